"""Write a trained byte-level Qwen3 as a GGUF that llama.cpp and `fucina generate` load.

Tokenizer: the gpt2-style byte-level BPE convention (tokenizer.ggml.model
"gpt2", pre "qwen2") with 256 byte tokens - token id b is byte b, spelled with
GPT-2's byte-to-unicode map - then the ChatML special tokens, then ONE inert
merge. GGUF BPE loaders (llama.cpp, pipeline.llm.tokenizer) refuse an empty
merge list, so we add "a" + "1" -> "a1": the qwen2 pre-tokenizer always cuts a
letter run before a digit, so that pair never meets inside a chunk and the
merge never fires. A token id is a byte, and any text round-trips.

Trade-off: no merges means one token per byte (long sequences, tiny vocab);
it is what a from-scratch model on a 2-core machine can learn in minutes.
Weights: F32, or F16 for the matrices (norms stay F32), written with gguf-py's
GGUFWriter to a temp file and renamed, so a failed export leaves nothing.
"""
from __future__ import annotations

import os

import gguf
import numpy as np

from ..llm.tokenizer import _bytes_to_unicode

SPECIAL_TOKENS = [("<|endoftext|>", gguf.TokenType.CONTROL), ("<|im_start|>", gguf.TokenType.CONTROL),
                  ("<|im_end|>", gguf.TokenType.CONTROL), ("<think>", gguf.TokenType.USER_DEFINED),
                  ("</think>", gguf.TokenType.USER_DEFINED)]
INERT_MERGE = ("a", "1")  # never adjacent within one qwen2 pre-token (letters and digits are split)
VOCAB_SIZE = 256 + len(SPECIAL_TOKENS) + 1

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)


def byte_vocab():
    """(tokens, types, merges): 256 byte tokens (id = byte value), the specials, the inert merge."""
    to_char = _bytes_to_unicode()
    tokens = [to_char[b] for b in range(256)] + [t for t, _ in SPECIAL_TOKENS] + ["".join(INERT_MERGE)]
    types = [int(gguf.TokenType.NORMAL)] * 256 + [int(t) for _, t in SPECIAL_TOKENS] + [int(gguf.TokenType.NORMAL)]
    return tokens, types, [" ".join(INERT_MERGE)]


def write_model_gguf(path, config, weights: dict, dtype="F32", name="fucina-lm", description="", vocab=None,
                     pre="qwen2"):
    """weights: GGUF tensor name -> float32 array [out, in] (Qwen3.named_weights order).
    vocab: (tokens, types, merges) of a trained BPE (pipeline.llm.bpe_train.gguf_vocab), default byte_vocab();
    pre: its llama.cpp pre-tokenizer name."""
    if dtype not in ("F32", "F16"):
        raise ValueError(f"write_model_gguf: dtype must be F32 or F16, got {dtype!r}")
    tokens, types, merges = vocab or byte_vocab()
    tmp = f"{path}.tmp-{os.getpid()}"
    wr = gguf.GGUFWriter(tmp, arch="qwen3")
    wr.add_name(name)
    if description:
        wr.add_description(description)
    wr.add_context_length(config.context_length)
    wr.add_embedding_length(config.hidden)
    wr.add_block_count(config.layers)
    wr.add_feed_forward_length(config.ffn)
    wr.add_head_count(config.heads)
    wr.add_head_count_kv(config.kv_heads)
    wr.add_key_length(config.head_dim)
    wr.add_value_length(config.head_dim)
    wr.add_rope_freq_base(config.rope_base)
    wr.add_layer_norm_rms_eps(config.rms_eps)
    wr.add_file_type(0 if dtype == "F32" else 1)
    wr.add_tokenizer_model("gpt2")
    wr.add_tokenizer_pre(pre)
    wr.add_token_list(tokens)
    wr.add_token_types(types)
    wr.add_token_merges(merges)
    wr.add_bos_token_id(tokens.index("<|endoftext|>"))
    wr.add_eos_token_id(tokens.index("<|im_end|>"))
    wr.add_pad_token_id(tokens.index("<|endoftext|>"))
    wr.add_add_bos_token(False)
    wr.add_chat_template(CHAT_TEMPLATE)
    for tname, a in weights.items():
        a = np.ascontiguousarray(a, dtype=np.float32)
        wr.add_tensor(tname, a if (a.ndim == 1 or dtype == "F32") else a.astype(np.float16))
    try:
        wr.write_header_to_file()
        wr.write_kv_data_to_file()
        wr.write_tensors_to_file()
        wr.close()
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path
