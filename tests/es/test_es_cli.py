"""`fucina es-spirals` and `fucina bench es` as commands (argument handling, output shape)."""
import argparse
import json

import pytest

from pipeline.commands import es_spirals
from pipeline.errors import UserError


def _run(argv, capsys):
    parser = argparse.ArgumentParser()
    es_spirals.add_arguments(parser)
    code = es_spirals.run(parser.parse_args(argv))
    return code, capsys.readouterr()


def test_es_spirals_json_output(capsys, tmp_path):
    code, out = _run(["--inprocess", "--population", "8", "--max-iterations", "3", "--json", "--out",
                      str(tmp_path)], capsys)
    result = json.loads(out.out)
    assert code == 0 and result["iterations"] == 3 and len(result["sha256"]) == 64
    assert result["member_evals_per_s"] > 0 and 0 <= result["accuracy"] <= 1
    assert "es-spirals: in-process" in out.err  # the config is printed at start
    assert (tmp_path / "checkpoint-step-3" / "trainer_state.json").exists()


def test_es_spirals_text_output_and_bad_flags(capsys, tmp_path):
    code, out = _run(["--inprocess", "--population", "8", "--max-iterations", "2", "--out", str(tmp_path)], capsys)
    assert code == 0 and "member-evals/s" in out.out and "sha256 " in out.out
    with pytest.raises(UserError, match="already holds checkpoints"):
        _run(["--inprocess", "--population", "8", "--out", str(tmp_path)], capsys)
    with pytest.raises(UserError, match="--workers 0 needs"):
        _run(["--workers", "0"], capsys)
    with pytest.raises(UserError, match="--remote-workers needs --bind"):
        _run(["--remote-workers", "1"], capsys)
    with pytest.raises(UserError, match="give tcp://HOST:PORT"):
        _run(["--bind", "ipc:///tmp/x"], capsys)
    with pytest.raises(UserError, match="population must be even"):
        _run(["--inprocess", "--population", "7"], capsys)


def test_bench_es_module_shape():
    from pipeline.bench import es as bench_es
    assert bench_es.NAME == "es"
    parser = argparse.ArgumentParser()
    bench_es.add_arguments(parser)
    args = parser.parse_args([])
    assert args.iterations > 0 and args.population == 128


def test_bench_es_finetune_rows_smoke(capsys):
    """A tiny `fucina bench es --cases finetune` on the fixture: the rows exist and the timings are positive."""
    from pipeline.cli import main
    rc = main(["bench", "es", "--cases", "finetune", "--finetune-population", "4", "--finetune-batch", "1",
               "--member-batch", "2", "--finetune-workers", "0", "--finetune-new-tokens", "2", "--repeat", "1",
               "--json"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    import json
    rows = {r["case"]: r for r in json.loads(out.out)["results"]}
    assert set(rows) == {"es-finetune/nll-batched-w0", "es-finetune/generate-batched-w0",
                         "es-finetune/nll-lowrank-w0", "es-finetune/generate-lowrank-w0"}
    assert all(r["ms"] > 0 and r["baselines"]["one_at_a_time"] > 0 and r["baselines"]["plain_batched_forward"] > 0
               for r in rows.values())
