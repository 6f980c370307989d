"""Ray as the placement engine for workers: `fucina launch JOB --ray [ADDRESS] --trainers N`, and for ES
`fucina es-spirals --ray [ADDRESS] --members N`.

Each trainer (es_member) is a Ray actor holding one CPU (spread over the
cluster's nodes); the actor runs `python -m workers.trainer --remote
--connect tcp://... --key FILE` (`workers.es_member`, which maps no shared
memory anyway) as its child, with the same pinned thread environment a local
worker gets, and waits for it. The scheduler (and the loader, optimizer and
checkpointer of a gradient job) stay on the launching host under the
ordinary Supervisor.

Faults: a worker process that exits non-zero returns from the actor's
`run`, and the launcher calls `run` again (counted as a respawn, as for a
local worker). An actor process that dies is restarted by Ray
(`max_restarts`) and its pending `run` re-submitted (`max_task_retries`);
its worker child dies with it (PR_SET_PDEATHSIG), and the scheduler re-runs
the lost task exactly as for a local worker (ES: the lost members, and the
new member gets a state transfer) - the bits do not change. When the
scheduler itself dies and the launcher restarts it, `restart()` stops every
actor's worker (SIGTERM, then SIGKILL) and starts a fresh one that joins the
new scheduler: an old worker would otherwise hear the new scheduler's
heartbeats on the same port and idle forever, unknown to it.

The key travels to the actors as the text of worker.key through Ray's own
channels (each actor writes it to a private 0600 file for its worker):
the Ray cluster is trusted with it, as it is with running our code. Only
strings and ints are passed to the actors.
"""
from __future__ import annotations

from ..errors import FucinaError, UserError


def install_hint(extra: str = "ray", root: str | None = None) -> str:
    """How to install an extra: `pip install -e '.[X]'` in the source checkout this code runs from (`root`, default
    the directory above the package, holds pyproject.toml), else `pip install 'fucina[X]'` from a package index; a
    checkout's hint names both, its own first (a user of a checkout has no `fucina` package to add an extra to)."""
    import os
    root = root or os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    index = f"pip install 'fucina[{extra}]'"
    if os.path.isfile(os.path.join(root, "pyproject.toml")):
        return f"pip install -e '.[{extra}]' in the source checkout {root} (from a package index: {index})"
    return index


def require_ray():
    try:
        import ray
    except ImportError:
        raise UserError(f"--ray needs Ray, which is not installed: {install_hint('ray')}") from None
    return ray


def _die_with_parent():
    """preexec_fn of the worker child: SIGKILL it when the actor process dies (Linux prctl)."""
    import ctypes
    import signal
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG


class WorkerActor:
    """One worker placed by Ray (decorated with ray.remote in RayWorkers). Two threads (max_concurrency=2), so
    `stop` reaches the worker while `run` waits for it."""

    def __init__(self):
        self.proc = None

    def run(self, command: list, key_text: str, env: dict) -> int:
        import os
        import subprocess
        import tempfile
        keydir = tempfile.mkdtemp(prefix="fucina-ray-key-")  # 0700
        path = os.path.join(keydir, "worker.key")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(key_text)
        try:
            self.proc = subprocess.Popen([*command, "--key", path], env=env, preexec_fn=_die_with_parent)
            return self.proc.wait()
        finally:
            os.unlink(path)
            os.rmdir(keydir)

    def stop(self, grace_s: float = 5.0) -> int | None:
        """End the running worker (SIGTERM: it unwinds and says bye; SIGKILL after grace_s); -> its exit code."""
        import subprocess
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return None if proc is None else proc.returncode
        proc.terminate()
        try:
            return proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()

    def pid(self) -> int:
        import os
        return os.getpid()


class RayWorkers:
    """N worker actors; `poll()` re-runs the ones whose worker exited with an error."""

    def __init__(self, address, n, command, key_path, env):
        ray = self.ray = require_ray()
        self.connected_here = not ray.is_initialized()
        if self.connected_here:
            ray.init(address=address or None, include_dashboard=False, log_to_driver=False,
                     configure_logging=False, runtime_env={"env_vars": {"PYTHONPATH": env["PYTHONPATH"]}})
        with open(key_path) as fh:
            self.key_text = fh.read()
        self.command, self.env = command, env
        actor = ray.remote(num_cpus=1, max_restarts=-1, max_task_retries=-1, max_concurrency=2,
                           scheduling_strategy="SPREAD")(WorkerActor)
        self.actors = [actor.remote() for _ in range(n)]
        self.runs = {a: a.run.remote(self.command, self.key_text, self.env) for a in self.actors}

    def poll(self) -> int:
        """Re-start workers that exited with an error; -> how many were re-started."""
        done, _ = self.ray.wait(list(self.runs.values()), timeout=0, num_returns=len(self.runs))
        again = 0
        for actor, ref in list(self.runs.items()):
            if ref in done and self.ray.get(ref) != 0:  # 0: told to stop; 75 (replaced) or a crash: again
                self.runs[actor] = actor.run.remote(self.command, self.key_text, self.env)
                again += 1
        return again

    def restart(self, timeout_s: float = 30.0):
        """The scheduler was restarted: end every actor's worker and start a fresh one, which joins the new
        scheduler (its hello waits in ZeroMQ until the new scheduler binds the port)."""
        try:
            self.ray.get([actor.stop.remote() for actor in self.actors], timeout=timeout_s)
        except self.ray.exceptions.GetTimeoutError:
            raise FucinaError(f"launch --ray: the Ray workers did not stop within {timeout_s:.0f} s for the "
                              "scheduler's restart (is the cluster reachable?)") from None
        self.ray.wait(list(self.runs.values()), timeout=timeout_s, num_returns=len(self.runs))
        self.runs = {a: a.run.remote(self.command, self.key_text, self.env) for a in self.actors}

    def close(self):
        for actor in self.actors:
            self.ray.kill(actor, no_restart=True)
        if self.connected_here:
            self.ray.shutdown()
