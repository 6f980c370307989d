"""`--search lowrank` (EGGROLL): the batched low-rank forward is the dense W + sigma * A B^T / sqrt(r) forward
within float tolerance, the update is the dense reward-weighted sum, and in-process, 2 member processes, a
resumed run and `fucina eval --lora` all see the same bits."""
import json
import os

import numpy as np
import pytest
from threadpoolctl import threadpool_limits

from pipeline.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
F32 = os.path.join(ROOT, "tests", "fixtures", "qwen3-mini-f32.gguf")
Q8 = os.path.join(ROOT, "tests", "fixtures", "qwen3-mini-q8_0.gguf")


def _setup(model, rank, scorer=None, dequantize=False):
    from pipeline.es import ESConfig
    from pipeline.finetune.es import ESFinetune
    from pipeline.finetune.model import LoraModel
    from pipeline.llm import data as sft
    from pipeline.llm.chat import ChatTemplate
    from pipeline.llm.gguf import open_gguf
    from pipeline.llm.tokenizer import load_tokenizer
    gg = open_gguf(model)
    samples = sft.encode_all(sft.RawEncoder(load_tokenizer(gg)), ChatTemplate.from_gguf(gg), sft.PIRATE_PAIRS[:3])
    trainer = LoraModel.from_gguf(model, targets=("q",), rank=2, seed=5)
    cfg = ESConfig(sigma=0.05, alpha=0.05, population=6, antithetic=True, seed=9, restore_mode="snapshot")
    return ESFinetune(trainer, samples, sft.Loader(3), cfg, batch=3, search="lowrank", noise_rank=rank,
                      dequantize=dequantize, scorer=scorer), samples


@pytest.mark.parametrize("rank", [1, 3])
def test_batched_low_rank_forward_is_the_dense_perturbation(rank):
    from pipeline.finetune.model import batch_loss
    with threadpool_limits(1):
        run, samples = _setup(F32, rank)
        assert {n.split(".")[-2] for n in run.es.names} == {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate",
                                                            "ffn_up", "ffn_down"}
        run.iteration_step()  # W off its file values: the update took effect
        batched = run.score(range(6), [0, 1, 2])
        dense = []
        for m in range(6):
            run.es.perturb(m)  # W + sign * sigma * A B^T / sqrt(r), densely in place
            dense.append(-batch_loss(run.trainer, samples))
            run.es.restore(m)
        assert len(set(batched)) == 6  # the members differ
        np.testing.assert_allclose(batched, dense, rtol=2e-5)
        # one member alone (k = 1) and any member batch are the same bits
        assert [run.score([m], [0, 1, 2])[0] for m in range(6)] == batched


def test_update_is_the_dense_reward_weighted_sum():
    from pipeline.es import ESConfig
    from pipeline.es.lowrank import LowRankES
    from pipeline.es.shaping import shape
    rng = np.random.default_rng(3)
    ws = [rng.standard_normal((6, 5)).astype(np.float32), rng.standard_normal((4, 9)).astype(np.float32)]
    before = [w.copy() for w in ws]
    es = LowRankES(ESConfig(sigma=0.1, alpha=0.2, population=8, antithetic=True, seed=4), rank=2)
    for i, w in enumerate(ws):
        es.add_param(w, f"w{i}")
    rewards = rng.standard_normal(8)
    coeffs, _ = shape(rewards, 8, "z_score")
    expected = [b.astype(np.float64) for b in before]
    for m in range(8):  # member m's perturbation sign * sigma * E_d, weighted by its coefficient
        for e, (name, noise) in zip(expected, es.dense_noise(m).items()):
            e += 0.2 * coeffs[m] * noise.astype(np.float64) / 0.1 / 8
    es.update(rewards)
    for w, e, b in zip(ws, expected, before):
        assert not np.array_equal(w, b)
        np.testing.assert_allclose(w, e, rtol=1e-5, atol=1e-6)


def test_low_rank_refuses_a_quantized_base_without_dequantize(capsys):
    rc = main(["es-finetune", "--model", Q8, "--search", "lowrank", "--iterations", "1", "--json"])
    err = capsys.readouterr().err
    assert rc == 2 and "--search lowrank" in err and "--dequantize" in err and "Traceback" not in err


def _json(capsys, argv):
    rc = main(argv)
    out = capsys.readouterr()
    assert rc == 0, out.err
    return json.loads(out.out.strip().splitlines()[-1])


def test_in_process_two_workers_resume_and_eval_see_the_same_bits(tmp_path, capsys):
    from pipeline.finetune.build import eval_model
    from pipeline.runtime.ckpt import params_sha256
    common = ["es-finetune", "--model", Q8, "--search", "lowrank", "--noise-rank", "2", "--dequantize",
              "--population", "6", "--batch", "2", "--max-new-tokens", "2", "--threads", "0", "--eval-samples", "2",
              "--json"]
    one = _json(capsys, common + ["--iterations", "3", "--save", str(tmp_path / "one")])
    assert one["final_loss"] != one["initial_loss"]
    batched = _json(capsys, common + ["--iterations", "3", "--member-batch", "4"])
    workers = _json(capsys, common + ["--iterations", "3", "--member-batch", "3", "--workers", "2",
                                      "--out", str(tmp_path / "run")])
    _json(capsys, common + ["--iterations", "1", "--save", str(tmp_path / "half")])
    resumed = _json(capsys, common + ["--iterations", "3", "--load", str(tmp_path / "half")])
    for r in (batched, workers, resumed):
        assert r["searched_sha256"] == one["searched_sha256"]
    for r in (batched, workers):
        assert r["reward_stats"] == one["reward_stats"]
    trainer = eval_model(Q8, str(tmp_path / "one"))  # `fucina eval --lora RUN` loads the searched matrices
    from pipeline.es.lowrank import projection_slots
    weights = trainer.model.named_weights()
    named = [(n, weights[n].raw) for n in projection_slots(trainer).values()]
    assert params_sha256(named) == one["searched_sha256"]
