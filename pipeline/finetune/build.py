"""One builder from a fine-tune spec to what a run is made of: the model file's text side (tokenizer, chat
template, encoder), the records and samples, the loader, the LoRA model and the scorer.

The backprop job (job.py), the ES job and its replicas (es.py), `fucina eval` (eval_model: the base model plus a
run's adapters or ES checkpoint) and the commands all build through here, so a flag means the same thing in every
process of a run: an es_member builds its replica from the job spec alone (build_es), never from a command line.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from ..errors import ConfigMismatchError, UserError
from ..llm import data as sft


@dataclasses.dataclass
class Text:
    """A GGUF's text side: its tokenizer, the chat template rendering records, the encoder and encode options."""
    gguf: object
    tokenizer: object
    encoder: object
    template: object
    options: object


def open_text(model, chat_template: str = "", seq_max: int = 256) -> Text:
    """The text side of the GGUF at `model` (a path or an open GGUF): tokenizer (with the llm/tokenizer
    fallback), the chat template (a name or Jinja file, else the model's own) and the encode options."""
    from ..llm.chat import ChatTemplate
    from ..llm.gguf import open_gguf
    from ..llm.tokenizer import load_tokenizer
    gg = open_gguf(model) if isinstance(model, (str, os.PathLike)) else model
    tokenizer = load_tokenizer(gg)
    return Text(gg, tokenizer, sft.RawEncoder(tokenizer), ChatTemplate.from_gguf(gg, chat_template or None),
                sft.EncodeOptions(seq_max=seq_max))


def load_records(spec, flag: str = "--data"):
    """(records, source, countdown tasks or None) of a spec: its data file (any sft format), its built-in task's
    problems, or the built-in pirate pairs."""
    if spec.data:
        if not os.path.isfile(spec.data):
            raise UserError(f"{flag} {spec.data}: no such file")
        return sft.load_jsonl(spec.data, spec.instruction_key, spec.response_key, format=spec.format,
                              max_record_bytes=spec.max_record_bytes), spec.data, None
    if getattr(spec, "task", "") == "countdown":
        from ..es import countdown
        tasks = countdown.problems(spec.task_seed, spec.task_size, spec.task_numbers, spec.task_max_number)
        return [sft.Pair(t.prompt, f"<answer>{t.solution}</answer>") for t in tasks], "countdown problem", tasks
    return list(sft.PIRATE_PAIRS), "pirate pair", None


def data_seed(spec) -> int:
    return spec.seed if spec.data_seed < 0 else spec.data_seed


def loader_of(spec, n: int):
    """The deterministic sample order of a spec: sequential, or Fisher-Yates per epoch seeded by its data seed."""
    return sft.Loader(n, "shuffled" if spec.shuffle else "sequential", seed=data_seed(spec))


def lora_model(model, spec, alpha: float, seed: int | None = None, dropout: float = 0.0, checkpoint_layers=False):
    """The LoraModel of a spec over `model` (a GGUF, open or a path, or a loaded DecoderLM)."""
    from ..models.registry import load_model
    from .model import LoraModel, keep_freed_memory
    keep_freed_memory()
    if not hasattr(model, "blocks"):
        model = load_model(model)
    return LoraModel(model, targets=spec.target_tuple(), rank=spec.rank, alpha=alpha, dropout=dropout,
                     seed=spec.seed if seed is None else seed, checkpoint_layers=checkpoint_layers)


def scorer_of(reward: str, samples, records, text: Text, tasks, max_new_tokens: int, timeout: float, model_path):
    """What a member (or an eval item) is scored by: -mean CE of the samples (nll), or a reward of the greedy
    answers to the records' prompts (a countdown task's references are its problems)."""
    from ..es.rewards import GenerationScorer, NLLScorer
    if reward == "nll":
        return NLLScorer(samples)
    return GenerationScorer(prompt_items(records, text, tasks), reward, text.template.stop_ids, max_new_tokens,
                            timeout=timeout).bind(str(model_path), text.tokenizer)


def prompt_items(records, text: Text, tasks=None) -> list:
    """The generation-reward items (prompt, prompt ids, reference) of records, encoded by the model's text side;
    a countdown task's references are its problems (many answers are right)."""
    from ..es.rewards import items_of
    items = items_of(records, text.encoder, text.template, text.options)
    if tasks is not None:
        items = [dataclasses.replace(item, reference=t.reference) for item, t in zip(items, tasks)]
    return items


def eval_model(model, lora_dir=None, source="the model"):
    """The model `fucina eval` scores: a LoraModel over `model` (a GGUF, open or a path, or a loaded DecoderLM)
    carrying the adapters of `lora_dir` (a finetune / es-finetune checkpoint or run directory: its latest
    committed checkpoint), or, with none, zero adapters (B = 0: the base model's answers).

    An es-finetune `--search full` or `lowrank` checkpoint (model.safetensors: the searched matrices under their
    GGUF names) is loaded into private writable copies of those matrices instead (pipeline/es/full.py).
    A directory that is not a checkpoint, a corrupt one, or adapters of another model are one UserError
    naming the directory."""
    from ..models.registry import load_model
    from .model import LoraModel
    arch = getattr(model, "architecture", None)  # an open GGUF names it; a loaded model is taken as given
    if not hasattr(model, "blocks"):
        model = load_model(model)
    if lora_dir is None:
        return LoraModel(model, targets=("q",), rank=1, seed=0)
    from ..runtime.ckpt import load_checkpoint, read_state, resolve, tensors_of
    ckpt = Path(resolve(lora_dir))
    state = read_state(ckpt)
    if state.config.get("es_search") in ("full", "lowrank"):
        from ..es.full import writable_dense_weights
        trainer = LoraModel(model, targets=("q",), rank=1, seed=0)
        dense = writable_dense_weights(trainer, dequantize=True, source=source)
        if state.config["es_search"] == "lowrank":  # it searched the projection matrices only
            from ..es.lowrank import projection_slots
            dense = {name: dense[name] for name in projection_slots(trainer).values()}
        load_checkpoint(ckpt, model=tensors_of(dense))
        return trainer
    from ..llm.export import load_adapters, resolve_alpha
    adapters = load_adapters(ckpt)
    if arch is not None and adapters.arch != arch:  # equal shapes across families would load and score nonsense
        raise UserError(f"--lora {ckpt}: adapters trained on a {adapters.arch} model (config.lora.arch), "
                        f"{source} is {arch}")
    trainer = LoraModel(model, targets=tuple(adapters.targets), rank=adapters.rank,
                        alpha=resolve_alpha(None, adapters), seed=0)
    tensors = {}
    for pair in adapters.pairs:
        tensors[f"{pair.trainer_name}.lora_a"] = pair.a
        tensors[f"{pair.trainer_name}.lora_b"] = pair.b
    trainer.load_adapter_tensors(tensors, source=f"--lora {ckpt}")
    return trainer


def es_reward(spec) -> str:
    """The reward an ES spec scores: its `reward`, else countdown for the countdown task, else nll."""
    return spec.reward or ("countdown" if spec.task == "countdown" else "nll")


def es_data_source(spec) -> str:
    """The run config's data field (the default countdown difficulty keeps the name older checkpoints recorded)."""
    from ..es.countdown import MAX_NUMBER, N_NUMBERS
    if spec.data:
        return spec.data
    if spec.task != "countdown":
        return "builtin:pirate"
    source = f"builtin:countdown:{spec.task_seed}:{spec.task_size}"
    if (spec.task_numbers, spec.task_max_number) != (N_NUMBERS, MAX_NUMBER):
        source += f":numbers={spec.task_numbers}:max={spec.task_max_number}"
    return source


@dataclasses.dataclass
class ESParts:
    """An ES fine-tune run as build_es makes it: the run and what the command prints its answers with."""
    run: object
    text: Text
    records: list
    run_config: dict


def build_es(spec, log=lambda m: None, search: str | None = None, dequantize: bool = False) -> ESParts:
    """The ES run of an ESFinetuneSpec (its ES settings resolved; with `load`, the checkpoint's ES settings, batch,
    search and adapter seed win over the spec's, and the checkpoint is loaded). `search` "full" is
    the in-process command's (the spec's search is a job's: ab, b or lowrank)."""
    from ..es import ESConfig
    from ..runtime.ckpt import read_state
    from .es import ESFinetune, es_run_from_state
    from .model import lora_config

    state = read_state(spec.load) if spec.load else None
    lora_seed, batch, noise_rank = spec.seed, spec.batch, spec.noise_rank
    settings = dict(sigma=spec.sigma, alpha=spec.alpha, population=spec.population, seed=spec.es_seed,
                    noise=spec.noise, antithetic=spec.antithetic, shaping=spec.shaping, restore_mode="snapshot",
                    anchor_decay=spec.anchor_decay or None, anchor_lambda=spec.anchor_lambda)
    if state is not None:  # the checkpoint's ES settings win over the spec's, as on the command line
        settings, batch, stored_search = es_run_from_state(state.config, f"{spec.load}/trainer_state.json")
        search = search or stored_search
        noise_rank = state.config.get("es_noise_rank", noise_rank)
        if isinstance(state.seeds.get("lora"), int):
            lora_seed = state.seeds["lora"]  # the adapter init (and so the AWD anchor) must be the checkpoint's
    search = search or spec.search
    text = open_text(spec.model, spec.chat_template, spec.seq_max)
    records, source, tasks = load_records(spec)
    samples = sft.encode_all(text.encoder, text.template, records, text.options, source=source)
    model = lora_model(text.gguf, spec, alpha=spec.lora_alpha, seed=lora_seed)
    loader = loader_of(spec, len(samples))
    es_config = ESConfig(**settings)
    reward = es_reward(spec)
    if state is not None and state.config.get("reward", reward) != reward:
        log(f"resume: the checkpoint was trained with --reward {state.config['reward']}; this run scores {reward}")
    scorer = scorer_of(reward, samples, records, text, tasks, spec.max_new_tokens, spec.reward_timeout, spec.model)
    run = ESFinetune(model, samples, loader, es_config, batch=batch, search=search, scorer=scorer,
                     dequantize=dequantize or spec.dequantize, model_source=str(spec.model),
                     member_batch=spec.member_batch, noise_rank=noise_rank)
    if state is not None:
        stored_order = state.config.get("order")
        if stored_order is not None and stored_order != loader.order:
            raise ConfigMismatchError(f"{spec.load}/trainer_state.json: field 'config.order' is {stored_order!r} "
                                      f"but this run is {loader.order!r} (pass --shuffle as the checkpoint did, or "
                                      "not)")
        run.load(spec.load)
        log(f"resumed {spec.load}: ES iteration {run.iteration}, loader epoch {run.loader.epoch} index "
            f"{run.loader.index}")
    run_config = {"model": str(spec.model), "lora": lora_config(model), "seq_max": spec.seq_max,
                  "data": es_data_source(spec), "order": loader.order, "trainer": "es", "reward": reward}
    return ESParts(run, text, records, run_config)


def split_records(records, fraction, seed, source="record"):
    """(train, validation) records: round(fraction * n) whole records (documents, never a part of one) picked by
    the first positions of the seeded epoch permutation (pure in (n, seed)); both keep the file order."""
    from pipeline.kernels.rng import derive_seed
    n = len(records)
    k = int(round(fraction * n))
    if k < 1 or k >= n:
        raise UserError(f"--val-split {fraction}: {n} {source}s leave {k} for validation and {n - k} for training; "
                        "both need at least one")
    held = set(int(i) for i in sft.epoch_permutation(n, derive_seed(seed, 0x56414C), 0)[:k])
    return [r for i, r in enumerate(records) if i not in held], [r for i, r in enumerate(records) if i in held]
