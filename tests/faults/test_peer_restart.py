"""Real trainers: a crashed peer resumes from its checkpoint and rejoins the run, exactly or by catching up."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from peer_nodes import CPU, MERGE, TINY, peer_overrides
from spes.config import load_config
from spes.node import build_node, rejoin
from spes.sync.node_files import read_run_id
from spes.sync.peer import PeerSync, SyncResult
from spes.sync.server import spec_of_run
from spes.sync.spec import RunSpec
from spes.trainer import Trainer
from sync_helpers import running_server

STEPS = 8


class Crash(RuntimeError):
    """The simulated crash of a node between two steps."""


class CrashingLoader:
    """A node's data loader that dies when asked for batch `crash_at` (0-based): the node crashes mid-run."""

    def __init__(self, inner: Any, crash_at: int) -> None:
        self.inner, self.crash_at = inner, crash_at

    def __iter__(self) -> Iterator[torch.Tensor]:
        for i, batch in enumerate(self.inner):
            if i == self.crash_at:
                raise Crash(f"simulated crash before step {i + 1}")
            yield batch

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)


class Recording:
    """Wraps PeerSync; keeps each sync's result and the weights right after it."""

    def __init__(self, inner: PeerSync) -> None:
        self.inner = inner
        self.after: dict[int, dict[str, torch.Tensor]] = {}
        self.results: dict[int, SyncResult] = {}

    def sync(self, step: int) -> SyncResult:
        return self._kept(step, self.inner.sync(step))

    def catch_up(self, step: int) -> SyncResult | None:
        result = self.inner.catch_up(step)
        return result if result is None else self._kept(step, result)

    def _kept(self, step: int, result: SyncResult) -> SyncResult:
        self.results[step] = result
        self.after[step] = {n: t.detach().clone() for n, t in self.inner.model.state_dict().items()}
        return result

    def __getattr__(self, name: str) -> object:  # the rest of the Syncer: PeerSync's own
        return getattr(self.inner, name)


def overrides(corpus: Any, tmp_path: Path, addr: str, peer: int) -> list[str]:
    """The command line of peer `peer` of these runs (`python -m spes.train configs/tiny.yaml ...`): the in-process
    peers' (`peer_nodes`), run longer, saving every round, retrying more."""
    return peer_overrides(
        corpus,
        tmp_path,
        addr,
        peer,
        f"--max_duration={STEPS}st",
        "--save_interval=2",
        "--save_num_checkpoints_to_keep=-1",
        "--spes_config.max_retries=8",
    )


def server_spec(corpus: Any, tmp_path: Path) -> RunSpec:
    """The spec the server of these runs builds from the nodes' YAML and overrides, with its merge warm-up."""
    return spec_of_run(TINY, [*overrides(corpus, tmp_path, "127.0.0.1:1", 0), *MERGE])


def node(
    corpus: Any,
    tmp_path: Path,
    addr: str,
    peer: int,
    *,
    load_path: str | None = None,
    crash_at: int | None = None,
    run_id: str | None = None,
) -> tuple[Trainer, Recording]:
    """One peer as `python -m spes.train configs/tiny.yaml` would build it (--resume: `load_path`; a fresh node of a
    running run: `run_id`)."""
    cfg, _ = load_config(TINY, overrides(corpus, tmp_path, addr, peer))
    cfg.load_path, cfg.spes_config.run_id = load_path, run_id
    built = build_node(cfg, CPU, log=lambda _m: None)
    run_id = read_run_id(built.checkpoint.path) if built.checkpoint is not None else None  # as spes.train does
    sync = PeerSync(cfg, built.model, CPU, log=lambda _m: None, run_id=run_id)
    sync.join()
    loader = built.loader if crash_at is None else CrashingLoader(built.loader, crash_at)
    recording = Recording(sync)
    trainer = Trainer(
        cfg=cfg,
        model=built.model,
        optimizer=built.optimizer,
        loader=loader,
        info=CPU,
        syncer=recording,
        log=lambda _m: None,
    )
    if built.checkpoint is not None:
        trainer.load_state_dict(built.checkpoint.trainer)
    rejoin(trainer, recording, built.checkpoint, log=lambda _m: None)  # type: ignore[arg-type]
    return trainer, recording


def run(trainer: Trainer, recording: Recording) -> Trainer:
    try:
        trainer.fit()
    finally:
        recording.inner.close()
    return trainer


def crash_then_resume(
    corpus: Any, tmp_path: Path, addr: str, crash_at: int, resume_from: str
) -> tuple[Trainer, Recording]:
    """Peer 1 crashes before batch `crash_at`, then restarts from `resume_from` (in its save folder; '.': latest)."""
    with pytest.raises(Crash):
        run(*node(corpus, tmp_path, addr, 1, crash_at=crash_at))
    trainer, recording = node(corpus, tmp_path, addr, 1, load_path=str(tmp_path / "node1" / resume_from))
    return run(trainer, recording), recording


def final_weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in trainer.model.state_dict().items()}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_crashed_peer_resumes_from_its_checkpoint_and_the_run_is_exact(tiny_corpus: Any, tmp_path: Path) -> None:
    reference = {}
    spec = server_spec(tiny_corpus, tmp_path)
    with running_server(spec) as (_, addr), ThreadPoolExecutor(2) as pool:
        runs = [pool.submit(run, *node(tiny_corpus, tmp_path / "ref", addr, p)) for p in range(2)]
        reference = {p: final_weights(f.result(timeout=240)) for p, f in enumerate(runs)}
    with running_server(spec) as (_, addr), ThreadPoolExecutor(2) as pool:
        steady = pool.submit(run, *node(tiny_corpus, tmp_path / "crash", addr, 0))
        # NOTE: crash before step 5, after the step-4 sync and checkpoint; the server waits at round 6 meanwhile.
        restarted = pool.submit(crash_then_resume, tiny_corpus, tmp_path / "crash", addr, 4, ".")  # its latest
        got = {1: final_weights(restarted.result(timeout=240)[0]), 0: final_weights(steady.result(timeout=240))}
    for peer in range(2):
        assert sorted(got[peer]) == sorted(reference[peer])
        for name, tensor in reference[peer].items():
            assert torch.equal(got[peer][name], tensor), (peer, name)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_peer_resumed_from_an_older_checkpoint_catches_up_with_the_run(tiny_corpus: Any, tmp_path: Path) -> None:
    with running_server(server_spec(tiny_corpus, tmp_path)) as (_, addr), ThreadPoolExecutor(2) as pool:
        trainer0, recording0 = node(tiny_corpus, tmp_path, addr, 0)
        steady = pool.submit(run, trainer0, recording0)
        # NOTE: crash before step 7 (rounds 2..6 done), resume from step 2: the run has moved on to round 6.
        restarted = pool.submit(crash_then_resume, tiny_corpus, tmp_path, addr, 6, "step2")
        trainer1, recording1 = restarted.result(timeout=240)
        steady.result(timeout=240)
    caught_up = recording1.results[2]  # at start: the run had moved on to round 6
    assert (caught_up.step, caught_up.caught_up, caught_up.metrics()["caught_up_to"]) == (6, True, 6)
    assert sorted(recording1.results) == [2, 8]
    assert trainer1.step == STEPS
    for name, tensor in recording0.after[6].items():  # peer 0 holds the whole global model after round 6
        assert torch.equal(recording1.after[2][name], tensor), name
    weights = [final_weights(trainer0), final_weights(trainer1)]
    shared = [n for n in weights[0] if ".experts." not in n]
    assert shared and all(torch.equal(weights[0][n], weights[1][n]) for n in shared)
    rows = [json.loads(line) for line in (tmp_path / "node1" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 6, 7, 8]  # the crashed attempt's steps 3..6 did not happen


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_fresh_node_replacing_a_lost_one_starts_from_the_runs_latest_round(tiny_corpus: Any, tmp_path: Path) -> None:
    with running_server(server_spec(tiny_corpus, tmp_path)) as (_, addr), ThreadPoolExecutor(1) as pool:
        trainer0, recording0 = node(tiny_corpus, tmp_path, addr, 0)
        steady = pool.submit(run, trainer0, recording0)
        with pytest.raises(Crash):  # peer 1 is lost before step 7, after round 6, with its save folder
            run(*node(tiny_corpus, tmp_path, addr, 1, crash_at=6))
        run_id = read_run_id(tmp_path / "node1" / "step6")
        trainer1, recording1 = node(tiny_corpus, tmp_path / "new", addr, 1, run_id=run_id)
        run(trainer1, recording1)
        steady.result(timeout=240)
    assert sorted(recording1.results) == [0, 8]
    assert (recording1.results[0].step, recording1.results[0].caught_up) == (6, True)
    for name, tensor in recording0.after[6].items():
        assert torch.equal(recording1.after[0][name], tensor), name
    assert trainer1.step == STEPS and trainer1.tokens == 2 * trainer0.tokens // STEPS  # it trained steps 7 and 8
