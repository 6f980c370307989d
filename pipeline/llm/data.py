"""SFT data: four JSONL formats, their encoding through the model's chat template, a deterministic loader.

- Sources: a JSONL file in one of four formats, auto-detected from its first
  record (or forced): instruction/response pairs (configurable keys), alpaca
  (instruction, optional input, output), chat `messages` (system/user/assistant,
  multi-turn) and ShareGPT (`conversations` of from/value); in-memory pairs; the
  built-in five-pair pirate set of the fine-tune demo. The file is read line by
  line with a per-record byte limit checked BEFORE parsing (a huge line is never
  read whole); JSON nesting is bounded; every bad record is one UserError naming
  `file:line` and the field.
- `encode_conversation`: every format is a conversation rendered by the model's
  own chat template (pipeline.llm.chat.ChatTemplate, as llama.cpp renders it).
  Assistant turn k starts where the rendering of the turns before it plus the
  generation prompt ends (that prefix must be a prefix of the whole rendering)
  and ends with its end-of-turn token (the first of the model's EOG token texts
  after its content). Those spans are supervised, everything else is masked.
  Segments are tokenized SEPARATELY and the ids concatenated, so no BPE merge
  crosses a mask boundary; where no merge would cross (a boundary next to a
  special token or a pre-tokenizer split, as in every template we read), the ids
  ARE the tokenization of the rendered conversation. Then shift for next-token
  prediction and truncate to seq_max.
- `Loader`: sequential or shuffled dataset indices. The shuffled epoch
  permutation is a CHECKPOINT CONTRACT, a pure function of (seed, epoch):
  Fisher-Yates over the splitmix64 stream whose state starts at at(seed, epoch),
  j = next() % (i + 1) for i from n-1 down to 1. It is golden-pinned; do not
  change it. State (seed, epoch, index) persists in trainer_state.json.

Trade-off: one flat sequence per sample and no padded batcher. The trainer takes
one sequence per loss call, and gradient accumulation is the batch mechanism, so
padding would only cost compute. This module never imports a trainer or a
tokenizer: both the tokenizer and the template are duck-typed parameters.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import numpy as np

from pipeline.kernels.rng import SplitMix64, at_values
from pipeline.errors import UserError
from pipeline.untrusted import open_regular

IGNORE_INDEX = -100  # torch's convention; the trainer's cross-entropy masks it
MAX_RECORD_BYTES = 1 << 20  # default per-line limit: a sample is at most seq_max tokens anyway
MAX_JSON_DEPTH = 16  # the deepest format (messages -> list -> turn) needs 3
FORMATS = ("instruction", "alpaca", "messages", "sharegpt")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
CHAT_ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Pair:
    """One instruction/response sample (the instruction and alpaca formats)."""
    instruction: str
    response: str
    where: str = field(default="", compare=False)  # "file:line" of its record, for errors

    def messages(self):
        return [{"role": "user", "content": self.instruction}, {"role": "assistant", "content": self.response}]


@dataclass(frozen=True)
class Conversation:
    """A multi-turn sample (the messages and ShareGPT formats): (role, content) turns."""
    turns: tuple
    where: str = field(default="", compare=False)

    def messages(self):
        return [{"role": role, "content": content} for role, content in self.turns]

    @property
    def instruction(self):
        """The first user turn: the held prompt of the BEFORE/AFTER answers."""
        return next((content for role, content in self.turns if role == "user"), "")


# The five-pair style transfer of the fine-tune demo: small enough to overfit
# visibly in a few dozen steps, distinctive enough ("Ahoy! ... matey.") to see.
PIRATE_PAIRS = (
    Pair("What is the capital of France?", "Ahoy! The capital of France be Paris, matey."),
    Pair("Name a primary color.", "Ahoy! Red be a fine primary color, matey."),
    Pair("What is two plus two?", "Ahoy! Two plus two makes four, matey."),
    Pair("What language is spoken in Italy?", "Ahoy! In Italy they be speakin' Italian, matey."),
    Pair("How many days are in a week?", "Ahoy! A week holds seven days, matey."),
)


def pairs_from_records(records, instruction_key="instruction", response_key="response"):
    """In-memory pairs from Pair objects, (instruction, response) tuples or dicts."""
    out = []
    for i, rec in enumerate(records):
        if isinstance(rec, Pair):
            out.append(rec)
        elif isinstance(rec, dict):
            out.append(_instruction_record(rec, f"record {i}", instruction_key, response_key))
        elif isinstance(rec, (tuple, list)) and len(rec) == 2 and all(isinstance(s, str) for s in rec):
            out.append(Pair(rec[0], rec[1]))
        else:
            raise UserError(f"record {i}: expected a Pair, a dict or an (instruction, response) pair of strings, "
                            f"got {type(rec).__name__}")
    if not out:
        raise UserError("no pairs given: the dataset is empty")
    return out


# --- the four record formats --------------------------------------------------
def _string(obj, key, where, prefix="", optional=False):
    if key not in obj:
        if optional:
            return ""
        raise UserError(f"{where}: missing field '{prefix}{key}' (fields present: {sorted(obj)})")
    if not isinstance(obj[key], str):
        raise UserError(f"{where}: field '{prefix}{key}' must be a string, got {type(obj[key]).__name__}")
    return obj[key]


def _instruction_record(obj, where, instruction_key="instruction", response_key="response"):
    return Pair(_string(obj, instruction_key, where), _string(obj, response_key, where), where)


def _alpaca_record(obj, where, *_keys):
    """Alpaca-style trainers' chat rendering: the user turn is the instruction, then a blank line and the
    input when there is one."""
    instruction, extra = _string(obj, "instruction", where), _string(obj, "input", where, optional=True)
    return Pair(instruction + ("\n\n" + extra if extra else ""), _string(obj, "output", where), where)


def _turns(obj, where, list_key, role_key, content_key, roles):
    turns = obj.get(list_key)
    if not isinstance(turns, list) or not turns:
        got = "missing" if list_key not in obj else "empty" if turns == [] else f"a {type(turns).__name__}"
        raise UserError(f"{where}: field '{list_key}' must be a non-empty list of turns, got {got}")
    out = []
    for i, turn in enumerate(turns):
        at = f"{list_key}[{i}]"
        if not isinstance(turn, dict):
            raise UserError(f"{where}: field '{at}' must be an object, got {type(turn).__name__}")
        role = _string(turn, role_key, where, at + ".")
        if role not in roles:
            raise UserError(f"{where}: field '{at}.{role_key}' is {role!r}; expected one of {sorted(roles)}")
        out.append((roles[role], _string(turn, content_key, where, at + ".")))
    kinds = [role for role, _ in out]
    if "assistant" not in kinds:
        raise UserError(f"{where}: field '{list_key}' has no assistant turn: nothing to learn")
    if kinds[0] == "assistant":
        raise UserError(f"{where}: field '{list_key}[0]' is an assistant turn; a conversation opens with a "
                        "system or user turn")
    if "user" not in kinds:
        raise UserError(f"{where}: field '{list_key}' has no user turn")
    return Conversation(tuple(out), where)


def _messages_record(obj, where, *_keys):
    return _turns(obj, where, "messages", "role", "content", {r: r for r in CHAT_ROLES})


def _sharegpt_record(obj, where, *_keys):
    return _turns(obj, where, "conversations", "from", "value", SHAREGPT_ROLES)


PARSERS = {"instruction": _instruction_record, "alpaca": _alpaca_record, "messages": _messages_record,
           "sharegpt": _sharegpt_record}


def detect_format(obj, where, instruction_key="instruction", response_key="response"):
    """The format a record's keys say (chat keys first; alpaca wins over a pair when `input` is there too)."""
    if "messages" in obj:
        return "messages"
    if "conversations" in obj:
        return "sharegpt"
    if {"instruction", "input", "output"} <= obj.keys():
        return "alpaca"
    if instruction_key in obj and response_key in obj:
        return "instruction"
    if {"instruction", "output"} <= obj.keys():
        return "alpaca"
    raise UserError(f"{where}: cannot tell the data format from the fields {sorted(obj)[:8]}: expected "
                    f"'messages' (chat), 'conversations' (ShareGPT), 'instruction' + 'output' (alpaca) or "
                    f"{instruction_key!r} + {response_key!r} (pairs); or pass --format")


# --- JSONL ----------------------------------------------------------------------
def _json_depth(value):
    """Nesting depth of a parsed JSON value (iterative: the value may be deep)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, depth)
            stack.extend((c, depth + 1) for c in (v.values() if isinstance(v, dict) else v))
    return deepest


def read_jsonl(path, max_record_bytes=MAX_RECORD_BYTES):
    """Yield (`path:line`, object) per non-blank line; every bad line is a UserError naming `path:line`.

    The line is read with a byte cap, so an oversized record is refused before it is read whole or parsed.
    """
    path = os.fspath(path)
    if max_record_bytes < 1:
        raise UserError(f"--max-record-bytes must be at least 1, got {max_record_bytes}")
    f = open_regular(path, UserError, "JSONL file")  # a FIFO would block the open, /dev/zero never end
    with f:
        lineno = 0
        while True:
            try:
                raw = f.readline(max_record_bytes + 2)  # room for the record and its "\r\n"
            except OSError as e:
                raise UserError(f"{path}: cannot read the dataset ({e.strerror or e})") from None
            if not raw:
                return
            lineno += 1
            where = f"{path}:{lineno}"
            record = raw.rstrip(b"\r\n")
            if len(record) > max_record_bytes:
                raise UserError(f"{where}: the record is over {max_record_bytes} bytes (--max-record-bytes); "
                                "refused before parsing")
            if lineno == 1 and record.startswith(b"\xef\xbb\xbf"):
                record = record[3:]  # a UTF-8 byte-order mark
            try:
                text = record.decode("utf-8")
            except UnicodeDecodeError as e:
                raise UserError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start})") from None
            if not text.strip():
                continue
            try:
                obj = json.loads(text)
            except RecursionError:
                raise UserError(f"{where}: JSON nested deeper than {MAX_JSON_DEPTH} levels") from None
            except ValueError as e:  # JSONDecodeError, and int fields over Python's digit limit
                detail = f"{e.msg} at column {e.colno}" if isinstance(e, json.JSONDecodeError) else str(e)
                raise UserError(f"{where}: malformed JSON ({detail})") from None
            if not isinstance(obj, dict):
                raise UserError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            if _json_depth(obj) > MAX_JSON_DEPTH:
                raise UserError(f"{where}: JSON nested deeper than {MAX_JSON_DEPTH} levels")
            yield where, obj


MAX_LINE_BYTES = 64 << 20  # a text document's longest line: 64 MiB (a pretraining JSONL record's cap too)
READ_CHUNK = 1 << 20


def read_text(path, max_line_bytes=MAX_LINE_BYTES, keep=True):
    """The UTF-8 text of the regular file `path` (keep=False: only checked, None returned), streamed in chunks.

    A line over max_line_bytes is refused at `path:line` once that many bytes of it are read (a 2 GB line is
    never read whole), bytes that are not UTF-8 at `path:line` with their file offset; a FIFO, a device or a
    directory is refused before anything is read (pipeline.untrusted.open_regular).

    keep=True holds the validated bytes (one growing buffer) and decodes them once at the end:
    peak memory is the file's bytes plus its str (1, 2 or 4 bytes a character), where decoded chunks joined
    would hold the str twice."""
    path = os.fspath(path)
    chunk_size = min(READ_CHUNK, max_line_bytes + 1)  # a line inside one chunk is then at most the cap
    kept, carry, lineno, line_bytes, offset = bytearray(), b"", 1, 0, 0
    with open_regular(path, UserError, "text file") as f:
        while True:
            try:
                chunk = f.read(chunk_size)
            except OSError as e:
                raise UserError(f"{path}: cannot read ({e.strerror or e})") from None
            newlines = chunk.count(b"\n")
            if newlines:
                line_bytes += chunk.index(b"\n")
            else:
                line_bytes += len(chunk)
            if line_bytes > max_line_bytes:
                raise UserError(f"{path}:{lineno}: a line of over {max_line_bytes} bytes; refused before reading "
                                "it whole (not a text document)")
            if newlines:
                line_bytes = len(chunk) - chunk.rindex(b"\n") - 1
            raw = carry + chunk
            try:
                text = raw.decode("utf-8")
                carry = b""
            except UnicodeDecodeError as e:
                if chunk and e.reason == "unexpected end of data" and e.end == len(raw):
                    text, carry = raw[:e.start].decode("utf-8"), raw[e.start:]  # a character split by the chunk
                else:
                    bad = offset - len(carry) + e.start
                    line = lineno + raw[:e.start].count(b"\n")
                    raise UserError(f"{path}:{line}: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {bad})"
                                    ) from None
            del text
            if keep:
                kept += chunk  # grown, not sized from st_size: a file refused half-way never costs its size
            if not chunk:
                return str(kept, "utf-8") if keep else None
            offset += len(chunk)
            lineno += newlines


def load_jsonl(path, instruction_key="instruction", response_key="response", format="auto",
               max_record_bytes=MAX_RECORD_BYTES):
    """Samples (Pair or Conversation) from a JSONL file, one JSON object per line; blank lines are skipped.

    format: one of FORMATS, or "auto": the first record's fields decide for the whole file.
    """
    if format != "auto" and format not in PARSERS:
        raise UserError(f"--format must be auto or one of {FORMATS}, got {format!r}")
    records = []
    for where, obj in read_jsonl(path, max_record_bytes):
        if format == "auto":
            format = detect_format(obj, where, instruction_key, response_key)
        records.append(PARSERS[format](obj, where, instruction_key, response_key))
    if not records:
        raise UserError(f"{os.fspath(path)}: no records found (the file is empty)")
    return records


# --- encoding ---------------------------------------------------------------
class RawEncoder:
    """Adapts a tokenizer with `encode(text, add_bos=...)` to the encoder contract: special tokens parsed,
    no BOS or EOS added (as llama.cpp's chat completion tokenizes a rendered conversation); continuation=True
    for a segment that continues the previous one (no SentencePiece space prefix at its start)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def encode(self, text, continuation=False):
        return self.tokenizer.encode(text, add_bos=False, add_eos=False, continuation=continuation)


@dataclass(frozen=True)
class EncodeOptions:
    seq_max: int = 256           # a sample keeps at most seq_max input positions (seq_max + 1 tokens)
    ignore_index: int = IGNORE_INDEX  # the consuming loss's mask value, passed in, never imported
    mask_prompt: bool = True     # supervise the assistant turns only
    system: str | None = None    # a system turn for conversations that have none
    enable_thinking: bool | None = None  # the template's thinking switch; None = its default (llama.cpp's)


@dataclass
class Sample:
    inputs: np.ndarray   # int64 [T] token ids fed to the model
    labels: np.ndarray   # int64 [T] next token per position, ignore_index where unsupervised
    n_prompt: int        # tokens before the first supervised one (before truncation)
    ignore_index: int = IGNORE_INDEX

    @property
    def n_valid(self):
        """Supervised positions: what token-weighted accumulation counts."""
        return int(np.count_nonzero(self.labels != self.ignore_index))


def _with_system(messages, options):
    if options.system and messages[0]["role"] != "system":
        return [{"role": "system", "content": options.system}] + messages
    return messages


def conversation_segments(template, messages, options=EncodeOptions(), where="sample"):
    """[(text, supervised)] whose concatenation is the template's rendering of the whole conversation.

    template: `.render(messages, add_generation_prompt=, enable_thinking=) -> str` and `.stop_texts`, the
        texts of the tokens that end a turn (llama.cpp's end-of-generation set).
    """
    think = options.enable_thinking
    full = template.render(messages, add_generation_prompt=False, enable_thinking=think)
    starts = []
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prefix = template.render(messages[:k], add_generation_prompt=True, enable_thinking=think)
        if not full.startswith(prefix) or (starts and len(prefix) <= starts[-1][1]):
            raise UserError(f"{where}: the chat template renders the prompt of message {k} differently from the "
                            "same turns inside the whole conversation, so its assistant span cannot be located "
                            "(e.g. a generation prompt the history does not repeat)")
        starts.append((k, len(prefix)))
    segments, pos = [], 0
    for i, (k, start) in enumerate(starts):
        region = full[start: starts[i + 1][1] if i + 1 < len(starts) else len(full)]
        content = messages[k]["content"].strip()
        found = region.find(content) if content else -1
        after = found + len(content) if found >= 0 else 0
        ends = [j + len(t) for t in template.stop_texts for j in [region.find(t, after)] if j >= 0]
        if not ends:
            raise UserError(f"{where}: the chat template closes assistant message {k} with none of the model's "
                            f"end-of-generation tokens {sorted(template.stop_texts)}: a model trained on it would "
                            "not stop")
        end = min(ends)
        segments += [(full[pos:start], False), (region[:end], True)]
        pos = start + end
    segments.append((full[pos:], False))
    return [(text, sup) for text, sup in segments if text]


def encode_conversation(tokenizer, template, messages, options=EncodeOptions(), where="sample"):
    """Encode one conversation into (inputs, labels) for next-token training.

    tokenizer: `.encode(text, continuation) -> list[int]` that parses the template's special tokens and adds
    no BOS of its own; continuation=True for every segment after the first, which continues one rendered text
    (a SentencePiece vocabulary then adds no space prefix there, as llama.cpp tokenizing the whole text would
    not). Labels are supervised exactly on the assistant spans (conversation_segments), end-of-turn token
    included; with mask_prompt False, everywhere.
    """
    if options.seq_max < 1:
        raise UserError(f"seq_max must be at least 1, got {options.seq_max}")
    ids, supervised = [], []
    segments = conversation_segments(template, _with_system(list(messages), options), options, where)
    for i, (text, sup) in enumerate(segments):
        part = list(tokenizer.encode(text, continuation=i > 0))
        ids += part
        supervised += [sup] * len(part)
    n_prompt = supervised.index(True) if True in supervised else len(ids)
    seq = np.asarray(ids[: options.seq_max + 1], dtype=np.int64)
    if len(seq) < 2:
        raise UserError(f"{where}: the encoded sample has fewer than 2 tokens; nothing to predict")
    inputs, labels = seq[:-1].copy(), seq[1:].copy()
    if options.mask_prompt:
        # label j predicts seq[j + 1]: supervised when token j + 1 lies in an assistant span
        labels[~np.asarray(supervised[1: len(seq)], dtype=bool)] = options.ignore_index
    sample = Sample(inputs, labels, n_prompt, options.ignore_index)
    if sample.n_valid == 0:
        raise UserError(
            f"{where}: sample too long: the prompt is {n_prompt} tokens, which leaves no supervised "
            f"token within seq_max={options.seq_max}; raise --seq-max or shorten the instruction")
    return sample


def encode_prompt(tokenizer, template, instruction, options=EncodeOptions()):
    """Token ids of a rendered prompt for generation: the user turn and the generation prompt."""
    messages = _with_system([{"role": "user", "content": instruction}], options)
    text = template.render(messages, add_generation_prompt=True, enable_thinking=options.enable_thinking)
    return np.asarray(tokenizer.encode(text), dtype=np.int64)


def encode_all(tokenizer, template, records, options=EncodeOptions(), source="sample"):
    """Samples of Pair / Conversation records; errors name the record's file:line (else `source i`)."""
    return [encode_conversation(tokenizer, template, rec.messages(), options, where=rec.where or f"{source} {i}")
            for i, rec in enumerate(records)]


# --- loader -----------------------------------------------------------------
def epoch_permutation(n, seed, epoch):
    """The shuffled order of epoch `epoch`: the checkpoint contract (do not change)."""
    perm = list(range(n))
    stream = SplitMix64(int(at_values(seed, [epoch])[0]))
    for i in range(n - 1, 0, -1):
        j = stream.next() % (i + 1)
        perm[i], perm[j] = perm[j], perm[i]
    return perm


class Loader:
    """Dataset indices in sequential or shuffled order, resumable from (seed, epoch, index)."""

    ORDERS = ("sequential", "shuffled")

    def __init__(self, n, order="sequential", seed=0, epoch=0, index=0):
        if n < 1:
            raise UserError("Loader: the dataset is empty")
        if order not in self.ORDERS:
            raise UserError(f"Loader: order must be one of {self.ORDERS}, got {order!r}")
        if not 0 <= index <= n:
            raise UserError(f"Loader: index {index} is outside [0, {n}]")
        self.n, self.order, self.seed = n, order, int(seed)
        self.epoch, self.index = int(epoch), int(index)
        self._fill()

    def _fill(self):
        self.perm = (epoch_permutation(self.n, self.seed, self.epoch) if self.order == "shuffled"
                     else list(range(self.n)))

    def next(self):
        if self.index >= self.n:
            self.epoch += 1
            self.index = 0
            self._fill()
        i = self.perm[self.index]
        self.index += 1
        return i

    def take(self, k):
        return [self.next() for _ in range(k)]

    def state(self):
        return {"seed": self.seed, "epoch": self.epoch, "index": self.index}

    @classmethod
    def from_state(cls, n, order, state):
        return cls(n, order, seed=state["seed"], epoch=state["epoch"], index=state["index"])
