"""Exports per family, from a `fucina finetune` run on the tiny llama / qwen2 / gemma3 fixtures: the merged
GGUF reloads as the adapted model; the llama.cpp adapter GGUF carries the base's architecture (and,
parity, llama.cpp serving base + adapter gives our adapted logits); `fucina export-peft` uses the
family's Hugging Face module names (and, parity, loads into transformers' LlamaForCausalLM /
Qwen2ForCausalLM built from the same GGUF weights, giving our adapted logits: llama's q/k adapter
rows reordered from GGUF's permuted order into HF's)."""
import json
from pathlib import Path

import numpy as np
import pytest

from pipeline.cli import main
from pipeline.llm.export import load_adapters
from pipeline.llm.gguf import GGUFFile
from pipeline.models.registry import family

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
FIXTURE = {"llama": "llama-mini-f32.gguf", "qwen2": "qwen2-mini-f32.gguf", "gemma3": "gemma3-gemma-mini-f32.gguf"}
# llama.cpp vs our trainer, of the logit scale: f32 sums in another order (~1e-6); gemma3 also reads
# GELU from ggml's f16 table (two f16 roundings of 2^-11 relative each; measured 7e-5 of the scale)
LLAMA_CPP_BOUND = {"llama": 2e-5, "qwen2": 2e-5, "gemma3": 3e-4}


@pytest.fixture(scope="module", params=sorted(FIXTURE))
def run(request, tmp_path_factory):
    arch = request.param
    out = tmp_path_factory.mktemp(arch)
    model = FIXTURES / FIXTURE[arch]
    assert main(["finetune", "--model", str(model), "--steps", "3", "--targets", "q,k,v,o,gate,up,down",
                 "--save", str(out / "run"), "--max-new-tokens", "1"]) == 0
    assert main(["export-peft", "--adapters", str(out / "run"), "--out", str(out / "peft")]) == 0
    assert main(["export-gguf", "--from-gguf", str(model), "--adapters", str(out / "run"),
                 "--out", str(out / "merged.gguf")]) == 0
    assert main(["export-gguf", "--adapters", str(out / "run"), "--base", str(model),
                 "--lora-out", str(out / "adapter.gguf")]) == 0
    return arch, model, out


def _adapted_logits(path, run_dir, ids):
    """Our trainer over the base with the run's adapters: the reference every export must reproduce."""
    from pipeline.finetune.model import LoraModel
    from pipeline.train.state_dict import read_safetensors
    state = json.loads((run_dir / "trainer_state.json").read_text())["config"]["lora"]
    tr = LoraModel.from_gguf(path, targets=tuple(state["targets"]), rank=state["rank"], alpha=state["alpha"])
    tr.load_adapter_tensors(read_safetensors(run_dir / "adapters.safetensors")[0])
    return tr.eval_logits(ids)


def test_merged_gguf_is_the_adapted_model(run):
    from pipeline.models.registry import load_model
    arch, path, out = run
    ids = np.arange(3, 23)
    merged = load_model(out / "merged.gguf")
    assert merged.config.arch == arch
    want = _adapted_logits(path, out / "run", ids)
    assert np.abs(want - load_model(path).infer(ids, all_logits=True)).max() > 1e-2 * np.abs(want).max()
    # W + s B A rounded once to f32 vs the unmerged sum: ~1e-6 of the logit scale
    np.testing.assert_allclose(merged.infer(ids, all_logits=True), want, rtol=0, atol=2e-5 * np.abs(want).max())


def test_adapter_gguf_names_the_base_architecture(run):
    arch, _, out = run
    gg = GGUFFile(out / "adapter.gguf")
    assert (gg.architecture, gg.get("general.type"), gg.get("adapter.type")) == (arch, "adapter", "lora")
    assert gg.has("blk.1.attn_q.weight.lora_a") and gg.has("blk.1.ffn_down.weight.lora_b")


@pytest.mark.parity
@pytest.mark.needs("llama_cpp")
def test_llama_cpp_serves_merged_and_base_plus_adapter_as_our_adapted_model(run):
    from test_export import _llama_logits
    arch, path, out = run
    ids = list(range(3, 23))
    want = _adapted_logits(path, out / "run", np.array(ids))
    bound = LLAMA_CPP_BOUND[arch] * np.abs(want).max()  # (llama.cpp adds the adapter's delta beside the base product)
    np.testing.assert_allclose(_llama_logits(out / "merged.gguf", ids), want, rtol=0, atol=bound)
    np.testing.assert_allclose(_llama_logits(path, ids, lora=out / "adapter.gguf"), want, rtol=0, atol=bound)


def test_peft_names_are_the_familys(run):
    from pipeline.train.state_dict import read_safetensors
    arch, path, out = run
    config = json.loads((out / "peft" / "adapter_config.json").read_text())
    assert config["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    tensors, _ = read_safetensors(out / "peft" / "adapter_model.safetensors")
    modules = dict(family(arch).hf_modules)
    want = {f"base_model.model.model.layers.{i}.{modules[t]}.lora_{ab}.weight"
            for i in range(GGUFFile(path).get(f"{arch}.block_count")) for t in modules for ab in "AB"}
    assert set(tensors) == want
    adapters = load_adapters(out / "run")
    q = next(p for p in adapters.pairs if (p.layer, p.target) == (0, "q"))
    exported = tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
    if arch == "llama":  # rows reordered (a permutation of the same rows), not copied
        assert not np.array_equal(exported, q.b)
        assert np.array_equal(np.sort(exported, axis=0), np.sort(q.b, axis=0))
    else:
        assert np.array_equal(exported, q.b)


def _hf_model(arch, path):
    """transformers' model of `arch` holding the GGUF's weights (llama q/k rows un-permuted)."""
    import torch
    import transformers
    gg = GGUFFile(path)
    fam = family(arch)
    w = lambda n: torch.tensor(gg.weight(n).dequantize())
    a = arch
    heads, kv = int(gg.get(f"{a}.attention.head_count")), int(gg.get(f"{a}.attention.head_count_kv"))
    kwargs = dict(vocab_size=gg.weight("token_embd.weight").shape[0], hidden_size=int(gg.get(f"{a}.embedding_length")),
                  intermediate_size=int(gg.get(f"{a}.feed_forward_length")),
                  num_hidden_layers=int(gg.get(f"{a}.block_count")), num_attention_heads=heads,
                  num_key_value_heads=kv, rms_norm_eps=float(gg.get(f"{a}.attention.layer_norm_rms_epsilon")),
                  rope_theta=float(gg.get(f"{a}.rope.freq_base")), tie_word_embeddings=not gg.has("output.weight"),
                  max_position_embeddings=256)
    cls, cfg_cls = {"llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig),
                    "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config)}[arch]
    cfg = cfg_cls(**kwargs)
    cfg.head_dim = int(gg.get(f"{a}.attention.key_length", kwargs["hidden_size"] // heads))
    model = cls(cfg).eval()
    sd = {"model.embed_tokens.weight": w("token_embd.weight"), "model.norm.weight": w("output_norm.weight").reshape(-1)}
    names = {"q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output", "gate": "ffn_gate", "up": "ffn_up",
             "down": "ffn_down"}
    for i in range(cfg.num_hidden_layers):
        p, h = f"blk.{i}.", f"model.layers.{i}."
        sd[h + "input_layernorm.weight"] = w(p + "attn_norm.weight").reshape(-1)
        sd[h + "post_attention_layernorm.weight"] = w(p + "ffn_norm.weight").reshape(-1)
        for t, module in fam.hf_modules:
            for kind in ("weight", "bias"):
                if gg.has(p + names[t] + "." + kind):
                    value = gg.weight(p + names[t] + "." + kind).dequantize()
                    value = value.reshape(-1) if kind == "bias" else value
                    sd[h + module + "." + kind] = torch.tensor(fam.hf_rows(t, value, heads, kv).copy())
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    return model


@pytest.mark.parity
@pytest.mark.needs("peft")
@pytest.mark.needs("transformers")
@pytest.mark.needs("torch")
def test_peft_export_in_transformers_gives_our_adapted_logits(run):
    import torch
    from peft import PeftModel
    arch, path, out = run
    if arch == "gemma3":
        pytest.skip("no transformers Gemma3 replica here yet (the torch LoRA replica covers gemma3's formulation)")
    ids = np.arange(3, 23)
    hf = _hf_model(arch, path)
    with torch.no_grad():
        base = hf(torch.tensor(ids)[None]).logits[0].double().numpy()
    tuned = PeftModel.from_pretrained(hf, out / "peft").eval()
    with torch.no_grad():
        theirs = tuned(torch.tensor(ids)[None]).logits[0].double().numpy()
    ours = _adapted_logits(path, out / "run", ids)
    scale = np.abs(theirs).max()
    assert np.abs(theirs - base).max() > 1e-2 * scale  # the adapters change the model
    # f32 on both sides, different summation orders through 2 layers: ~1e-6 of the logit scale
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=2e-5 * scale)
