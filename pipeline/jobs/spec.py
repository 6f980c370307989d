"""Job specs: a dataclass of typed fields, filled from defaults, a TOML file and flags.

Precedence: dataclass default < TOML file (`--config FILE`) < explicit flag.
Every field is a flag (`steps` -> `--steps N`, `micro_batches` ->
`--micro-batches N`), with the field's `help` metadata as its help text.

Trade-off: flat specs only (no nested tables) - every knob has exactly one
spelling on the command line, in TOML and in the checkpoint metadata.
"""
from __future__ import annotations

import argparse
import dataclasses
import tomllib

from ..errors import UserError

_SCALARS = (int, float, str, bool)


def field(default, help: str, choices=None):  # noqa: A002 - mirrors argparse
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices})


NONFINITE_POLICIES = ("stop", "skip")


def on_nonfinite_field():
    """The `on_nonfinite` field every training spec has (pipeline/runtime: a NaN/inf is never applied)."""
    return field("stop", "a NaN/inf loss or gradient: stop the run naming the step, worker and tensor (the last "
                 "good checkpoint stays latest), or skip that micro-batch and report it", choices=NONFINITE_POLICIES)


def add_flags(parser: argparse.ArgumentParser, spec_cls):
    """One flag per spec field; defaults are None so we can tell 'not given'."""
    parser.add_argument("--config", metavar="FILE.toml", help="TOML file of job fields (flags override it)")
    group = parser.add_argument_group(f"{spec_cls.__name__} fields (override the TOML/defaults)")
    for f in dataclasses.fields(spec_cls):
        flag = "--" + f.name.replace("_", "-")
        shown = "off" if f.default is False else f.default  # a bare "False" reads as a value to pass
        help_text = f"{f.metadata.get('help', '')} (default: {shown})".replace("%", "%%")  # argparse formats it
        if f.type in ("bool", bool):
            group.add_argument(flag, dest=f"job_{f.name}", default=None, action=argparse.BooleanOptionalAction,
                               help=help_text)
        else:
            group.add_argument(flag, dest=f"job_{f.name}", default=None, type=_type_of(f),
                               choices=f.metadata.get("choices"), metavar=f.name.upper(), help=help_text)


def _type_of(f):
    return {"int": int, "float": float, "str": str}.get(f.type if isinstance(f.type, str) else f.type.__name__, str)


MAX_JOB_FILE_BYTES = 1 << 20  # a job file is a few flags: anything bigger is not one


def load_toml(path: str, spec_cls) -> dict:
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_JOB_FILE_BYTES + 1)
    except FileNotFoundError:
        raise UserError(f"{path}: no such job file") from None
    except OSError as e:
        raise UserError(f"{path}: cannot read the job file ({e.strerror or e})") from None
    if len(raw) > MAX_JOB_FILE_BYTES:
        raise UserError(f"{path}: a job file over {MAX_JOB_FILE_BYTES} bytes is refused")
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text (byte {e.start})") from None
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"{path}: not valid TOML: {e}") from None
    except RecursionError:  # tomllib recurses per nested array/table: a hostile file nests 100,000 deep
        raise UserError(f"{path}: not valid TOML: nested too deeply") from None
    return check_fields(data, spec_cls, where=path)


def check_fields(data: dict, spec_cls, where: str) -> dict:
    fields = {f.name: f for f in dataclasses.fields(spec_cls)}
    out = {}
    for key, value in data.items():
        name = key.replace("-", "_")
        if name not in fields:
            raise UserError(f"{where}: unknown field {key!r} for {spec_cls.__name__} (known: {', '.join(fields)})")
        want = _type_of(fields[name]) if fields[name].type not in ("bool", bool) else bool
        if want is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, want) or (want is int and isinstance(value, bool)):
            raise UserError(f"{where}: field {key!r} must be {want.__name__}, got {value!r}")
        choices = fields[name].metadata.get("choices")
        if choices and value not in choices:
            raise UserError(f"{where}: field {key!r} must be one of {choices}, got {value!r}")
        out[name] = value
    return out


def from_args(spec_cls, args) -> object:
    """Build a spec from parsed args: defaults < --config TOML < flags."""
    values = load_toml(args.config, spec_cls) if getattr(args, "config", None) else {}
    for f in dataclasses.fields(spec_cls):
        v = getattr(args, f"job_{f.name}", None)
        if v is not None:
            values[f.name] = v
    return build(spec_cls, values, where="flags")


def build(spec_cls, values: dict, where="spec"):
    spec = spec_cls(**check_fields(values, spec_cls, where))
    validate = getattr(spec, "validate", None)
    if validate:
        validate()
    return spec


def to_dict(spec) -> dict:
    return dataclasses.asdict(spec)
