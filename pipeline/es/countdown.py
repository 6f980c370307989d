"""The Countdown task (es-at-scale's demo): reach a target from a few numbers with + - * / and parentheses.

Problem i of seed s is a pure function of (s, i): its draws are the splitmix64
values at(at(s, i), k), k = 0, 1, ... (pipeline.es.noise.at), so a problem set
is the same on every platform and problem i does not depend on how many are
generated. A problem is built forwards: draw `n_numbers` numbers in [1, max_number]
(default 4 in [1, 99]), fold a random permutation of a random subset of at least
two of them with random operators, and keep the result as the target if it is a
positive integer <= 999 (else redraw from the next counter values). So every
problem has a solution, kept as the reference response for the NLL reward.
Fewer and smaller numbers make an easier task (a small model solves some of
them, which RL on a verifier needs); the defaults draw the same problems as
before the knob existed.

Reward (countdown_reward), on the content of the LAST <answer>...</answer> of
the completion:
    1.0  the expression parses, uses only the given numbers (each at most once)
         and evaluates exactly (fractions.Fraction) to the target
    0.1  it parses and uses only the given numbers, each at most once, but
         misses the target (or divides by zero): a well-formed answer
    0.0  anything else (no answer tag, a character outside digits, + - * / ( )
         and spaces, a number that was not given or is used twice, > 200 chars)
The expression is parsed by the small recursive-descent parser below (integer
literals, binary + - * /, parentheses, nesting depth <= 32); model text is
never eval'd.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

from ..errors import UserError
from .noise import at

N_NUMBERS = 4
MAX_NUMBER = 99
N_NUMBERS_RANGE = (2, 6)
MAX_NUMBER_RANGE = (1, 999)
MAX_TARGET = 999
MAX_EXPRESSION = 200
MAX_DEPTH = 32
PARTIAL_CREDIT = 0.1
_OPS = "+-*/"
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_REFERENCE = re.compile(r"numbers ((?:\d+ )*\d+) target (\d+)")


@dataclass(frozen=True)
class Problem:
    numbers: tuple
    target: int
    solution: str

    @property
    def prompt(self) -> str:
        listed = ", ".join(str(n) for n in self.numbers)
        return (f"Using the numbers {listed}, write an arithmetic expression that equals {self.target}. "
                f"You may use + - * / and parentheses, and each number at most once. "
                f"Put the expression inside <answer></answer>, for example <answer>(1 + 2) * 3</answer>.")

    @property
    def reference(self) -> str:
        """The machine-readable problem statement the reward reads back."""
        return f"numbers {' '.join(str(n) for n in self.numbers)} target {self.target}"


def _apply(op, a, b):
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    return None if b == 0 else a / b


def check_difficulty(n_numbers: int, max_number: int) -> None:
    for flag, value, (low, high) in (("--task-numbers", n_numbers, N_NUMBERS_RANGE),
                                     ("--task-max-number", max_number, MAX_NUMBER_RANGE)):
        if not low <= value <= high:
            raise UserError(f"countdown: {flag} must be in {low}..{high}, got {value}")


def problem(seed: int, index: int, n_numbers: int = N_NUMBERS, max_number: int = MAX_NUMBER) -> Problem:
    """Problem `index` of the set `seed` (deterministic; see the module docstring)."""
    check_difficulty(n_numbers, max_number)
    key = at(seed, index)
    k = 0

    def draw(n):
        nonlocal k
        k += 1
        return at(key, k - 1) % n

    while True:
        numbers = [1 + draw(max_number) for _ in range(n_numbers)]
        order = list(range(n_numbers))
        for i in range(n_numbers - 1, 0, -1):  # Fisher-Yates on the counter draws
            j = draw(i + 1)
            order[i], order[j] = order[j], order[i]
        used = order[:2 + draw(n_numbers - 1)]  # 2..n_numbers of them
        value, text = Fraction(numbers[used[0]]), str(numbers[used[0]])
        for pos in used[1:]:
            op = _OPS[draw(4)]
            value = _apply(op, value, Fraction(numbers[pos]))
            if value is None:
                break
            text = f"({text} {op} {numbers[pos]})" if pos != used[-1] else f"{text} {op} {numbers[pos]}"
        if value is not None and value.denominator == 1 and 0 < value <= MAX_TARGET:
            return Problem(tuple(numbers), int(value), text)


def problems(seed: int, n: int, n_numbers: int = N_NUMBERS, max_number: int = MAX_NUMBER) -> list[Problem]:
    if n < 1:
        raise UserError(f"--task countdown needs at least 1 problem, got {n}")
    return [problem(seed, i, n_numbers, max_number) for i in range(n)]


# --- the safe expression parser ----------------------------------------------------------------
class _Malformed(Exception):
    pass


def _tokens(text):
    out, i = [], 0
    while i < len(text):
        c = text[i]
        if c.isspace():
            i += 1
        elif c in "0123456789":
            j = i
            while j < len(text) and text[j] in "0123456789":
                j += 1
            out.append(int(text[i:j]))
            i = j
        elif c in _OPS + "()":
            out.append(c)
            i += 1
        else:
            raise _Malformed(c)
    return out


def parse_expression(text: str):
    """(value as a Fraction or None on division by zero, [numbers used in order]); _Malformed if it is not
    an expression of integer literals, binary + - * / and parentheses."""
    if len(text) > MAX_EXPRESSION:
        raise _Malformed("too long")
    toks, pos, used, zero_division = _tokens(text), 0, [], False

    def peek():
        return toks[pos] if pos < len(toks) else None

    def factor(depth):
        nonlocal pos
        tok = peek()
        if isinstance(tok, int):
            pos += 1
            used.append(tok)
            return Fraction(tok)
        if tok == "(" and depth < MAX_DEPTH:
            pos += 1
            value = expr(depth + 1)
            if peek() != ")":
                raise _Malformed("unclosed (")
            pos += 1
            return value
        raise _Malformed(repr(tok))

    def fold(sub, ops, depth):
        nonlocal pos, zero_division
        value = sub(depth)
        while peek() in ops:
            op = toks[pos]
            pos += 1
            rhs = sub(depth)
            if value is not None and rhs is not None:
                value = _apply(op, value, rhs)
                zero_division |= value is None
        return value

    def term(depth):
        return fold(factor, ("*", "/"), depth)

    def expr(depth):
        return fold(term, ("+", "-"), depth)

    value = expr(0)
    if pos != len(toks):
        raise _Malformed("trailing tokens")
    return (None if zero_division else value), used


def _uses_only_given(used, numbers) -> bool:
    pool = list(numbers)
    for n in used:
        if n not in pool:
            return False
        pool.remove(n)
    return True


def countdown_reward(prompt, completion, reference) -> float:
    """1.0 correct, PARTIAL_CREDIT for a well-formed answer, 0.0 otherwise (module docstring)."""
    m = _REFERENCE.fullmatch(reference)
    if m is None:
        raise UserError(f"countdown reward: the reference {reference!r} is not a countdown problem "
                        "('numbers A B C D target T'); use it with --task countdown")
    numbers, target = [int(v) for v in m.group(1).split()], int(m.group(2))
    answers = _ANSWER.findall(completion)
    if not answers:
        return 0.0
    try:
        value, used = parse_expression(answers[-1])
    except _Malformed:
        return 0.0
    if not _uses_only_given(used, numbers):
        return 0.0
    return 1.0 if value == target else PARTIAL_CREDIT
