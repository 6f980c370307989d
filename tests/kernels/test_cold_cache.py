"""Bits must not depend on whether numba compiled a kernel just now or loaded
it from its cache: a fresh process with an empty cache and one with a warm
cache give identical cross-entropy gradients, two-pass and one-pass (frozen head),
and attention / RMSNorm gradients (fastmath reassociation once broke this, and
with it 1-process vs N-process equality)."""
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PROBE = """
import sys, numpy as np
from pipeline.kernels import rng
from pipeline.autograd import Tensor, cross_entropy, linear_cross_entropy, rms_norm, attention
x = Tensor(rng.gaussian(1, (37, 64)), requires_grad=True)
w = Tensor(rng.gaussian(2, (384, 64)) * 0.1, requires_grad=True)
labels = (rng.at_values(3, range(37)) % 384).astype(np.int64)
linear_cross_entropy(x, w, labels).backward()
logits = Tensor(rng.gaussian(4, (37, 384)), requires_grad=True)
cross_entropy(logits, labels).backward()
h = Tensor(rng.gaussian(5, (2, 70, 4, 16)), requires_grad=True)
(attention(h, h, h, causal=True) * rms_norm(h, None, 1e-6)).sum().backward()
xf = Tensor(rng.gaussian(6, (37, 64)), requires_grad=True)  # a frozen head: the one-pass pipeline/kernels/headce.py
frozen = linear_cross_entropy(xf, Tensor(rng.gaussian(7, (1500, 64)) * 0.3), labels, label_smoothing=0.1)
frozen.backward()
np.savez(sys.argv[1], gx=x.grad, gw=w.grad, gl=logits.grad, gh=h.grad, gf=xf.grad, lf=frozen.data)
"""


# The fine-tune step's own kernels: SwiGLU / SiLU, RoPE, and the tiled GEMMs of the two-pass head.
FINETUNE_PROBE = """
import sys, numpy as np
from pipeline.kernels import rng
from pipeline.autograd import Tensor, rope, silu, linear_cross_entropy
from pipeline.models.decoder import swiglu
a = Tensor(rng.gaussian(1, (37, 3001)) * 4, requires_grad=True)
b = Tensor(rng.gaussian(2, (37, 3001)), requires_grad=True)
(swiglu(a, b) * silu(b)).sum().backward()
h = Tensor(rng.gaussian(5, (1, 70, 4, 16)), requires_grad=True)
(rope(h, np.arange(70), 1e6) * h).sum().backward()
x = Tensor(rng.gaussian(3, (40, 512)), requires_grad=True)
labels = (rng.at_values(3, range(40)) % 3333).astype(np.int64)
labels[:7] = -100
linear_cross_entropy(x, rng.gaussian(4, (3333, 512)) * 0.1, labels).backward()
np.savez(sys.argv[1], ga=a.grad, gb=b.grad, gh=h.grad, gx=x.grad)
"""


def _same_bits_cold_and_warm(tmp_path, probe):
    """Run `probe` (which saves arrays to argv[1]) against an empty numba cache, then
    against the cache it filled; every array must be bitwise equal."""
    tree = tmp_path / "tree"
    shutil.copytree(ROOT / "pipeline", tree / "pipeline", ignore=shutil.ignore_patterns("__pycache__"))
    env = dict(os.environ, PYTHONPATH=str(tree), NUMBA_CACHE_DIR=str(tmp_path / "numba_cache"))
    outs = []
    for name in ("cold", "warm"):
        out = tmp_path / f"{name}.npz"
        r = subprocess.run([sys.executable, "-c", probe, str(out)], cwd=tree, env=env, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        outs.append(np.load(out))
    for k in outs[0]:
        assert np.array_equal(outs[0][k], outs[1][k]), k


def test_cold_and_warm_numba_cache_give_identical_bits(tmp_path):
    _same_bits_cold_and_warm(tmp_path, PROBE)


@pytest.mark.slow
def test_cold_and_warm_cache_identical_for_finetune_kernels(tmp_path):
    _same_bits_cold_and_warm(tmp_path, FINETUNE_PROBE)


EDIT_PROBE = """
import numba, numpy as np
from pipeline.kernels import qint
raw = np.zeros((2, 18), np.uint8)
raw[:, 0:2] = np.frombuffer(np.float16(1.0).tobytes(), np.uint8)  # d = 1, every nibble 0: weights -8
print(qint.matmul_t_many([(2, raw)], np.ones((1, 32), np.float32))[0][0, 0], numba.config.CACHE_DIR)
"""


def test_an_edit_to_an_inlined_helper_recompiles_its_callers(tmp_path):
    """numba revalidates a cached function by its own file only; qint.py's Q4_0 kernel inlines qblocks.py's
    idot_q4_0, so editing qblocks.py alone must still give new machine code: the cache directory is named by a
    digest of every pipeline/kernels/*.py (kernels/__init__.py), and the previous digest's directory is removed."""
    tree = tmp_path / "tree"
    shutil.copytree(ROOT / "pipeline", tree / "pipeline", ignore=shutil.ignore_patterns("__pycache__"))
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env["PYTHONPATH"] = str(tree)

    def run():
        r = subprocess.run([sys.executable, "-c", EDIT_PROBE], cwd=tree, env=env, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        value, cache = r.stdout.split()
        return float(value), pathlib.Path(cache)

    before, first_cache = run()
    assert abs(before + 8 * 32) < 0.1 and first_cache.parent == tree / "pipeline/kernels/__pycache__"  # x as Q8_0
    assert any(first_cache.rglob("*.nbi"))  # the kernels were cached there
    qblocks = tree / "pipeline" / "kernels" / "qblocks.py"
    source = qblocks.read_text()
    old = "h.b.sub(_nibbles(h, 2), h.bytes_const(8))"
    assert old in source
    qblocks.write_text(source.replace(old, "h.b.sub(_nibbles(h, 2), h.bytes_const(7))"))  # weights -7 now
    after, second_cache = run()
    assert abs(after + 7 * 32) < 0.1 and second_cache != first_cache and not first_cache.exists()
