"""Write tests/goldens/checkpoints/: two tiny committed checkpoints, the on-disk format's reference.

    adamw/  a 2-4-4-2 spirals MLP after 3 AdamW steps: model.safetensors, optimizer.safetensors, trainer_state.json
    es/     an ES trainer (f32, f16 and bf16 slots) after one update: model.safetensors, trainer_state.json

tests/train/test_checkpoint_goldens.py loads them with today's code and re-saves them byte for byte, so a
change to the checkpoint writers that would strand existing checkpoints fails there. Needs no oracle:
python tools/gen_checkpoint_goldens.py (from the repository root).
"""
import os
import shutil
import sys

import ml_dtypes
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pipeline import optim  # noqa: E402
from pipeline.autograd import Tensor, cross_entropy  # noqa: E402
from pipeline.es.checkpoint import save_es_checkpoint  # noqa: E402
from pipeline.es.trainer import ESConfig, ESTrainer  # noqa: E402
from pipeline.models.spirals import SpiralsMLP, make_spirals  # noqa: E402
from pipeline.runtime.ckpt import save_checkpoint  # noqa: E402
from pipeline.train.trainer_state import TrainerState  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "goldens", "checkpoints")


def adamw_model():
    """-> (model, optimizer) after 3 AdamW steps on 16 spirals points."""
    X, y = make_spirals(n_per_arm=8)
    model = SpiralsMLP(seed=0, hidden=4)
    opt = optim.AdamW(model.named_parameters(), lr=0.01)
    for _ in range(3):
        cross_entropy(model(Tensor(X)), y).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def es_trainer(update=True):
    """-> an ESTrainer over an f32, an f16 and a bf16 slot (after one update unless update=False)."""
    es = ESTrainer(ESConfig(sigma=0.1, alpha=0.05, population=4, seed=7))
    es.add_param(np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3), "w")
    es.add_param(np.linspace(0, 1, 4).astype(np.float16), "h")
    es.add_param(np.linspace(0, 1, 3).astype(ml_dtypes.bfloat16), "b")
    if update:
        es.update(np.array([1.0, 0.5, -0.25, 2.0]))
    return es


def main():
    shutil.rmtree(OUT, ignore_errors=True)
    model, opt = adamw_model()
    save_checkpoint(os.path.join(OUT, "adamw"), TrainerState(step=3, seeds={"init": 0}), model, opt)
    save_es_checkpoint(os.path.join(OUT, "es"), es_trainer(), run_config={"note": "golden"})
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
