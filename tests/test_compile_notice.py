"""The first-call notice: printed when numba compiles (its compile event fires only on a cache miss), never
when a kernel loads from numba's cache or is already compiled; one notice, progress lines, a closing count."""
import os
import subprocess
import sys
import textwrap

from numba import njit

from pipeline.cli import main
from pipeline import compile_notice as cn


def test_nested_compiles_count_once_with_progress_lines():
    lines, now = [], [0.0]
    notice = cn.CompileNotice(lines.append, clock=lambda: now[0])
    notice.on_start(None)
    notice.on_start(None)  # a kernel pulls in another: one outermost compile
    now[0] = 4.0
    notice.on_end(None)
    notice.on_end(None)
    now[0] = 5.0
    notice.on_start(None)
    now[0] = 12.0
    notice.on_end(None)  # 10 s after the notice: a progress line
    assert lines == [cn.MESSAGE, "  ... 2 kernels compiled, 11 s"]
    assert notice.count == 2 and notice.seconds == 11.0 and "compiled 2 kernel(s) in 11.0 s" in notice.summary()


def test_a_real_compile_is_announced_and_a_compiled_function_is_not():
    @njit
    def fresh(x):
        return x * 3 + 1

    lines = []
    with cn.compile_notice(lines.append) as notice:
        assert fresh(2) == 7
    assert lines[0] == cn.MESSAGE and notice.said and notice.count == 1 and lines[-1].startswith("compiled 1 ")
    lines.clear()
    with cn.compile_notice(lines.append) as notice:
        assert fresh(3) == 10  # this signature is compiled already
    assert lines == [] and not notice.said


PROBE = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[1])
    from pipeline.compile_notice import compile_notice
    lines = []
    with compile_notice(lines.append) as notice:
        import cached_kernel
        cached_kernel.twice(4)
    print(int(notice.said))
""")


def test_a_kernel_loaded_from_numbas_cache_is_not_announced(tmp_path):
    (tmp_path / "cached_kernel.py").write_text("from numba import njit\n\n\n@njit(cache=True)\n"
                                               "def twice(x):\n    return 2 * x\n")
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"))
    said = [subprocess.run([sys.executable, "-c", PROBE, str(tmp_path)], env=env, capture_output=True, text=True,
                           check=True).stdout.strip() for _ in range(2)]
    assert said == ["1", "0"]  # cold: compiled and said; warm: loaded from the cache, silent


def test_the_commands_run_under_the_notice(monkeypatch, capsys):
    import pipeline.cli as cli

    @njit
    def fresh(x):
        return x - 1

    build = cli.build_parser  # a command's run is bound at parse time: give eval-logits one that compiles
    monkeypatch.setattr(cli, "build_parser", lambda *a: _with_run(build(*a), "eval-logits", lambda args: fresh(1)))
    assert main(["eval-logits", "--model", __file__, "--tokens", "1"]) == 0
    err = capsys.readouterr().err
    assert cn.MESSAGE in err and "compiled 1 kernel(s)" in err
    assert main(["eval-logits", "--model", __file__, "--tokens", "1"]) == 0
    assert "compiling" not in capsys.readouterr().err


def _with_run(parser, command, run):
    for action in parser._subparsers._group_actions:
        action.choices[command].set_defaults(_run=run)
    return parser
