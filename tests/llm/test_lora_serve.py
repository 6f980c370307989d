"""Serving a LoRA fine-tune unmerged (`--lora PATH`, `--lora-scale S`): the logits equal the merged dense model's
within float tolerance, from a run directory and from the adapter GGUF export-gguf writes, on the commands."""
import json

import numpy as np
import pytest
from test_export_fixtures import write_tiny_qwen3

from pipeline.cli import main as fucina
from pipeline.errors import UserError
from pipeline.llm.export import load_adapters, merge, write_lora_gguf
from pipeline.llm.generate import LoadedModel
from pipeline.llm.lora_serve import load_lora
from pipeline.train.state_dict import save_state_dict
from pipeline.train.trainer_state import TrainerState

TARGETS = {"q": (256, 256), "k": (128, 256), "v": (128, 256), "o": (256, 256), "gate": (512, 256),
           "up": (512, 256), "down": (256, 512)}  # [out, in] of write_tiny_qwen3's defaults
RANK, ALPHA = 4, 8.0
PROMPT = [5, 17, 99, 3, 42, 250, 7, 61]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return write_tiny_qwen3(tmp_path_factory.mktemp("base") / "base.gguf")


def make_run(directory, seed=0, targets=TARGETS, layers=(0, 1)):
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in layers:
        for t, (out, inp) in targets.items():
            tensors[f"layers.{layer}.{t}.lora_a"] = (0.05 * rng.standard_normal((RANK, inp))).astype(np.float32)
            tensors[f"layers.{layer}.{t}.lora_b"] = (0.05 * rng.standard_normal((out, RANK))).astype(np.float32)
    directory.mkdir(parents=True)
    save_state_dict(directory / "adapters.safetensors", tensors)
    state = TrainerState(step=3, config={"lora": {"rank": RANK, "alpha": ALPHA, "targets": list(targets)}})
    (directory / "trainer_state.json").write_text(state.to_json())
    return directory


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("ft") / "run")


def logits(path, **kw):
    return LoadedModel(path, **kw).model.infer(np.array(PROMPT), all_logits=True)


def assert_close(got, want):
    assert np.abs(got - want).max() <= 2e-4 * np.abs(want).max()


def test_a_run_directory_gives_the_merged_models_logits(base, run_dir, tmp_path):
    merged = tmp_path / "merged.gguf"
    merge(base, load_adapters(run_dir), ALPHA, merged)
    plain, want, got = logits(base), logits(merged), logits(base, lora=[run_dir])
    assert np.abs(want - plain).max() > 0.05 * np.abs(plain).max()  # the adapter changes the logits a lot ...
    assert_close(got, want)                                           # ... and the unmerged route follows them


def test_lora_scale_scales_the_delta_as_llama_cpp(base, run_dir, tmp_path):
    half = tmp_path / "half.gguf"
    merge(base, load_adapters(run_dir), ALPHA * 0.5, half)  # s * alpha / rank: alpha halved == scale 0.5
    assert_close(logits(base, lora=[run_dir], lora_scale=[0.5]), logits(half))
    assert np.array_equal(logits(base, lora=[run_dir], lora_scale=[0.0]), logits(base))


def test_the_adapter_gguf_gives_the_same_logits_as_the_run(base, run_dir, tmp_path):
    adapter = tmp_path / "adapter.gguf"
    write_lora_gguf(load_adapters(run_dir), ALPHA, base, adapter)
    pairs = load_lora(adapter)
    assert len(pairs) == 14 and all(p.scale == np.float32(ALPHA / RANK) for p in pairs)
    assert_close(logits(base, lora=[adapter]), logits(base, lora=[run_dir]))


def test_two_adapters_add_their_deltas(base, run_dir, tmp_path):
    other = make_run(tmp_path / "other", seed=1, targets={"q": TARGETS["q"]}, layers=(1,))
    step1 = tmp_path / "m1.gguf"
    merge(base, load_adapters(run_dir), ALPHA, step1)
    both = tmp_path / "m2.gguf"
    merge(step1, load_adapters(other), ALPHA, both)
    assert_close(logits(base, lora=[run_dir, other]), logits(both))


def test_bad_lora_inputs_are_one_clear_error(base, run_dir, tmp_path):
    with pytest.raises(UserError, match="no such file or directory"):
        load_lora(tmp_path / "missing")
    with pytest.raises(UserError, match="not a LoRA adapter GGUF"):
        load_lora(base)
    wrong = make_run(tmp_path / "wrong", targets={"q": (256, 128)}, layers=(0,))
    with pytest.raises(UserError, match=r"\[out, in\] = \[256, 256\].*another model"):
        LoadedModel(base, lora=[wrong])
    deep = make_run(tmp_path / "deep", targets={"q": TARGETS["q"]}, layers=(7,))
    with pytest.raises(UserError, match="layer 7, but the model has 2 layers"):
        LoadedModel(base, lora=[deep])
    with pytest.raises(UserError, match="one scale for all adapters or one per --lora"):
        LoadedModel(base, lora=[run_dir], lora_scale=[1.0, 2.0])
    with pytest.raises(UserError, match="--lora-scale needs --lora"):
        LoadedModel(base, lora_scale=[1.0])


def test_eval_logits_and_generate_take_lora(base, run_dir, tmp_path, capsys):
    merged = tmp_path / "merged.gguf"
    merge(base, load_adapters(run_dir), ALPHA, merged)
    ids = ",".join(map(str, PROMPT))
    assert fucina(["eval-logits", "--model", str(merged), "--tokens", ids, "--json"]) == 0
    want = np.array(json.loads(capsys.readouterr().out)["logits"])
    assert fucina(["eval-logits", "--model", str(base), "--tokens", ids, "--json", "--lora", str(run_dir)]) == 0
    out = capsys.readouterr()
    assert "lora: " in out.err and "14 adapted projections" in out.err
    assert_close(np.array(json.loads(out.out)["logits"]), want)
    assert fucina(["generate", "--model", str(merged), "--prompt", "hello", "--max-tokens", "6"]) == 0
    merged_text = capsys.readouterr().out
    assert fucina(["generate", "--model", str(base), "--prompt", "hello", "--max-tokens", "6",
                   "--lora", str(run_dir)]) == 0
    assert capsys.readouterr().out == merged_text
    assert fucina(["generate", "--model", str(base), "--prompt", "hi", "--lora", str(tmp_path / "nope")]) == 2
    assert "no such file or directory" in capsys.readouterr().err
