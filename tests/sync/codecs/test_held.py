"""Held-model codecs (spes.sync.codecs.held over the int8 and sparse quantizers): the math of a round driven through
the production classes and the wire, then real servers and clients on loopback, both planes.

After every round every peer's held model (what it loads) must equal the server's bit for bit, merge rounds
included; the server's global model must track a lossless run exactly up to the peers' carried errors (error
feedback keeps what was not sent); a peer holding no model, or another one, gets full values; bad payloads are
refused naming the tensor; a node whose codec or settings differ from the server's is refused at join.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from spes.config import ServerSection
from spes.sync import plane_tcp
from spes.sync.client import SyncClient, SyncError
from spes.sync.codecs import int8
from spes.sync.codecs.base import NO_BASE, Quantizer
from spes.sync.codecs.held import REENCODE_LIMIT, HeldPeer, HeldServer, apply_delta, encode_delta, headroom, next_held
from spes.sync.codecs.interface import Served, UploadBase
from spes.sync.codecs.sparse import Sparse
from spes.sync.merge import build_global, round_alpha
from spes.sync.proto import spes_pb2 as pb
from spes.sync.protocol import Reason
from spes.sync.server import ParameterServer
from spes.sync.spec import RunSpec
from spes.sync.wire import DIGEST, Coded, TensorDecoder, checksum, encode_tensors, header_for
from sync_helpers import NO_MERGE, joined_clients, make_client, running_server, sync_all, tiny_spec

MERGE = ServerSection(merge_interval=30, merge_alpha_start=0.5, merge_decay_steps=1000, merge_topk=1)
"""Step 30 is a merge round."""
CODECS = {"int8": {}, "sparse": {"chunk": 64, "topk": 8, "bits": 2}}
"""Each held-model codec, with settings that make several chunks per tensor of the test model."""


def spec_of(codec: str, server: ServerSection = MERGE) -> RunSpec:
    """Expert blocks of 2 x 16 x 32 = 1024 values: 4 int8 blocks of 256, 16 sparse chunks of 64."""
    return tiny_spec(codec=codec, codec_settings=CODECS[codec], server=server, d=16, f=32, sync_steps=10)


def held_of(server: ParameterServer) -> dict[str, torch.Tensor]:
    done = server.service.state.completed
    assert done is not None
    return done.served.tensors


def trained(model: dict[str, torch.Tensor], spec: RunSpec, peer: int, step: int) -> dict[str, torch.Tensor]:
    """What `peer` trained from `model` by round `step`: its tensors moved by small steps (as in training)."""
    gen = torch.Generator().manual_seed(step * 10 + peer)
    return {n: model[n] + 1e-2 * torch.randn(model[n].shape, generator=gen) for n in spec.trainable(peer)}


def assert_bit_identical(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(got[name].view(torch.int32), tensor.view(torch.int32)), name


def assert_on_held(loaded: dict[str, torch.Tensor], server: ParameterServer) -> None:
    """What a node loaded is the server's held model of those tensors, bit for bit."""
    held = held_of(server)
    assert_bit_identical(loaded, {n: held[n] for n in loaded})


# -- the math of rounds, through the production classes and the wire ------------------------------------------------
def through(items: dict, decoder: TensorDecoder) -> TensorDecoder:
    """Send `items` through the chunked wire into `decoder`, as either plane would."""
    for chunk in encode_tensors(items, "fp32"):
        decoder.feed(chunk)
    return decoder


def one_round(
    spec: RunSpec, step: int, peers: list[HeldPeer], server: HeldServer, served: Served | None, glob: dict, theta: list
) -> tuple[Served, dict, list[dict]]:
    """Round `step`: every peer uploads `theta[p]` (what it trains), the server aggregates (`build_global`) and
    serves, every peer downloads what it needs and commits. Returns the new served round, the global model and
    what each peer's codec returned (what its node loads)."""
    assert spec.manifest is not None
    values, relayed = {}, {}
    for p, peer in enumerate(peers):
        items = peer.upload(theta[p], spec.own(p))
        expected = {n: spec.manifest[n] for n in theta[p]}
        base = UploadBase(served, glob, spec.own(p))
        decoder = through(items, server.upload_decoder(expected, {}, base))
        values[p], own = server.upload_values(decoder, decoder.finish(), base)
        relayed.update(own)
    alpha, loaded = round_alpha(step, spec.mode, spec.server), []
    built = build_global(values, spec=spec, step=step, names=list(spec.manifest), previous=glob)
    new_served = server.serve(step, built.tensors, served, list(spec.manifest), relayed if alpha == 0 else {})
    for p, peer in enumerate(peers):
        selection = server.select(new_served, full=False, base_round=peer.base_round)
        names = list(spec.manifest) if selection.whole else spec.downloads(p, merged=alpha > 0)
        info = pb.RoundInfo(round=step, merged=alpha > 0, names=names, base_round=selection.base_round)
        decoder = peer.decoder({n: spec.manifest[n] for n in names}, None)
        loaded.append(peer.receive(info, through({n: selection.items[n] for n in names}, decoder), caught_up=False))
    return new_served, built.tensors, loaded


@pytest.mark.parametrize("codec", CODECS)
def test_error_feedback_keeps_what_was_not_sent_over_30_rounds(codec: str) -> None:
    """Two nodes train small steady updates (below an int8 step, mostly outside a chunk's top-k) for 30 rounds.

    What a node still owes the run is o = theta - H + e (its model less the held model, plus its carried error):
    e for an averaged tensor (the node loads H), theta - H for its own blocks (it keeps them as it trained them).
    The server's global model G must equal the lossless run's L less the mean of the nodes' o (an expert block:
    its owner's): G_r - L_r = -mean_p(o_p,r), exactly up to fp32 rounding, whatever the number of rounds.
    Dropping the error feedback or applying an upload to the held model instead of the global one breaks the
    identity by the lost updates, which grow every round. An owner's model holds its own blocks as the lossless
    run does (loading their reconstruction would set it back by what the upload left out, every round). Every
    peer ends each round on the server's held model, bit for bit.
    """
    spec = spec_of(codec, ServerSection(merge_interval=0))
    assert spec.manifest is not None
    gen = torch.Generator().manual_seed(11)
    init = {n: torch.randn(s, generator=gen) for n, s in spec.manifest.items()}
    server, peers = (
        HeldServer(spec.codec_impl.server().quantizer),
        [HeldPeer(spec.codec_impl.peer().quantizer) for _ in range(2)],
    )  # type: ignore[attr-defined]
    served, glob, lossless, nodes = None, dict(init), dict(init), [dict(init), dict(init)]
    owed_at_most = 0.0
    for step in range(1, 31):
        progress = []
        for p in range(2):
            steady = {n: 1e-3 + 1e-4 * torch.randn(spec.manifest[n], generator=gen) for n in spec.trainable(p)}
            for t in steady.values():
                t.view(-1)[::64] = 0.5  # one large entry per chunk or block sets the step and the top-k
            progress.append(steady)
        theta = [{n: nodes[p][n] + progress[p][n] for n in progress[p]} for p in range(2)]
        served, glob, loaded = one_round(spec, step, peers, server, served, glob, theta)
        nodes = [{**nodes[p], **theta[p], **loaded[p]} for p in range(2)]
        lossless = build_global(
            {p: {n: lossless[n] + progress[p][n] for n in progress[p]} for p in range(2)}, spec=spec, step=step
        ).tensors
        for peer in peers:
            assert_bit_identical(peer.held, served.tensors)
        for name in spec.manifest:
            owner, zero = spec.owner(name), torch.zeros(spec.manifest[name])
            owed = [
                nodes[p][name] - peers[p].held[name] + peers[p].carried.get(name, zero)
                for p in range(2)
                if owner in (None, p)
            ]
            gap = glob[name] - lossless[name] + sum(owed) / len(owed)
            assert float(gap.abs().max()) < 1e-5, (step, name)
            if owner is not None:
                assert float((nodes[owner][name] - lossless[name]).abs().max()) < 1e-5, (step, name)
            owed_at_most = max(owed_at_most, float(sum(o.abs().max() for o in owed)))
    assert owed_at_most > 1e-3, "the case must owe updates a codec without feedback would lose"


@pytest.mark.parametrize("codec", CODECS)
def test_a_merge_round_keeps_every_peer_on_the_servers_held_model(codec: str) -> None:
    spec = spec_of(codec)
    assert spec.manifest is not None
    gen = torch.Generator().manual_seed(12)
    init = {n: torch.randn(s, generator=gen) for n, s in spec.manifest.items()}
    quantizer = spec.codec_impl.server().quantizer  # type: ignore[attr-defined]
    server, peers = HeldServer(quantizer), [HeldPeer(quantizer) for _ in range(2)]
    served, glob = None, dict(init)
    for step in (10, 20, 30, 40):  # 30 merges: owners download their own blocks, nothing is relayed
        base = [peer.held if peer.round is not None else init for peer in peers]
        theta = [trained(base[p], spec, p, step) for p in range(2)]
        served, glob, _ = one_round(spec, step, peers, server, served, glob, theta)
        for peer in peers:
            assert_bit_identical(peer.held, served.tensors)
            assert peer.round == step


def test_a_peer_state_round_trips_and_refuses_another_codec() -> None:
    """A resumed node gets back its held model, its round and its carried error (the next delta adds it); an empty
    state (a node that held none) drops what the peer held."""
    spec = spec_of("sparse")
    peer = spec.codec_impl.peer()
    assert peer.state_dict() == ({}, {})
    held, carried = {"a": torch.ones(3)}, {"a": torch.tensor([0.25, -0.5, 0.0])}
    peer.held, peer.round, peer.carried = held, 7, carried  # type: ignore[attr-defined]
    metadata, tensors = peer.state_dict()
    other = spec.codec_impl.peer()
    other.load_state_dict(metadata, tensors)
    assert other.base_round == 7
    assert_bit_identical(other.held, held)  # type: ignore[attr-defined]
    assert_bit_identical(other.carried, carried)  # type: ignore[attr-defined]
    other.load_state_dict({}, {})
    assert other.base_round == NO_BASE and other.state_dict() == ({}, {})
    with pytest.raises(ValueError, match="codec state of 'sparse', this run's codec is 'int8'"):
        spec_of("int8").codec_impl.peer().load_state_dict(metadata, tensors)
    with pytest.raises(ValueError, match="this run's codec is 'fp32'"):
        tiny_spec().codec_impl.peer().load_state_dict(metadata, tensors)


QUANTIZER = int8.Int8(block=int8.MIN_BLOCK)
SHAPE = (4, 64)
"""Two int8 blocks per tensor."""


def holding(model: dict[str, torch.Tensor], step: int) -> HeldPeer:
    """A peer holding `model` as the held model of round `step` (as a node resumed from its checkpoint)."""
    peer = HeldPeer(QUANTIZER)
    peer.load_state_dict({"codec": QUANTIZER.name, "round": str(step)}, {f"held/{n}": t for n, t in model.items()})
    return peer


def download(
    peer: HeldPeer,
    server: HeldServer,
    served: Served,
    names: list[str],
    *,
    full: bool = False,
    into: dict | None = None,
) -> dict:
    """`names` of the round `served` as the server selects them for `peer`, through the wire (into a client's kept
    buffers `into`, if given); what it loads."""
    selection = server.select(served, full=full, base_round=peer.base_round)
    info = pb.RoundInfo(round=served.round, names=names, base_round=selection.base_round)
    assert peer.whole(info) == (selection.base_round == NO_BASE)
    decoder = peer.decoder({n: SHAPE for n in names}, into)
    return peer.receive(info, through({n: selection.items[n] for n in names}, decoder), caught_up=full)


def test_a_tensor_the_held_model_lacks_travels_as_full_fp32_values_and_is_held_as_sent() -> None:
    """A fragment's first round: the peer's held model (round 10) has `shared` but not its own expert block `own`
    nor `other`. The peer sends `shared` as a delta and `own` as full fp32 values; the server holds and serves them
    so (a delta against round 10 for `shared`, full values for `other`); the peer, which does not download its own
    block nor load it, holds what it sent: a copy, which its training goes on changing without touching."""
    gen = torch.Generator().manual_seed(5)
    model = {"shared": torch.randn(SHAPE, generator=gen)}
    peer, server, previous = holding(model, 10), HeldServer(QUANTIZER), Served(10, dict(model))
    trained = {"shared": model["shared"] + 1e-2, "own": torch.randn(SHAPE, generator=gen)}
    items = peer.upload(trained, own=["own"])
    assert isinstance(items["shared"], Coded) and items["shared"].base_round == 10
    assert isinstance(items["own"], torch.Tensor) and torch.equal(items["own"], trained["own"])
    base = UploadBase(previous, model, ["own"])
    decoder = through(items, server.upload_decoder({n: SHAPE for n in trained}, {}, base))
    values, relayed = server.upload_values(decoder, decoder.finish(), base)
    glob = {**values, "other": torch.randn(SHAPE, generator=gen)}
    served = server.serve(20, glob, previous, list(glob), relayed)
    assert served.base == 10 and served.round == 20
    coded = served.deltas["shared"]
    assert isinstance(coded, Coded) and coded.base_round == 10
    for name in ("own", "other"):
        assert_bit_identical({name: served.deltas[name]}, {name: glob[name]})  # type: ignore[dict-item]
    loaded = download(peer, server, served, ["shared", "other"])
    assert sorted(loaded) == ["other", "shared"] and peer.round == 20
    assert_bit_identical(peer.held, served.tensors)
    trained["own"].add_(1.0)  # training goes on in the node's own tensor
    assert_bit_identical(peer.held, served.tensors)


@pytest.mark.gpu
@pytest.mark.parametrize("quantizer", [QUANTIZER, Sparse(chunk=64, topk=8)], ids=["int8", "sparse"])
def test_a_peer_training_on_cuda_sends_deltas_against_its_cpu_held_model(quantizer: Quantizer) -> None:
    """A node resumed from its checkpoint holds its held model and carried error on the CPU and gives the codec its
    trained tensors on the GPU: the delta is measured across devices (a quantizer's payload and delta stay on the
    GPU), and the peer holds its reconstruction on the CPU, bit for bit what the server reconstructs."""
    gen = torch.Generator().manual_seed(7)
    model, carried = torch.randn(SHAPE, generator=gen), 1e-3 * torch.randn(SHAPE, generator=gen)
    peer = HeldPeer(quantizer)
    peer.load_state_dict({"codec": quantizer.name, "round": "10"}, {"held/w": model, "carried/w": carried})
    items = peer.upload({"w": (model + 1e-2).cuda()}, own=["w"])
    server, previous = HeldServer(quantizer), Served(10, {"w": model})
    base = UploadBase(previous, previous.tensors, ["w"])
    decoder = through(items, server.upload_decoder({"w": SHAPE}, {}, base))
    values, relayed = server.upload_values(decoder, decoder.finish(), base)
    served = server.serve(20, values, previous, ["w"], relayed)
    peer.receive(pb.RoundInfo(round=20, base_round=10), peer.decoder({}, None), caught_up=False)
    assert peer.held["w"].device.type == "cpu"
    assert_bit_identical(peer.held, served.tensors)


def test_a_bf16_tensor_the_held_model_lacks_is_held_in_fp32() -> None:
    peer = holding({"shared": torch.zeros(SHAPE)}, 10)
    own = torch.linspace(-1, 1, math.prod(SHAPE)).view(SHAPE).bfloat16()
    items = peer.upload({"own": own}, own=["own"])
    assert items["own"].dtype == torch.float32  # type: ignore[union-attr]
    peer.receive(pb.RoundInfo(round=20, base_round=10), peer.decoder({}, None), caught_up=False)
    assert peer.held["own"].dtype == torch.float32 and torch.equal(peer.held["own"], own.float())


def test_a_download_carries_deltas_only_to_a_peer_holding_their_base() -> None:
    server, tensors = HeldServer(QUANTIZER), {"a": torch.ones(SHAPE)}
    deltas = {"a": Coded(QUANTIZER.encode("a", torch.ones(SHAPE)), 10)}
    served = Served(20, tensors, dict(deltas), base=10)
    selection = server.select(served, full=False, base_round=10)
    assert (selection.items, selection.whole, selection.base_round) == (deltas, False, 10)
    for full, base_round in ((True, 10), (False, 9), (False, NO_BASE)):  # a catch-up, another base, none
        selection = server.select(served, full=full, base_round=base_round)
        assert (selection.items, selection.whole, selection.base_round) == (tensors, True, NO_BASE)
    for base_round in (10, NO_BASE):  # no base: the first round, or a restarted server's
        selection = server.select(Served(20, tensors), full=False, base_round=base_round)
        assert (selection.items, selection.whole, selection.base_round) == (tensors, True, NO_BASE)


def test_a_peer_refuses_deltas_against_a_model_it_does_not_hold() -> None:
    peer = holding({"a": torch.zeros(SHAPE)}, 10)
    assert peer.whole(pb.RoundInfo(round=20, base_round=NO_BASE))
    assert not peer.whole(pb.RoundInfo(round=20, base_round=10))
    with pytest.raises(
        ValueError, match="round 20: payloads against the held model of round 9, but this peer holds 10"
    ):
        peer.whole(pb.RoundInfo(round=20, base_round=9))
    with pytest.raises(ValueError, match="held model of round 10, but this peer holds -1"):
        HeldPeer(QUANTIZER).whole(pb.RoundInfo(round=20, base_round=10))


def test_a_peer_that_forgets_its_held_model_sends_full_values() -> None:
    """After a base_mismatch the client makes the peer forget its held model: the next upload is full values."""
    model = {"a": torch.ones(SHAPE)}
    peer = holding(model, 10)
    assert isinstance(peer.upload(model, own=[])["a"], Coded)
    assert peer.forget() is True
    assert peer.base_round == NO_BASE and peer.state_dict() == ({}, {})
    assert peer.upload(model, own=[])["a"] is model["a"]
    assert peer.forget() is False


def test_a_peer_that_caught_up_drops_its_carried_error() -> None:
    """Its upload was not taken, so the error it carried is not owed to the model: once caught up, sending the held
    model itself is a zero delta (with the stale error carried, the server would move the model)."""
    gen = torch.Generator().manual_seed(6)
    model = {"a": torch.randn(SHAPE, generator=gen)}
    peer, server = holding(model, 10), HeldServer(QUANTIZER)
    dict(peer.upload({"a": model["a"] + 1e-3 * torch.randn(SHAPE, generator=gen)}, own=[]))  # a lossy delta, sent
    assert peer._pending[0]["a"].any()  # the error it would carry, had the server taken it
    caught_up = Served(30, {"a": torch.randn(SHAPE, generator=gen)})
    download(peer, server, caught_up, ["a"], full=True)
    assert peer.carried == {}
    coded = peer.upload(peer.held, own=[])["a"]
    assert isinstance(coded, Coded) and not QUANTIZER.decode(coded.payload).any()


def test_a_fragments_round_keeps_the_error_the_other_fragments_carry() -> None:
    """With fragments an upload holds one fragment's tensors: what the other fragments' earlier uploads left out is
    still owed, and must still be carried when their own round comes (dropping it lost most of a sparse delta)."""
    gen = torch.Generator().manual_seed(7)
    model = {n: torch.randn(SHAPE, generator=gen) for n in ("a", "b")}
    peer, server = holding(model, 10), HeldServer(QUANTIZER)
    peer.upload({n: v + 1e-3 * torch.randn(SHAPE, generator=gen) for n, v in model.items()}, own=[])
    download(peer, server, next_held(QUANTIZER, 20, model, Served(10, model), ["a", "b"], {}), ["a", "b"])
    carried_b = peer.carried["b"].clone()
    assert carried_b.any()
    peer.upload({"a": peer.held["a"] + 1e-3 * torch.randn(SHAPE, generator=gen)}, own=[])  # fragment a's round
    download(peer, server, next_held(QUANTIZER, 22, peer.held, Served(20, peer.held), ["a"], {}), ["a"])
    assert set(peer.carried) == {"a", "b"} and torch.equal(peer.carried["b"], carried_b)


def test_a_fragments_first_round_loads_its_fragment_and_holds_the_whole_model() -> None:
    """A peer holding no model (its first round, or after `forget`) gets full values of every tensor, but with
    fragments the round serves one: it loads that fragment and nothing else, so the other fragments keep their
    local progress as on a raw wire (loading everything set them back to the server's model once), and it holds
    the whole model, so the other fragments' next rounds are deltas against the server's copy."""
    gen = torch.Generator().manual_seed(8)
    server_model = {n: torch.randn(SHAPE, generator=gen) for n in ("a", "b")}
    peer, server = HeldPeer(QUANTIZER), HeldServer(QUANTIZER)
    peer.upload({"a": server_model["a"] + 1e-3}, own=[])  # fragment a's round: full values
    selection = server.select(Served(10, server_model), full=False, base_round=peer.base_round)
    info = pb.RoundInfo(round=10, names=["a", "b"], base_round=selection.base_round)
    assert peer.whole(info)
    decoder = through({n: selection.items[n] for n in ("a", "b")}, peer.decoder({"a": SHAPE, "b": SHAPE}, None))
    loaded = peer.receive(info, decoder, caught_up=False, serves=["a"])
    assert list(loaded) == ["a"] and torch.equal(loaded["a"], server_model["a"])
    assert_bit_identical(peer.held, server_model) and peer.base_round == 10
    local_b = server_model["b"] + 1e-3  # fragment b's local progress, kept
    coded = peer.upload({"b": local_b}, own=[])["b"]
    assert isinstance(coded, Coded) and coded.base_round == 10


def test_an_upload_is_made_as_a_plane_reads_it_and_its_digest_before(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each tensor is encoded when a plane first reads it (its first bytes go while the rest is encoded), once; the
    digest the server tells a retry by is made from the inputs: equal for a retry, different for other values,
    another carried error or another held round. A duplicate upload (the server had it, nothing was read) still
    leaves each tensor's error carried at `receive`, as its first sending did."""
    gen = torch.Generator().manual_seed(8)
    model = {n: torch.randn(SHAPE, generator=gen) for n in ("a", "b")}
    theta = {n: v + 1e-3 * torch.randn(SHAPE, generator=gen) for n, v in model.items()}
    peer, served = holding(model, 10), next_held(QUANTIZER, 20, model, Served(10, model), ["a", "b"], {})
    served.complete()  # the server's encoding, not counted below
    encoded: list[str] = []
    encode = int8.Int8.encode
    monkeypatch.setattr(int8.Int8, "encode", lambda self, name, x: encoded.append(name) or encode(self, name, x))
    items, digest = peer.upload(theta, own=[]), peer.digest(theta)
    assert encoded == [] and list(items) == ["a", "b"]
    assert isinstance(items["a"], Coded) and items["a"] is items["a"] and encoded == ["a"]
    assert peer.digest(dict(theta)) == digest != peer.digest({**theta, "b": theta["b"] + 1e-3})
    assert holding(model, 11).digest(theta) != digest
    download(peer, HeldServer(QUANTIZER), served, ["a"])
    assert encoded == ["a", "b"] and sorted(peer.carried) == ["a", "b"]
    assert torch.equal(peer.carried["b"], encode_delta(QUANTIZER, "b", theta["b"], model["b"]).error)
    assert peer.digest(theta) != holding(peer.held, 20).digest(theta)  # the same round, no carried error


def test_the_servers_deltas_are_made_when_first_read_and_what_could_fail_there_fails_before(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A round is published before the server has encoded its deltas (the encoding overlaps the downloads): each is
    encoded once, when a download (or `complete`) first reads it, as `encode_delta` would have; until then the round
    keeps what it is made of alive (`holds`, for buffer reuse); what could fail there fails in `next_held`."""
    gen = torch.Generator().manual_seed(12)
    model = {n: torch.randn(SHAPE, generator=gen) for n in ("a", "b", "c")}
    new = {n: v + 1e-2 * torch.randn(SHAPE, generator=gen) for n, v in model.items()}
    encoded: list[str] = []
    encode = int8.Int8.encode
    monkeypatch.setattr(int8.Int8, "encode", lambda self, name, x: encoded.append(name) or encode(self, name, x))
    served = next_held(QUANTIZER, 20, new, Served(10, model), ["a", "b"], {})
    assert "a" in served.tensors and "a" in served.deltas and "c" not in served.deltas
    assert encoded == [] and list(served.deltas) == ["a", "b"] and list(served.tensors) == ["a", "b", "c"]
    assert {id(t) for t in served.holds()} == {id(t) for t in (*model.values(), new["a"], new["b"])}
    item = served.deltas["b"]
    assert encoded == ["b"] and served.deltas["b"] is item and served.tensors["c"] is model["c"]
    eager = encode_delta(QUANTIZER, "b", new["b"], model["b"])
    assert isinstance(item, Coded) and item.base_round == 10 and torch.equal(served.tensors["b"], eager.reconstruction)
    assert torch.equal(QUANTIZER.decode(item.payload), QUANTIZER.decode(eager.payload))
    served.complete()
    assert encoded == ["b", "b", "a"]  # the check's own encode of "b" above, then "a" once
    assert {id(t) for t in served.holds()} == {id(served.tensors[n]) for n in ("a", "b", "c")}
    with pytest.raises(ValueError, match="tensor 'a' holds NaN or Inf values, or values beyond 1e\\+30"):
        next_held(QUANTIZER, 20, {**new, "a": torch.full(SHAPE, 2e30)}, Served(10, model), ["a"], {})


def test_bad_tensors_are_refused_naming_the_tensor() -> None:
    value = torch.zeros(SHAPE)
    for what, base, carried in (("base", torch.zeros(3), None), ("carried error", value, torch.zeros(3))):
        with pytest.raises(ValueError, match=f"tensor 'w': shape \\[4, 64\\], its {what} has shape \\[3\\]"):
            encode_delta(QUANTIZER, "w", value, base, carried)
    diverged = torch.full(SHAPE, float("nan"))
    with pytest.raises(ValueError, match="tensor 'w' holds NaN or Inf"):  # a peer's upload
        dict(holding({"w": value}, 10).upload({"w": diverged}, own=[]))  # made as a plane reads it
    with pytest.raises(ValueError, match="tensor 'w' holds NaN or Inf"):  # the server's deltas
        next_held(QUANTIZER, 20, {"w": diverged}, Served(10, {"w": value}), ["w"], {})


@pytest.mark.parametrize("quantizer", [QUANTIZER, Sparse(chunk=64, topk=8)], ids=["int8", "sparse"])
def test_a_delta_is_summed_in_fp32_and_cast_to_its_bases_dtype(quantizer: Quantizer) -> None:
    """`apply_delta` on any base: base + decode(payload) in fp32, then one rounding to base's dtype (a sparse
    delta leaves the entries it did not send as base had them)."""
    gen = torch.Generator().manual_seed(9)
    base = torch.randn(SHAPE, generator=gen).bfloat16()
    payload = quantizer.encode("w", 1e-2 * torch.randn(SHAPE, generator=gen))
    got = apply_delta(base, payload, quantizer)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, (base.float() + quantizer.decode(payload)).bfloat16())


def test_a_sparse_delta_lands_in_kept_memory_only_where_it_fits_and_never_in_its_base() -> None:
    """`out` is written only when it is fp32 of base's shape and not base itself: base stays as it was (it is the
    held model every other reader shares), and memory of another dtype or shape is left alone."""
    sparse, gen = Sparse(chunk=64, topk=8), torch.Generator().manual_seed(10)
    base = torch.randn(SHAPE, generator=gen)
    payload = sparse.encode("w", 1e-2 * torch.randn(SHAPE, generator=gen))
    want, kept = apply_delta(base, payload, sparse), base.clone()
    for out in (base, torch.zeros(SHAPE, dtype=torch.bfloat16), torch.zeros(2, 2)):
        got = apply_delta(base, payload, sparse, out)
        assert got is not out and torch.equal(got, want) and torch.equal(base, kept)
    fits = torch.empty(SHAPE)
    assert apply_delta(base, payload, sparse, fits) is fits and torch.equal(fits, want)


def test_the_server_re_encodes_values_up_to_its_limit_and_refuses_beyond_naming_the_tensor() -> None:
    """`headroom`'s bound at its edges: max |value| + 2 max |base| <= REENCODE_LIMIT (2^100, exact in fp32), the
    magnitudes of negative values counted as of positive ones."""
    limit, zeros = REENCODE_LIMIT, torch.zeros(SHAPE)

    def full(x: float) -> torch.Tensor:
        return torch.full(SHAPE, x)

    for value, base in ((full(limit), zeros), (full(0.75 * limit), zeros), (zeros, full(0.45 * limit))):
        headroom("w", value, base)
    for value, base in ((full(-1.5 * limit), zeros), (zeros, full(-0.6 * limit)), (full(limit), full(limit * 2**-40))):
        with pytest.raises(
            ValueError,
            match=r"^tensor 'w' holds NaN or Inf values, or values beyond 1e\+30 \(fp32's range is 3e38\): the "
            "global model diverged$",
        ):
            headroom("w", value, base)


def test_a_peer_refuses_a_delta_for_a_tensor_its_held_model_lacks_naming_it() -> None:
    peer = holding({"a": torch.zeros(SHAPE)}, 10)
    coded = {"b": Coded(QUANTIZER.encode("b", torch.ones(SHAPE)), 10)}
    with pytest.raises(ValueError, match="tensor 'b': a delta against a held model that does not hold it"):
        through(coded, peer.decoder({"b": SHAPE}, None)).finish()


def test_a_taken_upload_answered_with_full_values_leaves_its_error_carried() -> None:
    """A server restarted after the round closed serves its restored round as full values (no base) to the peers
    whose uploads it took: they hold those values, and carry what their uploads left out as after any round."""
    gen = torch.Generator().manual_seed(11)
    model = {"a": torch.randn(SHAPE, generator=gen)}
    peer = holding(model, 10)
    dict(peer.upload({"a": model["a"] + 1e-3 * torch.randn(SHAPE, generator=gen)}, own=[]))
    error = peer._pending[0]["a"]
    restored = {"a": torch.randn(SHAPE, generator=gen)}
    info = pb.RoundInfo(round=20, names=["a"], base_round=NO_BASE)
    loaded = peer.receive(info, through(restored, peer.decoder({"a": SHAPE}, None)), caught_up=False)
    assert torch.equal(loaded["a"], restored["a"]) and peer.round == 20
    assert peer.carried.keys() == {"a"} and peer.carried["a"] is error


def test_a_download_that_is_not_finite_is_refused_naming_the_server_address() -> None:
    """Full values holding Inf, and a finite delta that overflows once applied to the held model (3e38 + 3e38): a
    spes server publishes only finite rounds, so they come from a damaged or hostile one."""
    peer = holding({"w": torch.full(SHAPE, 3e38)}, 10)
    with pytest.raises(ValueError, match="'w' holds NaN or Inf values: .*spes_config.server_addr"):
        through({"w": torch.full(SHAPE, float("inf"))}, peer.decoder({"w": SHAPE}, None))
    delta = holding({"w": torch.zeros(SHAPE)}, 10).upload({"w": torch.full(SHAPE, 3e38)}, own=[])
    want = "'w' holds NaN or Inf values once its int8 delta is applied: .*spes_config.server_addr"
    with pytest.raises(ValueError, match=want):
        through(delta, peer.decoder({"w": SHAPE}, None)).finish()


def test_an_upload_is_refused_when_it_is_not_finite_naming_the_tensor() -> None:
    """Full values holding NaN, and a finite delta that overflows once applied to the global model (3e38 + 3e38)."""
    server, big = HeldServer(QUANTIZER), torch.full(SHAPE, 3e38)
    previous = Served(10, {"w": torch.zeros(SHAPE)})
    raw = {"w": torch.full(SHAPE, float("nan"))}
    with pytest.raises(ValueError, match="tensor 'w' holds NaN or Inf values: this peer's training diverged"):
        through(raw, server.upload_decoder({"w": SHAPE}, {}, UploadBase(previous, previous.tensors, [])))
    want = "tensor 'w' holds NaN or Inf values once its int8 delta is applied: this peer's training diverged"
    with pytest.raises(ValueError, match=want):
        through(
            holding(previous.tensors, 10).upload({"w": big}, own=[]),
            server.upload_decoder({"w": SHAPE}, {}, UploadBase(previous, {"w": big}, [])),
        ).finish()
    sparse = Sparse(chunk=64, topk=8)  # only the sent entries overflow: those are the ones checked
    peer = HeldPeer(sparse)
    peer.load_state_dict({"codec": "sparse", "round": "10"}, {"held/w": previous.tensors["w"]})
    with pytest.raises(ValueError, match=want.replace("int8", "sparse")):
        through(
            peer.upload({"w": big}, own=[]),
            HeldServer(sparse).upload_decoder({"w": SHAPE}, {}, UploadBase(previous, {"w": big}, [])),
        ).finish()


def test_the_server_applies_each_payload_as_it_arrives_and_refuses_one_its_base_lacks() -> None:
    """An averaged tensor's delta is applied to the global model once its last byte is in, before the next
    tensor's bytes (the work overlaps the rest of the upload); a delta for a tensor the base does not hold is a
    refusal naming it, not a server error."""
    gen = torch.Generator().manual_seed(3)
    glob = {n: torch.randn(SHAPE, generator=gen) for n in ("a", "b")}
    previous = Served(10, {n: t.clone() for n, t in glob.items()})
    items = holding(previous.tensors, 10).upload({n: t + 1e-2 for n, t in glob.items()}, own=[])
    server, expected = HeldServer(QUANTIZER), {"a": SHAPE, "b": SHAPE}
    decoder = server.upload_decoder(expected, {}, UploadBase(previous, glob, []))
    for chunk in encode_tensors(items, "fp32"):
        decoder.feed(chunk)
        if chunk.header.name == "b":  # the next tensor's header: "a" is whole
            assert list(decoder.applied) == ["a"]
    values, relayed = server.upload_values(decoder, decoder.finish(), UploadBase(previous, glob, []))
    assert sorted(values) == ["a", "b"] and not relayed
    assert torch.allclose(values["a"], glob["a"] + 1e-2, atol=1e-3)
    lacking = UploadBase(Served(10, {"a": previous.tensors["a"]}), {"a": glob["a"]}, [])
    with pytest.raises(ValueError, match="tensor 'b': a delta against a model that does not hold it"):
        through(items, server.upload_decoder(expected, {}, lacking)).finish()


def test_full_values_are_received_into_the_servers_kept_buffers() -> None:
    buffer, into = torch.empty(SHAPE), {}
    into["w"] = buffer
    values = {"w": torch.randn(SHAPE)}
    received = through(
        values, HeldServer(QUANTIZER).upload_decoder({"w": SHAPE}, into, UploadBase(None, {}, []))
    ).finish()
    assert received["w"] is buffer and torch.equal(buffer, values["w"])


def test_a_peer_keeping_its_buffers_applies_a_download_into_the_tensors_the_last_round_replaced() -> None:
    """With kept buffers (the trainer's client) a round's sparse deltas (which bring no memory of their own, as
    int8's decoded ones do) land in the held tensors the round before replaced, which nothing reads any more, and
    make the same held model bit for bit as fresh memory does; the last round's result, the held model until this
    one commits, is untouched."""
    quantizer = Sparse(chunk=64, topk=8)
    gen = torch.Generator().manual_seed(8)
    model = {"w": torch.randn(SHAPE, generator=gen)}
    server = HeldServer(quantizer)
    peers = []
    for _ in range(2):
        peer = HeldPeer(quantizer)
        peer.load_state_dict({"codec": quantizer.name, "round": "10"}, {"held/w": model["w"].clone()})
        peers.append(peer)
    reusing, fresh = peers
    served, held_10, fresh_10 = Served(10, {"w": model["w"].clone()}), reusing.held["w"], fresh.held["w"]
    got = {}
    for step in (20, 30):
        served = server.serve(step, {"w": torch.randn(SHAPE, generator=gen)}, served, ["w"], {})
        last = reusing.held["w"].clone()
        got[step] = download(reusing, server, served, ["w"], into={})["w"]
        want = download(fresh, server, served, ["w"])["w"]
        assert torch.equal(got[step].view(torch.int32), want.view(torch.int32))
        assert torch.equal(got.get(step - 10, held_10), last)  # the last round's result, untouched
    assert got[20] is not held_10 and got[30] is held_10  # round 20 replaced round 10's tensor; round 30 reused it
    assert torch.equal(fresh_10, model["w"])  # without kept buffers a replaced tensor may still be the caller's


@pytest.mark.parametrize("quantizer", [QUANTIZER, Sparse(chunk=64, topk=8)], ids=["int8", "sparse"])
def test_payloads_are_applied_into_the_servers_kept_buffers(quantizer: Quantizer) -> None:
    """An applied sparse payload lands in the buffer the server keeps for that tensor from round to round (fresh
    memory costs a page fault per page); an int8 one in its decoded delta, fresh memory already (one more tensor
    to write would cost more). Either holds exactly what the peer reconstructs."""
    glob = {"w": torch.randn(SHAPE, generator=torch.Generator().manual_seed(5))}
    previous = Served(10, {"w": glob["w"].clone()})
    peer = HeldPeer(quantizer)
    peer.load_state_dict({"codec": quantizer.name, "round": "10"}, {"held/w": previous.tensors["w"]})
    items = peer.upload({"w": glob["w"] + 1e-2}, own=["w"])
    into = {"w": torch.empty(SHAPE)}
    buffer = into["w"]
    base = UploadBase(previous, glob, ["w"])
    decoder = through(dict(items), HeldServer(quantizer).upload_decoder({"w": SHAPE}, into, base))
    values, _ = HeldServer(quantizer).upload_values(decoder, decoder.finish(), base)
    assert (values["w"] is buffer) == isinstance(quantizer, Sparse)
    assert torch.equal(values["w"].view(torch.int32), peer._pending[1]["w"].view(torch.int32))


def test_a_restored_round_holds_the_persisted_held_model() -> None:
    server, glob = HeldServer(QUANTIZER), {"a": torch.ones(SHAPE)}
    held = Served(20, {"a": torch.zeros(SHAPE)}, {"a": torch.zeros(SHAPE)}, base=10)
    restored = server.restore(20, glob, server.persisted(held))
    assert (restored.round, restored.tensors, restored.deltas, restored.base) == (20, held.tensors, {}, None)
    restored = server.restore(20, glob, {})  # nothing persisted: the held model is the global model
    assert (restored.round, restored.tensors, restored.base) == (20, glob, None)


# -- real servers and clients ---------------------------------------------------------------------------------------
@contextlib.contextmanager
def held_run(
    codec: str, plane: str, seed: int
) -> Iterator[tuple[RunSpec, dict[str, torch.Tensor], ParameterServer, list[SyncClient]]]:
    """A server of `spec_of(codec)` with its payloads on `plane`, two joined clients, and a random initial model."""
    spec = spec_of(codec)
    assert spec.manifest is not None
    gen = torch.Generator().manual_seed(seed)
    init = {n: torch.randn(s, generator=gen) for n, s in spec.manifest.items()}
    with (
        running_server(spec, data_port=0 if plane == "tcp" else -1) as (server, addr),
        # NOTE: peer 0 keeps its buffers (as the trainer's client does), peer 1 does not
        joined_clients(addr, spec, data_plane=plane, per_peer=lambda p: {"reuse_buffers": p == 0}) as clients,
    ):
        yield spec, init, server, clients


@pytest.mark.timeout(60)
@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("plane", ["grpc", "tcp"])
def test_every_peer_holds_the_servers_model_bit_for_bit_after_every_round(codec: str, plane: str) -> None:
    """Two peers, four rounds (the third a merge round): the first moves full values, the others coded deltas
    of exactly the analytic size; every peer holds the server's held model bit for bit, and what it loads is that
    model but for its own blocks on a round without merging (the first included): those it keeps as it trained
    them, as on a raw wire."""
    with held_run(codec, plane, seed=0) as (spec, init, server, clients):
        assert spec.manifest is not None
        models = [init, init]
        for step in (10, 20, 30, 40):
            theta = {p: trained(models[p], spec, p, step) for p in range(2)}
            results = sync_all(clients, step, theta)
            merged = step == 30
            for p in range(2):
                kept = [] if merged else spec.own(p)
                assert sorted(results[p][0]) == sorted(n for n in spec.manifest if n not in kept)
                assert_on_held(results[p][0], server)
                assert_bit_identical(clients[p].codec.held, held_of(server))  # type: ignore[attr-defined]
                models[p] = {**models[p], **theta[p], **results[p][0]}
            for p, (_, stats) in results.items():
                up = spec.trainable(p)
                assert stats.merged == merged and clients[p].plane.name == plane
                if step == 10:  # nobody holds a model yet: full fp32 values both ways
                    assert (stats.bytes_up, stats.bytes_down) == (
                        4 * sum(math.prod(spec.manifest[n]) for n in up),
                        4 * sum(math.prod(s) for s in spec.manifest.values()),
                    )
                else:
                    assert (stats.bytes_up, stats.bytes_down) == spec.round_bytes(p, merged=merged)
        done = server.service.state.completed
        assert done is not None and done.served.base == 30


@pytest.mark.timeout(60)
@pytest.mark.parametrize("plane", ["grpc", "tcp"])
def test_a_diverged_peer_stops_naming_the_tensor_though_its_upload_is_made_while_sent(plane: str) -> None:
    """A payload is made as the plane sends it: a tensor that is not finite stops the upload with the codec's error
    naming it, on either plane (gRPC would report its own "exception iterating requests" instead), not a retry."""
    with held_run("sparse", plane, seed=1) as (spec, init, _, clients):
        sync_all(clients, 10, {p: trained(init, spec, p, 10) for p in range(2)})
        diverged = trained(init, spec, 0, 20)
        last = list(diverged)[-1]
        diverged[last][0] = float("nan")
        with pytest.raises(ValueError, match=f"tensor '{last}' holds NaN or Inf values: this peer's training"):
            clients[0].sync(20, diverged)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("codec", CODECS)
def test_a_new_peer_and_a_peer_holding_another_model_get_full_values(codec: str) -> None:
    """A restarted peer holds no model: it uploads and downloads full values once (holding them all, loading what a
    raw wire would bring), then deltas again. A peer whose held model is of another round has its deltas refused
    (base_mismatch) and sends full values instead."""
    spec = spec_of(codec)
    assert spec.manifest is not None
    gen = torch.Generator().manual_seed(1)
    init = {n: torch.randn(s, generator=gen) for n, s in spec.manifest.items()}
    everything = 4 * sum(math.prod(s) for s in spec.manifest.values())
    with running_server(spec, data_port=0) as (server, addr), joined_clients(addr, spec) as clients:
        first = trained(init, spec, 0, 10)
        results = sync_all(clients, 10, {0: first, 1: trained(init, spec, 1, 10)})
        model = {**first, **results[0][0]}
        clients[1].close()
        with make_client(addr, spec, 1, run_id=server.service.run_id) as fresh:  # a replacement node of this run
            fresh.join()
            peers = [clients[0], fresh]
            theta = {p: trained(model, spec, p, 20) for p in range(2)}
            results = sync_all(peers, 20, theta)
            assert results[1][1].bytes_down == everything and results[0][1].bytes_down < everything / 3
            assert sorted(results[1][0]) == sorted(spec.downloads(1, merged=False))  # its own blocks as it trained them
            assert_bit_identical(fresh.codec.held, held_of(server))  # type: ignore[attr-defined]
            for p in range(2):
                assert_on_held(results[p][0], server)
            codec_state = clients[0].codec
            assert codec_state.base_round == 20
            codec_state.round = 10  # type: ignore[attr-defined]  # a held model of another round than the server's
            models = [{**model, **theta[p], **results[p][0]} for p in range(2)]
            results = sync_all(peers, 30, {p: trained(models[p], spec, p, 30) for p in range(2)})
            assert results[0][1].bytes_down == everything and codec_state.base_round == 30
            for p in range(2):
                assert_bit_identical(results[p][0], held_of(server))


def raw_coded_upload(server: ParameterServer, spec: RunSpec, header: pb.TensorHeader, payload: bytes) -> pb.DataError:
    """Peer 0's upload of round 20 over the data plane: the hand-made coded tensor `header` first, then zero deltas
    against round 10 for the rest of what it trains; the server's refusal."""
    assert spec.manifest is not None
    quantizer = spec.codec_impl.server().quantizer  # type: ignore[attr-defined]
    with plane_tcp.connect("127.0.0.1", server.data_port, None, timeout_s=10) as sock:
        plane_tcp.send_hello(sock, pb.DataHello(op=pb.DATA_OP_UPLOAD, peer_id=0, step=20))
        assert plane_tcp.recv_reply(sock).send
        plane_tcp.send_frame(sock, header)
        sock.sendall(payload + DIGEST.pack(checksum(payload)))
        with contextlib.suppress(OSError):  # refused at the first tensor: the server drains the rest
            for name in (n for n in spec.trainable(0) if n != header.name):
                zero = Coded(quantizer.encode(name, torch.zeros(spec.manifest[name])), base_round=10)
                plane_tcp.send_tensor(sock, name, zero, "fp32")
        return plane_tcp.recv_reply(sock).error


@pytest.mark.timeout(60)
def test_malformed_payloads_are_refused_naming_the_tensor() -> None:
    int8, sparse = spec_of("int8"), spec_of("sparse")
    name = "blocks.0.ffn.experts.w1.0"
    for spec in (int8, sparse):
        assert spec.manifest is not None
        gen = torch.Generator().manual_seed(2)
        init = {n: torch.randn(s, generator=gen) for n, s in spec.manifest.items()}
        quantizer = spec.codec_impl.server().quantizer  # type: ignore[attr-defined]
        with running_server(spec, data_port=0) as (server, addr), joined_clients(addr, spec) as clients:
            sync_all(clients, 10, {p: trained(init, spec, p, 10) for p in range(2)})
            good = Coded(quantizer.encode(name, torch.ones(spec.manifest[name])), base_round=10)
            packed = good.payload.pack().numpy().tobytes()
            cases = []
            if spec is int8:
                numel, blocks = 1024, 4
                for scale in (-1.0, float("nan"), float("inf"), 3e38):  # 3e38 is finite, 127 x 3e38 is not
                    scales = torch.full((blocks,), scale, dtype=torch.float32).numpy().tobytes()
                    cases.append((header_for(name, good, "fp32"), packed[:numel] + scales))
                wants = ["negative, NaN or Inf scale", "NaN or Inf scale", "", "holds NaN or Inf values once its int8"]
            else:  # the index stream starts after 16 fp32 scales: put the first two chunk indices out of order
                out_of_order = bytearray(packed)
                out_of_order[64] = 0xFF
                cases.append((header_for(name, good, "fp32"), bytes(out_of_order)))
                wants = ["index outside its chunk or out of order"]
            short = header_for(name, good, "fp32")
            short.num_bytes -= 4  # a scale too few
            cases.append((short, packed[:-4]))
            wants.append(f"needs {len(packed)}")
            other = header_for(name, good, "fp32")
            other.params["block" if spec is int8 else "topk"] = 64 if spec is int8 else 4
            cases.append((other, b""))
            wants.append("parameters")
            for (header, payload), want in zip(cases, wants):
                error = raw_coded_upload(server, spec, header, payload)
                assert error.code == "INVALID_ARGUMENT" and repr(name) in error.message, error
                assert want in error.message, error.message
            wrong_base = header_for(name, Coded(good.payload, 9), "fp32")
            stale = raw_coded_upload(server, spec, wrong_base, packed)
            assert (stale.code, stale.reason) == ("FAILED_PRECONDITION", Reason.BASE_MISMATCH), stale
            assert "against the held model of round 9, but the receiver holds round 10" in stale.message
            assert server.service.state.snapshot().open_round is None  # nothing was kept


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "server_codec, node_codec, field",
    [
        ("int8", "fp32", "codec"),
        ("fp32", "int8", "codec"),
        ("bf16", "sparse", "codec"),
        ("sparse", "sparse", "codec_settings"),
    ],
)
def test_a_node_whose_codec_differs_from_the_servers_is_refused_at_join(
    server_codec: str, node_codec: str, field: str
) -> None:
    node = spec_of(node_codec) if node_codec in CODECS else tiny_spec(codec=node_codec, d=16, f=32, sync_steps=10)
    server_spec = (
        spec_of(server_codec) if server_codec in CODECS else tiny_spec(codec=server_codec, d=16, f=32, sync_steps=10)
    )
    if field == "codec_settings":
        node = tiny_spec(codec="sparse", codec_settings={"chunk": 64, "topk": 4}, d=16, f=32, sync_steps=10)
    with running_server(server_spec) as (_, addr):
        with pytest.raises(SyncError) as err:
            with joined_clients(addr, node, max_retries=0):
                pass
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert f"peer 0 has {field} = " in str(err.value) and "spes_config." + field in str(err.value)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("codec", CODECS)
def test_a_restarted_server_serves_its_persisted_held_model(tmp_path: Path, codec: str) -> None:
    spec = spec_of(codec)
    assert spec.manifest is not None
    gen = torch.Generator().manual_seed(3)
    init = {n: torch.randn(s, generator=gen) for n, s in spec.manifest.items()}
    with running_server(spec, state_dir=str(tmp_path)) as (server, addr), joined_clients(addr, spec) as clients:
        sync_all(clients, 10, {p: trained(init, spec, p, 10) for p in range(2)})
        theta = {p: trained(init, spec, p, 20) for p in range(2)}
        results = sync_all(clients, 20, theta)
        models = [{**init, **theta[p], **results[p][0]} for p in range(2)]
        held = {n: t.clone() for n, t in held_of(server).items()}
        states = [client.codec.state_dict() for client in clients]
        run_id = clients[0].run_id
    with (
        running_server(spec, state_dir=str(tmp_path)) as (server, addr),
        joined_clients(addr, spec, run_id=run_id) as clients,
    ):  # the nodes resume as from their checkpoints: the run's id and the codec's state
        assert_bit_identical(held_of(server), held)
        done = server.service.state.completed
        assert done is not None and done.served.base is None
        for client, state in zip(clients, states, strict=True):
            client.codec.load_state_dict(*state)  # as a resumed node does from its checkpoint
        results = sync_all(clients, 30, {p: trained(models[p], spec, p, 30) for p in range(2)})
        for p in range(2):  # the restored held model is the base of the next round's deltas, both ways
            assert_bit_identical(results[p][0], held_of(server))
            step_30_merges = spec.round_bytes(p, merged=True)
            assert (results[p][1].bytes_up, results[p][1].bytes_down) == step_30_merges


def drifting_deltas(spec: RunSpec, peer: int, step: int) -> dict[str, torch.Tensor]:
    """One round's training progress of `peer`: a steady drift of 5e-4 per value (with a little noise), and one
    value of +-0.5 per int8 block, so each block's scale (0.5 / 127, a step of 3.9e-3) rounds the drift to zero.
    Only error feedback carries it to the model: without it the drift is never sent."""
    gen = torch.Generator().manual_seed(step * 10 + peer)
    deltas = {}
    for name in spec.trainable(peer):
        delta = 5e-4 + 1e-4 * torch.randn((spec.manifest or {})[name], generator=gen)
        outliers = delta.view(-1)[:: int8.DEFAULT_BLOCK]
        outliers.copy_(torch.randint(0, 2, outliers.shape, generator=gen) - 0.5)
        deltas[name] = delta
    return deltas


@pytest.mark.timeout(90)
def test_error_feedback_keeps_thirty_int8_rounds_within_one_step_of_the_lossless_sum() -> None:
    """Two peers sync 30 rounds through a real server, each training `drifting_deltas` from the model it holds. The
    lossless run (the round math on fp32 values) moves every drifting value by 30 x 5e-4 = 1.5e-2; the int8 run
    must end within one quantization step (3.9e-3: the carried error and the last download's rounding, each at
    most half a step) of it. A peer that dropped its carried error would fall behind by the whole drift."""
    spec = spec_of("int8", NO_MERGE)
    gen = torch.Generator().manual_seed(4)
    init = {n: torch.randn(s, generator=gen) for n, s in (spec.manifest or {}).items()}
    lossless = init
    with running_server(spec) as (server, addr), joined_clients(addr, spec) as clients:
        models = [init, init]
        for step in range(10, 310, 10):
            deltas = {p: drifting_deltas(spec, p, step) for p in range(2)}
            uploads = {p: {n: models[p][n] + d for n, d in deltas[p].items()} for p in range(2)}
            results = sync_all(clients, step, uploads)
            models = [{**models[p], **uploads[p], **results[p][0]} for p in range(2)]
            fp32 = {p: {n: lossless[n] + d for n, d in deltas[p].items()} for p in range(2)}
            lossless = build_global(fp32, spec=spec, step=step).tensors
        assert_on_held(results[0][0], server)
    step_size = 0.5 / int8.QMAX
    for name, want in lossless.items():
        error = (models[0][name] - want).abs().max().item()
        assert error <= step_size * 1.05, (name, error, step_size)
        moved = (models[0][name] - init[name]).view(-1)
        block = int8.DEFAULT_BLOCK
        drift = torch.cat([moved[i + 1 : i + block] for i in range(0, moved.numel(), block)])
        assert drift.mean().item() > 30 * 5e-4 / 2, name  # the drifting values moved, not only the outliers
