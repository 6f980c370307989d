"""The two-spirals gauntlet: train, checkpoint halfway, resume bit-exact, infer.

For each optimizer recipe, three phases on the same full-batch data:
  1. train `steps` steps from init seed S, checkpointing at steps // 2;
  2. build a fresh model from a DIFFERENT init seed and a fresh optimizer,
     load that checkpoint, replay the second half, and compare every final
     parameter with phase 1: the max |delta| must be exactly 0;
  3. load the final weights into a gradient-free model and measure accuracy.
A resume that is merely close fails: any divergence is a real change (a
moment in the wrong slot, an lr keyed off by one step), never noise.

Trade-off: every recipe pays a second, replayed half of training (1.5x the
work) to turn "checkpoints work" into an == check instead of a hope.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ..autograd import Tensor, cross_entropy, named_parameters
from ..models.spirals import SpiralsMLP, accuracy, make_spirals
from .. import optim
from ..runtime.ckpt import checkpoint_dir, load_checkpoint, save_checkpoint
from .trainer_state import TrainerState


def register(opt, model, positional=False, swap_biases=False):
    """Register w1, w2, w3, b1, b2, b3; the head w3 goes to a fallback where there is one.

    positional: no explicit names (slots get positional auto-names), which is
    what makes a swapped registration order land moments in the wrong slots.
    """
    order = ["w1", "w2", "w3", "b1", "b2", "b3"]
    if swap_biases:
        order[3], order[4] = order[4], order[3]
    for name in order:
        add = getattr(opt, "add_fallback_param", None) if name == "w3" else None
        (add or opt.add_param)(getattr(model, name), None if positional else name)
    return opt


@dataclass
class Recipe:
    """name; make(model, positional, swap_biases) -> (optimizer, LrSchedule | None);
    factor(step, total) -> lr factor (pure in the step); clip: max grad norm or None."""

    name: str
    make: Callable
    factor: Callable | None = None
    clip: float | None = None
    sgd_family: bool = False


def _single(factory):
    """A recipe maker for one optimizer over the whole model."""
    def make(model, positional=False, swap_biases=False):
        return register(factory(), model, positional, swap_biases), None
    return make


def _groups(model, positional=False, swap_biases=False):
    """Matrices in a weight-decayed AdamW, biases in a no-decay AdamW, one set, one schedule."""
    decay = optim.AdamW(lr=0.01, weight_decay=0.1)
    no_decay = optim.AdamW(lr=0.01, weight_decay=0.0)
    biases = ["b1", "b2", "b3"]
    if swap_biases:
        biases[0], biases[1] = biases[1], biases[0]
    for name in ("w1", "w2", "w3"):
        decay.add_param(getattr(model, name), None if positional else name)
    for name in biases:
        no_decay.add_param(getattr(model, name), None if positional else name)
    opt = optim.OptimizerSet(decay, no_decay)
    return opt, optim.LrSchedule(opt)


RECIPES = {
    "sgd": Recipe("sgd", _single(lambda: optim.SGD(lr=0.05, momentum=0.9, nesterov=True)), sgd_family=True),
    "adam": Recipe("adam", _single(lambda: optim.Adam(lr=0.01))),
    "adamw": Recipe("adamw", _single(lambda: optim.AdamW(lr=0.01, weight_decay=0.01))),
    # Muon's fallback default lr (3e-4) is tuned for LLM heads; this toy head wants far more.
    "muon": Recipe("muon", _single(lambda: optim.Muon(lr=0.02, fallback={"lr": 0.01}))),
    "apollo": Recipe("apollo", _single(lambda: optim.Apollo(lr=0.01, rank=16, update_proj_gap=200))),
    "apollo-mini": Recipe("apollo-mini", _single(lambda: optim.Apollo.mini(lr=0.01, update_proj_gap=200))),
    "lion": Recipe("lion", _single(lambda: optim.Lion(lr=1e-3))),
    "groups": Recipe("groups", _groups,
                     factor=lambda step, total: optim.warmup_cosine_factor(step, total, total // 20, 0.1), clip=1.0),
}


def train(model, opt, schedule, recipe, X, y, start, stop, total, restart_schedule=False):
    """Full-batch steps [start, stop); returns the last step's loss.

    The lr factor is a pure function of the step, so a resumed run re-applies
    it from `start` (restart_schedule=True keys it from 0 instead: a bug on purpose).
    """
    loss = float("nan")
    for step in range(start, stop):
        if schedule is not None:
            schedule.apply(recipe.factor(step - start if restart_schedule else step, total))
        out = cross_entropy(model(X), y)
        out.backward()
        if recipe.clip is not None:
            opt.clip_grad_norm(recipe.clip)
        opt.step()
        opt.zero_grad()
        loss = out.item()
    return loss


def _params(model):
    return {name: t.data.copy() for name, t in named_parameters(model)}


def _frozen_model(seed, hidden):
    """A SpiralsMLP with no trainable tensors: the inference target of phase 3."""
    model = SpiralsMLP(seed=seed, hidden=hidden)
    for _, t in named_parameters(model):
        t.requires_grad = False
    return model


def run_recipe(recipe: Recipe, run_dir, steps=2000, seed=0, hidden=64, sabotage=None) -> dict:
    """The three phases for one recipe; checkpoints go to run_dir/<recipe name>/."""
    if steps < 2:
        raise ValueError(f"gauntlet: steps must be >= 2 to checkpoint halfway, got {steps}")
    run_dir = Path(run_dir) / recipe.name
    X, y = make_spirals(seed=seed)
    X = Tensor(X)
    half = steps // 2
    positional = sabotage == "swap-biases"
    config = {"recipe": recipe.name, "steps": steps, "hidden": hidden, "seed": seed}

    def state(step):
        return TrainerState(step=step, seeds={"data": seed, "init": seed}, loader={"full_batch": True, "rows": len(y)},
                            schedule={"name": "warmup_cosine" if recipe.factor else "constant", "total": steps},
                            config=config)

    t0 = time.perf_counter()

    # phase 1: the run that never stops (it checkpoints halfway, and at the end)
    model = SpiralsMLP(seed=seed, hidden=hidden)
    opt, schedule = recipe.make(model, positional=positional)
    train(model, opt, schedule, recipe, X, y, 0, half, steps)
    save_checkpoint(checkpoint_dir(run_dir, half), state(half), model, opt)
    loss = train(model, opt, schedule, recipe, X, y, half, steps, steps)
    reference = _params(model)
    trained_accuracy = accuracy(model, X, y)

    # phase 2: fresh objects from another init seed, resumed from the checkpoint
    resumed = SpiralsMLP(seed=seed + 1, hidden=hidden)
    opt2, schedule2 = recipe.make(resumed, positional=positional, swap_biases=sabotage == "swap-biases")
    # explicit directory, not latest_checkpoint: a reused --run-dir may hold a later step
    start = load_checkpoint(checkpoint_dir(run_dir, half), resumed, opt2).step
    train(resumed, opt2, schedule2, recipe, X, y, start, steps, steps, restart_schedule=sabotage == "restart-schedule")
    replayed = _params(resumed)
    same_bits = all(reference[n].tobytes() == replayed[n].tobytes() for n in reference)  # also tells -0.0 from 0.0
    max_diff = 0.0 if same_bits else max(
        float(np.max(np.abs(reference[n].astype(np.float64) - replayed[n]))) for n in reference)

    # phase 3: the final weights into a gradient-free model
    save_checkpoint(checkpoint_dir(run_dir, steps), state(steps), model, opt)
    frozen = _frozen_model(seed + 2, hidden)
    load_checkpoint(checkpoint_dir(run_dir, steps), frozen, trainable_only=False)
    return {"name": recipe.name, "loss": loss, "accuracy": trained_accuracy, "resume_from": start,
            "resume_max_abs_diff": max_diff, "bit_exact": same_bits,
            "inference_accuracy": accuracy(frozen, X, y), "seconds": time.perf_counter() - t0}
