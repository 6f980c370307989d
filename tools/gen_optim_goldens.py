"""Generate optimizer parity goldens for tests/optim/test_goldens.py.

Run: .venv/bin/python tools/gen_optim_goldens.py   (needs torch and apollo-torch;
never imported at run time). Writes tests/goldens/optim/optim_goldens.npz (the
final parameters of every case) and tests/goldens/optim/meta.json (each case's
optimizer, kwargs, parameter shapes/routes, step count, and the generating
versions), so the test rebuilds every case from the JSON alone.

Inputs are pure functions of the counter RNG (pipeline.kernels.rng), so nothing but the
final parameters is stored:
    param i initial value = 0.5 * gaussian(derive_seed(seed, 10000 + i), shape)
    gradient of param i at step s = (1 + 0.5 sin s) * gaussian(derive_seed(seed, 64 s + i), shape)

References:
  sgd/adam/adamw  torch.optim.* with foreach=False (the single-tensor path).
                  Each is recorded twice: with stock torch, and with torch.Tensor.sqrt
                  replaced by a correctly rounded sqrt ("ieee_sqrt"), because
                  torch's CPU sqrt here goes through MKL VML, which is ~1 ulp off
                  on ~0.5% of elements and so perturbs small parameters by a few ulps.
  bf16 state      the same torch optimizer with its state buffers rounded to bf16
                  (round-to-nearest-even) after every step: the step math uses the
                  float32 values, the stored state is narrowed, as in our kernels.
  muon            a float32 transcription of Keller Jordan's Muon reference
                  (github.com/KellerJordan/Muon, muon.py: muon_update +
                  zeropower_via_newtonschulz5), run in float32 instead of bf16;
                  fallback params use torch.optim.AdamW(lr 3e-4, betas (0.9, 0.95),
                  eps 1e-10, wd 0) like our embedded fallback.
  apollo          apollo_torch.APOLLOAdamW (pip apollo-torch) with its random
                  projection replaced by ours (pipeline.optim.apollo.projection),
                  injected into GradientProjector.
"""
import json
import math
import pathlib
import platform
import sys
import types

import numpy as np
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipeline.kernels import rng  # noqa: E402
from pipeline.optim.apollo import projection  # noqa: E402

OUT = ROOT / "tests" / "goldens" / "optim"
STEPS = 21

MATS = [["w", [24, 40], "main"], ["v", [40, 16], "main"], ["b", [40], "main"]]


def case(opt, kwargs, params=None, seed=7, steps=STEPS, bf16=(), ieee_sqrt=False):
    return {"opt": opt, "kwargs": kwargs, "params": params or MATS, "seed": seed, "steps": steps,
            "bf16_state": list(bf16), "ieee_sqrt": ieee_sqrt}


def torch_cases():
    cases = {}
    for ieee in (False, True):
        tag = "_ieee" if ieee else ""
        cases.update({
            f"sgd_plain{tag}": case("sgd", {"lr": 0.05}, ieee_sqrt=ieee),
            f"sgd_momentum{tag}": case("sgd", {"lr": 0.05, "momentum": 0.9}, ieee_sqrt=ieee),
            f"sgd_dampening{tag}": case("sgd", {"lr": 0.05, "momentum": 0.9, "dampening": 0.3}, ieee_sqrt=ieee),
            f"sgd_nesterov_wd{tag}": case("sgd", {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
                                          ieee_sqrt=ieee),
            f"sgd_wd{tag}": case("sgd", {"lr": 0.05, "weight_decay": 0.1}, ieee_sqrt=ieee),
            f"adam{tag}": case("adam", {"lr": 0.01}, ieee_sqrt=ieee),
            f"adam_wd{tag}": case("adam", {"lr": 0.01, "weight_decay": 0.05}, ieee_sqrt=ieee),
            f"adamw_nowd{tag}": case("adamw", {"lr": 0.01, "weight_decay": 0.0}, ieee_sqrt=ieee),
            f"adamw_wd{tag}": case("adamw", {"lr": 0.01, "betas": [0.8, 0.99], "weight_decay": 0.1}, ieee_sqrt=ieee),
        })
    cases.update({
        "sgd_momentum_bf16": case("sgd", {"lr": 0.05, "momentum": 0.9, "state_dtype": "bf16"},
                                  bf16=["momentum_buffer"]),
        "sgd_nesterov_bf16": case("sgd", {"lr": 0.05, "momentum": 0.9, "nesterov": True, "state_dtype": "bf16"},
                                  bf16=["momentum_buffer"]),
        "adamw_bf16_m": case("adamw", {"lr": 0.01, "weight_decay": 0.1, "state_dtype": "bf16"}, bf16=["exp_avg"],
                             ieee_sqrt=True),
        "adamw_bf16_mv": case("adamw", {"lr": 0.01, "weight_decay": 0.1, "state_dtype": "bf16",
                                        "second_moment_dtype": "bf16"},
                              bf16=["exp_avg", "exp_avg_sq"], ieee_sqrt=True),
        "adam_bf16_m": case("adam", {"lr": 0.01, "state_dtype": "bf16"}, bf16=["exp_avg"], ieee_sqrt=True),
    })
    return cases


def muon_cases():
    shapes = [["square", [32, 32], "main"], ["wide", [24, 56], "main"], ["tall", [64, 20], "main"],
              ["bias", [32], "main"], ["embed", [50, 16], "fallback"]]
    return {
        "muon": case("muon", {"lr": 0.02}, shapes),
        "muon_wd_plain_momentum": case("muon", {"lr": 0.02, "weight_decay": 0.1, "nesterov": False, "momentum": 0.9},
                                       shapes),
        "muon_rms": case("muon", {"lr": 0.01, "scale": "match_rms_adamw", "weight_decay": 0.01,
                                  "fallback": {"lr": 0.003, "weight_decay": 0.01}}, shapes),
        "muon_bf16": case("muon", {"lr": 0.02, "state_dtype": "bf16"}, shapes, bf16=["momentum_buffer"]),
    }


def apollo_cases():
    shapes = [["tall", [48, 16], "main"], ["wide", [12, 40], "main"], ["bias", [16], "main"],
              ["embed", [30, 8], "fallback"]]
    return {
        "apollo_channel": case("apollo", {"lr": 0.01, "rank": 4, "update_proj_gap": 7, "seed": 5}, shapes),
        "apollo_channel_wd": case("apollo", {"lr": 0.01, "rank": 3, "update_proj_gap": 10, "seed": 9,
                                             "weight_decay": 0.05, "scale": 2.0}, shapes),
        "apollo_mini": case("apollo_mini", {"lr": 0.01, "update_proj_gap": 7, "seed": 5}, shapes),
    }


# --- inputs ---------------------------------------------------------------------

def initial(seed, i, shape):
    return (0.5 * rng.gaussian(rng.derive_seed(seed, 10000 + i), shape, dtype=np.float64)).astype(np.float32)


def gradient(seed, step, i, shape):
    g = rng.gaussian(rng.derive_seed(seed, 64 * step + i), shape, dtype=np.float64)
    return (g * (1.0 + 0.5 * math.sin(step))).astype(np.float32)


# --- torch references ---------------------------------------------------------------

def _ieee_sqrt(self):
    return torch.from_numpy(np.sqrt(self.detach().numpy().astype(np.float64)).astype(np.float32))


def narrow_bf16_(t):
    t.copy_(t.bfloat16().float())


def run_torch(spec):
    params = [torch.nn.Parameter(torch.from_numpy(initial(spec["seed"], i, shape)))
              for i, (_, shape, _) in enumerate(spec["params"])]
    kwargs = {k: v for k, v in spec["kwargs"].items() if k not in ("state_dtype", "second_moment_dtype")}
    if "betas" in kwargs:
        kwargs["betas"] = tuple(kwargs["betas"])
    cls = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[spec["opt"]]
    if spec["opt"] == "adamw" and "weight_decay" not in kwargs:
        kwargs["weight_decay"] = 0.01
    opt = cls(params, foreach=False, **kwargs)
    saved_sqrt = torch.Tensor.sqrt
    if spec["ieee_sqrt"]:
        torch.Tensor.sqrt = _ieee_sqrt
    try:
        for step in range(spec["steps"]):
            for i, (p, (_, shape, _)) in enumerate(zip(params, spec["params"])):
                p.grad = torch.from_numpy(gradient(spec["seed"], step, i, shape))
            opt.step()
            for p in params:
                for key in spec["bf16_state"]:
                    narrow_bf16_(opt.state[p][key])
    finally:
        torch.Tensor.sqrt = saved_sqrt
    return [p.detach().numpy().copy() for p in params]


def keller_newtonschulz5(G, steps):
    """zeropower_via_newtonschulz5 from Keller Jordan's muon.py, in float32 (the reference uses bf16)."""
    assert G.ndim >= 2
    a, b, c = (3.4445, -4.7750, 2.0315)
    X = G.float()
    if G.size(-2) > G.size(-1):
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        A = X @ X.mT
        B = b * A + c * A @ A
        X = a * X + B @ X
    if G.size(-2) > G.size(-1):
        X = X.mT
    return X


def keller_muon_update(grad, momentum, beta, ns_steps, nesterov, scale_mode):
    """muon_update from the reference (grad is a clone: the reference lerps p.grad in place)."""
    momentum.lerp_(grad, 1 - beta)
    update = grad.lerp_(momentum, beta) if nesterov else momentum
    if update.ndim == 4:
        update = update.view(len(update), -1)
    update = keller_newtonschulz5(update, steps=ns_steps)
    rows, cols = update.size(-2), update.size(-1)
    if scale_mode == "spectral":
        update *= max(1, rows / cols) ** 0.5
    else:  # Moonlight's RMS matching
        update *= 0.2 * math.sqrt(max(rows, cols))
    return update


def run_muon(spec):
    kw = spec["kwargs"]
    lr, wd = kw.get("lr", 0.02), kw.get("weight_decay", 0.0)
    beta, nesterov = kw.get("momentum", 0.95), kw.get("nesterov", True)
    scale_mode = kw.get("scale", "spectral")
    fb = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-10, "weight_decay": 0.0}
    fb.update({k: (tuple(v) if k == "betas" else v) for k, v in (kw.get("fallback") or {}).items()})
    params, muon_params, fallback_params = [], [], []
    for i, (_, shape, route) in enumerate(spec["params"]):
        p = torch.nn.Parameter(torch.from_numpy(initial(spec["seed"], i, shape)))
        params.append(p)
        (fallback_params if route == "fallback" or len(shape) < 2 else muon_params).append(p)
    adamw = torch.optim.AdamW(fallback_params, foreach=False, **fb)
    state = {}
    for step in range(spec["steps"]):
        for i, (p, (_, shape, _)) in enumerate(zip(params, spec["params"])):
            p.grad = torch.from_numpy(gradient(spec["seed"], step, i, shape))
        with torch.no_grad():
            for p in muon_params:
                if p not in state:
                    state[p] = torch.zeros_like(p)
                update = keller_muon_update(p.grad.clone(), state[p], beta, 5, nesterov, scale_mode)
                p.mul_(1 - lr * wd)
                p.add_(update.reshape(p.shape), alpha=-lr)
                if "momentum_buffer" in spec["bf16_state"]:
                    narrow_bf16_(state[p])
        adamw.step()
    return [p.detach().numpy().copy() for p in params]


def run_apollo(spec):
    sys.modules.setdefault("transformers", types.ModuleType("transformers"))
    sys.modules.setdefault("transformers.utils", types.ModuleType("transformers.utils"))
    versions = types.ModuleType("transformers.utils.versions")
    versions.require_version = lambda *a, **k: None
    sys.modules["transformers.utils.versions"] = versions
    # import apollo_torch.apollo without the package __init__ (which needs bitsandbytes for
    # the 8-bit variants we do not use)
    import importlib.util
    if "apollo_torch" not in sys.modules:
        pkg = types.ModuleType("apollo_torch")
        pkg.__path__ = list(importlib.util.find_spec("apollo_torch").submodule_search_locations)
        sys.modules["apollo_torch"] = pkg
    from apollo_torch import apollo as apollo_module
    from apollo_torch import random_projector

    kw = dict(spec["kwargs"])
    mini = spec["opt"] == "apollo_mini"
    rank = kw.get("rank", 1 if mini else 128)
    gap = kw.get("update_proj_gap", 200)
    seed = kw.get("seed", 0)
    group = {"rank": rank, "update_proj_gap": gap, "scale": kw.get("scale", 128.0 if mini else 1.0),
             "proj": "random", "proj_type": "std", "scale_type": kw.get("scale_type", "tensor" if mini else "channel")}

    names = {}

    class OurProjector(random_projector.GradientProjector):
        def project(self, full_rank_grad, iter):
            self._iter = iter
            return super().project(full_rank_grad, iter)

        def update_ortho_matrix(self, full_rank_grad, proj_type):
            rows, cols = full_rank_grad.shape
            assert proj_type == ("right" if rows >= cols else "left")
            P = projection(seed, self._name, self._iter // self.update_proj_gap, rows, cols, self.rank)
            self.ortho_matrix = torch.from_numpy(P)

    def init_projector(self, group, state):
        pr = OurProjector(group["rank"], update_proj_gap=group["update_proj_gap"], scale=group["scale"],
                          proj_type=group["proj_type"], seed=state["seed"])
        pr._name = names[state["seed"]]
        return pr

    apollo_module.AdamW._initialize_projector = init_projector
    params, projected, plain = [], [], []
    for i, (name, shape, route) in enumerate(spec["params"]):
        p = torch.nn.Parameter(torch.from_numpy(initial(spec["seed"], i, shape)))
        params.append(p)
        (projected if route == "main" and len(shape) == 2 else plain).append((name, p))
    # apollo_torch seeds each projector with the 1-based param index across groups
    for idx, (name, _) in enumerate(projected + plain, start=1):
        names[idx] = name
    opt = apollo_module.AdamW([dict(group, params=[p for _, p in projected]), {"params": [p for _, p in plain]}],
                                   lr=kw.get("lr", 0.01), betas=tuple(kw.get("betas", (0.9, 0.999))),
                                   eps=kw.get("eps", 1e-6), weight_decay=kw.get("weight_decay", 0.0))
    for step in range(spec["steps"]):
        for i, (p, (_, shape, _)) in enumerate(zip(params, spec["params"])):
            p.grad = torch.from_numpy(gradient(spec["seed"], step, i, shape))
        opt.step()
    return [p.detach().numpy().copy() for p in params]


def main():
    import importlib.metadata as md
    OUT.mkdir(parents=True, exist_ok=True)
    cases = {**torch_cases(), **muon_cases(), **apollo_cases()}
    arrays = {}
    for name, spec in cases.items():
        if spec["opt"] in ("sgd", "adam", "adamw"):
            final = run_torch(spec)
        elif spec["opt"] == "muon":
            final = run_muon(spec)
        else:
            final = run_apollo(spec)
        for (pname, _, _), arr in zip(spec["params"], final):
            arrays[f"{name}/{pname}"] = arr
        print(f"{name}: {len(final)} params")
    np.savez_compressed(OUT / "optim_goldens.npz", **arrays)
    meta = {
        "generator": "tools/gen_optim_goldens.py",
        "versions": {"torch": torch.__version__, "apollo-torch": md.version("apollo-torch"),
                     "numpy": np.__version__, "python": platform.python_version()},
        "muon_reference": "Keller Jordan muon.py (muon_update, zeropower_via_newtonschulz5) transcribed in float32",
        "inputs": "initial = 0.5*gaussian(derive_seed(seed, 10000+i)); "
                  "grad(step) = (1+0.5 sin step)*gaussian(derive_seed(seed, 64*step+i))",
        "cases": cases,
    }
    (OUT / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")


if __name__ == "__main__":
    main()
