"""The LoRA trainer over a frozen Qwen3: torch goldens, finite differences,
frozen base, checkpointed layers, dropout streams, accumulation arm."""
import json
import os

import numpy as np
import pytest

from pipeline.autograd import Tensor
from pipeline.errors import UserError
from pipeline.autograd import parameter
from pipeline.finetune.model import TARGETS, LoraModel
from pipeline.models.decoder import MLP, Attention, Block, FrozenLinear, Linear
from pipeline.models.qwen3 import Qwen3, Qwen3Config

GOLDEN = os.path.join(os.path.dirname(__file__), "..", "goldens", "lora", "trainer_golden.npz")
CFG = Qwen3Config(vocab_size=64, hidden=32, layers=2, heads=4, kv_heads=2, head_dim=8, ffn=48)


def random_model(cfg=CFG, seed=0):
    return Qwen3.init_random(cfg, seed=seed)


def model_from_arrays(cfg, z):
    """A Qwen3 whose weights are the golden's arrays (GGUF-style names)."""
    lin = lambda name: Linear(parameter(z[name], name))
    vec = lambda name: Tensor(z[name])
    blocks = []
    for i in range(cfg.layers):
        p = f"blk.{i}."
        attn = Attention(lin(p + "q"), lin(p + "k"), lin(p + "v"), lin(p + "o"),
                         vec(p + "attn_q_norm"), vec(p + "attn_k_norm"))
        blocks.append(Block(vec(p + "attn_norm"), attn, vec(p + "ffn_norm"),
                            MLP(lin(p + "gate"), lin(p + "up"), lin(p + "down"))))
    embed = parameter(z["token_embd"], "token_embd")
    return Qwen3(cfg, embed, blocks, vec("output_norm"), Linear(embed))


def _sample(seq=24, n_masked=6, seed=0):
    g = np.random.default_rng(seed)
    tokens = g.integers(0, CFG.vocab_size, seq)
    labels = np.r_[tokens[1:], g.integers(0, CFG.vocab_size)]
    labels[:n_masked] = -100
    return tokens, labels


def _grads(tr):
    return {n: p.grad.copy() for n, p in tr.named_parameters()}


def _warm(tr, steps=2, lr=0.05, seed=0):
    """A few plain SGD steps so B != 0 and the A gradients are live."""
    for s in range(steps):
        tr.zero_grad()
        tr.loss(*_sample(seed=100 + s)).backward()
        for p in tr.parameters():
            p.data -= np.float32(lr) * p.grad
    tr.zero_grad()


def test_golden_parity_with_torch_replica():
    z = np.load(GOLDEN)
    meta = json.loads(str(z["meta"]))["config"]
    cfg = Qwen3Config(vocab_size=meta["vocab"], hidden=meta["hidden"], layers=meta["layers"], heads=meta["heads"],
                      kv_heads=meta["kv_heads"], head_dim=meta["head_dim"], ffn=meta["ffn"],
                      rope_base=meta["rope_theta"], rms_eps=meta["norm_eps"])
    tr = LoraModel(model_from_arrays(cfg, z), targets=TARGETS, rank=meta["rank"], alpha=meta["alpha"])
    tr.load_adapter_tensors({n: z[n] for n, _ in tr.named_parameters()})
    loss = tr.loss(z["tokens"], z["labels"])
    loss.backward()
    assert abs(loss.item() - float(z["expected_loss"])) <= 1e-5 * abs(float(z["expected_loss"]))
    worst = 0.0
    for n, p in tr.named_parameters():
        ref = z["grad." + n]
        worst = max(worst, float(np.abs(p.grad - ref).max() / np.abs(ref).max()))
    print(f"golden: worst grad rel dev {worst:.2e}")
    assert worst <= 1e-5, worst


def test_finite_differences_through_the_whole_loss():
    base = random_model(seed=5)
    tr = LoraModel(base, targets=("q", "v", "down"), rank=4, alpha=8, seed=1)
    _warm(tr)
    tokens, labels = _sample(seq=40, n_masked=10, seed=7)
    tr.loss(tokens, labels).backward()
    g = np.random.default_rng(3)
    analytic, numeric = [], []
    eps = 1e-2
    for name, p in tr.named_parameters():
        idx = [tuple(int(g.integers(0, s)) for s in p.shape) for _ in range(8)]
        for i in idx:
            keep = p.data[i]
            vals = []
            for e in (eps, -eps):
                p.data[i] = keep + e
                vals.append(tr.loss(tokens, labels).data.astype(np.float64).item())
            p.data[i] = keep
            numeric.append((vals[0] - vals[1]) / (2 * eps))
            analytic.append(float(p.grad[i]))
    a, n = np.array(analytic), np.array(numeric)
    cos = a @ n / (np.linalg.norm(a) * np.linalg.norm(n))
    print(f"FD cosine {cos:.7f} over {len(a)} elements")
    assert cos >= 0.99999, cos
    assert np.abs(a).min() > 0  # the A gradients are live after warm-up


def _projections(model):
    for blk in model.blocks:
        yield from (blk.attn.q, blk.attn.k, blk.attn.v, blk.attn.o, blk.mlp.gate, blk.mlp.up, blk.mlp.down)


def test_zero_b_is_the_base_and_frozen_base_gets_no_gradient():
    model = random_model(seed=2)  # init_random: every base weight is even a requires_grad parameter
    snapshot = [p.weight.data.copy() for p in _projections(model)]
    tokens, labels = _sample()
    base_logits = model.forward(tokens).data
    tr = LoraModel(model, targets=TARGETS, rank=2, dropout=0.2, seed=9)
    # B == 0: the adapted model IS the base model (the model's own autograd forward)
    np.testing.assert_allclose(tr.eval_logits(tokens), base_logits, rtol=1e-5, atol=1e-5)
    loss = tr.loss(tokens, labels)
    loss.backward()
    # only adapters are parameters and every one got a gradient ...
    assert all(n.rsplit(".", 1)[1] in ("lora_a", "lora_b") for n, _ in tr.named_parameters())
    assert all(p.grad is not None for p in tr.parameters())
    # ... while no base tensor received one (they enter the graph as constants) and none changed
    from pipeline.autograd import named_parameters
    base_tensors = named_parameters(model)
    assert len(base_tensors) > 0 and all(t.grad is None for _, t in base_tensors)
    for p, before in zip(_projections(model), snapshot):
        np.testing.assert_array_equal(p.weight.data, before)
    # zero structure: B == 0 -> dL/dA == 0 exactly, dL/dB != 0
    for n, p in tr.named_parameters():
        assert (np.abs(p.grad).sum() == 0) == n.endswith("lora_a"), n


def test_quantized_base_trains_and_stays_untouched():
    from gguf import GGMLQuantizationType as QT, quantize
    from pipeline.llm.quants import FORMATS, FrozenWeight
    cfg = Qwen3Config(vocab_size=64, hidden=64, layers=1, heads=2, kv_heads=1, head_dim=32, ffn=64)
    model = random_model(cfg, seed=4)
    blk = model.blocks[0]
    for holder, attr in ((blk.attn, "q"), (blk.attn, "k"), (blk.attn, "v"), (blk.attn, "o"),
                         (blk.mlp, "gate"), (blk.mlp, "up"), (blk.mlp, "down")):
        w = getattr(holder, attr).weight.data
        setattr(holder, attr, FrozenLinear(FrozenWeight(FORMATS[QT.Q8_0], quantize(w, QT.Q8_0), w.shape, attr)))
    before = blk.attn.q.weight.raw.copy()
    tr = LoraModel(model, rank=4)
    tokens, labels = _sample(seq=12, n_masked=3)
    # with B == 0 the trainer reproduces the model's forward over the quantized weights
    np.testing.assert_allclose(tr.eval_logits(tokens), model.forward(tokens).data, rtol=1e-4, atol=1e-4)
    l0 = tr.loss(tokens, labels)
    l0.backward()
    for p in tr.parameters():
        p.data -= np.float32(0.1) * p.grad
    assert tr.loss(tokens, labels).item() < l0.item()
    np.testing.assert_array_equal(blk.attn.q.weight.raw, before)


def test_checkpoint_layers_is_bitwise_equal_with_dropout():
    base = random_model(seed=3)
    tokens, labels = _sample(seq=20)
    runs = []
    for ckpt in (False, True):
        tr = LoraModel(base, targets=("q", "v", "gate"), rank=4, dropout=0.3, seed=11, checkpoint_layers=ckpt)
        _warm(tr, steps=2)
        loss = tr.loss(tokens, labels)
        loss.backward()
        runs.append((loss.item(), _grads(tr)))
    assert runs[0][0] == runs[1][0]
    for n in runs[0][1]:
        np.testing.assert_array_equal(runs[0][1][n], runs[1][1][n])


def test_dropout_stream_follows_the_step_counter_and_eval_does_not_advance_it():
    base = random_model(seed=3)
    tokens, labels = _sample(seq=16)
    tr = LoraModel(base, rank=4, dropout=0.5, seed=2)
    _warm(tr, steps=1)
    step = tr.step
    tr.eval_logits(tokens)
    tr.generate(tokens[:4], max_new_tokens=2)
    assert tr.step == step
    a = tr.loss(tokens, labels).item()
    b = tr.loss(tokens, labels).item()
    assert a != b  # a new step draws a new dropout mask
    tr.step = step
    assert tr.loss(tokens, labels).item() == a  # a restored counter replays it


def test_sum_reduction_with_scale_is_the_mean():
    base = random_model(seed=6)
    tokens, labels = _sample()
    tr = LoraModel(base, rank=2)
    mean = tr.loss(tokens, labels).item()
    n_valid = int((labels != -100).sum())
    s = tr.loss(tokens, labels, reduction="sum", loss_scale=1.0 / n_valid).item()
    assert s == pytest.approx(mean, rel=1e-6)


def test_bad_inputs_are_clear_errors():
    base = random_model(seed=6)
    with pytest.raises(UserError, match="targets"):
        LoraModel(base, targets=("q", "x"))
    with pytest.raises(UserError, match="rank"):
        LoraModel(base, rank=100)
    tr = LoraModel(base)
    with pytest.raises(UserError, match="token ids"):
        tr.loss(np.array([1, 2, 999]), np.array([2, 3, 4]))
    with pytest.raises(UserError, match="labels shape"):
        tr.loss(np.array([1, 2]), np.array([2]))


def test_grouped_projections_equal_one_by_one_bitwise(monkeypatch):
    """q/k/v and gate/up share one tile dispatch (adapted_linears, adapters riding in it):
    same bits as one call per weight."""
    import pipeline.finetune.model as ft
    fixture = os.path.join(os.path.dirname(__file__), "..", "fixtures", "qwen3-mini-q8_0.gguf")

    def run():
        tr = LoraModel.from_gguf(fixture, targets=("q", "v", "gate"), rank=4)
        for p in tr.parameters():
            p.data[...] = np.random.default_rng(0).standard_normal(p.shape).astype(np.float32) * 0.1
        tokens = np.arange(40) % tr.config.vocab_size
        loss = tr.loss(tokens, np.roll(tokens, -1))
        loss.backward()
        return loss.item(), _grads(tr)

    grouped = run()
    one_by_one = ft.adapted_linears
    monkeypatch.setattr(ft, "adapted_linears", lambda x, ws, ads: [one_by_one(x, [w], [a])[0] for w, a in zip(ws, ads)])
    single = run()
    assert grouped[0] == single[0]
    for n in grouped[1]:
        np.testing.assert_array_equal(grouped[1][n], single[1][n])


def test_the_adapter_init_is_pure_in_the_seed():
    """--seed seeds every A (B starts at 0): the same seed gives the same bits, another seed other values."""
    def init(seed):
        return LoraModel(random_model(), targets=("q", "v"), rank=4, seed=seed).adapter_tensors()
    one, again, other = init(7), init(7), init(8)
    a_names = [n for n in one if n.endswith("lora_a")]
    assert len(a_names) == CFG.layers * 2
    for n in one:
        assert one[n].tobytes() == again[n].tobytes()
    for n in a_names:
        assert np.any(one[n]) and not np.array_equal(one[n], other[n])
    assert all(not np.any(one[n]) and not np.any(other[n]) for n in one if n.endswith("lora_b"))


def test_the_schedule_warms_up_then_decays_to_zero_at_the_last_step():
    from pipeline.finetune.schedule import lr_factor
    warm = [lr_factor(s, 2, 10, "cosine") for s in range(2)]
    assert warm == [0.5, 1.0] == [lr_factor(s, 2, 10, "linear") for s in range(2)]
    for decay in ("linear", "cosine"):
        after = [lr_factor(s, 2, 10, decay) for s in range(2, 10)]
        assert after[0] == 1.0 and all(a > b for a, b in zip(after, after[1:])) and 0.0 < after[-1] < 0.2
        assert lr_factor(10, 2, 10, decay) == 0.0
    assert lr_factor(5, 2, 10, "linear") == pytest.approx(1 - 3 / 8)
    assert lr_factor(6, 2, 10, "cosine") == pytest.approx(0.5)  # half way through the decay
    assert [lr_factor(s, 2, 10, "constant") for s in range(2, 10)] == [1.0] * 8
    with pytest.raises(UserError, match="decay"):
        lr_factor(0, 0, 10, "step")


def test_segmented_attention_is_each_segment_alone():
    """ops.attention(segments=...): every packed segment gets the output and gradients it gets alone."""
    from pipeline.autograd import ops
    g = np.random.default_rng(3)
    lengths = [5, 70, 1, 9]  # one segment longer than a query block (64), one of a single position
    t = sum(lengths)
    q, k, v = (Tensor(g.standard_normal((1, t, 4, 8)).astype(np.float32), requires_grad=True) for _ in range(3))
    seg = np.repeat(np.arange(len(lengths)), lengths)
    out = ops.attention(q, k, v, causal=True, segments=seg)
    w = g.standard_normal(out.shape).astype(np.float32)
    (out * w).sum().backward()
    start = 0
    for n in lengths:
        part = [Tensor(x.data[:, start:start + n].copy(), requires_grad=True) for x in (q, k, v)]
        alone = ops.attention(*part, causal=True)
        np.testing.assert_allclose(out.data[:, start:start + n], alone.data, rtol=1e-5, atol=1e-6)
        (alone * w[:, start:start + n]).sum().backward()
        for whole, p in zip((q, k, v), part):
            np.testing.assert_allclose(whole.grad[:, start:start + n], p.grad, rtol=1e-4, atol=1e-5)
        start += n
    with pytest.raises(Exception, match="non-decreasing"):
        ops.attention(q, k, v, causal=True, segments=seg[::-1])


@pytest.mark.parametrize("fixture", ["qwen3-mini-q8_0.gguf", "gemma3-gemma-mini-f32.gguf"])
def test_a_packed_window_has_the_loss_and_gradients_of_its_samples_one_by_one(fixture):
    """--pack's contract on the real forward (RoPE positions restarting, q/k norms, gemma's sliding window): the
    summed CE and the adapter gradients of samples packed in one window equal the sum over the samples alone."""
    from pipeline.finetune.model import packed
    from pipeline.llm.data import Sample
    path = os.path.join(os.path.dirname(__file__), "..", "fixtures", fixture)
    tr = LoraModel.from_gguf(path, targets=TARGETS, rank=4, seed=1)
    g = np.random.default_rng(0)
    for p in tr.parameters():  # B != 0: every adapter gradient is live
        p.data[...] = (0.1 * g.standard_normal(p.shape)).astype(np.float32)
    vocab = tr.config.vocab_size
    samples = []
    for n in (7, 3, 12):
        labels = g.integers(0, vocab, n)
        labels[: n // 3] = -100
        samples.append(Sample(g.integers(0, vocab, n), labels, n // 3, -100))
    one_by_one, grads = 0.0, None
    for s in samples:
        tr.zero_grad()
        loss = tr.loss(s.inputs, s.labels, reduction="sum")
        loss.backward()
        one_by_one += float(loss.item())
        mine = _grads(tr)
        grads = mine if grads is None else {n: grads[n] + mine[n] for n in grads}
    tr.zero_grad()
    tokens, labels, segments = packed(samples)
    loss = tr.loss(tokens, labels, reduction="sum", segments=segments)
    loss.backward()
    assert float(loss.item()) == pytest.approx(one_by_one, rel=1e-5)
    together = _grads(tr)
    for n in grads:
        np.testing.assert_allclose(together[n], grads[n], rtol=1e-3, atol=1e-4 * np.abs(grads[n]).max())
    tr.zero_grad()
    unsegmented = float(tr.loss(tokens, labels, reduction="sum").item())
    assert abs(unsegmented - one_by_one) > 1e-3  # without the mask the samples see each other: the test can fail


def test_pack_windows_first_fit_in_order():
    from pipeline.finetune.model import pack_windows
    assert pack_windows([5, 4, 3, 2, 6], 8) == [[0, 2], [1, 3], [4]]
    assert pack_windows([8, 1], 8) == [[0], [1]]
    with pytest.raises(UserError, match="does not fit"):
        pack_windows([9], 8)
