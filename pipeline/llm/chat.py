"""Chat templates and stop tokens, rendered the way llama.cpp's standard chat path renders them.

Parity target: llama-cpp-python's `create_chat_completion`, whose Jinja2ChatFormatter
renders the GGUF's `tokenizer.chat_template` in a sandboxed jinja2 environment
(trim_blocks, lstrip_blocks, loop controls, `{% generation %}` passed through,
json.dumps as `tojson`) with exactly `messages`, `bos_token`, `eos_token` (the
token texts), `add_generation_prompt`, `raise_exception` and `strftime_now`; the
text is then tokenized with special tokens parsed and NO BOS added (a template
that wants BOS writes `{{ bos_token }}`). `enable_thinking` is not passed there,
so a Qwen3 template renders its default (thinking on: no empty think block);
`enable_thinking=True/False` is the explicit switch, refused for a template that
has no such variable. A GGUF without a template gets ChatML, llama-server's
fallback. Trade-off: `strftime_now` makes date-printing templates (Llama 3.x)
render today's date, in llama.cpp and here alike.

Stop tokens: llama.cpp stops generation on its end-of-generation (EOG) set, built
by its vocab loader from the GGUF: eos/eot/eom and FIM pad/repo/sep ids from the
metadata, plus every token whose text is one of a fixed list (<|im_end|>,
<|endoftext|>, <|eot_id|>, ...). `end_of_generation_ids` rebuilds that set
(llama.cpp as vendored by llama-cpp-python 0.3.36; the gpt-oss/solar `<|end|>`
exception is not reproduced: no model we read has those tokens).
"""
from __future__ import annotations

import json
from datetime import datetime
from functools import cached_property

from ..errors import UserError

ROLES = ("system", "user", "assistant")

# Token texts llama.cpp's vocab loader (llama-vocab.cpp) marks as end-of-generation.
EOG_TEXTS = frozenset((
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
    "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>", "[e~[",
))
# ... and the FIM tokens it recognises by text when the metadata does not name them (all are EOG).
FIM_TEXTS = {
    "tokenizer.ggml.fim_pad_token_id": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "tokenizer.ggml.fim_rep_token_id": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "tokenizer.ggml.fim_sep_token_id": ("<|file_sep|>",),
}
EOG_ID_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


def end_of_generation_ids(metadata) -> frozenset[int]:
    """llama.cpp's EOG token set of a GGUF (metadata: the GGUF's key -> value map)."""
    tokens = metadata.get("tokenizer.ggml.tokens") or []
    ids = {i for i, text in enumerate(tokens) if text in EOG_TEXTS}
    for key, texts in FIM_TEXTS.items():
        if metadata.get(key) is None:
            ids.update(i for i, text in enumerate(tokens) if text in texts)
    for key in (*EOG_ID_KEYS, *FIM_TEXTS):
        value = metadata.get(key)
        if isinstance(value, int) and 0 <= value < len(tokens):
            ids.add(value)
    return frozenset(ids)


def check_messages(messages, where="chat"):
    """Every message is {'role': system|user|assistant, 'content': str}; raises UserError naming the first bad one."""
    if not messages:
        raise UserError(f"{where}: no messages to render")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise UserError(f"{where}: message {i} must be {{'role': one of {ROLES}, 'content': str}}, got {m!r}")


def render_chatml(messages, *, add_generation_prompt: bool = True) -> str:
    """<|im_start|>role\\ncontent<|im_end|>\\n per message, then the assistant prefix (llama-server's fallback)."""
    check_messages(messages)
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment():
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class PassGenerationTags(jinja2.ext.Extension):
        """HF's `{% generation %}...{% endgeneration %}` marks assistant text; it renders as its body."""
        tags = {"generation"}

        def parse(self, parser):
            parser.stream.skip(1)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[PassGenerationTags, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    return env


class ChatTemplate:
    """One model's conversation renderer: its GGUF jinja template (else ChatML), BOS/EOS texts and EOG ids."""

    def __init__(self, jinja_source: str | None = None, *, bos_token: str = "", eos_token: str = "",
                 stop_ids=frozenset(), stop_texts=frozenset(), source: str = "chat template"):
        self.jinja_source, self.source = jinja_source, source
        self.bos_token, self.eos_token = bos_token, eos_token
        self.stop_ids = frozenset(stop_ids)      # generation stops on these ids (llama.cpp's EOG set)
        self.stop_texts = frozenset(stop_texts)  # their texts: an assistant turn ends at the first one
        self._compiled = None

    @classmethod
    def from_gguf(cls, gg) -> "ChatTemplate":
        md = gg.metadata
        tokens = md.get("tokenizer.ggml.tokens") or []

        def text_of(key):
            i = md.get(key)
            return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else ""

        stop_ids = end_of_generation_ids(md)
        template = md.get("tokenizer.chat_template")
        if template is not None and not isinstance(template, str):
            raise UserError(f"{gg.path}: tokenizer.chat_template must be a string, got {type(template).__name__}")
        return cls(template, bos_token=text_of("tokenizer.ggml.bos_token_id"),
                   eos_token=text_of("tokenizer.ggml.eos_token_id"), stop_ids=stop_ids,
                   stop_texts={tokens[i] for i in stop_ids}, source=f"{gg.path}: tokenizer.chat_template")

    def _template(self):
        import jinja2
        if self._compiled is None:
            try:
                self._compiled = _environment().from_string(self.jinja_source)
            except jinja2.TemplateError as e:
                raise UserError(f"{self.source}: cannot parse the jinja chat template "
                                f"({type(e).__name__}: {e})") from None
        return self._compiled

    @cached_property
    def has_thinking_switch(self) -> bool:
        """Whether the template reads `enable_thinking` (Qwen3's reasoning on/off)."""
        if not self.jinja_source:
            return False
        from jinja2 import meta
        self._template()  # a template that does not parse is a named UserError here
        return "enable_thinking" in meta.find_undeclared_variables(_environment().parse(self.jinja_source))

    def render(self, messages, *, add_generation_prompt: bool = True, enable_thinking: bool | None = None) -> str:
        """The conversation as text; enable_thinking None leaves the template's default (llama.cpp's)."""
        check_messages(messages)
        if enable_thinking is not None and not self.has_thinking_switch:
            raise UserError(f"{self.source}: this chat template has no thinking switch (enable_thinking); "
                            "drop --think/--no-think")
        if not self.jinja_source:
            return render_chatml(messages, add_generation_prompt=add_generation_prompt)

        def raise_exception(msg):
            raise UserError(f"{self.source}: the template refused the conversation: {msg}")

        extra = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
        try:
            return self._template().render(
                messages=messages, bos_token=self.bos_token, eos_token=self.eos_token,
                add_generation_prompt=add_generation_prompt, raise_exception=raise_exception,
                functions=None, function_call=None, tools=None, tool_choice=None,
                strftime_now=lambda fmt: datetime.now().strftime(fmt), **extra)
        except UserError:
            raise
        except Exception as e:  # the template is data from the file: whatever it trips on is the file's fault
            raise UserError(f"{self.source}: cannot render the jinja chat template ({type(e).__name__}: {e})") from None
