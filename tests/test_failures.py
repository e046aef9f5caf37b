"""How a failed run ends (spes.failures), through `spes.train`'s main: a refusal of spes is its one line; any other
failure names its type and where it came through, its traceback kept in a file (or printed with SPES_DEBUG=1); the
exit codes are those docs/running.md tabulates."""

from __future__ import annotations

import contextlib
import errno
import importlib
import inspect
import json
import re
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import spes.train
from spes.atomic import OutOfRoom, room_for
from spes.failures import DEBUG_ENV, HINTS, USER_ERRORS, exit_code, kind_of, report
from spes.torchrun import ERROR_DIR_ENV
from spes.train import main

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny.yaml")


def _plant_bug(monkeypatch: pytest.MonkeyPatch) -> tuple[str, str, str]:
    """A bug in spes's own code, no refusal of its: `main` unpacks what a changed `load_config` returns.
    Returns (the error, where it is raised, its source line)."""
    monkeypatch.setattr(spes.train, "load_config", lambda path, overrides: (1, 2, 3))
    lines, first = inspect.getsourcelines(main)
    where = f"spes/train.py:{first + next(i for i, line in enumerate(lines) if '= load_config(' in line)}"
    return "ValueError: too many values to unpack (expected 2)", where, "cfg, inert = load_config("


def _plant_raise(monkeypatch: pytest.MonkeyPatch) -> tuple[str, str, str]:
    """A ValueError raised on purpose but not by spes, as a library raises one that spes passes on."""

    def run(cfg: object, inert: object = None) -> int:
        raise ValueError("planted")

    monkeypatch.setattr(spes.train, "run", run)
    return "ValueError: planted", f"test_failures.py:{run.__code__.co_firstlineno + 1}", 'raise ValueError("planted")'


@pytest.fixture
def kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The folder a failure's traceback file goes to (the temporary directory), here empty at first."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    return tmp_path


@pytest.mark.parametrize("plant", [_plant_bug, _plant_raise])
def test_a_failure_spes_did_not_raise_names_where_and_keeps_its_traceback_in_a_file(
    plant: Callable[[pytest.MonkeyPatch], tuple[str, str, str]],
    kept: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    message, where, source = plant(monkeypatch)
    assert main([TINY]) == 2
    err = capsys.readouterr().err
    found = re.fullmatch(rf"error: {re.escape(message)} \(at (\S+); traceback in (\S+)\)\n", err)
    assert found and found[1].endswith(where) and Path(found[2]).parent == kept, err
    text = Path(found[2]).read_text()
    assert text.startswith("Traceback (most recent call last):") and source in text, text
    assert text.endswith(f"{message}\n") and all(
        line.startswith(("Traceback", "  ", message)) for line in text.splitlines()
    )
    assert Path(found[2]).name.startswith("spes-traceback-") and found[2].endswith(".txt")


def test_the_place_is_relative_under_the_working_directory_and_whole_outside_it(
    kept: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _, where, _ = _plant_bug(monkeypatch)
    monkeypatch.chdir(REPO)
    assert main([TINY]) == 2 and f"(at {where}; " in capsys.readouterr().err
    monkeypatch.chdir(kept)
    assert main([TINY]) == 2 and f"(at {REPO / where}; " in capsys.readouterr().err


def test_an_error_raised_inside_a_library_is_placed_at_the_line_that_called_it(
    kept: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def run(cfg: object, inert: object = None) -> int:
        return int(json.loads("{"))  # raised in the standard library's json

    monkeypatch.setattr(spes.train, "run", run)
    assert main([TINY]) == 2
    place = re.search(r"\(at (\S+); ", capsys.readouterr().err)
    assert place and place[1].endswith(f"test_failures.py:{run.__code__.co_firstlineno + 1}"), place


def test_a_traceback_no_file_can_hold_is_printed_above_the_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "gone"))
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    message, _, source = _plant_raise(monkeypatch)
    assert main([TINY]) == 2
    head, _, last = capsys.readouterr().err.rstrip("\n").rpartition("\n")
    assert head.startswith("Traceback (most recent call last):") and source in head and head.endswith(message), head
    assert last.startswith(f"error: {message} (at ") and last.endswith("; traceback above)"), last


def test_a_hint_follows_its_message_in_the_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def run(cfg: object, inert: object = None) -> int:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(spes.train, "run", run)
    assert main([TINY]) == 5
    assert capsys.readouterr().err == (
        "error: CUDA out of memory. Tried to allocate 2.00 GiB; lower device_train_microbatch_size or set "
        "activation_checkpointing\n"
    )


def test_the_line_is_left_for_spes_torchrun_under_the_ranks_number(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(ERROR_DIR_ENV, str(tmp_path))
    monkeypatch.delenv("RANK", raising=False)
    assert main([TINY, "--model.d_mdoel=3"]) == 2
    line = (tmp_path / "rank0.txt").read_text()
    assert line == (
        "error: command line (--model.d_mdoel=3): unknown config key 'model.d_mdoel'; did you mean 'model.d_model'?\n"
    )
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "3")
    assert main([TINY, "--model.d_mdoel=3"]) == 2
    assert (tmp_path / "rank3.txt").read_text() == line and capsys.readouterr().err == ""  # the launcher prints it


def test_a_rank_ended_by_a_signal_leaves_its_line_as_stopped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """spes.torchrun prints a rank that failed of itself before one its signal stopped (tests/test_distributed)."""
    monkeypatch.setenv(ERROR_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "2")
    assert report(KeyboardInterrupt()) == 130
    assert [p.name for p in tmp_path.iterdir()] == ["rank2.stopped.txt"]


def test_a_refusal_is_its_line_alone_and_spes_debug_prints_every_traceback(
    kept: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    refusal = (
        "error: command line (--model.d_mdoel=3): unknown config key 'model.d_mdoel'; did you mean 'model.d_model'?\n"
    )
    assert main([TINY, "--model.d_mdoel=3"]) == 2
    assert capsys.readouterr().err == refusal and not any(kept.iterdir())
    monkeypatch.setenv(DEBUG_ENV, "1")
    assert main([TINY, "--model.d_mdoel=3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):") and err.endswith("\n" + refusal), err
    _, _, source = _plant_bug(monkeypatch)
    assert main([TINY]) == 2
    err = capsys.readouterr().err
    assert source in err and err.endswith("; traceback above)\n") and not any(kept.iterdir()), err


def test_ctrl_c_before_any_checkpoint_points_to_a_resume_that_works(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A second Ctrl-C, or one while the node is still being built, ends without saving: there may be no
    checkpoint yet, where --resume would fail; --resume=auto continues or starts afresh."""

    def interrupted(cfg: object, inert: object = None) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(spes.train, "run", interrupted)
    assert main([TINY]) == 130
    assert capsys.readouterr().err == (
        "error: interrupted without saving; start again with --resume=auto: it continues from save_folder's last "
        "checkpoint, or starts afresh when there is none yet\n"
    )


def test_the_exit_codes_table_is_the_codes_of_the_code() -> None:
    """docs/running.md's table, row by row: the exit code of each kind of failure `spes.train` reports."""
    doc = (REPO / "docs" / "running.md").read_text()
    table = doc[doc.index("**Exit codes.**") : doc.index("**Tracebacks.**")]
    documented = {
        kind: int(code)
        for code, kinds in re.findall(r"^\| (\d+) \|.*\| ([^|]*) \|$", table, flags=re.M)
        for kind in re.findall(r"`(\w+)`", kinds)
    }
    assert documented == {kind.rpartition(".")[2]: code for kind, code in USER_ERRORS.items()}


def test_every_kind_of_the_tables_is_an_exception_class_and_one_not_loaded_is_passed_over() -> None:
    """The tables name their classes by import path, so that matching a refused config's error imports neither torch
    nor the sync wing: a misspelt path would match nothing, silently, so each is imported here."""
    for kind in {**USER_ERRORS, **HINTS}:
        module, _, name = kind.rpartition(".")
        cls = getattr(importlib.import_module(module), name)
        assert issubclass(cls, BaseException) and kind_of(cls.__new__(cls), [kind]) == kind, kind
    assert kind_of(ValueError("x"), ["spes_never_imported.ValueError", "builtins.ValueError"]) == "builtins.ValueError"
    assert "spes_never_imported" not in sys.modules
    assert kind_of(FileNotFoundError("x"), ["builtins.OSError", "builtins.FileNotFoundError"]) == "builtins.OSError"
    assert kind_of(KeyboardInterrupt(), USER_ERRORS) == "builtins.KeyboardInterrupt"
    assert kind_of(KeyboardInterrupt(), ["builtins.Exception"]) is None


def test_a_kind_the_table_does_not_hold_has_no_exit_code_of_its_own_and_ends_as_python_would(
    kept: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`main` re-raises what `exit_code` does not know (Python's traceback, exit 1); `report` given one anyway
    says it in its line and returns Python's 1, not a user error's code."""
    assert exit_code(RuntimeError("x")) is None and exit_code(FileNotFoundError("x")) == 2
    try:
        raise RuntimeError("planted")
    except RuntimeError as e:
        assert report(e) == 1
    assert capsys.readouterr().err.startswith("error: RuntimeError: planted (at ")


def test_a_full_disk_is_its_line_alone_with_the_exit_code_of_oserrors(
    kept: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`spes.atomic.room_for`'s OutOfRoom already names the file and the fix: printed as it is (no type, no traceback
    file), exit 6."""
    with pytest.raises(OutOfRoom) as caught, room_for("cannot append step 3 to run/metrics.jsonl", "free space"):
        raise OSError(errno.ENOSPC, "No space left on device")
    assert report(caught.value) == 6
    assert (
        capsys.readouterr().err
        == "error: cannot append step 3 to run/metrics.jsonl: no space left on device; free space\n"
    )
    assert list(kept.iterdir()) == []


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs Linux's /dev/full")
def test_a_line_that_stderr_has_no_room_for_still_ends_with_the_failures_exit_code(
    kept: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """stderr redirected to a log on the disk that filled up: the line cannot be written, the exit code still tells
    (it ended as an uncaught OSError, exit 1)."""
    with pytest.raises(OSError) as caught:
        raise OSError(errno.ENOSPC, "No space left on device")
    full = open("/dev/full", "w")  # closed below, where it fails as the report's print did
    monkeypatch.setattr(sys, "stderr", full)
    assert report(caught.value) == 6
    with contextlib.suppress(OSError):  # NOTE: it still holds the line it had no room for
        full.close()
