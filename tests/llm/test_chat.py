"""Chat templates: the exact ChatML string, think on/off, and the GGUF jinja template."""
from pathlib import Path

import pytest

from pipeline.errors import UserError
from pipeline.llm.chat import ChatTemplate, render_chatml, render_jinja
from pipeline.llm.gguf import GGUFFile

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
MSGS = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Capital of France?"}]


def test_chatml_exact_string_think_off():
    assert render_chatml(MSGS) == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nCapital of France?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_chatml_think_on_and_no_generation_prompt():
    assert render_chatml(MSGS[1:], think_off=False) == \
        "<|im_start|>user\nCapital of France?<|im_end|>\n<|im_start|>assistant\n"
    assert render_chatml(MSGS[1:], add_generation_prompt=False) == "<|im_start|>user\nCapital of France?<|im_end|>\n"


def test_gguf_jinja_template_matches_chatml():
    tpl = ChatTemplate.from_gguf(GGUFFile(FIXTURES / "qwen3-mini-f32.gguf"))
    assert tpl.jinja_source
    for think_off in (True, False):
        assert tpl.render(MSGS, think_off=think_off) == render_chatml(MSGS, think_off=think_off)
    assert ChatTemplate(None).render(MSGS) == render_chatml(MSGS)


def test_jinja_errors_are_named():
    with pytest.raises(UserError, match="cannot render"):
        render_jinja("{% for x in %}", MSGS, source="t.gguf: tokenizer.chat_template")
    with pytest.raises(UserError, match="refused the conversation: no system"):
        render_jinja("{{ raise_exception('no system') }}", MSGS)


def test_bad_messages():
    with pytest.raises(UserError, match="no messages"):
        render_chatml([])
    with pytest.raises(UserError, match="message 0"):
        render_chatml([{"role": "robot", "content": "x"}])
