"""`fucina bench optim` runs end to end (on tiny stand-in shapes; no timing assertions)."""
import argparse

import numba

import pytest

from pipeline.bench import optim as bench


def test_bench_rows_have_the_shared_shape(monkeypatch):
    monkeypatch.setattr(bench, "BLOCK", [("q_proj", (64, 32)), ("down_proj", (32, 96)), ("norm", (32,))])
    monkeypatch.setattr(bench, "EMBEDDING", [("embed_tokens", (300, 32))])
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--repeat", "1", "--threads", "1", "--no-torch", "--apollo-rank", "4"])
    try:
        rows = bench.run(args)
    finally:  # the bench pins numba to --threads; give the rest of the session its threads back
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    cases = [r["case"] for r in rows]
    assert cases == [f"{c}/{s}" for s in ("block", "embedding") for c in bench.CASES]
    for r in rows:
        assert r["ms"] > 0 and isinstance(r["baselines"], dict)
        elementwise = bench.BYTES_PER_ELEMENT[r["case"].split("/")[0]] is not None
        if elementwise or r["case"].endswith("/embedding"):
            assert r["gbps"] > 0 and r["baselines"]["triad"] > 0 and "of triad" in r["notes"]


def test_bench_rejects_unknown_cases():
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    with pytest.raises(Exception, match="unknown case"):
        bench.run(parser.parse_args(["--cases", "adamw,sgdx", "--no-torch"]))
