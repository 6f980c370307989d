"""What `pip install fucina` puts on sys.path: only its own top-level packages.

A top-level `kernels` package (our numba kernels until 2026-12-03) shadowed Hugging Face's `kernels`, which
transformers >= 5.25 imports: with Fucina installed, `from transformers import ...` failed for every user.
The kernels now live in pipeline/kernels; this pins the installed top-level names.
"""
import importlib.util
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
TOP_LEVEL = {"pipeline", "workers"}  # names no other distribution we meet installs


def test_the_packages_found_are_only_pipeline_and_workers():
    text = (ROOT / "pyproject.toml").read_text()
    include = re.search(r"^include = \[(.*)\]$", text, re.M)
    assert include, "pyproject.toml: [tool.setuptools.packages.find] include = [...] not found"
    assert {name.strip().strip('"').rstrip("*") for name in include.group(1).split(",")} == TOP_LEVEL
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    assert packages == TOP_LEVEL, f"top-level packages in the tree: {sorted(packages)}"


def test_kernels_is_not_ours():
    """`import kernels` finds Hugging Face's package when installed, never a directory of this tree."""
    spec = importlib.util.find_spec("kernels")
    if spec is not None and spec.origin:  # a venv may sit inside the tree (.venv/lib/.../site-packages/kernels)
        assert pathlib.Path(spec.origin).resolve().parent.parent != ROOT, spec.origin
    from pipeline.kernels import rng
    assert ROOT / "pipeline" / "kernels" in pathlib.Path(rng.__file__).resolve().parents
