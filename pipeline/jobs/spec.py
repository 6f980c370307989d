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


def field(default, help: str, choices=None, aliases=(), metavar=None):  # noqa: A002 - mirrors argparse
    """A spec field: its flag is `--name-with-dashes` (and any `aliases`, other spellings of the same flag)."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices, "aliases": tuple(aliases),
                                                        "metavar": metavar})


NONFINITE_POLICIES = ("stop", "skip")


def on_nonfinite_field():
    """The `on_nonfinite` field every training spec has (pipeline/runtime: a NaN/inf is never applied)."""
    return field("stop", "a NaN/inf loss or gradient: stop the run naming the step, worker and tensor (the last "
                 "good checkpoint stays latest), or skip that micro-batch and report it", choices=NONFINITE_POLICIES)


def tensorboard_field():
    """The `tensorboard` field of every job that writes metrics.jsonl (runtime/metrics.MetricsLog)."""
    return field("", "also write the step records (training loss, validation loss, lr, tokens/s) as TensorBoard "
                 "scalars to an event file in DIR, created if missing (`tensorboard --logdir DIR`; no TensorBoard "
                 "install needed to write it); empty: off", metavar="DIR")


def add_flags(parser: argparse.ArgumentParser, spec_cls):
    """One flag per spec field (`fucina launch JOB`); defaults are None so we can tell 'not given'."""
    parser.add_argument("--config", metavar="FILE.toml", help="TOML file of job fields (flags override it)")
    group = parser.add_argument_group(f"{spec_cls.__name__} fields (override the TOML/defaults)")
    add_field_flags(group, spec_cls)


def add_field_flags(parser, spec_cls, names=None, dest="job_{}", defaults=False, unset=(), overrides=None):
    """The flags of spec_cls's fields (all, or those in `names`, in that order): `--name-with-dashes` plus the
    field's aliases, its help (with its default), type and choices. The one place a field becomes a flag: launch
    (add_flags) and the commands that run a job's spec (finetune, es-finetune) both call it.

    dest: the attribute pattern ("{}" is the field's name). defaults False: every default None ('not given',
    what launch's precedence needs); True: the field's own default, but None for the `unset` names (a command
    that tells 'not given' from a value). overrides: {name: argparse keywords} a command adds (required, an
    input-file type, a metavar)."""
    fields = {f.name: f for f in dataclasses.fields(spec_cls)}
    for name in names or list(fields):
        f = fields[name]
        flags = ["--" + f.name.replace("_", "-"), *f.metadata.get("aliases", ())]
        shown = "off" if f.default is False else f.default  # a bare "False" reads as a value to pass
        suffix = "" if f.default == "" else f" (default: {shown})"  # an empty default: the help says what it means
        help_text = f"{f.metadata.get('help', '')}{suffix}".replace("%", "%%")  # argparse formats it
        default = f.default if defaults and name not in unset else None
        kwargs = dict(dest=dest.format(f.name), default=default, help=help_text)
        if f.type in ("bool", bool):
            kwargs.update(action=argparse.BooleanOptionalAction)
        else:
            kwargs.update(type=_type_of(f), choices=f.metadata.get("choices"),
                          metavar=f.metadata.get("metavar") or f.name.upper())
        kwargs.update((overrides or {}).get(name, {}))
        parser.add_argument(*flags, **kwargs)


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
