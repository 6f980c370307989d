"""SFT data: instruction/response pairs, their encoding, and a deterministic loader.

Three small pieces, generic across model families:

- a pair source: a JSONL file (configurable keys; a malformed line is an error
  naming the file and line) or in-memory pairs, plus the built-in five-pair
  pirate dataset of the fine-tune demo;
- `encode_pair`: renders the instruction through the model's chat template,
  encodes prompt and response SEPARATELY and concatenates the ids (encoding the
  joined text would let BPE merge across the boundary, and the prompt/response
  mask would fall inside a token), appends the stop marker, shifts for
  next-token prediction and masks prompt positions with `ignore_index`;
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
from dataclasses import dataclass

import numpy as np

from kernels.rng import SplitMix64, at_values
from pipeline.errors import UserError

IGNORE_INDEX = -100  # torch's convention; the trainer's cross-entropy masks it


@dataclass(frozen=True)
class Pair:
    instruction: str
    response: str


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
            out.append(_pair_from_object(rec, instruction_key, response_key, f"record {i}"))
        elif isinstance(rec, (tuple, list)) and len(rec) == 2 and all(isinstance(s, str) for s in rec):
            out.append(Pair(rec[0], rec[1]))
        else:
            raise UserError(f"record {i}: expected a Pair, a dict or an (instruction, response) pair of strings, got {type(rec).__name__}")
    if not out:
        raise UserError("no pairs given: the dataset is empty")
    return out


def _pair_from_object(obj, instruction_key, response_key, where):
    for key in (instruction_key, response_key):
        if key not in obj:
            raise UserError(f"{where}: missing key {key!r} (keys present: {sorted(obj)})")
        if not isinstance(obj[key], str):
            raise UserError(f"{where}: key {key!r} must be a string, got {type(obj[key]).__name__}")
    return Pair(obj[instruction_key], obj[response_key])


def load_jsonl(path, instruction_key="instruction", response_key="response"):
    """Pairs from a JSONL file, one JSON object per line; blank lines are skipped.

    Any malformed line raises UserError naming `path:line`.
    """
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise UserError(f"{path}: cannot read the dataset ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    pairs = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{where}: malformed JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(obj, dict):
            raise UserError(f"{where}: expected a JSON object with {instruction_key!r} and {response_key!r}, got {type(obj).__name__}")
        pairs.append(_pair_from_object(obj, instruction_key, response_key, where))
    if not pairs:
        raise UserError(f"{path}: no pairs found (the file is empty)")
    return pairs


# --- encoding ---------------------------------------------------------------
class PromptTemplate:
    """Adapts a chat template (pipeline.llm.chat.ChatTemplate: `render(messages, ...)`,
    `stop_text`) to encode_pair's contract: render_prompt gives the (system and)
    user turn plus the opened assistant turn; `stop` closes the assistant turn."""

    def __init__(self, chat_template):
        self.chat_template = chat_template
        self.stop = chat_template.stop_text

    def render_prompt(self, instruction, system=None, think_off=True):
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": instruction}]
        return self.chat_template.render(messages, add_generation_prompt=True, think_off=think_off)


class RawEncoder:
    """Adapts a tokenizer with `encode(text, add_bos=...)` to encode_pair's contract:
    special tokens parsed, no BOS added to the separately encoded parts."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def encode(self, text):
        return self.tokenizer.encode(text, add_bos=False)


@dataclass(frozen=True)
class EncodeOptions:
    seq_max: int = 256           # a sample keeps at most seq_max input positions (seq_max + 1 tokens)
    ignore_index: int = IGNORE_INDEX  # the consuming loss's mask value, passed in, never imported
    mask_prompt: bool = True     # supervise the response (and stop marker) only
    system: str | None = None    # optional system turn
    think_off: bool = True       # pre-fill an empty reasoning block (Qwen3), as at inference


@dataclass
class Sample:
    inputs: np.ndarray   # int64 [T] token ids fed to the model
    labels: np.ndarray   # int64 [T] next token per position, ignore_index where unsupervised
    n_prompt: int        # tokens of the rendered prompt (before truncation)
    ignore_index: int = IGNORE_INDEX

    @property
    def n_valid(self):
        """Supervised positions: what token-weighted accumulation counts."""
        return int(np.count_nonzero(self.labels != self.ignore_index))


def encode_pair(tokenizer, template, pair, options=EncodeOptions(), where="pair"):
    """Encode one pair into (inputs, labels) for next-token training.

    tokenizer: `.encode(text) -> list[int]` that recognises the template's
        special tokens and adds no BOS/EOS of its own.
    template: `.render_prompt(instruction, system=None, think_off=True) -> str`
        (the rendered user turn plus the opened assistant turn) and `.stop`, the
        text that closes an assistant turn (e.g. "<|im_end|>").
    """
    if options.seq_max < 1:
        raise UserError(f"seq_max must be at least 1, got {options.seq_max}")
    prompt_text = template.render_prompt(pair.instruction, system=options.system, think_off=options.think_off)
    prompt = list(tokenizer.encode(prompt_text))
    # Encoded separately and concatenated: the prompt/response boundary stays a token boundary.
    response = list(tokenizer.encode(pair.response)) + list(tokenizer.encode(template.stop))
    seq = (prompt + response)[: options.seq_max + 1]
    if len(seq) < 2:
        raise UserError(f"{where}: the encoded sample has fewer than 2 tokens; nothing to predict")
    ids = np.asarray(seq, dtype=np.int64)
    inputs, labels = ids[:-1].copy(), ids[1:].copy()
    if options.mask_prompt:
        # label j predicts seq[j + 1]: it belongs to the prompt when j + 1 < len(prompt)
        labels[: max(0, min(len(prompt) - 1, len(labels)))] = options.ignore_index
    sample = Sample(inputs, labels, len(prompt), options.ignore_index)
    if sample.n_valid == 0:
        raise UserError(
            f"{where}: sample too long: the prompt is {len(prompt)} tokens, which leaves no supervised "
            f"token within seq_max={options.seq_max}; raise --seq-max or shorten the instruction")
    return sample


def encode_prompt(tokenizer, template, instruction, options=EncodeOptions()):
    """Token ids of a rendered prompt for generation (no response, no stop)."""
    text = template.render_prompt(instruction, system=options.system, think_off=options.think_off)
    return np.asarray(tokenizer.encode(text), dtype=np.int64)


def encode_all(tokenizer, template, pairs, options=EncodeOptions(), source="pair"):
    return [encode_pair(tokenizer, template, p, options, where=f"{source} {i}") for i, p in enumerate(pairs)]


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
        self.perm = epoch_permutation(self.n, self.seed, self.epoch) if self.order == "shuffled" else list(range(self.n))

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
