"""Message schemas: round trip, and every malformed frame is dropped (logged), never raised."""
import logging

import msgpack
import pytest

from pipeline.runtime import messages


def test_round_trip_keeps_fields_and_header():
    frame = messages.pack("grad_done", 7, worker="trainer-1", gen=0, k=3, loss=0.25, rows=16, ms=1.5)
    msg = messages.decode(frame)
    assert msg["kind"] == "grad_done" and msg["v"] == messages.SCHEMA_VERSION
    assert msg["step"] == 7 and msg["k"] == 3 and msg["loss"] == 0.25
    assert isinstance(msg["seq"], int)


def test_sequence_numbers_increase():
    a = messages.make("bye", worker="x")
    b = messages.make("bye", worker="x")
    assert b["seq"] > a["seq"]


def test_make_refuses_unknown_kind_and_missing_fields():
    with pytest.raises(messages.MessageError, match="unknown kind"):
        messages.make("teleport")
    with pytest.raises(messages.MessageError, match="missing field"):
        messages.make("grad_done", worker="t")


@pytest.mark.parametrize("frame, why", [
    (b"\x81\xa4kind\x91\x01", "unknown kind [1]"),  # {"kind": [1]}: unhashable, crashed the scheduler once
    (msgpack.packb({"kind": "hello", "v": 1, "step": 0, "seq": 0, "role": "optimizer", "worker": "w", "pid": "1",
                    "token": "t"}), "field 'pid' is not a non-negative int"),
    (msgpack.packb({"kind": "hello", "v": 1, "step": 0, "seq": 0, "role": "admin", "worker": "w", "pid": 1,
                    "token": "t"}), "field 'role' is not one of"),
    (msgpack.packb({"kind": "grad_done", "v": 1, "step": True, "seq": 0, "worker": "w", "gen": 0, "k": 0,
                    "loss": 0.0, "rows": 1, "ms": 0.0}), "field 'step' is not a non-negative int"),
    (msgpack.packb({"kind": "loaded", "v": 1, "step": 0, "seq": 0, "worker": "w", "gen": 0, "k": 0, "slot": 0,
                    "batch": {"segment": "s"}, "ms": 0.0}), "field 'batch' is not a segment descriptor"),
    (msgpack.packb({"kind": "bye", "v": 1.0, "step": 0, "seq": 0, "worker": "w"}), "schema version"),
    (b"\x00" * (messages.MAX_FRAME_BYTES + 1), "the limit is"),
    (msgpack.packb({"kind": "teleport", "v": 1, "step": 0, "seq": 0}), "unknown kind"),
    (msgpack.packb({"kind": "bye", "v": 99, "step": 0, "seq": 0, "worker": "w"}), "schema version"),
    (msgpack.packb({"kind": "bye", "v": 1, "step": 0, "seq": 0}), "missing"),
    (msgpack.packb([1, 2, 3]), "not a map"),
    (b"\xc1\xff garbage", "not msgpack"),
])
def test_bad_frames_are_logged_and_dropped(frame, why, caplog):
    with caplog.at_level(logging.WARNING, logger="fucina.messages"):
        assert messages.decode(frame) is None
    assert why in caplog.text


def test_no_pickle_on_the_wire():
    frame = messages.pack("event", event="x", detail={"a": [1, 2.5, "s", None, True]})
    assert b"\x80\x04" not in frame[:2]  # not a pickle protocol header
    assert msgpack.unpackb(frame)["detail"] == {"a": [1, 2.5, "s", None, True]}


def _decode_raises_only_message_error(frame):
    try:
        msg = messages.parse(frame)
    except messages.MessageError:
        assert messages.decode(frame) is None
        return
    assert msg["kind"] in messages.KINDS and messages.decode(frame) == msg


def _frames():
    from wire_fuzz import frames
    names = {f for fields in (*messages.KINDS.values(), *messages.OPTIONAL.values()) for f in fields}
    return frames(messages.KINDS, names | set(messages.HEADER), messages.SCHEMA_VERSION)


def test_decode_raises_only_message_error_fuzz():
    import wire_fuzz
    wire_fuzz.run(wire_fuzz.QUICK, _frames(), _decode_raises_only_message_error)


@pytest.mark.slow
def test_decode_raises_only_message_error_long_fuzz():
    import wire_fuzz
    wire_fuzz.run(wire_fuzz.LONG, _frames(), _decode_raises_only_message_error)
