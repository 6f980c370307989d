"""Generate PyTorch cross-entropy goldens for tests/autograd/test_losses.py.

Run: .venv/bin/python tools/gen_ce_goldens.py  (needs torch; never imported at run time)
Writes tests/goldens/ce/ce_goldens.npz (inputs, losses, logit gradients per case)
and tests/goldens/ce/meta.json (cases and the generating versions). The
reference is torch.nn.functional.cross_entropy evaluated in float64 on the
float32 inputs, so the goldens carry no float32 rounding of their own.
"""
import json
import pathlib
import platform

import numpy as np
import torch
import torch.nn.functional as F

OUT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "goldens" / "ce"

# name: (rows, classes, logit scale, ignore_index, n_ignored, reduction, label_smoothing)
CASES = {
    "mean": (16, 10, 1.0, -100, 0, "mean", 0.0),
    "sum": (16, 10, 1.0, -100, 0, "sum", 0.0),
    "none": (16, 10, 1.0, -100, 0, "none", 0.0),
    "ignore_mean": (20, 7, 1.0, -100, 6, "mean", 0.0),
    "ignore_sum": (20, 7, 1.0, -100, 6, "sum", 0.0),
    "ignore_none": (20, 7, 1.0, -100, 6, "none", 0.0),
    "smooth_mean": (12, 9, 1.0, -100, 0, "mean", 0.1),
    "smooth_sum": (12, 9, 1.0, -100, 0, "sum", 0.2),
    "smooth_ignore_mean": (24, 11, 1.0, -100, 5, "mean", 0.15),
    "smooth_ignore_none": (24, 11, 1.0, -100, 5, "none", 0.15),
    "sentinel_in_range": (15, 6, 1.0, 3, 0, "mean", 0.0),
    "large_logits": (10, 50, 30.0, -100, 2, "mean", 0.05),
    "wide": (4, 3000, 4.0, -100, 1, "mean", 0.0),
}


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(20261129)
    arrays = {}
    for name, (n, c, scale, ignore, n_ign, reduction, eps) in CASES.items():
        logits = (rng.standard_normal((n, c)) * scale).astype(np.float32)
        labels = rng.integers(0, c, n).astype(np.int64)
        if n_ign:
            labels[rng.choice(n, n_ign, replace=False)] = ignore
        upstream = rng.standard_normal(n).astype(np.float32) if reduction == "none" else np.float32(1.0)
        x = torch.tensor(logits, dtype=torch.float64, requires_grad=True)
        loss = F.cross_entropy(x, torch.tensor(labels), ignore_index=ignore, reduction=reduction, label_smoothing=eps)
        loss.backward(torch.tensor(upstream, dtype=torch.float64))
        arrays[f"{name}/logits"] = logits
        arrays[f"{name}/labels"] = labels
        arrays[f"{name}/upstream"] = np.asarray(upstream)
        arrays[f"{name}/loss"] = loss.detach().numpy()
        arrays[f"{name}/grad"] = x.grad.numpy()
    np.savez_compressed(OUT / "ce_goldens.npz", **arrays)
    meta = {
        "generator": "tools/gen_ce_goldens.py",
        "torch": torch.__version__, "numpy": np.__version__, "python": platform.python_version(),
        "reference": "torch.nn.functional.cross_entropy in float64 on float32 inputs",
        "cases": {k: dict(zip(["rows", "classes", "scale", "ignore_index", "n_ignored", "reduction",
                               "label_smoothing"], v))
                  for k, v in CASES.items()},
    }
    (OUT / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"wrote {len(CASES)} cases to {OUT}")


if __name__ == "__main__":
    main()
