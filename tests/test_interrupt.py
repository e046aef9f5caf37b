"""Ctrl-C / SIGTERM: every node saves its last step (a round it waited for kept in flight) and `--resume` continues
exactly; a launcher's echo of the signal is not a second Ctrl-C."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import spes.interrupt
from conftest import Corpus, wait_until
from node_runs import (
    ENV,
    LAUNCH_STOP_GRACE_S,
    REPO,
    TINY,
    assert_same_models,
    launch,
    node_models,
    reaped,
    start_node,
    start_server,
)
from spes.config import SpesConfig
from spes.interrupt import (
    ECHO_S,
    Interruptible,
    Stopped,
    StopRequest,
    outliving_readers,
    still_read,
    stop_signals,
)
from spes.save_folder import META_FILE
from spes.sync.channel import open_channel
from spes.sync.proto import spes_pb2 as pb
from spes.sync.proto import spes_pb2_grpc as pb_grpc
from terminal_helpers import on_a_terminal, read_until


def aborts(sig: signal.Signals) -> bool:
    """Whether signalling this process raised KeyboardInterrupt (a StopRequest's abort): a result the test asserts
    on, not an interrupt of the test session (as mutmut would take it)."""
    try:
        os.kill(os.getpid(), sig)
    except KeyboardInterrupt:
        return True
    return False


class Clock:
    """A stand-in for spes.interrupt's clock: time.monotonic() reads `now`."""

    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    stand_in = Clock()
    monkeypatch.setattr(spes.interrupt, "time", stand_in)
    return stand_in


SIGNALS = (signal.SIGINT, signal.SIGTERM)


@pytest.fixture
def outer() -> Iterator[list[int]]:
    """The signals that reached the handlers in place before a StopRequest: recorders, so that a signal a StopRequest
    fails to catch neither ends the test's process nor interrupts its session."""
    reached: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, _frame: reached.append(signum)) for sig in SIGNALS}
    yield reached
    for sig, handler in previous.items():
        signal.signal(sig, handler)


def test_a_signal_echoed_by_the_launcher_is_the_same_request_and_a_later_one_aborts(
    outer: list[int], clock: Clock
) -> None:
    said: list[str] = []
    stop = StopRequest(said.append)
    assert stop.requested is False
    with stop:
        first = clock.now
        assert not aborts(signal.SIGINT)
        clock.now = first + spes.interrupt.ECHO_S - 0.001
        assert not aborts(signal.SIGTERM)  # torchrun / srun passing it on
        assert stop.requested is True
        assert said == [
            "received SIGINT: saving a checkpoint after this step (press Ctrl-C again after 2 s to abort without "
            "saving)"
        ]
        clock.now = first + spes.interrupt.ECHO_S  # ECHO_S after the first: another request, an abort
        assert aborts(signal.SIGTERM)
    assert outer == []
    assert [aborts(sig) for sig in SIGNALS] == [False, False] and outer == list(SIGNALS)  # the handlers before, back


def test_off_the_main_thread_a_stop_request_changes_no_handler(outer: list[int]) -> None:
    """Python sets signal handlers from the main thread only: a StopRequest entered elsewhere leaves them."""
    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(lambda: StopRequest(print).__enter__().previous).result() == {}
    assert [aborts(sig) for sig in SIGNALS] == [False, False] and outer == list(SIGNALS)


def test_outside_the_training_loop_sigterm_interrupts_as_ctrl_c_and_a_launchers_echo_does_not(
    outer: list[int], clock: Clock
) -> None:
    """SIGTERM killed a node still being built outright, leaving no word of what its save folder held; and torchrun's
    echo of the terminal's Ctrl-C interrupted the node's unwinding of the first."""
    with Interruptible():
        first = clock.now
        assert aborts(signal.SIGTERM)
        clock.now = first + ECHO_S - 0.001
        assert not aborts(signal.SIGINT)
        clock.now = first + ECHO_S  # another request: it interrupts the unwinding too
        assert aborts(signal.SIGINT)
    assert outer == []
    assert [aborts(sig) for sig in SIGNALS] == [False, False] and outer == list(SIGNALS)


def test_the_echo_of_a_stop_request_arriving_after_the_training_loop_is_ignored_too(
    outer: list[int], clock: Clock
) -> None:
    """A loop that saved and ended within ECHO_S of the signal: its echo reached the handler back in place, which
    took it for a new interrupt and the node said it ended without saving."""
    with Interruptible():
        with StopRequest(lambda _said: None) as stop:
            first = clock.now
            assert not aborts(signal.SIGINT) and stop.requested
        clock.now = first + ECHO_S - 0.001
        assert not aborts(signal.SIGINT)
        clock.now = first + ECHO_S
        assert aborts(signal.SIGTERM)
    assert outer == []


def test_a_node_leaving_on_an_error_ignores_the_first_signal_and_a_later_one_interrupts(
    outer: list[int], clock: Clock
) -> None:
    """Every rank of a node agrees on a non-finite step and leaves; torchrun signals the ranks still unwinding once the
    first exits, and the KeyboardInterrupt raised in a rank's unwinding printed a traceback (failed once in CI)."""
    with Interruptible():
        with pytest.raises(RuntimeError, match="loss nan"), StopRequest(lambda _said: None):
            raise RuntimeError("step 3: loss nan")
        first = clock.now
        assert not aborts(signal.SIGTERM)
        clock.now = first + ECHO_S - 0.001
        assert not aborts(signal.SIGINT)
        clock.now = first + ECHO_S  # a user's Ctrl-C on a node stuck on its way out still interrupts it
        assert aborts(signal.SIGINT)
    assert outer == []
    with Interruptible():
        with pytest.raises(RuntimeError), StopRequest(lambda _said: None):
            raise RuntimeError("step 3: loss nan")
        with StopRequest(lambda _said: None):  # a clean handling after it leaves the node leaving
            pass
        assert not aborts(signal.SIGTERM)
    assert outer == []
    with Interruptible():  # a loop that ended cleanly leaves the handler interrupting at once
        with StopRequest(lambda _said: None):
            pass
        assert aborts(signal.SIGTERM)
    assert outer == []


@pytest.fixture(scope="module")
def reference(tiny_corpus: Corpus, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, torch.Tensor]]:
    """The run nobody interrupts: 2 peers, rounds at steps 4, 8 and 12."""
    out = tmp_path_factory.mktemp("reference")
    proc = launch(tiny_corpus, out)
    stdout, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 0, stdout[-2000:] + stderr[-2000:]
    return node_models(out)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_node_stopped_while_waiting_for_a_round_keeps_it_in_its_checkpoint_and_resumes_exactly(
    tiny_corpus: Corpus, reference: list[dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    server, port = start_server(tiny_corpus, tmp_path)
    with reaped(server) as procs:

        def node(peer: int, *flags: str) -> subprocess.Popen:
            procs.append(start_node(tiny_corpus, tmp_path, peer, port, *flags))
            return procs[-1]

        first = node(0)  # peer 1 is not there yet: peer 0 uploads the round of step 4 and waits for it
        with open_channel(SpesConfig(server_addr=f"127.0.0.1:{port}")) as channel:
            stub = pb_grpc.ParameterServerStub(channel)
            wait_until(lambda: list(stub.Status(pb.StatusRequest(), timeout=5).peers_uploaded) == [0], "the upload", 90)
        first.send_signal(signal.SIGINT)
        assert first.wait(timeout=60) == 130  # the alternative, waiting for a round peer 1 never joins, never ends
        log = (tmp_path / "node0.log").read_text()
        assert "stopped at step 4" in log, log[-2000:]
        assert (tmp_path / "node0" / "step4" / "pending_round.st").is_file()

        resumed, second = node(0, "--resume"), node(1)
        assert resumed.wait(timeout=180) == 0 and second.wait(timeout=180) == 0
        log = (tmp_path / "node0.log").read_text()
        assert "step 4: applied the round the interrupted run was waiting for" in log, log[-2000:]
        rows = [json.loads(line) for line in (tmp_path / "node0" / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == list(range(1, 13)), "each step logged once"
        assert [r["step"] for r in rows if "sync_s" in r] == [4, 8, 12], "the resumed round's row too"
    assert_same_models(node_models(tmp_path), reference)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_ctrl_c_on_the_launcher_saves_every_node_within_seconds_and_resume_finishes_the_same_run(
    tiny_corpus: Corpus, reference: list[dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    out = tmp_path / "run"
    proc = launch(tiny_corpus, out)
    log0 = out / "peer0.log"
    # NOTE: stop the run between its first and second round, read from peer 0's own log: the launcher's echo of it
    # lags by up to its 0.5 s poll, long enough under load for the rest of this short run to finish first
    wait_until(lambda: log0.is_file() and "step 6/12" in log0.read_text(), "peer 0's step 6", 90)
    asked = time.monotonic()
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=90)
    assert proc.returncode == 130, stderr[-2000:]
    assert time.monotonic() - asked < LAUNCH_STOP_GRACE_S / 2  # no child was left to the grace, then killed
    assert "interrupted: the peers save a checkpoint and stop" in stderr
    for peer in (0, 1):
        log = (out / f"peer{peer}.log").read_text()
        assert "stopped at step" in log, log[-2000:]
    assert (out / "server_state" / "run.json").is_file()

    resumed = launch(tiny_corpus, out, "--resume")
    stdout, stderr = resumed.communicate(timeout=240)
    assert resumed.returncode == 0, stdout[-2000:] + stderr[-2000:]
    assert_same_models(node_models(out), reference)
    for peer in (0, 1):  # the resume's lines follow the first start's in the same log, echoed once
        log = (out / f"peer{peer}.log").read_text()
        assert log.index("stopped at step") < log.index("loaded ") < log.index("done: step 12"), log[-2000:]
    assert "stopped at step" not in stdout and "[peer0] loaded " in stdout
    assert (out / "server.log").read_text().count("listening on") == 2


def test_a_trainers_stop_exits_130_and_names_the_step_it_saved() -> None:
    """A SystemExit (nothing on the way out takes it for a failure) that `spes.train` reads the saved step from."""
    stopped = Stopped(7)
    assert isinstance(stopped, SystemExit) and stopped.code == 130 and stopped.step == 7


def test_a_hangup_asks_to_stop_unless_the_process_was_started_to_ignore_it(outer: list[int]) -> None:
    """A closed terminal's SIGHUP killed a node outright, its steps since the last checkpoint lost (torchrun takes
    it as SIGTERM); under `nohup` it must stay ignored."""
    previous = signal.signal(signal.SIGHUP, lambda _signum, _frame: None)  # NOTE: a hangup missed ends no test run
    try:
        assert stop_signals() == (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
        with Interruptible():
            assert aborts(signal.SIGHUP)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        assert stop_signals() == (signal.SIGINT, signal.SIGTERM)
        with Interruptible():
            assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_a_hangup_during_a_stop_under_way_aborts_nothing(outer: list[int], clock: Clock) -> None:
    """Ctrl-C, then the terminal closed (a laptop shut) more than ECHO_S later: its SIGHUP was taken for a second
    Ctrl-C, and the node (the launcher: its children) stopped without saving."""
    previous = signal.signal(signal.SIGHUP, lambda _signum, _frame: None)  # NOTE: a hangup missed ends no test run
    try:
        with StopRequest(lambda _said: None) as stop:
            assert not aborts(signal.SIGINT) and stop.requested
            clock.now += 10 * ECHO_S
            assert not aborts(signal.SIGHUP)
            assert aborts(signal.SIGINT)
        with Interruptible():
            assert aborts(signal.SIGINT)
            clock.now += 10 * ECHO_S
            assert not aborts(signal.SIGHUP)
            assert aborts(signal.SIGTERM)
    finally:
        signal.signal(signal.SIGHUP, previous)
    assert outer == []


def test_output_nobody_reads_any_more_is_dropped_and_said_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Python ignores SIGPIPE: a node piped into `head` died of a BrokenPipeError at its next progress line."""
    read, write = os.pipe()
    os.close(read)
    closed = open(write, "w")
    said = io.StringIO()
    monkeypatch.setattr(sys, "stdout", closed)
    monkeypatch.setattr(sys, "stderr", said)
    assert still_read(sys.stdout)
    with outliving_readers("note: nobody reads"):
        assert still_read(sys.stdout) and sys.stdout.fileno() == write  # NOTE: what it does not wrap is the stream's
        for _ in range(3):
            print("step 1", flush=True)
        assert not still_read(sys.stdout) and still_read(sys.stderr)  # NOTE: a `--watch` ends on it
    assert sys.stdout is closed and said.getvalue() == "note: nobody reads\n" and still_read(sys.stdout)
    closed.close()  # NOTE: its buffer went to /dev/null: no error left to raise


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_node_whose_terminal_hangs_up_saves_its_last_step_and_stops(tiny_corpus: Corpus, tmp_path: Path) -> None:
    """A closed terminal (SIGHUP, then EIO on every write to it) killed a training node at once: no checkpoint, its
    steps since the last one lost. Now it saves as on SIGTERM (exit 130), its last words to a terminal gone."""
    argv = ["-m", "spes.train", TINY, *tiny_corpus.overrides(tmp_path / "node"), "--using_spes=false"]
    proc, master = on_a_terminal([*argv, "--eval_interval=null", "--max_duration=1000st", "--save_interval=1000"], ENV)
    with reaped(proc):
        seen = read_until(master, b"step 3/", 90)
        assert b"step 3/" in seen, seen[-2000:]
        os.close(master)
        assert proc.wait(timeout=60) == 130
    saved = tmp_path / "node" / (tmp_path / "node" / "latest").read_text().strip()
    assert (saved / META_FILE).is_file()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_node_piped_into_a_reader_that_stops_early_trains_on_to_its_end(tiny_corpus: Corpus, tmp_path: Path) -> None:
    """`spes.train ... | head` ended the run at its next progress line in a BrokenPipeError (exit 6, nothing saved)."""
    argv = [sys.executable, "-m", "spes.train", TINY, *tiny_corpus.overrides(tmp_path / "node"), "--using_spes=false"]
    read, write = os.pipe()
    os.close(read)  # `| head -n 0`: the reader has gone before the first line
    with open(write, "wb") as stdout:
        proc = subprocess.Popen(
            [*argv, "--eval_interval=null", "--max_duration=4st", "--save_interval=null"],
            cwd=REPO,
            env=ENV,
            stdout=stdout,
            stderr=subprocess.PIPE,
            text=True,
        )
    with reaped(proc):
        _, stderr = proc.communicate(timeout=90)
    assert proc.returncode == 0, stderr[-2000:]
    assert "Traceback" not in stderr and stderr.count("note: nobody reads this node's output any more") == 1, stderr
    rows = (tmp_path / "node" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(row)["step"] for row in rows] == [1, 2, 3, 4]
