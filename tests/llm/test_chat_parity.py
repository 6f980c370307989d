"""Chat prompts, SFT conversations and stop tokens against llama.cpp (llama-cpp-python as the oracle).

- the prompt ids `fucina generate --chat` / `fucina chat` build equal the ids llama-cpp-python's
  create_chat_completion hands to its completion (captured at that call), single- and multi-turn;
- the rendering equals its Jinja2ChatFormatter's for other templates (its own ChatML, Llama 3 with
  bos_token, Mistral's raise_exception) and for the explicit thinking switch;
- an SFT conversation's ids equal llama.cpp's tokenization of the formatter's rendering of it;
- our end-of-generation set is llama.cpp's (llama_vocab_is_eog over the whole vocabulary);
- the greedy answers of `fucina generate --chat` and `fucina chat` are create_chat_completion's at
  temperature 0, on an F32 model whose greedy continuations match llama.cpp's exactly.
"""
import io
from pathlib import Path

import pytest

from pipeline.llm import data as sft
from pipeline.llm.chat import ChatTemplate
from pipeline.llm.generate import LoadedModel
from test_parity_llama import llama, mk

pytestmark = [pytest.mark.parity, pytest.mark.needs("llama_cpp")]

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
F32 = FIXTURES / "qwen3-mini-f32.gguf"
SINGLE = [{"role": "user", "content": "What is the capital of France?"}]
MULTI = [{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Hi there"},
         {"role": "assistant", "content": "Ahoy, matey!"}, {"role": "user", "content": "Where be the treasure?"}]


class Captured(Exception):
    pass


def oracle_chat_prompt(llm, messages):
    """The prompt ids create_chat_completion passes on to the completion."""
    def capture(prompt, **_):
        raise Captured(prompt)

    llm.create_completion = capture
    with pytest.raises(Captured) as got:
        llm.create_chat_completion(messages=messages)
    return list(got.value.args[0])


@pytest.fixture(scope="module")
def vocab_only():
    import llama_cpp
    return {name: llama_cpp.Llama(model_path=str(FIXTURES / name), vocab_only=True, verbose=False)
            for name in ("qwen3-mini-f32.gguf", "qwen3-tied-q4_k_s.gguf")}


@pytest.mark.parametrize("name", ["qwen3-mini-f32.gguf", "qwen3-tied-q4_k_s.gguf"])
@pytest.mark.parametrize("messages", [SINGLE, MULTI], ids=["single", "multi"])
def test_chat_prompt_ids_are_create_chat_completions(vocab_only, name, messages):
    lm = LoadedModel(FIXTURES / name)
    assert lm.encode_chat(messages) == oracle_chat_prompt(vocab_only[name], messages)
    if messages is SINGLE:
        assert lm.encode_prompt(messages[0]["content"], chat=True) == oracle_chat_prompt(vocab_only[name], messages)


def _formatter(template, bos="<|endoftext|>", eos="<|im_end|>", generation=True):
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter
    return Jinja2ChatFormatter(template=template, bos_token=bos, eos_token=eos, add_generation_prompt=generation)


@pytest.mark.parametrize("template_name", ["CHATML_CHAT_TEMPLATE", "LLAMA3_INSTRUCT_CHAT_TEMPLATE",
                                           "MISTRAL_INSTRUCT_CHAT_TEMPLATE"])
def test_rendering_equals_jinja2_chat_formatter(template_name):
    from llama_cpp import llama_chat_format
    source = getattr(llama_chat_format, template_name)
    ours = ChatTemplate(source, bos_token="<|endoftext|>", eos_token="<|im_end|>")
    alternating = [m for m in MULTI if m["role"] != "system"]
    for messages in (SINGLE, alternating, alternating + [{"role": "assistant", "content": "Arr."}]):
        for generation in (True, False):
            theirs = _formatter(source, generation=generation)(messages=messages).prompt
            assert ours.render(messages, add_generation_prompt=generation) == theirs
    if "MISTRAL" in template_name:  # both refuse what the template refuses
        from pipeline.errors import UserError
        with pytest.raises(ValueError, match="alternate"):
            _formatter(source)(messages=MULTI[1:2] * 2)
        with pytest.raises(UserError, match="alternate"):
            ours.render(MULTI[1:2] * 2)


@pytest.mark.parametrize("enable_thinking", [True, False])
def test_thinking_switch_equals_the_formatter_given_enable_thinking(vocab_only, enable_thinking):
    lm = LoadedModel(F32)
    theirs = _formatter(lm.template.jinja_source)(messages=SINGLE, enable_thinking=enable_thinking).prompt
    assert lm.template.render(SINGLE, enable_thinking=enable_thinking) == theirs
    oracle = vocab_only["qwen3-mini-f32.gguf"]
    assert lm.encode_chat(SINGLE, enable_thinking) == oracle.tokenize(theirs.encode(), add_bos=False, special=True)


def test_sft_conversation_ids_are_llama_cpps_tokenization(vocab_only):
    lm = LoadedModel(F32)
    oracle = vocab_only["qwen3-mini-f32.gguf"]
    chat = MULTI + [{"role": "assistant", "content": "Under the palm, arr!"}]
    for messages in (chat, chat[1:3], [chat[1], {"role": "assistant", "content": " spaced  reply\n"}]):
        text = _formatter(lm.template.jinja_source, generation=False)(messages=messages).prompt
        sample = sft.encode_conversation(sft.RawEncoder(lm.tokenizer), lm.template, messages)
        theirs = oracle.tokenize(text.encode(), add_bos=False, special=True)
        assert sample.inputs.tolist() == theirs[:-1]
        prefix = oracle.tokenize(_formatter(lm.template.jinja_source)(messages=messages[:-1]).prompt.encode(),
                                 add_bos=False, special=True)
        assert theirs[:len(prefix)] == prefix and (sample.labels[len(prefix) - 1:-1] == theirs[len(prefix):-1]).all()


@pytest.mark.parametrize("name", ["qwen3-mini-f32.gguf", "qwen3-tied-q4_k_s.gguf"])
def test_stop_ids_are_llama_cpps_end_of_generation_set(vocab_only, name):
    import llama_cpp
    oracle = vocab_only[name]
    eog = {i for i in range(oracle.n_vocab()) if llama_cpp.llama_vocab_is_eog(oracle._model.vocab, i)}
    assert set(LoadedModel(FIXTURES / name).stop_ids()) == eog and len(eog) >= 2


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    """(path, oracle) of the untied parity shape in F32: its random weights answer prompt-dependent text
    (the mini fixture answers newlines to everything), and its greedy runs match llama.cpp's."""
    shape = mk.SHAPES["untied"]
    path = mk.write_gguf(tmp_path_factory.mktemp("chat") / "untied-F32.gguf", shape, dtype="F32",
                         weights=mk.make_weights(shape, seed=11), vocab=mk.train_vocab(shape.vocab))
    return path, llama(path, quantized=False)


def _oracle_answer(llm, messages, n):
    """(text, first n token ids) of create_chat_completion at temperature 0. The ids are recorded from its
    generator (the text alone drops invalid UTF-8, which these random models emit); it may draw a token or
    two past max_tokens to complete a UTF-8 character, which the first n ids leave out."""
    ids, real_generate = [], llm.generate

    def spy(*args, **kwargs):
        for token in real_generate(*args, **kwargs):
            ids.append(int(token))
            yield token

    llm.generate = spy
    try:
        out = llm.create_chat_completion(messages=messages, temperature=0.0, max_tokens=n, repeat_penalty=1.0)
    finally:
        del llm.generate
    text = out["choices"][0]["message"]["content"]
    assert llm.detokenize(ids).decode("utf-8", errors="ignore") == text  # the spy saw the answer
    return text, ids[:n]


def _printed(lm, ids):
    """What fucina's streaming decoder prints for these ids."""
    stream = lm.tokenizer.stream()
    return "".join(stream.push(i) for i in ids) + stream.flush()


@pytest.mark.parametrize("messages", [SINGLE, MULTI[:2]], ids=["user", "system+user"])
def test_generate_chat_answers_like_create_chat_completion(untied, capsys, messages):
    from pipeline.cli import main
    from pipeline.llm.generate import generate
    path, oracle = untied
    lm = LoadedModel(path)
    theirs, their_ids = _oracle_answer(oracle, messages, 24)
    assert list(generate(lm.model, lm.encode_chat(messages), 24, stop_ids=lm.stop_ids())) == their_ids
    argv = ["generate", "--model", str(path), "--chat", "--prompt", messages[-1]["content"], "--max-tokens", "24"]
    if messages[0]["role"] == "system":
        argv += ["--system", messages[0]["content"]]
    assert main(argv) == 0
    assert capsys.readouterr().out == _printed(lm, their_ids) + "\n" and theirs.strip()
    # the empty think block fucina used to add changes the answer: this comparison can fail
    assert main(argv + ["--no-think"]) == 0
    assert capsys.readouterr().out != _printed(lm, their_ids) + "\n"


def test_chat_answers_two_turns_like_create_chat_completion(untied):
    import argparse
    from pipeline.commands import chat
    path, oracle = untied
    lm = LoadedModel(path)
    args = argparse.Namespace(model=str(path), max_tokens=16, temperature=0.0, top_k=0, top_p=1.0, seed=0,
                              think=None, system=None, threads=1, blas_threads=1)
    out = io.StringIO()
    assert chat.run(args, stdin=io.StringIO("Hi there\nWhere be the treasure?\n/exit\n"), stdout=out) == 0
    history = [{"role": "user", "content": "Hi there"}]
    _, first_ids = _oracle_answer(oracle, history, 16)
    # fucina's history holds its decoded reply; llama.cpp is given the same text
    history += [{"role": "assistant", "content": lm.tokenizer.decode(first_ids)},
                {"role": "user", "content": "Where be the treasure?"}]
    _, second_ids = _oracle_answer(oracle, history, 16)
    assert out.getvalue() == _printed(lm, first_ids) + "\n" + _printed(lm, second_ids) + "\n"
