"""Job specs (TOML + flags) and the jobs' pure functions (data order, gradients, export)."""
import argparse

import numpy as np
import pytest
from llama_oracle import CHILD_PRELUDE

from pipeline.errors import UserError
from pipeline.jobs import get_job
from pipeline.jobs.spec import add_flags, build, from_args


def _parse(job, argv):
    p = argparse.ArgumentParser()
    add_flags(p, get_job(job).Spec)
    return p.parse_args(argv)


def test_flags_override_toml_which_overrides_defaults(tmp_path):
    toml = tmp_path / "job.toml"
    toml.write_text('steps = 7\nlr = 1\nmicro-batches = 2\n')
    spec = from_args(get_job("spirals").Spec, _parse("spirals", ["--config", str(toml), "--steps", "9"]))
    assert (spec.steps, spec.lr, spec.micro_batches, spec.batch) == (9, 1.0, 2, 64)


@pytest.mark.parametrize("text, msg", [
    ("stepz = 3\n", "unknown field 'stepz'"),
    ('steps = "many"\n', "field 'steps' must be int"),
    ("steps = = 3\n", "not valid TOML"),
    ('optimizer = "sgd"\n', "must be one of"),
])
def test_bad_toml_names_file_and_field(tmp_path, text, msg):
    toml = tmp_path / "bad.toml"
    toml.write_text(text)
    job = "lm" if "optimizer" in text else "spirals"
    with pytest.raises(UserError, match=msg) as e:
        from_args(get_job(job).Spec, _parse(job, ["--config", str(toml)]))
    assert str(toml) in str(e.value)


def test_indivisible_batch_is_refused():
    with pytest.raises(UserError, match="not divisible"):
        build(get_job("spirals").Spec, {"batch": 10, "micro_batches": 3})


def test_spirals_data_order_is_a_pure_function_of_seed_and_step():
    job_cls = get_job("spirals")
    a, b = job_cls(build(job_cls.Spec, {})), job_cls(build(job_cls.Spec, {}))
    out_a = {n: np.zeros(s, d) for n, s, d in a.batch_layout()}
    out_b = {n: np.zeros(s, d) for n, s, d in b.batch_layout()}
    a.fill_batch(500, 3, out_a)  # deep into a later epoch, computed cold in both
    b.fill_batch(0, 0, out_b)
    b.fill_batch(500, 3, out_b)
    np.testing.assert_array_equal(out_a["x"], out_b["x"])
    # one epoch visits every point exactly once
    n, rows = len(a.y), []
    for step in range(n // a.spec.batch):
        for k in range(a.micro_batches):
            a.fill_batch(step, k, out_a)
            rows.append(out_a["x"].copy())
    seen = np.concatenate(rows)
    assert len(np.unique(seen, axis=0)) == len(seen)


def test_lm_micro_batch_gradients_sum_to_the_full_batch_gradient():
    job_cls = get_job("lm")
    spec = {"batch": 4, "micro_batches": 2, "seq": 16, "hidden": 16, "layers": 1, "heads": 2, "kv_heads": 1,
            "head_dim": 8, "ffn": 32}
    job = job_cls(build(job_cls.Spec, spec))
    whole = job_cls(build(job_cls.Spec, {**spec, "micro_batches": 1}))
    params = {n: a.copy() for n, a in job.init_params()}
    model = job.bind(list(params.items()))
    slots = []
    for k in range(2):
        batch = {n: np.zeros(s, d) for n, s, d in job.batch_layout()}
        job.fill_batch(0, k, batch)
        grads = {n: np.zeros_like(a) for n, a in params.items()}
        job.micro_grad(model, batch, grads)
        slots.append(grads)
    batch = {n: np.zeros(s, d) for n, s, d in whole.batch_layout()}
    whole.fill_batch(0, 0, batch)
    full = {n: np.zeros_like(a) for n, a in params.items()}
    whole.micro_grad(whole.bind(list(params.items())), batch, full)
    for name in params:
        np.testing.assert_allclose(slots[0][name] + slots[1][name], full[name], rtol=2e-4, atol=1e-6)


def test_lm_gguf_export_round_trips_through_the_reader(tmp_path):
    from pipeline.jobs.lm_export import VOCAB_SIZE, byte_vocab
    from pipeline.llm.gguf import GGUFFile
    from pipeline.llm.tokenizer import Tokenizer
    from pipeline.models.qwen3 import Qwen3
    job_cls = get_job("lm")
    job = job_cls(build(job_cls.Spec, {"hidden": 16, "layers": 1, "heads": 2, "kv_heads": 1, "head_dim": 8,
                                       "ffn": 32, "sample_tokens": 4}))
    params = {n: a for n, a in job.init_params()}
    extras = job.finish(str(tmp_path), params, log=lambda m: None)
    tokens, _, _ = byte_vocab()
    assert len(tokens) == VOCAB_SIZE == 262
    gg = GGUFFile(extras["gguf"])
    tok = Tokenizer.from_gguf(gg)
    text = "def f(x):\n    return a1 + x1b2  # café"
    ids = tok.encode(text)
    assert ids == list(text.encode())  # one token per byte, id = byte
    assert tok.decode(ids) == text
    loaded = Qwen3.from_gguf(gg)
    ours = job.bind(list(params.items()))
    prompt = np.frombuffer(b"The for", np.uint8).astype(np.int64)
    np.testing.assert_allclose(loaded.infer(prompt), ours.infer(prompt), rtol=1e-4, atol=1e-4)


_LLAMA = CHILD_PRELUDE + """
import json, numpy as np
llm = llama(sys.argv[1], n_ctx=64, logits_all=True, n_threads=1, type_k=0, type_v=0)
ids = llm.tokenize(sys.argv[2].encode(), add_bos=False, special=False)
llm.eval(ids)
np.save(sys.argv[3], np.array(llm.scores[:len(ids)], np.float32))
print(json.dumps(ids))
"""


@pytest.mark.parity
@pytest.mark.needs("llama_cpp")
def test_lm_gguf_loads_in_llama_cpp_with_byte_ids_and_matching_logits(tmp_path):
    import json
    import subprocess
    import sys
    job_cls = get_job("lm")
    job = job_cls(build(job_cls.Spec, {"hidden": 32, "layers": 1, "heads": 2, "kv_heads": 1, "head_dim": 16,
                                       "ffn": 64, "sample_tokens": 0}))
    params = {n: a for n, a in job.init_params()}
    gguf_path = job.finish(str(tmp_path), params, log=lambda m: None)["gguf"]
    text = "The for statement a1 x = [1, 2]"
    proc = subprocess.run([sys.executable, "-c", _LLAMA, gguf_path, text, str(tmp_path / "logits.npy")],
                          capture_output=True, text=True, timeout=120)
    if proc.returncode == -4:
        pytest.skip("llama.cpp died with SIGILL on this CPU")
    assert proc.returncode == 0, proc.stderr[-2000:]
    ids = json.loads(proc.stdout.strip().splitlines()[-1])
    assert ids == list(text.encode())
    ours = job.bind(list(params.items())).infer(np.array(ids, np.int64), all_logits=True)
    np.testing.assert_allclose(np.load(tmp_path / "logits.npy"), ours, rtol=1e-3, atol=1e-3)
