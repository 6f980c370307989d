"""Every ```python block in README.md and docs/*.md runs, so the docs cannot rot.

Blocks of one page run in order in one namespace, inside a temporary working
directory. A block whose first line is `# not-run` is shown but not executed
(use it only for fragments that need a model file the reader brings).
"""
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks(page):
    return [b for b in BLOCK.findall(page.read_text()) if not b.lstrip().startswith("# not-run")]


@pytest.mark.parametrize("page", [p for p in PAGES if python_blocks(p)], ids=lambda p: p.name)
def test_doc_snippets_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ns = {"__name__": f"doc_{page.stem}"}
    for i, block in enumerate(python_blocks(page)):
        code = compile(block, f"{page.name}[block {i}]", "exec")
        exec(code, ns)
