"""Non-finite values and bad answers: a NaN/inf never reaches the parameters, a peer that keeps sending bad
tensors (NaN, float64 where float32 belongs) is evicted and its work runs elsewhere (mock peers, real segments)."""
import numpy as np
import pytest

from test_remote_frames import _start, remote_rig  # noqa: F401 - the fixture
from test_scheduler import M, desc, rig, spin, start  # noqa: F401 - the fixture

from pipeline.jobs import get_job
from pipeline.jobs.spec import build
from pipeline.runtime import remote
from pipeline.runtime.inprocess import run_inprocess
from pipeline.runtime.roles import NonFiniteError, OptimizerLogic, first_nonfinite
from pipeline.runtime.scheduler import MAX_STRIKES, RunFailed


def test_first_nonfinite_names_the_loss_or_the_first_bad_tensor():
    ok = {"a": np.ones(3, np.float32), "b": np.zeros((2, 2), np.float32), "empty": np.zeros(0, np.float32)}
    assert first_nonfinite(1.5, ok) is None
    assert first_nonfinite(float("nan"), ok) == "loss"
    for bad in (np.nan, np.inf, -np.inf, 1e30, -1e30, 2.0 ** 64):  # |x| >= 2^64 squares to inf in float32
        poisoned = {**ok, "b": np.array([[0, 1], [bad, 2]], np.float32)}
        assert first_nonfinite(0.0, poisoned) == "b"
    assert first_nonfinite(1e30, ok) == "loss"
    below = float(np.nextafter(np.float32(2.0 ** 64), np.float32(0)))  # the largest float32 whose square is finite
    assert np.isfinite(np.float32(below) * np.float32(below))
    assert first_nonfinite(below, {"b": np.array([-below, below], np.float32)}) is None


def _spirals(**over):
    job = get_job("spirals")
    return job(build(job.Spec, {"steps": 3, "batch": 8, "micro_batches": M, "checkpoint_every": 1,
                                "eval_every": 0, **over}))


def test_the_optimizer_refuses_a_nan_slot_nobody_reported_and_applies_nothing():
    job = _spirals()
    params = {n: np.array(a) for n, a in job.init_params()}
    opt = OptimizerLogic(job, params)
    opt.init(None)
    before = {n: a.copy() for n, a in params.items()}
    slots = [{n: np.full_like(a, 0.01) for n, a in params.items()} for _ in range(M)]
    name = next(iter(params))
    slots[2][name].reshape(-1)[0] = np.inf
    with pytest.raises(NonFiniteError, match=rf"step 1: the gradient of {name} is not finite .*\[2\]"):
        opt.step(0, slots)
    assert all(np.array_equal(params[n], before[n]) for n in params)
    opt.step(0, slots, skip={2})  # the same step without micro-batch 2: applied, finite
    assert all(np.isfinite(a).all() for a in params.values())
    assert any(not np.array_equal(params[n], before[n]) for n in params)


class Poisoned(type(_spirals())):
    """spirals whose micro-batch (1, 2) carries a NaN input: a NaN loss and NaN gradients, as divergence gives."""

    def fill_batch(self, step, k, out):
        super().fill_batch(step, k, out)
        if (step, k) == (1, 2):
            out["x"][0, 0] = np.nan


def test_inprocess_stops_at_a_nan_naming_step_micro_batch_and_tensor_and_keeps_the_checkpoint(tmp_path):
    job = Poisoned(_spirals().spec)
    with pytest.raises(NonFiniteError) as e:
        run_inprocess(job, str(tmp_path), log=lambda m: None)
    said = str(e.value)
    assert "optimizer step 2, micro-batch 2: inprocess computed a non-finite (NaN, inf or |x| >= 2^64) loss" in said
    assert said.endswith("--on-nonfinite skip leaves such micro-batches out") and "checkpoint-step-1" in said
    assert sorted(p.name for p in tmp_path.glob("checkpoint-step-*")) == ["checkpoint-step-1"]


def test_inprocess_skip_leaves_the_micro_batch_out_and_reports_it(tmp_path):
    import json
    clean = run_inprocess(_spirals(), str(tmp_path / "clean"), log=lambda m: None)
    clean_skip = run_inprocess(_spirals(on_nonfinite="skip"), str(tmp_path / "cs"), log=lambda m: None)
    assert clean_skip["params_sha256"] == clean["params_sha256"]  # no bad value: the policy changes no bit
    out = run_inprocess(Poisoned(_spirals(on_nonfinite="skip").spec), str(tmp_path / "skip"), log=lambda m: None)
    assert out["nonfinite_skipped"] == 1 and out["params_sha256"] != clean["params_sha256"]
    lines = [json.loads(x) for x in (tmp_path / "skip" / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped"] for r in lines if r["kind"] == "metrics" and "skipped" in r] == [[2]]
    assert [(r["step"], r["detail"]["k"]) for r in lines if r.get("event") == "nonfinite_skipped"] == [(2, 2)]


def _answer_all(sched, fakes, loss_of=lambda who, k: 0.5, nonfinite_of=lambda who, k: None):
    """Answer every grad task the local fakes hold; -> the (who, k) answered."""
    done = []
    for who in ("t1", "t2"):
        for t in fakes[who].take("grad", wait_s=0.2):
            extra = {"nonfinite": nonfinite_of(who, t["k"])} if nonfinite_of(who, t["k"]) else {}
            fakes[who].send("grad_done", t["step"], gen=0, k=t["k"], loss=loss_of(who, t["k"]), rows=2, ms=1,
                            **extra)
            done.append((who, t["k"]))
    spin(sched, fakes)
    return done


def test_a_local_trainers_nonfinite_stops_the_run_naming_step_worker_and_tensor(rig):  # noqa: F811 - the imported fixture
    sched, fakes = rig
    start(sched, fakes)
    with pytest.raises(RunFailed, match=r"optimizer step 1, micro-batch \d: t\d computed a non-finite .* "
                                        r"gradient of l1.weight; nothing was applied"):
        for _ in range(3):
            _answer_all(sched, fakes, nonfinite_of=lambda who, k: "l1.weight" if k == 1 else None)
    assert fakes["optimizer"].take("step", wait_s=0.1) == []


def test_skip_leaves_out_the_micro_batch_and_reports_it(rig):  # noqa: F811 - the imported fixture
    sched, fakes = rig
    sched.on_nonfinite = "skip"
    start(sched, fakes)
    for _ in range(3):
        _answer_all(sched, fakes, loss_of=lambda who, k: float("inf") if k == 3 else 0.25)
    (step,) = fakes["optimizer"].take("step")
    assert step["skip"] == [3] and sched.losses[1] == 0.75
    fakes["optimizer"].send("stepped", 1, gen=0, lr=0.1, grad_norm=1.0, ms=1.0)
    spin(sched, fakes)
    import json
    with open(f"{sched.run_dir}/metrics.jsonl") as fh:
        lines = [json.loads(x) for x in fh]
    assert [r["skipped"] for r in lines if r["kind"] == "metrics"] == [[3]]
    assert sched.nonfinite_skipped == 1


def _grads(job, value, dtype=np.float32):
    return remote.to_frames(np.full(s, value, dtype) for _, s, _ in job.param_layout())


def _tasks(fakes):
    return {who: fakes[who].take("grad", wait_s=0.3) for who in ("r1", "r2")}


@pytest.mark.parametrize("value", [np.nan, 1e30])  # 1e30: finite, but its square overflows the optimizer's float32
def test_a_remote_nan_is_rechecked_elsewhere_and_a_peer_that_keeps_sending_them_is_evicted(remote_rig, value):  # noqa: F811, E501
    sched, fakes, job, segs = remote_rig
    _start(sched, fakes, segs)
    names = [n for n, _, _ in job.param_layout()]
    answered = {k: None for k in range(M)}
    nan_sent = 0
    for _ in range(40):
        for who, tasks in _tasks(fakes).items():
            for t in tasks:
                if who == "r1":  # NaN frames, a finite loss: the scheduler finds it in what it copied
                    nan_sent += 1
                    fakes[who].sock.send("grad_done", 0, gen=0, k=t["k"], loss=1.0, rows=2, ms=1.0,
                                         buffers=_grads(job, value), worker=who)
                else:
                    fakes[who].sock.send("grad_done", 0, gen=0, k=t["k"], loss=1.0, rows=2, ms=1.0,
                                         buffers=_grads(job, 0.5), worker=who)
                    answered[t["k"]] = who
        spin(sched, fakes, 0.2)
        if "r1" not in sched.peers and all(answered.values()):
            break
    assert "r1" not in sched.peers and nan_sent == MAX_STRIKES  # evicted at its third contradicted NaN
    assert all(who == "r2" for who in answered.values())
    (shutdown,) = fakes["r1"].take("shutdown")
    assert "evicted after 3 bad answers" in shutdown["reason"] and not shutdown.get("replace")
    assert fakes["optimizer"].take("step")  # every micro-batch in, from r2, finite
    assert all(np.array_equal(segs["grads"].tensors[f"{k}/{n}"], np.full_like(segs["grads"].tensors[f"{k}/{n}"],
                                                                                0.5)) for k in range(M) for n in names)


@pytest.mark.parametrize("dtype,answers", [(np.float64, 1), (np.float16, MAX_STRIKES)])
def test_a_remote_trainer_answering_another_dtype_is_evicted_and_its_work_reassigned(remote_rig, dtype, answers):  # noqa: F811, E501
    """Version skew: float64 is twice the bytes the layout allows (refused unread, evicted at once); float16
    fits the budget but not the layout (three strikes). Either way the other trainer does the work."""
    sched, fakes, job, segs = remote_rig
    _start(sched, fakes, segs)
    bad_answers, good = 0, set()
    for _ in range(40):
        for who, tasks in _tasks(fakes).items():
            for t in tasks:
                bad_answers += who == "r1"
                fakes[who].sock.send("grad_done", 0, gen=0, k=t["k"], loss=1.0, rows=2, ms=1.0,
                                     buffers=_grads(job, 0.5, dtype if who == "r1" else np.float32), worker=who)
                good |= {t["k"]} if who == "r2" else set()
        spin(sched, fakes, 0.2)
        if len(good) == M:
            break
    assert bad_answers == answers and "r1" not in sched.peers and good == set(range(M))
    assert fakes["optimizer"].take("step")
    assert sched.evicted == 1


@pytest.mark.parametrize("shape", ["too many frames", "too many bytes"])
def test_a_message_over_the_schemas_frame_budget_is_refused_unread_and_its_sender_evicted(remote_rig, shape):  # noqa: F811, E501
    """The budget is the gradient layout's own (frames, bytes); more is refused before a byte is read."""
    sched, fakes, job, segs = remote_rig
    _start(sched, fakes, segs)
    frames, nbytes = sched.buffer_limits()
    (task,) = fakes["r1"].take("grad")
    if shape == "too many frames":
        buffers = [b"x"] * (frames + 1)                    # each tiny: only the count is over
    else:
        buffers = [b"\0" * (nbytes // frames + 64)] * frames  # the right count, each a little long
    fakes["r1"].sock.send("grad_done", 0, gen=0, k=task["k"], loss=1.0, rows=2, ms=1.0, buffers=buffers,
                          worker="r1")
    spin(sched, fakes)
    assert "r1" not in sched.peers and sched.evicted == 1
    (shutdown,) = fakes["r1"].take("shutdown")
    assert "buffer frames" in shutdown["reason"] and not shutdown.get("replace")
    assert sched.grads.get(task["k"], ("issued", "r2"))[1] != "r1"  # its task went back to the queue
    assert "r2" in sched.peers


def test_es_nonfinite_rewards_are_rescored_elsewhere_and_a_member_that_keeps_sending_them_is_evicted(tmp_path):
    """The direct-handle pattern of tests/es/test_es_runtime.py: a NaN reward another member does not reproduce
    is a strike; three and the member is evicted; a NaN two members agree on stops the run, naming both."""
    import sys
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[1] / "es"))
    from test_es_runtime import _hello, _job, _rewards

    from pipeline.runtime.es_scheduler import ESScheduler
    from pipeline.runtime.transport import ipc_endpoints
    sched = ESScheduler(_job(), str(tmp_path), "t3st", ipc_endpoints(str(tmp_path)), trainers=2, log=lambda m: None)
    try:
        a, b = _hello(sched, b"es_member-1"), _hello(sched, b"es_member-2")
        sched.pump()
        for strike in range(1, MAX_STRIKES + 1):
            chunk_a = list(a.task[1])
            _rewards(sched, b"es_member-1", 0, chunk_a, float("nan"))  # a's NaN: re-scored by b
            if b.task is not None and b.task[1] != tuple(chunk_a):
                _rewards(sched, b"es_member-2", 0, list(b.task[1]), 1.0)
            sched.pump()
            assert b.task == (0, tuple(chunk_a)) and not any(m in sched.rewards for m in chunk_a)
            _rewards(sched, b"es_member-2", 0, chunk_a, 1.0)  # finite: a's NaN was a's
            assert a.strikes == strike or "es_member-1" not in sched.peers
            if "es_member-1" not in sched.peers:
                break
            for m in list(sched.rewards):  # start the chunk over for the next round
                del sched.rewards[m]
            sched.chunks, a.task = [], None
            sched.cut([a]), sched.pump()
        assert "es_member-1" not in sched.peers and sched.evicted == 1
        c = _hello(sched, b"es_member-3")
        sched.rewards = {}
        sched.cut([b, c])
        b.task = c.task = None
        sched.pump()
        chunk_b = list(b.task[1])
        _rewards(sched, b"es_member-2", 0, chunk_b, float("inf"))
        _rewards(sched, b"es_member-3", 0, list(c.task[1]), 1.0)  # c's own chunk, then b's to re-score
        sched.pump()
        assert c.task == (0, tuple(chunk_b))
        with pytest.raises(RunFailed, match=r"iteration 0: es_member-2 and es_member-3 scored ES member\(s\) "
                                            r"\[\d.*non-finite .*nothing was applied"):
            _rewards(sched, b"es_member-3", 0, chunk_b, float("inf"))
    finally:
        sched.close()
