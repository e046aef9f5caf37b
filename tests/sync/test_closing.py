"""Closing a round (spes.sync.closing): `RoundCloser` over its own round state, memory and codec, no coordinator."""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from spes.sync import closing
from spes.sync.buffers import RoundMemory
from spes.sync.closing import RoundCloser, RoundParts
from spes.sync.codecs.interface import Served
from spes.sync.fragments import WHOLE
from spes.sync.merge import build_global
from spes.sync.rounds import Completed, RoundState
from spes.sync.spec import RunSpec
from sync_helpers import NO_MERGE, peer_upload, tiny_spec

SPEC = tiny_spec(server=NO_MERGE)


class Closer:
    """A `RoundCloser` of `spec` and what it shares, recording what it published and after how long."""

    def __init__(self, spec: RunSpec, state_dir: Path | None = None) -> None:
        self.spec = spec
        self.parts = RoundParts(
            threading.Condition(),
            RoundState(spec.num_peers, spec.server, spec.next_round),
            RoundMemory(),
            spec.codec_impl.server(),
        )
        self.published: list[tuple[Completed, float]] = []
        self.closer = RoundCloser(
            self.parts, str(state_dir) if state_dir else None, lambda done, s: self.published.append((done, s))
        )

    def close(self, step: int, fragment: int = WHOLE, seed: int = 1) -> dict[int, dict[str, torch.Tensor]]:
        """Every peer's upload of `fragment` of round `step` staged, and the round handed to `close`."""
        names = self.spec.layout.names(fragment, self.spec.manifest or {})
        uploads = {p: {n: t for n, t in peer_upload(self.spec, p, seed).items() if n in names} for p in (0, 1)}
        with self.parts.cond:
            # NOTE: received into the pool's buffers, as the server does (the aggregation may sum into them)
            pool = self.parts.memory.pool
            received = {p: {n: pool.take(t.shape, t.dtype).copy_(t) for n, t in uploads[p].items()} for p in (0, 1)}
            staged = [self.parts.state.stage_upload(p, step, received[p], None, fragment) for p in (0, 1)]
            assert staged == [False, True]
            self.closer.close(step, self.spec)
        return uploads

    def wait(self) -> None:
        self.closer.join(30)


@contextmanager
def held_build(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[threading.Event, list[threading.Thread]]]:
    """`build_round` held until the event is set; yields it and the threads that called it."""
    release, callers = threading.Event(), []
    build: Callable[..., Completed] = closing.build_round

    def held(*args: object) -> Completed:
        callers.append(threading.current_thread())
        assert release.wait(30)
        return build(*args)

    monkeypatch.setattr(closing, "build_round", held)
    try:
        yield release, callers
    finally:
        release.set()


def of_round(caplog: pytest.LogCaptureFixture, step: int) -> list[logging.LogRecord]:
    """What the thread closing round `step` logged (steps no other test closes: other tests' rounds may still be
    closing on threads of their own)."""
    return [r for r in caplog.records if r.threadName == f"aggregate-{step}"]


@pytest.mark.timeout(60)
def test_a_round_is_built_on_a_thread_of_its_own_then_published_with_the_seconds_it_took(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    run = Closer(SPEC)
    with held_build(monkeypatch) as (release, callers):
        began = time.perf_counter()
        uploads = run.close(1)
        while not callers:
            time.sleep(0.01)
        assert (callers[0].name, callers[0].daemon) == ("aggregate-1", True)  # named in a dump; never holds exit
        assert run.published == [] and run.parts.state.aggregating
        time.sleep(0.05)
        release.set()
        run.wait()
    took = time.perf_counter() - began
    [(done, seconds)] = run.published
    assert run.parts.state.completed is not None and run.parts.state.completed.round == 1
    assert (done.round, done.peers) == (1, frozenset({0, 1}))
    assert 0.05 <= seconds <= took
    want = build_global(uploads, spec=SPEC, step=1).tensors
    assert all(torch.equal(done.global_model[n], want[n]) for n in want)


@pytest.mark.timeout(60)
def test_join_gives_up_on_a_stuck_aggregation_after_its_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    run = Closer(SPEC)
    with held_build(monkeypatch) as (_, callers):
        run.close(1)
        while not callers:
            time.sleep(0.01)
        run.closer.join(0.1)  # a shutdown's grace: returns though the round is still being built
        assert callers[0].is_alive() and run.published == []


@pytest.mark.timeout(60)
def test_a_failed_aggregation_is_logged_and_left_to_the_peers_to_upload_again(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def fails(*args: object) -> Completed:
        raise ValueError("the aggregate of 'embed.weight' is not finite")

    monkeypatch.setattr(closing, "build_round", fails)
    run = Closer(SPEC)
    run.close(61)
    run.wait()
    message = "aggregation of round 61 failed: the aggregate of 'embed.weight' is not finite"
    assert run.parts.state.failure == (61, message) and run.published == [] and not run.parts.state.uploaded
    [record] = of_round(caplog, 61)
    assert (record.getMessage(), record.levelno, bool(record.exc_info)) == (message, logging.ERROR, True)


@pytest.mark.timeout(60)
def test_a_round_that_cannot_be_saved_is_not_published_and_says_how_to_go_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A state dir the system refuses (a full disk, a file in its place) is logged as its one line, not with a
    traceback in server.log; any other error of the save keeps its traceback."""
    not_a_dir = tmp_path / "state"
    not_a_dir.write_text("")
    run = Closer(SPEC, not_a_dir)
    run.close(1)
    run.wait()
    step, message = run.parts.state.failure or (None, "")
    assert step == 1 and message.startswith(f"the server could not save round 1 under --state_dir {not_a_dir} (")
    assert message.endswith(
        "): free space there (or fix its permissions), then resume the nodes with --resume=auto; the server's latest "
        "round is still the one before, and the nodes upload this one again"
    )
    assert run.published == [] and run.parts.state.completed is None
    [record] = of_round(caplog, 1)
    assert (record.getMessage(), record.levelno, record.exc_info) == (message, logging.ERROR, False)
    caplog.clear()

    def refuses(directory: str, saved: object) -> None:
        raise ValueError("no")

    monkeypatch.setattr(closing, "save_round", refuses)
    run = Closer(SPEC, tmp_path / "elsewhere")
    run.close(1)
    run.wait()
    assert run.parts.state.failure == (
        1,
        f"the server could not save round 1 under --state_dir {tmp_path}/elsewhere (no)",
    )
    [record] = of_round(caplog, 1)
    assert record.exc_info


@pytest.mark.timeout(60)
def test_a_restarted_server_restores_the_round_it_saved_with_its_fragment_and_held_model(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "spes.server")
    spec = tiny_spec(codec="int8", overlap_fragments=2, sync_steps=4, server=NO_MERGE)
    before = Closer(spec, tmp_path)
    before.close(2, fragment=1)
    before.wait()
    saved = before.parts.state.completed
    assert saved is not None and saved.fragment == 1

    after = Closer(spec, tmp_path)
    assert after.closer.restore(spec) == spec
    done = after.parts.state.completed
    assert done is not None and (done.round, done.peers, done.fragment) == (2, frozenset({0, 1}), 1)
    assert done.served.round == 2 and sorted(done.served.tensors) == sorted(saved.served.tensors)
    assert all(torch.equal(done.served.tensors[n], t) for n, t in saved.served.tensors.items())  # the held model
    assert f"resumed from {tmp_path}: round 2 complete (peers [0, 1]); waiting for peers to re-join" in [
        r.getMessage() for r in caplog.records
    ]
    assert Closer(spec).closer.restore(spec) is spec  # no --state_dir: nothing to restore


@pytest.mark.timeout(60)
def test_a_restart_with_another_length_or_server_settings_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    spec = dataclasses.replace(tiny_spec(sync_steps=2, server=NO_MERGE), last_step=40)
    before = Closer(spec, tmp_path)
    before.close(2)
    before.wait()
    caplog.set_level(logging.WARNING, "spes.server")
    longer = dataclasses.replace(spec, last_step=80, server=dataclasses.replace(NO_MERGE, merge_topk=2, outer_lr=0.5))
    assert Closer(longer, tmp_path).closer.restore(longer).last_step == 80
    assert [r.getMessage() for r in caplog.records] == [
        "max_duration changed: the run now ends at step 80 (it was to end at step 40); every node must resume with "
        "this max_duration",
        f"the server: section differs from the one the run's rounds so far had, the next rounds use this server's: "
        f"server.merge_topk: {NO_MERGE.merge_topk} -> 2; server.outer_lr: {NO_MERGE.outer_lr} -> 0.5",
    ]
    caplog.clear()
    Closer(spec, tmp_path).closer.restore(spec)
    assert caplog.records == []  # the same run: nothing to say


@pytest.mark.timeout(60)
@pytest.mark.parametrize("restored", [False, True])
def test_a_superseded_round_is_retired_into_the_pool_and_its_memory_reused(restored: bool, tmp_path: Path) -> None:
    """Round 1, built or restored, goes back to the pool once round 2 replaces it (no download reads it): round 3
    is built into its memory."""
    if restored:
        saving = Closer(SPEC, tmp_path)
        saving.close(1)
        saving.wait()
    run = Closer(SPEC, tmp_path)
    run.parts.memory.pool.set_limits({(shape, torch.float32): 8 for shape in (SPEC.manifest or {}).values()})
    if restored:
        run.closer.restore(SPEC)
    else:
        run.close(1)
        run.wait()
    first = run.parts.state.completed
    assert first is not None and first.round == 1
    for step in (2, 3):
        run.close(step, seed=step)
        run.wait()
    third = run.parts.state.completed
    assert third is not None and third.round == 3
    assert {t.data_ptr() for t in first.global_model.values()} & {t.data_ptr() for t in third.tensors()}


@pytest.mark.timeout(60)
def test_once_published_a_round_makes_what_its_downloads_send_and_says_when_or_why_not(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, "spes.server")
    run = Closer(SPEC)
    began = time.perf_counter()
    run.close(51)
    run.wait()
    took = time.perf_counter() - began
    [record] = of_round(caplog, 51)
    made = re.fullmatch(r"round 51: what .* made (\S+) s after it began", record.getMessage())
    assert made is not None
    assert 0 <= float(made[1]) <= took + 0.005  # its own seconds, rounded to 2 places

    def fails(self: Served) -> None:
        raise RuntimeError("re-encoding failed")

    monkeypatch.setattr(Served, "complete", fails)
    run.close(52, seed=2)
    run.wait()
    assert run.parts.state.completed is not None and run.parts.state.completed.round == 52  # published all the same
    [failed] = of_round(caplog, 52)  # and nothing said of it being made
    assert failed.getMessage() == "round 52: making what its downloads send failed" and failed.exc_info is not None
