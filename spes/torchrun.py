"""`torchrun` as spes's launch scripts use it: a failed run ends with the failing rank's one-line error.

    python -m spes.torchrun --standalone --nproc_per_node=4 -m spes.train configs/spes_1b/node_0.yaml

Takes torchrun's arguments unchanged. Plain torchrun follows a child's clean `error: ...` line with a ~35-line
`ChildFailedError` traceback; here each rank of `spes.train` leaves its line in a temporary directory
(`SPES_ERROR_DIR`), printing nothing, and the lowest rank's line (rank 0 talks to the server and writes
checkpoints: its line names the culprit, the others' say that rank 0 failed) is printed last, with the first
failure's exit code; a rank that failed of itself comes before one that torchrun stopped because another had failed
(its line says it was interrupted, which is not why the run ended). A signal (Ctrl-C, a scheduler's SIGTERM) ends
in one line too, with the lowest rank's word of what it did: saved a checkpoint and stopped, or stopped before saving
and what its save folder holds.

On a signal torchrun passes it on and SIGKILLs any rank still running after its shutdown timeout; a stopped rank
saves a checkpoint at its next step boundary, and torch's 30 s killed a 1B node mid-save (the steps since its last
checkpoint lost). Here the ranks get `SHUTDOWN_TIMEOUT_S` unless `--shutdown_timeout` (`PET_SHUTDOWN_TIMEOUT`) or
`TORCH_ELASTIC_SHUTDOWN_TIMEOUT` says otherwise; a scheduler's signal must come at least that long before its time
limit (run_scripts/run_cluster.sh). A failed rank's peers are stopped as before (torch stops a failed group with its
own 30 s), so a rank hung in a collective whose peer died does not hold the launch longer.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import tempfile
from pathlib import Path

from spes.interrupt import outliving_readers

ERROR_DIR_ENV = "SPES_ERROR_DIR"
SHUTDOWN_TIMEOUT_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
SHUTDOWN_TIMEOUT_S = 300
"""Seconds the ranks get to stop (a step and a checkpoint) after a signal passed on, before torchrun kills them."""


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(sys.argv[1:] if argv is None else argv)
    args.shutdown_timeout = shutdown_timeout(args.shutdown_timeout)
    # NOTE: its "failed (exitcode ...) local_rank ..." line would stand between the rank's output and the line below
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    # NOTE: its warnings are "Received 15 death signal, shutting down workers" and "Got termination signal", which
    # the line on a signal says; its errors stay
    logging.getLogger("torch.distributed.elastic.agent.server.api").setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory(prefix="spes-errors-") as errors:
        os.environ[ERROR_DIR_ENV] = errors
        try:
            run(args)
            return 0
        except ChildFailedError as e:
            rank, failure = e.get_first_failure()
            line = _lowest_ranks_line(errors, failed=True) or (
                f"error: rank {rank} of {args.training_script} exited with code {failure.exitcode}; see its output "
                "above"
            )
            print(line, file=sys.stderr, flush=True)
            return failure.exitcode if failure.exitcode > 0 else 1
        except SignalException as e:  # torchrun has passed the signal on to the ranks and waited for them
            said = _lowest_ranks_line(errors, failed=False)
            print(
                f"error: stopped by {signal.Signals(e.sigval).name}: "
                + (
                    said.removeprefix("error: ")
                    if said
                    else f"no rank said what it saved (a rank still running {args.shutdown_timeout} s after the "
                    "signal is killed: --shutdown_timeout or TORCH_ELASTIC_SHUTDOWN_TIMEOUT gives it longer); "
                    "--resume=auto continues from save_folder's latest checkpoint, or starts afresh when there is "
                    "none"
                ),
                file=sys.stderr,
                flush=True,
            )
            return 128 + e.sigval


def shutdown_timeout(given: int | None) -> int:
    """The seconds the ranks get to stop after a signal: `given` (--shutdown_timeout, or PET_SHUTDOWN_TIMEOUT), else
    TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else `SHUTDOWN_TIMEOUT_S` (torch's own default, 30 s, is too short for a save)."""
    if given is not None:
        return given
    value = os.environ.get(SHUTDOWN_TIMEOUT_ENV, "").strip()
    if not value:
        return SHUTDOWN_TIMEOUT_S
    try:
        return int(value)
    except ValueError:
        raise SystemExit(
            f"error: {SHUTDOWN_TIMEOUT_ENV}={value!r} is not a number of seconds: set it to one (the time the ranks "
            f"get to save and stop after a signal), or unset it for {SHUTDOWN_TIMEOUT_S} s"
        ) from None


def rank_file(rank: str, *, stopped: bool) -> str:
    """The name of the file in `$SPES_ERROR_DIR` that holds rank `rank`'s line; `stopped`: the rank ended on a
    signal (its line says what it saved), not of a failure of its own."""
    return f"rank{rank}{'.stopped' if stopped else ''}.txt"


def _lowest_ranks_line(errors: str, *, failed: bool) -> str | None:
    """The line the lowest rank left in `errors` (rank 0 talks to the server and writes the checkpoints: its line
    names the culprit, or what it saved), if any rank left one. After a rank `failed`, a rank that failed of itself
    comes first: the others were stopped by torchrun's signal (a slow rank 0 still reading its config among them)."""
    left = list(Path(errors).glob("rank*.txt"))
    if not left:
        return None

    def order(path: Path) -> tuple[bool, int]:
        rank, *stopped = path.name.removesuffix(".txt").removeprefix("rank").split(".")
        return (failed and bool(stopped), int(rank))

    return min(left, key=order).read_text().strip()


if __name__ == "__main__":
    with outliving_readers(None):  # NOTE: the line on a SIGHUP of a closed terminal died of EIO (exit 1, not 129)
        raise SystemExit(main())
