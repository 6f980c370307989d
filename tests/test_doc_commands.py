"""Every shell command in README.md and docs/*.md runs as written, so the documented commands cannot rot.

A page's ```bash blocks run line by line (`bash -c`, in page order, stdin closed, one directory per page:
a later block may use what an earlier one made) in a fresh directory laid out like the repository root a
reader works in: `.venv` (the venv running these tests), `Procfile`, `scripts/`, and
the input files the docs ask the reader to bring (M.gguf and model.gguf: a small Qwen3 GGUF; base-f16.gguf:
an F16 one with 256-wide rows; pairs.jsonl). The venv is NOT activated: `fucina` resolves to
.venv/bin/fucina (the docs' convention, stated in the README) and nothing else of the venv is on PATH, so a
Procfile line that needs the venv's Python without naming it fails here as it fails for a reader.

Conventions a line's comment may carry: "(exit N)" - the status it must end with (else 0);
"(another terminal)" - it runs beside the line before it, once that line's run has written its run.json.
A page that makes a fresh venv (`python3 -m venv .venv ...`) runs in a copy of the repository's files
instead, with no venv until that line makes one (in the shortened runs, with the compiled kernels: see _sandbox).

Pages holding a long command (training runs, benchmarks, a fresh venv) run whole in the `slow` suite with their
long training runs shortened (`shorten`: a `fucina pretrain` or `fucina launch lm` line runs a tenth of its
--steps, at least 8, a resume at least 60, a pretrain line a quarter of its --batch-tokens, at least 1024;
`launch lm` without --steps, and the Procfile's lm through CONFIG, 30 steps; a `fucina es-finetune` line a tenth
of 40 or more --iterations, at least 4; a `fucina spirals` line a tenth of its --steps, at least 20, and 200
without --steps), and exactly as written in the `soak` suite (`pytest -m soak`); the default suite runs each
page's lines up to its first long one, and the documented honcho command. Never run: llama-cli (an interactive
program outside Fucina), and the README's test-suite command, which is .ci/run's first step verbatim (checked
here).
"""
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
VENV_BIN = pathlib.Path(sys.prefix) / "bin"

LONG = re.compile(r"fucina (launch lm|pretrain|tokenizer train|sft|finetune|es-finetune|bench"
                  r"|spirals(?! --optimizer \S+ --steps))"
                  r"|honcho_run\.sh lm|python3 -m venv")
NEVER_RUN = re.compile(r"^llama-cli ")
TEST_SUITE = re.compile(r"pytest")
PAIRS = [("Say hello.", "Ahoy, matey!"), ("Name a colour.", "Blue as the deep sea, arr."),
         ("Count to three.", "One, two, three, me hearty."), ("What is rain?", "Water from the sky, matey."),
         ("Greet a friend.", "Ahoy there, shipmate!"), ("Where is north?", "Where the star points, arr."),
         ("Give me a number.", "Seven, like the seas."), ("Say goodbye.", "Fair winds, matey!")]


def commands(body):
    """The command lines of a bash block: comments and blank lines dropped, `\\` continuations joined."""
    out, pending = [], ""
    for line in body.splitlines():
        if pending:
            line = pending + " " + line.strip()
            pending = ""
        if line.rstrip().endswith("\\"):
            pending = line.rstrip()[:-1]
            continue
        if line.strip() and not line.lstrip().startswith("#"):
            out.append(line.strip())
    return out


def page_commands(page):
    """The page's command lines to run, in order (the never-run ones left out)."""
    return [c for lang, body in FENCE.findall(page.read_text()) if lang == "bash" for c in commands(body)
            if not (TEST_SUITE.search(c) or NEVER_RUN.search(c))]


PAGE_LINES = {page.name: lines for page in PAGES if (lines := page_commands(page))}


def _comment(line):
    m = re.search(r"\s#\s(.*)$", line)
    return m.group(1) if m else ""


def _expected_status(line):
    m = re.search(r"\(exit (\d+)\)", _comment(line))
    return int(m.group(1)) if m else 0


def _sandbox(workdir, fresh_clone, warm_kernels=False):
    """A directory laid out like the repository root, and the environment of a shell with no venv active.
    `warm_kernels` (a fresh clone in the shortened runs): numba's cached kernels come along (index + object
    files; the sources keep their mtimes, so the cache stays valid), the compile a new clone pays being
    test_cold_cache's subject, not this page's."""
    if fresh_clone:  # the repository's files only (tracked or not ignored): no venv, no runs, nothing built
        files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                               capture_output=True, check=True).stdout
        for rel in filter(None, files.decode().split("\0")):
            if (ROOT / rel).is_file():
                (workdir / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / rel, workdir / rel)
        cached = [p for p in (ROOT / "pipeline").rglob("__pycache__/*") if p.suffix in (".nbi", ".nbc")]
        for path in cached if warm_kernels else []:
            (workdir / path.relative_to(ROOT)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, workdir / path.relative_to(ROOT))
    else:
        if not (VENV_BIN / "fucina").exists():
            pytest.skip(f"the tests do not run from a venv holding fucina ({sys.prefix})")
        (workdir / ".venv").symlink_to(sys.prefix)
        for name in ("Procfile", "scripts"):
            (workdir / name).symlink_to(ROOT / name)
        (workdir / "bin").mkdir()
        (workdir / "bin" / "fucina").symlink_to(VENV_BIN / "fucina")
    path = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p and not p.startswith(sys.prefix)]
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME", "PYTHON")}
    env["PATH"] = os.pathsep.join([str(workdir / "bin")] + path)
    return env


def _inputs(workdir, lines):
    """The files the docs ask the reader to bring, made for the lines that name them."""
    text = " ".join(lines)
    for name in ("M.gguf", "model.gguf"):
        if re.search(rf"(?<![\w/-]){re.escape(name)}", text):
            shutil.copy(ROOT / "tests" / "fixtures" / "qwen3-mini-f32.gguf", workdir / name)
    if "base-f16.gguf" in text:
        from test_export_fixtures import write_tiny_qwen3
        write_tiny_qwen3(workdir / "base-f16.gguf", dtype="f16")
    if "pairs.jsonl" in text:
        import json
        (workdir / "pairs.jsonl").write_text(
            "".join(json.dumps({"instruction": q, "response": a}) + "\n" for q, a in PAIRS))


def _start(line, cwd, env):
    return subprocess.Popen(["bash", "-c", line], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc, line, timeout):
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"`{line}` still running after {timeout} s:\n{out[-3000:]}")
    assert proc.returncode == _expected_status(line), \
        f"`{line}` exited {proc.returncode}, expected {_expected_status(line)}:\n{out[-3000:]}"
    return out


def _wait_for_run_json(cwd, since, proc, timeout=900):
    t_end = time.time() + timeout
    while time.time() < t_end and proc.poll() is None:
        if any(p.stat().st_mtime >= since for p in pathlib.Path(cwd).glob("runs/*/run.json")):
            return
        time.sleep(0.5)


SHORTEN = re.compile(r"fucina (pretrain|launch lm|es-finetune|spirals)\b")
SHORT_ES_ITERATIONS = 4  # an es-finetune line without --iterations (its default is 40)
SHORT_LM_STEPS = 30
SHORT_SPIRALS_STEPS = 200  # a spirals line without --steps (its default is 2000): the resume gate is the same


def shorten(line):
    """The line with its training run cut to a tenth (at least 8 steps; `launch lm` without --steps: 30) and its
    --checkpoint-every with it (an es-finetune line: --iterations of 40 or more to a tenth, at least 4; without
    it, 4); a trailing comment is kept after the flags. A command naming a pretrain run's
    `checkpoint-step-N` names step N/10 instead (the shortened run's checkpoint). Other lines are as they are."""
    if not SHORTEN.search(line):
        return re.sub(r"(runs/pretrain-\S*/checkpoint-step-)(\d+)0\b", r"\1\2", line) \
            if line.startswith("fucina ") and "runs/pretrain-" in line else line
    code, sep, comment = line.partition(" # ")
    if "fucina spirals" in code:  # every recipe's bit-exact resume gate at a tenth of the steps
        m = re.search(r"--steps (\d+)", code)
        if not m:
            return f"{code.rstrip()} --steps {SHORT_SPIRALS_STEPS}" + sep + comment
        return f"{code[:m.start()]}--steps {max(20, int(m.group(1)) // 10)}{code[m.end():]}" + sep + comment
    if "es-finetune" in code:  # --iterations is the total target: a resume's tenth goes on past the first run's
        m = re.search(r"--iterations (\d+)", code)
        if not m:
            return f"{code.rstrip()} --iterations {SHORT_ES_ITERATIONS}" + sep + comment
        n = int(m.group(1))
        return f"{code[:m.start()]}--iterations {max(SHORT_ES_ITERATIONS, n // 10) if n >= 40 else n}{code[m.end():]}" \
            + sep + comment
    m = re.search(r"--steps (\d+)", code)
    if m:
        floor = 2 * SHORT_LM_STEPS if "--resume" in code else 8  # a resume goes on past the shortened first run
        code = f"{code[:m.start()]}--steps {max(floor, int(m.group(1)) // 10)}{code[m.end():]}"
    elif "launch lm" in code:
        code = f"{code.rstrip()} --steps {SHORT_LM_STEPS}"
    code = re.sub(r"--checkpoint-every (\d+)", lambda c: f"--checkpoint-every {max(1, int(c.group(1)) // 10)}", code)
    if "fucina pretrain" in code:  # d4's 256-token windows: 1024 tokens still split into 2 micro-batches of them
        code = re.sub(r"--batch-tokens (\d+)", lambda c: f"--batch-tokens {max(1024, int(c.group(1)) // 4)}", code)
    return code + sep + comment


def run_block(workdir, lines, timeout=3600, short=False):
    fresh = any(line.startswith("python3 -m venv") for line in lines)
    env = _sandbox(workdir, fresh, warm_kernels=short)
    if short:  # the Procfile's scheduler reads its job fields from CONFIG (scripts/honcho_run.sh lm)
        (workdir / "short-lm.toml").write_text(f"steps = {SHORT_LM_STEPS}\n")
        env["CONFIG"] = str(workdir / "short-lm.toml")
        lines = [shorten(line) for line in lines]
    _inputs(workdir, lines)
    outputs, i = {}, 0
    while i < len(lines):
        line, nxt = lines[i], lines[i + 1] if i + 1 < len(lines) else ""
        started, proc = time.time(), _start(line, workdir, env)
        if "(another terminal)" in _comment(nxt):
            _wait_for_run_json(workdir, started, proc)
            outputs[nxt] = _finish(_start(nxt, workdir, env), nxt, timeout)
            i += 1
        outputs[line] = _finish(proc, line, timeout)
        i += 1
    return outputs


@pytest.fixture
def sandbox():
    """A fresh directory with a short path: ipc:// socket paths (RUN_DIR/*.sock) must stay under ~100 chars."""
    path = pathlib.Path(tempfile.mkdtemp(prefix="fucina-docs-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _fast_prefix(lines):
    prefix = []
    for line in lines:
        if LONG.search(line):
            break
        prefix.append(line)
    return prefix


@pytest.mark.parametrize("page", [name for name, lines in PAGE_LINES.items() if _fast_prefix(lines)])
def test_documented_commands_up_to_the_first_long_one(page, sandbox):
    run_block(sandbox, _fast_prefix(PAGE_LINES[page]))


def test_the_procfile_runs_under_honcho_as_documented(sandbox):
    """As pipeline.md says, from the repository root with the venv not activated (the Procfile names its
    Python): every role starts, the run finishes, the monitor line shows its steps."""
    lines = [c for c in PAGE_LINES["pipeline.md"] if "honcho start" in c]
    assert lines, "pipeline.md shows no honcho command"
    out = run_block(sandbox, lines, timeout=600)[lines[0]]
    assert '"event": "run_finished"' in out and '"kind": "metrics"' in out, out[-3000:]
    assert (sandbox / "runs" / "p" / "summary.json").is_file()


LONG_PAGES = [name for name, lines in PAGE_LINES.items() if any(LONG.search(c) for c in lines)]


@pytest.mark.slow
@pytest.mark.parametrize("page", LONG_PAGES)
def test_documented_commands_all_of_them_shortened(page, sandbox):
    _run_whole_page(page, sandbox, short=True)


@pytest.mark.soak
@pytest.mark.parametrize("page", LONG_PAGES)
def test_documented_commands_all_of_them_as_written(page, sandbox):
    _run_whole_page(page, sandbox, short=False)


def test_shorten_cuts_training_runs_only():
    assert shorten("fucina pretrain --preset d4 --steps 160 --x 1") == "fucina pretrain --preset d4 --steps 16 --x 1"
    assert shorten("fucina pretrain --steps 160 --batch-tokens 4096 --micro-batches 2") == \
        "fucina pretrain --steps 16 --batch-tokens 1024 --micro-batches 2"
    assert shorten("fucina launch lm   # ~3-5 min") == f"fucina launch lm --steps {SHORT_LM_STEPS} # ~3-5 min"
    resumed = shorten("fucina launch lm --resume r --steps 600   # on")
    assert resumed == f"fucina launch lm --resume r --steps {2 * SHORT_LM_STEPS}   # on"
    assert shorten("fucina finetune --steps 30") == "fucina finetune --steps 30"
    assert shorten("fucina pretrain --steps 120 --checkpoint-every 40 --x 1") == \
        "fucina pretrain --steps 12 --checkpoint-every 4 --x 1"
    assert shorten("fucina export-gguf --from-checkpoint runs/pretrain-latest/checkpoint-step-40 --out step-40.gguf") \
        == "fucina export-gguf --from-checkpoint runs/pretrain-latest/checkpoint-step-4 --out step-40.gguf"
    assert shorten("fucina generate --model step-40.gguf") == "fucina generate --model step-40.gguf"
    assert shorten("fucina es-finetune --model m --iterations 200 --save s") == \
        "fucina es-finetune --model m --iterations 20 --save s"
    assert shorten("fucina es-finetune --model m --iterations 6") == "fucina es-finetune --model m --iterations 6"
    assert shorten("fucina spirals --json   # j") == f"fucina spirals --json --steps {SHORT_SPIRALS_STEPS} # j"
    assert shorten("fucina spirals --optimizer adamw --steps 400") == "fucina spirals --optimizer adamw --steps 40"
    assert shorten("fucina es-finetune --model m --shuffle   # c") == \
        f"fucina es-finetune --model m --shuffle --iterations {SHORT_ES_ITERATIONS} # c"


def _run_whole_page(page, sandbox, short):
    lines = PAGE_LINES[page]
    run_block(sandbox, lines, short=short)
    if sum("launch lm" in line for line in lines) >= 2:  # "latest" had two runs to choose from, and chose the newest
        runs = sorted(p.name for p in (sandbox / "runs").glob("lm-2*") if not p.is_symlink())  # lm-<time>
        assert len(runs) >= 2 and os.readlink(sandbox / "runs" / "lm-latest") == runs[-1]


def test_the_readme_test_command_is_the_first_thing_ci_runs():
    readme = [c for b in FENCE.findall((ROOT / "README.md").read_text()) if b[0] == "bash"
              for c in commands(b[1]) if TEST_SUITE.search(c)]
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.lstrip().startswith("#")]
    first_command = next(line for line in ci if line.startswith("python3 "))
    assert readme == [first_command]


def test_commands_outside_bash_blocks_are_marked_as_not_run():
    """A block that is not bash (a synopsis, a transcript) must say so (```text), never look runnable."""
    for page in PAGES:
        for lang, body in FENCE.findall(page.read_text()):
            if lang == "":
                assert not re.search(r"^(fucina |\.venv/bin/|python -m |scripts/\S+\.sh)", body, re.M), \
                    f"{page.name}: an unlabelled block holds commands; label it ```bash (run) or ```text:\n{body}"


def test_every_page_with_commands_is_collected():
    assert set(PAGE_LINES) >= {"README.md", "pipeline.md", "models.md", "finetune.md", "export.md", "spirals.md"}
