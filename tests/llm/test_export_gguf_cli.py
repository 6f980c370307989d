"""`fucina export-gguf --dtype` on the quick-start model's shapes: a target that converts nothing is refused
before anything is written, the report says what stayed at which type and why, and general.file_type only
ever names a type the file holds."""
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import LlamaFileType
from test_export_fixtures import write_tiny_qwen3

from pipeline.cli import main as fucina
from pipeline.jobs.lm import LMSpec
from pipeline.llm.gguf_write import is_matrix_weight, read_gguf

SPEC = LMSpec()  # the shapes `fucina launch lm` gives model.gguf by default (rows of 128 and 384)


@pytest.fixture(scope="module")
def quick_start_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("lm") / "model.gguf"
    return write_tiny_qwen3(path, hidden=SPEC.hidden, layers=SPEC.layers, heads=SPEC.heads, kv_heads=SPEC.kv_heads,
                            head_dim=SPEC.head_dim, ffn=SPEC.ffn, dtype=SPEC.gguf_dtype.lower(), tied=True)


def _run(argv, capsys):
    code = fucina(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("dtype", ["q4_k", "q5_k", "q6_k"])
def test_a_k_quant_that_converts_nothing_is_refused_and_writes_nothing(quick_start_model, tmp_path, capsys, dtype):
    assert SPEC.hidden % 256 and SPEC.ffn % 256  # the premise: no row of the quick-start model fits a K-quant block
    out = tmp_path / "q.gguf"
    code, _, err = _run(["export-gguf", "--from-gguf", str(quick_start_model), "--dtype", dtype, "--out", str(out)],
                        capsys)
    assert code == 2 and not out.exists() and not list(tmp_path.iterdir())
    assert f"--dtype {dtype}: no tensor of {quick_start_model} converts to {dtype.upper()}" in err
    assert f"row length {SPEC.hidden} is not a multiple of 256" in err and f"row length {SPEC.ffn} is not" in err
    # every 32-block target converts a 128-wide model; no 256-block (K-quant) one does
    assert "nothing written" in err
    assert "Targets that convert this file: f16, bf16, q4_0, q4_1, q5_0, q5_1, q8_0;" in err


def test_a_target_the_file_already_has_is_refused(quick_start_model, tmp_path, capsys):
    code, _, err = _run(["export-gguf", "--from-gguf", str(quick_start_model), "--dtype", "f32",
                         "--out", str(tmp_path / "same.gguf")], capsys)
    assert code == 2 and "kept: already the target type" in err and not (tmp_path / "same.gguf").exists()


def test_q8_0_quantizes_every_matrix_of_the_quick_start_model(quick_start_model, tmp_path, capsys):
    out = tmp_path / "q8.gguf"
    code, stdout, _ = _run(["export-gguf", "--from-gguf", str(quick_start_model), "--dtype", "q8_0",
                            "--out", str(out)], capsys)
    assert code == 0
    contents = read_gguf(out)
    matrices = [t for t in contents.tensors if is_matrix_weight(t)]
    assert matrices and all(t.qtype == QT.Q8_0 for t in matrices)
    others = len(contents.tensors) - len(matrices)
    assert (f"{len(matrices)} of {len(contents.tensors)} tensors converted to Q8_0; {others} kept: not a matrix "
            "weight" in stdout and stdout.rstrip().endswith("general.file_type MOSTLY_Q8_0"))
    assert int(contents.metadata["general.file_type"].value) == LlamaFileType.MOSTLY_Q8_0


def test_a_partial_conversion_lists_what_stayed_and_labels_a_type_the_file_holds(tmp_path, capsys):
    src = write_tiny_qwen3(tmp_path / "odd.gguf", dtype="f16", ffn=320)  # ffn_down rows are 320 long
    out = tmp_path / "q5.gguf"
    code, stdout, _ = _run(["export-gguf", "--from-gguf", str(src), "--dtype", "q5_k", "--out", str(out)], capsys)
    assert code == 0
    assert "  blk.0.ffn_down.weight: kept F16: row length 320 is not a multiple of 256 required by Q5_K" in stdout
    assert "2 kept F16: row length 320 is not a multiple of 256 required by Q5_K" in stdout  # one per layer
    contents = read_gguf(out)
    assert int(contents.metadata["general.file_type"].value) == LlamaFileType.MOSTLY_Q5_K_S
    assert QT.Q5_K in {t.qtype for t in contents.tensors}


# --- a full disk / a read-only run dir: one line, rc 2, nothing half-written (issue 32) -------------------
def test_a_file_size_limit_mid_write_is_one_error_and_leaves_nothing(quick_start_model, tmp_path, capsys):
    """RLIMIT_FSIZE makes the kernel refuse the write past 64 KB (EFBIG, as a full disk refuses with ENOSPC):
    the export is one error line, rc 2, and neither the output nor its temp file is left behind."""
    import resource
    import signal
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    out = out_dir / "copy.gguf"
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write then fails instead of killing us
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, hard))
    try:
        code, _, err = _run(["export-gguf", "--from-gguf", str(quick_start_model), "--out", str(out)], capsys)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_handler)
    assert quick_start_model.stat().st_size > 64 << 10  # the premise: the copy cannot fit
    assert code == 2 and list(out_dir.iterdir()) == []
    (line,) = err.strip().splitlines()  # the kernel's EFBIG, or the buffered writer's short-write report
    assert line.startswith(f"fucina export-gguf: error: {out}: cannot write the GGUF (") and \
        line.endswith("); nothing was written") and ("File too large" in line or "a short write" in line), line


def test_a_full_disk_mid_write_is_one_error_and_keeps_the_old_file(quick_start_model, tmp_path, capsys, monkeypatch):
    import errno
    from gguf import GGUFWriter
    out = tmp_path / "copy.gguf"
    out.write_bytes(b"the previous export")
    real = GGUFWriter.write_tensors_to_file

    def full(self, *args, **kwargs):
        real(self, *args, **kwargs)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(GGUFWriter, "write_tensors_to_file", full)
    code, _, err = _run(["export-gguf", "--from-gguf", str(quick_start_model), "--out", str(out)], capsys)
    assert code == 2 and "cannot write the GGUF (No space left on device); nothing was written" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy.gguf"] and out.read_bytes() == b"the previous export"


def test_an_os_error_from_any_command_is_one_line_rc_2(monkeypatch, capsys):
    """A resume into a read-only run dir fails where the run writes its first file (metrics.jsonl); as root a
    chmod does not stop that write (root passes permission checks), so the refusal is simulated at the write.
    Checked for real: a read-only bind mount gives `.../metrics.jsonl: Read-only file system`, rc 2."""
    import errno
    from pipeline.commands import export_gguf

    def read_only(args):
        raise OSError(errno.EROFS, "Read-only file system", "/runs/ft/metrics.jsonl")

    monkeypatch.setattr(export_gguf, "run", read_only)
    assert fucina(["export-gguf", "--from-gguf", "x", "--out", "y"]) == 2
    assert capsys.readouterr().err == "fucina export-gguf: error: /runs/ft/metrics.jsonl: Read-only file system\n"
