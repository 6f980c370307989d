"""Every message kind on the wire, in one module (the zguide/jupyter_client way).

Wire format: one ZeroMQ frame holding a msgpack map
    {"kind": str, "v": SCHEMA_VERSION, "step": int, "seq": int, ...fields}
Tensors never travel in messages: they live in shared memory and messages carry
descriptors (see shm.py). msgpack only, never pickle: a peer can send us bytes
but never code. The one exception is a trainer started with --remote: its
tensors follow the message as raw buffer frames whose count and sizes the
receiver checks against the layout it knows (remote.py).

Trade-off: schemas are plain dicts checked against a table of typed fields
rather than classes; that keeps encode/decode one function each and lets a
monitor written in any language read the stream. Every field of every kind is
checked for its type (ints are ints, never bools or floats; roles are known
names; descriptors have the shape shm.py reads), so a handler never meets a
value it did not expect: a frame that is not msgpack, not a map, of an
unknown kind or version, missing a field or carrying a mistyped one is logged
and dropped by `decode` (returns None) - a bad peer can never crash a worker.
Ranges that depend on the run (k < micro_batches, a task this peer was
assigned) are the scheduler's to check.
"""
from __future__ import annotations

import itertools
import logging

import msgpack

from ..errors import FucinaError

SCHEMA_VERSION = 1
MAX_FRAME_BYTES = 16 << 20   # control frames are descriptors and scalars; ZeroMQ drops longer ones unread
MAX_STR = 1 << 16            # an error text or a path, never a payload
ROLES = ("loader", "optimizer", "checkpointer", "trainer", "es_member")
log = logging.getLogger("fucina.messages")


class MessageError(FucinaError, ValueError):
    """A message we refuse: raised by `make` for what we would not send, by `parse` for what we received."""


# --- field types: each a predicate with a name for the error message ---------------------------------
def _is_int(v):
    return type(v) is int and 0 <= v < 1 << 63   # bool is an int subclass: refused


def _is_num(v):
    return type(v) in (int, float) and (type(v) is float or abs(v) < 1 << 63)


def _is_str(v):
    return type(v) is str and len(v) <= MAX_STR


def _is_tensor(v):
    return (type(v) is dict and _is_str(v.get("name")) and _is_str(v.get("dtype")) and _is_int(v.get("offset"))
            and type(v.get("shape")) is list and all(_is_int(d) for d in v["shape"]))


def _is_tensors(v):
    return type(v) is list and all(_is_tensor(t) for t in v)


def _is_desc(v):
    """A shared-memory segment descriptor: {segment, tensors: [{name, dtype, shape, offset}], owner}."""
    return type(v) is dict and _is_str(v.get("segment")) and _is_str(v.get("owner")) and _is_tensors(v.get("tensors"))


def _is_run(v):
    return (type(v) is dict and all(_is_str(v.get(f)) for f in ("run_id", "run_dir", "job"))
            and type(v.get("spec")) is dict)


def _is_roles(v):
    return type(v) is dict and all(type(k) is str and _is_num(x) for k, x in v.items())


INT = ("a non-negative int", _is_int)
NUM = ("a number", _is_num)
STR = ("a string", _is_str)
BOOL = ("a bool", lambda v: type(v) is bool)
MAP = ("a map", lambda v: type(v) is dict)
ROLE = (f"one of {', '.join(ROLES)}", lambda v: v in ROLES if type(v) is str else False)
DESC = ("a segment descriptor", _is_desc)
TENSORS = ("a list of tensor specs", _is_tensors)
RUN = ("a run description", _is_run)
NUMS_BY_ROLE = ("a map of role -> number", _is_roles)
INTS = ("a list of non-negative ints", lambda v: type(v) is list and all(_is_int(x) for x in v))
NUMS = ("a list of numbers", lambda v: type(v) is list and all(_is_num(x) for x in v))
OPT_NUMS = ("a list of numbers or nil", lambda v: v is None or NUMS[1](v))
OPT_NUM = ("a number or nil", lambda v: v is None or _is_num(v))
BLOBS = ("a list of byte strings", lambda v: type(v) is list and all(type(x) is bytes for x in v))
HEADER = {"v": INT, "step": INT, "seq": INT}

# kind -> {field: type} required (beyond kind/v/step/seq), then optional fields.  Control plane first.
KINDS: dict[str, dict] = {
    # worker -> scheduler
    "hello": {"role": ROLE, "worker": STR, "pid": INT, "token": STR},  # token: secret of its heartbeats
    "heartbeat": {"worker": STR},                                    # both ways (scheduler echoes)
    "loaded": {"worker": STR, "gen": INT, "k": INT, "slot": INT, "batch": DESC, "ms": NUM},  # a slot of `batch`
    "grad_done": {"worker": STR, "gen": INT, "k": INT, "loss": NUM, "rows": INT, "ms": NUM},  # grad slot k
    "stepped": {"worker": STR, "gen": INT, "lr": NUM, "grad_norm": NUM, "ms": NUM},  # version `step` published
    "snapshot_ready": {"worker": STR, "gen": INT, "segment": STR, "tensors": TENSORS, "meta": MAP},
    "ready": {"worker": STR, "gen": INT, "params": DESC, "grads": DESC},  # optimizer finished init/restore
    "committed": {"worker": STR, "path": STR, "ms": NUM},              # checkpointer wrote dir of `step`
    "failed": {"worker": STR, "error": STR},                          # a task failed; retrying will not fix it
    "bye": {"worker": STR},                                           # a worker exits cleanly
    # ES task kind (es_member role; `step` is the ES iteration): only member ids and scalar rewards per iteration
    "es_rewards": {"worker": STR, "members": INTS, "rewards": NUMS, "ms": NUM},  # rewards of its es_eval, in order
    "es_digested": {"worker": STR, "sha256": STR},                   # its replica's params sha256 at `step`
    # scheduler -> worker
    "welcome": {"worker": STR, "run": RUN},                 # handshake reply: run description
    "load": {"gen": INT, "k": INT, "slot": INT},            # loader: produce micro-batch (step, k) into slot
    "grad": {"gen": INT, "k": INT, "slot": INT, "batch": DESC, "params": DESC, "grads": DESC},  # trainer:
                                                            # forward+backward k against params version `step`
    "step": {"gen": INT, "micro_batches": INT},             # optimizer: reduce slots 0..M-1 in order, step
    "init": {"gen": INT, "resume": STR},                    # optimizer: (re)load state (resume dir or "")
    "snapshot": {"gen": INT},                               # optimizer: copy params+state to a shm segment
    "write": {"segment": STR, "tensors": TENSORS, "meta": MAP, "dir": STR},  # checkpointer: write a dir
    "shutdown": {"reason": STR},                            # any worker: exit now
    "params": {"gen": INT, "tensors": TENSORS},             # remote trainer: parameters of version `step`
                                                            # follow as buffer frames (remote.py)
    "es_state": {"tensors": TENSORS, "data": BLOBS},        # es_member: the replica's parameters at `step`
                                                            # (a state transfer: only when a member joins/lags)
    "es_eval": {"members": INTS, "catchup": OPT_NUMS},      # es_member: apply `catchup` (rewards of step-1) if
                                                            # it is at step-1, then score `members` at `step`
    "es_digest": {"catchup": OPT_NUMS},                     # es_member: reach `step` as in es_eval, send sha256
    # PUB (metrics and events)
    "metrics": {"loss": OPT_NUM, "lr": NUM, "grad_norm": NUM, "tokens_per_s": NUM, "step_ms": NUM,
                "roles": NUMS_BY_ROLE},
    "event": {"event": STR, "detail": MAP},
    "es_metrics": {"reward_mean": NUM, "reward_std": NUM, "reward_min": NUM, "reward_max": NUM,
                   "evals_per_s": NUM, "step_ms": NUM},  # an ES iteration `step` committed
}
OPTIONAL: dict[str, dict] = {
    "hello": {"remote": BOOL},          # a trainer that cannot map this host's shared memory (remote.py)
    "heartbeat": {"token": STR,         # a worker's: the token of its hello (the scheduler's echo has none)
                  "incarnation": STR},  # the scheduler's echo: which scheduler process answered (a restart)
    "grad_done": {"stale": BOOL,        # the trainer refused: its parameters are of another version
                  "nonfinite": STR},    # 'loss' or the tensor whose gradient held a NaN/inf (nothing written)
    "step": {"skip": INTS},             # micro-batches left out (non-finite, --on-nonfinite skip)
    "stepped": {"eval": OPT_NUM, "stop": BOOL},  # stop: the job stopped early at this step
    "ready": {"resume": STR, "stop": BOOL},      # stop: the checkpoint resumed is of a run that stopped early
    "shutdown": {"replace": BOOL,       # a supervisor should start a fresh process
                 "unused": BOOL},       # this run has no use for the role (a Procfile worker stands by)
    "metrics": {"total": INT, "eval": OPT_NUM, "eval_name": STR, "skipped": INTS,
                "gflop_per_s": NUM},    # the step's estimated GFLOP/s (job.flops_per_token)
    "es_metrics": {"total": INT, "eval": OPT_NUM, "eval_name": STR},
}

_seq = itertools.count()


def make(kind: str, step: int = 0, **fields) -> dict:
    """Build a message dict; refuses unknown kinds and missing fields early."""
    if kind not in KINDS:
        raise MessageError(f"message: unknown kind {kind!r} (known: {', '.join(sorted(KINDS))})")
    missing = [f for f in KINDS[kind] if f not in fields]
    if missing:
        raise MessageError(f"message {kind!r}: missing field(s) {missing}")
    return {"kind": kind, "v": SCHEMA_VERSION, "step": int(step), "seq": next(_seq), **fields}


def encode(msg: dict) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def pack(kind: str, step: int = 0, **fields) -> bytes:
    return encode(make(kind, step, **fields))


def parse(frame: bytes) -> dict:
    """bytes -> a message whose every field has its schema's type; anything else raises MessageError."""
    if len(frame) > MAX_FRAME_BYTES:
        raise MessageError(f"a frame of {len(frame)} bytes (the limit is {MAX_FRAME_BYTES})")
    try:
        msg = msgpack.unpackb(frame, raw=False, strict_map_key=False)
    except Exception as e:  # noqa: BLE001 - msgpack raises several types for garbage
        raise MessageError(f"a frame that is not msgpack ({len(frame)} bytes): {type(e).__name__}: {e}") from None
    if type(msg) is not dict:
        raise MessageError(f"a msgpack frame that is not a map: {type(msg).__name__}")
    kind = msg.get("kind")
    if type(kind) is not str or kind not in KINDS:  # a list or a map as kind is not even hashable
        raise MessageError(f"a message of unknown kind {short(kind)}")
    if msg.get("v") != SCHEMA_VERSION or type(msg.get("v")) is not int:
        raise MessageError(f"a {kind!r} message with schema version {short(msg.get('v'))} "
                           f"(we speak {SCHEMA_VERSION})")
    check_fields(msg, {**HEADER, **KINDS[kind]}, OPTIONAL.get(kind, {}))
    return msg


def check_fields(msg: dict, required: dict, optional: dict, error=MessageError):
    """Every required field present and every field of `required`/`optional` of its type, else `error`."""
    kind = msg["kind"]
    missing = [f for f in required if f not in msg]
    if missing:
        raise error(f"a {kind!r} message missing field(s) {missing}")
    for fields in (required, optional):
        for name, (what, ok) in fields.items():
            if name in msg and not ok(msg[name]):
                raise error(f"a {kind!r} message whose field {name!r} is not {what}: {short(msg[name])}")


def decode(frame: bytes) -> dict | None:
    """bytes -> message dict, or None (logged) when the frame is not a valid message."""
    try:
        return parse(frame)
    except MessageError as e:
        log.warning("dropped %s", e)
        return None


def short(value, limit=80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."

