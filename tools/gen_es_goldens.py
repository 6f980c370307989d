"""Generate tests/goldens/es/: the ES noise mapping and update algebra, transcribed independently.

Run: .venv/bin/python tools/gen_es_goldens.py
Never imported at run time. This is a second, scalar/numpy transcription of
the algebra (pure-Python splitmix64 and polynomial gaussian; z-score in float64
with ddof 0; centered ranks with ties broken by member index; antithetic fold
(C+ - C-) * eps; f32 update sum_n C_n eps_n / N * alpha; anchored weight decay
l1/l2) written from the formulas in pipeline/es/trainer.py and
pipeline/kernels/es_noise.py docstrings, on our own noise (the reference's torch Philox
RNG is deliberately replaced by splitmix64). Tests compare the trainer
against these values within float32 tolerance.
"""
import json
import math
import platform
import sys
from pathlib import Path

import ml_dtypes
import numpy as np

OUT = Path(__file__).resolve().parent.parent / "tests" / "goldens" / "es"
MASK = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15


def at(seed, i):
    z = (seed + (i + 1) * GOLDEN) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def gaussian(key, n):
    """Scalar transcription of the fast mapping (float64 list)."""
    L = [1 / 3, 1 / 5, 1 / 7, 1 / 9, 1 / 11, 1 / 13]
    S = [-1 / 6, 1 / 120, -1 / 5040, 1 / 362880, -1 / 39916800]
    K = [-0.5, 1 / 24, -1 / 720, 1 / 40320, -1 / 3628800, 1 / 479001600]
    out = []
    for p in range((n + 1) // 2):
        u1 = 1.0 - float(at(key, 2 * p) >> 11) * (1.0 / 9007199254740992.0)
        u2 = float(at(key, 2 * p + 1) >> 11) * (1.0 / 9007199254740992.0)
        m, e = math.frexp(u1)
        if m < 0.7071067811865476:
            m, e = m * 2.0, e - 1
        s = (m - 1.0) / (m + 1.0)
        z = s * s
        poly = 1.0 + z * (L[0] + z * (L[1] + z * (L[2] + z * (L[3] + z * (L[4] + z * L[5])))))
        r = math.sqrt(-2.0 * (e * 0.6931471805599453 + 2.0 * s * poly))
        y = u2 * 4.0
        q = math.floor(y + 0.5)
        x = (y - q) * 1.5707963267948966
        x2 = x * x
        sx = x * (1.0 + x2 * (S[0] + x2 * (S[1] + x2 * (S[2] + x2 * (S[3] + x2 * S[4])))))
        cx = 1.0 + x2 * (K[0] + x2 * (K[1] + x2 * (K[2] + x2 * (K[3] + x2 * (K[4] + x2 * K[5])))))
        c, sn = [(cx, sx), (-sx, cx), (-cx, -sx), (sx, -cx)][int(q) & 3]
        out += [r * c, r * sn]
    return out[:n]


def eps(seed, iteration, draw, slot, size, scheme):
    key = at(at(seed, iteration), draw)
    if scheme == "iid":
        key = at(key, slot)
    return np.array(gaussian(key, size)).astype(np.float32)


def shape_rewards(r, shaping):
    r = np.array(r, dtype=np.float64)
    bad = ~np.isfinite(r)
    r[bad] = r[~bad].min()  # the documented non-finite rule: worst finite reward
    if shaping == "z_score":
        return (r - r.mean()) / (r.std() + 1e-8)
    ranks = np.empty(r.size)
    order = sorted(range(r.size), key=lambda n: (r[n], n))
    for rank, n in enumerate(order):
        ranks[n] = rank
    return ranks / (r.size - 1) - 0.5


def es_run(case):
    cfg = case["config"]
    pop, alpha = cfg["population"], cfg["alpha"]  # sigma does not enter the update algebra
    params = [np.array(p["init"], dtype=np.float32).reshape(-1).astype(p["dtype"]) for p in case["params"]]
    anchor = [p.astype(np.float32) for p in params]
    for it, rewards in enumerate(case["rewards"]):
        coeffs = shape_rewards([float(r) for r in rewards], cfg["shaping"])
        if cfg["antithetic"]:
            coeffs = coeffs[0::2] - coeffs[1::2]
        for s, p in enumerate(params):
            acc = np.zeros(p.size, np.float32)
            for d, c in enumerate(coeffs):
                acc = acc + np.float32(c) * eps(cfg["seed"], it, d, s, p.size, cfg["noise"])
            acc = acc / np.float32(pop)
            theta = p.astype(np.float32) + np.float32(alpha) * acc
            if cfg["anchor_decay"]:
                dlt = theta - anchor[s]
                shrink = alpha * cfg["anchor_lambda"]
                if cfg["anchor_decay"] == "l2":
                    dlt = dlt * np.float32(1.0 - shrink)
                else:
                    dlt = np.sign(dlt) * np.maximum(np.abs(dlt) - np.float32(shrink), np.float32(0))
                theta = anchor[s] + dlt
            params[s] = theta.astype(p.dtype)
    return [p.astype(np.float32).tolist() for p in params]


def cases():
    g = np.random.default_rng(20261129)
    base = {"sigma": 0.01, "alpha": 0.05, "population": 6, "seed": 77, "noise": "iid", "antithetic": False,
            "shaping": "z_score", "anchor_decay": None, "anchor_lambda": 0.0}
    variants = {
        "z_score": {},
        "correlated": {"noise": "correlated"},
        "antithetic": {"antithetic": True},
        "centered_ranks": {"shaping": "centered_ranks"},
        "awd_l2": {"anchor_decay": "l2", "anchor_lambda": 10.0, "alpha": 5e-3},
        "awd_l1": {"anchor_decay": "l1", "anchor_lambda": 0.5, "alpha": 5e-2},
    }
    for name, over in variants.items():
        cfg = {**base, **over}
        params = [{"name": "w", "dtype": "float32", "init": g.standard_normal((3, 4)).astype(np.float32).tolist()},
                  {"name": "b", "dtype": "float32", "init": g.standard_normal(4).astype(np.float32).tolist()},
                  {"name": "h", "dtype": "float16", "init": g.standard_normal(4).astype(np.float32).tolist()},
                  {"name": "bf", "dtype": "bfloat16", "init": g.standard_normal(5).astype(np.float32).tolist()}]
        rewards = [g.standard_normal(cfg["population"]).round(1).tolist() for _ in range(3)]  # rounding makes ties
        rewards[1][2] = "nan"  # pins the non-finite rule (float("nan") when read)
        case = {"name": name, "config": cfg, "params": params, "rewards": rewards}
        case["expected"] = es_run(case)
        yield case


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    versions = {"python": platform.python_version(), "numpy": np.__version__, "ml_dtypes": ml_dtypes.__version__,
                "generator": "tools/gen_es_goldens.py"}
    noise = [{"key": k, "n": n, "values": [v.hex() for v in gaussian(k, n)]}
             for k, n in [(0, 9), (1, 4), (0xDEADBEEF, 7), (MASK, 5), (at(at(at(7, 0), 3), 1), 6)]]
    (OUT / "noise.json").write_text(json.dumps({"versions": versions, "noise": noise}, indent=1) + "\n")
    doc = {"versions": versions, "cases": list(cases())}
    (OUT / "update.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {OUT}/noise.json, update.json", file=sys.stderr)


if __name__ == "__main__":
    main()
