"""Entry point `python -m spes.server` (and `spes-server`): the SPES parameter server (`spes.sync.server`).

The command line is parsed and checked without torch (`spes.sync.settings`): `--help`, a mistyped flag, a config key
the run does not have or a flag value that cannot serve answer in a fraction of a second. `spes.sync.server`, which
imports torch, gRPC's server and the round service (seconds), is imported only for a command that holds.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

from spes.sync.settings import FIRST_IMPLEMENTATION_FLAGS, build_parser, command_from_args

log = logging.getLogger("spes.server")

FROM_ENV = "SPES_SERVER_FROM_ENV"
"""Set by run_parameter_server.sh: `VAR<tab>--flag=value` a line for each argument it made from an environment
variable, so that a refusal of one names the variable the user set, not a command line they never typed."""


def named_from_env(message: str) -> str:
    """`message` (a refusal) with each argument run_parameter_server.sh made from an environment variable named by
    that variable: as the origin of a refused override (`command line (--server.merge_topk=0)`, or without the run's
    YAML `command line: config key 'server.merge_topk' = 0 ...`), else after a refusal of its flag (`--port must be
    in [0, 65535], got 99999`) that no command line is blamed for."""
    for line in os.environ.get(FROM_ENV, "").splitlines():
        var, _, arg = line.partition("\t")
        flag, _, value = arg.partition("=")
        key = FIRST_IMPLEMENTATION_FLAGS.get(flag, flag.removeprefix("--"))
        origin = f"{var}={value} (run_parameter_server.sh's environment, as {arg})"
        if var in message:
            continue
        if f"command line (--{key}={value})" in message:
            message = message.replace(f"command line (--{key}={value})", origin)
        elif message.startswith(f"command line: config key '{key}' = {value} "):
            message = origin + message.removeprefix("command line")
        elif flag in message and value in message and "command line" not in message:
            message = f"{message} ({var}={value} in run_parameter_server.sh's environment)"
    return message


def main(argv: list[str] | None = None) -> int:
    """Run the server until SIGTERM/SIGINT, then shut down cleanly and return 0; 2, with one line on stderr, for a
    command that cannot serve."""
    parser = build_parser()
    parser.exit_on_error = False  # NOTE: a flag's bad value (`--port=abc`) raised here, to be named by its source
    try:
        args = parser.parse_args(argv)
    except argparse.ArgumentError as exc:
        parser.error(named_from_env(str(exc)))
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: stop.set())
    try:
        command = command_from_args(args)
        from spes.sync.server import start_command  # NOTE: lazy: torch and the server, for a command that holds

        server = start_command(command)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {named_from_env(str(exc))}", file=sys.stderr)
        return 2
    try:
        stop.wait()
    finally:
        log.info("shutting down")
        server.stop(grace_s=2.0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
