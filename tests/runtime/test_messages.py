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
