"""The optimizer surface: registration, config errors, 16-bit params, persistence."""
import ml_dtypes
import numpy as np
import pytest

from pipeline.kernels import rng
from pipeline.autograd.tensor import Tensor
from pipeline.errors import ConfigMismatchError, DTypeMismatchError, FucinaError
from pipeline.optim import SGD, Adam, AdamW, Apollo, Lion, Muon, OptimizerConfigError, OptimizerSet

BF16 = ml_dtypes.bfloat16


def param(shape, seed, dtype=np.float32):
    return Tensor(rng.gaussian(seed, shape).astype(dtype), requires_grad=True)


def grads_for(tensors, step):
    for i, t in enumerate(tensors):
        t.grad = rng.gaussian(rng.derive_seed(99, 32 * step + i), t.shape)


def model(seed=0):
    return [("w", param((12, 20), seed + 1)), ("v", param((20, 6), seed + 2)),
            ("b", param((6,), seed + 3)), ("emb", param((15, 4), seed + 4))]


def run(opt, tensors, steps, start=0):
    for s in range(start, start + steps):
        grads_for(tensors, s)
        opt.step()
        opt.zero_grad()


# --- configuration errors ---------------------------------------------------------

@pytest.mark.parametrize("make,match", [
    (lambda: AdamW([], lr=-1e-3), "lr must be >= 0"),
    (lambda: AdamW([], betas=(0.9, 1.0)), r"betas\[1\] must be < 1"),
    (lambda: Adam([], betas=(-0.1, 0.9)), r"betas\[0\] must be >= 0"),
    (lambda: SGD([], momentum=0.0, nesterov=True), "nesterov requires momentum > 0"),
    (lambda: SGD([], momentum=0.9, dampening=0.1, nesterov=True), "dampening == 0"),
    (lambda: Apollo([], second_moment_dtype="bf16"), "second_moment_dtype='bf16' is not supported"),
    (lambda: Apollo([], state_dtype="bf16"), "APOLLO state stays float32"),
    (lambda: AdamW([], state_dtype="f8"), "expected 'f32' or 'bf16'"),
    (lambda: Muon([], scale="huge"), "scale must be one of"),
    (lambda: Lion([], weight_decay=-1), "weight_decay must be >= 0"),
    (lambda: Apollo([], rank=0), "rank must be >= 1"),
])
def test_bad_configurations_raise_clear_errors(make, match):
    with pytest.raises(OptimizerConfigError, match=match):
        make()


def test_lr_setter_validates():
    opt = SGD([], lr=0.1)
    with pytest.raises(OptimizerConfigError, match="lr"):
        opt.lr = -0.5
    opt.lr = 0.2
    assert opt.lr == 0.2


def test_registration_names_and_duplicates():
    a, b = param((3,), 1), param((3,), 2)
    opt = AdamW([a, ("bias", b)])
    assert [n for n, _ in opt.named_parameters()] == ["param.0", "bias"]
    with pytest.raises(OptimizerConfigError, match="already registered"):
        opt.add_param(a, name="again")
    with pytest.raises(OptimizerConfigError, match="duplicate slot name"):
        opt.add_param(param((3,), 3), name="bias")
    with pytest.raises(OptimizerConfigError, match="float32, float16 or bfloat16"):
        opt.add_param(Tensor(np.zeros(3), dtype=np.float64))
    m = Muon([("w", param((4, 4), 4))])
    m.add_fallback_param(param((5, 4), 5), name="emb")
    with pytest.raises(OptimizerConfigError, match="already registered"):
        m.add_fallback_param(m.params[0])


def test_step_skips_params_without_grad_and_zero_grad_clears():
    a, b = param((4,), 1), param((4,), 2)
    before = b.data.copy()
    opt = SGD([a, b], lr=0.1)
    a.grad = np.ones(4, np.float32)
    opt.step()
    assert np.array_equal(b.data, before)
    opt.zero_grad()
    assert a.grad is None and b.grad is None


def test_bad_gradient_is_named():
    a = param((4,), 1)
    opt = AdamW([("w", a)])
    a.grad = np.ones(5, np.float32)
    with pytest.raises(FucinaError, match="'w'.*shape"):
        opt.step()


def test_muon_routes_vectors_to_the_fallback():
    w, b, emb = param((8, 6), 1), param((6,), 2), param((10, 6), 3)
    opt = Muon([("w", w), ("b", b)], fallback_params=[("emb", emb)])
    assert [s.name for s in opt.slots] == ["w"]
    assert [s.name for s in opt.fallback.slots] == ["b", "emb"]
    assert opt.fallback.lr == 3e-4 and opt.fallback.betas == (0.9, 0.95) and opt.fallback.eps == 1e-10


def test_lion_matches_a_numpy_reference():
    p = param((50,), 1)
    x = p.data.astype(np.float64)
    m = np.zeros(50)
    opt = Lion([p], lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)
    for s in range(5):
        grads_for([p], s)
        g = p.grad.astype(np.float64)
        x = x * (1 - 1e-2 * 0.1) - 1e-2 * np.sign(0.9 * m + 0.1 * g)
        m = 0.99 * m + 0.01 * g
        opt.step()
    assert np.allclose(p.data, x, rtol=0, atol=1e-6)


# --- 16-bit parameters -------------------------------------------------------------

@pytest.mark.parametrize("dtype", [BF16, np.float16])
def test_16bit_params_step_through_an_f32_master(dtype):
    value = rng.gaussian(5, (64,)).astype(dtype)
    p16 = Tensor(value.copy(), requires_grad=True)
    p32 = Tensor(value.astype(np.float32), requires_grad=True)
    o16, o32 = AdamW([p16], lr=1e-5), AdamW([p32], lr=1e-5)  # steps far below 16-bit resolution
    for s in range(10):
        grads_for([p16], s)
        p32.grad = p16.grad.copy()
        o16.step()
        o32.step()
    assert p16.data.dtype == np.dtype(dtype)
    master = o16.slots[0].master
    assert np.array_equal(master, p32.data)  # the master accumulates exactly what an f32 param would
    assert np.array_equal(p16.data, p32.data.astype(dtype))  # narrowed back after each step
    assert not np.array_equal(master, value.astype(np.float32))  # sub-resolution updates were kept
    sd = o16.state_dict()
    assert sd["tensors"]["param.0.master"].dtype == np.float32


# --- persistence -------------------------------------------------------------------

def make(kind, tensors):
    named = list(tensors)
    if kind == "adamw_bf16":
        return AdamW(named, lr=1e-2, state_dtype="bf16", second_moment_dtype="bf16")
    if kind == "sgd_bf16":
        return SGD(named, lr=1e-2, momentum=0.9, state_dtype="bf16")
    if kind == "lion":
        return Lion(named, lr=1e-3, weight_decay=0.1)
    if kind == "muon":
        o = Muon([x for x in named if x[0] != "emb"], lr=0.02, weight_decay=0.01)
        o.add_fallback_param(dict(named)["emb"], name="emb")
        return o
    if kind == "apollo":
        o = Apollo([x for x in named if x[0] != "emb"], lr=1e-2, rank=2, update_proj_gap=3, seed=11)
        o.add_fallback_param(dict(named)["emb"], name="emb")
        return o
    if kind == "apollo_mini":
        return Apollo.mini(named, update_proj_gap=4)
    if kind == "set":
        decay = AdamW([x for x in named if x[1].ndim == 2], lr=1e-2, weight_decay=0.1)
        plain = AdamW([x for x in named if x[1].ndim < 2], lr=1e-2, weight_decay=0.0)
        return OptimizerSet(decay, plain)
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["adamw_bf16", "sgd_bf16", "lion", "muon", "apollo", "apollo_mini", "set"])
def test_resume_is_bit_exact_even_with_permuted_registration(kind):
    full = model()
    opt = make(kind, full)
    run(opt, [t for _, t in full], 8)
    ref_params = {n: t.data.copy() for n, t in full}

    half = model()
    opt = make(kind, half)
    run(opt, [t for _, t in half], 4)
    sd = opt.state_dict()
    saved = {n: t.data.copy() for n, t in half}

    fresh = model(seed=100)  # different init: nothing can leak
    for n, t in fresh:
        t.data[...] = saved[n]
    perm = [fresh[i] for i in (2, 0, 3, 1)] if kind != "set" else fresh
    resumed = make(kind, perm)
    resumed.load_state_dict(sd)
    order = {n: t for n, t in fresh}
    run(resumed, [order[n] for n, _ in full], 4, start=4)
    for n, t in fresh:
        assert np.array_equal(t.data, ref_params[n]), n


def test_state_dict_shape_and_contents():
    tensors = model()
    opt = AdamW(tensors, state_dtype="bf16")
    run(opt, [t for _, t in tensors], 2)
    sd = opt.state_dict()
    assert sd["type"] == "adamw" and sd["config"]["state_dtype"] == "bf16" and sd["config"]["lr"] == 1e-3
    assert sd["tensors"]["w.exp_avg"].dtype == BF16 and sd["tensors"]["w.exp_avg_sq"].dtype == np.float32
    assert sd["scalars"]["w.step"] == 2
    import json
    json.dumps(sd["config"])


def test_load_errors_name_the_field():
    tensors = model()
    ap = Apollo(tensors[:3], rank=2)
    run(ap, [t for _, t in tensors[:3]], 1)
    sd = ap.state_dict()
    with pytest.raises(ConfigMismatchError, match="'config.rank'"):
        Apollo(tensors[:3], rank=3).load_state_dict(sd)
    with pytest.raises(ConfigMismatchError, match="field 'type'"):
        AdamW(tensors[:3]).load_state_dict(sd)

    aw = AdamW(tensors, state_dtype="bf16")
    run(aw, [t for _, t in tensors], 1)
    sd = aw.state_dict()
    with pytest.raises(DTypeMismatchError, match="'config.state_dtype' is 'bf16'"):
        AdamW(tensors).load_state_dict(sd)
    # even with the config field forged, the stored dtype itself is checked
    forged = dict(sd, config=dict(sd["config"], state_dtype="f32"))
    with pytest.raises(DTypeMismatchError, match="w.exp_avg is stored as bfloat16"):
        AdamW(tensors).load_state_dict(forged)
    bad_shape = dict(sd, tensors=dict(sd["tensors"], **{"w.exp_avg": sd["tensors"]["w.exp_avg"][:3]}))
    with pytest.raises(ConfigMismatchError, match="w.exp_avg has shape"):
        AdamW(tensors, state_dtype="bf16").load_state_dict(bad_shape)
    renamed = [("other" if n == "w" else n, t) for n, t in tensors]
    with pytest.raises(ConfigMismatchError, match="'w'|other"):
        AdamW(renamed, state_dtype="bf16").load_state_dict(sd)
    m = Muon(tensors[:2], scale="spectral")
    with pytest.raises(ConfigMismatchError, match="'config.scale'"):
        Muon(tensors[:2], scale="match_rms_adamw").load_state_dict(m.state_dict())


def test_lr_is_not_taken_from_the_checkpoint():
    tensors = model()
    opt = AdamW(tensors, lr=0.5)
    run(opt, [t for _, t in tensors], 1)
    other = AdamW(tensors, lr=0.01)
    other.load_state_dict(opt.state_dict())
    assert other.lr == 0.01


def test_set_rejects_a_shared_parameter_and_namespaces_state():
    tensors = model()
    a = AdamW(tensors[:2])
    with pytest.raises(OptimizerConfigError, match="stepped twice"):
        OptimizerSet(a, SGD(tensors[1:3]))
    s = OptimizerSet(a, Muon(tensors[2:]))
    run(s, [t for _, t in tensors], 1)
    sd = s.state_dict()
    assert "0.w.exp_avg" in sd["tensors"] and "1.fallback.b.exp_avg" in sd["tensors"]
    assert [m["type"] for m in sd["config"]["members"]] == ["adamw", "muon"]


def test_param_groups_view_sets_lr_like_torch():
    tensors = model()
    muon = Muon(tensors[:3], lr=0.02)
    groups = muon.param_groups
    assert [g["lr"] for g in groups] == [0.02, 3e-4]
    assert [len(g["params"]) for g in groups] == [2, 1]  # w, v | b routed to the fallback
    for g in groups:
        g["lr"] = g["lr"] * 0.5
    assert (muon.lr, muon.fallback.lr) == (0.01, 1.5e-4)
    with pytest.raises(KeyError):
        groups[0]["betas"] = (0.9, 0.9)


def test_apollo_projection_is_a_pure_function_of_seed_name_and_refresh_epoch():
    from pipeline.optim.apollo import projection
    a = projection(3, "layers.0.w", 0, 40, 16, 4)
    assert a.shape == (4, 16) and a.dtype == np.float32  # rows >= cols: right projection [rank, cols]
    assert projection(3, "layers.0.w", 0, 16, 40, 4).shape == (16, 4)  # wide: left [rows, rank]
    assert np.array_equal(a, projection(3, "layers.0.w", 0, 40, 16, 4))
    assert not np.array_equal(a, projection(3, "layers.0.w", 1, 40, 16, 4))
    assert not np.array_equal(a, projection(4, "layers.0.w", 0, 40, 16, 4))
    assert not np.array_equal(a, projection(3, "layers.1.w", 0, 40, 16, 4))
    assert abs(float(a.std()) * 2 - 1) < 0.3  # N(0, 1/rank) with rank 4

    # inside the optimizer, P changes exactly at multiples of update_proj_gap
    w = param((40, 16), 1)
    opt = Apollo([("w", w)], rank=4, update_proj_gap=3, seed=3)
    seen = []
    for s in range(7):
        grads_for([w], s)
        opt.step()
        seen.append(opt._proj_cache["w"][0])
    assert seen == [0, 0, 0, 1, 1, 1, 2]
    assert np.array_equal(opt._proj_cache["w"][1], projection(3, "w", 2, 40, 16, 4))


def test_newton_schulz_orthogonalizes_and_muon_flattens_conv_weights():
    from pipeline.optim.muon import newton_schulz5
    G = rng.gaussian(1, (12, 30)) * np.linspace(0.01, 10, 30, dtype=np.float32)
    s = np.linalg.svd(newton_schulz5(G), compute_uv=False)
    assert s.min() > 0.5 and s.max() < 1.5  # every direction ~ the same step
    tall = newton_schulz5(G.T.copy())
    assert np.allclose(tall, newton_schulz5(G).T, atol=1e-6)
    conv = param((6, 3, 2, 2), 2)
    opt = Muon([("conv", conv)], lr=0.02)
    grads_for([conv], 0)
    before = conv.data.copy()
    opt.step()
    step = (before - conv.data).reshape(6, 12) / np.float32(0.02)
    # first step: the Nesterov update is a multiple of g, and Newton-Schulz is scale-invariant
    assert np.allclose(step, newton_schulz5(conv.grad.reshape(6, 12)), atol=1e-4)


def test_muon_and_apollo_steps_are_thread_count_invariant():
    import numba
    from threadpoolctl import threadpool_limits
    results = []
    for threads in (1, 2):
        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
        try:
            with threadpool_limits(threads):
                ws = [("w", param((384, 512), 1)), ("v", param((512, 256), 2))]
                muon = Muon(ws[:1])
                apollo = Apollo(ws[1:], rank=8)
                for s in range(2):
                    grads_for([t for _, t in ws], s)
                    muon.step()
                    apollo.step()
                results.append([t.data.copy() for _, t in ws])
        finally:
            numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    for a, b in zip(*results):
        assert np.array_equal(a, b)
