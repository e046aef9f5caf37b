"""How a run that fails ends: one line `error: ...` naming the culprit and the fix, and an exit code by kind.

A user's bad input, a dead server or a diverged loss is refused by a `raise` of spes whose message says what to do;
anything else (a bug, or a library's or the system's error passed on) is named with its type and the line of ours it
came through, its traceback kept in a file the line names (`SPES_DEBUG=1`: printed above it). `spes.torchrun` reads
the line from `$SPES_ERROR_DIR` and prints it last. docs/running.md has the exit codes' table (held to USER_ERRORS
by its test).
"""

from __future__ import annotations

import dis
import os
import sys
import sysconfig
import tempfile
import traceback
from collections.abc import Iterable
from pathlib import Path

from spes.torchrun import ERROR_DIR_ENV, rank_file

# What a user can cause or meet, by the import path of its class: each ends the run with its message as one line and
# this exit code (the first that matches). OSError: a full disk or an unwritable save_folder; KeyboardInterrupt: a
# second Ctrl-C. Named, not imported: a refused config is answered before torch or the sync wing is loaded (see
# `kind_of`).
USER_ERRORS: dict[str, int] = {
    "builtins.ValueError": 2,
    "builtins.FileNotFoundError": 2,
    "spes.sync.protocol.SyncError": 3,
    "spes.guard.NonFiniteError": 4,
    "torch.OutOfMemoryError": 5,
    "builtins.OSError": 6,
    "builtins.KeyboardInterrupt": 130,
}
HINTS: dict[str, str | None] = {  # None: the message says what to do
    "torch.OutOfMemoryError": "lower device_train_microbatch_size or set activation_checkpointing",
    "spes.interrupt.Unsaved": None,
    "builtins.KeyboardInterrupt": "interrupted without saving; start again with --resume=auto: it continues from "
    "save_folder's last checkpoint, or starts afresh when there is none yet",
}
DEBUG_ENV = "SPES_DEBUG"
"""Set to 1, a failure's full traceback is printed above its error line."""
LIBRARIES = tuple({sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")})
"""Where Python's and the installed packages' code lives: a frame there is not where a failure of ours lies."""


def report(e: BaseException) -> int:
    """Print the failure as one line (under `spes.torchrun`, leave it for the launcher to print); its exit code
    (1, Python's own, for a kind USER_ERRORS does not hold).

    The traceback is never lost: SPES_DEBUG=1 prints it above the line; without it, a failure spes did not raise on
    purpose (a bug, or an error of a library or of the system that spes passes on) is named with its type and where it
    was raised, and its traceback is kept in a file the line names.
    """
    debug = os.environ.get(DEBUG_ENV) == "1"
    if debug:
        traceback.print_exception(e, file=sys.stderr)
    kind = kind_of(e, HINTS)
    hint = None if kind is None else HINTS[kind]
    message = str(e)
    if kind is None and not _raised_by_spes(e):
        kept = "traceback above" if debug else _keep_traceback(e)
        message = f"{type(e).__name__}: {message} (at {_raised_at(e)}; {kept})"
    line = "error: " + "; ".join(" ".join(part.split()) for part in (message, hint) if part)
    if not leave_for_launcher(line, stopped=isinstance(e, KeyboardInterrupt)):
        try:
            print(line, file=sys.stderr, flush=True)
        except OSError:  # NOTE: stderr is a log on the disk that filled up: the exit code still tells the kind
            pass
    return exit_code(e) or 1


def exit_code(e: BaseException) -> int | None:
    """The exit code a failure a user can cause or meet ends the run with (USER_ERRORS); None for any other."""
    kind = kind_of(e, USER_ERRORS)
    return None if kind is None else USER_ERRORS[kind]


def kind_of(e: BaseException, kinds: Iterable[str]) -> str | None:
    """The first of `kinds` (import paths of exception classes) that `e` is an instance of, or None.

    A kind whose module is not loaded is passed over without importing it: nothing of it can have been raised.
    """
    for kind in kinds:
        module, _, name = kind.rpartition(".")
        cls = getattr(sys.modules.get(module), name, None)
        if isinstance(cls, type) and isinstance(e, cls):
            return kind
    return None


def leave_for_launcher(line: str, *, stopped: bool) -> bool:
    """Under `spes.torchrun`, leave `line` in this rank's file of `$SPES_ERROR_DIR`, which it prints (the lowest
    rank's; after a failure, a failed rank's before a `stopped` one's) after the ranks have ended; whether it did
    (else there is no launcher to leave it for)."""
    if not os.environ.get(ERROR_DIR_ENV):
        return False
    name = rank_file(os.environ.get("RANK", "0"), stopped=stopped)
    with open(os.path.join(os.environ[ERROR_DIR_ENV], name), "w") as f:
        f.write(line + "\n")
    return True


def _raised_by_spes(e: BaseException) -> bool:
    """Whether a `raise` statement of the spes package raised `e`: a refusal whose message names the culprit and
    the fix (any other error's message may name neither)."""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return False
    code = tb.tb_frame.f_code
    in_spes = Path(code.co_filename).resolve().is_relative_to(Path(__file__).resolve().parent)
    return in_spes and dis.opname[code.co_code[tb.tb_lasti]] == "RAISE_VARARGS"


def _raised_at(e: BaseException) -> str:
    """`file:line` of the innermost frame of `e` outside Python and the installed packages (the call of ours that
    failed), relative to the working directory when under it."""
    frames = traceback.extract_tb(e.__traceback__)  # NOTE: a caught exception has at least the catcher's frame
    where = next((f for f in reversed(frames) if not f.filename.startswith(LIBRARIES)), frames[-1])
    path = Path(where.filename)
    return f"{path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path}:{where.lineno}"


def _keep_traceback(e: BaseException) -> str:
    """Write the traceback of `e` to a temporary file; says where (or prints it when no file can be written)."""
    text = "".join(traceback.format_exception(e))
    try:
        fd, path = tempfile.mkstemp(prefix="spes-traceback-", suffix=".txt")
        with os.fdopen(fd, "w") as f:
            f.write(text)
    except OSError:
        print(text, end="", file=sys.stderr)
        return "traceback above"
    return f"traceback in {path}"
