"""Every `fucina ... --help` states each default once, marks required flags, names only files that exist;
bad flags and wrong paths are answered by the subcommand that got them."""
import argparse
import importlib.metadata
import pathlib
import re

import pytest

from pipeline.cli import build_parser, main

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _walk(parser, name="fucina"):
    """(name, parser) for the top-level parser and every (sub)subcommand under it."""
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _walk(sub, f"{name} {sub_name}")


PARSERS = dict(_walk(build_parser()))


def _flag_helps(parser):
    formatter = parser._get_formatter()
    for action in parser._actions:
        if action.option_strings and action.help is not argparse.SUPPRESS:
            yield action, formatter._expand_help(action)


def test_every_subcommand_is_walked():
    assert {"fucina generate", "fucina launch lm", "fucina launch spirals", "fucina bench ops"} <= set(PARSERS)


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_help_states_one_default_per_flag_and_marks_required_flags(name):
    parser = PARSERS[name]
    usage = parser.format_usage()
    for action, text in _flag_helps(parser):
        flag = action.option_strings[-1]
        assert len(re.findall(r"\bdefault", text, re.I)) <= 1, f"{name} {flag}: {text!r}"
        assert "(default: None)" not in text and "(default: False)" not in text, f"{name} {flag}: {text!r}"
        if re.search(r"\brequired\b", text):
            assert action.required, f"{name} {flag} says it is required but argparse does not enforce it"
        if action.required:
            assert flag in usage and f"[{flag}" not in usage, f"{name} {flag} is required, usage shows it optional"


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_help_names_only_files_in_the_repo(name):
    text = PARSERS[name].format_help()
    assert "DESIGN.md" not in text
    for ref in re.findall(r"[\w./-]+\.md\b", text):
        assert (ROOT / ref).is_file(), f"{name} --help points at {ref}, which is not in the repository"


def test_docs_name_no_file_outside_the_repo():
    for page in [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md")):
        assert "DESIGN.md" not in page.read_text(), page.name


def test_subcommand_lists_say_what_each_choice_is():
    for name, parser in PARSERS.items():
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for choice in action._choices_actions:
                    assert choice.help and choice.help != choice.dest, f"{name} {choice.dest}: help {choice.help!r}"


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"fucina {importlib.metadata.version('fucina')}"


@pytest.mark.parametrize("argv, prog", [
    (["plot", "RUN_DIR", "--bogus"], "fucina plot"),
    (["launch", "spirals", "--bogus", "1"], "fucina launch spirals"),
    (["bench", "ops", "--bogus"], "fucina bench ops"),
])
def test_unknown_flag_shows_the_subcommands_usage(argv, prog, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: {prog} ") and f"{prog}: error: unrecognized arguments: " in err


@pytest.mark.parametrize("argv, what", [
    (["generate", "--prompt", "x", "--model", "{dir}"], "GGUF"),
    (["eval-logits", "--text", "x", "--model", "{dir}"], "GGUF"),
    (["chat", "--model", "{dir}"], "GGUF"),
    (["finetune", "--model", "{dir}"], "GGUF"),
    (["es-finetune", "--model", "{dir}"], "GGUF"),
    (["finetune", "--model", "{file}", "--data", "{dir}"], "JSONL"),
    (["es-finetune", "--model", "{file}", "--data", "{dir}"], "JSONL"),
])
def test_a_directory_where_a_file_is_expected_is_one_error_line(argv, what, tmp_path, capsys):
    (tmp_path / "m.gguf").write_bytes(b"")
    argv = [a.format(dir=tmp_path, file=tmp_path / "m.gguf") for a in argv]
    assert main(argv) == 2
    flag = argv[argv.index(str(tmp_path)) - 1]
    assert capsys.readouterr().err == f"fucina {argv[0]}: error: {flag} {tmp_path} is a directory, not a {what} file\n"


def test_a_missing_file_is_named_as_missing(tmp_path, capsys):
    assert main(["finetune", "--model", str(tmp_path / "absent.gguf")]) == 2
    assert capsys.readouterr().err == f"fucina finetune: error: --model {tmp_path / 'absent.gguf'}: no such file\n"


def test_runs_started_in_the_same_second_get_their_own_directories(tmp_path, monkeypatch):
    import time as _time

    from pipeline.commands._args import default_run_dir
    monkeypatch.setattr(_time, "strftime", lambda fmt: "20261201-120000")
    first = default_run_dir("finetune", root=str(tmp_path))
    import os as _os
    _os.makedirs(first)
    second = default_run_dir("finetune", root=str(tmp_path))
    _os.makedirs(second)
    assert (first, second, default_run_dir("finetune", root=str(tmp_path))) == (
        str(tmp_path / "finetune-20261201-120000"), str(tmp_path / "finetune-20261201-120000-2"),
        str(tmp_path / "finetune-20261201-120000-3"))
