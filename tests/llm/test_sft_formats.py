"""The four SFT data formats on the fixture model's own tokenizer and chat template (exact ids and label
masks), JSONL hardening (size limit before parsing, depth, types: file:line:field errors), the CLI's
one-line refusal, and property tests that mutated JSONL only ever raises UserError."""
import json
import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.errors import UserError
from pipeline.llm import data as sft
from pipeline.llm.chat import ChatTemplate
from pipeline.llm.gguf import open_gguf
from pipeline.llm.tokenizer import Tokenizer

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "qwen3-mini-q8_0.gguf"
IGN = sft.IGNORE_INDEX


@pytest.fixture(scope="module")
def model():
    gg = open_gguf(FIXTURE)
    tok = Tokenizer.from_gguf(gg)
    return tok, sft.RawEncoder(tok), ChatTemplate.from_gguf(gg)


def _write(tmp_path, lines, name="data.jsonl"):
    p = tmp_path / name
    p.write_text("".join((json.dumps(x) if not isinstance(x, str) else x) + "\n" for x in lines), encoding="utf-8")
    return p


def _expect(enc, segments):
    """(inputs, labels) of hand-written (text, supervised) segments, each tokenized on its own."""
    ids, sup = [], []
    for text, s in segments:
        part = enc.encode(text)
        ids += part
        sup += [s] * len(part)
    labels = np.where(np.asarray(sup[1:]), ids[1:], IGN)
    return ids[:-1], labels.tolist()


def _check(model, record, segments):
    tok, enc, tpl = model
    sample = sft.encode_all(enc, tpl, [record])[0]
    inputs, labels = _expect(enc, segments)
    assert sample.inputs.tolist() == inputs and sample.labels.tolist() == labels
    # the ids are llama.cpp's tokenization of the whole rendered conversation (no merge crosses a boundary)
    full = "".join(text for text, _ in segments)
    assert tpl.render(record.messages(), add_generation_prompt=False) == full
    assert sample.inputs.tolist() + [enc.encode(full)[-1]] == enc.encode(full)
    return sample


def test_instruction_format(model, tmp_path):
    p = _write(tmp_path, [{"q": "What is 2+2?", "a": "Four."}])
    [rec] = sft.load_jsonl(p, instruction_key="q", response_key="a")
    assert rec == sft.Pair("What is 2+2?", "Four.") and rec.where == f"{p}:1"
    _check(model, rec, [("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n", False),
                        ("Four.<|im_end|>", True), ("\n", False)])


def test_alpaca_format_with_and_without_input(model, tmp_path):
    p = _write(tmp_path, [{"instruction": "Summarize.", "input": "The fox jumps.", "output": "Fox jumps."},
                          {"instruction": "Say hi.", "input": "", "output": "Hi!"},
                          {"instruction": "Say bye.", "output": "Bye!"}])
    with_input, empty, missing = sft.load_jsonl(p)
    _check(model, with_input,
           [("<|im_start|>user\nSummarize.\n\nThe fox jumps.<|im_end|>\n<|im_start|>assistant\n", False),
            ("Fox jumps.<|im_end|>", True), ("\n", False)])
    for rec, instruction, output in ((empty, "Say hi.", "Hi!"), (missing, "Say bye.", "Bye!")):
        _check(model, rec, [(f"<|im_start|>user\n{instruction}<|im_end|>\n<|im_start|>assistant\n", False),
                            (f"{output}<|im_end|>", True), ("\n", False)])


MULTI_TURN = [{"role": "system", "content": "Be a pirate."}, {"role": "user", "content": "Hi"},
              {"role": "assistant", "content": "Ahoy!"}, {"role": "user", "content": "Bye"},
              {"role": "assistant", "content": "Fair winds."}]
MULTI_TURN_SEGMENTS = [
    ("<|im_start|>system\nBe a pirate.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", False),
    ("Ahoy!<|im_end|>", True),
    ("\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n", False),
    ("Fair winds.<|im_end|>", True), ("\n", False)]
# the committed fixture's vocabulary pins the ids themselves (380 <|im_start|>, 381 <|im_end|>, 198 "\n")
MULTI_TURN_IDS = [380, 82, 88, 82, 304, 198, 33, 68, 259, 220, 79, 72, 81, 274, 68, 13, 381, 198, 380, 84, 82, 256,
                  198, 39, 72, 381, 198, 380, 346, 82, 300, 278, 258, 198, 32, 71, 78, 88, 0, 381, 198, 380, 84, 82,
                  256, 198, 33, 88, 68, 381, 198, 380, 346, 82, 300, 278, 258, 198, 37, 64, 72, 81, 220, 86, 72, 265,
                  82, 13, 381, 198]
MULTI_TURN_SUPERVISED = list(range(34, 40)) + list(range(58, 69))  # positions of the ids the loss sees


def test_messages_format_multi_turn(model, tmp_path):
    [rec] = sft.load_jsonl(_write(tmp_path, [{"messages": MULTI_TURN}]))
    sample = _check(model, rec, MULTI_TURN_SEGMENTS)
    assert sample.inputs.tolist() == MULTI_TURN_IDS[:-1]
    assert [j + 1 for j in np.flatnonzero(sample.labels != IGN)] == MULTI_TURN_SUPERVISED
    assert [MULTI_TURN_IDS[j] for j in MULTI_TURN_SUPERVISED][-1] == 381  # each turn's <|im_end|> is learned
    assert rec.instruction == "Hi"


def test_sharegpt_format_maps_roles(model, tmp_path):
    from_value = {"system": "system", "user": "human", "assistant": "gpt"}
    turns = [{"from": from_value[m["role"]], "value": m["content"]} for m in MULTI_TURN]
    turns[3]["from"] = "user"  # user/assistant are accepted too
    [rec] = sft.load_jsonl(_write(tmp_path, [{"conversations": turns, "id": 7}]))
    assert rec.messages() == MULTI_TURN
    assert _check(model, rec, MULTI_TURN_SEGMENTS).inputs.tolist() == MULTI_TURN_IDS[:-1]


def test_forced_format_and_detection_per_file(tmp_path):
    # with input present, alpaca wins even when --response-key output would match the pair keys
    p = _write(tmp_path, [{"instruction": "I", "input": "X", "output": "O"}])
    assert sft.load_jsonl(p, response_key="output") == [sft.Pair("I\n\nX", "O")]
    assert sft.load_jsonl(p, response_key="output", format="instruction") == [sft.Pair("I", "O")]
    with pytest.raises(UserError, match=r"data.jsonl:1: field 'messages' must be a non-empty list.*missing"):
        sft.load_jsonl(p, format="messages")
    # the first record decides for the file: a later record of another format names its line and field
    p = _write(tmp_path, [{"messages": MULTI_TURN}, {"instruction": "I", "response": "R"}])
    with pytest.raises(UserError, match=r"data.jsonl:2: field 'messages' must be"):
        sft.load_jsonl(p)


@pytest.mark.parametrize("record,match", [
    ({"messages": "hi"}, r":1: field 'messages' must be a non-empty list of turns, got a str"),
    ({"messages": []}, r":1: field 'messages' must be a non-empty list of turns, got empty"),
    ({"messages": [{"role": "user", "content": "q"}, "a"]}, r":1: field 'messages\[1\]' must be an object"),
    ({"messages": [{"role": "user", "content": ["q"]}]}, r"field 'messages\[0\].content' must be a string, got list"),
    ({"messages": [{"role": "bot", "content": "q"}]}, r"field 'messages\[0\].role' is 'bot'; expected one of"),
    ({"messages": [{"content": "q"}]}, r"missing field 'messages\[0\].role'"),
    ({"messages": [{"role": "user", "content": "q"}]}, r"field 'messages' has no assistant turn"),
    ({"messages": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "q"}]},
     r"field 'messages\[0\]' is an assistant turn"),
    ({"messages": [{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}]}, r"has no user turn"),
    ({"conversations": [{"from": "tool", "value": "x"}]}, r"field 'conversations\[0\].from' is 'tool'"),
    ({"conversations": [{"from": "human", "value": 3}]}, r"field 'conversations\[0\].value' must be a string, got int"),
    ({"instruction": ["a"], "input": "", "output": "o"}, r"field 'instruction' must be a string, got list"),
    ({"instruction": "i", "input": None, "output": "o"}, r"field 'input' must be a string, got NoneType"),
    ({"instruction": "i", "response": {"text": "r"}}, r"field 'response' must be a string, got dict"),
])
def test_malformed_records_name_file_line_and_field(tmp_path, record, match):
    p = _write(tmp_path, ["", record])  # a blank first line: the record is line 2
    with pytest.raises(UserError, match=match.replace(":1:", ":2:")) as e:
        sft.load_jsonl(p)
    assert str(e.value).startswith(f"{p}:2: ")


def test_record_over_the_size_limit_is_refused_before_parsing(tmp_path):
    p = tmp_path / "data.jsonl"
    with open(p, "w") as f:
        f.write('{"instruction": "' + "x" * 5000 + '"')  # not even valid JSON: never parsed
    with pytest.raises(UserError, match=r"data.jsonl:1: the record is over 4096 bytes \(--max-record-bytes\)"):
        sft.load_jsonl(p, max_record_bytes=4096)
    # the limit is per line, its terminator not counted
    ok = '{"instruction": "a", "response": "b"}'
    p.write_text(ok + "\r\n" + ok + "\n")
    assert len(sft.load_jsonl(p, max_record_bytes=len(ok))) == 2
    with pytest.raises(UserError, match=r"data.jsonl:1: the record is over"):
        sft.load_jsonl(p, max_record_bytes=len(ok) - 1)


def test_a_huge_line_is_not_read_whole(tmp_path, monkeypatch):
    """The reader asks for at most limit + 2 bytes of a line, however long the line is."""
    p = tmp_path / "data.jsonl"
    p.write_bytes(b"[" * (8 << 20))
    sizes = []
    real_fdopen = os.fdopen  # the reader opens through pipeline.untrusted.open_regular (os.open + os.fdopen)

    class Spy:
        def __init__(self, f):
            self.f = f

        def readline(self, size=-1):
            sizes.append(size)
            return self.f.readline(size)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    monkeypatch.setattr(os, "fdopen", lambda *a, **k: Spy(real_fdopen(*a, **k)))
    with pytest.raises(UserError, match=":1: the record is over 1048576 bytes"):
        sft.load_jsonl(p)
    assert sizes == [sft.MAX_RECORD_BYTES + 2]


@pytest.mark.parametrize("raw,match", [
    (b'{"a": ' * 20 + b'1' + b'}' * 20, r":1: JSON nested deeper than 16 levels"),
    (b"[" * 100_000 + b"]" * 100_000, r":1: JSON nested deeper than 16 levels"),
    (b'{"instruction": "\xff", "response": "b"}', r":1: not UTF-8 text"),
    (b'{"instruction": 1' + b"1" * 5000 + b', "response": "b"}', r":1: malformed JSON \(Exceeds the limit"),
    (b'\xef\xbb\xbf{"instruction": "a", "response": "b"}\n"str"', r":2: expected a JSON object, got str"),
])
def test_depth_encoding_and_type_errors(tmp_path, raw, match):
    p = tmp_path / "data.jsonl"
    p.write_bytes(raw)
    with pytest.raises(UserError, match=match):
        sft.load_jsonl(p)


def test_cli_refuses_a_bad_record_in_one_line(tmp_path, capsys):
    from pipeline.cli import main
    p = _write(tmp_path, [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": 5}]}])
    for command in ("finetune", "es-finetune"):
        assert main([command, "--model", str(FIXTURE), "--data", str(p)]) != 0
        err = capsys.readouterr().err
        assert f"{p}:1: field 'messages[1].content' must be a string, got int" in err
        assert "Traceback" not in err and err.strip().count("\n") == 0


def test_cli_trains_on_messages_data(tmp_path):
    """A multi-turn messages file through `fucina finetune` (two steps: the data path, not convergence)."""
    from pipeline.cli import main
    p = _write(tmp_path, [{"messages": MULTI_TURN}, {"messages": MULTI_TURN[1:3]}])
    out = tmp_path / "ft"
    assert main(["finetune", "--model", str(FIXTURE), "--data", str(p), "--format", "messages", "--steps", "2",
                 "--accum-steps", "2", "--max-new-tokens", "2", "--save", str(out), "--json"]) == 0
    assert (out / "trainer_state.json").is_file()


def _pirate_in(fmt):
    for p in sft.PIRATE_PAIRS:
        chat = [{"role": "user", "content": p.instruction}, {"role": "assistant", "content": p.response}]
        yield {"instruction": {"instruction": p.instruction, "response": p.response},
               "alpaca": {"instruction": p.instruction, "input": "", "output": p.response},
               "messages": {"messages": chat},
               "sharegpt": {"conversations": [{"from": {"user": "human", "assistant": "gpt"}[m["role"]],
                                               "value": m["content"]} for m in chat]}}[fmt]


def test_the_pirate_set_in_every_format_trains_the_same_bits(tmp_path, capsys):
    """The same conversations in four formats are the same samples, so `fucina finetune` ends with the same
    adapters as on the built-in set."""
    from pipeline.cli import main
    base = ["finetune", "--model", str(FIXTURE), "--steps", "1", "--max-new-tokens", "1", "--json"]  # 5 samples
    assert main(base + ["--save", str(tmp_path / "builtin")]) == 0
    reference = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["adapters_sha256"]
    for fmt in sft.FORMATS:
        data = _write(tmp_path, list(_pirate_in(fmt)), name=f"pirate-{fmt}.jsonl")
        assert main(base + ["--data", str(data), "--save", str(tmp_path / fmt)]) == 0
        assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["adapters_sha256"] == reference, fmt


# --- property tests: mutated JSONL gives records or UserError, never another exception ------------------
SEEDS = [b'{"instruction": "a", "response": "b"}',
         b'{"instruction": "i", "input": "x", "output": "o"}',
         json.dumps({"messages": MULTI_TURN}).encode(),
         json.dumps({"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}).encode()]
JSON_BYTES = list(b'{}[]",:\\ \n0123456789.-+eEtrufalsn') + [0xFF, 0xC3, 0x80, 0xEF, 0xBB, 0xBF]


@st.composite
def mutated_jsonl(draw):
    lines = []
    for _ in range(draw(st.integers(1, 3))):
        line = bytearray(draw(st.sampled_from(SEEDS)))
        for _ in range(draw(st.integers(0, 6))):
            op, at = draw(st.integers(0, 2)), draw(st.integers(0, len(line)))
            byte = draw(st.sampled_from(JSON_BYTES))
            if op == 0:
                line[at:at] = bytes([byte]) * draw(st.integers(1, 40))
            elif op == 1 and line:
                del line[at: at + draw(st.integers(1, 8))]
            elif line:
                line[min(at, len(line) - 1)] = byte
        lines.append(bytes(line))
    return b"\n".join(lines)


def _only_user_errors(tmp_path, raw, fmt):
    p = tmp_path / "fuzz.jsonl"
    p.write_bytes(raw)
    try:
        records = sft.load_jsonl(p, format=fmt, max_record_bytes=512)
    except UserError as e:
        assert str(e).startswith(str(p))
        return
    assert records and all(isinstance(r, (sft.Pair, sft.Conversation)) for r in records)
    for r in records:  # what loads renders through a ChatML template without error
        sft.conversation_segments(ChatTemplate(None, stop_texts={"<|im_end|>"}), r.messages())


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=mutated_jsonl(), fmt=st.sampled_from(("auto",) + sft.FORMATS))
def test_mutated_jsonl_only_raises_user_error(tmp_path, raw, fmt):
    _only_user_errors(tmp_path, raw, fmt)


@pytest.mark.slow
@settings(max_examples=5000, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=mutated_jsonl() | st.binary(max_size=2048), fmt=st.sampled_from(("auto",) + sft.FORMATS))
def test_mutated_jsonl_only_raises_user_error_long(tmp_path, raw, fmt):
    _only_user_errors(tmp_path, raw, fmt)


# A template in the style of Qwen3's: earlier assistant turns are rendered without their reasoning block, the
# turn after the last user message with it (empty here), and enable_thinking=false pre-fills an empty one.
HISTORY_REWRITING = (
    "{%- set ns = namespace(last_user=0) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and loop.index0 > ns.last_user %}"
    "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}")


def test_a_template_that_rewrites_earlier_turns(model):
    """Spans are located in the rendering of the WHOLE conversation: turn 1 as the history shows it, the
    last turn with the reasoning block the template gives it."""
    tok, enc, fixture_template = model
    tpl = ChatTemplate(HISTORY_REWRITING, stop_ids=fixture_template.stop_ids, stop_texts=fixture_template.stop_texts)
    assert [(t, s) for t, s in sft.conversation_segments(tpl, MULTI_TURN) if s] == [
        ("Ahoy!<|im_end|>", True), ("<think>\n\n</think>\n\nFair winds.<|im_end|>", True)]
    sample = sft.encode_conversation(enc, tpl, MULTI_TURN)
    full = enc.encode(tpl.render(MULTI_TURN, add_generation_prompt=False))
    assert sample.inputs.tolist() == full[:-1]
    # enable_thinking=False pre-fills a block the history of turn 1 does not have: refused, not mis-masked
    with pytest.raises(UserError, match="renders the prompt of message 2 differently"):
        sft.encode_conversation(enc, tpl, MULTI_TURN, sft.EncodeOptions(enable_thinking=False), where="d:1")
    # ... while a single exchange is consistent with it
    single = sft.encode_conversation(enc, tpl, MULTI_TURN[1:3], sft.EncodeOptions(enable_thinking=False))
    assert single.n_valid == len(enc.encode("Ahoy!<|im_end|>"))


def test_sentencepiece_segments_continue_one_text_without_extra_space_prefix():
    """SentencePiece adds a space prefix at the start of an encode call (and after special tokens); a
    conversation's later segments continue one rendered text, so they must not get one: the ids equal the
    tokenization of the whole rendering, as llama.cpp tokenizes it."""
    from pipeline.llm.tokenizer import Tokenizer
    gg = open_gguf(Path(__file__).resolve().parent.parent / "fixtures" / "tokenizers" / "spm-tiny.gguf")
    tok = Tokenizer.from_gguf(gg)
    assert tok.add_space_prefix  # the premise: a plain encode of " yo" would start with an extra "▁"
    llama2_style = ("{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
                    "{% else %} {{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}")
    tpl = ChatTemplate(llama2_style, eos_token="</s>", stop_ids={tok.eos_id}, stop_texts={"</s>"})
    messages = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "a tiny answer"}]
    sample = sft.encode_conversation(sft.RawEncoder(tok), tpl, messages)
    whole = tok.encode(tpl.render(messages, add_generation_prompt=False), add_bos=False)
    assert list(sample.inputs) + [int(sample.labels[-1])] == whole
    assert int(sample.labels[-1]) == tok.eos_id  # the end-of-turn token is supervised
