"""`fucina es-finetune` on the tiny Q8_0 Qwen3 fixture: resume bit-exactness (with anchored decay),
the checkpoint layout, no backward anywhere, the loss falls, the searched tensors, clear errors."""
import json
import os

import numpy as np
import pytest
from threadpoolctl import threadpool_limits

from pipeline.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = os.path.join(ROOT, "tests", "fixtures", "qwen3-mini-q8_0.gguf")
SMALL = ("--population", "4", "--batch", "2", "--max-new-tokens", "3", "--threads", "0")


@pytest.fixture(autouse=True, scope="module")
def one_blas_thread():
    """Tiny matmuls: one BLAS thread is faster on a shared 2-core box (restored afterwards)."""
    with threadpool_limits(1):
        yield


def _run(capsys, *argv):
    rc = main(["es-finetune", "--model", MODEL, *SMALL, *argv, "--json"])
    out = capsys.readouterr()
    return rc, (json.loads(out.out.strip().splitlines()[-1]) if rc == 0 else None), out.err


def test_stop_and_resume_is_bit_identical_with_anchored_decay(tmp_path, capsys):
    common = ("--shuffle", "--anchor-decay", "l2", "--anchor-lambda", "5", "--sigma", "0.05", "--alpha", "0.05")
    rc, full, err = _run(capsys, "--iterations", "4", *common)
    assert rc == 0, err
    assert full["iterations"] == 4 and len(full["reward_means"]) == 4
    rc, half, _ = _run(capsys, "--iterations", "2", "--save", str(tmp_path / "a"), *common)
    assert rc == 0 and half["adapters_sha256"] != full["adapters_sha256"]
    # the checkpoint's ES settings win over the flags (a different sigma is reported and ignored)
    rc, resumed, err = _run(capsys, "--iterations", "4", "--load", str(tmp_path / "a"), "--shuffle", "--sigma", "0.5")
    assert rc == 0, err
    assert "ignoring --sigma 0.5" in err and "resumed" in err
    assert resumed["adapters_sha256"] == full["adapters_sha256"]
    assert resumed["final_loss"] == full["final_loss"]
    assert resumed["reward_means"] == full["reward_means"][2:]


def test_checkpoint_layout_and_es_fields(tmp_path, capsys):
    rc, s, _ = _run(capsys, "--iterations", "2", "--save", str(tmp_path / "r"), "--save-every", "1")
    assert rc == 0
    final = tmp_path / "r"
    assert sorted(p.name for p in final.iterdir()) == ["adapters.safetensors", "checkpoint-step-1",
                                                       "trainer_state.json"]
    assert (final / "checkpoint-step-1" / "trainer_state.json").is_file()
    assert not (final / "checkpoint-step-1" / "optimizer.safetensors").exists()
    state = json.loads((final / "trainer_state.json").read_text())
    cfg = state["config"]
    assert state["step"] == 2 and cfg["es_iteration"] == 2
    assert cfg["es_population"] == 4 and cfg["es_antithetic"] is True and cfg["es_restore_mode"] == "snapshot"
    assert cfg["lora"]["rank"] == 8 and cfg["lora"]["targets"] == ["q", "v"] and cfg["es_search"] == "ab"
    # 2 iterations x batch 2
    assert set(state["loader"]) == {"seed", "epoch", "index"} and state["loader"]["index"] == 4
    from safetensors.numpy import load_file
    tensors = load_file(final / "adapters.safetensors")
    assert sorted(tensors)[0] == "layers.0.q.lora_a" and len(tensors) == 2 * 2 * 2
    assert all(np.any(t) for n, t in tensors.items() if n.endswith("lora_b"))  # ES moved B off zero
    from pipeline.finetune.model import LoraModel, adapters_sha256
    reloaded = LoraModel.from_gguf(MODEL, targets=("q", "v"), seed=42)
    reloaded.load_adapter_tensors(tensors)
    assert adapters_sha256(reloaded) == s["adapters_sha256"]


def test_no_backward_anywhere_and_the_loss_falls(monkeypatch, capsys):
    from pipeline.autograd.tensor import Tensor

    def refuse(*_a, **_k):
        raise AssertionError("es-finetune called backward()")

    monkeypatch.setattr(Tensor, "backward", refuse)
    rc, s, err = _run(capsys, "--iterations", "6", "--population", "8", "--batch", "5")
    assert rc == 0, err
    assert s["final_loss"] < s["initial_loss"], s
    assert "BEFORE" in err and "AFTER" in err and "member-evals/s" in err


def test_search_b_keeps_a_at_its_init():
    from pipeline.es import ESConfig
    from pipeline.finetune.es import ESFinetune
    from pipeline.finetune.model import batch_loss
    from pipeline.llm import data as sft
    from pipeline.finetune.model import LoraModel
    from pipeline.llm.tokenizer import load_tokenizer
    from pipeline.llm.chat import ChatTemplate
    from pipeline.llm.gguf import open_gguf

    gg = open_gguf(MODEL)
    enc, tpl = sft.RawEncoder(load_tokenizer(gg)), ChatTemplate.from_gguf(gg)
    samples = sft.encode_all(enc, tpl, sft.PIRATE_PAIRS[:3])
    trainer = LoraModel.from_gguf(MODEL, targets=("v",), rank=4, seed=3)
    a_init = {n: p.data.copy() for n, p in trainer.named_parameters() if n.endswith("lora_a")}
    run = ESFinetune(trainer, samples, sft.Loader(3), ESConfig(sigma=0.05, alpha=0.05, population=4, seed=1,
                                                              restore_mode="snapshot"), batch=3, search="b")
    assert run.es.names == ["layers.0.v.lora_b", "layers.1.v.lora_b"]
    base = batch_loss(trainer, samples)
    # batch_loss is the trainer's own token-weighted mean CE (B = 0: the base model). Here the loss is taken with
    # the graph on, whose float32 reductions may run in another order than batch_loss's no-grad path: each
    # sample's CE sum of n positive float32 terms is then within n * eps32 (relative) of the other order's.
    total = sum(float(trainer.loss(s.inputs, s.labels, reduction="sum").item()) for s in samples)
    float32_bound = max(s.n_valid for s in samples) * float(np.finfo(np.float32).eps)
    assert base == pytest.approx(total / sum(s.n_valid for s in samples), rel=float32_bound)
    stats = run.iteration_step()
    assert stats["batch"] == [0, 1, 2] and run.iteration == 1
    for n, p in trainer.named_parameters():
        if n.endswith("lora_a"):
            assert np.array_equal(p.data, a_init[n])
        else:
            assert np.any(p.data)
    assert batch_loss(trainer, samples) != base


def test_rank_mismatch_on_resume_is_a_config_error(tmp_path, capsys):
    assert _run(capsys, "--iterations", "1", "--save", str(tmp_path / "c"))[0] == 0
    rc, _, err = _run(capsys, "--iterations", "2", "--load", str(tmp_path / "c"), "--rank", "4")
    assert rc == 2 and "config.lora.rank" in err and "is 8" in err
    rc, _, err = _run(capsys, "--iterations", "2", "--load", str(tmp_path / "c"), "--shuffle")
    assert rc == 2 and "config.order" in err


def test_bad_inputs_are_one_line_errors(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"instruction": "a", "response": "b"}\n{"instruction": "a" "response": "b"}\n')
    rc, _, err = _run(capsys, "--data", str(bad))
    assert rc == 2 and "bad.jsonl:2: malformed JSON" in err
    rc = main(["es-finetune", "--model", str(tmp_path / "none.gguf")])
    err = capsys.readouterr().err
    assert rc == 2 and "no such file" in err
    rc, _, err = _run(capsys, "--population", "5")
    assert rc == 2 and "population" in err and "even" in err
    rc, _, err = _run(capsys, "--anchor-decay", "l1")
    assert rc == 2 and "--anchor-lambda" in err
    rc, _, err = _run(capsys, "--save-every", "2")
    assert rc == 2 and "--save" in err
    rc, _, err = _run(capsys, "--load", str(tmp_path))
    assert rc == 2 and "not a committed checkpoint" in err
    # a backprop `fucina finetune` checkpoint has no es_* fields: refused by name, nothing loaded
    assert main(["finetune", "--model", MODEL, "--targets", "q,v", "--steps", "1", "--accum-steps", "1",
                 "--max-new-tokens", "1", "--save", str(tmp_path / "bp")]) == 0
    capsys.readouterr()
    rc, _, err = _run(capsys, "--load", str(tmp_path / "bp"))
    assert rc == 2 and "config.es_sigma" in err and "not an es-finetune checkpoint" in err


@pytest.mark.slow
def test_default_run_lowers_the_pirate_loss(capsys):
    """The default ES settings on the fixture, 60 iterations (population 16 x batch 5): a measurable drop."""
    rc = main(["es-finetune", "--model", MODEL, "--iterations", "60", "--max-new-tokens", "3", "--threads", "0",
               "--json"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    s = json.loads(out.out.strip().splitlines()[-1])
    assert s["final_loss"] <= 0.9 * s["initial_loss"], s
    means = s["reward_means"]
    assert np.mean(means[-10:]) > np.mean(means[:10])  # the population's reward rose, not just the end point


def test_checkpoint_exports_like_a_backprop_one(tmp_path, capsys):
    """`fucina export-gguf` merges an ES checkpoint (same layout); the merged model scores the ES final loss."""
    f32 = os.path.join(ROOT, "tests", "fixtures", "qwen3-mini-f32.gguf")
    rc = main(["es-finetune", "--model", f32, *SMALL, "--iterations", "2", "--eval-samples", "5",
               "--sigma", "0.1", "--alpha", "0.1", "--save", str(tmp_path / "es"), "--json"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    s = json.loads(out.out.strip().splitlines()[-1])
    assert main(["export-gguf", "--from-gguf", f32, "--adapters", str(tmp_path / "es"),
                 "--out", str(tmp_path / "merged.gguf")]) == 0
    capsys.readouterr()
    from pipeline.llm.tokenizer import load_tokenizer
    from pipeline.finetune.model import batch_loss
    from pipeline.llm import data as sft
    from pipeline.llm.chat import ChatTemplate
    from pipeline.finetune.model import LoraModel
    from pipeline.llm.gguf import open_gguf
    gg = open_gguf(tmp_path / "merged.gguf")
    samples = sft.encode_all(sft.RawEncoder(load_tokenizer(gg)), ChatTemplate.from_gguf(gg),
                             sft.PIRATE_PAIRS)
    merged = batch_loss(LoraModel.from_gguf(tmp_path / "merged.gguf"), samples)  # B = 0 adapters: the merged base alone
    assert s["final_loss"] != s["initial_loss"]
    assert merged == pytest.approx(s["final_loss"], rel=1e-4)


def test_same_bits_with_one_and_two_threads(capsys):
    runs = []
    for threads in ("1", "2"):
        rc = main(["es-finetune", "--model", MODEL, "--population", "4", "--batch", "2", "--max-new-tokens", "2",
                   "--iterations", "2", "--threads", threads, "--json"])
        out = capsys.readouterr()
        assert rc == 0, out.err
        runs.append(json.loads(out.out.strip().splitlines()[-1]))
    assert runs[0]["adapters_sha256"] == runs[1]["adapters_sha256"]
    assert runs[0]["reward_means"] == runs[1]["reward_means"]


def test_member_processes_equal_in_process(tmp_path, capsys):
    rc, inproc, err = _run(capsys, "--iterations", "2")
    assert rc == 0, err
    rc, fanned, err = _run(capsys, "--iterations", "2", "--workers", "2", "--out", str(tmp_path / "run"))
    assert rc == 0, err
    assert "2 es_member processes on the runtime" in err
    assert fanned["adapters_sha256"] == inproc["adapters_sha256"]
    assert fanned["reward_means"] == inproc["reward_means"]


def _flags(*argv):
    import argparse

    from pipeline.commands import es_finetune
    p = argparse.ArgumentParser()
    es_finetune.add_arguments(p)
    return p.parse_args(["--model", MODEL, *argv])


@pytest.mark.parametrize("argv", [(), ("--task", "countdown", "--task-numbers", "3", "--population", "6",
                                       "--anchor-decay", "l1", "--anchor-lambda", "0.5", "--shuffle", "--data-seed",
                                       "9", "--no-antithetic", "--reward", "rule:format", "--member-batch", "2")])
def test_the_job_spec_stands_for_the_flags_every_replica_builds_from(argv):
    """spec_of (flags -> the es-finetune job's typed fields) carries every flag the builder reads, with the ES
    settings resolved (the noise seed derived from --seed, population/sigma/... their defaults), and the replica
    an es_member builds from that spec alone (build_es) is the one the command builds from the flags."""
    from pipeline.commands.es_finetune import ES_DEFAULTS, _es_settings, build as command_build, reward_spec, spec_of
    from pipeline.finetune.build import build_es, es_reward
    from pipeline.finetune.spec import ESFinetuneSpec
    from pipeline.jobs.spec import build
    args = _flags(*argv)
    spec = build(ESFinetuneSpec, spec_of(args))
    settings = _es_settings(args, None, log=lambda m: None)
    assert spec.task == args.task
    for name in ("model", "task_numbers", "shuffle", "seed", "rank", "reward_timeout", "lora_alpha",
                 "targets", "seq_max", "member_batch", "max_new_tokens"):
        assert getattr(spec, name) == getattr(args, name), name
    assert spec.data_seed == args.data_seed
    assert es_reward(spec) == reward_spec(args)  # the --reward list travels as one spec string
    assert {k: getattr(spec, k) or None for k in ES_DEFAULTS if k != "anchor_lambda"} == \
           {k: settings[k] or None for k in ES_DEFAULTS if k != "anchor_lambda"}
    assert spec.es_seed == settings["seed"]
    replica = build_es(spec).run
    here = command_build(args, log=lambda m: None)[0]
    assert replica.es.config == here.es.config and replica.batch == here.batch
    assert replica.loader.state() == here.loader.state() and replica.loader.order == here.loader.order
    assert [n for n, _ in replica.trainer.named_parameters()] == [n for n, _ in here.trainer.named_parameters()]
    assert all(np.array_equal(a.data, b.data) for (_, a), (_, b) in zip(replica.trainer.named_parameters(),
                                                                        here.trainer.named_parameters()))
    assert type(replica.scorer) is type(here.scorer) and len(replica.scorer) == len(here.scorer)


@pytest.mark.parametrize("text, message", [
    ('model = "m.gguf"\nbatch = 0\n', "field 'batch' must be >= 1, got 0"),
    ('model = "m.gguf"\npopulation = 5\n', "field 'population' must be even with antithetic pairs"),
    ('model = "m.gguf"\nsearch = "full"\n', "field 'search' must be one of"),
    ('model = "m.gguf"\nflags = "{}"\n', "unknown field 'flags'"),
    ('batch = 2\n', "field 'model' (a GGUF file) is required"),
])
def test_a_bad_es_finetune_job_file_is_one_error_naming_the_field(tmp_path, text, message):
    from pipeline.errors import UserError
    from pipeline.finetune.spec import ESFinetuneSpec
    from pipeline.jobs.spec import build, load_toml
    path = tmp_path / "es.toml"
    path.write_text(text)
    with pytest.raises(UserError) as e:
        build(ESFinetuneSpec, load_toml(str(path), ESFinetuneSpec), where=str(path))
    assert message in str(e.value)


def test_a_replica_resumed_from_a_checkpoint_takes_its_es_settings(tmp_path, capsys):
    """An es_member's replica of a `load` spec (build_es) takes the checkpoint's ES settings, batch and search over
    the spec's, as the command line does; only a population that differs is refused (the job's make_task)."""
    from pipeline.errors import UserError
    from pipeline.finetune.build import build_es
    from pipeline.finetune.es import ESFinetuneJob
    from pipeline.finetune.spec import ESFinetuneSpec
    from pipeline.jobs.spec import build
    rc = main(["es-finetune", "--model", MODEL, *SMALL, "--iterations", "1", "--sigma", "0.02", "--save",
               str(tmp_path / "c")])
    assert rc == 0, capsys.readouterr().err
    spec = build(ESFinetuneSpec, {"model": MODEL, "load": str(tmp_path / "c"), "population": 4})  # sigma 0.05
    run = build_es(spec).run
    assert (run.es.config.sigma, run.batch, run.search, run.iteration) == (0.02, 2, "ab", 1)
    with pytest.raises(UserError, match="field 'population' is 6"):
        ESFinetuneJob(build(ESFinetuneSpec, {"model": MODEL, "load": str(tmp_path / "c"), "population": 6})).make_task()


def test_tensorboard_gets_each_in_process_iteration(tmp_path, capsys):
    import glob

    from pipeline.runtime.tensorboard import read_events
    rc, s, _ = _run(capsys, "--iterations", "2", "--tensorboard", str(tmp_path / "tb"))
    assert rc == 0
    (path,) = glob.glob(str(tmp_path / "tb" / "events.out.tfevents.*"))
    events = read_events(path)[1:]
    assert [e["step"] for e in events] == [1, 2]
    assert [e["scalars"]["es/reward_mean"] for e in events] == pytest.approx(s["reward_means"], rel=1e-6)
    assert "es/evals_per_s" in events[0]["scalars"]
