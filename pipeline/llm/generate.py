"""Token generation: prefill once, then decode one token at a time through the KV cache.

Trade-off: sampling is plain numpy on the final logits (temperature, top-k,
top-p), driven by the project's counter RNG so a (seed, step) pair always
draws the same token — and temperature 0 is exact greedy argmax (ties go to
the lowest id), so greedy runs are deterministic by construction. Generation
is a Python generator yielding token ids; callers stream text with the
tokenizer's StreamDecoder.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipeline.kernels import rng
from ..errors import UserError


@dataclass
class Sampling:
    temperature: float = 0.0   # 0 = greedy
    top_k: int = 0             # 0 = no limit
    top_p: float = 1.0         # nucleus mass kept
    seed: int = 0

    def __post_init__(self):
        if self.temperature < 0:
            raise UserError(f"sampling: temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise UserError(f"sampling: top-k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise UserError(f"sampling: top-p must be in (0, 1], got {self.top_p}")


def sample(logits: np.ndarray, s: Sampling, step: int) -> int:
    """One token id from logits [vocab]; the uniform draw is rng.at(seed, step)."""
    if s.temperature == 0.0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / s.temperature
    order = np.argsort(-z, kind="stable")
    if s.top_k:
        order = order[: s.top_k]
    p = np.exp(z[order] - z[order[0]])
    p /= p.sum()
    if s.top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(p), s.top_p) + 1)
        p = p[:keep] / p[:keep].sum()
        order = order[:keep]
    u = rng.at(s.seed, step) / 2.0 ** 64
    return int(order[min(int(np.searchsorted(np.cumsum(p), u, side="right")), len(order) - 1)])


def _checked_prompt(model, prompt_ids) -> np.ndarray:
    prompt_ids = np.asarray(prompt_ids, dtype=np.int64)
    if prompt_ids.size == 0:
        raise UserError("generate: the prompt is empty (it encodes to zero tokens)")
    n_ctx = model.config.context_length
    if prompt_ids.size >= n_ctx:
        raise UserError(f"generate: the prompt has {prompt_ids.size} tokens; the model's context is {n_ctx}")
    return prompt_ids


def generate(model, prompt_ids, max_tokens: int = 64, sampling: Sampling | None = None, stop_ids=(), cache=None):
    """Yield up to max_tokens new token ids after prompt_ids; stops after a stop id or at the context end."""
    sampling = sampling or Sampling()
    prompt_ids = _checked_prompt(model, prompt_ids)
    n_ctx = model.config.context_length
    cache = cache if cache is not None else model.new_cache(min(n_ctx, prompt_ids.size + max_tokens))
    logits = model.infer(prompt_ids, cache)
    for step in range(max_tokens):
        token = sample(logits, sampling, step)
        yield token
        if token in stop_ids or cache.length >= n_ctx:
            return
        logits = model.infer(np.array([token]), cache)


def greedy_rows(model, prompts, max_tokens: int, stop_ids=(), adapt=None) -> list[list[int]]:
    """[list(generate(model, p, max_tokens, stop_ids=stop_ids)) for p in prompts] (greedy), the rows decoded
    in lock-step through model.infer_rows: prompts of one length prefill together, then every unfinished
    row decodes its next token in one pass, so each weight is read once per step for all rows. A row
    stops at a stop id (kept, as generate yields it) or at the context end. adapt(rows, layer, target, x3, y3)
    adds per-row terms to the projections (infer_rows' hook; rows: the prompt indices of x3's rows).
    Each row's tokens are the bits of generating it alone (infer_rows' contract)."""
    prompts = [_checked_prompt(model, p) for p in prompts]
    n_ctx = model.config.context_length

    def infer(rows, ids):
        hook = None if adapt is None else (lambda *args: adapt(rows, *args))
        return model.infer_rows(ids, [caches[r] for r in rows], hook)

    caches = [model.new_cache(min(n_ctx, p.size + max_tokens)) for p in prompts]
    logits = [None] * len(prompts)
    for length in sorted({p.size for p in prompts}):
        rows = [r for r, p in enumerate(prompts) if p.size == length]
        for r, row_logits in zip(rows, infer(rows, np.stack([prompts[r] for r in rows]))):
            logits[r] = row_logits
    out = [[] for _ in prompts]
    active = list(range(len(prompts))) if max_tokens > 0 else []
    for step in range(max_tokens):
        for r in active:
            out[r].append(int(np.argmax(logits[r])))  # sample()'s greedy rule: ties to the lowest id
        active = [r for r in active if out[r][-1] not in stop_ids and caches[r].length < n_ctx]
        if not active or step == max_tokens - 1:
            break
        for r, row_logits in zip(active, infer(active, np.array([[out[r][-1]] for r in active]))):
            logits[r] = row_logits
    return out


def greedy(model, prompt_ids, n: int) -> list[int]:
    """n greedy tokens (no stop ids): the deterministic continuation used by parity tests."""
    return list(generate(model, prompt_ids, n, Sampling()))


class LoadedModel:
    """A GGUF opened for inference: model (with the --lora adapters applied), tokenizer (None when the file has
    none), chat template."""

    def __init__(self, path, llama_numerics: bool = False, chat_template: str | None = None, lora=None,
                 lora_scale=None, log=None):
        from .chat import ChatTemplate
        from .gguf import GGUFFile
        from .quants import for_inference
        from .tokenizer import Tokenizer
        from ..models.registry import load_model
        self.gguf = GGUFFile(path)
        self.model = load_model(self.gguf, llama_numerics=llama_numerics)
        for_inference(self.model)  # its prompts take the prompt_tiles formats' tiles (pipeline/llm/quants.py)
        if lora:  # --lora PATH...: adapters applied beside the frozen weights (pipeline/llm/lora_serve.py)
            from .lora_serve import attach
            attach(self.model, lora, lora_scale, log)
        elif lora_scale:
            raise UserError("--lora-scale needs --lora PATH")
        self._tok_error = None
        try:
            self.tokenizer = Tokenizer.from_gguf(self.gguf)
        except UserError as e:
            self.tokenizer, self._tok_error = None, e
        self.template = ChatTemplate.from_gguf(self.gguf, chat_template)  # chat_template: --chat-template

    def require_tokenizer(self):
        if self.tokenizer is None:
            raise self._tok_error
        return self.tokenizer

    def encode_chat(self, messages, enable_thinking: bool | None = None):
        """A conversation's prompt ids as llama.cpp's chat completion builds them: rendered with the
        generation prompt, special tokens parsed, no BOS added (the template writes its own)."""
        tok, n_ctx = self.require_tokenizer(), self.model.config.context_length
        # bounded before tokenizing: the rendering stops past what the context can hold at all
        text = self.template.render(messages, enable_thinking=enable_thinking, max_chars=n_ctx * tok.max_token_chars,
                                    limit_reason=f"the model's context of {n_ctx} tokens, at most "
                                                 f"{tok.max_token_chars} characters each")
        return tok.encode(text, special=True, add_bos=False)

    def encode_prompt(self, text: str, chat: bool = False, system: str | None = None,
                      enable_thinking: bool | None = None):
        if not text:
            raise UserError("the prompt is empty")
        if chat:
            msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
            ids = self.encode_chat(msgs, enable_thinking)
        else:
            tok = self.require_tokenizer()
            tok.check_fits(text, self.model.config.context_length)
            ids = tok.encode(text, special=False)
        if not ids:
            raise UserError("the prompt encodes to zero tokens")
        return ids

    def stop_ids(self):
        """llama.cpp's end-of-generation ids of the GGUF (eos, eot, eom, FIM and the end-of-turn texts)."""
        return self.template.stop_ids
