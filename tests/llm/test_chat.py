"""Chat templates: the exact ChatML string, the GGUF jinja template as llama.cpp renders it, the thinking
switch, bos/eos texts, and llama.cpp's end-of-generation set."""
from pathlib import Path

import pytest

from pipeline.errors import UserError
from pipeline.llm.chat import ChatTemplate, end_of_generation_ids, render_chatml
from pipeline.llm.gguf import GGUFFile

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
MSGS = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Capital of France?"}]
CHATML = ("<|im_start|>system\nYou are terse.<|im_end|>\n"
          "<|im_start|>user\nCapital of France?<|im_end|>\n")


def test_chatml_exact_string():
    assert render_chatml(MSGS) == CHATML + "<|im_start|>assistant\n"
    assert render_chatml(MSGS, add_generation_prompt=False) == CHATML


def test_gguf_template_default_has_no_think_block_like_llama_cpp():
    """llama-cpp-python passes no enable_thinking: a Qwen3-style template renders its default."""
    tpl = ChatTemplate.from_gguf(GGUFFile(FIXTURES / "qwen3-mini-f32.gguf"))
    assert tpl.jinja_source and tpl.has_thinking_switch
    assert tpl.render(MSGS) == CHATML + "<|im_start|>assistant\n"
    assert tpl.render(MSGS, enable_thinking=True) == CHATML + "<|im_start|>assistant\n"
    assert tpl.render(MSGS, enable_thinking=False) == CHATML + "<|im_start|>assistant\n<think>\n\n</think>\n\n"


def test_thinking_switch_refused_where_the_template_has_none():
    with pytest.raises(UserError, match="no thinking switch"):
        ChatTemplate(None).render(MSGS, enable_thinking=False)
    plain = ChatTemplate("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert not plain.has_thinking_switch and plain.render(MSGS) == "You are terse.Capital of France?"
    with pytest.raises(UserError, match="no thinking switch"):
        plain.render(MSGS, enable_thinking=True)


def test_template_context_matches_llama_cpp_python():
    """bos_token/eos_token texts, raise_exception, tojson without HTML escaping, {% generation %}, loop controls."""
    tpl = ChatTemplate("{{ bos_token }}{% for m in messages %}{% if loop.first %}{% continue %}{% endif %}"
                       "{% generation %}{{ m['content'] | tojson }}{% endgeneration %}{% endfor %}{{ eos_token }}"
                       "{{ 'G' if add_generation_prompt }}", bos_token="<s>", eos_token="</s>")
    assert tpl.render(MSGS + [{"role": "user", "content": "<&>"}]) == '<s>"Capital of France?""<&>"</s>G'
    assert tpl.render(MSGS, add_generation_prompt=False).endswith("</s>")


def test_jinja_errors_are_named():
    with pytest.raises(UserError, match="t.gguf: tokenizer.chat_template: cannot parse"):
        ChatTemplate("{% for x in %}", source="t.gguf: tokenizer.chat_template").render(MSGS)
    with pytest.raises(UserError, match="refused the conversation: no system"):
        ChatTemplate("{{ raise_exception('no system') }}").render(MSGS)
    with pytest.raises(UserError, match=r"cannot render .*ZeroDivisionError"):
        ChatTemplate("{{ 1 // 0 }}").render(MSGS)
    with pytest.raises(UserError, match="cannot render"):  # the sandbox refuses attribute games
        ChatTemplate("{{ ''.__class__.__mro__ }}").render(MSGS)


def test_bad_messages():
    with pytest.raises(UserError, match="no messages"):
        render_chatml([])
    with pytest.raises(UserError, match="message 0"):
        render_chatml([{"role": "robot", "content": "x"}])
    with pytest.raises(UserError, match="message 1"):
        ChatTemplate(None).render([MSGS[0], {"role": "user", "content": ["a list"]}])


def test_end_of_generation_ids_follow_llama_cpp_rules():
    tokens = ["a", "<|im_end|>", "<|endoftext|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<|im_start|>",
              "</s>", "b"]
    assert end_of_generation_ids({"tokenizer.ggml.tokens": tokens}) == {1, 2, 3, 4, 5, 7}
    # metadata ids join the set; a FIM id named in the metadata replaces the text search for that kind
    md = {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.eos_token_id": 8, "tokenizer.ggml.eot_token_id": 0,
          "tokenizer.ggml.fim_pad_token_id": 6, "tokenizer.ggml.eom_token_id": 99}
    assert end_of_generation_ids(md) == {0, 1, 2, 4, 5, 6, 7, 8}


def test_from_gguf_reads_token_texts_and_stops():
    tpl = ChatTemplate.from_gguf(GGUFFile(FIXTURES / "qwen3-mini-f32.gguf"))
    assert (tpl.bos_token, tpl.eos_token) == ("<|endoftext|>", "<|im_end|>")
    assert tpl.stop_texts == {"<|endoftext|>", "<|im_end|>"} and len(tpl.stop_ids) == 2


# --- the render budget: hostile templates end in one UserError, in bounded time and memory ---------------
HOSTILE_TEMPLATES = {
    "nested range loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "content * 10**7": "{{ messages[0]['content'] * 10000000 }}",
    "10**7 * content": "{{ 10000000 * messages[0]['content'] }}",
    "doubling by ~": "{% set ns = namespace(x=messages[0]['content']) %}{% for i in range(60) %}"
                     "{% set ns.x = ns.x ~ ns.x %}{% endfor %}",
    "doubling by +": "{% set ns = namespace(x=messages[0]['content']) %}{% for i in range(60) %}"
                     "{% set ns.x = ns.x + ns.x %}{% endfor %}",
    "str.ljust width": "{{ 'x'.ljust(10**10) }}",
    "center filter width": "{{ 'x'|center(10**10) }}",
    "map to a width": "{{ ['a']|map('center', 10**10)|list }}",
    "huge power": "{{ 7 ** 100000000 }}",
    "printf width": "{{ '%10000000000s' % 'a' }}",
    "format width": "{{ '{:>10000000000}'.format(1) }}",
    "format width argument": "{{ '{:>{}}'.format(1, 10**10) }}",
    "replace growth": "{{ (messages[0]['content'] * 1000000)|replace('e', 'x' * 100) }}",
    "join separator": "{{ (range(100000)|list)|join(messages[0]['content'] * 1000) }}",
    "indent width": "{{ ('a\n' * 100000)|indent(100000) }}",
    "lipsum": "{{ lipsum(10**7) }}",
    "endless output": "{% for i in range(100000) %}{% for j in range(100000) %}{{ messages[0]['content'] }}"
                      "{% endfor %}{% endfor %}",
}


@pytest.mark.parametrize("name", sorted(HOSTILE_TEMPLATES))
def test_a_hostile_template_is_one_user_error(name):
    tpl = ChatTemplate(HOSTILE_TEMPLATES[name], source="hostile.jinja")
    tpl.render_seconds = 0.5  # the default is 5 s; the loops here would run for hours
    with pytest.raises(UserError, match=r"^hostile.jinja: the jinja chat template (is refused: .*over|did not "
                                        r"finish rendering within 0.5 s)"):
        tpl.render(MSGS)


def test_the_budget_leaves_ordinary_templates_alone_and_is_reset_after_a_refusal():
    ok = ("{% for m in messages %}{{ '%-6s' % m['role'] }}{{ m['content']|center(20) }}{{ [1, 2]|join(', ') }}"
          "{{ '{:>3}'.format(7) }}{{ 'a' ~ 'b' }}{{ ('x' * 3) + 'y' }}{{ 2 ** 10 }}{% endfor %}")
    tpl = ChatTemplate(ok)
    want = tpl.render(MSGS)
    assert want == "".join(f"{m['role']:<6}{m['content'].center(20)}1, 2  7abxxxy1024" for m in MSGS)
    with pytest.raises(UserError, match="the rendering is over 60 characters"):
        tpl.render(MSGS, max_chars=60)
    assert tpl.render(MSGS) == want   # the per-render limit did not stick


def test_the_context_bound_is_checked_before_tokenizing(tmp_path, monkeypatch):
    """A rendering longer than context x the longest token's characters cannot fit: refused while rendering,
    never tokenized; a plain prompt is checked the same way."""
    from pipeline.llm.generate import LoadedModel
    from pipeline.llm.tokenizer import Tokenizer
    template = tmp_path / "grow.jinja"
    template.write_text("{% for i in range(100000) %}{{ messages[0]['content'] }}{% endfor %}")
    model = LoadedModel(FIXTURES / "qwen3-mini-f32.gguf", chat_template=str(template))
    tok, n_ctx = model.require_tokenizer(), model.model.config.context_length
    monkeypatch.setattr(Tokenizer, "encode", lambda *a, **k: pytest.fail("tokenized"))
    with pytest.raises(UserError, match=rf"over {n_ctx * tok.max_token_chars:,} characters \(the model's context "
                                        rf"of {n_ctx} tokens"):
        model.encode_chat([{"role": "user", "content": "x" * 1000}])
    with pytest.raises(UserError, match="refused before tokenizing"):
        model.encode_prompt("y" * (n_ctx * tok.max_token_chars + 1))


def test_the_watchdog_interrupts_only_the_late_rendering():
    """The timeout lands in the thread whose rendering is late, never in another one nor after it returned."""
    import threading
    import time
    slow = ChatTemplate(HOSTILE_TEMPLATES["nested range loops"], source="slow.jinja")
    slow.render_seconds = 0.3
    ok = ChatTemplate("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    seen = []

    def steady():
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            seen.append(ok.render(MSGS))

    other = threading.Thread(target=steady)
    other.start()
    for _ in range(2):
        with pytest.raises(UserError, match="within 0.3 s"):
            slow.render(MSGS)
    other.join()
    time.sleep(0.4)  # past any deadline that could still be pending
    assert seen and set(seen) == {"You are terse.Capital of France?"}
