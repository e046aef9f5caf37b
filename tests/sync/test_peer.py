"""End to end over real gRPC on loopback: real trainers, a real server, the pure round function as the oracle."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
import torch

from dist_helpers import run_ranks
from peer_nodes import MERGE, QUIET, TINY, peer_config, peer_overrides, start_peer
from spes.config import load_config
from spes.distributed import DistInfo
from spes.node import build_node
from spes.sync.client import RoundPhases, SyncStats
from spes.sync.fragments import WHOLE, merge_step
from spes.sync.merge import build_global, parse_expert_block, round_alpha
from spes.sync.node_files import CODEC_FILE, PENDING_FILE, RUN_FILE
from spes.sync.overlap import apply_overlapped
from spes.sync.peer import PeerSync, SyncResult
from spes.sync.proto import spes_pb2 as pb
from spes.sync.protocol import SyncError, Tensors
from spes.sync.server import spec_of_run
from spes.sync.spec import RunSpec
from spes.sync.status import describe
from spes.trainer import Trainer
from sync_helpers import running_server


class RecordingSync:
    """Wraps PeerSync and keeps what was uploaded and what the model held before and after each round."""

    def __init__(self, inner: PeerSync, model: torch.nn.Module) -> None:
        self.inner, self.model = inner, model
        self.before: dict[int, dict[str, torch.Tensor]] = {}
        self.after: dict[int, dict[str, torch.Tensor]] = {}
        self.held: dict[int, dict[str, torch.Tensor]] = {}
        """A held-model codec's held model after each round."""

    def state(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}

    def sync(self, step: int) -> SyncResult:
        self.before[step] = self.state()
        result = self.inner.sync(step)
        self.after[step] = self.state()
        held = getattr(self.inner.client.codec, "held", None) if self.inner.client is not None else None
        if held is not None:
            self.held[step] = {n: t.clone() for n, t in held.items()}
        return result

    def __getattr__(self, name: str) -> object:  # the rest of the Syncer: PeerSync's own
        return getattr(self.inner, name)


def run_peers(
    corpus,
    tmp_path: Path,
    addr: str,
    *,
    dilico: bool,
    steps: int = 8,
    extra: tuple[str, ...] = (),
    log: Callable[[str], None] = lambda _m: None,
) -> list[tuple[RecordingSync, Trainer]]:  # type: ignore[no-untyped-def]
    peers = []
    for peer in range(2):
        trainer = start_peer(peer_config(corpus, tmp_path, addr, peer, *run_args(dilico, steps, extra)), log)
        assert isinstance(trainer.syncer, PeerSync)
        trainer.syncer = recorder = RecordingSync(trainer.syncer, trainer.model)
        peers.append((recorder, trainer))
    with ThreadPoolExecutor(2) as pool:
        for future in [pool.submit(t.fit) for _, t in peers]:
            future.result(timeout=240)
    for recorder, _ in peers:
        recorder.inner.close()
    return peers


def run_args(dilico: bool, steps: int = 8, extra: tuple[str, ...] = ()) -> tuple[str, ...]:
    return (f"--max_duration={steps}st", f"--using_dilico={dilico}".lower(), *extra)


def server_spec(corpus: Any, folder: Path, *extra: str, num_peers: int = 2) -> RunSpec:
    """The spec the server of these runs builds from the nodes' YAML and overrides, with its merge warm-up."""
    overrides = peer_overrides(corpus, folder, "127.0.0.1:1", 0, *extra, f"--spes_config.num_peers={num_peers}")
    return spec_of_run(TINY, [*overrides, *MERGE])


def trained(state: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: state[n] for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("dilico", [False, True], ids=["spes", "diloco"])
def test_after_every_round_peers_hold_the_aggregate_of_their_uploads(tiny_corpus, tmp_path: Path, dilico: bool) -> None:
    spec = server_spec(tiny_corpus, tmp_path, *run_args(dilico))
    with running_server(spec) as (_, addr):
        peers = run_peers(tiny_corpus, tmp_path, addr, dilico=dilico)
    (rec0, t0), (rec1, t1) = peers
    assert sorted(rec0.after) == [2, 4, 6, 8]
    for step in rec0.after:
        uploads = {0: trained(rec0.before[step], t0.model), 1: trained(rec1.before[step], t1.model)}
        expected = build_global(uploads, spec=spec, step=step).tensors
        for name, value in expected.items():
            torch.testing.assert_close(rec0.after[step][name], value, rtol=0, atol=0, msg=f"peer 0 {name} @ {step}")
            torch.testing.assert_close(rec1.after[step][name], value, rtol=0, atol=0, msg=f"peer 1 {name} @ {step}")
        assert set(expected) == set(rec0.after[step])  # every tensor of the model came out of the round
    if not dilico:
        merged_rounds = [s for s in rec0.after if s % spec.server.merge_interval == 0]
        owned0 = "blocks.0.ffn.experts.w1.0"
        assert not torch.equal(rec0.after[merged_rounds[0]][owned0], rec0.before[merged_rounds[0]][owned0])
        assert torch.equal(rec0.after[2][owned0], rec0.before[2][owned0])  # no merge: own experts stay as trained


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_frozen_experts_change_only_through_sync(tiny_corpus, tmp_path: Path) -> None:
    with running_server(server_spec(tiny_corpus, tmp_path, *run_args(False))) as (_, addr):
        (rec0, _), _ = run_peers(tiny_corpus, tmp_path, addr, dilico=False)
    frozen = [n for n in rec0.after[2] if (b := parse_expert_block(n)) is not None and b.block == 1]
    steps = sorted(rec0.after)
    for prev, step in zip(steps, steps[1:]):
        for name in frozen:
            assert torch.equal(rec0.before[step][name], rec0.after[prev][name]), (name, step)
        assert any(not torch.equal(rec0.after[step][n], rec0.before[step][n]) for n in frozen)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("codec", ["int8", "sparse"])
def test_held_codec_trainers_hold_the_servers_model_bit_for_bit_after_every_round(
    tiny_corpus, tmp_path: Path, codec: str
) -> None:
    """`spes_config.codec: int8` (or sparse) end to end: after every round (a merge round included) both trainers
    hold the same held model bit for bit, after the last one the server's, and load it, but for each one's own
    expert blocks on a round without merging: those it keeps as it trained them (what it uploaded)."""
    extra = (f"--spes_config.codec={codec}",)
    spec = server_spec(tiny_corpus, tmp_path, *run_args(False, extra=extra))
    with running_server(spec) as (server, addr):
        peers = run_peers(tiny_corpus, tmp_path, addr, dilico=False, extra=extra)
        done = server.service.state.completed
    assert sorted(peers[0][0].after) == [2, 4, 6, 8] and done is not None and done.served.round == 8
    merged = [step for step in peers[0][0].after if round_alpha(step, spec.mode, spec.server) > 0]
    assert merged == [4, 8]
    for step in (2, 4, 6, 8):
        held = peers[0][0].held[step]
        for p, (rec, _) in enumerate(peers):
            assert sorted(rec.held[step]) == sorted(rec.after[step])
            for name, value in rec.after[step].items():
                assert torch.equal(rec.held[step][name].view(torch.int32), held[name].view(torch.int32)), (name, step)
                as_trained = step not in merged and spec.owner(name) == p
                want = rec.before[step][name] if as_trained else held[name]
                assert torch.equal(value.view(torch.int32), want.view(torch.int32)), (p, name, step)
    for name, value in done.served.tensors.items():
        assert torch.equal(value.view(torch.int32), peers[0][0].held[8][name].view(torch.int32)), name


# ---------------------------------------------------------------------------------------------------------------
# Overlapped rounds (spes_config.overlap_sync)

OVERLAP = ["--spes_config.overlap_sync=true"]


def test_results_of_one_step_add_up() -> None:
    phases = RoundPhases(0.25, 0.5, 0.125)
    due = SyncResult(step=8, stats=SyncStats(1.0, 10, 20, 6, True, 0.5, phases=phases), rounds=1, waited_s=0.25)
    started_and_due = SyncResult(
        step=8, stats=SyncStats(2.0, 30, 40, 8, False, 0.0, phases=phases), rounds=1, waited_s=0.5
    )
    both = SyncResult(step=8, rounds=0).then(due).then(started_and_due)
    assert both.metrics() == {
        "sync_s": 3.0,
        "sync_mb_up": 40 / 2**20,
        "sync_mb_down": 60 / 2**20,
        "sync_round": 8,
        "merged": True,
        "merge_alpha": 0.0,
        "sync_upload_s": 0.5,
        "sync_publish_s": 1.0,
        "sync_download_s": 0.25,
        "sync_wait_s": 0.75,
        "sync_rounds": 2,
    }
    assert SyncResult(step=4, rounds=0).metrics() == {} and "sync_wait_s" not in SyncResult(step=4).metrics()


def fit(trainer: Trainer) -> Trainer:
    try:
        trainer.fit()
    finally:
        assert isinstance(trainer.syncer, PeerSync)
        trainer.syncer.close()
    return trainer


def weight_bits(trainer: Trainer) -> dict[str, bytes]:
    """Every parameter's raw bytes (so -0.0 and +0.0 differ)."""
    return {n: p.detach().contiguous().numpy().tobytes() for n, p in trainer.model.named_parameters()}


def losses(history: list[dict[str, Any]]) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in history]


def two_peers(corpus: Any, folder: Path, *extra: str) -> list[Trainer]:
    """Both peers trained to the end against a fresh server (merge warm-up every 4 steps)."""
    with running_server(server_spec(corpus, folder, *extra)) as (_, addr), ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(fit, start_peer(peer_config(corpus, folder, addr, p, *extra))) for p in range(2)]
        return [f.result(timeout=240) for f in futures]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_overlap_with_a_delay_of_zero_steps_is_the_blocking_run_bit_for_bit(tiny_corpus: Any, tmp_path: Path) -> None:
    blocking = two_peers(tiny_corpus, tmp_path / "blocking")
    overlapped = two_peers(tiny_corpus, tmp_path / "overlapped", *OVERLAP, "--spes_config.overlap_steps=0")
    for b, o in zip(blocking, overlapped):
        assert isinstance(o.syncer, PeerSync) and o.syncer.overlap_steps == 0 and b.syncer.overlap_steps == 0  # type: ignore[union-attr]
        assert weight_bits(o) == weight_bits(b)
        assert losses(o.history) == losses(b.history)
        rounds = [r for r in o.history if "sync_wait_s" in r]
        assert [(r["step"], r["sync_rounds"]) for r in rounds] == [(2, 1), (4, 1), (6, 1), (8, 1)]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_fragments_round_aggregates_that_fragment_and_the_last_step_the_whole_model(
    tiny_corpus: Any, tmp_path: Path
) -> None:
    """sync_steps 4 over 2 fragments, applied at once: rounds at steps 2, 4, 6 over fragments 1, 2, 1 and a whole
    round at the last step, 7, though not a sync step. After each, both peers hold the aggregate of their uploads of
    that fragment (merged as the whole round it stands in for) and every other tensor as they trained it; at the
    end, the same model."""
    extra = (
        *OVERLAP,
        "--spes_config.sync_steps=4",
        "--spes_config.overlap_fragments=2",
        "--spes_config.overlap_steps=0",
    )
    lines: list[str] = []
    spec = server_spec(tiny_corpus, tmp_path, *run_args(False, 7, extra))
    with running_server(spec) as (_, addr):
        (rec0, t0), (rec1, t1) = run_peers(
            tiny_corpus, tmp_path, addr, dilico=False, steps=7, extra=extra, log=lines.append
        )
    assert sorted(rec0.after) == [2, 4, 6, 7]
    said = [line for line in lines if line.startswith("2 fragments, one every 2 steps, uploading ")]
    assert len(said) == 2 and said[0].endswith(" MiB (fp32) of what this node trains"), lines
    layout = rec0.inner.layout
    assert [layout.fragment_at(step, 7) for step in rec0.after] == [1, 2, 1, WHOLE]
    for step in rec0.after:
        fragment = layout.fragment_at(step, 7)
        names = layout.names(fragment, [n for n, _ in t0.model.named_parameters()])
        uploads = {
            p: {n: t for n, t in trained(rec.before[step], t.model).items() if n in names}
            for p, (rec, t) in enumerate(((rec0, t0), (rec1, t1)))
        }
        expected = build_global(uploads, spec=spec, step=merge_step(step, 4, fragment)).tensors
        assert sorted(expected) == sorted(names)
        for rec in (rec0, rec1):
            for name, value in rec.after[step].items():
                want = expected[name] if name in names else rec.before[step][name]
                torch.testing.assert_close(value, want, rtol=0, atol=0, msg=f"{name} @ {step}")
    assert all(torch.equal(rec0.after[7][n], rec1.after[7][n]) for n in rec0.after[7])


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("fragments, codec", [(1, "fp32"), (2, "fp32"), (2, "int8")])
def test_a_node_checkpointed_mid_round_resumes_as_if_never_stopped(
    tiny_corpus: Any, tmp_path: Path, fragments: int, codec: str
) -> None:
    """Rounds every 4 steps applied 2 steps later; peer 1 stops at step 5, its round of step 4 in flight, and resumes
    from that checkpoint while peer 0 trains on: both end as in the uninterrupted run, bit for bit. With 2 fragments
    a round comes every 2 steps, each applied 2 steps later; with int8 the checkpoint also holds the codec's state
    from before the round in flight (held model, carried error), so the resumed node sends the very same bytes."""
    extra = [
        *OVERLAP,
        "--spes_config.sync_steps=4",
        "--spes_config.overlap_steps=2",
        "--max_duration=12st",
        f"--spes_config.overlap_fragments={fragments}",
        f"--spes_config.codec={codec}",
    ]
    reference = two_peers(tiny_corpus, tmp_path / "straight", *extra)
    folder = tmp_path / "stopped"

    def stop_and_resume(addr: str) -> tuple[Trainer, Trainer]:
        first = fit(start_peer(peer_config(tiny_corpus, folder, addr, 1, *extra, "--stop_at=5", "--save_interval=5")))
        assert (folder / "node1" / "step5" / PENDING_FILE).is_file()
        files = [RUN_FILE, PENDING_FILE, CODEC_FILE] if codec == "int8" else [RUN_FILE, PENDING_FILE]
        assert sorted(json.loads((folder / "node1" / "step5" / "meta.json").read_text())["extra"]) == sorted(files)
        again = peer_config(tiny_corpus, folder, addr, 1, *extra, f"--load_path={folder / 'node1'}")
        return first, fit(start_peer(again))

    with running_server(server_spec(tiny_corpus, folder, *extra)) as (_, addr), ThreadPoolExecutor(2) as pool:
        steady = pool.submit(fit, start_peer(peer_config(tiny_corpus, folder, addr, 0, *extra)))
        first, resumed = pool.submit(stop_and_resume, addr).result(timeout=240)
        peers = [steady.result(timeout=240), resumed]
    assert losses(first.history + resumed.history) == losses(reference[1].history)
    for peer in range(2):
        assert weight_bits(peers[peer]) == weight_bits(reference[peer]), peer
    landed = [(r["step"], r["sync_round"]) for r in resumed.history if "sync_wait_s" in r]
    assert landed == ([(6, 4), (10, 8), (12, 12)] if fragments == 1 else [(6, 4), (8, 6), (10, 8), (12, 12)])


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("codec", ["fp32", "int8"])
def test_an_overlapped_node_the_run_moved_past_catches_up(tiny_corpus: Any, tmp_path: Path, codec: str) -> None:
    """Peer 1 stops at step 7 and resumes from its step-2 checkpoint (round 2 in flight); the run has completed
    round 6 meanwhile: at the round's step it loads the whole global model of round 6 and continues from there
    (with int8: the server's held model, as full values; its carried error dropped, its upload never taken)."""
    extra = [
        *OVERLAP,
        "--spes_config.overlap_steps=1",
        "--save_interval=2",
        "--save_num_checkpoints_to_keep=-1",
        f"--spes_config.codec={codec}",
    ]
    with running_server(server_spec(tiny_corpus, tmp_path, *extra)) as (_, addr), ThreadPoolExecutor(2) as pool:
        steady = pool.submit(fit, start_peer(peer_config(tiny_corpus, tmp_path, addr, 0, *extra)))
        fit(start_peer(peer_config(tiny_corpus, tmp_path, addr, 1, *extra, "--stop_at=7")))
        assert (tmp_path / "node1" / "step2" / PENDING_FILE).is_file()
        old = f"--load_path={tmp_path / 'node1' / 'step2'}"
        behind = fit(start_peer(peer_config(tiny_corpus, tmp_path, addr, 1, *extra, old)))
        ahead = steady.result(timeout=240)
    caught_up = [r for r in behind.history if "caught_up_to" in r]
    assert [(r["step"], r["caught_up_to"]) for r in caught_up] == [(6, 6)]
    assert [r["step"] for r in behind.history] == [6, 7, 8]  # its step 3 became step 6: the run was past 3..6
    shared = [n for n, p in ahead.model.named_parameters() if ".experts." not in n]
    weights = [dict(t.model.named_parameters()) for t in (ahead, behind)]
    assert shared and all(torch.equal(weights[0][n], weights[1][n]) for n in shared)  # both end on round 8's model


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_failed_overlapped_round_raises_at_the_step_it_was_due(tiny_corpus: Any, tmp_path: Path) -> None:
    alone = (*OVERLAP, "--spes_config.overlap_steps=1", "--spes_config.num_train_experts_per_node=8")
    with running_server(server_spec(tiny_corpus, tmp_path, *alone, num_peers=1)) as (_, addr):
        cfg = peer_config(
            tiny_corpus,
            tmp_path,
            addr,
            0,
            *alone,
            "--spes_config.num_peers=1",
            "--spes_config.max_retries=0",
            "--spes_config.rpc_timeout_s=5",
        )
        trainer = start_peer(cfg)
    # the line also says what TLS needs: a TLS server shows a client without its CA only `Socket closed`
    running = f"is the parameter server running at spes_config.server_addr={addr} and reachable from this node\\? "
    with pytest.raises(SyncError, match=running + r"\(a server that serves TLS needs spes_config.tls_ca\)"):
        fit(trainer)  # the server is gone: the round uploaded at step 2 fails in the background
    assert trainer.step == 3


@pytest.mark.timeout(120)
def test_a_node_admitted_by_its_dry_join_says_its_mode_when_it_joins(tiny_corpus: Any, tmp_path: Path) -> None:
    """The join line never named the mode: a DiLoCo baseline's log read as a SPES node's."""
    alone = (*run_args(True), "--spes_config.num_peers=1")
    logged: list[str] = []
    with running_server(server_spec(tiny_corpus, tmp_path, *run_args(True), num_peers=1)) as (_, addr):
        trainer = start_peer(peer_config(tiny_corpus, tmp_path, addr, 0, *alone), logged.append)
        assert trainer.syncer is not None
        trainer.syncer.close()
    assert not [line for line in logged if "dry join" in line], logged  # admitted: nothing to say
    assert "DiLoCo node, peer 0 of 1; experts: trains all 8 of every MoE layer" in logged
    joined = "joined parameter server as a DiLoCo node (no round completed yet); uploading"
    assert any(line.startswith(joined) for line in logged), logged


def _admission_worker(args: dict[str, Any], info: DistInfo) -> str:
    """`check_admitted` on this torchrun's ranks: what each raised."""
    from spes.model import Transformer
    from spes.sync.peer import check_admitted

    cfg = load_config(TINY, args["overrides"])[0]
    with torch.device("meta"):
        model = Transformer.for_run(cfg)
    try:
        check_admitted(cfg, model, info, None, QUIET)
    except SyncError as exc:
        return str(exc)
    return "admitted"


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_refusal_before_the_build_stops_every_rank_of_the_node(tiny_corpus: Any, tmp_path: Path) -> None:
    """Rank 0 asks the server; the other ranks, which would go on to build and wait in a collective until torchrun
    killed them, stop too."""
    with running_server(server_spec(tiny_corpus, tmp_path, *run_args(False))) as (_, addr):
        overrides = peer_overrides(tiny_corpus, tmp_path, addr, 0, *run_args(True))
        said = run_ranks(2, "sync.test_peer:_admission_worker", {"overrides": overrides}, tmp_path / "ranks")
    assert "failed (FAILED_PRECONDITION): peer 0 has mode = 'diloco' but the run has mode = 'spes'" in said[0]
    assert said[1] == "rank 0 failed to be admitted by the parameter server; its error line says why"


def test_a_refused_tls_handshake_is_not_called_an_unreachable_server() -> None:
    """A retried-out UNAVAILABLE gets the hint to check the server and the address; a TLS handshake the client
    refused (not retried: `plane_grpc.failure_of` says what it means) is raised as it is."""
    node = SimpleNamespace(distributed=False, server_addr="h:1", tls_files=("ca.pem", None))
    refused = SyncError(
        "join failed (UNAVAILABLE): the server's TLS certificate has expired", grpc.StatusCode.UNAVAILABLE
    )
    with pytest.raises(SyncError) as err:
        PeerSync._agree(node, refused, "join the parameter server")  # type: ignore[arg-type]
    assert err.value is refused
    down = SyncError("join failed (UNAVAILABLE): Connection refused", grpc.StatusCode.UNAVAILABLE, retryable=True)
    with pytest.raises(SyncError, match=r"Connection refused; is the parameter server running at spes_config.serve"):
        PeerSync._agree(node, down, "join the parameter server")  # type: ignore[arg-type]


def _full(model: torch.nn.Module) -> Tensors:
    """Every parameter whole, on every rank (gathered from the shards under FSDP: a collective)."""
    from spes.distributed import unwrap

    return {
        n: (p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach()).clone()
        for n, p in unwrap(model).named_parameters()
    }


def _overlapped_node_worker(args: dict[str, Any], info: DistInfo) -> dict[str, Any]:
    """One overlapped node on this torchrun's ranks. At each round it applies, rank 0 checks the weights every rank
    then holds against the rule computed from whole tensors; every rank reports a digest of what it holds."""
    cfg = load_config(TINY, args["overrides"])[0]
    node = build_node(cfg, info, log=QUIET)
    landed: dict[str, Any] = {}

    class Checked(PeerSync):
        def _load(self, step: int, downloaded: Tensors, *rest: Any, **kwargs: Any) -> SyncResult:
            before, glob = _full(self.model), {n: t.clone() for n, t in downloaded.items()}
            snapshot = {n: t.clone() for n, t in (kwargs.get("snapshot") or {}).items()}
            result = super()._load(step, downloaded, *rest, **kwargs)
            after = _full(self.model)
            digest = hashlib.sha256(b"".join(after[n].numpy().tobytes() for n in sorted(after))).hexdigest()
            expected = apply_overlapped(glob, before, snapshot) if info.is_main else {}
            held = self.client.codec.held if self.client is not None else {}  # type: ignore[attr-defined]
            served = hashlib.sha256(b"".join(held[n].numpy().tobytes() for n in sorted(held))).hexdigest()
            others = set(self.trainable) - set(kwargs["trained"])  # trained here, outside the round's fragment
            landed[str(step)] = {
                "digest": digest,
                "served": served,
                "rule_holds": all(torch.equal(after[n], t) for n, t in expected.items()),
                "served_is_held": all(torch.equal(t, held[n]) for n, t in glob.items()),
                "applied": sorted(expected),
                "others_kept": all(torch.equal(after[n], before[n]) for n in others),
                "others": len(others),
            }
            return result

    syncer = Checked(cfg, node.model, info, log=QUIET)
    syncer.join()
    trainer = Trainer(
        cfg=cfg, model=node.model, optimizer=node.optimizer, loader=node.loader, info=info, syncer=syncer, log=QUIET
    )
    trainer.fit()
    syncer.close()
    return landed


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_four_int8_nodes_over_fragments_and_overlap_hold_the_same_held_model_after_every_round(
    tiny_corpus: Any, tmp_path: Path
) -> None:
    """Every sync feature at once: 4 nodes with int8 deltas, sync_steps 2 over 2 fragments (a round every step, over
    one fragment: each rank gathers and loads only its tensors), each applied 1 step later, the whole model at the
    last step. Node 0 runs on 2 DDP ranks, node 1 on 2 FSDP2 ranks (gloo), nodes 2 and 3 on one process each.

    After every round every node holds the same held model, bit for bit, and what it loads before its own progress
    is added is of it (but for its own blocks taken verbatim, which it keeps), the overlap rule holds on whole
    tensors, every rank of a node holds the same, and a fragment's round leaves the node's tensors of the other
    fragment as it trained them (a held model served whole would reset them to their last round's values: training
    stalls)."""
    from dist_helpers import SMALL_NODE

    extra = (
        *SMALL_NODE,
        "--model.moe_num_experts=8",
        "--spes_config.num_train_experts_per_node=2",
        "--spes_config.codec=int8",
        *OVERLAP,
        "--spes_config.overlap_fragments=2",
        "--spes_config.overlap_steps=1",
        "--max_duration=4st",
        "--data.validation_paths=[]",
    )

    def node(addr: str, peer: int, strategy: str, ranks: int) -> list[Any]:
        overrides = peer_overrides(
            tiny_corpus, tmp_path, addr, peer, *extra, "--spes_config.num_peers=4", f"--distributed_strategy={strategy}"
        )
        return run_ranks(
            ranks,
            "sync.test_peer:_overlapped_node_worker",
            {"overrides": overrides},
            tmp_path / f"ranks{peer}",
            timeout=300,
        )

    layout = [(0, "ddp", 2), (1, "fsdp", 2), (2, "single", 1), (3, "single", 1)]
    with (
        running_server(server_spec(tiny_corpus, tmp_path, *extra, num_peers=4)) as (_, addr),
        ThreadPoolExecutor(4) as pool,
    ):
        futures = [pool.submit(node, addr, *args) for args in layout]
        nodes = [f.result(timeout=380) for f in futures]
    for ranks in nodes:
        main = ranks[0]
        assert sorted(main) == ["2", "3", "4"]  # rounds 1, 2 and 3 a step later, 4 at once
        for step in ("2", "3", "4"):
            assert main[step]["rule_holds"] and main[step]["applied"] and main[step]["served_is_held"], step
            assert main[step]["others_kept"] and (main[step]["others"] > 0) == (step != "4"), step
            assert all(other[step]["digest"] == main[step]["digest"] for other in ranks[1:]), step
            assert main[step]["served"] == nodes[0][0][step]["served"], step  # every node: the same held model


@pytest.mark.parametrize("current", [-1, 20])
def test_the_join_line_names_the_servers_latest_round_as_spes_status_does(current: int) -> None:
    """It read "current round: step -1" before the first round, then "the run's latest round: step 20" where
    `python -m spes.status` (and the server's log) read "round 20 complete"."""
    logged: list[str] = []
    node = SimpleNamespace(
        client=SimpleNamespace(join=lambda: current),
        spec=SimpleNamespace(mode="spes", manifest={}, codec="fp32"),
        trainable=[],
        layout=SimpleNamespace(overlap_fragments=1),
        log=logged.append,
        _agree=lambda error, what: None,
    )
    PeerSync.join(node)  # type: ignore[arg-type]
    status = describe(pb.StatusReply(run_id="r", num_peers=1, current_round=current, open_round=-1, peers_joined=[0]))
    latest = status.removeprefix("run r: ").split(";")[0]
    assert logged[0].startswith(f"joined parameter server as a SPES node ({latest}); uploading"), (logged, status)
