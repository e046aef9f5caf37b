"""spes.cli: a mistyped flag is answered with the flag it likely meant; the entry points' help shows a flag's default
only where it has one."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import usage_error
from spes.cli import ArgumentParser, DefaultsHelpFormatter, meant_flags, parser_flags, print_text

ROOT = Path(__file__).resolve().parents[1]


def test_a_mistyped_flag_is_refused_naming_the_flag_it_likely_meant(capsys: pytest.CaptureFixture[str]) -> None:
    """`--tokenfile x` got only "unrecognized arguments"; a subcommand's flag is found too (`hf export`'s)."""
    parser = ArgumentParser(prog="p")
    parser.add_argument("--token_file")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("export").add_argument("--checkpoint")
    assert parser_flags(parser) == {"-h", "--help", "--token_file", "-v", "--verbose", "--checkpoint"}
    for argv, said in [
        (["export", "--tokenfile", "t"], "unrecognized arguments: --tokenfile t; did you mean --token_file?"),
        (
            ["export", "--chekpoint=c", "--tokn_file=t"],
            "unrecognized arguments: --chekpoint=c --tokn_file=t; did you mean --checkpoint or --token_file?",
        ),
        (["export", "--zzz"], "unrecognized arguments: --zzz"),
        (
            ["--tokn_file=/a/long/path/to/the/token"],
            "unrecognized arguments: --tokn_file=/a/long/path/to/the/token; did you mean --token_file?",
        ),
    ]:
        with pytest.raises(SystemExit) as exited:
            parser.parse_args(argv)
        assert exited.value.code == 2
        assert capsys.readouterr().err.splitlines()[-1] == f"p: error: {said}", argv
    given = argparse.Namespace(token_file="default", kept=1)
    assert parser.parse_args(["--verbose"], given) is given and vars(given) == {
        "token_file": "default",
        "kept": 1,
        "verbose": True,
        "command": None,
    }
    assert meant_flags(["--verbos", "--verbse", "-x"], ["--verbose", "-v"]) == "; did you mean --verbose?"


def test_a_missing_required_argument_is_refused_naming_the_mistyped_flag_given_for_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """argparse refuses a missing required argument before it hands back the unknown words: `export --chekpoint c`
    was told only that --checkpoint is required, a flag the user believed given. A subcommand's own parser (of the
    same class: `add_subparsers` makes them so) names the words given after its name; a word after `--`, one with a
    space (a value to argparse), an abbreviation argparse takes, and a parser's config overrides are not named."""
    parser = ArgumentParser(prog="p")
    sub = parser.add_subparsers(dest="command", required=True)
    export = sub.add_parser("export")
    assert type(export) is ArgumentParser
    where = export.add_mutually_exclusive_group(required=True)
    where.add_argument("--checkpoint")
    where.add_argument("--run_dir")
    export.add_argument("--out", required=True)
    export.add_argument("--verbose", action="store_true")
    export.add_argument("names", nargs="*")
    group = "one of the arguments --checkpoint --run_dir is required"
    for argv, said in [
        (
            ["export", "--chekpoint", "c", "--out", "o"],
            f"{group} (--chekpoint is not a flag of this command; did you mean --checkpoint?)",
        ),
        (
            ["export", "--run_dir=r", "--ot=o", "--zzz", "--ot"],
            "the following arguments are required: --out (--ot and --zzz are not flags of this command; did you mean "
            "--out?)",
        ),
        (["export", "--out", "o", "--verb", "-x", "--", "--chekpoint"], group),  # an abbreviation; after `--`
        (["export", "--out", "o", "--chekpoint=my dir"], group),  # argparse takes it for a name
        (["export", "--out", "o"], group),
        (
            ["--chekpoint=c"],
            "the following arguments are required: command (--chekpoint is not a flag of this command; did you mean "
            "--checkpoint?)",
        ),
    ]:
        with pytest.raises(SystemExit) as exited:
            parser.parse_args(argv)
        assert exited.value.code == 2
        prog = "p export" if argv[0] == "export" else "p"
        assert capsys.readouterr().err.splitlines()[-1] == f"{prog}: error: {said}", argv
    overrides = ArgumentParser(prog="o", takes_overrides=True, allow_abbrev=False)
    overrides.add_argument("--config", required=True)
    with pytest.raises(SystemExit):  # `--model.d_model=8` and `--cofig=c` are overrides there; `--conf` is no flag
        overrides.parse_known_args(["--model.d_model=8", "--cofig=c", "--conf"])
    assert capsys.readouterr().err.splitlines()[-1] == (
        "o: error: the following arguments are required: --config (--conf is not a flag of this command; did you "
        "mean --config?)"
    )


def test_a_parser_that_takes_overrides_refuses_a_flag_no_override_looks_like(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """spes.upcycle and spes.preflight hand every unknown word to the config loader, which refused `--partiton` only
    as a malformed override: no override is written without `=value`, so such a word is a mistyped flag, unless the
    caller takes it (spes.preflight's `--resume`, as spes.train takes it)."""
    parser = ArgumentParser(prog="o", takes_overrides=True)
    parser.add_argument("--partition", action="store_true")
    parser.add_argument("--out")
    parsed, rest = parser.parse_known_args(["--model.d_model=8", "--part", "--resume", "--", "--x"])
    assert parsed.partition and rest == ["--model.d_model=8", "--resume", "--", "--x"]
    parser.refuse_unknown_flags(allowed=["--resume"])
    parser.parse_known_args(["--partiton", "--resume", "--ot", "o"])
    assert usage_error(capsys, parser.refuse_unknown_flags) == (
        "o: error: unrecognized arguments: --partiton --resume --ot; did you mean --partition or --out?"
    )


def test_help_shows_real_defaults_and_none_after_a_required_or_unset_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    parser = argparse.ArgumentParser(prog="p", formatter_class=DefaultsHelpFormatter)
    parser.add_argument("config", nargs="?", help="a YAML")
    parser.add_argument("--out", required=True, help="where to write")
    parser.add_argument("--limit", help="at most this many (default: all)")
    parser.add_argument("--size", type=int, default=4096, help="how many")
    parser.add_argument("--name", default="text", help="the field (%(default)s unless given)")
    parser.add_argument("--force", action="store_true", help="replace it")
    parser.add_argument("--seed", default=argparse.SUPPRESS, help="the seed")
    lines = [" ".join(line.split()) for line in parser.format_help().splitlines()]
    for shown in (
        "config a YAML",
        "--out OUT where to write",
        "--limit LIMIT at most this many (default: all)",
        "--size SIZE how many (default: 4096)",
        "--name NAME the field (text unless given)",
        "--force replace it (default: False)",
        "--seed SEED the seed",
    ):
        assert shown in lines, shown


def test_help_for_a_reader_that_stopped_reading_ends_quietly(tmp_path: Path) -> None:
    """`python -m spes.train --help | head` (or quitting `less`): the help is longer than a pipe's first write, and
    the rest met a closed pipe: `error: BrokenPipeError ...`, exit 6 and a traceback file, as for a bug of spes.
    argparse's entry points say nothing there; neither does spes.train now."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # NOTE: a reader gone before the first byte: every write meets a closed pipe
    try:
        done = subprocess.run(
            [sys.executable, "-m", "spes.train", "--help"],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path)},  # a traceback kept: not in /tmp
            timeout=60,
        )
    finally:
        os.close(write_end)
    assert (done.returncode, done.stderr) == (0, "")


def test_print_text_prints_it_and_points_a_closed_stdout_at_nothing(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """In process (the test above runs it in a child): the text as print writes it; on a closed pipe no error, and
    stdout's descriptor then writes to /dev/null, so the interpreter's flush at exit raises nothing either."""
    print_text("usage\nkeys")
    assert capsys.readouterr().out == "usage\nkeys\n"
    read_end, write_end = os.pipe()
    os.close(read_end)
    with capsys.disabled(), open(write_end, "w") as closed:  # noqa: PTH123  # a descriptor, not a path
        monkeypatch.setattr(sys, "stdout", closed)
        print_text("usage")  # its write meets the closed pipe
        assert os.write(write_end, b"more") == 4
        monkeypatch.undo()


def test_the_command_line_words_are_read_from_sys_argv_and_a_fresh_parser_has_none(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """argparse's own arguments reach it positionally too (`ArgumentParser("p")`); with no words given, the refusal
    reads the process's own (sys.argv past the program's name) for its hint; before any parse, no flag is unknown."""
    parser = ArgumentParser("p")
    parser.add_argument("--checkpoint", required=True)
    assert parser.prog == "p" and parser.unknown_flags() == []
    monkeypatch.setattr(sys, "argv", ["spes-x", "--chekpoint", "c"])
    assert usage_error(capsys, parser.parse_args) == (
        "p: error: the following arguments are required: --checkpoint "
        "(--chekpoint is not a flag of this command; did you mean --checkpoint?)"
    )
