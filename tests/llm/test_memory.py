"""What inference holds in memory and what it imports (docs/models.md, "Memory").

Both run in a fresh subprocess, so nothing an earlier test imported or allocated counts. The resident-memory
test measures memory, not time: a K-quant model a few tens of MB large is generated once into a temporary
directory, and a prompt plus a few decoded tokens may grow the process by the file's bytes (the mapped weights,
every page touched by decode), the prompt tiles it reports and a fixed allowance for activations, KV cache and
allocator slack: a second resident copy of the weights (a dequantized or copied-out matrix) or prompt activations
of the vocabulary's width for every position would pass the bound.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "qwen3-tied-q4_k_s.gguf"
HEAVY = ("torch", "matplotlib", "scipy", "pandas", "transformers", "peft", "ray", "zmq", "llama_cpp")


def _run(code: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_generate_imports_nothing_it_does_not_run():
    """`fucina generate` imports its own command module, not every command's (pipeline/cli.py), and nothing of
    training's, plotting's or the multiprocess runtime's."""
    mods = _run("import json, sys\n"
                "from pipeline.cli import main\n"
                f"assert main(['generate', '--model', {str(FIXTURE)!r}, '--prompt', 'hello', '--max-tokens', '2',"
                " '--threads', '1']) == 0\n"
                "print(json.dumps(sorted(sys.modules)))")
    roots = {m.split(".")[0] for m in mods}
    assert not roots & set(HEAVY), sorted(roots & set(HEAVY))
    others = [m for m in mods if m.startswith(("pipeline.es", "pipeline.jobs", "pipeline.finetune", "pipeline.runtime",
                                               "pipeline.commands.")) and m != "pipeline.commands.generate"
              and m != "pipeline.commands._args"]
    assert not others, others
    assert "pipeline.models.decoder" in mods and "numba" in roots  # the run did load and run the model


_MEASURE = """
import gc, json, sys
import numpy as np
from pipeline.llm.generate import LoadedModel, generate
from pipeline.llm.quants import FrozenWeight
from pipeline.threads import pin_threads

def status():
    out = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    return out

def run(path):
    model = LoadedModel(path).model
    ids = (np.arange(64) * 7919 + 13) % model.config.vocab_size
    out = list(generate(model, ids, 8))
    tiles = sum(w.tile_bytes for w in model.named_weights().values() if isinstance(w, FrozenWeight))
    return len(out), tiles

pin_threads(2)
run(sys.argv[1])  # a small model of the same formats: every kernel the measured run takes is loaded before base
gc.collect()
base = status()["VmRSS"]
try:
    open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS (else the warm-up's peak, about base)
except OSError:
    pass
n, tiles = run(sys.argv[2])
print(json.dumps({"base": base, "peak": status()["VmHWM"], "tiles": tiles, "tokens": n}))
"""


def _k_quant_model(path: Path, tmp: Path, large: bool = True):
    """A qwen3 GGUF in Q4_K with the fixtures' tokenizer: 6 layers, hidden 1024, ffn 2816 (about 37 MB), or
    (large False) one small layer of the same formats, whose run loads every kernel the large one runs."""
    sys.path.insert(0, str(ROOT / "tools"))
    import make_tiny_model as mk
    from pipeline.llm.gguf_write import transcode
    shape = (mk.Shape(hidden=1024, layers=6, heads=8, kv_heads=2, head_dim=128, ffn=2816, tied=True, vocab=512)
             if large else mk.Shape(hidden=256, layers=1, heads=2, kv_heads=1, head_dim=128, ffn=512, tied=True,
                                    vocab=512))
    rng = np.random.default_rng(0)
    weights = {name: (rng.standard_normal(a.shape, np.float32) * (0.02 if a.ndim == 2 else 0.1) + (a.ndim == 1))
               .astype(np.float32) for name, a in _shapes(mk, shape).items()}
    f32 = tmp / f"{path.stem}-f32.gguf"
    mk.write_gguf(f32, shape, weights=weights, name="memory-test")
    transcode(f32, path, "q4_k")
    f32.unlink()


def _shapes(mk, shape):
    """make_weights' tensors at a tiny scale of every dimension we do not care about: names and shapes only."""
    qd, kvd, h = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.hidden
    out = {"token_embd.weight": np.empty((shape.vocab, h)), "output_norm.weight": np.empty(h)}
    for i in range(shape.layers):
        p = f"blk.{i}."
        out |= {p + "attn_norm.weight": np.empty(h), p + "ffn_norm.weight": np.empty(h),
                p + "attn_q_norm.weight": np.empty(shape.head_dim), p + "attn_k_norm.weight": np.empty(shape.head_dim),
                p + "attn_q.weight": np.empty((qd, h)), p + "attn_k.weight": np.empty((kvd, h)),
                p + "attn_v.weight": np.empty((kvd, h)), p + "attn_output.weight": np.empty((h, qd)),
                p + "ffn_gate.weight": np.empty((shape.ffn, h)), p + "ffn_up.weight": np.empty((shape.ffn, h)),
                p + "ffn_down.weight": np.empty((h, shape.ffn))}
    return out


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads VmRSS/VmHWM from /proc")
def test_a_prompt_and_decode_hold_one_resident_form_of_the_weights(tmp_path):
    model, warm = tmp_path / "memory-q4_k.gguf", tmp_path / "warm-q4_k.gguf"
    _k_quant_model(model, tmp_path)
    _k_quant_model(warm, tmp_path, large=False)
    size = model.stat().st_size
    assert size > 30 << 20
    got = _run(_MEASURE.replace("sys.argv[1]", repr(str(warm))).replace("sys.argv[2]", repr(str(model))))
    grew, allowance = got["peak"] - got["base"], 24 << 20
    print(f"grew {grew / 2**20:.1f} MB: file {size / 2**20:.1f}, tiles {got['tiles'] / 2**20:.1f}")
    assert got["tokens"] == 8 and got["tiles"] > size  # Q4_K tiles: 2560 bytes per 16 rows' 2304 of the file
    # decode read every weight: its mapped pages count (the measurement sees the weights at all)
    assert grew > size // 2, (grew, size)
    assert grew < size + got["tiles"] + allowance, (f"grew {grew / 2**20:.1f} MB; file {size / 2**20:.1f}, "
                                                   f"tiles {got['tiles'] / 2**20:.1f}")


def test_a_vocabulary_s_scores_are_one_f32_array_with_the_file_s_values(tmp_path):
    """Gemma's 262k SentencePiece scores were 262k Python floats in the metadata (8 MB): now one array.array('f')
    (pipeline/llm/gguf.py COMPACT_F32) that the tokenizer keeps as it is; short arrays stay lists."""
    from array import array

    import gguf
    from pipeline.llm.gguf import COMPACT_F32, GGUFFile, metadata_of
    from pipeline.llm.tokenizer import Tokenizer
    values = np.random.default_rng(0).standard_normal(COMPACT_F32 + 5).astype(np.float32)
    w = gguf.GGUFWriter(str(tmp_path / "v.gguf"), arch="llama")
    w.add_tokenizer_model("llama")
    w.add_token_list([f"<0x{i:02X}>" for i in range(256)] + [f"t{i}" for i in range(len(values) - 256)])
    w.add_token_scores(values.tolist())
    w.add_array("short.scores", [0.5, 0.25])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    gg = GGUFFile(tmp_path / "v.gguf")
    scores = gg.metadata["tokenizer.ggml.scores"]
    assert isinstance(scores, array) and scores.typecode == "f" and list(scores) == values.tolist()
    assert metadata_of(gg, "tokenizer.ggml.scores", "numbers") is scores
    assert gg.metadata["short.scores"] == [0.5, 0.25]
    assert Tokenizer.from_gguf(gg).scores is scores
