"""ES fine-tuning of LoRA adapters over a frozen Qwen3 GGUF: `fucina finetune`'s gradient-free twin.

Everything but the learning signal is the backprop fine-tune's: the same
`pipeline.llm.finetune.Trainer` (frozen base, quantized or not, adapters named
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
perturbs the model's dense matrices instead (pipeline/es/full.py);
`member_batch` scores members k at a time as one batch (pipeline/es/batched.py).

Trade-off: by default members run sequentially in one process (the LLM-scale
shape: one model instance, no population of replicas), so an iteration costs
population x batch forwards; restores are snapshots (adapters are small, and a
bitwise restore keeps resume exact without relying on (x + t) - t). A
`MemberPool` of N processes (each maps the GGUF read-only, the OS shares its
pages) scores members k with k % N == j on process j from the materialized rows
theta + sigma*eps_k: the parameters are small, so shipping rows is cheap, and
the rewards, hence the update, are the same bits as in place.
"""
from __future__ import annotations

import numpy as np

from ..autograd.tensor import Tensor, no_grad
from ..errors import ConfigMismatchError, FucinaError, UserError
from ..llm.finetune import ProcessPool, death
from ..train.checkpoint import load_checkpoint, read_sentinel, save_checkpoint
from ..train.trainer_state import TrainerState
from .checkpoint import STRUCTURAL
from .rewards import NLLScorer
from .trainer import ESConfig, ESTrainer

SEARCHES = ("ab", "b", "full")


def batch_loss(trainer, samples) -> float:
    """Token-weighted mean CE of `samples` under the trainer's current adapters (no graph, no dropout).

    Each sample's CE sum is accumulated in float64 in batch order, then divided
    by the batch's supervised-token count: one serial sum, same bits every call.
    """
    total, valid = 0.0, 0
    saved_step = trainer.step  # loss() advances the dropout counter; evaluation must not
    try:
        with no_grad():
            for s in samples:
                total += float(trainer.loss(s.inputs, s.labels, reduction="sum").item())
                valid += s.n_valid
    finally:
        trainer.step = saved_step
    if valid == 0:
        raise UserError("the batch has no supervised token")
    return total / valid


class ESFinetune:
    """ES over a Trainer's adapters: one `iteration_step()` = one ES update from one loader batch."""

    def __init__(self, trainer, samples, loader, es_config: ESConfig, batch=5, search="ab", pool=None, scorer=None,
                 dequantize=False, model_source="the model", member_batch=0):
        """scorer: what a member's reward is (pipeline/es/rewards.py); default -mean CE of `samples`.
        search "full": every dense matrix of the model instead of the adapters (pipeline/es/full.py);
        dequantize: let it perturb an f32 copy of quantized matrices instead of refusing them.
        member_batch: score members k at a time as one batch (pipeline/es/batched.py; same bits), 0 = one by one."""
        if search not in SEARCHES:
            raise UserError(f"search must be one of {SEARCHES}, got {search!r}")
        if batch < 1:
            raise UserError(f"batch must be >= 1, got {batch}")
        if trainer.dropout:
            raise UserError("ES fine-tuning scores members with dropout off; build the Trainer with dropout=0")
        self.trainer, self.samples, self.loader = trainer, samples, loader
        self.batch, self.search, self.pool = int(batch), search, pool
        self.scorer = scorer if scorer is not None else NLLScorer(samples)
        self.member_batch = int(member_batch)
        if self.member_batch < 0:
            raise UserError(f"member batch must be >= 0, got {member_batch}")
        if self.member_batch and search == "full":
            raise UserError("--member-batch batches members' LoRA adapters; --search full scores members one "
                            "at a time")
        self.es = ESTrainer(es_config)
        if search == "full":
            from .full import writable_dense_weights
            if pool is not None:
                raise UserError("--search full scores members in this process (--workers would ship every weight "
                                "of every member each iteration)")
            for name, arr in writable_dense_weights(trainer, dequantize, model_source).items():
                self.es.add_param(arr, name)
        for name, p in trainer.named_parameters():
            if search == "ab" or (search == "b" and name.endswith(".lora_b")):
                self.es.add_param(p, name)
        if es_config.anchor_decay is not None:
            self.es.capture_anchor()  # the initial adapters; a resume loads the checkpoint AFTER this

    @property
    def iteration(self) -> int:
        return self.es.iteration

    def n_searched(self) -> int:
        return self.es.dim

    def iteration_step(self) -> dict:
        """Draw a batch, score every member on it, update; returns the ES stats (+ batch indices)."""
        idx = self.loader.take(self.batch)
        if self.pool is None and not self.member_batch:  # in place: perturb -> score -> restore, one by one
            stats = self.es.step(lambda member: self.scorer.score(self.trainer, idx))
        elif self.pool is None:  # the rows theta + sigma*eps_m, member_batch of them per pass
            rows = self.es.split(self.es.materialize_members(range(self.es.config.population)))
            stats = self.es.update(self.scorer.score_members(self.trainer, rows, idx, self.member_batch))
        else:  # the rows theta + sigma*eps_m are bitwise what perturb(m) leaves, so the rewards are too
            rows = self.es.split(self.es.materialize_members(range(self.es.config.population)))
            adapters = {n: p.data for n, p in self.trainer.named_parameters()}
            stats = self.es.update(self.pool.score(adapters, rows, idx))
        stats["batch"] = idx
        return stats

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
        if self.search == "full":  # the searched matrices under their GGUF names, dtypes kept
            return save_checkpoint(directory, self.state(run_config), model=self._full_tensors())
        return save_checkpoint(directory, self.state(run_config), model=self.trainer, adapters=True)

    def _full_tensors(self) -> dict:
        """{GGUF name: Tensor sharing the searched array} (what the checkpoint walk saves and loads into)."""
        return {name: Tensor(arr, requires_grad=True) for name, arr in self.es.named_arrays()}

    def load(self, directory):
        """Resume: validate the stored ES fields against this run, then load adapters, iteration, loader.

        The anchor (if any) was captured at construction from the initial
        adapters, i.e. BEFORE this load, as anchored decay requires.
        """
        from ..llm.data import Loader
        from ..llm.finetune import check_resume_config

        state = read_sentinel(directory)
        source = f"{directory}/trainer_state.json"
        stored = state.config
        check_resume_config(stored, self.trainer, source)
        ours = {**self.es.state_fields(), "es_search": self.search, "es_batch": self.batch}
        for name in STRUCTURAL + ("es_search", "es_batch"):
            if name not in stored:
                raise ConfigMismatchError(f"{source}: field 'config.{name}' is missing; not an es-finetune checkpoint")
            if stored[name] != ours[name]:
                raise ConfigMismatchError(f"{source}: field 'config.{name}' is {stored[name]!r} in the checkpoint, "
                                          f"{ours[name]!r} in this run")
        if state.seeds.get("lora") != self.trainer.seed:
            raise ConfigMismatchError(f"{source}: field 'seeds.lora' is {state.seeds.get('lora')!r} in the checkpoint, "
                                      f"{self.trainer.seed!r} in this run (the adapter init and the anchor depend on it)")
        load_checkpoint(directory, model=self._full_tensors() if self.search == "full" else self.trainer)
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



# --- member processes ------------------------------------------------------------
def _member_main(conn, model_path, trainer_kwargs, scorer, threads, member_batch):
    """A member process: a Trainer over the mapped GGUF; answers (adapters, member rows, batch) with rewards.

    The scorer is bound here, so a user's reward file is imported (and called) in this process."""
    from ..llm.finetune import Trainer
    from ..threads import pin_threads
    pin_threads(threads)
    trainer = Trainer.from_gguf(model_path, **trainer_kwargs)
    params = dict(trainer.named_parameters())
    scorer.bind(model_path)
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg is None:
            break
        adapters, members, idx = msg
        rewards = []
        try:
            if member_batch and members:  # this process's members as batches (the same bits as one by one)
                for name, arr in adapters.items():
                    params[name].data[...] = arr
                stacked = {name: np.stack([rows[name] for rows in members]) for name in members[0]}
                rewards = scorer.score_members(trainer, stacked, idx, member_batch)
            else:
                for rows in members:  # rows: {searched name: this member's values}
                    for name, arr in {**adapters, **rows}.items():
                        params[name].data[...] = arr
                    rewards.append(scorer.score(trainer, idx))
        except FucinaError as e:  # e.g. a reward function's bad return: the parent raises it as one line
            conn.send(("error", str(e)))
            continue
        conn.send(rewards)


class MemberPool(ProcessPool):
    """N spawned member processes; member k is scored by process k % N; rewards come back in member order."""

    def __init__(self, n, model_path, trainer_kwargs, scorer, threads=1, member_batch=0):
        super().__init__(n, _member_main, (str(model_path), trainer_kwargs, scorer, threads, member_batch),
                         f"a member process on {model_path}")

    def score(self, adapters, rows, idx):
        """adapters: {name: array} (the unperturbed state); rows: {searched name: (population, ...)}."""
        population = len(next(iter(rows.values())))
        n = len(self.conns)
        for j, conn in enumerate(self.conns):
            mine = [{name: r[k] for name, r in rows.items()} for k in range(j, population, n)]
            conn.send((adapters, mine, idx))
        rewards = [None] * population
        for j, conn in enumerate(self.conns):
            try:
                answer = conn.recv()
            except (EOFError, OSError):
                self.procs[j].join(timeout=5)
                raise UserError(f"member process {j} died: {death(self.procs[j].exitcode)}") from None
            if isinstance(answer, tuple):
                raise UserError(f"member process {j}: {answer[1]}")
            rewards[j::n] = answer
        return rewards
