"""The ES task kind: the scheduler hands (iteration, members) to es_member workers and gathers scalar rewards.

    es_state(params at t)      only to a member that joins or lags (a state transfer)
    es_eval(t, members, catchup) -> es_rewards(t, members, rewards)
    es_digest(T, catchup)      -> es_digested(T, sha256)   at the end: every replica must agree

Per iteration only member ids and float64 rewards cross the wire: the rewards
of iteration t-1 ride on the message assigning iteration t's members
(`catchup`), and every replica - each member's and the scheduler's own
(pipeline/es/run.py ESRun) - applies that same update itself. Members are pure
functions of (theta_t, member id), so the members of a lost worker are handed
to another and the run's bits do not change.

The population of an iteration is cut into as many contiguous chunks as there
are live members when it starts; an idle member takes the next chunk. The
security rules are the trainer plan's (everything but the plan is inherited
from Scheduler): results are matched to the ROUTER connection, a reward counts
only for the chunk that connection was assigned in this iteration, once, and
anything else is logged and dropped.
"""
from __future__ import annotations

import json
import math
import os
import time

from ..es.run import ESRun, state_fields
from . import ckpt
from .scheduler import START_GRACE_S, RunFailed, Scheduler, fault

DIGEST_WAIT_S = 30.0  # how long the end waits for the replicas' digests (a member lost meanwhile is skipped)


class ESScheduler(Scheduler):
    RESULTS = {"es_rewards": ("es_member",), "es_digested": ("es_member",), "failed": ("es_member",),
               "bye": ("es_member",)}
    ROLES = ("es_member",)

    def __init__(self, job, run_dir, run_id, endpoints, trainers=1, resume=None, log=print, **kw):
        super().__init__(job, run_dir, run_id, endpoints, trainers=trainers, resume=resume, log=log, **kw)
        self.es = ESRun(job, run_dir, resume, log)
        self.metrics.close()
        self.metrics = self.es.metrics  # one metrics.jsonl writer
        self.replica_at: dict[str, int] = {}  # member id -> the iteration its replica is at
        self.prev_rewards = None              # rewards of iteration cur-1 (the catch-up of a member at cur-1)
        self.chunks: list[list[int]] = []     # this iteration's chunks not handed out yet
        self.rewards: dict[int, float] = {}
        self.digests: dict[str, str] = {}
        self.digest_asked: set[str] = set()
        self.digest_deadline = None
        self.center_done = False
        self.cur = self.es.iteration

    # --- results -----------------------------------------------------------
    def on_es_rewards(self, peer, msg):
        members = msg["members"]
        if peer.task != (msg["step"], tuple(members)) or len(msg["rewards"]) != len(members):
            return self.drop(peer, msg, f"it was assigned {peer.task}, not these members of iteration {msg['step']}")
        peer.task = None
        key = (msg["step"], tuple(members))
        bad = [m for m, r in zip(members, msg["rewards"]) if not math.isfinite(r)]
        if bad:
            return self.nonfinite_rewards(peer, key, bad)
        for wid in self.suspects.pop(key, ()):  # a NaN another member did not reproduce: that peer's
            if wid in self.peers:
                self.strike(self.peers[wid], f"non-finite rewards for iteration {key[0]} that {peer.id} scored finite")
        for m, r in zip(members, msg["rewards"]):
            self.rewards.setdefault(m, float(r))
        self.role_ms["trainer"] += msg["ms"]

    def nonfinite_rewards(self, peer, key, bad):
        """A NaN/inf reward is never applied: the chunk is first re-scored by another member (members are pure
        functions of (theta_t, member id), so an honest one reproduces it); confirmed, it stops the run."""
        seen = self.suspects.setdefault(key, set())
        seen.add(peer.id)
        if len(seen) == 1 and any(p.id not in seen for p in self.role("es_member")):
            self.chunks.insert(0, list(key[1]))
            self.event("nonfinite_recheck", step=key[0], worker=peer.id, members=bad[:8])
            return
        self.event("nonfinite", step=key[0], worker=peer.id, members=bad[:8])
        latest = ckpt.latest_checkpoint(self.run_dir)
        raise RunFailed(f"iteration {key[0]}: {' and '.join(sorted(seen))} scored ES member(s) {bad[:8]} "
                        f"non-finite (a NaN or inf reward); nothing was applied, the latest checkpoint is "
                        f"{latest or 'none (the run had not saved one)'}")

    def on_es_digested(self, peer, msg):
        if peer.id not in self.digest_asked or peer.id in self.digests or msg["step"] != self.cur:
            return self.drop(peer, msg, "no digest is outstanding there")
        self.digests[peer.id] = msg["sha256"]

    # --- faults ------------------------------------------------------------
    def buffer_limits(self) -> tuple[int, int]:
        return 0, 0  # every ES message is one frame

    def lost(self, wid, why, evict=False):
        peer = self.peers.pop(wid, None)
        if peer is None:
            return
        self.liveness.forget(wid)
        self.by_identity.pop(peer.identity, None)
        self.replica_at.pop(wid, None)
        self.digest_asked.discard(wid)
        if why != "left":
            self.router.send(peer.identity, "shutdown", reason=f"declared lost: {why}",
                             **({} if evict else {"replace": True}))
        self.event("worker_evicted" if evict else "worker_lost", worker=wid, role=peer.role, reason=why)
        if peer.task is not None and peer.task[0] == self.cur:
            self.chunks.insert(0, list(peer.task[1]))  # pure in (theta_t, member): another re-runs them

    # --- dispatch ----------------------------------------------------------
    def catchup(self, peer):
        """Bring peer's replica to self.cur: the previous rewards, or (None after) a state transfer."""
        at = self.replica_at.get(peer.id)
        if at == self.cur:
            return None
        if at == self.cur - 1 and self.prev_rewards is not None:
            self.replica_at[peer.id] = self.cur
            return self.prev_rewards
        self.send(peer, "es_state", self.cur, **state_fields(self.es.trainer))
        self.event("state_transfer", worker=peer.id, iteration=self.cur)
        self.replica_at[peer.id] = self.cur
        return None

    def pump(self):
        members = self.role("es_member")
        if not self.started:
            waited = time.monotonic() - self.t_start > START_GRACE_S
            if not members or (len(members) < self.trainers_wanted and not waited):
                return
            self.started = True
            self.es.begin()
            self.event("run_started", members=len(members), population=self.job.population,
                       iterations=self.job.steps, start=self.cur)
        if self.digest_deadline is not None:
            return self.maybe_finish()
        if len(self.rewards) == self.job.population:
            self.advance(members)  # and on to iteration cur+1 in this same pass: no member waits for a poll
        if not self.center_done:
            if self.es.finished():
                return self.ask_digests()
            self.center_done = True
            self.cut(members)
        self.hand_out(members)

    def cut(self, members):
        """Iteration cur's population as one contiguous chunk per live member."""
        pop, n = self.job.population, max(1, len(members))
        self.chunks = [c for c in (list(range(k * pop // n, (k + 1) * pop // n)) for k in range(n)) if c]

    def hand_out(self, members, transfers=True):
        """A chunk to each idle member; transfers=False skips a member that needs the parameters (es_state)."""
        for peer in sorted((p for p in members if p.task is None), key=lambda p: p.born):
            if not self.chunks:
                break
            at = self.replica_at.get(peer.id)
            if not transfers and not (at == self.cur or (at == self.cur - 1 and self.prev_rewards is not None)):
                continue
            chunk = next((c for c in self.chunks if self.may_score(peer, c, members)), None)
            if chunk is None:
                continue
            self.chunks.remove(chunk)
            peer.task = (self.cur, tuple(chunk))
            self.send(peer, "es_eval", self.cur, members=chunk, catchup=self.catchup(peer))

    def may_score(self, peer, chunk, members) -> bool:
        """Not a chunk this peer scored non-finite - unless no other member is left to re-score it."""
        seen = self.suspects.get((self.cur, tuple(chunk)), ())
        return peer.id not in seen or all(p.id in seen for p in members)

    def advance(self, members):
        """Every reward of iteration cur is in: the replicas move to cur+1.

        A job whose stop test needs no parameters (no center score: es-finetune stops at its iteration count)
        hands iteration cur+1 out BEFORE this replica applies the update: the members apply the same update
        themselves from the catch-up rewards, so they need not wait for ours. Only a member that needs a state
        transfer waits, since that ships this replica's parameters."""
        rewards = [self.rewards[m] for m in range(self.job.population)]
        self.rewards, self.prev_rewards, self.cur = {}, rewards, self.cur + 1
        early = not self.job.center_scored and not (self.job.steps > 0 and self.cur >= self.job.steps)
        if early:
            self.cut(members)
            self.hand_out(members, transfers=False)
        record = self.es.commit(rewards)
        fault(self.run_dir, "step", self.cur)
        self.center_done = early
        record["roles"] = {"es_member": round(self.role_ms["trainer"], 3)}
        self.role_ms = dict.fromkeys(self.role_ms, 0.0)
        self.pub.publish("es_metrics", self.cur, total=self.job.steps,
                         **{k: v for k, v in record.items() if k != "roles"})

    def ask_digests(self):
        """The end: every live replica at cur or cur-1 reports its sha256 (a lagging one holds nothing to check)."""
        self.digest_deadline = time.monotonic() + DIGEST_WAIT_S
        for peer in self.role("es_member"):
            if self.replica_at.get(peer.id, -2) >= self.cur - 1:
                self.digest_asked.add(peer.id)
                self.send(peer, "es_digest", self.cur, catchup=self.catchup(peer))
        self.maybe_finish()

    def maybe_finish(self):
        waiting = self.digest_asked - set(self.digests)
        if waiting and time.monotonic() < self.digest_deadline:
            return
        sha = self.es.digest()
        wrong = {w: d for w, d in self.digests.items() if d != sha}
        if wrong:
            raise RunFailed(f"replicas disagree at iteration {self.cur}: {wrong} vs the scheduler's {sha}")
        self.summary = {**self.es.summary("pipeline", members=self.trainers_wanted,
                                          replicas_checked=len(self.digests)),
                        "restarts": self.restarts, "unanswered_digests": sorted(waiting)}
        tmp = os.path.join(self.run_dir, "summary.json.tmp")
        with open(tmp, "w") as fh:  # before run_finished: whoever hears it can read the summary
            json.dump(self.summary, fh, indent=1)
        os.replace(tmp, os.path.join(self.run_dir, "summary.json"))
        self.event("run_finished", **self.summary)

