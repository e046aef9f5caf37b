"""Shared fixtures: a small real corpus (stdlib sources -> local BPE -> token shards) and the quickstart's run on it,
each made once per session; GPU tests (`@pytest.mark.gpu`) skipped without CUDA and counted in the summary line."""

from __future__ import annotations

import fcntl
import gc
import json
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from tqdm import tqdm

from spes.tokenizer import LoadedTokenizer, train_byte_level_bpe

REPO = Path(__file__).resolve().parents[1]
# NOTE: the suite runs two workers on two cores (run_scripts/test.sh). A torch process with a thread per core next to
# other busy processes runs many times slower (its threads wait on each other whenever one is descheduled: 108 s
# against 21 s to size bench/mini_repro_memory.py's models on a loaded machine), so the tests and every process
# they start use one torch thread unless OMP_NUM_THREADS says otherwise.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
# NOTE: tqdm's default lock is a process-shared semaphore made once: a process that dies holding it (a bar that raised
# while drawing leaves it held) blocks every process forked later from the same parent. mutmut forks each mutant's
# tests from one process: after a mutant of a bar's arguments, every later one hung until its timeout. Bars in tests
# need no lock across processes; a thread lock is each process's own.
tqdm.set_lock(threading.RLock())
GPU_SKIPPED = "gpu tests skipped: no CUDA"
"""The summary line's count of GPU tests this machine could not run ("= 480 passed, 3 gpu tests skipped: no CUDA
in ... ="), so a CI run that checked nothing on a GPU says so where it is read."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Without CUDA every `@pytest.mark.gpu` test skips, saying why."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=f"needs CUDA: no CUDA device on this machine (torch {torch.__version__})")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


def pytest_report_teststatus(report: pytest.TestReport, config: pytest.Config) -> tuple[str, str, str] | None:
    """A GPU test skipped on a machine without CUDA is counted under `GPU_SKIPPED`, not with the other skips."""
    if report.skipped and "gpu" in report.keywords and not torch.cuda.is_available():
        return GPU_SKIPPED, "s", "SKIPPED (no CUDA)"
    return None


_PRESENCE_REPORTED: set[int] = set()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """A module whose fixtures are torn down must leave no `SyncClient` open: its presence stream would live on,
    reopening itself to the address of a server long gone, and hold a peer id of the next server bound there (CI
    saw a benchmark's peer 0 refused as a duplicate of such a leftover)."""
    yield
    if nextitem is not None and nextitem.module is item.module:
        return
    left = [
        t for t in threading.enumerate() if t.name.startswith("spes-presence-") and t.ident not in _PRESENCE_REPORTED
    ]
    _PRESENCE_REPORTED.update(t.ident for t in left if t.ident is not None)
    if left:
        raise AssertionError(
            f"{item.nodeid.split('::')[0]} left {len(left)} SyncClient(s) open "
            f"({', '.join(t.name for t in left)}): close every client (use it as a context manager)"
        )


@dataclass(frozen=True)
class Corpus:
    root: Path
    tokenizer: Path
    train: str  # glob of training shards
    valid: str  # glob of validation shards

    def overrides(self, save_folder: Path | str) -> list[str]:
        """Overrides that point configs/tiny.yaml at this corpus and `save_folder`."""
        return [
            f"--tokenizer.identifier={self.tokenizer}",
            f"--data.paths=[{self.train}]",
            f"--data.validation_paths=[{self.valid}]",
            f"--save_folder={save_folder}",
        ]


def _write_docs(path: Path, files: list[Path]) -> None:
    with open(path, "w") as f:
        for p in files:
            f.write(json.dumps({"text": p.read_text(errors="replace")}) + "\n")


def _run(*args: str) -> None:
    subprocess.run([sys.executable, *args], check=True, capture_output=True, cwd=REPO, timeout=300)


def made_once(tmp_path_factory: pytest.TempPathFactory, name: str, make: Callable[[Path], None]) -> Path:
    """The folder `name` of a session fixture, filled by `make(folder)` once per test session, not once per xdist
    worker (the suite runs two, run_scripts/test.sh): the first worker to get here makes it under a file lock, the
    other waits, then finds it made (pytest-xdist's recipe for a session fixture made once)."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        folder = tmp_path_factory.mktemp(name)
        make(folder)
        return folder
    folder = tmp_path_factory.getbasetemp().parent / name  # NOTE: the parent of every worker's basetemp
    with open(f"{folder}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not (folder / ".made").is_file():
            shutil.rmtree(folder, ignore_errors=True)  # what a worker that failed to make it left
            folder.mkdir()
            make(folder)
            (folder / ".made").touch()
    return folder


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """No test may reach a model hub."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture
def dead_port() -> Iterator[int]:
    """A loopback port where no server is, nor can be while the test runs: bound and never listening, so a
    connection to it is refused (a port found free and released could be taken meanwhile by a server another
    test worker starts, and a node would then join that server's run)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


@pytest.fixture
def collections() -> Iterator[list[int]]:
    """The generation of every garbage collection that starts while the test runs."""
    seen: list[int] = []

    def record(phase: str, info: dict) -> None:
        if phase == "start":
            seen.append(info["generation"])

    gc.callbacks.append(record)
    try:
        yield seen
    finally:
        gc.callbacks.remove(record)


def usage_error(capsys: pytest.CaptureFixture[str], call: Callable[[], object]) -> str:
    """The line argparse printed when `call` exited 2 on a bad flag (`prog: error: ...`)."""
    with pytest.raises(SystemExit) as exit_:
        call()
    assert exit_.value.code == 2
    return capsys.readouterr().err.splitlines()[-1]


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    """Poll `condition` until it holds; fail naming `what` after `timeout_s` (a hand-off, not a fixed sleep)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout_s:g} s waiting for {what}"
        time.sleep(0.02)


def make_garbage(cycles: int = 5000) -> None:
    """Reference cycles: thousands of allocations past the collector's threshold (700), then unreachable."""
    for _ in range(cycles):
        a: list = []
        a.append(a)


def littering(trainer: Any) -> None:
    """Make each of `trainer`'s steps also make `make_garbage`'s cycles: enough that automatic collection, were it
    on, would run several times a step."""
    step = trainer.train_step

    def step_with_garbage(batch: torch.Tensor) -> dict:
        make_garbage()
        return step(batch)

    trainer.train_step = step_with_garbage


def tensorboard_scalars(log_dir: Path) -> dict[str, dict[int, float]]:
    """The scalars of the TensorBoard event files under `log_dir`: {tag: {step: value}}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> LoadedTokenizer:
    """A 512-token byte-level BPE, trained once per session (for tests that need a real tokenizer, not a corpus)."""
    from data_fixtures import tokenizer_training_texts

    return train_byte_level_bpe(
        tokenizer_training_texts(), vocab_size=512, output_dir=tmp_path_factory.getbasetemp() / "tokenizer"
    )


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory: pytest.TempPathFactory) -> Corpus:
    """~120 stdlib modules for training, 10 held out; a 4096-token byte-level BPE like configs/tiny.yaml expects.
    Tests only read it."""
    root = made_once(tmp_path_factory, "corpus", _make_corpus)
    return Corpus(
        root=root, tokenizer=root / "tok", train=str(root / "train" / "*.npy"), valid=str(root / "valid" / "*.npy")
    )


def _make_corpus(root: Path) -> None:
    stdlib = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    _write_docs(root / "train.jsonl", stdlib[:120])
    _write_docs(root / "valid.jsonl", stdlib[120:130])
    scripts = REPO / "data_process_scripts"
    _run(
        str(scripts / "train_tokenizer.py"),
        "--input",
        str(root / "train.jsonl"),
        "--output_dir",
        str(root / "tok"),
        "--vocab_size",
        "4096",
    )
    for split in ("train", "valid"):
        _run(
            str(scripts / "tokenize_data.py"),
            "--file_glob",
            str(root / f"{split}.jsonl"),
            "--tokenizer_name_or_path",
            str(root / "tok"),
            "--output_prefix",
            str(root / split / "part"),
            "--processes",
            "1",
        )


QUICKSTART = ["-m", "spes.launch", "configs/tiny.yaml"]
"""configs/tiny.yaml's header command (`.venv/bin/python -m spes.launch configs/tiny.yaml`, the core of
run_scripts/quickstart.sh), from `-m` on: what `quickstart_run` runs."""


@dataclass(frozen=True)
class LaunchedRun:
    """A finished `spes.launch` run: its command line, output and directory, and the processes still naming that
    directory right after the launcher returned (none, if it stopped all it started)."""

    argv: list[str]
    stdout: str
    out: Path
    leftovers: list[str]


@pytest.fixture(scope="session")
def quickstart_run(tiny_corpus: Corpus, tmp_path_factory: pytest.TempPathFactory) -> LaunchedRun:
    """The quickstart on the test corpus: server + 4 peers of configs/tiny.yaml, shortened to 20 steps (two rounds
    of 10, the second a merge round, validation after each, a checkpoint at the end). One run shared by the tests
    of the launcher (tests/test_launch.py), the header command (tests/test_shipped_commands.py) and the
    convert -> load -> evaluate chain (tests/test_eval.py)."""
    folder = made_once(tmp_path_factory, "quickstart", lambda folder: _launch_quickstart(tiny_corpus, folder))
    fields = json.loads((folder / "launched.json").read_text())
    return LaunchedRun(**{**fields, "out": Path(fields["out"])})


def _launch_quickstart(tiny_corpus: Corpus, folder: Path) -> None:
    """Run the quickstart into `folder`/run; record its `LaunchedRun` in `folder`/launched.json."""
    out = folder / "run"
    argv = [
        sys.executable,
        *QUICKSTART,
        "--out",
        str(out),
        "--",
        "--server.merge_interval=20",
        f"--tokenizer.identifier={tiny_corpus.tokenizer}",
        f"--data.paths=[{tiny_corpus.train}]",
        f"--data.validation_paths=[{tiny_corpus.valid}]",
        "--max_duration=20st",
        "--eval_interval=10",
        "--eval_subset_num_batches=1",
        "--log_interval=10",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    leftovers = [
        " ".join(p.info["cmdline"])
        for p in psutil.process_iter(["cmdline"])
        if str(out) in " ".join(p.info["cmdline"] or [])
    ]
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run = LaunchedRun(argv=argv, stdout=done.stdout, out=out, leftovers=leftovers)
    (folder / "launched.json").write_text(json.dumps({**asdict(run), "out": str(out)}))
