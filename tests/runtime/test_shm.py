"""Shared-memory segments: layout, attach, versions, and unlink on every kind of exit."""
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import numpy as np
import pytest

from pipeline.runtime import shm


@pytest.fixture
def run_id():
    rid = "test" + uuid.uuid4().hex[:8]
    yield rid
    shm.unlink_run(rid)


def test_layout_is_aligned_and_sized():
    specs, size = shm.layout([("a", (3,), np.float32), ("b", (2, 5), np.int64), ("c", (0,), np.float32)])
    assert [s.offset % shm.ALIGN for s in specs] == [0, 0, 0]
    assert specs[0].offset == shm.HEADER_BYTES
    assert specs[1].offset >= specs[0].offset + 12 and size >= specs[1].offset + 80


def test_create_attach_share_bytes_and_version(run_id):
    owner = shm.Registry(run_id, "optimizer")
    seg = owner.create("params", [("w", (4, 3), np.float32), ("step", (1,), np.int64)])
    seg.tensors["w"][...] = np.arange(12, dtype=np.float32).reshape(4, 3)
    seg.version = 41
    desc = seg.describe("w")
    assert desc["segment"] == seg.name and desc["shape"] == [4, 3] and desc["version"] == 41
    reader = shm.Registry(run_id, "trainer")
    other = reader.attach(seg.name, seg.layout_wire())
    np.testing.assert_array_equal(other.tensors["w"], seg.tensors["w"])
    assert other.version == 41
    other.tensors["w"][0, 0] = -1  # same memory
    assert seg.tensors["w"][0, 0] == -1
    reader.close()
    assert shm.run_segments(run_id) == [seg.name]  # a reader never unlinks
    owner.close()
    assert shm.run_segments(run_id) == []


def test_attach_missing_segment_names_it(run_id):
    reg = shm.Registry(run_id, "x")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        reg.attach(shm.run_prefix(run_id) + "nope", [])


def test_view_past_the_end_is_refused(run_id):
    reg = shm.Registry(run_id, "x")
    seg = reg.create("small", [("a", (2,), np.float32)])
    bad = [{"name": "a", "dtype": "float32", "shape": [1000], "offset": 64}]
    with pytest.raises(ValueError, match="runs past the segment end"):
        shm.Registry(run_id, "y").attach(seg.name, bad)
    reg.close()


def test_unlink_run_removes_every_prefixed_segment(run_id):
    reg = shm.Registry(run_id, "loader")
    reg.create("a", [("x", (8,), np.float32)])
    reg.create("b", [("x", (8,), np.float32)])
    assert len(shm.run_segments(run_id)) == 2
    removed = shm.unlink_run(run_id)
    assert len(removed) == 2 and shm.run_segments(run_id) == []
    reg.close()  # tolerates segments already gone


CHILD = textwrap.dedent("""
    import sys, time
    import numpy as np
    from pipeline.runtime import shm
    shm.exit_on_signals()
    reg = shm.Registry(sys.argv[1], "child")
    reg.create("buf", [("x", (1024,), np.float32)])
    print("ready", flush=True)
    if sys.argv[2] == "fatal":
        raise RuntimeError("boom")
    # Short sleeps, like a worker's poll loop: the kernel may deliver the signal to a BLAS thread, and then
    # the main thread runs Python's handler only when its current sleep ends (a 60 s sleep timed the test out).
    for _ in range(600):
        time.sleep(0.1)
""")


@pytest.mark.parametrize("how", ["sigterm", "sigint", "fatal"])
def test_child_unlinks_on_sigterm_ctrl_c_and_fatal_error(run_id, how):
    # A shell without job control starts background jobs with SIGINT ignored, and children inherit that: the
    # child gets Ctrl-C's default disposition (KeyboardInterrupt) whatever shell started pytest.
    p = subprocess.Popen([sys.executable, "-c", CHILD, run_id, how], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert p.stdout.readline().strip() == b"ready"
    if how != "fatal":
        assert len(shm.run_segments(run_id)) == 1
        p.send_signal(signal.SIGTERM if how == "sigterm" else signal.SIGINT)
    p.wait(20)
    deadline = time.time() + 5
    while shm.run_segments(run_id) and time.time() < deadline:
        time.sleep(0.05)
    assert shm.run_segments(run_id) == []
