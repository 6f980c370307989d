"""ZeroMQ transport: ROUTER<->DEALER, PUB/SUB, liveness, heartbeat loss."""
import os
import subprocess
import sys
import textwrap
import time

import msgpack

from pipeline.runtime import transport


def test_router_dealer_round_trip_and_bad_frames(tmp_path):
    ep = transport.ipc_endpoints(str(tmp_path))
    router = transport.RouterSocket(ep.control)
    dealer = transport.DealerSocket(ep.control)
    try:
        dealer.send("hello", role="trainer", worker="trainer-1", pid=1, token="t")
        identity, msg = router.recv(5000)
        assert identity[:1] == b"\x00" and msg["kind"] == "hello"  # the ROUTER named the connection, not the peer
        router.send(identity, "shutdown", reason="test")
        assert dealer.recv(5000)["reason"] == "test"
        dealer.sock.send(msgpack.packb({"kind": "warp", "v": 1, "step": 0, "seq": 0}))
        identity, msg = router.recv(5000)
        assert msg is None  # dropped, not raised
        router.sock.send_multipart([identity, b"\x00garbage"])
        assert dealer.recv(5000) is False
    finally:
        dealer.close()
        router.close()


def test_tcp_binds_loopback_by_default():
    ep = transport.tcp_endpoints(5555)
    assert ep.control == "tcp://127.0.0.1:5555" and ep.events == "tcp://127.0.0.1:5556"


def test_long_run_dir_is_refused(tmp_path):
    import pytest
    with pytest.raises(ValueError, match="too long"):
        transport.ipc_endpoints(str(tmp_path / ("x" * 120)))


def test_pub_sub_delivers_metrics(tmp_path):
    ep = transport.ipc_endpoints(str(tmp_path))
    pub = transport.Publisher(ep.events)
    sub = transport.Subscriber(ep.events)
    try:
        got = None
        for _ in range(100):  # slow joiner: publish until the subscription is live
            pub.publish("event", 3, event="ping", detail={})
            got = sub.recv(50)
            if got:
                break
        assert got["event"] == "ping" and got["step"] == 3
    finally:
        sub.close()
        pub.close()


def test_liveness_declares_silent_workers_dead():
    live = transport.Liveness(timeout_s=0.05)
    live.beat("a")
    live.beat("b")
    time.sleep(0.08)
    live.beat("b")
    assert live.dead() == ["a"]
    live.forget("a")
    assert live.dead() == []


WORKER = textwrap.dedent("""
    import sys, time
    from pipeline.runtime.shm import exit_on_signals
    from pipeline.runtime.transport import HeartbeatThread
    exit_on_signals()
    hb = HeartbeatThread(sys.argv[1], "w", "token", timeout_s=1.0, interval_s=0.05)
    hb.start()
    try:
        time.sleep(30)
    except SystemExit:
        print("lost" if hb.lost else "replaced" if hb.replaced else "other", flush=True)
        raise
""")


def test_worker_exits_when_scheduler_heartbeats_stop(tmp_path):
    ep = transport.ipc_endpoints(str(tmp_path))
    router = transport.RouterSocket(ep.control)
    root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
    p = subprocess.Popen([sys.executable, "-c", WORKER, ep.control], stdout=subprocess.PIPE, cwd=root)
    try:
        echoed = 0
        t_end = time.time() + 30
        while echoed < 5 and time.time() < t_end:  # play scheduler for a few beats
            got = router.recv(100)
            if got and got[1] and got[1]["kind"] == "heartbeat":
                router.send(got[0], "heartbeat", worker="scheduler")
                echoed += 1
        assert echoed == 5
        t0 = time.time()
        router.close()  # the scheduler "dies"
        out, _ = p.communicate(timeout=20)
        assert out.strip() == b"lost"
        assert time.time() - t0 < 10
    finally:
        if p.poll() is None:
            p.kill()


def test_a_paused_worker_does_not_mistake_its_own_pause_for_a_dead_scheduler(tmp_path):
    import signal
    ep = transport.ipc_endpoints(str(tmp_path))
    router = transport.RouterSocket(ep.control)
    root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
    p = subprocess.Popen([sys.executable, "-c", WORKER, ep.control], stdout=subprocess.PIPE, cwd=root)

    def echo(seconds=None, beats=None):
        echoed, t_end = 0, time.time() + (seconds or 30)
        while time.time() < t_end and (beats is None or echoed < beats):
            got = router.recv(50)
            if got and got[1] and got[1]["kind"] == "heartbeat":
                router.send(got[0], "heartbeat", worker="scheduler")
                echoed += 1
        return echoed
    try:
        assert echo(beats=5) == 5
        time.sleep(0.3)  # no echo in flight when it stops, so nothing wakes it but its own clock
        p.send_signal(signal.SIGSTOP)
        time.sleep(2.0)  # twice its 1 s timeout
        p.send_signal(signal.SIGCONT)
        assert echo(seconds=2.0) > 5
        assert p.poll() is None, "the worker took its own pause for the scheduler's death"
        router.close()
        out, _ = p.communicate(timeout=20)
        assert out.strip() == b"lost"
    finally:
        p.send_signal(signal.SIGCONT)
        if p.poll() is None:
            p.kill()


def test_a_worker_leaves_when_another_scheduler_process_answers_its_heartbeats(tmp_path):
    """A restarted scheduler on the same endpoint never welcomed the old worker: an echo from another scheduler
    incarnation than the first ends it (replaced: it exits 75 for a supervisor), instead of idling unknown."""
    ep = transport.ipc_endpoints(str(tmp_path))
    router = transport.RouterSocket(ep.control)
    root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
    p = subprocess.Popen([sys.executable, "-c", WORKER, ep.control], stdout=subprocess.PIPE, cwd=root)
    try:
        echoed, t_end = 0, time.time() + 30
        while p.poll() is None and time.time() < t_end:
            got = router.recv(50)
            if got and got[1] and got[1]["kind"] == "heartbeat":  # 5 echoes of one scheduler, then of another
                router.send(got[0], "heartbeat", worker="scheduler", incarnation="first" if echoed < 5 else "second")
                echoed += 1
        out, _ = p.communicate(timeout=20)
        assert out.strip() == b"replaced" and echoed >= 6  # the second scheduler's first echo ends it
    finally:
        if p.poll() is None:
            p.kill()
