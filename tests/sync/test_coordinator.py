"""The round service without any transport: joins, uploads fed straight into its decoder, downloads."""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
import torch

from conftest import wait_until
from spes.config import ServerSection
from spes.sync import closing
from spes.sync.coordinator import Coordinator
from spes.sync.fragments import WHOLE, merge_step
from spes.sync.merge import build_global, round_alpha
from spes.sync.protocol import Reason, Refused
from spes.sync.settings import DeployConfig, ServerConfig
from spes.sync.spec import RunSpec
from spes.sync.state import load_round
from spes.sync.wire import TensorDecoder, encode_tensors
from sync_helpers import NO_MERGE, join_request, peer_upload, tiny_spec

SPEC = tiny_spec(server=NO_MERGE)
MANIFEST = SPEC.manifest or {}
JOIN = {"session": "s", "address": "test", "common_name": lambda: None}


def feeding(tensors: dict[str, torch.Tensor]):  # type: ignore[no-untyped-def]
    def feed(decoder: TensorDecoder) -> None:
        for chunk in encode_tensors(tensors, "fp32"):
            decoder.feed(chunk)

    return feed


def coordinator(spec: RunSpec, **deploy: object) -> Coordinator:
    return Coordinator(ServerConfig(spec, DeployConfig(**deploy)))  # type: ignore[arg-type]


@contextmanager
def running(service: Coordinator) -> Iterator[Coordinator]:
    """`service`, shut down on leaving, whether the test passed or not."""
    try:
        yield service
    finally:
        service.shutdown(grace_s=1.0)


def completed_round(service: Coordinator, step: int) -> None:
    """Wait until round `step` is the latest completed (it is built on a thread of its own)."""
    wait_until(lambda: service.status().current_round == step, f"round {step} to complete")


@contextmanager
def joined(spec: RunSpec = SPEC, **deploy: object) -> Iterator[Coordinator]:
    """A running coordinator every peer of `spec` has joined."""
    with running(coordinator(spec, **deploy)) as service:
        for peer in range(spec.num_peers):
            service.join(join_request(peer, spec), session=f"s{peer}", address="test", common_name=lambda: None)
        yield service


@pytest.mark.timeout(60)
def test_a_round_through_the_coordinator_alone() -> None:
    with running(coordinator(SPEC)) as service:
        with pytest.raises(Refused) as err:
            service.uploads.receive(0, 1, feeding({}))
        assert (err.value.code, err.value.reason) == (grpc.StatusCode.FAILED_PRECONDITION, Reason.NOT_JOINED)
        for peer in range(2):
            reply = service.join(join_request(peer, SPEC), session=f"s{peer}", address="test", common_name=lambda: None)
            assert (reply.current_round, reply.open_round) == (-1, -1)
        uploads = {p: peer_upload(SPEC, p, seed=1) for p in range(2)}
        want = build_global(uploads, spec=SPEC, step=1).tensors
        assert list(service.uploads.receive(0, 1, feeding(uploads[0])).uploaded_peers) == [0]
        assert service.uploads.receive(0, 1, feeding(uploads[0])).duplicate
        assert list(service.uploads.receive(1, 1, feeding(uploads[1])).uploaded_peers) == [0, 1]
        with service.downloads.serve(1, 1, False, lambda: True, 30.0) as outgoing:
            assert outgoing is not None
            assert sorted(outgoing.info.names) == sorted(SPEC.downloads(1, merged=False))
            assert all(torch.equal(outgoing.tensors[n], want[n]) for n in outgoing.info.names)
            outgoing.sent = 123
        status = service.status()
        assert (status.current_round, status.num_peers, status.bytes_out) == (1, 2, 123)
        with service.downloads.serve(0, 2, False, lambda: False, 30.0) as gone:  # the caller went away while waiting
            assert gone is None


@pytest.mark.timeout(60)
def test_a_fragments_round_covers_its_tensors_merges_as_its_whole_round_and_keeps_the_rest(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Rounds every 2 steps over 2 fragments (sync_steps 4), then a whole round: each round's download is the
    aggregate of its fragment's uploads only, merged with the warm-up of the whole round it stands in for (the
    whole round merges only fragment 2, whose turn step 6 is), and the server's global model keeps the other
    fragment's values of the round before."""
    caplog.set_level(logging.INFO, "spes.server")
    merge = ServerSection(merge_interval=4, merge_alpha_start=0.5, merge_decay_steps=100)
    spec = tiny_spec(overlap_fragments=2, sync_steps=4, server=merge)
    layout = spec.layout
    with joined(spec) as service:
        held: dict[str, torch.Tensor] = {}
        for step, fragment in ((2, 1), (4, 2), (6, WHOLE)):
            names = layout.names(fragment, MANIFEST)
            uploads = {p: {n: t for n, t in peer_upload(spec, p, step).items() if n in names} for p in (0, 1)}
            merge_at, mergeable = layout.merged_names(step, fragment, MANIFEST)
            assert merge_at == merge_step(step, 4, fragment) or fragment == WHOLE
            want = build_global(uploads, spec=spec, step=merge_at, mergeable=mergeable)
            for peer in range(2):
                service.uploads.receive(peer, step, feeding(uploads[peer]), fragment)
            held.update(want.tensors)
            with service.downloads.serve(0, step, False, lambda: True, 30.0) as outgoing:
                assert outgoing is not None
                alpha = round_alpha(merge_at, "spes", merge)  # the whole round at 6 stands in for fragment 2's
                assert (outgoing.info.merged, outgoing.info.alpha) == (True, alpha) and alpha > 0
                sent = spec.downloads(0, names, merged=alpha > 0)  # merged: its own blocks come back too
                assert sorted(outgoing.info.names) == sorted(sent)
                assert all(torch.equal(outgoing.tensors[n], want.tensors[n]) for n in sent)
            if step == 2:  # only fragment 1 has had a round: no whole model to catch up to yet
                with pytest.raises(
                    Refused, match=rf"holds only the fragments .* \({len(layout.parts[0])} of {len(MANIFEST)} tensors\)"
                ) as err:
                    service.downloads.serve(0, step, True, lambda: True, 30.0).__enter__()
                assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
                assert str(err.value).endswith(
                    "tensors): a node that falls behind before every fragment has had one (step sync_steps) must start "
                    "the run again"
                )
                continue
            with service.downloads.serve(0, step, True, lambda: True, 30.0) as whole:  # what a catching-up peer loads
                assert whole is not None and sorted(whole.info.names) == sorted(held)
                assert all(torch.equal(whole.tensors[n], held[n]) for n in held)
        assert sorted(held) == sorted(MANIFEST)
    assert [m.split(", aggregation ")[0] for m in caplog.messages if " complete: " in m] == [
        "round 2 (fragment 1 of 2) complete: peers 2",
        "round 4 (fragment 2 of 2) complete: peers 2",
        "round 6 complete: peers 2",
    ]


@pytest.mark.timeout(60)
def test_fragment_layouts_and_uploads_that_disagree_are_refused() -> None:
    spec = tiny_spec(overlap_fragments=2, sync_steps=4, server=NO_MERGE)
    with running(coordinator(spec)) as service:
        for other, code, match in (
            (tiny_spec(overlap_fragments=5, sync_steps=10), grpc.StatusCode.FAILED_PRECONDITION, "sync_steps = 10"),
            (tiny_spec(sync_steps=4), grpc.StatusCode.FAILED_PRECONDITION, "overlap_fragments = 1 but the run has"),
        ):
            with pytest.raises(Refused, match=match) as err:
                service.join(join_request(0, other), **JOIN)  # type: ignore[arg-type]
            assert err.value.code == code
        for peer in range(2):
            service.join(join_request(peer, spec), **JOIN)  # type: ignore[arg-type]
        layout = spec.layout
        upload = {n: t for n, t in peer_upload(spec, 0, 1).items() if n in layout.parts[0]}
        with pytest.raises(Refused, match=r"fragment 3 is not one of this run's \(0 or 1..2\)"):
            service.uploads.receive(0, 2, feeding(upload), 3)
        service.uploads.receive(0, 2, feeding(upload), 1)
        with pytest.raises(Refused, match="uploads fragment 2 for round 2, whose other uploads are of fragment 1"):
            service.uploads.receive(1, 2, feeding({}), 2)
        with pytest.raises(Refused, match="is not expected here"):  # fragment 1's round, fragment 2's tensors
            service.uploads.receive(
                1, 2, feeding({n: t for n, t in peer_upload(spec, 1, 1).items() if n in layout.parts[1]}), 1
            )


@pytest.mark.timeout(60)
def test_a_quorum_round_waits_for_the_owners_of_a_fragment_never_synchronized(tmp_path: Path) -> None:
    """Fragment 1 has had its round; fragment 2's first round cannot close without peer 1, whose experts in it have
    no global copy yet. A server restarted from its state holds the peers to the run's fragments."""
    quorum = ServerSection(merge_interval=0, dead_peer_policy="quorum", min_peers=1, round_timeout_s=0.2)
    spec = tiny_spec(overlap_fragments=2, sync_steps=4, server=quorum)
    layout = spec.layout
    with joined(spec, state_dir=str(tmp_path)) as service:
        for peer in range(2):
            part = {n: t for n, t in peer_upload(spec, peer, 2).items() if n in layout.parts[0]}
            service.uploads.receive(peer, 2, feeding(part), 1)
        with service.downloads.serve(0, 2, False, lambda: True, 30.0) as done:  # round 2 complete
            assert done is not None
        part = {n: t for n, t in peer_upload(spec, 0, 4).items() if n in layout.parts[1]}
        service.uploads.receive(0, 4, feeding(part), 2)
        time.sleep(0.3)
        with pytest.raises(Refused, match=r"no global copy of the experts of peers \[1\] exists yet"):
            service.downloads.serve(0, 4, False, lambda: True, 5.0).__enter__()
    with pytest.raises(ValueError, match="written by a run with overlap_fragments=2, this server has overlap_fr"):
        coordinator(tiny_spec(sync_steps=4, server=quorum), state_dir=str(tmp_path))
    with running(coordinator(spec, state_dir=str(tmp_path))) as restarted:
        # the node resumes from its checkpoint, which names the run
        restarted.join(join_request(0, spec, run_id=restarted.run_id), **JOIN)  # type: ignore[arg-type]


@pytest.mark.timeout(60)
def test_an_aggregate_that_overflows_is_refused_naming_the_tensor_and_nothing_is_published() -> None:
    """Two peers upload finite values of 3e38: their fp32 mean overflows. The round fails with the tensor's name,
    the previous round stays the latest, and the peers may upload again."""
    with joined() as service:
        uploads = {p: peer_upload(SPEC, p, seed=1) for p in range(2)}
        for peer in range(2):
            service.uploads.receive(peer, 1, feeding(uploads[peer]))
        with service.downloads.serve(0, 1, False, lambda: True, 30.0) as first:
            assert first is not None
        for peer in range(2):
            uploads[peer]["lm_head.weight"].fill_(3.0e38)
            service.uploads.receive(peer, 2, feeding(uploads[peer]))
        with pytest.raises(Refused, match=r"aggregate of tensor 'lm_head.weight' holds NaN or Inf") as err:
            service.downloads.serve(0, 2, False, lambda: True, 5.0).__enter__()
        assert err.value.code == grpc.StatusCode.INTERNAL
        assert service.status().current_round == 1
        done = service.state.completed
        assert done is not None and all(bool(torch.isfinite(t).all()) for t in done.global_model.values())


@pytest.mark.timeout(60)
def test_a_round_that_cannot_be_saved_is_refused_naming_the_state_dir_and_can_be_uploaded_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The round's file cannot be written (here `--state_dir` became a file): the waiting peers are told where and
    what to do, nothing is published, round 1 stays the latest on disk and in memory; once the directory is
    writable again the same uploads complete the round, which is then persisted."""
    caplog.set_level(logging.INFO, "spes.server")
    state_dir = tmp_path / "state"
    with joined(state_dir=str(state_dir)) as service:
        for step in (1, 2):
            for peer in range(2):
                service.uploads.receive(peer, step, feeding(peer_upload(SPEC, peer, seed=step)))
            if step == 1:
                with service.downloads.serve(0, 1, False, lambda: True, 30.0) as first:
                    assert first is not None
                shutil.rmtree(state_dir)
                state_dir.write_text("not a directory")
        with pytest.raises(Refused) as err:
            service.downloads.serve(0, 2, False, lambda: True, 5.0).__enter__()
        assert str(err.value).startswith(f"the server could not save round 2 under --state_dir {state_dir} (")
        assert str(err.value).endswith(
            "): free space there (or fix its permissions), then resume the nodes with --resume=auto; the server's "
            "latest round is still the one before, and the nodes upload this one again"
        )
        assert service.status().current_round == 1
        state_dir.unlink()
        for peer in range(2):
            service.uploads.receive(peer, 2, feeding(peer_upload(SPEC, peer, seed=2)))
        with service.downloads.serve(0, 2, False, lambda: True, 30.0) as second:
            assert second is not None
        assert load_round(state_dir, service.spec).step == 2  # type: ignore[union-attr]
    persisted = [m for m in caplog.messages if m.startswith("round 2 complete: ")]
    assert len(persisted) == 1 and ", persisted, merged no; since round 1: " in persisted[0]
    with running(coordinator(SPEC, state_dir=str(state_dir))) as restarted:  # a restarted server resumes from round 2
        assert (
            restarted.status().current_round == 2
            and f"resumed from {state_dir}: round 2 complete (peers [0, 1])" in (caplog.text)
        )
        restarted.join(join_request(0, SPEC, run_id=restarted.run_id), **JOIN)  # type: ignore[arg-type]
        with restarted.downloads.serve(0, 2, True, lambda: True, 5.0) as caught_up:  # a node catching up
            assert caught_up is not None and caught_up.info.round == 2 and list(caught_up.info.peers) == [0, 1]
            assert set(caught_up.info.names) == set(MANIFEST)


@pytest.mark.timeout(60)
def test_an_upload_counts_its_bytes_refuses_bad_payloads_by_kind_and_keeps_nothing_of_a_broken_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with joined() as service:
        caplog.set_level(logging.DEBUG, "spes.server")  # from here on: the joins are not this test's
        upload = peer_upload(SPEC, 0, seed=2)
        size = sum(t.numel() * 4 for t in upload.values())

        def broken(decoder: TensorDecoder) -> None:
            decoder.feed(next(encode_tensors(upload, "fp32")))
            raise OSError("connection reset")

        reply = service.uploads.receive(0, 1, broken)
        assert reply.round == 0 and not reply.duplicate  # nothing kept, nothing staged
        assert service.state.snapshot().uploaded_peers == ()
        broken_off = service.uploads.bytes_in
        assert broken_off == len(next(encode_tensors(upload, "fp32")).data)  # what arrived before the break
        assert [r.getMessage() for r in caplog.records] == [
            "receiving the upload of peer 0 for round 1",  # what tests/faults waits for before cutting an upload
            f"upload of peer 0 for round 1 broke off after {broken_off} bytes; nothing was kept",
        ]

        def corrupt(decoder: TensorDecoder) -> None:
            chunk = next(encode_tensors(upload, "fp32"))
            chunk.checksum ^= 1
            decoder.feed(chunk)

        with pytest.raises(Refused) as err:
            service.uploads.receive(0, 1, corrupt)
        assert (err.value.code, err.value.reason) == (grpc.StatusCode.INVALID_ARGUMENT, Reason.CORRUPT)
        assert str(err.value).startswith("upload of peer 0 for round 1: ")
        before = service.uploads.bytes_in
        assert before == broken_off  # a chunk that fails its checksum is not counted, and the count is kept
        first = service.uploads.receive(0, 1, feeding(upload), digest=7)
        assert (first.round, first.duplicate, list(first.uploaded_peers)) == (1, False, [0])
        assert service.uploads.bytes_in == before + size  # added up over uploads, kept or not
        again = service.uploads.receive(0, 1, feeding(upload), digest=7)  # a retry of the committed upload
        assert (again.round, again.duplicate) == (1, True)
        with pytest.raises(Refused, match="upload of peer 1 for round 1: ") as err:
            service.uploads.receive(1, 1, feeding(upload), fragment=3)  # no fragment 3 in this run
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.timeout(60)
def test_a_newer_upload_of_a_peer_ends_its_stalled_one() -> None:
    with joined() as service:
        stalled, newer = service.guard.admit(None), service.guard.admit(None)
        upload = peer_upload(SPEC, 0, seed=3)
        started = threading.Event()

        def stall(decoder: TensorDecoder) -> None:
            started.set()
            while not stalled.expired:
                time.sleep(0.01)
            raise OSError("ended")

        worker = threading.Thread(target=lambda: service.uploads.receive(0, 1, stall, ticket=stalled))
        worker.start()
        assert started.wait(10)
        reply = service.uploads.receive(0, 1, feeding(upload), ticket=newer)
        worker.join(10)
        assert stalled.expired and stalled.why == "superseded by a newer upload of peer 0" and not newer.expired
        assert list(reply.uploaded_peers) == [0]
        assert service.uploads.receive(1, 1, feeding(peer_upload(SPEC, 1, seed=3))).uploaded_peers == [0, 1]


@pytest.mark.timeout(60)
def test_an_upload_that_ended_is_not_ended_again_by_the_peers_next_one() -> None:
    with joined() as service:
        first, second = service.guard.admit(None), service.guard.admit(None)
        service.uploads.receive(0, 1, feeding(peer_upload(SPEC, 0, seed=1)), ticket=first)
        service.uploads.receive(1, 1, feeding(peer_upload(SPEC, 1, seed=1)))
        completed_round(service, 1)
        service.uploads.receive(0, 2, feeding(peer_upload(SPEC, 0, seed=2)), ticket=second)
        assert not first.expired and not second.expired


@pytest.mark.timeout(60)
def test_a_retry_that_wins_the_race_makes_the_slower_copy_a_duplicate_and_a_duplicate_is_never_read() -> None:
    """Two copies of one upload in flight at once (a peer's retry of one whose reply it lost): the first to finish
    is staged, the other's buffers go back and it is answered as a duplicate."""
    with joined() as service:
        upload = peer_upload(SPEC, 0, seed=5)
        retried: list[object] = []

        def overtaken(decoder: TensorDecoder) -> None:
            worker = threading.Thread(
                target=lambda: retried.append(service.uploads.receive(0, 1, feeding(upload), 0, 9))
            )
            worker.start()
            worker.join(10)
            feeding(upload)(decoder)

        slower = service.uploads.receive(0, 1, overtaken, 0, 9)
        [faster] = retried
        assert (faster.round, faster.duplicate, list(faster.uploaded_peers)) == (1, False, [0])  # type: ignore[attr-defined]
        assert (slower.round, slower.duplicate, list(slower.uploaded_peers)) == (1, True, [0])

        def unread(decoder: TensorDecoder) -> None:
            raise AssertionError("a duplicate's payload was read")

        assert service.uploads.receive(0, 1, unread, 0, 9).duplicate
        service.uploads.receive(1, 1, feeding(peer_upload(SPEC, 1, seed=5)))
        completed_round(service, 1)
        late = service.uploads.receive(0, 1, unread, 0, 9)  # a retry of an upload of the round just completed
        assert (late.round, late.duplicate, list(late.uploaded_peers)) == (1, True, [0, 1])


@pytest.mark.timeout(60)
def test_a_full_download_waits_for_the_open_round_though_its_peer_did_not_upload_it() -> None:
    """A catching-up node asks for the whole model of the round in progress without taking part in it."""
    with joined() as service:
        service.uploads.receive(0, 1, feeding(peer_upload(SPEC, 0, seed=1)))
        with service.downloads.serve(1, 1, True, lambda: True, 0.2) as waited:  # its own time ran out, no refusal
            assert waited is None
        with pytest.raises(Refused, match="holds no upload of peer 1 for round 1"):
            service.downloads.serve(1, 1, False, lambda: True, 0.2).__enter__()


@pytest.mark.timeout(60)
def test_a_download_says_its_round_and_peers_and_ends_when_the_server_stops_or_the_caller_runs_out() -> None:
    with joined() as service:
        uploads = {p: peer_upload(SPEC, p, seed=4) for p in range(2)}
        for peer in range(2):
            service.uploads.receive(peer, 1, feeding(uploads[peer]))
        with service.downloads.serve(0, 1, False, lambda: True, None) as outgoing:
            assert outgoing is not None
            assert (outgoing.info.round, list(outgoing.info.peers), outgoing.info.base_round) == (1, [0, 1], -1)
            assert outgoing.wire_dtype == "fp32" and set(outgoing.tensors) == set(outgoing.info.names)
        service.uploads.receive(0, 2, feeding(uploads[0]))
        start = time.monotonic()
        with service.downloads.serve(0, 2, False, lambda: True, 0.3) as late:  # peer 1's upload never comes
            assert late is None
        assert 0.3 <= time.monotonic() - start < 30  # its own time, not the round it waits for, which never ends
        service.shutdown(grace_s=1.0)
        with pytest.raises(Refused) as err, service.downloads.serve(0, 2, False, lambda: True, 5.0):
            pass
        going_away = (
            grpc.StatusCode.UNAVAILABLE,
            "the parameter server is shutting down: nodes retry until it is back",
            Reason.SHUTTING_DOWN,
        )
        assert (err.value.code, str(err.value), err.value.reason) == going_away
        with pytest.raises(Refused) as err:  # nor is an upload staged: its round would close after the server stopped
            service.uploads.receive(1, 2, feeding(uploads[1]))
        assert (err.value.code, str(err.value), err.value.reason) == going_away
        assert service.status().peers_uploaded == [0]


@pytest.mark.timeout(60)
def test_a_download_waiting_past_the_round_timeout_closes_a_quorum_round_with_the_peers_that_came(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, "spes.server")
    quorum = ServerSection(merge_interval=0, dead_peer_policy="quorum", round_timeout_s=0.5, min_peers=1)
    spec = replace(SPEC, server=quorum)
    with joined(spec) as service:
        for peer in range(2):  # round 1 with both: the global model then holds a copy of every owner's blocks
            service.uploads.receive(peer, 1, feeding(peer_upload(spec, peer, seed=5)))
        with service.downloads.serve(0, 1, False, lambda: True, 30.0) as first:
            assert first is not None
        service.uploads.receive(0, 2, feeding(peer_upload(spec, 0, seed=6)))  # peer 1 never uploads round 2
        start = time.monotonic()
        with service.downloads.serve(0, 2, False, lambda: True, 30.0) as outgoing:
            assert outgoing is not None and outgoing.info.round == 2 and list(outgoing.info.peers) == [0]
        assert 0.4 < time.monotonic() - start < 15  # the round's 0.5 s timeout, not the download's own 30 s
        assert "round 2 timed out: closing it with peers [0] (server.dead_peer_policy quorum)" in caplog.messages
        assert service.status().current_round == 2
    lines = [m.split(" s, ", 1) for m in caplog.messages if " complete: " in m]
    assert [(head.split(", aggregation ")[0], tail.split(";")[0]) for head, tail in lines] == [
        ("round 1 complete: peers 2", "merged no"),
        ("round 2 complete: peers 1 (quorum, missing [1])", "merged no"),
    ]


@pytest.mark.timeout(60)
def test_a_rounds_log_line_says_what_its_bytes_are_and_since_when(caplog: pytest.LogCaptureFixture) -> None:
    """Round 1's line read `in 4.6 MiB, out 0.0 MiB (since last round)`, as if it had served nothing: what goes out
    between two lines is the previous round's downloads. And `merged no, alpha 0`: the alpha only where it ran.
    A model of half a MiB an upload, so that each line's bytes in show (a tiny one's read 0.0 whatever they were)."""
    merge = ServerSection(merge_interval=2, merge_alpha_start=0.5, merge_decay_steps=100)
    spec = tiny_spec(server=merge, d=64, f=64)

    def completes() -> list[str]:
        return [m for m in caplog.messages if " complete: " in m]

    with joined(spec) as service:
        caplog.set_level(logging.INFO, "spes.server")
        for step in (1, 2, 3):
            for peer in range(2):
                service.uploads.receive(peer, step, feeding(peer_upload(spec, peer, seed=step)))
            # NOTE: the line is logged on the closer's thread once published: a download may finish first
            wait_until(lambda n=step: len(completes()) == n, f"round {step}'s line (logged once it is published)")
            with service.downloads.serve(0, step, False, lambda: True, 30.0) as outgoing:
                assert outgoing is not None
                outgoing.sent = step * 2**20
        upload = sum(t.numel() * 4 for t in peer_upload(spec, 0, seed=1).values()) * 2 / 2**20
        assert upload > 0.5
        lines = [m.split(": peers 2, aggregation ")[1] for m in completes()]
        assert [line.split(" s, ", 1)[1] for line in lines] == [
            f"merged no; since the server started: {upload:.1f} MiB in (uploads), 0.0 MiB out (downloads)",
            f"merged yes (alpha {round_alpha(2, 'spes', merge):.6g}); since round 1: {upload:.1f} MiB in (uploads), "
            "1.0 MiB out (downloads)",
            f"merged no; since round 2: {upload:.1f} MiB in (uploads), 2.0 MiB out (downloads)",
        ]


@pytest.mark.timeout(60)
def test_a_dry_join_checks_the_run_and_registers_nothing_and_a_join_says_where_the_run_is(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A preflight's Join is answered as one (no round, the data port, whether the model was checked against the
    run's manifest) and leaves no peer joined; a real Join gets the run's rounds, its data port and its run id."""
    caplog.set_level(logging.INFO, "spes.server")
    with running(coordinator(SPEC)) as service:
        assert service.join(join_request(0, SPEC), **JOIN).data_port == 0  # type: ignore[arg-type]  # no data plane
        service.data_port = 4567
        dry = join_request(1, SPEC)
        dry.dry_run = True
        reply = service.join(dry, session="s1", address="there", common_name=lambda: None)
        assert (reply.current_round, reply.open_round, reply.data_port, reply.run_id) == (-1, -1, 4567, service.run_id)
        assert reply.dry_run and reply.manifest_checked and list(service.status().peers_joined) == [0]
        assert "preflight of peer 1: its settings and model match the run" in caplog.messages
        assert "peer 0 joined from test (codec fp32)" in caplog.messages
        service.uploads.receive(0, 1, feeding(peer_upload(SPEC, 0, seed=1)))
        again = service.join(join_request(1, SPEC), session="s1", address="there", common_name=lambda: None)
        assert (again.current_round, again.open_round, again.data_port, again.run_id) == (-1, 1, 4567, service.run_id)
        service.uploads.receive(1, 1, feeding(peer_upload(SPEC, 1, seed=1)))
        completed_round(service, 1)
        later = service.join(join_request(0, SPEC, run_id=service.run_id), **JOIN)  # type: ignore[arg-type]
        assert (later.current_round, later.open_round) == (1, -1)


@pytest.mark.timeout(60)
def test_a_server_without_the_runs_manifest_takes_the_first_joins_and_a_dry_join_says_it_had_none(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, "spes.server")
    bare = replace(SPEC, manifest=None)
    with running(coordinator(bare)) as service:
        dry = join_request(0, SPEC)
        dry.dry_run = True
        assert not service.join(dry, **JOIN).manifest_checked  # type: ignore[arg-type]
        assert service.spec.manifest is None  # a dry run takes nothing either
        service.join(join_request(0, SPEC), **JOIN)  # type: ignore[arg-type]
        assert service.spec.manifest == MANIFEST
        took = f"took the model manifest ({len(MANIFEST)} tensors) and sync_steps from peer 0"
        assert caplog.messages.count(took) == 1
        service.join(join_request(1, SPEC), session="s1", address="test", common_name=lambda: None)
        assert caplog.messages.count(took) == 1 and service.spec.manifest == MANIFEST


@pytest.mark.timeout(60)
def test_status_says_the_run_its_open_round_and_who_is_there(tmp_path: Path) -> None:
    """Every field of Status a dashboard or `spes.status` reads, through a round: the run, its mode and policy, the
    open round's age and missing peers, the rounds completed, and each peer's presence."""
    with running(coordinator(SPEC)) as service:
        fresh = service.status()
        assert (fresh.mode, fresh.run_id, fresh.persistent, fresh.rounds_completed) == (
            "spes",
            service.run_id,
            False,
            0,
        )
        assert fresh.run_id and fresh.dead_peer_policy == SPEC.server.dead_peer_policy and list(fresh.presence) == []
        for peer in range(2):
            service.join(join_request(peer, SPEC), session=f"s{peer}", address="test", common_name=lambda: None)
        ended = service.presence(1, "s1", service.run_id, "there", lambda: None)
        service.uploads.receive(0, 1, feeding(peer_upload(SPEC, 0, seed=1)))
        time.sleep(0.05)
        waiting = service.status()
        assert (waiting.open_round, list(waiting.missing_peers), list(waiting.peers_uploaded)) == (1, [1], [0])
        assert waiting.open_round_age_s >= 0.05
        heard, present = waiting.presence  # peer 0 was last heard from at its join; peer 1's stream is open
        assert (heard.peer, heard.connected, present.peer, present.last_seen_s, present.connected) == (
            0,
            False,
            1,
            0,
            True,
        )
        assert heard.last_seen_s >= 0.05
        ended()
        time.sleep(0.05)
        [gone] = [p for p in service.status().presence if p.peer == 1]
        assert not gone.connected and gone.last_seen_s >= 0.05
        service.uploads.receive(1, 1, feeding(peer_upload(SPEC, 1, seed=1)))
        completed_round(service, 1)
        done = service.status()
        assert (done.rounds_completed, done.open_round, list(done.missing_peers)) == (1, -1, [])
        for peer in range(2):
            service.uploads.receive(peer, 2, feeding(peer_upload(SPEC, peer, seed=2)))
        completed_round(service, 2)
        assert service.status().rounds_completed == 2
    with running(coordinator(SPEC, state_dir=str(tmp_path))) as kept:
        assert kept.status().persistent and kept.status().run_id == kept.run_id


@pytest.mark.timeout(60)
def test_the_server_says_what_it_waits_for_while_it_waits_and_stops_saying_it_when_stopped(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Every REPORT_S while peers are yet to join or a round is open, a `waiting:` line saying for what and whom;
    none while every peer is in and no round is open, and none once the server stops."""
    monkeypatch.setattr("spes.sync.coordinator.REPORT_S", 0.05)
    caplog.set_level(logging.INFO, "spes.server")

    before = set(threading.enumerate())
    service = coordinator(SPEC)

    def waiting() -> list[str]:  # NOTE: this run's only: another test's server may log in this process too
        return [m for m in caplog.messages if m.startswith(f"waiting: run {service.run_id}: ")]

    with running(service):
        service.join(join_request(0, SPEC), **JOIN)  # type: ignore[arg-type]
        wait_until(lambda: len(waiting()) >= 2, "two lines while peer 1 is yet to join")
        assert waiting()[-1] == (
            f"waiting: run {service.run_id}: no round completed yet; 1 of 2 peers joined (peer 1 never joined)"
        )
        service.join(join_request(1, SPEC), session="s1", address="test", common_name=lambda: None)
        caplog.clear()  # NOTE: a line is decided and written under the lock the join took: none after it is stale
        time.sleep(0.3)
        assert waiting() == []
        service.uploads.receive(0, 1, feeding(peer_upload(SPEC, 0, seed=1)))
        wait_until(lambda: len(waiting()) >= 2, "two lines while round 1 is open")
        assert waiting()[-1].startswith(f"waiting: run {service.run_id}: round 1 open for 0 s, uploaded by [0], ")
    assert [t for t in set(threading.enumerate()) - before if t.name == "spes-status-report"] == []  # joined
    caplog.clear()
    time.sleep(0.3)
    assert waiting() == []


@pytest.mark.timeout(60)
def test_a_status_never_shows_a_round_completed_before_it_is_counted() -> None:
    """The closer published round 1, then counted it outside the lock: a status between the two (a loaded machine)
    said round 1 was the latest with 0 rounds completed. The counting is held here while a status is asked."""
    with running(coordinator(SPEC)) as service:
        counting, count = threading.Event(), service.closer._published

        def slow_count(done: object, seconds: float) -> None:
            counting.set()
            time.sleep(0.3)
            count(done, seconds)  # type: ignore[arg-type]

        service.closer._published = slow_count
        for peer in range(2):
            service.join(join_request(peer, SPEC), session=f"s{peer}", address="test", common_name=lambda: None)
            service.uploads.receive(peer, 1, feeding(peer_upload(SPEC, peer, seed=1)))
        assert counting.wait(10)
        status = service.status()
        assert (status.current_round, status.rounds_completed) == (1, 1)


@pytest.mark.timeout(60)
def test_a_waiting_line_decided_before_a_join_is_written_before_the_join_returns(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The reporter decided under the lock and wrote after it: a reporter held between the two wrote, after peer 1's
    join had returned, that peer 1 never joined. Its writing is held here (a log handler waiting) while peer 1 joins."""
    monkeypatch.setattr("spes.sync.coordinator.REPORT_S", 0.05)
    caplog.set_level(logging.INFO, "spes.server")
    held, release, events = threading.Event(), threading.Event(), []

    class Holding(logging.Handler):  # NOTE: held in its filter, which runs outside the handler's own lock
        def filter(self, record: logging.LogRecord) -> bool:
            if record.getMessage().startswith("waiting:") and not held.is_set():
                held.set()
                release.wait(10)
                events.append("line")
            return True

        def emit(self, record: logging.LogRecord) -> None:
            pass

    handler = Holding()
    logging.getLogger("spes.server").addHandler(handler)
    try:
        with running(coordinator(SPEC)) as service:
            service.join(join_request(0, SPEC), **JOIN)  # type: ignore[arg-type]
            assert held.wait(10)
            joiner = threading.Thread(
                target=lambda: (service.join(join_request(1, SPEC), **{**JOIN, "session": "s1"}), events.append("join"))
            )
            joiner.start()
            time.sleep(0.3)  # NOTE: the join's time to return, were the line written outside the lock
            release.set()
            joiner.join(10)
    finally:
        logging.getLogger("spes.server").removeHandler(handler)
    assert events == ["line", "join"]


@pytest.mark.timeout(60)
def test_the_status_reporter_is_a_named_daemon_thread() -> None:
    """A server left running (a test that fails, an embedding process) must not keep its process alive; the name says
    in a thread dump what it is."""
    before = set(threading.enumerate())
    with running(coordinator(SPEC)):
        [reporter] = [t for t in set(threading.enumerate()) - before if t.name == "spes-status-report"]
        assert reporter.daemon


@pytest.mark.timeout(60)
def test_a_presence_stream_holds_its_peer_id_until_it_ends_and_one_of_another_run_is_refused_and_told(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A presence stream registers its process as the peer (a Join of another process is refused naming where it
    runs) until it ends; one of another run is refused (other_run) and the server warns from where."""
    with running(coordinator(SPEC, peer_liveness=0.2)) as service:
        ended = service.presence(0, "s0", service.run_id, "node-a:1", lambda: None)
        assert [(p.peer, p.connected) for p in service.status().presence] == [(0, True)]
        time.sleep(0.3)  # past the liveness: only the open stream keeps the peer id
        with pytest.raises(Refused, match="peer_id 0 is already joined by a live process at node-a:1; this join came "):
            service.join(join_request(0, SPEC), session="other", address="node-b:2", common_name=lambda: None)
        service.join(join_request(0, SPEC), session="s0", address="node-a:1", common_name=lambda: None)
        ended()
        assert [(p.peer, p.connected) for p in service.status().presence] == [(0, False)]
        time.sleep(0.3)
        service.join(join_request(0, SPEC), session="other", address="node-b:2", common_name=lambda: None)
        with pytest.raises(Refused) as err:
            service.presence(1, "s1", "another-run", "node-c:3", lambda: None)
        assert (err.value.reason, str(err.value)) == (
            Reason.OTHER_RUN,
            f"peer 1 belongs to run another-run (its checkpoint or spes_config.run_id), but this server holds run "
            f"{service.run_id} (no round yet): restart the server with that run's --state_dir, or start the node "
            "fresh (without --resume) for this one",
        )
        assert f"refused a presence stream from node-c:3: {err.value}" in caplog.messages
        assert [p.peer for p in service.status().presence] == [0]
        for _ in range(10):  # a leftover process retrying: 10 lines a window, then a count of what was left out
            with pytest.raises(Refused):
                service.presence(1, "s1", "another-run", "node-c:3", lambda: None)
        service.join(join_request(1, SPEC), session="s1", address="x", common_name=lambda: None)
        for peer in range(2):
            service.uploads.receive(peer, 1, feeding(peer_upload(SPEC, peer, seed=1)))
        completed_round(service, 1)
        with pytest.raises(Refused, match=f"peer 1 starts a fresh run, but this server holds run {service.run_id} at "):
            service.presence(1, "s1", "", "node-d:4", lambda: None)  # a fresh node, once the run has a round
    refused = [m for m in caplog.messages if m.startswith("refused a presence stream from ")]
    assert len(refused) == 10 and caplog.messages[-1].startswith("2 more 'presence' warnings left out in ")


@pytest.mark.timeout(60)
def test_a_stream_is_counted_against_its_peer_and_refused_once_its_process_was_replaced() -> None:
    """Each Upload/Download stream takes one of its peer's `--max_streams_per_peer` slots; a stream of a process
    whose peer id another process has since taken is refused (superseded), as is any once the server stops."""
    with joined(max_streams_per_peer=1) as service:
        service.open_stream(service.guard.admit(None), 0, "s0", lambda: None)
        service.open_stream(service.guard.admit(None), 1, "s1", lambda: None)
        with pytest.raises(Refused, match="peer 0 already has --max_streams_per_peer=1 streams open") as err:
            service.open_stream(service.guard.admit(None), 0, "s0", lambda: None)
        assert err.value.reason == Reason.BUSY
    with joined(peer_liveness=0.1) as service:
        time.sleep(0.2)
        service.join(join_request(0, SPEC), session="new", address="elsewhere", common_name=lambda: None)
        with pytest.raises(Refused, match="peer_id 0 has been taken over by another process at elsewhere") as err:
            service.open_stream(service.guard.admit(None), 0, "s0", lambda: None)
        assert err.value.reason == Reason.SUPERSEDED
        service.open_stream(service.guard.admit(None), 0, "new", lambda: None)
        service.shutdown(grace_s=1.0)
        with pytest.raises(Refused) as err:
            service.open_stream(service.guard.admit(None), 1, "s1", lambda: None)
        assert err.value.reason == Reason.SHUTTING_DOWN


@pytest.mark.timeout(60)
def test_with_tls_peer_ids_every_call_must_come_with_its_peers_certificate() -> None:
    """A Join, a stream and a presence stream naming a peer other than the caller's certificate's are refused."""
    tls = {"tls_cert": "c.pem", "tls_key": "k.pem", "tls_client_ca": "ca.pem", "tls_peer_ids": True}
    with running(coordinator(SPEC, **tls)) as service:
        for call in (
            lambda: service.join(join_request(0, SPEC), session="s0", address="a", common_name=lambda: "peer-1"),
            lambda: service.open_stream(service.guard.admit(None), 0, "s0", lambda: "peer-1"),
            lambda: service.presence(0, "s0", service.run_id, "a", lambda: "peer-1"),
        ):
            with pytest.raises(Refused, match="a call for peer 0 came with ") as err:
                call()
            assert err.value.code == grpc.StatusCode.PERMISSION_DENIED
        service.join(join_request(0, SPEC), session="s0", address="a", common_name=lambda: "peer-0")
        service.open_stream(service.guard.admit(None), 0, "s0", lambda: "peer-0")
        service.presence(0, "s0", service.run_id, "a", lambda: "peer-0")()


@pytest.mark.timeout(60)
def test_the_stream_limits_are_the_deploys_flags_with_the_rate_floor_in_bytes() -> None:
    """--min_stream_rate is KiB/s; the stream guard counts bytes."""
    limits = {"stream_idle_timeout": 7.0, "max_streams": 5, "max_streams_per_peer": 3, "min_stream_rate": 2.0}
    with running(coordinator(SPEC, **limits)) as service:
        guard = service.guard
        assert (guard.idle_timeout_s, guard.max_streams, guard.max_per_peer, guard.min_rate) == (7.0, 5, 3, 2048.0)


@pytest.mark.timeout(60)
def test_a_stopping_server_waits_for_a_running_aggregation_no_longer_than_its_grace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A round whose aggregation hangs (a stalled disk, a huge model) must not hold the server's stop past its
    grace: the process has to end within what its supervisor allows."""
    release, building = threading.Event(), threading.Event()
    build_round = closing.build_round

    def stalled(*args, **kwargs):  # type: ignore[no-untyped-def]
        building.set()
        release.wait(30)
        return build_round(*args, **kwargs)

    monkeypatch.setattr(closing, "build_round", stalled)
    with joined() as service:
        for peer in range(2):
            service.uploads.receive(peer, 1, feeding(peer_upload(SPEC, peer, seed=1)))
        assert building.wait(10)
        stop = threading.Thread(target=service.shutdown, args=(0.2,))
        stop.start()
        stop.join(10)
        stopped = not stop.is_alive()
        release.set()
        stop.join(30)
        assert stopped, "the stop waited for the aggregation past its grace"
