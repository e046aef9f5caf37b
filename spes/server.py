"""Entry point `python -m spes.server` (and `spes-server`): the SPES parameter server (`spes.sync.server`).

The command line is parsed and checked without torch (`spes.sync.settings`): `--help`, a mistyped flag, a config key
the run does not have or a flag value that cannot serve answer in a fraction of a second. `spes.sync.server`, which
imports torch, gRPC's server and the round service (seconds), is imported only for a command that holds.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading

from spes.interrupt import stop_signals
from spes.sync.settings import build_parser, command_from_args

log = logging.getLogger("spes.server")


def main(argv: list[str] | None = None) -> int:
    """Run the server until SIGTERM, SIGINT or SIGHUP (a closed terminal; not under `nohup`), then shut down cleanly
    and return 0; 2, with one line on stderr, for a command that cannot serve."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stop = threading.Event()
    for sig in stop_signals():
        signal.signal(sig, lambda signum, _frame: stop.set())
    try:
        command = command_from_args(args)
        from spes.sync.server import start_command  # NOTE: lazy: torch and the server, for a command that holds

        server = start_command(command)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        stop.wait()
    finally:
        log.info("shutting down")
        server.stop(grace_s=2.0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
