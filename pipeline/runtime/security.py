"""CURVE keys for tcp:// endpoints: who may join a run, and the files that say so.

On one host the control and event sockets are ipc:// files in the run
directory (or a private temp directory), which this module makes 0700: only
the run's user can connect. A tcp:// endpoint is reachable by anyone who can
route to it, so there every socket speaks ZeroMQ CURVE (encryption plus
authentication): each run makes two fresh key pairs,

    scheduler.key  the server's secret key and the one client public key it accepts (0600)
    worker.key     the server's public key and the client key pair a worker presents (0600)

and a ZAP handler (pyzmq's ThreadAuthenticator) on the binding side accepts a
handshake only from that client key. A peer without worker.key cannot finish
the handshake, so it can neither send a message nor read one. Every worker of
a run shares the one client key: the key says "may join this run", the
protocol (results matched by connection, one task per connection) does the
rest.

Trade-off: keys are files rather than a key server - a remote worker is
started with `--key worker.key` copied over by whatever means the operator
trusts (scp), and the file's 0600 mode is the whole access policy on a host.
Key files are JSON (never pickled or evaluated); anything else in them is one
UserError naming the file and the field.
"""
from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass

import zmq
from zmq.utils import z85

from ..errors import UserError

FORMAT = "fucina.curve/1"
SERVER_FILE, CLIENT_FILE = "scheduler.key", "worker.key"


def is_tcp(endpoint: str) -> bool:
    return endpoint.startswith("tcp://")


def require_curve():
    """tcp:// without CURVE would be an open door: refuse instead."""
    if not zmq.has("curve"):
        raise UserError(f"tcp:// endpoints need ZeroMQ with CURVE security, but this libzmq {zmq.zmq_version()} "
                        f"(pyzmq {zmq.pyzmq_version()}) was built without it; use ipc:// on one host, or install "
                        f"a pyzmq wheel (they bundle libzmq with CURVE)")


@dataclass(frozen=True)
class ServerKey:
    public: bytes
    secret: bytes
    client_public: bytes   # the one client key the authenticator accepts


@dataclass(frozen=True)
class ClientKey:
    server_public: bytes
    public: bytes
    secret: bytes


def private_dir(path: str) -> str:
    """Create `path` (if needed) and make it 0700: ipc sockets and key files live there."""
    os.makedirs(path, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def private_tempdir(prefix: str) -> str:
    return tempfile.mkdtemp(prefix=prefix)  # mkdtemp creates it 0700


def _write_private(path: str, fields: dict):
    """Atomically write a 0600 JSON file (the temp file is 0600 from its creation on)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump({"format": FORMAT, **fields}, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def create_run_keys(directory: str) -> tuple[str, str]:
    """Fresh server and client key pairs -> (scheduler.key path, worker.key path), both 0600."""
    require_curve()
    server_public, server_secret = zmq.curve_keypair()
    client_public, client_secret = zmq.curve_keypair()
    server_path, client_path = os.path.join(directory, SERVER_FILE), os.path.join(directory, CLIENT_FILE)
    _write_private(server_path, {"public": server_public.decode(), "secret": server_secret.decode(),
                                 "client_public": client_public.decode()})
    _write_private(client_path, {"server_public": server_public.decode(), "public": client_public.decode(),
                                 "secret": client_secret.decode()})
    return server_path, client_path


def _read(path: str, fields: tuple[str, ...]) -> list[bytes]:
    try:
        with open(path) as fh:
            data = json.load(fh)
    except FileNotFoundError:
        raise UserError(f"{path}: no such key file (a run writes worker.key into its run directory)") from None
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise UserError(f"{path}: not a key file ({type(e).__name__}: {e})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise UserError(f"{path}: field 'format' is not {FORMAT!r}")
    out = []
    for name in fields:
        value = data.get(name)
        if not isinstance(value, str) or len(value) != 40:  # a Z85-encoded 32-byte key
            raise UserError(f"{path}: field {name!r} is not a 40-character Z85 CURVE key")
        try:
            z85.decode(value)
        except (ValueError, KeyError, TypeError):  # z85 rejects characters outside its alphabet this way
            raise UserError(f"{path}: field {name!r} is not valid Z85") from None
        out.append(value.encode())
    return out


def load_server_key(path: str) -> ServerKey:
    require_curve()
    return ServerKey(*_read(path, ("public", "secret", "client_public")))


def load_client_key(path: str) -> ClientKey:
    require_curve()
    return ClientKey(*_read(path, ("server_public", "public", "secret")))


class _AcceptOne:
    """ZAP credentials provider: exactly one client public key may join."""

    def __init__(self, client_public: bytes):
        self.client_public = client_public

    def callback(self, domain, key: bytes) -> bool:
        return key == self.client_public


def start_authenticator(ctx: zmq.Context, key: ServerKey):
    """A ZAP handler thread on `ctx` that admits only `key.client_public`; -> the authenticator (stop() it)."""
    from zmq.auth.thread import ThreadAuthenticator
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback(domain="*", credentials_provider=_AcceptOne(key.client_public))
    return auth


def secure_server(sock: zmq.Socket, key: ServerKey):
    """Make a binding socket a CURVE server (before bind)."""
    sock.curve_secretkey = key.secret
    sock.curve_publickey = key.public
    sock.curve_server = True


def secure_client(sock: zmq.Socket, key: ClientKey):
    """Make a connecting socket a CURVE client of the run's server (before connect)."""
    sock.curve_serverkey = key.server_public
    sock.curve_publickey = key.public
    sock.curve_secretkey = key.secret
