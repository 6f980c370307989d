"""ES fine-tuning rewards: what a population member is scored by.

    nll               -token-weighted mean CE of the reference responses (no generation)
    exact             1.0 if the greedy answer equals the reference answer after normalisation
                      (strip, casefold, collapse whitespace, strip trailing punctuation), else 0.0
    rule:format       1.0 for the R1 shape <think>...</think><answer>...</answer> (nothing else
                      around them but whitespace), else 0.0
    rule:length=LO,HI 1.0 when LO <= len(completion) <= HI characters; outside, 1 - distance / bound
                      (floored at 0), so ES sees a slope instead of a cliff
    rule:regex=PAT    1.0 if re.search(PAT, completion) finds a match, else 0.0
    countdown         the built-in Countdown checker (pipeline/es/countdown.py; --task countdown)
    PATH.py:FUNC      a user's function reward(prompt, completion, reference) -> float

Trade-off: every generation reward scores the GREEDY completion (temperature 0,
ties to the lowest id) decoded through the KV cache with the member's adapters
in the projections, so a member's reward is a pure function of its parameters:
no sampling noise competes with the ES noise, and the bits do not depend on
threads or workers. The price is that a member explores only through its
perturbation, never through sampling.

A user's reward file is the user's own code, named on the command line: it is
imported (importlib, from that path) in every process that scores members.
Model output is only ever passed to it as a string; nothing here evals it.
"""
from __future__ import annotations

import importlib.util
import math
import re
import string
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import UserError

RULES = ("format", "length", "regex")
GENERATION_REWARDS = ("exact", "countdown")
FORMAT_RE = re.compile(r"\s*<think>.*?</think>\s*<answer>.*?</answer>\s*", re.DOTALL)
_TRAILING_PUNCT = string.punctuation + "\u3002\uff01\uff1f\u2026"  # ASCII + the common CJK/ellipsis enders


class RewardFunctionError(UserError):
    """A reward function returned something that is not a finite float (names the function)."""


def normalize_answer(text: str) -> str:
    """strip, casefold, collapse whitespace runs to one space, strip trailing punctuation."""
    return " ".join(text.casefold().split()).rstrip(_TRAILING_PUNCT).rstrip()


def exact_reward(prompt, completion, reference) -> float:
    return 1.0 if normalize_answer(completion) == normalize_answer(reference) else 0.0


def format_reward(prompt, completion, reference) -> float:
    return 1.0 if FORMAT_RE.fullmatch(completion) else 0.0


def _length_reward(low, high):
    def length_reward(prompt, completion, reference) -> float:
        n = len(completion)
        if n < low:
            return max(0.0, 1.0 - (low - n) / low)
        if n > high:
            return max(0.0, 1.0 - (n - high) / high)
        return 1.0
    return length_reward


def _regex_reward(pattern):
    def regex_reward(prompt, completion, reference) -> float:
        return 1.0 if pattern.search(completion) else 0.0
    return regex_reward


def _parse_rule(body: str, where: str):
    name, _, arg = body.partition("=")
    if name == "format" and not arg:
        return format_reward
    if name == "length":
        try:
            low, high = (int(v) for v in arg.split(","))
        except ValueError:
            raise UserError(f"{where}: rule:length takes bounds in characters, rule:length=LO,HI "
                            f"(e.g. rule:length=20,200), got {body!r}") from None
        if not 1 <= low <= high:
            raise UserError(f"{where}: rule:length needs 1 <= LO <= HI, got {low},{high}")
        return _length_reward(low, high)
    if name == "regex" and arg:
        try:
            return _regex_reward(re.compile(arg))
        except re.error as e:
            raise UserError(f"{where}: rule:regex pattern {arg!r} does not compile: {e}") from None
    raise UserError(f"{where}: unknown rule {body!r}; the rules are rule:format, rule:length=LO,HI, "
                    f"rule:regex=PATTERN")


def load_user_function(spec: str, where: str = "--reward"):
    """FUNC from the Python file PATH of 'PATH.py:FUNC' (the user's own code, imported from that path)."""
    path, _, func = spec.rpartition(":")
    if not path.endswith(".py") or not func.isidentifier():
        raise UserError(f"{where}: a reward function is PATH.py:FUNC (e.g. my_reward.py:reward), got {spec!r}")
    file = Path(path)
    if not file.is_file():
        raise UserError(f"{where}: {path}: no such file")
    module_spec = importlib.util.spec_from_file_location(f"fucina_user_reward_{file.stem}", file)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:  # the user's module failed to import: one line naming it
        raise UserError(f"{where}: importing {path} failed: {type(e).__name__}: {e}") from None
    fn = getattr(module, func, None)
    if not callable(fn):
        raise UserError(f"{where}: {path} defines no function {func!r}")
    return fn


def checked(fn, name: str):
    """fn wrapped so that anything but a finite real number (bool excluded) is one clear error naming it."""
    def call(prompt, completion, reference) -> float:
        value = fn(prompt, completion, reference)
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
            raise RewardFunctionError(f"reward function {name} returned {type(value).__name__} {value!r}; "
                                      "it must return a finite float")
        value = float(value)
        if not math.isfinite(value):
            raise RewardFunctionError(f"reward function {name} returned {value}; it must return a finite float")
        return value
    return call


def parse_reward(spec: str, where: str = "--reward"):
    """The reward function of a --reward spec other than nll: (prompt, completion, reference) -> float."""
    if spec == "exact":
        fn, name = exact_reward, "exact"
    elif spec == "countdown":
        from .countdown import countdown_reward
        fn, name = countdown_reward, "countdown"
    elif spec.startswith("rule:"):
        fn, name = _parse_rule(spec[len("rule:"):], where), spec
    elif ":" in spec:
        fn, name = load_user_function(spec, where), spec
    else:
        raise UserError(f"{where}: unknown reward {spec!r}; use nll, exact, countdown, rule:format, "
                        f"rule:length=LO,HI, rule:regex=PATTERN or PATH.py:FUNC")
    return checked(fn, name)


# --- scorers: one member's reward on a batch of item indices --------------------------------
@dataclass
class Item:
    """One scoring item: the prompt text, its generation-prompt ids, the reference the reward compares to."""
    prompt: str
    prompt_ids: np.ndarray
    reference: str


class NLLScorer:
    """reward = -token-weighted mean CE of the batch's samples (the teacher-forced reference responses)."""

    kind = "nll"

    def __init__(self, samples):
        self.samples = samples

    def __len__(self):
        return len(self.samples)

    def bind(self, model_path):
        return self

    def score(self, trainer, idx) -> float:
        from .finetune import batch_loss
        return -batch_loss(trainer, [self.samples[i] for i in idx])

    def score_members(self, trainer, stacked: dict, idx, member_batch: int) -> list[float]:
        """Every member of stacked {searched name: (members, ...)} on the batch idx, member_batch per pass."""
        from .batched import chunked, member_nll_rewards
        samples = [self.samples[i] for i in idx]
        return chunked(lambda rows: member_nll_rewards(trainer, rows, samples), stacked, member_batch)


@dataclass
class GenerationScorer:
    """reward = mean over the batch of reward(prompt, greedy completion, reference).

    Picklable before bind(): member processes receive the spec string and the
    items, and bind() there loads the tokenizer and the reward function (a
    user's file is imported in the process that calls it). Completions are
    decoded in lock-step (pipeline/es/batched.py): the batch's prompts together,
    and with score_members member_batch members together, the same bits.
    """
    items: list
    spec: str
    stop_ids: frozenset
    max_new_tokens: int
    kind: str = "generate"
    _fn: object = field(default=None, repr=False)
    _tokenizer: object = field(default=None, repr=False)

    def __len__(self):
        return len(self.items)

    def __getstate__(self):
        return {**self.__dict__, "_fn": None, "_tokenizer": None}

    def bind(self, model_path, tokenizer=None):
        if tokenizer is None:
            from ..llm.tokenizer import load_tokenizer as _load_tokenizer
            from ..llm.gguf import open_gguf
            tokenizer = _load_tokenizer(open_gguf(model_path))
        self._tokenizer, self._fn = tokenizer, parse_reward(self.spec)
        return self

    def completions(self, trainer, stacked: dict, k: int, idx) -> list:
        """[member][item] completion texts of k members (stacked {}: the trainer's live adapters, k = 1)."""
        from .batched import member_generations
        prompts = [self.items[i].prompt_ids for i in idx]
        ids = member_generations(trainer, stacked, k, prompts, self.max_new_tokens, self.stop_ids)
        return [[self._tokenizer.decode(c) for c in member] for member in ids]

    def _mean_reward(self, texts, idx) -> float:
        total = 0.0
        for text, i in zip(texts, idx):
            item = self.items[i]
            total += self._fn(item.prompt, text, item.reference)
        return total / len(idx)

    def score(self, trainer, idx) -> float:
        return self._mean_reward(self.completions(trainer, {}, 1, idx)[0], idx)

    def score_members(self, trainer, stacked: dict, idx, member_batch: int) -> list[float]:
        """Every member of stacked {searched name: (members, ...)} on the batch idx, member_batch per pass."""
        from .batched import chunked

        def chunk(rows):
            k = len(next(iter(rows.values())))
            return [self._mean_reward(texts, idx) for texts in self.completions(trainer, rows, k, idx)]

        return chunked(chunk, stacked, member_batch)
