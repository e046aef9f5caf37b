"""Ctrl-C / SIGTERM: every node saves its last step (a round it waited for kept in flight) and `--resume` continues
exactly; a launcher's echo of the signal is not a second Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import spes.interrupt
from conftest import Corpus
from spes.config import SpesConfig
from spes.interrupt import StopRequest
from spes.sync.client import open_channel
from spes.sync.proto import spes_pb2 as pb
from spes.sync.proto import spes_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny.yaml")
RUN = [
    "--spes_config.num_peers=2",
    "--spes_config.num_train_experts_per_node=4",
    "--spes_config.sync_steps=4",
    "--max_duration=12st",
    "--eval_interval=null",
    "--save_interval=12",
]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}


def test_a_signal_echoed_by_the_launcher_is_the_same_request_and_a_later_one_aborts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    said: list[str] = []
    with StopRequest(said.append) as stop:
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGTERM)  # torchrun / srun passing it on
        assert stop.requested and len(said) == 1 and "saving a checkpoint" in said[0]
        monkeypatch.setattr(spes.interrupt, "ECHO_S", 0.0)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)


def _corpus(corpus: Corpus) -> list[str]:
    return [f"--tokenizer.identifier={corpus.tokenizer}", f"--data.paths=[{corpus.train}]", "--data.validation_paths=[]"]


def _models(out: Path) -> list[dict[str, torch.Tensor]]:
    """Each node's newest checkpointed weights."""
    nodes = [out / "node0", out / "node1"]
    return [load_file(str(n / (n / "latest").read_text().strip() / "model.safetensors")) for n in nodes]


def _assert_same(got: list[dict[str, torch.Tensor]], want: list[dict[str, torch.Tensor]]) -> None:
    for g, w in zip(got, want):
        assert g.keys() == w.keys()
        assert all(torch.equal(g[n], w[n]) for n in w), [n for n in w if not torch.equal(g[n], w[n])][:3]


def _launch(corpus: Corpus, out: Path, *flags: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "spes.launch", TINY, "--out", str(out), *flags, "--", *_corpus(corpus), *RUN]
    return subprocess.Popen(argv, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def reference(tiny_corpus: Corpus, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, torch.Tensor]]:
    """The run nobody interrupts: 2 peers, rounds at steps 4, 8 and 12."""
    out = tmp_path_factory.mktemp("reference")
    proc = _launch(tiny_corpus, out)
    stdout, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 0, stdout[-2000:] + stderr[-2000:]
    return _models(out)


def _start(argv: list[str], log: Path) -> subprocess.Popen:
    with open(log, "ab") as f:
        return subprocess.Popen(argv, cwd=REPO, env=ENV, stdout=f, stderr=subprocess.STDOUT)


def _wait_for(predicate, what: str, timeout_s: float = 90) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_node_stopped_while_waiting_for_a_round_keeps_it_in_its_checkpoint_and_resumes_exactly(
    tiny_corpus: Corpus, reference: list[dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    server_log = tmp_path / "server.log"
    server = _start(
        [sys.executable, "-m", "spes.server", TINY, *_corpus(tiny_corpus), *RUN, "--host", "127.0.0.1", "--port", "0"]
        + ["--data_port", "0", "--state_dir", str(tmp_path / "server_state")],
        server_log,
    )
    procs = [server]
    try:
        _wait_for(lambda: "listening on 127.0.0.1:" in server_log.read_text(), "the server")
        port = int(server_log.read_text().split("listening on 127.0.0.1:")[1].split()[0])

        def node(peer: int, *flags: str) -> subprocess.Popen:
            argv = [sys.executable, "-m", "spes.train", TINY, *_corpus(tiny_corpus), *RUN, *flags]
            argv += [f"--spes_config.peer_id={peer}", f"--spes_config.server_addr=127.0.0.1:{port}"]
            procs.append(_start([*argv, f"--save_folder={tmp_path}/node{peer}"], tmp_path / f"node{peer}.log"))
            return procs[-1]

        first = node(0)  # peer 1 is not there yet: peer 0 uploads the round of step 4 and waits for it
        with open_channel(SpesConfig(server_addr=f"127.0.0.1:{port}")) as channel:
            stub = pb_grpc.ParameterServerStub(channel)
            _wait_for(lambda: list(stub.Status(pb.StatusRequest(), timeout=5).peers_uploaded) == [0], "the upload")
        asked = time.monotonic()
        first.send_signal(signal.SIGINT)
        assert first.wait(timeout=30) == 130
        assert time.monotonic() - asked < 10
        log = (tmp_path / "node0.log").read_text()
        assert "stopped at step 4" in log, log[-2000:]
        assert (tmp_path / "node0" / "step4" / "pending_round.st").is_file()

        resumed, second = node(0, "--resume"), node(1)
        assert resumed.wait(timeout=180) == 0 and second.wait(timeout=180) == 0
        log = (tmp_path / "node0.log").read_text()
        assert "step 4: applied the round the interrupted run was waiting for" in log, log[-2000:]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    _assert_same(_models(tmp_path), reference)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_ctrl_c_on_the_launcher_saves_every_node_within_seconds_and_resume_finishes_the_same_run(
    tiny_corpus: Corpus, reference: list[dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    out = tmp_path / "run"
    proc = _launch(tiny_corpus, out)
    assert proc.stdout is not None
    for line in proc.stdout:  # peer 0's log, echoed: stop the run between its first and second round
        if "step 6/12" in line:
            break
    asked = time.monotonic()
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr[-2000:]
    assert time.monotonic() - asked < 15
    assert "interrupted: the peers save a checkpoint and stop" in stderr
    for peer in (0, 1):
        log = (out / f"peer{peer}.log").read_text()
        assert "stopped at step" in log, log[-2000:]
    assert (out / "server_state" / "run.json").is_file()

    resumed = _launch(tiny_corpus, out, "--resume")
    stdout, stderr = resumed.communicate(timeout=240)
    assert resumed.returncode == 0, stdout[-2000:] + stderr[-2000:]
    _assert_same(_models(out), reference)
