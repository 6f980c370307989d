"""Chat templates: ChatML for Qwen3 (built in) and the GGUF's own jinja template.

Trade-off: the built-in ChatML renderer is a few lines of string building whose
output is pinned by a test, so the default never depends on a template
interpreter; a GGUF's `tokenizer.chat_template` is honoured when asked for
(jinja2, sandboxed, with the HF conventions: trim_blocks, lstrip_blocks,
raise_exception, add_generation_prompt, enable_thinking). Qwen3's reasoning
channel is suppressed by default (`think_off`) by pre-filling an empty
<think></think> block in the assistant turn, exactly as Qwen3's own template
does with enable_thinking=False.
"""
from __future__ import annotations

from ..errors import UserError

EMPTY_THINK = "<think>\n\n</think>\n\n"
ROLES = ("system", "user", "assistant")


def _check(messages):
    if not messages:
        raise UserError("chat: no messages to render")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise UserError(f"chat: message {i} must be {{'role': one of {ROLES}, 'content': str}}, got {m!r}")


def render_chatml(messages, *, add_generation_prompt: bool = True, think_off: bool = True) -> str:
    """<|im_start|>role\\ncontent<|im_end|>\\n per message, then the assistant prefix."""
    _check(messages)
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    if add_generation_prompt:
        text += "<|im_start|>assistant\n" + (EMPTY_THINK if think_off else "")
    return text


def render_jinja(template: str, messages, *, add_generation_prompt: bool = True, think_off: bool = True,
                 source: str = "chat template", **extra) -> str:
    """Render a HF-style jinja chat template (as stored in tokenizer.chat_template)."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    _check(messages)

    def raise_exception(msg):
        raise UserError(f"{source}: the template refused the conversation: {msg}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                enable_thinking=not think_off, **extra)
    except jinja2.TemplateError as e:
        raise UserError(f"{source}: cannot render the jinja chat template ({type(e).__name__}: {e})") from None


class ChatTemplate:
    """Renders a conversation for one model: the GGUF's template when present (use_gguf), else ChatML."""

    def __init__(self, jinja_source: str | None = None, *, source: str = "chat template"):
        self.jinja_source, self.source = jinja_source, source

    @classmethod
    def from_gguf(cls, gg, use_gguf: bool = True) -> "ChatTemplate":
        tpl = gg.get("tokenizer.chat_template") if use_gguf else None
        return cls(tpl, source=f"{gg.path}: tokenizer.chat_template")

    def render(self, messages, *, add_generation_prompt: bool = True, think_off: bool = True) -> str:
        if self.jinja_source:
            return render_jinja(self.jinja_source, messages, add_generation_prompt=add_generation_prompt,
                                think_off=think_off, source=self.source)
        return render_chatml(messages, add_generation_prompt=add_generation_prompt, think_off=think_off)

    @property
    def stop_text(self) -> str:
        return "<|im_end|>"
