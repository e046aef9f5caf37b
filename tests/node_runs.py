"""Real runs of configs/tiny.yaml: shortened to 2 peers and 12 steps (rounds at 4, 8 and 12), for the tests that stop,
kill or restart their processes (the nodes as `python -m spes.train` children, the launcher, their weights); and a
`python -m spes.train` child run to its end, its last line read as users read a failure (`train`, `assert_one_line`)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import load_file

from conftest import Corpus, wait_until
from dist_helpers import run_logged
from spes.config import node_data_seed

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
FAST = ["--using_spes=false", "--eval_interval=null", "--log_interval=1", "--save_interval=null", "--max_duration=2st"]
"""Overrides that make configs/tiny.yaml a centralized run of 2 steps that saves nothing."""
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}


def corpus_args(corpus: Corpus) -> list[str]:
    """Overrides that train configs/tiny.yaml on the test corpus, without validation."""
    return [
        f"--tokenizer.identifier={corpus.tokenizer}",
        f"--data.paths=[{corpus.train}]",
        "--data.validation_paths=[]",
    ]


def train(tmp_path: Path, *args: str, timeout: float = 90, name: str = "train.log") -> tuple[int, str]:
    """`python -m spes.train *args` run to its end, its output logged to `tmp_path / name`: exit code, output."""
    proc = run_logged([sys.executable, "-m", "spes.train", *args], tmp_path / name, timeout=timeout)
    return proc.returncode, proc.stdout


def assert_one_line(code: int, out: str, *expected: str) -> str:
    """A non-zero exit, no traceback, and the last line the error naming `expected`."""
    last = out.strip().splitlines()[-1] if out.strip() else ""
    assert code != 0 and "Traceback" not in out and last.startswith("error: "), out[-3000:]
    assert all(e in last for e in expected), last
    return last


@contextlib.contextmanager
def reaped(*started: subprocess.Popen) -> Iterator[list[subprocess.Popen]]:
    """A list of a test's child processes (`started`, and whatever it appends): each is killed and waited for on
    the way out, so that a failing assertion leaves no server or node running."""
    procs = list(started)
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
            p.wait()


def start(argv: list[str], log: Path) -> subprocess.Popen:
    """A child process of the repository's Python, its output appended to `log`."""
    with open(log, "ab") as f:
        return subprocess.Popen(argv, cwd=REPO, env=ENV, stdout=f, stderr=subprocess.STDOUT)


def start_server(corpus: Corpus, out: Path, port: int = 0, *flags: str) -> tuple[subprocess.Popen, int]:
    """The run's server (data plane on a free port, state in `out/server_state`; `flags` override the run's
    settings) and the port it listens on."""
    log = out / "server.log"
    mark = log.stat().st_size if log.exists() else 0
    argv = [sys.executable, "-m", "spes.server", TINY, *corpus_args(corpus), *RUN, *flags, "--host", "127.0.0.1"]
    proc = start([*argv, "--port", str(port), "--data_port", "0", "--state_dir", str(out / "server_state")], log)
    wait_until(lambda: "listening on 127.0.0.1:" in log.read_text()[mark:] or proc.poll() is not None, "the server", 90)
    text = log.read_text()[mark:]
    assert "listening on 127.0.0.1:" in text, text
    return proc, int(text.split("listening on 127.0.0.1:")[1].split()[0])


def start_node(corpus: Corpus, out: Path, peer: int, port: int, *flags: str) -> subprocess.Popen:
    """Node `peer` of the run, as spes.launch starts it (its data seed, save folder `out/node<peer>`)."""
    argv = [sys.executable, "-m", "spes.train", TINY, *corpus_args(corpus), *RUN, *flags]
    argv += [f"--spes_config.peer_id={peer}", f"--data.seed={node_data_seed(6198, peer)}"]
    argv += [f"--spes_config.server_addr=127.0.0.1:{port}", f"--save_folder={out}/node{peer}"]
    return start(argv, out / f"node{peer}.log")


def launch(corpus: Corpus, out: Path, *flags: str) -> subprocess.Popen:
    """`python -m spes.launch` of the run into `out`, its output piped, taking Ctrl-C as from a terminal."""
    argv = [sys.executable, "-c", CTRL_C_PRELUDE, TINY, "--out", str(out), *flags, "--", *corpus_args(corpus), *RUN]
    return subprocess.Popen(argv, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


LAUNCH_STOP_GRACE_S = 120.0
"""The launcher's grace for its children's stop in these runs (`spes.launch.STOP_GRACE_S`, 10 s in use): long enough
that a child it had to kill after the grace cannot pass for one that stopped by itself on a slow machine."""

CTRL_C_PRELUDE = (
    "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); import spes.launch; "
    f"spes.launch.STOP_GRACE_S = {LAUNCH_STOP_GRACE_S}; sys.argv[0] = 'spes.launch'; "
    "raise SystemExit(spes.launch.main())"
)
"""`python -m spes.launch` taking Ctrl-C as from a terminal, its grace `LAUNCH_STOP_GRACE_S`: a suite run in the
background (`cmd &` without job control) has SIGINT ignored and a child inherits that, so the launcher would not
stop; the child's own interpreter gives it Python's handler back. (Not a `preexec_fn`: Python code between fork and
exec of a process that uses gRPC can crash the child in gRPC's poller.)"""


def node_models(out: Path) -> list[dict[str, torch.Tensor]]:
    """Each node's newest checkpointed weights."""
    nodes = [out / "node0", out / "node1"]
    return [load_file(str(n / (n / "latest").read_text().strip() / "model.safetensors")) for n in nodes]


def assert_same_models(got: list[dict[str, torch.Tensor]], want: list[dict[str, torch.Tensor]]) -> None:
    for g, w in zip(got, want):
        assert g.keys() == w.keys()
        assert all(torch.equal(g[n], w[n]) for n in w), [n for n in w if not torch.equal(g[n], w[n])][:3]
