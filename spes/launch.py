"""Run a whole SPES run on this machine: one parameter server and N peers as real processes on loopback.

    python -m spes.launch configs/tiny.yaml --out output/quickstart
    python -m spes.launch configs/tiny.yaml --dilico          # the DiLoCo/FedAvg baseline
    python -m spes.launch configs/tiny.yaml -- --max_duration=200st   # overrides for every peer

This is the quickstart's engine and a way to try a configuration before renting nodes: each peer is the
same `python -m spes.train` a real node runs (with its own `peer_id` and `data.seed`: the run's + 1000 * peer_id,
as the first implementation's launchers gave its nodes 6198, 7198, ...; the run's is the YAML's own node's data seed
less 1000 * its peer_id), the server is
the same `python -m spes.server` given the same YAML and overrides (so its `server:` section, e.g.
`-- --server.merge_interval=20`). At the end it prints a summary table and exits 0 with every child gone; if
any process fails, the others are stopped and the launcher exits with that process's code (docs/running.md's exit
codes: 2 a config or data error, 6 a full disk, ...), saying what was kept, then that process's own line, the last.
Ctrl-C or SIGTERM stops the peers (each saves a checkpoint of its last step), then the server (it persists its
state), and exits 130: `--resume` continues; so does SIGHUP (a closed terminal), unless started under `nohup`.
Another signal while they stop (`ECHO_S` or more after the first) kills them all at once, without saving; so does
SIGQUIT (Ctrl-\\), exit 131. A launcher whose output nobody reads any more (`| head`) goes on, the logs in --out.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from spes.cli import ArgumentParser, DefaultsHelpFormatter, meant_flags, parser_flags
from spes.config import CODECS, MODE_TITLES, RunMode, TrainConfig, load_config, run_data_seed
from spes.interrupt import Interruptible, outliving_readers
from spes.save_folder import LATEST, CheckpointError, list_checkpoints, resolve_checkpoint
from spes.schema import ConfigError, number_flag

STOP_GRACE_S = 10.0
"""How long a stopped peer (then the server) has to save and exit before it is killed."""

SERVER_START_S = 60.0
"""How long the launcher waits for the server to listen before it starts the peers anyway (they retry their join)."""

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)

KILLED = (
    "the server and the peers are killed without saving; --resume continues from each peer's last checkpoint and the "
    "server's last round"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _HelpFormatter(DefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Each flag's default, and the examples as written."""


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    overrides = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    summary, examples = __doc__.split("\n\n")[:2]
    p = ArgumentParser(
        prog="python -m spes.launch",
        usage="%(prog)s CONFIG [options] [-- --section.key=value ...]",
        description=summary,
        epilog=f"examples:\n{examples}\n\nEverything after `--` goes to every peer and the server.",
        formatter_class=_HelpFormatter,
    )
    p.add_argument(
        "config",
        metavar="CONFIG",
        help="node config (YAML); peer_id, data seed (the run's + 1000 * peer_id), server address and save folder "
        "are set here",
    )
    p.add_argument("--out", default="output/local_run", help="run directory: logs, checkpoints, summary.json")
    p.add_argument(
        "--resume",
        nargs="?",
        const=True,
        default=False,
        choices=["auto"],
        help="continue the run --out holds: the server from its state, every peer from its latest checkpoint (a "
        "folder that holds a run is refused without it, one that holds none with it: two runs are never mixed); "
        "--resume=auto: continue it, or start one when --out holds none (a job submitted again, as the nodes' own "
        "--resume=auto)",
    )
    p.add_argument(  # --dilico: the reference's spelling (its key using_dilico); --diloco: the paper's
        "--dilico", "--diloco", action="store_true", help="DiLoCo/FedAvg baseline: peers train and average everything"
    )
    p.add_argument("--port", type=number_flag(int, ge=0, le=65535), default=0, help="server port (0: a free one)")
    p.add_argument("--codec", choices=CODECS, default=None, help="how tensors travel (default: spes_config.codec)")
    p.add_argument("--threads", type=number_flag(int, ge=1), default=1, help="torch threads per peer")
    p.add_argument(
        "--eval_peers",
        type=int,
        default=None,
        help="how many peers (ids 0..N-1) run the validation evaluations (default: all); after a sync every "
        "peer holds the same global model, so one evaluating peer gives the run's merged curve for 1/N of the CPU",
    )
    p.add_argument("--timeout", type=number_flag(gt=0), default=1800, help="give up after this many seconds")
    args, unknown = p.parse_known_args(argv)
    if unknown:  # NOTE: spes.train takes overrides as they are; here they would reach no process
        p.error(
            f"unrecognized arguments: {' '.join(unknown)}{meant_flags(unknown, parser_flags(p))} (an override of the "
            f"run's config goes after `--`, e.g. python -m spes.launch {args.config} -- {' '.join(unknown)})"
        )
    return args, overrides


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    out = Path(args.out).expanduser()  # NOTE: --out=~/run reaches here as written
    resuming = args.resume is True or (args.resume == "auto" and bool(previous_run(out)))
    try:
        cfg, run = load_run(args, overrides)
        eval_peers = check_eval_peers(args.eval_peers, cfg.num_peers)
        resume = resume_flags(out, resuming)
        seeds = [run_data_seed(cfg, i) for i in range(cfg.num_peers)]  # as the first implementation's launchers
    except (ConfigError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    port = args.port or free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONUNBUFFERED": "1"}
    procs: dict[str, subprocess.Popen] = {}
    started = time.time()
    followed = out / "peer0.log"
    shown = followed.stat().st_size if resuming and followed.is_file() else 0  # NOTE: echo only this start's lines
    with Interruptible():  # SIGTERM, SIGHUP too: `finally` stops the children (own sessions) of a killed launcher
        if signal.getsignal(signal.SIGQUIT) == signal.SIG_DFL:  # NOTE: not where the shell has it ignored (`cmd &`)
            signal.signal(signal.SIGQUIT, lambda _signum, _frame: _quit(procs))
        try:
            procs["server"] = _spawn(server_command(args.config, run, port, out), out / "server.log", env, resuming)
            _await_listening(procs["server"], port, SERVER_START_S)
            for i, seed in enumerate(seeds):
                peer_cmd = [
                    *peer_command(args.config, run, i, seed, port, out),
                    *(["--eval_interval=null"] if i >= eval_peers else []),
                    *resume,
                ]
                procs[f"peer{i}"] = _spawn(peer_cmd, out / f"peer{i}.log", env, resuming)
            print(
                f"started server on 127.0.0.1:{port} and {cfg.num_peers} peers ({MODE_TITLES[cfg.mode]} run, data "
                f"seeds {seeds}); logs in {out}/ (following peer0.log)"
            )
            code, culprit = _wait(procs, followed, shown, args.timeout)
        except KeyboardInterrupt:
            print("interrupted: the peers save a checkpoint and stop, then the server", file=sys.stderr)
            code, culprit = 130, None
        finally:
            _stop_all(procs)
    if code != 0:
        for line in ending(out, culprit):
            print(line, file=sys.stderr)
        return code
    summary = summarize(out, cfg.num_peers, time.time() - started, cfg.mode)
    summary |= {"run_steps": cfg.duration_steps, "stop_at": cfg.stop_at if cfg.max_steps < cfg.duration_steps else None}
    print(format_summary(summary))
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return 0


def load_run(args: argparse.Namespace, overrides: list[str]) -> tuple[TrainConfig, list[str]]:
    """The run's config and the overrides every process of it gets (the launcher's flags folded in); a centralized
    run is refused (it needs no server)."""
    codec = [f"--spes_config.codec={args.codec}"] if args.codec else []
    run = [*overrides, *(["--using_dilico=true"] if args.dilico else []), *codec]
    cfg, _ = load_config(args.config, run)
    if not cfg.sync_enabled:  # NOTE: with the overrides that made it so: tiny.yaml itself is a SPES run
        given = f"{args.config} with {' '.join(run)}" if run else args.config
        raise ConfigError(
            f"{given} is a centralized run (using_spes: false): train it with "
            f"python -m spes.train {args.config}{''.join(' ' + o for o in run)}, which needs no server"
        )
    return cfg, run


def check_eval_peers(eval_peers: int | None, peers: int) -> int:
    """How many peers (ids 0..N-1) run the validation evaluations: `--eval_peers`, by default all."""
    chosen = peers if eval_peers is None else eval_peers
    if not 1 <= chosen <= peers:
        raise ConfigError(f"--eval_peers={eval_peers} must be between 1 and the run's {peers} peers")
    return chosen


def resume_flags(out: Path, resume: bool) -> list[str]:
    """The peers' flags to continue the run `out` holds (none without `--resume`); refuses a run held there
    without it, so a new run never lands on an old one, and `--resume` where none is held (the peers' `--resume=auto`
    would start a fresh run: a mistyped --out must not look like a resumed run)."""
    held = previous_run(out)
    if held and not resume:
        raise ConfigError(
            f"{out} holds {held}: pass --resume (quickstart: RESUME=1) to continue it, or another --out "
            "(quickstart: OUT=...) for a new run"
        )
    if not held and resume:
        raise ConfigError(
            f"nothing to resume: --out {out} holds no run (no server state, no node checkpoint); drop --resume "
            "(quickstart: unset RESUME) to start a new run there, or pass the --out (quickstart: OUT=...) of the run"
        )
    if not resume:
        return []
    return ["--resume=auto", *([f"--spes_config.run_id={run_id}"] if (run_id := held_run_id(out)) else [])]


def server_command(config: str, run: list[str], port: int, out: Path) -> list[str]:
    """The parameter server of the run on loopback `port`, its data plane on a free port, its state under `out`."""
    return [
        sys.executable,
        "-m",
        "spes.server",
        config,
        *run,
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        "--data_port",
        "0",
        "--state_dir",
        str(out / "server_state"),
    ]


def peer_command(config: str, run: list[str], peer: int, seed: int, port: int, out: Path) -> list[str]:
    """Node `peer` of the run, reading its data in the order of `seed`, saving under `out`/node`peer`."""
    return [
        sys.executable,
        "-m",
        "spes.train",
        config,
        *run,
        f"--spes_config.peer_id={peer}",
        f"--data.seed={seed}",
        f"--spes_config.server_addr=127.0.0.1:{port}",
        f"--save_folder={out}/node{peer}",
    ]


def previous_run(out: Path) -> str:
    """What run `out` holds ('' for none): its server's state, or a node's checkpoint."""
    state = out / "server_state" / "run.json"
    if state.is_file():
        try:
            run = f"the run {held_run_id(out)}"
        except ConfigError:  # NOTE: a resume names the damage; what a run holds is all this says
            run = "a run"
        return f"{run} (its server state, {state.parent})"
    nodes = saved_nodes(out)
    return f"the checkpoints of {', '.join(p.name for p in nodes)}" if nodes else ""


def saved_nodes(out: Path) -> list[Path]:
    """The node save folders in `out` holding a checkpoint (node2 before node10): as spes.train decides it, `latest`,
    or a checkpoint a save killed before pointing `latest` at it."""
    nodes = [p for p in out.glob("node*") if (p / LATEST).is_file() or list_checkpoints(p)]
    return sorted(nodes, key=lambda p: (len(p.name), p.name))


RESUME = "--resume and the same overrides after `--` (quickstart: RESUME=1 and the same settings)"
"""How the launcher continues the run its --out holds."""


def ending(out: Path, culprit: str | None) -> list[str]:
    """The last lines of a launch that did not finish: with no culprit (Ctrl-C, SIGTERM), what it kept and how to
    continue; else what it kept (if anything), then the culprit's own line, the last: the project's one line naming
    what failed and what to do. Why: "continue with --resume" after that line contradicted a refusal that the kept
    state cannot simply be resumed (a server state an older spes wrote, a state.json gone)."""
    if culprit is None:
        return [how_to_continue(out)]
    if not previous_run(out):
        return [culprit]
    return [
        f"{kept(out)}; once the error below is dealt with, {RESUME} continue from there, or another --out (quickstart: "
        "OUT=...) starts a new run",
        culprit,
    ]


def how_to_continue(out: Path) -> str:
    """What an interrupted start left in `out` (the step each peer goes on from), and the command that follows on
    from it."""
    if not previous_run(out):
        return f"nothing was saved yet in {out}: start the run again without --resume"  # NOTE: --resume is refused
    return f"{kept(out)}; continue with {RESUME}"


def kept(out: Path) -> str:
    """What `out` keeps of a run: each node's checkpoint a resume goes on from, and whether the server's state."""
    server = " and the server state" if (out / "server_state" / "run.json").is_file() else ""
    return f"kept in {out}: {kept_checkpoints(out) or 'no node checkpoint'}{server}"


def kept_checkpoints(out: Path) -> str:
    """Each node's checkpoint in `out` that --resume goes on from, resolved as a resume resolves it (e.g. "node0
    step106, node1 step105")."""
    kept = []
    for node in saved_nodes(out):
        try:
            kept.append(f"{node.name} {resolve_checkpoint(node).name}")
        except CheckpointError as exc:  # NOTE: a resume refuses it, naming what to do (a `latest` damaged)
            kept.append(f"{node.name} none a resume takes ({exc})")
    return ", ".join(kept)


def held_run_id(out: Path) -> str:
    """The id of the run whose server state `out` holds ('' for none); ConfigError naming its record when damaged
    (it was a traceback)."""
    from spes.sync.state import recorded_run_id  # NOTE: lazy: torch, only for a run that holds a server state

    try:
        return recorded_run_id(out / "server_state", fix="pick another --out for a new run") or ""
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _await_listening(server: subprocess.Popen, port: int, timeout: float) -> None:
    """Return once the server accepts connections on loopback `port`, has exited, or `timeout` s have passed: a peer
    started before it listens prints a refused join and each retry of it, noise in a run where nothing failed."""
    deadline = time.monotonic() + timeout
    while server.poll() is None and time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
            return
        except OSError:
            time.sleep(0.1)


def _spawn(cmd: list[str], log_path: Path, env: dict[str, str], resume: bool) -> subprocess.Popen:
    """Start `cmd` in its own session, its output into `log_path`: appended to on a resume, which keeps the earlier
    starts' lines (the run's history), else a new log."""
    log = open(log_path, "a" if resume else "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _wait(procs: dict[str, subprocess.Popen], follow: Path, offset: int, timeout: float) -> tuple[int, str | None]:
    """Follow one peer's log from byte `offset` until every peer exits; stop early on the first failure, saying at
    once who failed. The exit code and the culprit's line (said last, once the others are stopped): 0 and none, the
    first failed process's code (1 if a signal ended it) and its own line, or 1 and the timeout's past `timeout`."""
    deadline = time.time() + timeout
    peers = {k: p for k, p in procs.items() if k != "server"}
    while True:
        offset = _echo_new(follow, offset)
        failed = [k for k, p in procs.items() if p.poll() not in (None, 0)]
        if failed:
            for k in failed:
                print(
                    f"{k} exited with code {procs[k].returncode}; its log: {follow.parent / f'{k}.log'}",
                    file=sys.stderr,
                )
            first = procs[failed[0]].returncode
            log = follow.parent / f"{failed[0]}.log"
            said = _last_line(log) or f"error: {failed[0]} failed (exit code {first}) without saying why; see {log}"
            return max(first, 1), said  # NOTE: its kind, as spes.failures numbers it; killed: 1
        if all(p.poll() == 0 for p in peers.values()):
            _echo_new(follow, offset)
            return 0, None
        if time.time() > deadline:
            late = f"run did not finish within --timeout={timeout:g} s"
            print(f"{late}: the peers save a checkpoint and stop, then the server", file=sys.stderr)
            return 1, f"error: {late}; continue with --resume and a longer --timeout"
        time.sleep(0.5)


def _last_line(log: Path) -> str | None:
    """A failed child's own one-line error (`error: ...`), if its log ends with one."""
    lines = log.read_text(errors="replace").strip().splitlines() if log.exists() else []
    return lines[-1] if lines and lines[-1].startswith("error: ") else None


def _echo_new(path: Path, offset: int) -> int:
    """Print the complete lines appended to `path` since byte `offset`; return the new offset."""
    if not path.exists():
        return offset
    with open(path, "rb") as f:
        f.seek(offset)
        chunk = f.read()
    complete = chunk[: chunk.rfind(b"\n") + 1]
    for line in complete.decode(errors="replace").splitlines():
        print(f"  [peer0] {line}", flush=True)
    return offset + len(complete)


def _stop_all(procs: dict[str, subprocess.Popen]) -> None:
    """SIGTERM the peers first (each saves a checkpoint at its next step and exits; one waiting for a round stops
    waiting and keeps it in that checkpoint), then the server (it persists its state); SIGKILL what is left after
    `STOP_GRACE_S`, or at once on another interrupt (a second Ctrl-C must neither leave children running nor end
    in a traceback)."""
    peers = [p for k, p in procs.items() if k != "server"]
    server = [p for k, p in procs.items() if k == "server"]
    try:
        for group in (peers, server):
            for p in group:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGTERM)
            deadline = time.monotonic() + STOP_GRACE_S
            for p in group:
                try:
                    p.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    _kill(p)
    except KeyboardInterrupt:
        for sig in SIGNALS:  # NOTE: what is left takes a moment to kill; a third signal would leave it running
            signal.signal(sig, signal.SIG_IGN)
        print(f"error: interrupted while stopping: {KILLED}", file=sys.stderr)
        for p in procs.values():
            _kill(p)


def _quit(procs: dict[str, subprocess.Popen]) -> None:
    """SIGQUIT (Ctrl-\\): kill every child now, without saving, and exit 131. Why: the children, in sessions of their
    own, do not get the terminal's signal, and the launcher's default death (a core dump) left them all running."""
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    print(f"error: quit (SIGQUIT): {KILLED}", file=sys.stderr)
    for p in procs.values():
        _kill(p)
    raise SystemExit(128 + signal.SIGQUIT)


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL `proc`'s process group (its session: torchrun's ranks, a server's threads) and reap it."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def summarize(out: Path, peers: int, seconds: float, mode: RunMode) -> dict[str, Any]:
    """Per-peer figures read back from each node's metrics.jsonl, with the run's mode (a baseline's summary must not
    read as a SPES run's)."""
    rows = []
    for i in range(peers):
        records = [json.loads(line) for line in (out / f"node{i}" / "metrics.jsonl").read_text().splitlines()]
        syncs = [r for r in records if "sync_s" in r]
        evals = [r for r in records if "val_loss" in r]
        merged = [r for r in records if "merged_val_loss" in r]
        rows.append(
            {
                "peer": i,
                "steps": records[-1]["step"],
                "final_loss": records[-1]["loss"],
                "val_local_last": evals[-1]["val_loss"] if evals else None,
                "val_merged_first": merged[0]["merged_val_loss"] if merged else None,
                "val_merged_last": merged[-1]["merged_val_loss"] if merged else None,
                "rounds": len(syncs),
                "merge_rounds": sum(bool(r.get("merged")) for r in syncs),
                "mb_up": sum(r["sync_mb_up"] for r in syncs),
                "mb_down": sum(r["sync_mb_down"] for r in syncs),
                "sync_s": sum(r["sync_s"] for r in syncs),
                "wait_s": sum(r.get("sync_wait_s", 0.0) for r in syncs),
                "tokens": records[-1].get("tokens"),
            }
        )
    return {"mode": mode, "peers": rows, "wall_s": seconds}


def format_summary(summary: dict[str, Any]) -> str:
    def f(v: Any, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    head = (
        f"{'peer':>4} {'steps':>6} {'loss':>8} {'val local':>10} {'merged val':>11} {'-> last':>8} "
        f"{'rounds':>7} {'merges':>7} {'MiB up':>8} {'MiB down':>8} {'sync s':>7} {'wait s':>7}"
    )
    lines = [
        "",
        f"{MODE_TITLES[summary['mode']]} run summary (val = validation loss; merged val at the first and the last "
        "sync; sync s: time exchanging, wait s: time training stood still)",
        head,
        "-" * len(head),
    ]
    for r in summary["peers"]:
        lines.append(
            f"{r['peer']:>4} {r['steps']:>6} {f(r['final_loss'], '.4f'):>8} {f(r['val_local_last'], '.4f'):>10} "
            f"{f(r['val_merged_first'], '.4f'):>11} {f(r['val_merged_last'], '.4f'):>8} "
            f"{r['rounds']:>7} {r['merge_rounds']:>7} {r['mb_up']:>8.2f} {r['mb_down']:>8.2f} "
            f"{r['sync_s']:>7.2f} {r.get('wait_s', 0.0):>7.2f}"
        )
    lines.append(f"wall time {summary['wall_s']:.0f}s; every process exited cleanly")
    if summary.get("stop_at") is not None:  # NOTE: only the progress bar said so; the table read as a finished run
        lines.append(
            f"stopped at step {summary['stop_at']} of {summary['run_steps']} (stop_at): the run is unfinished, "
            "continue with --resume and the same overrides after `--`, stop_at larger or left out"
        )
    return "\n".join(lines)


UNREAD = "note: nobody reads the launcher's output any more: the run goes on, its logs in its --out folder"

if __name__ == "__main__":
    with outliving_readers(UNREAD):
        raise SystemExit(main())
