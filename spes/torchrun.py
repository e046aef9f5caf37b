"""`torchrun` as spes's launch scripts use it: a failed run ends with the failing rank's one-line error.

    python -m spes.torchrun --standalone --nproc_per_node=4 -m spes.train configs/spes_1b/node_0.yaml

Takes torchrun's arguments unchanged. Plain torchrun follows a child's clean `error: ...` line with a ~35-line
`ChildFailedError` traceback; here each rank of `spes.train` leaves its line in a temporary directory
(`SPES_ERROR_DIR`), printing nothing, and the lowest rank's line (rank 0 talks to the server and writes
checkpoints: its line names the culprit, the others' say that rank 0 failed) is printed last, with the first
failure's exit code. A signal (Ctrl-C, a scheduler's SIGTERM) ends in one line too, with the lowest rank's word of
what it did: saved a checkpoint and stopped, or stopped before saving and what its save folder holds.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import tempfile
from pathlib import Path

ERROR_DIR_ENV = "SPES_ERROR_DIR"


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(sys.argv[1:] if argv is None else argv)
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
            line = _lowest_ranks_line(errors) or (
                f"error: rank {rank} of {args.training_script} exited with code {failure.exitcode}; see its output "
                "above"
            )
            print(line, file=sys.stderr, flush=True)
            return failure.exitcode if failure.exitcode > 0 else 1
        except SignalException as e:  # torchrun has passed the signal on to the ranks and waited for them
            said = _lowest_ranks_line(errors)
            print(
                f"error: stopped by {signal.Signals(e.sigval).name}: "
                + (
                    said.removeprefix("error: ")
                    if said
                    else "no rank said what it saved (torchrun kills a rank still running after its shutdown "
                    "timeout, 30 s by default); --resume=auto continues from save_folder's latest checkpoint, or "
                    "starts afresh when there is none"
                ),
                file=sys.stderr,
                flush=True,
            )
            return 128 + e.sigval


def _lowest_ranks_line(errors: str) -> str | None:
    """The line the lowest rank left in `errors` (rank 0 talks to the server and writes the checkpoints: its line
    names the culprit, or what it saved), if any rank left one."""
    lines = sorted(Path(errors).glob("rank*.txt"), key=lambda p: int(p.stem.removeprefix("rank")))
    return lines[0].read_text().strip() if lines else None


if __name__ == "__main__":
    raise SystemExit(main())
