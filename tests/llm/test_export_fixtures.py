"""Tiny Qwen3 GGUFs and LoRA checkpoint directories for the export tests (plus their self-checks).

The other export test files import the builders from here by module name
(pytest puts this directory on sys.path).
"""
import json

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import GGUFWriter

from pipeline.kernels.quantize import to_bf16_bits
from pipeline.train.state_dict import save_state_dict

TARGET_TENSOR = {"q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output",
                 "gate": "ffn_gate", "up": "ffn_up", "down": "ffn_down"}


def _byte_vocab():
    """GPT-2 byte-to-unicode tokens (256), a few merges, then the ChatML specials."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    tokens = [chr(c) for _, c in sorted(zip(bs, cs))]
    merges = ["Ġ t", "h e", "Ġ a"]
    tokens += [m.replace(" ", "") for m in merges]
    types = [1] * len(tokens)
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        tokens.append(special)
        types.append(3)
    return tokens, types, merges


def write_tiny_qwen3(path, *, hidden=256, layers=2, heads=4, kv_heads=2, head_dim=64, ffn=512,
                     dtype="f32", tied=False, seed=0):
    """A random Qwen3 GGUF llama.cpp loads: rows of 256 so every K-quant applies."""
    rng = np.random.default_rng(seed)
    tokens, types, merges = _byte_vocab()
    vocab = len(tokens)
    w = GGUFWriter(str(path), "qwen3")
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(1000000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_file_type({"f32": 0, "f16": 1, "bf16": 32}[dtype])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab - 3)
    w.add_eos_token_id(vocab - 1)
    w.add_add_bos_token(False)

    def mat(name, rows, cols, scale=None):
        x = rng.standard_normal((rows, cols)).astype(np.float32) * np.float32(scale or 1 / np.sqrt(cols))
        if dtype == "f16":
            w.add_tensor(name, x.astype(np.float16))
        elif dtype == "bf16":
            w.add_tensor(name, to_bf16_bits(x).view(np.uint8).reshape(rows, -1), raw_dtype=QT.BF16)
        else:
            w.add_tensor(name, x)

    def vec(name, n):
        w.add_tensor(name, (1 + 0.1 * rng.standard_normal(n)).astype(np.float32))

    mat("token_embd.weight", vocab, hidden, 0.5)
    for i in range(layers):
        p = f"blk.{i}."
        vec(p + "attn_norm.weight", hidden)
        mat(p + "attn_q.weight", heads * head_dim, hidden)
        mat(p + "attn_k.weight", kv_heads * head_dim, hidden)
        mat(p + "attn_v.weight", kv_heads * head_dim, hidden)
        mat(p + "attn_output.weight", hidden, heads * head_dim)
        vec(p + "attn_q_norm.weight", head_dim)
        vec(p + "attn_k_norm.weight", head_dim)
        vec(p + "ffn_norm.weight", hidden)
        mat(p + "ffn_gate.weight", ffn, hidden)
        mat(p + "ffn_up.weight", ffn, hidden)
        mat(p + "ffn_down.weight", hidden, ffn)
    vec("output_norm.weight", hidden)
    if not tied:
        mat("output.weight", vocab, hidden)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_adapters(ckpt_dir, *, layers=2, dims=None, targets=("q", "v"), rank=4, seed=1,
                   alpha=None, sentinel=True, scale=0.05):
    """A checkpoint directory with adapters.safetensors (+ trainer_state.json recording config.lora.alpha).

    dims: target -> (out, in); defaults match write_tiny_qwen3's defaults."""
    from pipeline.train.trainer_state import TrainerState

    dims = dims or {"q": (256, 256), "k": (128, 256), "v": (128, 256), "o": (256, 256),
                    "gate": (512, 256), "up": (512, 256), "down": (256, 512)}
    rng = np.random.default_rng(seed)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for i in range(layers):
        for t in targets:
            out_dim, in_dim = dims[t]
            tensors[f"layers.{i}.{t}.lora_a"] = (rng.standard_normal((rank, in_dim)) * scale).astype(np.float32)
            tensors[f"layers.{i}.{t}.lora_b"] = (rng.standard_normal((out_dim, rank)) * scale).astype(np.float32)
    save_state_dict(ckpt_dir / "adapters.safetensors", tensors)
    if sentinel:
        lora = {"rank": rank, "targets": list(targets), "dropout": 0.0}  # the layout `fucina finetune` writes
        if alpha is not None:
            lora["alpha"] = alpha
        config = {"lora": lora}
        (ckpt_dir / "trainer_state.json").write_text(TrainerState(step=10, config=config).to_json())
    return tensors


def test_tiny_qwen3_fixture_reads_back(tmp_path):
    from pipeline.llm.gguf_write import read_gguf

    c = read_gguf(write_tiny_qwen3(tmp_path / "m.gguf", dtype="f16"))
    assert c.architecture == "qwen3"
    assert c.tensor("blk.1.attn_k.weight").shape == (128, 256)
    assert c.tensor("blk.1.attn_k.weight").qtype == QT.F16


@pytest.mark.parity
@pytest.mark.needs("llama_cpp")
def test_tiny_qwen3_fixture_loads_in_llama_cpp(tmp_path):
    import llama_cpp

    path = write_tiny_qwen3(tmp_path / "m.gguf")
    llm = llama_cpp.Llama(str(path), n_ctx=64, verbose=False, logits_all=True)
    llm.eval([1, 2, 3])
    assert np.isfinite(np.asarray(llm.scores[:3])).all()
    json.dumps(llm.metadata)  # plain strings: loaded as a normal model
