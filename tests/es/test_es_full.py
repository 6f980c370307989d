"""`--search full`: every dense matrix of an F16 model perturbed in place and restored; the reward moves, the
bits repeat across runs and thread counts, the mapped GGUF is never written, resume is exact (with anchored
decay), and a quantized file is refused unless --dequantize."""
import hashlib
import json
import os

import numpy as np
import pytest
from threadpoolctl import threadpool_limits

from pipeline.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
F32 = os.path.join(ROOT, "tests", "fixtures", "qwen3-mini-f32.gguf")
Q8 = os.path.join(ROOT, "tests", "fixtures", "qwen3-mini-q8_0.gguf")
FULL = ("--search", "full", "--population", "6", "--batch", "2", "--max-new-tokens", "2", "--sigma", "0.01",
        "--alpha", "0.01", "--eval-samples", "5")


@pytest.fixture(scope="module")
def f16(tmp_path_factory):
    """The f32 fixture transcoded to F16 (every matrix F16, norms kept F32), as `fucina quantize` writes it."""
    from pipeline.llm.gguf_write import transcode
    path = tmp_path_factory.mktemp("f16") / "qwen3-mini-f16.gguf"
    transcode(F32, path, "F16")
    return str(path)


def _run(capsys, model, *argv, threads="0"):
    rc = main(["es-finetune", "--model", model, *FULL, "--threads", threads, *argv, "--json"])
    out = capsys.readouterr()
    return rc, (json.loads(out.out.strip().splitlines()[-1]) if rc == 0 else None), out.err


def _sha(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def test_full_search_trains_an_f16_model_with_repeatable_bits(f16, capsys):
    on_disk = _sha(f16)
    with threadpool_limits(1):
        rc, one, err = _run(capsys, f16, "--iterations", "4", threads="1")
    assert rc == 0, err
    assert "every dense weight matrix" in err
    assert one["final_loss"] < one["initial_loss"], one
    rc, two, err = _run(capsys, f16, "--iterations", "4", threads="2")
    assert rc == 0, err
    assert two["searched_sha256"] == one["searched_sha256"] and two["reward_means"] == one["reward_means"]
    assert two["final_loss"] == one["final_loss"]
    assert _sha(f16) == on_disk  # the perturbations went to private copies, never into the mapped file


def test_full_search_registers_every_matrix_once_and_restores_bitwise(f16):
    from pipeline.llm.tokenizer import load_tokenizer
    from pipeline.es import ESConfig
    from pipeline.finetune.es import ESFinetune
    from pipeline.finetune.model import batch_loss
    from pipeline.llm import data as sft
    from pipeline.llm.chat import ChatTemplate
    from pipeline.finetune.model import LoraModel
    from pipeline.llm.gguf import open_gguf
    gg = open_gguf(f16)
    samples = sft.encode_all(sft.RawEncoder(load_tokenizer(gg)), ChatTemplate.from_gguf(gg), sft.PIRATE_PAIRS[:2])
    trainer = LoraModel.from_gguf(f16, seed=0)
    run = ESFinetune(trainer, samples, sft.Loader(2), ESConfig(sigma=0.01, alpha=0.01, population=2, seed=3,
                                                              restore_mode="snapshot"), batch=2, search="full")
    names = run.es.names
    assert "token_embd.weight" in names and "output.weight" not in names  # tied head: one slot
    assert len(names) == 1 + 2 * 7 and all(n.endswith(".weight") and "norm" not in n for n in names)
    assert {a.dtype for _, a in run.es.named_arrays()} == {np.dtype(np.float16)}
    before = [a.copy() for _, a in run.es.named_arrays()]
    base = batch_loss(trainer, samples)
    run.es.perturb(0)
    perturbed = batch_loss(trainer, samples)
    run.es.restore(0)
    assert perturbed != base  # the forward reads the perturbed matrices
    assert all(np.array_equal(a, b) for (_, a), b in zip(run.es.named_arrays(), before))
    assert batch_loss(trainer, samples) == base


def test_full_resume_is_exact_with_anchored_decay(f16, tmp_path, capsys):
    decay = ("--anchor-decay", "l2", "--anchor-lambda", "2")
    rc, whole, err = _run(capsys, f16, "--iterations", "4", *decay)
    assert rc == 0, err
    rc, half, err = _run(capsys, f16, "--iterations", "2", *decay, "--save", str(tmp_path / "h"))
    assert rc == 0, err
    from safetensors.numpy import load_file
    stored = load_file(tmp_path / "h" / "model.safetensors")
    assert "blk.1.ffn_down.weight" in stored and stored["token_embd.weight"].dtype == np.float16
    state = json.loads((tmp_path / "h" / "trainer_state.json").read_text())
    assert state["config"]["es_search"] == "full" and state["config"]["es_anchor_decay"] == "l2"
    rc, resumed, err = _run(capsys, f16, "--iterations", "4", "--load", str(tmp_path / "h"))
    assert rc == 0, err
    assert resumed["searched_sha256"] == whole["searched_sha256"]
    assert resumed["reward_means"] == whole["reward_means"][2:]


def test_quantized_files_refuse_full_unless_dequantized(capsys):
    rc, _, err = _run(capsys, Q8, "--iterations", "1")
    assert rc == 2 and "is Q8_0" in err and "--dequantize" in err and Q8 in err
    rc, s, err = _run(capsys, Q8, "--iterations", "1", "--dequantize")
    assert rc == 0, err
    assert s["final_loss"] != s["initial_loss"]
    rc, _, err = _run(capsys, Q8, "--iterations", "1", "--dequantize", "--workers", "2")
    assert rc == 2 and "drop --workers" in err
