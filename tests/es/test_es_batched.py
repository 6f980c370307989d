"""The population as one batch: rewards bitwise equal to scoring members one by one in place, for any batch
split, any number of member processes, quantized and f32 bases (qwen2: with biases), A+B or B-only search."""
import json
import os

import numpy as np
import pytest
from threadpoolctl import threadpool_limits

from pipeline.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURES = os.path.join(ROOT, "tests", "fixtures")


@pytest.fixture(autouse=True, scope="module")
def one_blas_thread():
    with threadpool_limits(1):
        yield


def _setup(model, search, targets=("q", "v", "down")):
    from pipeline.llm.tokenizer import load_tokenizer
    from pipeline.es import ESConfig
    from pipeline.finetune.es import ESFinetune
    from pipeline.llm import data as sft
    from pipeline.llm.chat import ChatTemplate
    from pipeline.finetune.model import LoraModel
    from pipeline.llm.gguf import open_gguf
    gg = open_gguf(model)
    samples = sft.encode_all(sft.RawEncoder(load_tokenizer(gg)), ChatTemplate.from_gguf(gg), sft.PIRATE_PAIRS[:3])
    trainer = LoraModel.from_gguf(model, targets=targets, rank=4, seed=5)
    cfg = ESConfig(sigma=0.1, alpha=0.1, population=6, antithetic=True, seed=9, restore_mode="snapshot")
    return ESFinetune(trainer, samples, sft.Loader(3), cfg, batch=3, search=search), samples


@pytest.mark.parametrize("model, search", [("qwen3-mini-q8_0.gguf", "ab"), ("qwen3-mini-f32.gguf", "b"),
                                           ("qwen3-tied-q4_k_s.gguf", "ab"), ("qwen2-mini-f32.gguf", "ab"),
                                           ("gemma3-gemma-mini-f32.gguf", "ab")])
def test_batched_rewards_are_the_one_by_one_bits(model, search):
    from pipeline.finetune.model import batch_loss
    run, samples = _setup(os.path.join(FIXTURES, model), search)
    run.iteration_step()  # B off zero, so every factor matters
    es = run.es
    one_by_one = []
    for m in range(es.config.population):
        es.perturb(m)
        one_by_one.append(-batch_loss(run.trainer, samples))
        es.restore(m)
    rows = es.split(es.materialize_members(range(es.config.population)))
    for split in (1, 2, 4, 6):
        assert run.scorer.score_members(run.trainer, rows, [0, 1, 2], split) == one_by_one, split
    assert len(set(one_by_one)) > 1  # the members differ, so equal lists are not a coincidence


def test_member_batch_flag_same_bits_in_process_and_in_member_processes(tmp_path, capsys):
    model = os.path.join(FIXTURES, "qwen3-mini-q8_0.gguf")
    common = ["es-finetune", "--model", model, "--population", "6", "--batch", "2", "--max-new-tokens", "2",
              "--iterations", "2", "--threads", "0", "--json"]
    results = []
    in_processes = ["--member-batch", "3", "--workers", "2", "--out", str(tmp_path / "run")]
    for extra in ([], ["--member-batch", "4"], in_processes):
        assert main(common + extra) == 0
        results.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    for r in results[1:]:
        assert r["adapters_sha256"] == results[0]["adapters_sha256"]
        assert r["reward_stats"] == results[0]["reward_stats"]
    rc = main(common + ["--member-batch", "2", "--search", "full"])
    assert rc == 2 and "one at a time" in capsys.readouterr().err


def test_member_batch_decodes_generation_rewards_in_lock_step_with_the_same_bits(tmp_path, capsys):
    model = os.path.join(FIXTURES, "qwen3-mini-q8_0.gguf")
    common = ["es-finetune", "--model", model, "--population", "6", "--batch", "2", "--max-new-tokens", "4",
              "--iterations", "2", "--threads", "0", "--json", "--reward", "rule:length=8,12", "--sigma", "0.5"]
    results = []
    in_processes = ["--member-batch", "3", "--workers", "2", "--out", str(tmp_path / "run")]
    for extra in ([], ["--member-batch", "4"], in_processes):
        assert main(common + extra) == 0
        results.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    for r in results[1:]:
        assert r["adapters_sha256"] == results[0]["adapters_sha256"]
        assert r["reward_stats"] == results[0]["reward_stats"]


class _Adapted:
    """A test-side LoRA view through the model's documented projection seam: base infer + the delta."""

    def __init__(self, proj, a, b, scale):
        self.proj, self.a, self.b, self.scale = proj, a, b, scale

    def infer(self, x):
        from pipeline.llm.lora import lora_forward
        return self.proj.infer(x) + lora_forward(np.ascontiguousarray(x), self.a, self.b, self.scale)[0]


def _member_view(trainer, rows, m):
    """trainer.model with member m's adapters (rows: {name: (k, ...)}) wrapped into its projections."""
    import copy
    from pipeline.models.decoder import MLP, Attention, Block
    view = copy.copy(trainer.model)
    view.blocks = []
    for i, b in enumerate(trainer.model.blocks):
        wrap = {}
        for t in ("q", "k", "v", "o", "gate", "up", "down"):
            ad = trainer.layers[i].get(t)
            if ad is None:
                wrap[t] = b.projection(t)
                continue
            name = f"layers.{i}.{t}.lora_"
            factor_a = rows[name + "a"][m] if name + "a" in rows else ad.lora_a.data
            factor_b = rows[name + "b"][m] if name + "b" in rows else ad.lora_b.data
            wrap[t] = _Adapted(b.projection(t), factor_a, factor_b, ad.scale)
        view.blocks.append(Block(b.attn_norm, Attention(wrap["q"], wrap["k"], wrap["v"], wrap["o"], b.attn.q_norm,
                                                        b.attn.k_norm), b.ffn_norm,
                                 MLP(wrap["gate"], wrap["up"], wrap["down"]), b.post_attn_norm, b.post_ffn_norm))
    return view


@pytest.mark.parametrize("model, search", [("qwen3-mini-q8_0.gguf", "ab"), ("qwen3-mini-f32.gguf", "b"),
                                           ("qwen3-tied-q4_k_s.gguf", "ab"), ("qwen2-mini-f32.gguf", "ab"),
                                           ("gemma3-gemma-mini-f32.gguf", "ab")])
def test_lock_step_decoding_is_the_one_by_one_bits(model, search):
    """Members x prompts decoded in lock-step (any member split): each row's tokens and logits are the bits
    of that member alone through the plain KV-cache decoder with its adapters in the projections."""
    from pipeline.autograd import no_grad
    from pipeline.es.batched import member_factors, member_generations
    from pipeline.llm.generate import generate
    from pipeline.llm.lora import lora_forward
    run, _ = _setup(os.path.join(FIXTURES, model), search)
    es, trainer, k = run.es, run.trainer, 4
    gen = np.random.default_rng(3)
    for _, p in trainer.named_parameters():  # adapters far from B = 0, so members decode differently
        p.data[...] = gen.standard_normal(p.data.shape).astype(np.float32)
    rows = es.split(es.materialize_members(range(k)))
    prompts = [np.array([1, 5, 9, 2, 7, 3]), np.array([3, 4]), np.array([1, 5, 9, 2, 8, 6])]
    alone = []
    for m in range(k):
        view = _member_view(trainer, rows, m)
        alone.append([list(generate(view, p, 5)) for p in prompts])
    for split in (1, 3, 4):
        got = []
        for start in range(0, k, split):
            chunk = {n: v[start:start + split] for n, v in rows.items()}
            got += member_generations(trainer, chunk, len(next(iter(chunk.values()))), prompts, 5)
        assert got == alone, split
    factors = member_factors(trainer, rows, k)  # and the logits themselves, bit for bit

    def adapt(layer, target, x3, y3):
        for a, b, scale in factors[layer].get(target, ()):
            for m in range(k):
                y3[m] += lora_forward(x3[m], a[m], b[m], scale)[0]

    ids = np.stack([prompts[0]] * k)
    with no_grad():  # as every decode runs (DecoderLM.infer is no-grad: the integer dots apply to its few rows)
        batched = trainer.model.infer_rows(ids, [trainer.model.new_cache(8) for _ in range(k)], adapt)
    for m in range(k):
        assert np.array_equal(batched[m], _member_view(trainer, rows, m).infer(prompts[0]))
    assert not np.array_equal(batched[0], batched[1])  # the members differ, so equal bits are no coincidence


@pytest.mark.parametrize("rows, t, n_in, n_out, rank", [(6, 1, 64, 48, 4), (4, 7, 96, 32, 8), (3, 51, 576, 192, 8)])
def test_stacked_lora_deltas_are_each_members_own_bits(rows, t, n_in, n_out, rank):
    """lora_forward_stacked (every member's delta in two np.matmul calls) against one lora_forward per entry, for
    factors that are views of one flat row per member (ESTrainer.split), broadcast or gathered."""
    from pipeline.llm.lora import lora_forward, lora_forward_stacked
    gen = np.random.default_rng(rows * t)
    x3 = gen.standard_normal((rows, t, n_in), dtype=np.float32)
    flat = gen.standard_normal((rows, 3 + rank * n_in + n_out * rank), dtype=np.float32)
    a = flat[:, 3:3 + rank * n_in].reshape(rows, rank, n_in)
    b = flat[:, 3 + rank * n_in:].reshape(rows, n_out, rank)
    scale = np.float32(16 / rank)
    pick = np.array([rows - 1] + list(range(rows - 1)))
    cases = [(a, b, range(rows)), (a[pick], b[pick], pick),
             (np.broadcast_to(a[1], a.shape), np.broadcast_to(b[1], b.shape), [1] * rows)]
    for fa, fb, members in cases:
        got = lora_forward_stacked(x3, fa, fb, scale)
        want = np.stack([lora_forward(x3[j], a[m], b[m], scale)[0] for j, m in enumerate(members)])
        assert np.array_equal(got, want)
    grouped = lora_forward_stacked(x3.reshape(1, rows, t, n_in), a[None, :1], b[None, :1], scale)[0]
    assert np.array_equal(grouped, np.stack([lora_forward(x3[j], a[0], b[0], scale)[0] for j in range(rows)]))
    assert not np.array_equal(got, want[::-1])  # the rows differ, so the equalities are no coincidence


def test_shared_head_tiles_are_matmul_nt_bits_per_member():
    """matmul_nt_each on a head big enough for matmul_nt's tiled branch (the fixtures' heads are not): each member's
    logits are matmul_nt's for that member alone; below the tiled size it is matmul_nt itself."""
    from pipeline.kernels.nn import TILED_MIN_FLOPS, matmul_nt, matmul_nt_each
    gen = np.random.default_rng(7)
    w = gen.standard_normal((12000, 576), dtype=np.float32)
    xs = [gen.standard_normal((14, 576), dtype=np.float32) for _ in range(3)]
    assert 2 * 14 * w.shape[0] * w.shape[1] >= TILED_MIN_FLOPS
    got = matmul_nt_each(xs, w)
    for x, logits in zip(xs, got):
        assert np.array_equal(logits, matmul_nt(x, w))
    assert not np.array_equal(got[0], got[1])
    small = [x[:2, :64] for x in xs]
    narrow = w[:300, :64]
    assert all(np.array_equal(g, matmul_nt(x, narrow)) for g, x in zip(matmul_nt_each(small, narrow), small))
