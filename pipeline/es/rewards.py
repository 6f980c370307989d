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
    SPEC@WEIGHT       any of the above but nll, weighted; several specs compose into their weighted sum
                      (`--reward rule:regex=<answer>@0.2 --reward countdown`: format credit + correctness)

Trade-off: every generation reward scores the GREEDY completion (temperature 0,
ties to the lowest id) decoded through the KV cache with the member's adapters
in the projections, so a member's reward is a pure function of its parameters:
no sampling noise competes with the ES noise, and the bits do not depend on
threads or workers. The price is that a member explores only through its
perturbation, never through sampling.

A user's reward file is the user's own code, named on the command line: it is
imported (importlib, from that path) in every process that scores members.
Model output is only ever passed to it as a string; nothing here evals it.
Its function is checked at load time to take (prompt, completion, reference),
and every call runs under limits (`call_limited`): a wall-clock timeout
(SIGALRM, in the main thread, where every fucina process scores), its
stdout/stderr captured and at most OUTPUT_CAP characters of it passed on, and
an exception or a bad return value stops the run with ONE line naming the
reward, the sample and what went wrong (a reward that breaks is a bug to fix,
not a score to guess; so it is fatal, rc 2, never a silent 0).
"""
from __future__ import annotations

import contextlib
import importlib.util
import inspect
import math
import re
import signal
import string
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import UserError

RULES = ("format", "length", "regex")
GENERATION_REWARDS = ("exact", "countdown")
FORMAT_RE = re.compile(r"\s*<think>.*?</think>\s*<answer>.*?</answer>\s*", re.DOTALL)
_TRAILING_PUNCT = string.punctuation + "\u3002\uff01\uff1f\u2026"  # ASCII + the common CJK/ellipsis enders


DEFAULT_TIMEOUT = 10.0  # seconds one call of a user's reward function may take (--reward-timeout)
OUTPUT_CAP = 4096  # characters of one call's captured stdout+stderr passed on to stderr; the rest is dropped
SPEC_SEP = "\n"  # several --reward specs travel as one string (job specs, checkpoints) joined by this


class RewardFunctionError(UserError):
    """A reward function raised, timed out or returned something that is not a finite float (names it)."""


class _RewardTimeout(BaseException):
    """Raised inside a user's reward by SIGALRM (BaseException: its `except Exception` cannot swallow it)."""


class _BoundedText:
    """A text sink keeping the first `cap` characters written and counting the rest (bounded memory)."""

    def __init__(self, cap):
        self.cap, self.parts, self.kept, self.dropped = cap, [], 0, 0

    def write(self, text):
        text = str(text)
        room = self.cap - self.kept
        if room > 0:
            self.parts.append(text[:room])
            self.kept += min(room, len(text))
        self.dropped += max(0, len(text) - max(room, 0))
        return len(text)

    def flush(self):
        pass

    def isatty(self):
        return False

    def text(self):
        return "".join(self.parts)


def call_limited(fn, args, timeout, name, sink=None):
    """fn(*args) with its stdout/stderr captured (OUTPUT_CAP characters passed on to `sink`, default the real
    stderr) and, for timeout > 0, stopped after `timeout` seconds by SIGALRM (-> RewardFunctionError)."""
    if timeout and timeout > 0 and threading.current_thread() is not threading.main_thread():
        raise UserError(f"reward function {name}: --reward-timeout is enforced by SIGALRM, which only the main "
                        "thread receives; score in the main thread or pass --reward-timeout 0")
    out = _BoundedText(OUTPUT_CAP)
    armed = timeout and timeout > 0

    def on_alarm(signum, frame):
        raise _RewardTimeout()

    old = signal.signal(signal.SIGALRM, on_alarm) if armed else None
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            if armed:
                signal.setitimer(signal.ITIMER_REAL, float(timeout))
            try:
                return fn(*args)
            finally:
                if armed:
                    signal.setitimer(signal.ITIMER_REAL, 0)
    except _RewardTimeout:
        raise RewardFunctionError(f"reward function {name} took longer than --reward-timeout {timeout:g} s") \
            from None
    finally:
        if armed:
            signal.signal(signal.SIGALRM, old)
        if out.kept or out.dropped:
            more = f" [... {out.dropped} more characters dropped]" if out.dropped else ""
            print(f"[reward {name} printed] {out.text()}{more}", file=sink or sys.stderr, flush=True)


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
    try:
        inspect.signature(fn).bind("prompt", "completion", "reference")
    except TypeError:
        raise UserError(f"{where}: {spec}: {func}{_signature(fn)} cannot be called as {func}(prompt, completion, "
                        "reference); a reward function takes those three strings") from None
    except ValueError:  # no signature to inspect (a builtin): the first call will tell
        pass
    return fn


def _signature(fn) -> str:
    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):
        return "(...)"


def _short(text, n=60) -> str:
    text = str(text)
    return repr(text if len(text) <= n else text[:n] + "...")


def as_reward_value(value, name: str, where: str = "") -> float:
    """value as a float if it is a finite real number (bool excluded), else one RewardFunctionError naming it."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        text = repr(value)
        text = text if len(text) <= 60 else text[:60] + "..."
        raise RewardFunctionError(f"reward function {name} returned {type(value).__name__} {text}{where}; "
                                  "it must return a finite float")
    try:
        number = float(value)
    except OverflowError:  # a Python int beyond float range, e.g. 10**400
        raise RewardFunctionError(f"reward function {name} returned an int of {len(str(abs(int(value))))} digits "
                                  f"(too large for a float){where}; it must return a finite float") from None
    if not math.isfinite(number):
        raise RewardFunctionError(f"reward function {name} returned {number}{where}; it must return a finite float")
    return number


def checked(fn, name: str, user: bool = False, timeout: float = DEFAULT_TIMEOUT):
    """fn wrapped so that a bad return value (and, for a user's function, an exception or a timeout) is one
    clear RewardFunctionError naming the reward and the sample. The wrapper takes an optional `sample`
    (the item's index) for that message; a user's function runs under call_limited."""
    def call(prompt, completion, reference, sample=None) -> float:
        where = "" if sample is None else f" on sample {sample}"
        if not user:
            return as_reward_value(fn(prompt, completion, reference), name, where)
        try:
            value = call_limited(fn, (prompt, completion, reference), timeout, name)
        except RewardFunctionError as e:
            raise RewardFunctionError(f"{e}{where}") from None
        except (Exception, SystemExit) as e:  # the user's code broke: one line, not its traceback
            raise RewardFunctionError(f"reward function {name} raised {type(e).__name__}: {e}{where} (prompt "
                                      f"{_short(prompt)}, completion {_short(completion)})") from None
        return as_reward_value(value, name, where)
    return call


_WEIGHT = re.compile(r"(.+)@([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)")


def split_specs(spec: str) -> list[tuple[str, float, bool]]:
    """[(spec, weight, weighted)] of a --reward value: specs joined by SPEC_SEP, each SPEC or SPEC@WEIGHT."""
    out = []
    for part in spec.split(SPEC_SEP):
        m = _WEIGHT.fullmatch(part)
        if m is None:
            out.append((part, 1.0, False))
            continue
        weight = float(m.group(2))
        if not math.isfinite(weight):
            raise UserError(f"--reward {part!r}: the weight must be a finite number")
        out.append((m.group(1), weight, True))
    return out


def join_specs(specs) -> str:
    """One string for several --reward specs (what a job spec and a checkpoint record); refuses nll in a mix."""
    specs = list(specs)
    for s in specs:
        if SPEC_SEP in s:
            raise UserError(f"--reward {s!r}: a reward spec cannot contain a newline")
    if len(specs) > 1 and any(part == "nll" for s in specs for part, _, _ in split_specs(s)):
        raise UserError("--reward nll is the teacher-forced loss and does not compose with generation rewards; "
                        "give it alone")
    return SPEC_SEP.join(specs)


def describe(spec: str) -> str:
    """A reward spec for humans: 'countdown', or '0.2*rule:regex=<answer> + 1*countdown' for a composite."""
    parts = split_specs(spec)
    if len(parts) == 1 and not parts[0][2]:
        return parts[0][0]
    return " + ".join(f"{w:g}*{s}" for s, w, _ in parts)


def _one_reward(spec: str, where: str, timeout: float):
    if spec == "exact":
        return checked(exact_reward, "exact")
    if spec == "countdown":
        from .countdown import countdown_reward
        return checked(countdown_reward, "countdown")
    if spec.startswith("rule:"):
        return checked(_parse_rule(spec[len("rule:"):], where), spec)
    if ":" in spec:
        return checked(load_user_function(spec, where), spec, user=True, timeout=timeout)
    raise UserError(f"{where}: unknown reward {spec!r}; use nll, exact, countdown, rule:format, "
                    f"rule:length=LO,HI, rule:regex=PATTERN or PATH.py:FUNC, each optionally @WEIGHT")


def parse_reward(spec: str, where: str = "--reward", timeout: float = DEFAULT_TIMEOUT):
    """The reward function of a --reward spec other than nll: (prompt, completion, reference, sample=None) ->
    float. Several specs (joined by SPEC_SEP) give their weighted sum, summed in spec order in float64."""
    parts = split_specs(spec)
    if len(parts) == 1 and not parts[0][2]:
        return _one_reward(parts[0][0], where, timeout)
    for part, _, _ in parts:
        if part == "nll":
            raise UserError(f"{where}: nll does not compose with generation rewards; give it alone")
    fns = [(_one_reward(part, where, timeout), weight) for part, weight, _ in parts]

    def composite(prompt, completion, reference, sample=None) -> float:
        total = 0.0
        for fn, weight in fns:
            total += weight * fn(prompt, completion, reference, sample)
        return total
    return composite


def user_reward_files(spec: str) -> list[str]:
    """The PATH.py files of the user functions a --reward value names (what a member process must import)."""
    files = []
    for part, _, _ in split_specs(spec):
        path, _, func = part.rpartition(":")
        if path.endswith(".py") and func and not part.startswith("rule:"):
            files.append(path)
    return files


def tie_message(spec: str, value: float, population: int, iteration: int, sigma: float, shaping: str) -> str:
    """One line for an iteration whose members all scored the same: what happened and what to try."""
    step = ("z-score shaping gives every member coefficient 0, so ES took no step" if shaping == "z_score"
            else "centered ranks break the tie by member index, so the step is noise")
    advice = ["a larger --sigma (now {:g}) so members differ".format(sigma)]
    names = [p for p, _, _ in split_specs(spec)]
    if "countdown" in names:
        advice.insert(0, "an easier task (--task-numbers 2 --task-max-number 9)")
    if len(names) == 1:
        example = "'rule:regex=<answer>@0.2'" if "countdown" in names else "'rule:length=1,40@0.2'"
        advice.insert(1 if "countdown" in names else 0,
                      f"a partial-credit reward composed in (e.g. --reward {example} --reward {names[0]})")
    return (f"iteration {iteration}: all {population} members scored {describe(spec)} = {value:.6g}; {step}. "
            f"Try {', '.join(advice[:-1])} or {advice[-1]}")


# --- scorers: one member's reward on a batch of item indices --------------------------------
@dataclass
class Item:
    """One scoring item: the prompt text, its generation-prompt ids, the reference the reward compares to."""
    prompt: str
    prompt_ids: np.ndarray
    reference: str


def items_of(records, encoder, template, options) -> list:
    """Generation-reward items: a record's first user turn is the prompt, its last assistant turn the reference."""
    from ..llm.data import encode_prompt
    items = []
    for rec in records:
        reference = getattr(rec, "response", None)
        if reference is None:
            reference = next((c for role, c in reversed(rec.turns) if role == "assistant"), "")
        items.append(Item(rec.instruction, encode_prompt(encoder, template, rec.instruction, options), reference))
    return items


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
        from ..finetune.model import batch_loss
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
    timeout: float = DEFAULT_TIMEOUT
    _fn: object = field(default=None, repr=False)
    _tokenizer: object = field(default=None, repr=False)

    def __len__(self):
        return len(self.items)

    def __getstate__(self):
        return {**self.__dict__, "_fn": None, "_tokenizer": None}

    def bind(self, model_path, tokenizer=None):
        if tokenizer is None:
            from ..llm.tokenizer import load_tokenizer
            from ..llm.gguf import open_gguf
            tokenizer = load_tokenizer(open_gguf(model_path))
        self._tokenizer, self._fn = tokenizer, parse_reward(self.spec, timeout=self.timeout)
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
            total += self._fn(item.prompt, text, item.reference, i)
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
