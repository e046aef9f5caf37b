"""End to end over real gRPC on loopback: real trainers, a real server, the pure round function as the oracle."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from spes.config import load_config
from spes.distributed import DistInfo
from spes.sync.merge import MergeConfig, build_global, parse_expert_block
from spes.sync.peer import PeerSync, SyncResult
from spes.train import build_node
from spes.trainer import Trainer
from sync_helpers import running_server

REPO = Path(__file__).resolve().parents[1]
CPU = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
MERGE = MergeConfig(interval=4, alpha_start=0.05, decay_steps=100, topk=2)


class RecordingSync:
    """Wraps PeerSync and keeps what was uploaded and what the model held before and after each round."""

    def __init__(self, inner: PeerSync, model: torch.nn.Module) -> None:
        self.inner, self.model = inner, model
        self.before: dict[int, dict[str, torch.Tensor]] = {}
        self.after: dict[int, dict[str, torch.Tensor]] = {}

    def state(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}

    def sync(self, step: int) -> SyncResult:
        self.before[step] = self.state()
        result = self.inner.sync(step)
        self.after[step] = self.state()
        return result


def run_peers(
    corpus, tmp_path: Path, addr: str, *, dilico: bool, steps: int = 8, extra: tuple[str, ...] = ()
) -> list[tuple[RecordingSync, Trainer]]:  # type: ignore[no-untyped-def]
    peers = []
    for peer in range(2):
        cfg, _ = load_config(
            str(REPO / "configs" / "tiny.yaml"),
            [
                *corpus.overrides(tmp_path / f"node{peer}"),
                f"--spes_config.peer_id={peer}",
                "--spes_config.num_peers=2",
                "--spes_config.num_train_experts_per_node=4",
                f"--spes_config.server_addr={addr}",
                "--spes_config.sync_steps=2",
                f"--max_duration={steps}st",
                "--eval_interval=null",
                "--save_interval=null",
                "--spes_config.rpc_timeout_s=30",
                "--spes_config.round_timeout_s=60",
                f"--using_dilico={str(dilico).lower()}",
                *extra,
            ],
        )
        node = build_node(cfg, CPU, log=lambda _m: None)
        peer_sync = PeerSync(cfg, node.model, CPU, log=lambda _m: None)
        peer_sync.join()
        recorder = RecordingSync(peer_sync, node.model)
        trainer = Trainer(
            cfg=cfg,
            model=node.model,
            optimizer=node.optimizer,
            loader=node.loader,
            info=CPU,
            syncer=recorder,
            log=lambda _m: None,
        )
        peers.append((recorder, trainer))
    with ThreadPoolExecutor(2) as pool:
        for future in [pool.submit(t.fit) for _, t in peers]:
            future.result(timeout=240)
    for recorder, _ in peers:
        recorder.inner.close()
    return peers


def trained(state: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: state[n] for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("dilico", [False, True], ids=["spes", "diloco"])
def test_after_every_round_peers_hold_the_aggregate_of_their_uploads(tiny_corpus, tmp_path: Path, dilico: bool) -> None:
    mode = "diloco" if dilico else "spes"
    with running_server(num_peers=2, experts_per_peer=8 if dilico else 4, mode=mode, merge=MERGE) as (_, addr):
        peers = run_peers(tiny_corpus, tmp_path, addr, dilico=dilico)
    (rec0, t0), (rec1, t1) = peers
    assert sorted(rec0.after) == [2, 4, 6, 8]
    for step in rec0.after:
        uploads = {0: trained(rec0.before[step], t0.model), 1: trained(rec1.before[step], t1.model)}
        expected = build_global(uploads, num_peers=2, experts_per_peer=4, mode=mode, step=step, merge=MERGE).tensors
        for name, value in expected.items():
            torch.testing.assert_close(rec0.after[step][name], value, rtol=0, atol=0, msg=f"peer 0 {name} @ {step}")
            torch.testing.assert_close(rec1.after[step][name], value, rtol=0, atol=0, msg=f"peer 1 {name} @ {step}")
        assert set(expected) == set(rec0.after[step])  # every tensor of the model came out of the round
    if not dilico:
        merged_rounds = [s for s in rec0.after if s % MERGE.interval == 0]
        owned0 = "blocks.0.ffn.experts.w1.0"
        assert not torch.equal(rec0.after[merged_rounds[0]][owned0], rec0.before[merged_rounds[0]][owned0])
        assert torch.equal(rec0.after[2][owned0], rec0.before[2][owned0])  # no merge: own experts stay as trained


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_frozen_experts_change_only_through_sync(tiny_corpus, tmp_path: Path) -> None:
    with running_server(num_peers=2, experts_per_peer=4, merge=MERGE) as (_, addr):
        (rec0, _), _ = run_peers(tiny_corpus, tmp_path, addr, dilico=False)
    frozen = [n for n in rec0.after[2] if (b := parse_expert_block(n)) is not None and b.block == 1]
    steps = sorted(rec0.after)
    for prev, step in zip(steps, steps[1:]):
        for name in frozen:
            assert torch.equal(rec0.before[step][name], rec0.after[prev][name]), (name, step)
        assert any(not torch.equal(rec0.after[step][n], rec0.before[step][n]) for n in frozen)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_int8_trainers_hold_the_servers_model_bit_for_bit_after_every_round(tiny_corpus, tmp_path: Path) -> None:
    """`spes_config.wire_dtype: int8` end to end: after every round (a merge round included) both trainers' whole
    models are equal bit for bit, and after the last one equal to the server's held model."""
    with running_server(num_peers=2, experts_per_peer=4, merge=MERGE, wire_dtype="int8") as (server, addr):
        peers = run_peers(tiny_corpus, tmp_path, addr, dilico=False, extra=("--spes_config.wire_dtype=int8",))
        held = server.service.state.held
    (rec0, _), (rec1, _) = peers
    assert sorted(rec0.after) == [2, 4, 6, 8] and held is not None and held.round == 8
    for step, model in rec0.after.items():
        for name, value in model.items():
            assert torch.equal(value.view(torch.int32), rec1.after[step][name].view(torch.int32)), (name, step)
    for name, value in held.tensors.items():
        assert torch.equal(value.view(torch.int32), rec0.after[8][name].view(torch.int32)), name
