"""The pretrain job on a tiny shape: same bits resumed (and, slow, with 2 trainers), bpb, samples, model.gguf."""
import json
import math
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from llama_oracle import CHILD_PRELUDE
from pretrain_helpers import small_documents, write_jsonl
from pipeline.errors import UserError
from pipeline.jobs import get_job
from pipeline.jobs.spec import build
from pipeline.llm.gguf import GGUFFile
from pipeline.llm.tokenizer import Tokenizer
from pipeline.models.registry import load_model
from pipeline.runtime import ckpt
from pipeline.runtime.inprocess import run_inprocess
from pipeline.threads import pin_threads

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
Pretrain = get_job("pretrain")


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    base = tmp_path_factory.mktemp("pretrain")
    return {"preset": "tiny", "data": write_jsonl(base / "docs.jsonl", small_documents()), "vocab_size": 320,
            "seq": 256, "batch_tokens": 512, "micro_batches": 2, "steps": 4, "warmup": 1,
            "checkpoint_every": 2, "eval_every": 2, "val_windows": 2, "sample_tokens": 4, "sample_every": 2,
            "prompts": "The |def ", "cache_dir": str(base / "cache")}


def _run(run_dir, spec, resume=None):
    pin_threads(1)
    return run_inprocess(Pretrain(build(Pretrain.Spec, spec)), str(run_dir), resume=resume, log=lambda m: None)


@pytest.fixture(scope="module")
def full(spec, tmp_path_factory):
    return _run(tmp_path_factory.mktemp("full"), spec)


def test_resumed_run_has_the_same_bits_and_time_lapse(full, spec, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(full["run_dir"], run_dir)  # the run stopped after step 4 resumes in place from step 2
    with open(full["samples"]) as fh:  # step 4's lines made stale: the resumed run must rewrite them
        stale = [{**r, "text": "stale"} if r["step"] == 4 else r for r in map(json.loads, fh)]
    (run_dir / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in stale))
    resumed = _run(run_dir, spec, resume=str(run_dir / "checkpoint-step-2"))
    assert resumed["start_step"] == 2 and resumed["params_sha256"] == full["params_sha256"]
    assert ckpt.params_sha256(ckpt.read_params(full["checkpoint"])) == full["params_sha256"]
    with open(full["samples"], "rb") as fh:  # steps 2 and 4 once each: 4 rewritten, not repeated
        assert (run_dir / "samples.jsonl").read_bytes() == fh.read()


def test_sequence_length_warm_up_keeps_the_batch_tokens(spec):
    job = Pretrain(build(Pretrain.Spec, spec))
    layout = {name: (shape, dtype) for name, shape, dtype in job.batch_layout()}
    seen = []
    for step in range(job.steps):
        out = {name: np.zeros(shape, dtype) for name, (shape, dtype) in layout.items()}
        job.fill_batch(step, 1, out)
        t = int(out["window"][0])
        rows = out["tokens"][: 256 // t * (t + 1)].reshape(-1, t + 1)
        assert rows.size == 256 // t * (t + 1)
        start = int(np.flatnonzero(np.lib.stride_tricks.sliding_window_view(job.train, t + 1)
                                   .__eq__(rows[0]).all(axis=1))[0])  # each row is a window of the stream
        assert start + t + 1 <= len(job.train)
        seen.append(t)
    assert seen == [64, 128, 256, 256]  # context_at over 4 steps: < 10%, < 30%, then the full length


def test_validation_bits_per_byte_and_the_time_lapse(full, spec):
    job = Pretrain(build(Pretrain.Spec, spec))
    tok = Tokenizer.from_gguf(GGUFFile(full["gguf"]))
    targets = job.val_rows[:, 1:].ravel()
    n_bytes = sum(len(tok.token_bytes(int(i))) for i in targets)  # special tokens spell no bytes
    assert full["val_bpb"] == pytest.approx(full["val_loss"] * targets.size / (math.log(2) * n_bytes), rel=1e-12)
    with open(full["samples"]) as fh:
        lines = [json.loads(line) for line in fh]
    assert [(r["step"], r["prompt"]) for r in lines] == [(2, "The "), (2, "def "), (4, "The "), (4, "def ")]
    assert all(r["text"].startswith(r["prompt"]) for r in lines)
    evals = [r for r in map(json.loads, open(os.path.join(full["run_dir"], "metrics.jsonl")))
             if r.get("eval") is not None]
    assert [r["step"] for r in evals] == [2, 4] and evals[-1]["eval"] == pytest.approx(full["val_loss"], rel=1e-6)


def test_model_gguf_loads_with_the_trained_tokenizer_and_same_logits(full, spec):
    job = Pretrain(build(Pretrain.Spec, spec))
    gg = GGUFFile(full["gguf"])
    assert gg.metadata["tokenizer.ggml.pre"] == "qwen2" and gg.architecture == "qwen3"
    text = "The for statement <|im_start|>user"
    ids = Tokenizer.from_gguf(gg).encode(text)
    assert ids == job.tok.encode(text, add_special_tokens=False).ids
    ours = job.bind(list(ckpt.read_params(full["checkpoint"], order=[n for n, _, _ in job.param_layout()]).items()))
    loaded = load_model(gg)
    np.testing.assert_allclose(loaded.infer(np.array(ids), all_logits=True), ours.infer(np.array(ids), all_logits=True),
                               rtol=1e-5, atol=1e-5)


def test_export_gguf_from_checkpoint(full, spec, tmp_path, capsys):
    from pipeline.cli import main
    final = tmp_path / "final.gguf"  # the last checkpoint is the final model: the same file, byte for byte
    assert main(["export-gguf", "--from-checkpoint", full["run_dir"], "--out", str(final)]) == 0
    assert final.read_bytes() == open(full["gguf"], "rb").read()
    mid = tmp_path / "mid.gguf"
    assert main(["export-gguf", "--from-checkpoint", os.path.join(full["run_dir"], "checkpoint-step-2"),
                 "--out", str(mid)]) == 0
    job = Pretrain(build(Pretrain.Spec, spec))
    ids = job.tok.encode("The for statement", add_special_tokens=False).ids
    assert Tokenizer.from_gguf(GGUFFile(str(mid))).encode("The for statement") == ids
    order = [n for n, _, _ in job.param_layout()]
    ours = job.bind(list(ckpt.read_params(os.path.join(full["run_dir"], "checkpoint-step-2"), order=order).items()))
    np.testing.assert_allclose(load_model(str(mid)).infer(np.array(ids), all_logits=True),
                               ours.infer(np.array(ids), all_logits=True), rtol=1e-5, atol=1e-5)
    half = tmp_path / "half.gguf"
    assert main(["export-gguf", "--from-checkpoint", full["run_dir"], "--dtype", "f16", "--out", str(half)]) == 0
    gg = GGUFFile(str(half))
    assert gg.tensor_type("blk.0.attn_q.weight") == "F16" and gg.tensor_type("output_norm.weight") == "F32"
    assert main(["export-gguf", "--from-checkpoint", full["run_dir"], "--dtype", "q8_0", "--out",
                 str(tmp_path / "q.gguf")]) == 2 and "second pass" in capsys.readouterr().err
    assert not (tmp_path / "q.gguf").exists()


def test_bad_specs_are_one_error(spec):
    with pytest.raises(UserError, match="multiple of every window length"):
        build(Pretrain.Spec, {**spec, "batch_tokens": 500})
    with pytest.raises(UserError, match="training tokens"):
        Pretrain(build(Pretrain.Spec, {**spec, "seq": 1 << 20, "batch_tokens": 1 << 21}))


_LLAMA = CHILD_PRELUDE + """
import json, numpy as np
llm = llama(sys.argv[1], n_ctx=64, logits_all=True, n_threads=1, type_k=0, type_v=0)
ids = llm.tokenize(sys.argv[2].encode(), add_bos=False, special=True)
llm.eval(ids)
np.save(sys.argv[3], np.array(llm.scores[:len(ids)], np.float32))
print(json.dumps(ids))
"""


@pytest.mark.parity
@pytest.mark.needs("llama_cpp")
@pytest.mark.parametrize("source", ["model.gguf", "checkpoint-step-2"])
def test_llama_cpp_loads_model_gguf_with_the_same_ids_and_logits(full, spec, tmp_path, source):
    from pipeline.cli import main
    job = Pretrain(build(Pretrain.Spec, spec))
    path = full["gguf"] if source == "model.gguf" else str(tmp_path / "mid.gguf")
    if source != "model.gguf":  # a mid-run checkpoint through export-gguf --from-checkpoint
        assert main(["export-gguf", "--from-checkpoint", os.path.join(full["run_dir"], source), "--out", path]) == 0
    text = "The for statement <|im_start|>user\nhi"
    proc = subprocess.run([sys.executable, "-c", _LLAMA, path, text, str(tmp_path / "logits.npy")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ids = json.loads(proc.stdout.strip().splitlines()[-1])
    assert ids == job.tok.encode(text, add_special_tokens=False).ids
    ours = load_model(path).infer(np.array(ids), all_logits=True)
    # F32 weights, width 64: float32 sums over <= 192 terms differ by summation order only (~1e-5 relative);
    # llama.cpp's F32 path keeps activations in F32, so the bound of the lm job's parity test holds here too
    np.testing.assert_allclose(np.load(tmp_path / "logits.npy"), ours, rtol=1e-3, atol=1e-3)


def _launch(run_dir, spec, *flags):
    args = [f"--{k.replace('_', '-')}={v}" for k, v in spec.items()]
    out = subprocess.run([sys.executable, "-m", "pipeline.cli", "launch", "pretrain", "--run-dir", str(run_dir),
                          "--json", *flags, *args], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_two_trainers_and_a_pipeline_resume_equal_inprocess(full, spec, tmp_path):
    two = _launch(tmp_path / "two", spec, "--trainers", "2")
    resumed = _launch(tmp_path / "resumed", spec, "--trainers", "2", "--resume",
                      os.path.join(full["run_dir"], "checkpoint-step-2"))
    assert two["params_sha256"] == full["params_sha256"] == resumed["params_sha256"]
    with open(full["samples"], "rb") as fh:
        assert (tmp_path / "two" / "samples.jsonl").read_bytes() == fh.read()


def _micro_grads(job, params, bf16):
    job.spec.bf16 = bf16
    model = job.bind(list(params.items()))
    batch = {name: np.zeros(shape, dtype) for name, shape, dtype in job.batch_layout()}
    job.fill_batch(3, 1, batch)
    grads = {n: np.zeros(shape, dtype) for n, shape, dtype in job.param_layout()}
    loss, _ = job.micro_grad(model, batch, grads)
    return loss, grads


def test_bf16_matrices_are_the_f32_math_on_rounded_masters(spec):
    """--bf16 = the same forward/backward on block matrices rounded to bf16; the f32 masters stay untouched."""
    import ml_dtypes
    from pipeline.jobs.recipes import is_hidden_matrix
    job = Pretrain(build(Pretrain.Spec, spec))
    masters = {n: a.copy() for n, a in job.init_params()}
    before = {n: a.copy() for n, a in masters.items()}
    loss, grads = _micro_grads(job, masters, bf16=True)
    assert all(np.array_equal(masters[n], before[n]) and masters[n].dtype == np.float32 for n in masters)
    assert all(g.dtype == np.float32 for g in grads.values())
    rounded = {n: a.astype(ml_dtypes.bfloat16).astype(np.float32) if is_hidden_matrix(n, a) else a
               for n, a in masters.items()}
    assert any(not np.array_equal(rounded[n], masters[n]) for n in masters)  # the rounding does something
    ref_loss, ref_grads = _micro_grads(job, rounded, bf16=False)
    assert loss == ref_loss and all(np.array_equal(grads[n], ref_grads[n]) for n in grads)
    f32_loss, _ = _micro_grads(job, masters, bf16=False)
    assert f32_loss != loss
