"""TrainerState: everything besides tensors that a resume needs, as JSON.

It is the checkpoint's commit sentinel (`trainer_state.json`, written last),
so parsing it strictly is the commit test: a directory whose sentinel is
missing or does not validate is not a checkpoint.

Trade-off: a small fixed dataclass with free-form dict fields (seeds, loader,
schedule, config) rather than a schema per trainer: every field is required
and type-checked, the dicts are the trainers' own business.

Counters: `step` counts MICRO-batches (dropout streams key on it); an
optimizer step happens every `accum_steps` of them, so `macro_step` is what
schedules and optimizer slots count. Gradients are never saved, so a state is
only resumable on a window boundary (step % accum_steps == 0).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from ..errors import CheckpointError
from ..untrusted import brief, parse_json

FORMAT = "fucina.trainer_state/1"
MAX_DEPTH = 64  # the free-form dicts (config, loader, ...) nest a few levels; deeper is not ours


@dataclass
class TrainerState:
    """step: micro-batches done; accum_steps: micro-batches per optimizer step;
    seeds: named RNG seeds ({"init": 1, "data": 2}); loader: the data loader's
    position (seed, epoch, index, ...); schedule: the LR schedule's inputs
    (name, total, warmup, ...); config: the run config as started."""

    step: int
    accum_steps: int = 1
    seeds: dict = field(default_factory=dict)
    loader: dict = field(default_factory=dict)
    schedule: dict = field(default_factory=dict)
    config: dict = field(default_factory=dict)

    def __post_init__(self):
        self.validate("TrainerState")

    @property
    def macro_step(self) -> int:
        return self.step // self.accum_steps

    @property
    def on_boundary(self) -> bool:
        return self.step % self.accum_steps == 0

    def validate(self, source: str) -> None:
        for name, kind in (("step", int), ("accum_steps", int)):
            value = getattr(self, name)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise CheckpointError(f"{source}: field {name!r} must be an integer, got {brief(value)}")
        if not 0 <= self.step < 2**63:
            raise CheckpointError(f"{source}: field 'step' must be >= 0 and < 2^63, got {self.step}")
        if not 1 <= self.accum_steps < 2**63:
            raise CheckpointError(f"{source}: field 'accum_steps' must be >= 1 and < 2^63, got {self.accum_steps}")
        for name in ("seeds", "loader", "schedule", "config"):
            if not isinstance(getattr(self, name), dict):
                value = getattr(self, name)
                raise CheckpointError(f"{source}: field {name!r} must be a JSON object, got {brief(value)}")
        for key, seed in self.seeds.items():
            # the counter RNG (pipeline/kernels/rng.py) takes a seed as a uint64
            if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**64:
                raise CheckpointError(f"{source}: seed {key!r} must be an integer in [0, 2^64), got {brief(seed)}")

    def require_boundary(self, source: str = "checkpoint") -> None:
        """Refuse a state in the middle of an accumulation window."""
        if not self.on_boundary:
            raise CheckpointError(
                f"{source}: step {self.step} is inside an accumulation window of {self.accum_steps} micro-batches "
                "(partial gradients are never saved); resume only from a step that is a multiple of accum_steps")

    def to_json(self) -> str:
        try:
            return json.dumps({"format": FORMAT, **asdict(self)}, indent=2, sort_keys=True, allow_nan=False) + "\n"
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"TrainerState: not JSON-serialisable ({e})") from None

    @classmethod
    def from_json(cls, text: str, source: str = "trainer_state.json") -> "TrainerState":
        raw = parse_json(text, source, CheckpointError, max_depth=MAX_DEPTH)
        if not isinstance(raw, dict):
            raise CheckpointError(f"{source}: expected a JSON object")
        if raw.get("format") != FORMAT:
            raise CheckpointError(f"{source}: field 'format' is {raw.get('format')!r}, expected {FORMAT!r}")
        names = [f.name for f in fields(cls)]
        missing = [n for n in names if n not in raw]
        if missing:
            raise CheckpointError(f"{source}: missing field {', '.join(repr(n) for n in missing)}")
        unknown = sorted(set(raw) - set(names) - {"format"})
        if unknown:
            raise CheckpointError(f"{source}: unknown field {', '.join(repr(n) for n in unknown)}")
        state = cls.__new__(cls)
        for n in names:
            setattr(state, n, raw[n])
        state.validate(source)
        return state

    @classmethod
    def read(cls, path) -> "TrainerState":
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: cannot read: {getattr(e, 'strerror', None) or e}") from None
        return cls.from_json(text, source=str(path))
