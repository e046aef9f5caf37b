"""The local launcher (server + peers as real processes) and the per-node launch script."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import yaml

import spes.launch
from conftest import LaunchedRun, usage_error
from spes.config import CODECS
from spes.interrupt import Interruptible
from spes.launch import (
    RESUME,
    SIGNALS,
    _stop_all,
    _wait,
    ending,
    format_summary,
    how_to_continue,
    load_run,
    parse_args,
    resume_flags,
    summarize,
)
from spes.save_folder import LATEST, META_FILE
from spes.schema import ConfigError

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny.yaml")


@pytest.mark.slow
@pytest.mark.timeout(450)
def test_local_run_finishes_with_summary_and_no_leftover_processes(quickstart_run: LaunchedRun) -> None:
    """The session's quickstart run (conftest.py): 4 peers, rounds at steps 10 and 20, a merge round at 20."""
    assert "SPES run summary" in quickstart_run.stdout
    # each peer's data order: the config's seed + 1000 * id
    assert "data seeds [6198, 7198, 8198, 9198]" in quickstart_run.stdout
    summary = json.loads((quickstart_run.out / "summary.json").read_text())
    assert [r["rounds"] for r in summary["peers"]] == [2] * 4
    assert [r["merge_rounds"] for r in summary["peers"]] == [1] * 4
    merged = {r["val_merged_last"] for r in summary["peers"]}
    assert len(merged) == 1  # every peer evaluates the same global model after the last sync
    assert quickstart_run.leftovers == []


@pytest.mark.parametrize(
    ("flag", "rule"),
    [
        ("--threads=0", "argument --threads: 0 must be an integer >= 1"),
        ("--port=70000", "argument --port: 70000 must be an integer in [0, 65535]"),
        ("--port=-1", "argument --port: -1 must be an integer in [0, 65535]"),
        ("--timeout=nan", "argument --timeout: nan must be a finite number > 0"),
        ("--timeout=0", "argument --timeout: 0 must be a finite number > 0"),
    ],
)
def test_a_launcher_flag_out_of_its_range_is_refused_naming_it(
    capsys: pytest.CaptureFixture[str], flag: str, rule: str
) -> None:
    assert usage_error(capsys, lambda: parse_args([TINY, flag])) == f"python -m spes.launch: error: {rule}"


@pytest.mark.parametrize(
    ("args", "refusal"),
    [
        (["--", "--spes_config.num_peerz=2"], "did you mean 'spes_config.num_peers'"),
        (["--eval_peers", "5"], "--eval_peers=5 must be between 1 and the run's 4 peers"),
        (
            ["--", "--spes_config.codec=int4"],
            "error: command line (--spes_config.codec=int4): config key 'spes_config.codec' = 'int4' must be one of "
            "['fp32', 'bf16', 'int8', 'sparse']\n",
        ),
    ],
)
def test_launcher_rejects_a_bad_config_before_starting_anything(tmp_path: Path, args: list[str], refusal: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "spes.launch", TINY, "--out", str(tmp_path), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and refusal in proc.stderr, proc.stderr
    assert not (tmp_path / "server.log").exists()


def test_resume_on_an_out_that_holds_no_run_is_refused_before_starting_anything(tmp_path: Path) -> None:
    """It passed --resume=auto to the peers, which started a fresh run: a mistyped --out (or quickstart's RESUME=1
    on a new OUT) looked like a resumed run."""
    out = tmp_path / "nothing" / "here"
    proc = subprocess.run(
        [sys.executable, "-m", "spes.launch", TINY, "--out", str(out), "--resume"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        f"error: nothing to resume: --out {out} holds no run (no server state, no node checkpoint); drop --resume "
        "(quickstart: unset RESUME) to start a new run there, or pass the --out (quickstart: OUT=...) of the run"
    ]
    assert not out.exists()


def test_an_out_from_home_is_the_home_folders(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The shell leaves --out=~/run as written: the run went into a folder named ~ where the launcher ran."""
    monkeypatch.setenv("HOME", str(tmp_path / "home ü"))
    assert spes.launch.main([TINY, "--out=~/my run", "--resume"]) == 2
    assert capsys.readouterr().err.startswith(f"error: nothing to resume: --out {tmp_path}/home ü/my run holds no run")


def test_a_run_is_a_server_state_or_a_nodes_checkpoint_as_the_nodes_see_it(tmp_path: Path) -> None:
    """A node's save folder whose save was killed before `latest` named its checkpoint still holds a run
    (spes.train resumes from it): --resume continues it, and a start without --resume is refused."""
    assert resume_flags(tmp_path, False) == []
    (tmp_path / "node1" / "step4").mkdir(parents=True)  # no `latest`
    with pytest.raises(ConfigError, match=r"holds the checkpoints of node1: pass --resume"):
        resume_flags(tmp_path, False)
    assert resume_flags(tmp_path, True) == ["--resume=auto"]
    (tmp_path / "server_state").mkdir()
    (tmp_path / "server_state" / "run.json").write_text(json.dumps({"run_id": "abc"}))
    assert resume_flags(tmp_path, True) == ["--resume=auto", "--spes_config.run_id=abc"]


def test_a_run_past_its_timeout_says_what_was_kept_and_how_to_continue(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It said only "run did not finish within 15s", though the peers are then stopped with a checkpoint each. What
    happens now is said at once; the error line, what to do, is the launch's last (after what was kept)."""
    procs = {name: subprocess.Popen(["sleep", "30"]) for name in ("server", "peer0")}
    try:
        code, culprit = _wait(procs, tmp_path / "peer0.log", 0, 0.01)
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()
    assert capsys.readouterr().err.splitlines() == [
        "run did not finish within --timeout=0.01 s: the peers save a checkpoint and stop, then the server"
    ]
    assert (code, culprit) == (
        1,
        "error: run did not finish within --timeout=0.01 s; continue with --resume and a longer --timeout",
    )


@pytest.fixture
def launcher_signals() -> Iterator[None]:
    """The test process's own SIGINT and SIGTERM handlers, put back after a test installs the launcher's."""
    previous = {sig: signal.getsignal(sig) for sig in SIGNALS}
    yield
    for sig, handler in previous.items():
        signal.signal(sig, handler)


def test_an_interrupt_while_stopping_kills_every_child_at_once_and_ends_without_a_traceback(
    launcher_signals: None, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second Ctrl-C while the peers saved ended spes.launch in a KeyboardInterrupt traceback and left the server
    (its own session) running, holding its state directory against the --resume it told the user to run. The
    grace is 40 s here: far enough past "at once" for a slow machine not to blur the two."""
    monkeypatch.setattr(spes.launch, "STOP_GRACE_S", 40.0)
    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(flush=True); time.sleep(60)"
    procs = {
        name: subprocess.Popen([sys.executable, "-c", stubborn], stdout=subprocess.PIPE, start_new_session=True)
        for name in ("server", "peer0")
    }
    for proc in procs.values():
        assert proc.stdout is not None and proc.stdout.readline() == b"\n"  # SIGTERM is ignored from here on
    again = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT))
    started = time.monotonic()
    again.start()
    try:
        with Interruptible():  # as spes.launch's main stops its children
            _stop_all(procs)
        escaped = False
    except KeyboardInterrupt:
        escaped = True
    finally:
        again.cancel()
        for proc in procs.values():
            proc.kill()
            proc.wait()
    assert not escaped
    assert time.monotonic() - started < spes.launch.STOP_GRACE_S / 2
    assert [proc.returncode for proc in procs.values()] == [-signal.SIGKILL] * 2
    assert capsys.readouterr().err.startswith("error: interrupted while stopping: the server and the peers are killed")


def test_an_interrupted_start_says_how_to_continue_from_what_it_saved(tmp_path: Path) -> None:
    """It said "continue with --resume" even when stopped before any save, and --resume was then refused; and it
    never said which step each peer saved (the followed log stops at the Ctrl-C, before the peers' last saves)."""
    assert how_to_continue(tmp_path) == f"nothing was saved yet in {tmp_path}: start the run again without --resume"
    for node, step in (("node0", 90), ("node0", 106), ("node10", 105), ("node2", 105)):
        (tmp_path / node / f"step{step}").mkdir(parents=True)
        (tmp_path / node / f"step{step}" / META_FILE).write_text("{}")
    assert how_to_continue(tmp_path) == (
        f"kept in {tmp_path}: node0 step106, node2 step105, node10 step105; continue with --resume and the same "
        "overrides after `--` (quickstart: RESUME=1 and the same settings)"
    )
    (tmp_path / "server_state").mkdir()
    (tmp_path / "server_state" / "run.json").write_text(json.dumps({"run_id": "abc"}))
    assert how_to_continue(tmp_path).startswith(
        f"kept in {tmp_path}: node0 step106, node2 step105, node10 step105 and the server state; continue with"
    )
    (tmp_path / "node0" / LATEST).write_text("step90")  # a run continued from an older checkpoint names it latest
    assert how_to_continue(tmp_path).startswith(f"kept in {tmp_path}: node0 step90, node2 step105")


def test_a_failed_launch_ends_with_the_culprits_line_after_what_was_kept(tmp_path: Path) -> None:
    """The culprit's line is the last (the project's one line naming what failed and what to do); what was kept is
    said before it, never as "continue with --resume", which contradicted a refusal that the kept state cannot simply
    be resumed. Ctrl-C, which has no culprit, still ends with how to continue."""
    culprit = "error: state.json: written by an earlier spes; ... or start a new run"
    assert ending(tmp_path, culprit) == [culprit]  # nothing kept: nothing to say of it
    assert ending(tmp_path, None) == [how_to_continue(tmp_path)]
    (tmp_path / "node0" / "step4").mkdir(parents=True)
    (tmp_path / "node0" / "step4" / META_FILE).write_text("{}")
    assert ending(tmp_path, culprit) == [
        f"kept in {tmp_path}: node0 step4; once the error below is dealt with, {RESUME} continue from there, or "
        "another --out (quickstart: OUT=...) starts a new run",
        culprit,
    ]
    assert ending(tmp_path, None) == [f"kept in {tmp_path}: node0 step4; continue with {RESUME}"]


def test_a_damaged_run_record_or_latest_is_named_not_a_traceback_nor_none_complete(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An emptied server_state/run.json was a JSONDecodeError traceback at --resume (and after a failed run), and a
    node whose `latest` was damaged read "none complete" beside a complete checkpoint the resume then refused."""
    (tmp_path / "server_state").mkdir()
    (tmp_path / "server_state" / "run.json").write_text("")
    with pytest.raises(ConfigError, match=r"server_state/run.json: not a spes run record \(.*\); pick another --out"):
        resume_flags(tmp_path, True)
    assert spes.launch.main([TINY, f"--out={tmp_path}", "--resume"]) == 2
    assert "not a spes run record" in capsys.readouterr().err
    (tmp_path / "node0" / "step20").mkdir(parents=True)
    (tmp_path / "node0" / "step20" / META_FILE).write_text("{}")
    (tmp_path / "node0" / LATEST).write_bytes(b"\xff\xfe")
    assert how_to_continue(tmp_path).startswith(
        f"kept in {tmp_path}: node0 none a resume takes ({tmp_path}/node0/latest: damaged"
    )


def test_the_readmes_quickstart_commands_run_one_after_another(tmp_path: Path) -> None:
    """The README showed `STEPS=800 bash run_scripts/quickstart.sh` as "a longer run": after the quickstart above it,
    that start was refused (output/quickstart holds a run). Each quickstart command the README gives after the
    first, run on the folder that first one left, must be admitted: a new run into its own OUT, or RESUME=1."""
    readme = (REPO / "README.md").read_text()
    written = re.findall(r"^((?:[A-Z_]+=\S+ )*)bash run_scripts/quickstart\.sh", readme, flags=re.MULTILINE)
    assert written[0] == "" and len(written) > 2  # the plain quickstart first, then its variants
    first = tmp_path / "output" / "quickstart"
    (first / "server_state").mkdir(parents=True)
    (first / "server_state" / "run.json").write_text(json.dumps({"run_id": "abc"}))
    for assignments in written[1:]:
        env = dict(a.split("=", 1) for a in assignments.split())
        resume_flags(tmp_path / env.get("OUT", "output/quickstart"), bool(env.get("RESUME")))


FAKE_SERVER = (
    "import socket, sys, time; time.sleep(1.5); s = socket.socket(); s.bind(('127.0.0.1', int(sys.argv[1]))); "
    "s.listen(); time.sleep(60)"
)
FAKE_PEER = """import socket, sys
try:
    socket.create_connection(('127.0.0.1', int(sys.argv[1])), timeout=5).close()
    print('joined')
except OSError as err:
    print(f'refused: {err}')
"""


@pytest.mark.timeout(60)
def test_the_peers_start_once_the_server_listens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], launcher_signals: None
) -> None:
    """Peers started beside a server still importing torch each printed a refused join and its retries, noise in
    every quickstart on a machine where nothing failed."""
    python = sys.executable
    monkeypatch.setattr(
        spes.launch, "server_command", lambda config, run, port, out: [python, "-c", FAKE_SERVER, f"{port}"]
    )
    monkeypatch.setattr(
        spes.launch, "peer_command", lambda config, run, peer, seed, port, out: [python, "-c", FAKE_PEER, f"{port}"]
    )

    def peers_exited(procs: dict[str, subprocess.Popen], follow: Path, offset: int, timeout: float) -> tuple[int, str]:
        code = max(p.wait(30) for name, p in procs.items() if name != "server") + 1  # 1: no summary to read
        return code, "error: no summary to read"

    monkeypatch.setattr(spes.launch, "_wait", peers_exited)
    assert spes.launch.main([TINY, "--out", str(tmp_path)]) == 1
    assert [(tmp_path / f"peer{i}.log").read_text() for i in range(4)] == ["joined\n"] * 4


STOPPING_CHILD = """import os, signal, socket, sys, time
signal.signal(signal.SIGTERM, lambda *_: sys.exit(print('stopped on SIGTERM', flush=True)))
if sys.argv[2] == 'server':
    s = socket.socket(); s.bind(('127.0.0.1', int(sys.argv[1]))); s.listen()
print('up', os.getpid(), flush=True)
time.sleep(60)
"""
LAUNCHER_ON_A_TERMINAL = f"""import signal, sys
for sig in (signal.SIGHUP, signal.SIGQUIT):  # as in a terminal's foreground job, whatever the test runner ignores
    signal.signal(sig, signal.SIG_DFL)
signal.signal(signal.SIGINT, signal.default_int_handler)
import spes.launch
child = [sys.executable, '-c', {STOPPING_CHILD!r}]
spes.launch.server_command = lambda config, run, port, out: [*child, str(port), 'server']
spes.launch.peer_command = lambda config, run, peer, seed, port, out: [*child, str(port), 'peer']
raise SystemExit(spes.launch.main(sys.argv[1:]))
"""


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize(("sig", "code", "last_word"), [(signal.SIGHUP, 130, "stopped"), (signal.SIGQUIT, 131, "up")])
def test_a_hangup_stops_every_child_and_a_quit_kills_them_none_left_running(
    tmp_path: Path, sig: signal.Signals, code: int, last_word: str
) -> None:
    """The launcher died of a closed terminal's SIGHUP or of Ctrl-\\ (SIGQUIT) at once, and its server and peers, in
    sessions of their own that the terminal's signal never reaches, trained on with nobody to stop them. A SIGHUP
    stops them as SIGTERM does (each saves); a SIGQUIT kills them now."""
    proc = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER_ON_A_TERMINAL, TINY, "--out", str(tmp_path)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().startswith("started server on 127.0.0.1:")
        logs = [tmp_path / f"{name}.log" for name in ("server", "peer0", "peer1", "peer2", "peer3")]
        deadline = time.monotonic() + 30
        while not all(log.is_file() and "up" in log.read_text() for log in logs) and time.monotonic() < deadline:
            time.sleep(0.1)
        os.killpg(proc.pid, sig)
        _, stderr = proc.communicate(timeout=30)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == code, stderr
    said = [log.read_text().splitlines() for log in logs]
    assert [lines[-1].split()[0] for lines in said] == [last_word] * 5
    assert [pid for lines in said if psutil.pid_exists(pid := int(lines[0].split()[1]))] == []


FAILING_PEER = """import pathlib, sys
step = pathlib.Path(sys.argv[1]) / 'node0' / 'step4'
step.mkdir(parents=True)
(step / sys.argv[2]).write_text('{}')
print('error: cannot save the checkpoint of step 8: no space left on device', flush=True)
sys.exit(6)
"""


@pytest.mark.timeout(60)
def test_a_failed_peer_ends_the_launch_with_its_exit_code_and_its_line_last(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], launcher_signals: None
) -> None:
    """A peer that ended on a full disk (exit 6) ended the launch with exit 1, its kind lost; its line, what failed
    and what to do, is the last, what was kept before it with the launcher's own way to continue (`--resume`)."""
    python = sys.executable
    listening = "import socket, sys, time; s = socket.socket(); s.bind(('127.0.0.1', int(sys.argv[1]))); s.listen(); "
    monkeypatch.setattr(
        spes.launch,
        "server_command",
        lambda config, run, port, out: [python, "-c", listening + "time.sleep(60)", f"{port}"],
    )
    monkeypatch.setattr(
        spes.launch,
        "peer_command",
        lambda config, run, peer, seed, port, out: (
            [python, "-c", FAILING_PEER, str(out), META_FILE] if peer == 0 else ["sleep", "60"]
        ),
    )
    assert spes.launch.main([TINY, "--out", str(tmp_path)]) == 6
    err = capsys.readouterr().err.splitlines()
    assert err[-3:] == [
        f"peer0 exited with code 6; its log: {tmp_path / 'peer0.log'}",
        f"kept in {tmp_path}: node0 step4; once the error below is dealt with, --resume and the same overrides after "
        "`--` (quickstart: RESUME=1 and the same settings) continue from there, or another --out (quickstart: "
        "OUT=...) starts a new run",
        "error: cannot save the checkpoint of step 8: no space left on device",
    ]


@pytest.mark.timeout(120)
def test_a_resume_the_server_refuses_ends_with_its_refusal_not_continue_with_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], launcher_signals: None
) -> None:
    """A real server on a state an earlier spes wrote refuses to resume it ("finish this run with the spes version
    that started it ... or start a new run"); the launch then said "continue with --resume" after that line, the
    last word contradicting the refusal. The peers here only wait."""
    state = tmp_path / "server_state"
    state.mkdir()
    (state / "run.json").write_text(json.dumps({"run_id": "abc"}))
    (state / "state.json").write_text(json.dumps({"format": 1}))
    waiting = ["sh", "-c", "sleep 60", "peer"]  # NOTE: the resume flags come after it, as $1 ...
    monkeypatch.setattr(spes.launch, "peer_command", lambda config, run, peer, seed, port, out: waiting)
    assert spes.launch.main([TINY, "--out", str(tmp_path), "--resume"]) == 2
    *_, exited, kept, refusal = capsys.readouterr().err.splitlines()
    assert exited == f"server exited with code 2; its log: {tmp_path / 'server.log'}"
    assert kept.startswith(f"kept in {tmp_path}: no node checkpoint and the server state; once the error below is ")
    assert refusal.startswith(f"error: {state / 'state.json'}: written by an earlier spes (server state format 1")
    assert refusal.endswith("or start a new run (a fresh --state_dir, every node without --resume)")


def test_waiting_for_a_server_ends_when_it_exits() -> None:
    """A server that fails at its start must not hold the launcher for the whole wait (its failure is reported)."""
    server = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    started = time.monotonic()
    spes.launch._await_listening(server, spes.launch.free_port(), 30.0)
    assert time.monotonic() - started < 10
    assert server.wait() == 3


def test_the_codec_flag_takes_only_a_codec(capsys: pytest.CaptureFixture[str]) -> None:
    """argparse's wording of the choices differs between Python versions: the flag, the value and each codec."""
    line = usage_error(capsys, lambda: parse_args([TINY, "--codec=int4"]))
    assert line.startswith("python -m spes.launch: error: argument --codec: invalid choice: 'int4' (choose from ")
    assert all(name in line for name in CODECS)
    assert parse_args([TINY, "--codec=sparse"])[0].codec == "sparse"


def test_the_baseline_flag_takes_the_papers_spelling_too(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """--dilico (the reference's using_dilico) and --diloco (the paper's DiLoCo) both run the baseline."""
    for flag in ("--dilico", "--diloco"):
        args, overrides = parse_args([TINY, flag])
        assert args.dilico is True and load_run(args, overrides)[1] == ["--using_dilico=true"], flag
    assert parse_args([TINY])[0].dilico is False
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit) as exit_:
        parse_args([TINY, "--help"])
    assert exit_.value.code == 0
    shown = " ".join(capsys.readouterr().out.split())
    assert "--dilico, --diloco DiLoCo/FedAvg baseline: peers train and average everything" in shown


def test_a_centralized_run_is_refused_naming_what_made_it_one() -> None:
    """`spes.launch configs/tiny.yaml -- --using_spes=false` said "configs/tiny.yaml is a centralized run", of a
    file that sets using_spes: true."""
    with pytest.raises(ConfigError) as refused:
        load_run(*parse_args([TINY, "--", "--using_spes=false", "--max_duration=5st"]))
    assert str(refused.value) == (
        f"{TINY} with --using_spes=false --max_duration=5st is a centralized run (using_spes: false): train it with "
        f"python -m spes.train {TINY} --using_spes=false --max_duration=5st, which needs no server"
    )


def test_an_override_before_the_double_dash_is_refused_saying_where_it_goes(capsys: pytest.CaptureFixture[str]) -> None:
    """spes.train takes `--max_duration=40st` as it is; the launcher takes it after `--`, and said only
    'unrecognized arguments'."""
    line = usage_error(capsys, lambda: parse_args([TINY, "--max_duration=40st"]))
    assert line == (
        "python -m spes.launch: error: unrecognized arguments: --max_duration=40st (an override of the run's config "
        f"goes after `--`, e.g. python -m spes.launch {TINY} -- --max_duration=40st)"
    )
    line = usage_error(capsys, lambda: parse_args([TINY, "--eval_peres=1"]))  # a mistyped flag of the launcher's
    assert line.startswith(
        "python -m spes.launch: error: unrecognized arguments: --eval_peres=1; did you mean --eval_peers? (an override"
    ), line


def test_the_help_says_where_overrides_go_and_each_default(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The module's examples and the flags' defaults were in the source only: --help showed neither the `--` that
    overrides follow nor where the run lands without --out."""
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit) as exit_:
        parse_args([TINY, "--help"])
    assert exit_.value.code == 0
    shown = capsys.readouterr().out
    assert shown.startswith("usage: python -m spes.launch CONFIG [options] [-- --section.key=value ...]\n")
    assert "python -m spes.launch configs/tiny.yaml -- --max_duration=200st" in shown
    flat = " ".join(shown.split())
    assert "summary.json (default: output/local_run)" in flat and "seconds (default: 1800)" in flat


def test_the_summary_names_the_runs_mode(tmp_path: Path) -> None:
    """A DiLoCo run's summary was headed "SPES run summary": a baseline's figures read as SPES's."""
    (tmp_path / "node0").mkdir()
    round_ = {"sync_s": 0.1, "sync_wait_s": 0.25, "sync_mb_up": 2.0, "sync_mb_down": 2.0}
    records = [{"step": 5, "loss": 7.0, "tokens": 80, **round_}, {"step": 6, "loss": 6.0, "tokens": 96}]
    (tmp_path / "node0" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    for mode, title in (("diloco", "DiLoCo"), ("spes", "SPES")):
        summary = summarize(tmp_path, 1, 3.0, mode)
        assert summary["mode"] == mode and summary["peers"][0]["rounds"] == 1
        table = format_summary(summary).splitlines()
        assert table[1].startswith(f"{title} run summary (val = validation loss")
        assert table[2].endswith("MiB up MiB down  sync s  wait s") and table[4].split()[-2:] == ["0.10", "0.25"]
    readme = (REPO / "README.md").read_text()
    assert "\n".join(table[1:3]) + "\n" in readme  # the quickstart's table as the README shows it


@pytest.mark.parametrize(("overrides", "said"), [([], None), (["--stop_at=6"], 6), (["--stop_at=12"], None)])
def test_a_launch_that_stop_at_ended_says_the_run_is_unfinished(
    overrides: list[str],
    said: int | None,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Only peer0's progress bar said `(stop_at 6)`: the summary, the launch's last word, read as a finished run's.
    (Its processes are stubs: what is tested is the launcher's account of a run that went well.)"""
    monkeypatch.setattr(spes.launch, "_spawn", lambda *args: None)
    monkeypatch.setattr(spes.launch, "_await_listening", lambda *args: None)
    monkeypatch.setattr(spes.launch, "_wait", lambda *args: (0, None))
    monkeypatch.setattr(spes.launch, "_stop_all", lambda procs: None)
    monkeypatch.setattr(spes.launch, "summarize", lambda *args: {"mode": "spes", "peers": [], "wall_s": 0.0})
    assert spes.launch.main([TINY, "--out", str(tmp_path), "--", "--max_duration=12st", *overrides]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["stop_at"], summary["run_steps"]) == (said, 12)
    if said is None:
        assert last == "wall time 0s; every process exited cleanly"
    else:
        assert last == (
            "stopped at step 6 of 12 (stop_at): the run is unfinished, continue with --resume and the same overrides "
            "after `--`, stop_at larger or left out"
        )


def test_resume_auto_continues_the_run_out_holds_or_starts_one_when_it_holds_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node's line ("continue with --resume=auto") ended a failed launch, whose --resume took no value: the user
    who followed it got an argparse error. (Its processes are stubs: what is tested is what the peers are told.)"""
    started: list[tuple[list[str], bool]] = []
    monkeypatch.setattr(spes.launch, "_spawn", lambda cmd, log, env, resume: started.append((cmd, resume)))
    monkeypatch.setattr(spes.launch, "_await_listening", lambda *args: None)
    monkeypatch.setattr(spes.launch, "_wait", lambda *args: (2, "error: stub"))
    monkeypatch.setattr(spes.launch, "_stop_all", lambda procs: None)
    assert spes.launch.main([TINY, "--out", str(tmp_path), "--resume=auto"]) == 2
    assert started and not any(resume or "--resume=auto" in cmd for cmd, resume in started)  # a fresh run
    (tmp_path / "node0").mkdir()
    (tmp_path / "node0" / LATEST).write_text("step20")
    started.clear()
    assert spes.launch.main([TINY, "--out", str(tmp_path), "--resume=auto"]) == 2
    assert all(resume for _, resume in started) and all("--resume=auto" in cmd for cmd, _ in started[1:])


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_diloco_run_says_so_and_averages_everything(tiny_corpus, tmp_path: Path) -> None:
    """`spes.launch --dilico` as running.md shows it, with the outer Nesterov step: every peer trains every expert,
    the start line and the summary name the baseline, and after the last round both peers hold the same model."""
    out = tmp_path / "run"
    overrides = [
        f"--tokenizer.identifier={tiny_corpus.tokenizer}",
        f"--data.paths=[{tiny_corpus.train}]",
        f"--data.validation_paths=[{tiny_corpus.valid}]",
        "--spes_config.num_peers=2",
        "--spes_config.sync_steps=5",
        "--server.outer_optimizer=nesterov",
        "--max_duration=10st",
        "--eval_interval=10",
        "--eval_subset_num_batches=1",
    ]
    argv = [sys.executable, "-m", "spes.launch", TINY, "--dilico", "--out", str(out), "--", *overrides]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=220)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "2 peers (DiLoCo run, data seeds [6198, 7198])" in done.stdout
    assert "\nDiLoCo run summary (val = validation loss" in done.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mode"] == "diloco"
    assert [(r["rounds"], r["merge_rounds"]) for r in summary["peers"]] == [(2, 0)] * 2
    assert len({r["val_merged_last"] for r in summary["peers"]}) == 1
    for peer in (0, 1):
        assert "experts: trains all 8 of every MoE layer" in (out / f"peer{peer}.log").read_text()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_sigterm_to_the_launcher_stops_the_server_and_every_peer(tiny_corpus, tmp_path: Path) -> None:
    out = tmp_path / "run"
    overrides = [
        f"--tokenizer.identifier={tiny_corpus.tokenizer}",
        f"--data.paths=[{tiny_corpus.train}]",
        "--spes_config.num_peers=2",
        "--spes_config.num_train_experts_per_node=4",
        "--max_duration=100000st",
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "spes.launch", TINY, "--out", str(out), "--", *overrides],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # the peers are started once this line is printed
            if line.startswith("started server"):
                break
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130
    assert "interrupted: the peers save a checkpoint and stop, then the server\n" in stderr
    leftovers = [p for p in psutil.process_iter(["cmdline"]) if str(out) in " ".join(p.info["cmdline"] or [])]
    assert leftovers == []


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_run_single_node_reads_in_its_peers_data_order_and_saves_the_run_config(tiny_corpus, tmp_path: Path) -> None:
    env = {**os.environ, "CONFIG": TINY, "NPROC_PER_NODE": "1", "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            "bash",
            "run_scripts/run_single_node.sh",
            "2",
            "--using_spes=false",
            "--max_duration=2st",
            *tiny_corpus.overrides(tmp_path),
            "--eval_interval=null",
            "--server.merge_interval=7",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # one file for every node (CONFIG): node 2 gets the file's data.seed + 1000 * 2, as the first implementation's
    # launchers gave their nodes
    assert "data order seed 8198 (data.seed)" in proc.stdout
    config = yaml.safe_load((tmp_path / "step2" / "config.yaml").read_text())
    assert config["data"]["seed"] == 8198 and config["spes_config"]["peer_id"] == 2
    assert config["server"]["merge_interval"] == 7  # the merge schedule is saved with the run's config
    meta = json.loads((tmp_path / "step2" / "meta.json").read_text())
    assert meta["trainer"]["data"]["seed"] == 8198  # the loader read in node 2's order


@pytest.mark.timeout(60)
def test_run_single_node_started_elsewhere_takes_a_relative_config_from_there_and_says_where_paths_go(
    tmp_path: Path,
) -> None:
    """From another folder, CONFIG=node.yaml beside the user was "not found" (the script runs in the repository), and
    relative paths in the config and the overrides went into the repository unsaid. Checked with a PYTHON that
    records what the node is started with."""
    here = tmp_path / "my runs ü"
    here.mkdir()
    (here / "node ü.yaml").write_text((REPO / "configs" / "tiny.yaml").read_text())
    python, args = tmp_path / "python", tmp_path / "args"
    python.write_text(
        f"""#!/bin/bash
case "$1 $2" in
  "-m spes.preflight") echo "1 the CPU" ;;
  "-m spes.torchrun") printf '%s\\n' "$@" > {shlex.quote(str(args))} ;;
  *) exec {shlex.quote(sys.executable)} "$@" ;;
esac
"""
    )
    python.chmod(0o755)
    env = {**os.environ, "CONFIG": "node ü.yaml", "PYTHON": str(python), "PYTHONPATH": str(REPO)}
    script = str(REPO / "run_scripts" / "run_single_node.sh")
    proc = subprocess.run(["bash", script, "0"], cwd=here, env=env, capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == (
        f"node 0: 1 process(es) on the CPU, config {here}/node ü.yaml; relative paths in it and in the overrides are "
        f"read from the repository, {REPO}"
    )
    assert f"{here}/node ü.yaml" in args.read_text().splitlines()
    proc = subprocess.run(["bash", script, "0"], cwd=REPO, env=env, capture_output=True, text=True, timeout=50)
    assert proc.returncode == 2 and proc.stderr == "error: config node ü.yaml not found (set CONFIG or CONFIG_DIR)\n"


def test_run_single_node_needs_a_node_id() -> None:
    proc = subprocess.run(["bash", "run_scripts/run_single_node.sh"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 2 and "usage" in proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_failing_peer_ends_the_local_run_with_its_error_line(tiny_corpus, tmp_path: Path) -> None:
    overrides = [
        f"--tokenizer.identifier={tiny_corpus.tokenizer}",
        f"--data.paths=[{tmp_path}/none/*.npy]",
        "--spes_config.num_peers=1",
        "--spes_config.num_train_experts_per_node=8",
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "spes.launch", TINY, "--out", str(tmp_path / "run"), "--", *overrides],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stdout + proc.stderr  # the peer's: a data error
    *_, kept, error = proc.stderr.strip().splitlines()
    assert error.startswith("error: data.paths: data path pattern"), proc.stderr
    assert kept.startswith(
        f"kept in {tmp_path / 'run'}: no node checkpoint and the server state; once the error below is dealt with, "
    )
