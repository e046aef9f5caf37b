"""Every run kind survives a restart bit for bit: a parameter server stopped after a round and started again on the
same --state_dir serves every later round exactly as an uninterrupted server does over the same uploads.

What a server persists differs by run kind: the global model in the codec's dtype (bf16 keeps its experts in bf16),
a held-model codec's held model (int8, sparse), DiLoCo's outer momentum, a fragmented run's partial model and
its fragment, the merge warm-up's rounds. Each kind runs the same rounds twice, once on one server and once with a
restart in the middle; every peer must download the same bits, with the same round facts, in both. So must a peer
whose download of the last round the stop cut off, and nodes resumed from their checkpoints (the codec's state read
back from its file) with the server running on or restarted too.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from spes.config import ServerSection
from spes.sync.client import SyncClient
from spes.sync.codecs.interface import PeerCodec
from spes.sync.node_files import CODEC_FILE, load_codec_state, save_codec_state
from spes.sync.protocol import Mode
from spes.sync.spec import RunSpec
from sync_helpers import joined_clients, peer_upload, running_server, tiny_spec

SERVER = ServerSection(merge_interval=2, merge_alpha_start=0.5, merge_decay_steps=1000, merge_topk=1)
"""Even steps merge (SPES: with 2 fragments every round does, for the whole round it stands in for); DiLoCo takes
the Nesterov outer step instead, whose momentum a restart must keep."""
SETTINGS = {"fp32": {}, "bf16": {}, "int8": {"block": 128}, "sparse": {"chunk": 16, "topk": 4}}
"""Each codec, with settings that make several blocks or chunks per tensor of the tiny model."""
STEPS = (1, 2, 3, 4, 5)


@dataclass(frozen=True)
class Kind:
    """A run kind: its codec, mode and fragments, and the round after which its server is restarted."""

    codec: str
    mode: Mode
    fragments: int = 1
    stop_after: int = 3
    """The last round the first server completes: 3, between merge rounds, so one merges on either side (and a bf16
    run's state holds its experts as uploaded, in bf16); 2, a merge round (its merged experts are fp32); with
    fragments 1, when the global model holds only the first fragment."""

    @property
    def spec(self) -> RunSpec:
        server = SERVER if self.mode == "spes" else ServerSection(merge_interval=0, outer_optimizer="nesterov")
        return tiny_spec(
            mode=self.mode,
            codec=self.codec,
            codec_settings=SETTINGS[self.codec],
            server=server,
            sync_steps=self.fragments,
            overlap_fragments=self.fragments,
        )


KINDS = [Kind(codec, mode) for codec in SETTINGS for mode in ("spes", "diloco")]
KINDS += [Kind("bf16", "spes", stop_after=2), Kind("int8", "spes", fragments=2, stop_after=1)]
KINDS += [Kind("sparse", "spes", fragments=2), Kind("fp32", "diloco", fragments=2)]
HELD = [Kind("int8", "spes"), Kind("sparse", "spes"), Kind("sparse", "spes", fragments=2)]
"""The kinds whose nodes keep a codec state between rounds."""


def kind_id(kind: Kind) -> str:
    return f"{kind.codec}-{kind.mode}-stop{kind.stop_after}" + (f"-{kind.fragments}fragments" * (kind.fragments > 1))


Downloads = dict[int, dict[int, tuple[dict[str, torch.Tensor], tuple[object, ...], tuple[int, int]]]]
"""step -> peer -> (what it downloaded, the round's facts as it saw them, the bytes it sent and received)."""


def run_rounds(clients: Sequence[SyncClient], spec: RunSpec, steps: Sequence[int], first_peer: int = 0) -> Downloads:
    """Peers `first_peer`, ... (`clients`) sync `steps` (each its fragment's round), uploading `peer_upload` of the
    step: the same uploads in every run, whatever the server did before."""
    got: Downloads = {}
    for step in steps:
        fragment = spec.layout.fragment_at(step, -1)
        with ThreadPoolExecutor(len(clients)) as pool:
            futures = {}
            for peer, client in enumerate(clients, start=first_peer):
                upload = peer_upload(spec, peer, seed=step)
                trained = {n: upload[n] for n in spec.layout.names(fragment, upload)}
                futures[peer] = pool.submit(client.sync, step, trained, fragment)
            results = {peer: future.result(timeout=60) for peer, future in futures.items()}
        got[step] = {
            peer: (
                {n: t.clone() for n, t in model.items()},
                (s.round, s.merged, s.alpha, s.peers, s.caught_up),
                (s.bytes_up, s.bytes_down),
            )
            for peer, (model, s) in results.items()
        }
    return got


def uninterrupted(spec: RunSpec) -> Downloads:
    with running_server(spec) as (_, addr), joined_clients(addr, spec) as clients:
        return run_rounds(clients, spec, STEPS)


def restarted(
    spec: RunSpec, folder: Path, stop_after: int, *, server: bool = True, nodes: bool = False, late: bool = False
) -> Downloads:
    """The rounds up to `stop_after`, then the rest after a restart: of the `server`, started again on its
    --state_dir, and of the `nodes`, resumed from their checkpoints (`checkpointed`); nodes that live on keep their
    codec's state (a held model, carried errors). Either way they re-join with the run's id. `late`: the server
    stopped before peer 1 downloaded the last round (it had uploaded it), so peer 1 syncs that round again, its
    upload a duplicate, its download from the restarted server."""
    before, after = STEPS[:stop_after], STEPS[stop_after:]
    with contextlib.ExitStack() as stack:
        _, addr = stack.enter_context(running_server(spec, state_dir=str(folder / "state")))
        with joined_clients(addr, spec) as clients:
            got = run_rounds(clients, spec, before[:-1])
            codecs = [client.codec for client in clients]
            if late:
                codecs[1] = copy.deepcopy(codecs[1])  # what peer 1 held before the last round's download
            got.update(run_rounds(clients, spec, before[-1:]))
            if nodes:
                codecs = [checkpointed(spec, client, folder / f"node{p}") for p, client in enumerate(clients)]
            run_id = clients[0].run_id
        if server:
            stack.close()
            _, addr = stack.enter_context(running_server(spec, state_dir=str(folder / "state")))
        with joined_clients(addr, spec, run_id=run_id) as clients:
            for client, codec in zip(clients, codecs, strict=True):
                client.codec = codec
            if late:
                got[before[-1]][1] = run_rounds(clients[1:], spec, before[-1:], first_peer=1)[before[-1]][1]
            return {**got, **run_rounds(clients, spec, after)}


def checkpointed(spec: RunSpec, client: SyncClient, checkpoint: Path) -> PeerCodec:
    """The codec of a node resumed from a checkpoint of `client`'s node: its state written to the checkpoint's file
    and read back into a fresh one, as `spes.sync.peer.PeerSync` does."""
    checkpoint.mkdir(parents=True)
    save_codec_state(checkpoint / CODEC_FILE, *client.codec.state_dict())
    codec = spec.codec_impl.peer()
    codec.load_state_dict(*load_codec_state(checkpoint / CODEC_FILE))
    return codec


def assert_same_bits(got: Downloads, want: Downloads, *, retried: tuple[int, int] | None = None) -> None:
    """Every peer downloaded the same bits with the same round facts and bytes in both runs (but the bytes of the
    `retried` (step, peer): its upload was a duplicate, its download maybe full values)."""
    assert sorted(got) == sorted(want)
    for step, peers in want.items():
        for peer, (model, facts, moved) in peers.items():
            their_model, their_facts, their_moved = got[step][peer]
            assert their_facts == facts, (step, peer)
            assert their_moved == moved or (step, peer) == retried, (step, peer)
            assert sorted(their_model) == sorted(model), (step, peer)
            for name, tensor in model.items():
                other = their_model[name]
                assert other.dtype == tensor.dtype, (step, peer, name)
                assert torch.equal(other.view(torch.uint8), tensor.view(torch.uint8)), (step, peer, name)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", KINDS, ids=kind_id)
def test_a_server_restarted_on_its_state_dir_serves_every_round_as_an_uninterrupted_one(
    tmp_path: Path, kind: Kind
) -> None:
    spec = kind.spec
    assert_same_bits(restarted(spec, tmp_path, kind.stop_after), uninterrupted(spec))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", KINDS, ids=kind_id)
def test_a_peer_that_had_not_downloaded_the_last_round_before_the_restart_gets_it_as_if_never_stopped(
    tmp_path: Path, kind: Kind
) -> None:
    """The server stops after publishing a round that one peer has uploaded but not yet downloaded: that peer's retry
    downloads it from the restarted server, which holds no deltas for it (`HeldServer.restore`: full values), and
    must load and hold what the uninterrupted peer did."""
    spec = kind.spec
    late = restarted(spec, tmp_path, kind.stop_after, late=True)
    assert_same_bits(late, uninterrupted(spec), retried=(kind.stop_after, 1))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("server", [False, True], ids=["server-on", "server-restarted"])
@pytest.mark.parametrize("kind", HELD, ids=kind_id)
def test_nodes_resumed_from_their_checkpoints_between_rounds_go_on_as_if_never_stopped(
    tmp_path: Path, kind: Kind, server: bool
) -> None:
    """Every node stops after a round and resumes from its checkpoint, its codec's state read back from the file
    (the held model, the carried errors: with fragments, also of the fragment whose round is next), while the server
    runs on or is restarted too (a whole run stopped and resumed): every later round is the uninterrupted one's."""
    spec = kind.spec
    assert_same_bits(restarted(spec, tmp_path, kind.stop_after, server=server, nodes=True), uninterrupted(spec))
