"""CURVE on tcp://: per-run key files, a handshake only the run's key completes, private ipc directories."""
import json
import os
import stat

import pytest
import zmq

from pipeline.errors import UserError
from pipeline.runtime import security, transport


def _mode(path):
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def keys(tmp_path):
    server, client = security.create_run_keys(str(tmp_path))
    return security.load_server_key(server), security.load_client_key(client), client


def test_key_files_are_private_and_each_run_gets_fresh_keys(tmp_path):
    server, client = security.create_run_keys(str(tmp_path))
    assert _mode(server) == 0o600 and _mode(client) == 0o600
    first = security.load_client_key(client)
    assert security.load_server_key(server).client_public == first.public
    security.create_run_keys(str(tmp_path))
    assert security.load_client_key(client).secret != first.secret
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]


@pytest.mark.parametrize("content, field", [
    ("not json", "not a key file"),
    (json.dumps({"format": "other"}), "'format'"),
    (json.dumps({"format": security.FORMAT, "server_public": "short"}), "'server_public'"),
    (json.dumps({"format": security.FORMAT, "server_public": "~" * 40}), "'server_public'"),  # not Z85
])
def test_a_bad_key_file_is_one_error_naming_file_and_field(tmp_path, content, field):
    path = tmp_path / "worker.key"
    path.write_text(content)
    with pytest.raises(UserError, match=field) as err:
        security.load_client_key(str(path))
    assert str(path) in str(err.value)
    with pytest.raises(UserError, match="no such key file"):
        security.load_client_key(str(tmp_path / "absent.key"))


def test_tcp_refuses_without_curve(monkeypatch):
    monkeypatch.setattr(zmq, "has", lambda capability: capability != "curve")
    with pytest.raises(UserError, match="CURVE"):
        security.require_curve()


def test_tcp_sockets_refuse_to_run_without_a_key():
    with pytest.raises(UserError, match="scheduler.key"):
        transport.RouterSocket("tcp://127.0.0.1:0")
    with pytest.raises(UserError, match="--key"):
        transport.DealerSocket("tcp://127.0.0.1:9")


def _receives(router, timeout_ms):
    got = router.recv(timeout_ms)
    return got is not None and got[1] is not None


def test_only_the_runs_client_key_completes_the_handshake(keys):
    server_key, client_key, _ = keys
    server = transport.ServerContext(server_key)
    router = transport.RouterSocket("tcp://127.0.0.1:0", server.ctx, server_key)
    pub = transport.Publisher("tcp://127.0.0.1:0", server.ctx, server_key)
    pub_endpoint = pub.sock.getsockopt_string(zmq.LAST_ENDPOINT)
    ctx = zmq.Context()
    strangers = []
    try:
        plain = ctx.socket(zmq.DEALER)  # no CURVE at all
        wrong = ctx.socket(zmq.DEALER)  # CURVE with the server's public key but a key pair of its own
        security.secure_client(wrong, security.ClientKey(server_key.public, *zmq.curve_keypair()))
        snoop = ctx.socket(zmq.SUB)     # a subscriber without the key
        snoop.setsockopt(zmq.SUBSCRIBE, b"")
        strangers = [plain, wrong, snoop]
        for s in (plain, wrong):
            s.setsockopt(zmq.LINGER, 0)
            s.connect(router.endpoint)
            s.send(transport.messages.pack("hello", role="optimizer", worker="stranger", pid=1, token="t"))
        snoop.setsockopt(zmq.LINGER, 0)
        snoop.connect(pub_endpoint)
        assert not _receives(router, 1500), "a peer without the run's key got a message through"
        member = transport.DealerSocket(router.endpoint, ctx, client_key)
        listener = transport.Subscriber(pub_endpoint, ctx, client_key)
        strangers += [member.sock, listener.sock]
        member.send("hello", role="trainer", worker="trainer-1", pid=1, token="t")
        identity, msg = router.recv(10000)
        assert msg["worker"] == "trainer-1"
        heard = None
        for _ in range(100):  # slow joiner: publish until the subscription is live
            pub.publish("event", event="ping", detail={})
            if (heard := listener.recv(50)) is not None:
                break
        assert heard["event"] == "ping"
        assert snoop.poll(200) == 0, "a subscriber without the key heard the events"
    finally:
        for s in strangers:
            s.close(0)
        ctx.term()
        router.close()
        pub.close()
        server.close()


def test_ipc_sockets_live_in_a_private_directory(tmp_path):
    ep = transport.ipc_endpoints(str(tmp_path))
    router = transport.RouterSocket(ep.control)
    try:
        sockets = os.path.dirname(ep.control[len("ipc://"):])
        assert _mode(sockets) == 0o700 and os.path.exists(os.path.join(sockets, "control.sock"))
    finally:
        router.close()


def test_a_worker_over_tcp_without_a_key_exits_with_one_error(tmp_path):
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-m", "workers.trainer", "--connect", "tcp://127.0.0.1:9"], cwd=root,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--key" in out.stderr and "Traceback" not in out.stderr
