"""ES fine-tuning of LoRA adapters over a frozen GGUF: `fucina finetune`'s gradient-free twin.

Everything but the learning signal is the backprop fine-tune's: the same
`pipeline.finetune.model.LoraModel` (frozen base, quantized or not, adapters named
`layers.<i>.<target>.lora_{a,b}`), the same SFT samples and deterministic
Loader, the same checkpoint directory (adapters.safetensors + trainer_state.json
written last), minus the optimizer file: (es seed, iteration) regenerate every
member's noise, so the es_* fields of trainer_state.json are the whole resume
story. backward() is never called.

One iteration: the Loader draws `batch` sample indices; every population member
scores that SAME batch with its perturbation applied in place (perturb ->
forward -> restore, one model instance serves the population); the reward is
the negative token-weighted mean cross-entropy over the batch (summed per sample
in float64, divided by the batch's supervised tokens); the ES trainer shapes the
rewards and updates the searched adapters.

Which tensors are searched (`search`): B starts at exact zeros and A at a seeded
kaiming-uniform, so the adapted model starts as the base model. With B = 0 a
perturbation of A alone changes nothing, and a joint (A, B) perturbation moves
the output through sigma * eps_B * A to first order (A's own noise enters only
at sigma^2). "ab" (default, the reference's and the backprop run's parameter
set) searches both factors; "b" searches only the B factors and keeps A at its
random projection: half the dimension, so the same population estimates the
useful direction with less noise. The unsearched factors are still saved.

Rewards other than -CE (exact match, rules, Countdown, a user's function over
the greedy answer) are scorers from pipeline/es/rewards.py; `search="full"`
perturbs the model's dense matrices instead (pipeline/es/full.py), `search="lowrank"` every projection matrix
by rank-`noise_rank` products scored in one batched forward (pipeline/es/lowrank.py, EGGROLL);
`member_batch` scores members k at a time as one batch (pipeline/es/batched.py).

Trade-off: in one process members run sequentially (the LLM-scale shape: one
model instance, no population of replicas), so an iteration costs population x
batch forwards; restores are snapshots (adapters are small, and a bitwise
restore keeps resume exact without relying on (x + t) - t). `ESFinetuneJob`
runs the same iteration as an ES job of the runtime (pipeline/es/run.py,
pipeline/runtime/es_scheduler.py): N es_member processes, each mapping the GGUF
read-only (the OS shares its pages) with a replica of its own, score chunks of
the population with the same `ESFinetune.score` and apply every update
themselves, so only member ids and rewards cross the wire and the bits are the
in-process run's.
"""
from __future__ import annotations

import os

import numpy as np

from ..errors import ConfigMismatchError, UserError
from ..es.checkpoint import STRUCTURAL
from ..es.rewards import NLLScorer
from ..es.run import ESJob
from ..es.trainer import ESConfig, ESTrainer
from ..runtime.ckpt import load_checkpoint, read_state, save_checkpoint, tensors_of
from ..train.trainer_state import TrainerState
from .spec import ESFinetuneSpec

SEARCHES = ("ab", "b", "full", "lowrank")
REWARD_FILES_ENV = "FUCINA_REWARD_FILES"  # os.pathsep-separated reward files a member may import
NOISE_CACHE_BYTES = 256 << 20  # most memory an iteration's cached noise draws may take (ESTrainer.cache_noise)


class ESFinetune:
    """ES over a LoraModel's adapters: one `iteration_step()` = one ES update from one loader batch."""

    def __init__(self, trainer, samples, loader, es_config: ESConfig, batch=5, search="ab", scorer=None,
                 dequantize=False, model_source="the model", member_batch=0, noise_rank=1):
        """scorer: what a member's reward is (pipeline/es/rewards.py); default -mean CE of `samples`.
        search "full": every dense matrix of the model instead of the adapters (pipeline/es/full.py);
        dequantize: let it perturb an f32 copy of quantized matrices instead of refusing them.
        search "lowrank": every projection matrix by rank-noise_rank products (pipeline/es/lowrank.py).
        member_batch: score members k at a time as one batch (pipeline/es/batched.py; same bits), 0 = one by one."""
        if search not in SEARCHES:
            raise UserError(f"search must be one of {SEARCHES}, got {search!r}")
        if batch < 1:
            raise UserError(f"batch must be >= 1, got {batch}")
        if trainer.dropout:
            raise UserError("ES fine-tuning scores members with dropout off; build the LoraModel with dropout=0")
        self.trainer, self.samples, self.loader = trainer, samples, loader
        self.batch, self.search = int(batch), search
        self.scorer = scorer if scorer is not None else NLLScorer(samples)
        self.member_batch = int(member_batch)
        if self.member_batch < 0:
            raise UserError(f"member batch must be >= 0, got {member_batch}")
        if self.member_batch and search == "full":
            raise UserError("--member-batch batches members' LoRA adapters; --search full scores members one "
                            "at a time")
        self._noise_names = {}  # lowrank: {GGUF name: "layers.<i>.<target>"}, the batched forward's factor names
        if search == "lowrank":
            from ..es.lowrank import LowRankES
            self.es = LowRankES(es_config, rank=noise_rank)
        else:
            self.es = ESTrainer(es_config)
        if search in ("full", "lowrank"):
            from ..es.full import writable_dense_weights
            from ..es.lowrank import projection_slots
            dense = writable_dense_weights(trainer, dequantize, model_source, search)
            if search == "full":
                for name, arr in dense.items():
                    self.es.add_param(arr, name)
            for (i, t), name in projection_slots(trainer).items() if search == "lowrank" else ():
                self.es.add_param(dense[name], name)
                self._noise_names[name] = f"layers.{i}.{t}"
        for name, p in trainer.named_parameters():
            if search == "ab" or (search == "b" and name.endswith(".lora_b")):
                self.es.add_param(p, name)
        if es_config.anchor_decay is not None:
            self.es.capture_anchor()  # the initial adapters; a resume loads the checkpoint AFTER this
        # batched members materialize their noise draws anyway: keep them for the update, which then regenerates
        # only the draws this process did not score (same bits; on Qwen3-0.6B's q,v adapters a full regeneration
        # is ~1 s per iteration on one thread), within a memory bound
        draws = es_config.population // 2 if es_config.antithetic else es_config.population
        self.es.cache_noise = (search != "lowrank" and bool(self.member_batch)
                               and draws * self.es.dim * 4 <= NOISE_CACHE_BYTES)

    @property
    def iteration(self) -> int:
        return self.es.iteration

    def n_searched(self) -> int:
        return self.es.dim

    def iteration_step(self) -> dict:
        """Draw a batch, score every member on it, update; returns the ES stats (+ batch indices)."""
        idx = self.loader.take(self.batch)
        stats = self.es.update(self.score(range(self.es.config.population), idx))
        stats["batch"] = idx
        return stats

    def score(self, members, idx) -> list[float]:
        """The rewards of `members` of this iteration on the batch idx (what an es_member computes for its chunk).

        One by one in place (perturb -> score -> restore), or member_batch rows
        theta + sigma*eps_m per pass: those rows are bitwise what perturb(m)
        leaves, so either way, and for any cut of the population, the same bits.
        """
        members = list(members)
        if self.search == "lowrank" and members:  # always the batched forward: one member alone is k = 1
            from ..es.batched import NOISE_IN, NOISE_OUT
            rows = {}
            for name, (bt, a) in self.es.member_factors(members).items():
                rows[f"{self._noise_names[name]}.{NOISE_IN}"] = bt
                rows[f"{self._noise_names[name]}.{NOISE_OUT}"] = a
            return [float(r) for r in self.scorer.score_members(self.trainer, rows, idx, self.member_batch or 1)]
        if self.member_batch and members:
            rows = self.es.split(self.es.materialize_members(members))
            return [float(r) for r in self.scorer.score_members(self.trainer, rows, idx, self.member_batch)]
        rewards = []
        for m in members:
            self.es.perturb(m)
            try:
                rewards.append(float(self.scorer.score(self.trainer, idx)))
            finally:
                self.es.restore(m)
        return rewards

    # --- checkpoints --------------------------------------------------------
    def state(self, run_config: dict) -> TrainerState:
        t = self.trainer
        return TrainerState(step=self.es.iteration, accum_steps=1,
                            seeds={"lora": t.seed, "es": self.es.config.seed, "data": self.loader.seed},
                            loader=self.loader.state(), schedule={},
                            config={**run_config, **self.es.state_fields(), "es_search": self.search,
                                    "es_batch": self.batch})

    def save(self, directory, run_config: dict):
        """adapters.safetensors (every adapter, searched or not) + trainer_state.json, the sentinel last."""
        if self.search in ("full", "lowrank"):  # the searched matrices under their GGUF names, dtypes kept
            return save_checkpoint(directory, self.state(run_config), model=self._full_tensors())
        return save_checkpoint(directory, self.state(run_config), model=self.trainer, adapters=True)

    def _full_tensors(self) -> dict:
        """{GGUF name: Tensor sharing the searched array} (what the checkpoint walk saves and loads into)."""
        return tensors_of(self.es.named_arrays())

    def load(self, directory):
        """Resume: validate the stored ES fields against this run, then load adapters, iteration, loader.

        The anchor (if any) was captured at construction from the initial
        adapters, i.e. BEFORE this load, as anchored decay requires.
        """
        from ..llm.data import Loader
        from .model import check_resume_config

        state = read_state(directory)
        source = f"{directory}/trainer_state.json"
        stored = state.config
        check_resume_config(stored, self.trainer, source)
        ours = {**self.es.state_fields(), "es_search": self.search, "es_batch": self.batch}
        for name in STRUCTURAL + ("es_search", "es_batch") + (("es_noise_rank",) if self.search == "lowrank" else ()):
            if name not in stored:
                raise ConfigMismatchError(f"{source}: field 'config.{name}' is missing; not an es-finetune checkpoint")
            if stored[name] != ours[name]:
                raise ConfigMismatchError(f"{source}: field 'config.{name}' is {stored[name]!r} in the checkpoint, "
                                          f"{ours[name]!r} in this run")
        if state.seeds.get("lora") != self.trainer.seed:
            raise ConfigMismatchError(f"{source}: field 'seeds.lora' is {state.seeds.get('lora')!r} in the checkpoint, "
                                      f"{self.trainer.seed!r} in this run (the adapter init and the anchor depend on "
                                      "it)")
        load_checkpoint(directory, model=self._full_tensors() if self.search in ("full", "lowrank") else self.trainer)
        self.es.iteration = state.step
        self.loader = Loader.from_state(self.loader.n, self.loader.order, state.loader)
        return state


def es_config_from_state(stored: dict, source: str) -> dict:
    """The ESConfig keyword arguments a checkpoint was trained with (the resume takes them, never the flags)."""
    keys = {"es_sigma": "sigma", "es_alpha": "alpha", "es_population": "population", "es_seed": "seed",
            "es_noise": "noise", "es_antithetic": "antithetic", "es_shaping": "shaping",
            "es_restore_mode": "restore_mode", "es_anchor_decay": "anchor_decay", "es_anchor_lambda": "anchor_lambda"}
    missing = [k for k in keys if k not in stored]
    if missing:
        raise ConfigMismatchError(f"{source}: field 'config.{missing[0]}' is missing; not an es-finetune checkpoint")
    return {ours: stored[k] for k, ours in keys.items()}


def es_run_from_state(stored: dict, source: str) -> tuple[dict, int, str]:
    """(ESConfig keyword arguments, batch, search) of an es-finetune checkpoint's config: what a resume takes."""
    config = es_config_from_state(stored, source)
    for key in ("es_batch", "es_search"):
        if key not in stored:
            raise ConfigMismatchError(f"{source}: field 'config.{key}' is missing; not an es-finetune checkpoint")
    return config, stored["es_batch"], stored["es_search"]


# --- the runtime job -------------------------------------------------------------
class FinetuneReplica:
    """The ES replica ESRun and es_member drive: the searched tensors, plus the loader that draws each batch.

    Setting `iteration` (a state transfer) moves the loader on by the batches
    of the iterations skipped, so a replica built at the run's start and given
    the parameters of iteration t scores iteration t's batch.
    """

    def __init__(self, ft: ESFinetune):
        self.ft = ft
        self._idx = None  # this iteration's batch once drawn

    def batch(self) -> list[int]:
        if self._idx is None:
            self._idx = self.ft.loader.take(self.ft.batch)
        return self._idx

    @property
    def iteration(self) -> int:
        return self.ft.es.iteration

    @iteration.setter
    def iteration(self, value: int):
        if value < self.ft.es.iteration:
            raise UserError(f"es_state for iteration {value}: this replica is already at {self.ft.es.iteration}")
        for _ in range(value - self.ft.es.iteration):
            self.batch()
            self._idx = None
        self.ft.es.iteration = value

    def named_arrays(self):
        return self.ft.es.named_arrays()

    def update(self, rewards) -> dict:
        self.batch()
        stats = self.ft.es.update(rewards)
        self._idx = None
        return stats


class FinetuneTask:
    """What the ES runtime asks of a job's task: the replica, member rewards, checkpoints (no center score)."""

    def __init__(self, ft: ESFinetune, run_config: dict):
        self.ft, self.run_config = ft, run_config
        self.trainer = FinetuneReplica(ft)

    def rewards(self, members) -> np.ndarray:
        return np.asarray(self.ft.score(members, self.trainer.batch()), dtype=np.float64)

    def center(self):
        return None  # es-finetune stops at --iterations; its loss is measured by the command, before and after



class ESFinetuneJob(ESJob):
    """`es-finetune`: ES over LoRA adapters of a frozen GGUF; a task is a chunk of (iteration, members)."""

    name = "es-finetune"
    Spec = ESFinetuneSpec
    eval_name = None
    center_scored = False  # stops at `iterations`: the scheduler hands out t+1 before its own update

    def __init__(self, spec: ESFinetuneSpec):
        self.spec = spec

    def reward_files(self) -> list:
        """The Python files the reward imports (`reward = "PATH.py:FUNC"`), resolved. A member process takes
        these paths from the scheduler's run description, so it imports one only when its own environment
        lists it (REWARD_FILES_ENV): a message is never enough to make a process run a file."""
        from ..es.rewards import user_reward_files
        return [os.path.realpath(path) for path in user_reward_files(self.spec.reward)]

    def make_task(self) -> FinetuneTask:
        from .build import build_es
        parts = build_es(self.spec)
        ft, run_config = parts.run, parts.run_config
        if ft.es.config.population != self.spec.population:
            raise UserError(f"es-finetune: field 'population' is {self.spec.population}, the checkpoint "
                            f"{self.spec.load} was trained with {ft.es.config.population}")
        return FinetuneTask(ft, run_config)

    def save(self, task: FinetuneTask, path):
        task.ft.save(path, task.run_config)

    def load(self, task: FinetuneTask, path):
        task.trainer._idx = None
        task.ft.load(path)


def check_reward_files(job, environ, where="es_member"):
    """Refuse a job whose reward would import a file this process's environment does not list (REWARD_FILES_ENV)."""
    allowed = {os.path.realpath(p) for p in environ.get(REWARD_FILES_ENV, "").split(os.pathsep) if p}
    refused = [p for p in getattr(job, "reward_files", list)() if p not in allowed]
    if refused:
        raise UserError(f"{where}: the run's reward imports {refused[0]}; a member imports a reward file only "
                        f"when its own environment lists it: {REWARD_FILES_ENV}={refused[0]}")


JOB = ESFinetuneJob
