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
has no such variable. A GGUF without a template (some published Gemma 3 files
carry none) gets its family's own turn format (`Family.chat_format`: ChatML for
qwen2/qwen3, Llama 3's for a llama whose vocabulary has its header tokens,
Gemma's for gemma3; ChatML when the vocabulary lacks the format's tokens), said
once on stderr; `--chat-template NAME|FILE` overrides the file's or the
family's template for any model. Trade-off: `strftime_now` makes date-printing templates (Llama 3.x)
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
import sys
from datetime import datetime
from functools import cached_property
from pathlib import Path

from ..errors import UserError
from ..untrusted import brief, open_regular

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


# The turn formats a family falls back to (and --chat-template names): jinja as the models' own templates
# write them (Llama 3.x's without its date/tools preamble, Gemma 3's with the system text folded into
# the first user turn). "chatml" is render_chatml (llama-server's fallback).
LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + "
    "'<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}"
)
GEMMA_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' %}{%- set loop_messages = messages[1:] %}"
    "{%- else %}{%- set first_user_prefix = '' %}{%- set loop_messages = messages %}{%- endif %}"
    "{%- for message in loop_messages %}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{- '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') + message['content'] | trim + "
    "'<end_of_turn>\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<start_of_turn>model\n' }}{%- endif %}"
)
CHAT_FORMATS = {"chatml": None, "llama3": LLAMA3_TEMPLATE, "gemma": GEMMA_TEMPLATE}
FORMAT_MARKERS = {"llama3": "<|start_header_id|>", "gemma": "<start_of_turn>"}  # the vocab must have these
MAX_TEMPLATE_FILE_BYTES = 1 << 20
_FALLBACKS_SAID = set()  # GGUF paths whose missing template was reported (once per process)


def add_chat_template_argument(parser):
    parser.add_argument("--chat-template", metavar="NAME|FILE", default=None,
                        help=f"render conversations with this turn format ({', '.join(CHAT_FORMATS)}) or jinja "
                             "file instead of the GGUF's template (default: the GGUF's, else its family's format)")


def _override(spec: str):
    """(jinja source or None for ChatML, description) of --chat-template NAME|FILE."""
    if spec in CHAT_FORMATS:
        return CHAT_FORMATS[spec], f"--chat-template {spec}"
    path = Path(spec)
    if not path.exists():
        raise UserError(f"--chat-template {spec}: neither a format name ({', '.join(CHAT_FORMATS)}) nor a file")
    with open_regular(path, UserError, "jinja chat template file", "--chat-template") as fh:
        raw = fh.read(MAX_TEMPLATE_FILE_BYTES + 1)
    if len(raw) > MAX_TEMPLATE_FILE_BYTES:
        raise UserError(f"--chat-template {spec}: larger than {MAX_TEMPLATE_FILE_BYTES} bytes; not a chat template")
    try:
        return raw.decode("utf-8"), f"--chat-template {spec}"
    except UnicodeDecodeError as e:
        raise UserError(f"--chat-template {spec}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def _family_fallback(gg, tokens):
    """(jinja source or None, name) of the turn format of the file's family, ChatML if its vocabulary
    lacks that format's tokens (a llama with a SentencePiece Llama 2 vocabulary, say)."""
    from ..models.registry import ARCHITECTURES
    fam = ARCHITECTURES.get(gg.architecture)
    name = fam.chat_format if fam is not None else "chatml"
    if name in FORMAT_MARKERS and FORMAT_MARKERS[name] not in tokens:
        name = "chatml"
    if str(gg.path) not in _FALLBACKS_SAID:
        _FALLBACKS_SAID.add(str(gg.path))
        print(f"note: {gg.path} has no tokenizer.chat_template; using the {gg.architecture} turn format "
              f"'{name}' (--chat-template NAME|FILE overrides)", file=sys.stderr)
    return CHAT_FORMATS[name], name


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


# --- the render budget ----------------------------------------------------------------------------------
# The sandbox keeps a template away from Python's internals, not from the CPU or memory: nested
# range(100000) loops never end, `content * 10**6` builds gigabytes. So a rendering has a budget: a time
# (RENDER_SECONDS, enforced by a watchdog thread that raises inside the rendering thread) and a size
# (the caller's max_chars, at most MAX_RENDER_CHARS) that the output and every string or list the template
# builds on the way must stay under. Operations that multiply sizes (`*`, `**`, `%`, widths, replace, join,
# indent, ...) are checked BEFORE they run, so none allocates past the budget; every other result is checked
# after (an operation that at most doubles its input then holds at most twice the budget).
RENDER_SECONDS = 5.0           # a real template renders in milliseconds
MAX_RENDER_CHARS = 1 << 26     # the most any rendering may produce, whatever context the model claims
MAX_INT_BITS = 1 << 16         # integer arithmetic results (`**`, `*`): far past any template's need
MAX_JSON_INDENT = 64


class _OverBudget(Exception):
    """A template operation would pass the size budget (the message says which)."""


class _RenderTimeout(BaseException):
    """Raised inside the rendering thread by the watchdog (a BaseException: no template-level handler
    catches it)."""


def _size(x) -> int:
    return len(x) if isinstance(x, (str, bytes, list, tuple, dict)) else 0


def _ints_in(text: str) -> int:
    """The sum of the integers written in a format string: a bound on the widths it asks for."""
    import re
    return sum(int(d) for d in re.findall(r"\d+", text)) if isinstance(text, str) else 0


def _width(w) -> int:
    return w if isinstance(w, int) else _size(w)


def _method_estimate(name, s, args, kwargs):
    """An upper estimate of the size of str method `name`'s result on `s`, or None when it is not larger
    than what exists already (checked after the call)."""
    if name in ("ljust", "rjust", "center", "zfill") and args:
        return max(len(s), _width(args[0]))
    if name == "expandtabs":
        return len(s) + s.count("\t") * _width(args[0] if args else kwargs.get("tabsize", 8))
    if name == "replace" and len(args) >= 2 and isinstance(args[0], str):
        old, new = args[0], args[1]
        return len(s) + (s.count(old) if old else len(s) + 1) * _size(new)
    if name == "join" and args and hasattr(args[0], "__len__"):
        return sum(_size(x) for x in args[0]) + len(s) * len(args[0])
    if name in ("format", "format_map"):  # widths are written in s or passed as arguments ({:{}})
        values = [*args, *kwargs.values(), *(args[0].values() if name == "format_map" and args
                                              and isinstance(args[0], dict) else ())]
        return len(s) + _ints_in(s) + sum(_size(x) + (x if isinstance(x, int) else 0) for x in values)
    return None


def _filter_estimate(name, args, kwargs):
    """As _method_estimate, for the filters that can build more than their input."""
    value = args[0] if args else None
    rest = args[1:]
    if name == "center":
        return max(_size(value), _width(rest[0] if rest else kwargs.get("width", 80)))
    if name == "indent" and isinstance(value, str):
        width = rest[0] if rest else kwargs.get("width", 4)
        return len(value) + (value.count("\n") + 1) * _width(width)
    if name == "replace" and len(rest) >= 2 and isinstance(value, str) and isinstance(rest[0], str):
        old = rest[0]
        return len(value) + (value.count(old) if old else len(value) + 1) * _size(rest[1])
    if name == "join" and hasattr(value, "__len__"):
        sep = rest[0] if rest else kwargs.get("d", "")
        return sum(_size(x) for x in value) + _size(sep) * len(value)
    if name == "format" and isinstance(value, str):
        return len(value) + _ints_in(value) + sum(_size(x) + (x if isinstance(x, int) else 0) for x in rest)
    if name == "tojson":
        indent = rest[1] if len(rest) > 1 else kwargs.get("indent")
        if _width(indent or 0) > MAX_JSON_INDENT:
            raise _OverBudget(f"tojson indent {brief(indent)} is over {MAX_JSON_INDENT}")
    if name == "wordwrap" and isinstance(value, str):
        return 2 * len(value)
    return None


def _environment():
    import jinja2.ext
    from jinja2.compiler import CodeGenerator
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class PassGenerationTags(jinja2.ext.Extension):
        """HF's `{% generation %}...{% endgeneration %}` marks assistant text; it renders as its body."""
        tags = {"generation"}

        def parse(self, parser):
            parser.stream.skip(1)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    class BudgetedConcat(CodeGenerator):
        """`a ~ b` goes through the environment's size check (jinja joins the parts directly)."""

        def visit_Concat(self, node, frame):
            self.write("environment.budgeted_concat((")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))")

    class BudgetedSandbox(ImmutableSandboxedEnvironment):
        """The sandbox with every operation that can build a large value checked against the budget."""
        intercepted_binops = frozenset({"*", "**", "%", "+"})
        code_generator_class = BudgetedConcat

        def __init__(self, **kw):
            super().__init__(**kw)
            import threading
            self.budget = threading.local()  # .max_chars of the rendering in this thread

        def limit(self) -> int:
            return getattr(self.budget, "max_chars", MAX_RENDER_CHARS)

        def checked(self, what, estimate):
            if estimate is not None and estimate > self.limit():
                raise _OverBudget(f"{what} would build {estimate:,} characters or items, over the budget of "
                                  f"{self.limit():,}")

        def result(self, what, value):
            self.checked(what, _size(value))
            return value

        def call_binop(self, context, operator, left, right):
            if operator == "*":
                seq, n = (left, right) if isinstance(right, int) else (right, left)
                if isinstance(seq, (str, bytes, list, tuple)) and isinstance(n, int):
                    self.checked("'*'", len(seq) * n)
                elif isinstance(left, int) and isinstance(right, int) and \
                        left.bit_length() + right.bit_length() > MAX_INT_BITS:
                    raise _OverBudget(f"'*' of integers of over {MAX_INT_BITS} bits")
            elif operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 \
                    and right > 0 and left.bit_length() * right > MAX_INT_BITS:
                raise _OverBudget(f"'**' would build an integer of over {MAX_INT_BITS} bits")
            elif operator == "%" and isinstance(left, str):
                args = right if isinstance(right, tuple) else (right,)
                self.checked("'%'", len(left) + _ints_in(left)
                             + sum(_size(x) + (x if isinstance(x, int) else 0) for x in args))
            elif operator == "+":
                self.checked("'+'", _size(left) + _size(right))
            return self.result(f"'{operator}'", super().call_binop(context, operator, left, right))

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja's own signature
            owner = getattr(__obj, "__self__", None)
            name = getattr(__obj, "__name__", "a call")
            if isinstance(owner, str):
                __self.checked(f"str.{name}", _method_estimate(name, owner, args, kwargs))
            elif name == "generate_lorem_ipsum":
                n, most = (args + (5, True, 20, 100))[0], kwargs.get("max", 100)
                __self.checked("lipsum", _width(n) * _width(most) * 16)
            return __self.result(name, super().call(__context, __obj, *args, **kwargs))

        def wrap_str_format(self, value):
            wrapper = super().wrap_str_format(value)  # str.format / format_map, sandboxed by jinja
            if wrapper is None:
                return None
            owner, name = value.__self__, value.__name__

            def checked(*args, **kwargs):
                self.checked(f"str.{name}", _method_estimate(name, owner, args, kwargs))
                return self.result(f"str.{name}", wrapper(*args, **kwargs))
            return checked

        def budgeted_concat(self, parts):
            parts = [str(p) for p in parts]
            self.checked("'~'", sum(map(len, parts)))
            return "".join(parts)

    env = BudgetedSandbox(trim_blocks=True, lstrip_blocks=True,
                          extensions=[PassGenerationTags, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson

    def budgeted(name, fn):
        import functools
        skip = 1 if getattr(fn, "jinja_pass_arg", None) is not None else 0  # a context/environment first

        @functools.wraps(fn)  # keeps jinja_pass_arg
        def filter_(*args, **kwargs):
            env.checked(f"filter {name}", _filter_estimate(name, args[skip:], kwargs))
            return env.result(f"filter {name}", fn(*args, **kwargs))
        return filter_

    env.filters = {name: budgeted(name, fn) for name, fn in env.filters.items()}
    return env


class _Watchdog:
    """One daemon thread for every rendering of the process: it raises _RenderTimeout inside a rendering
    thread whose deadline has passed (a Timer thread per rendering cost ~0.5 ms, 5x a typical rendering).

    Trade-off: CPython's PyThreadState_SetAsyncExc instead of a trace function or a subprocess: a trace
    hook would slow every template 10x and a subprocess per rendering costs milliseconds; the async
    exception lands at the template's next bytecode, and a lone C call is bounded by the size checks."""

    def __init__(self):
        import threading
        self._cond = threading.Condition()
        self._due = {}            # token -> [deadline, thread id, fired]
        self._tokens = iter(range(1 << 62))
        self._thread = None
        self._wake_at = None      # when the thread's current wait ends (None: it waits for a notify)

    @staticmethod
    def _raise_in(tid, exc):
        import ctypes
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(tid), ctypes.py_object(exc) if exc else None)

    def arm(self, seconds: float) -> int:
        import threading
        import time
        with self._cond:
            if self._thread is None or not self._thread.is_alive():  # first use, or a forked child
                self._thread = threading.Thread(target=self._run, name="fucina-render-watchdog", daemon=True)
                self._thread.start()
            token, deadline = next(self._tokens), time.monotonic() + seconds
            self._due[token] = [deadline, threading.get_ident(), False]
            if self._wake_at is None or deadline < self._wake_at:
                self._cond.notify()
        return token

    def disarm(self, token: int):
        with self._cond:
            entry = self._due.pop(token, None)
        if entry is not None and entry[2]:  # fired but perhaps not yet delivered: cleared, it cannot land later
            self._raise_in(entry[1], None)

    def _run(self):
        import time
        with self._cond:
            while True:
                now, wake = time.monotonic(), None
                for entry in self._due.values():
                    if entry[2]:
                        continue
                    if entry[0] <= now:
                        entry[2] = True
                        self._raise_in(entry[1], _RenderTimeout)
                    else:
                        wake = entry[0] if wake is None else min(wake, entry[0])
                self._wake_at = wake
                self._cond.wait(None if wake is None else wake - now)


_WATCHDOG = _Watchdog()


def _with_deadline(render, seconds: float):
    """render() in this thread, interrupted by _RenderTimeout once `seconds` have passed."""
    token = _WATCHDOG.arm(seconds)
    try:
        return render()
    finally:
        _WATCHDOG.disarm(token)


class ChatTemplate:
    """One model's conversation renderer: its GGUF jinja template (else ChatML), BOS/EOS texts and EOG ids."""

    def __init__(self, jinja_source: str | None = None, *, bos_token: str = "", eos_token: str = "",
                 stop_ids=frozenset(), stop_texts=frozenset(), source: str = "chat template"):
        self.jinja_source, self.source = jinja_source, source
        self.bos_token, self.eos_token = bos_token, eos_token
        self.stop_ids = frozenset(stop_ids)      # generation stops on these ids (llama.cpp's EOG set)
        self.stop_texts = frozenset(stop_texts)  # their texts: an assistant turn ends at the first one
        self._compiled = None
        self.render_seconds = RENDER_SECONDS

    @classmethod
    def from_gguf(cls, gg, override: str | None = None) -> "ChatTemplate":
        """The GGUF's template; override (--chat-template NAME|FILE) replaces it; a file without one gets
        its family's turn format."""
        from .gguf import metadata_of
        md = gg.metadata
        tokens = metadata_of(gg, "tokenizer.ggml.tokens", "strings") or []

        def text_of(key):
            i = md.get(key)
            return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else ""

        stop_ids = end_of_generation_ids(md)
        template = md.get("tokenizer.chat_template")
        if template is not None and not isinstance(template, str):
            raise UserError(f"{gg.path}: tokenizer.chat_template must be a string, got {type(template).__name__}")
        source = f"{gg.path}: tokenizer.chat_template"
        if override is not None:
            template, source = _override(override)
        elif template is None:
            template, name = _family_fallback(gg, tokens)
            source = f"{gg.path}: the {gg.architecture} turn format '{name}'"
        return cls(template, bos_token=text_of("tokenizer.ggml.bos_token_id"),
                   eos_token=text_of("tokenizer.ggml.eos_token_id"), stop_ids=stop_ids,
                   stop_texts={tokens[i] for i in stop_ids}, source=source)

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

    def render(self, messages, *, add_generation_prompt: bool = True, enable_thinking: bool | None = None,
               max_chars: int | None = None, limit_reason: str = "") -> str:
        """The conversation as text; enable_thinking None leaves the template's default (llama.cpp's).

        The rendering runs under the budget above: at most render_seconds, at most max_chars characters
        (MAX_RENDER_CHARS when None or larger; limit_reason says where a caller's limit comes from)."""
        check_messages(messages)
        if enable_thinking is not None and not self.has_thinking_switch:
            raise UserError(f"{self.source}: this chat template has no thinking switch (enable_thinking); "
                            "drop --think/--no-think")
        if not self.jinja_source:
            text = render_chatml(messages, add_generation_prompt=add_generation_prompt)
            limit = min(MAX_RENDER_CHARS, max_chars if max_chars is not None else MAX_RENDER_CHARS)
            if len(text) > limit:
                raise UserError(f"{self.source}: the conversation renders to {len(text):,} characters, over "
                                f"{limit:,}" + (f" ({limit_reason})" if limit_reason else ""))
            return text

        def raise_exception(msg):
            raise UserError(f"{self.source}: the template refused the conversation: {msg}")

        extra = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
        template = self._template()
        limit = min(MAX_RENDER_CHARS, max_chars if max_chars is not None else MAX_RENDER_CHARS)

        def render():
            out, n = [], 0
            for chunk in template.generate(
                    messages=messages, bos_token=self.bos_token, eos_token=self.eos_token,
                    add_generation_prompt=add_generation_prompt, raise_exception=raise_exception,
                    functions=None, function_call=None, tools=None, tool_choice=None,
                    strftime_now=lambda fmt: datetime.now().strftime(fmt), **extra):
                n += len(chunk)
                if n > limit:
                    raise _OverBudget(f"the rendering is over {limit:,} characters{why}")
                out.append(chunk)
            return "".join(out)

        why = f" ({limit_reason})" if limit_reason and limit < MAX_RENDER_CHARS else ""
        env = template.environment
        env.budget.max_chars = limit
        try:
            return _with_deadline(render, self.render_seconds)
        except UserError:
            raise
        except _RenderTimeout:
            raise UserError(f"{self.source}: the jinja chat template did not finish rendering within "
                            f"{self.render_seconds:g} s; refused") from None
        except _OverBudget as e:
            raise UserError(f"{self.source}: the jinja chat template is refused: {e}") from None
        except Exception as e:  # the template is data from the file: whatever it trips on is the file's fault
            raise UserError(f"{self.source}: cannot render the jinja chat template ({type(e).__name__}: {e})") from None
        finally:
            env.budget.max_chars = MAX_RENDER_CHARS
