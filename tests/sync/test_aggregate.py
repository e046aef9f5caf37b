"""Tests for spes.sync.aggregate: `build_round` as a pure function, each of its inputs reaching the round math
(`build_global`) and the codec, and its refusal of a non-finite aggregate."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from spes.config import ServerSection
from spes.sync.aggregate import NonFiniteRound, build_round
from spes.sync.codecs.base import Payload
from spes.sync.codecs.interface import Served
from spes.sync.codecs.raw import RawServer
from spes.sync.fragments import WHOLE
from spes.sync.merge import build_global
from spes.sync.protocol import Shape
from spes.sync.rounds import Completed
from spes.sync.spec import RunSpec
from sync_helpers import NO_MERGE, peer_upload, tiny_spec

DILOCO = tiny_spec(mode="diloco", server=ServerSection(outer_optimizer="nesterov", outer_lr=0.7, outer_momentum=0.9))
MERGING = ServerSection(merge_interval=1, merge_alpha_start=0.5, merge_decay_steps=100, merge_topk=1)


class RecordingCodec(RawServer):
    """The fp32 raw codec, recording what each round asks it to serve."""

    def __init__(self) -> None:
        super().__init__("fp32")
        self.served: list[dict[str, Any]] = []

    def serve(self, *args: Any, **kwargs: Any) -> Served:
        step, _, previous, names, relayed = args  # as build_round passes them
        self.served.append({"step": step, "previous": previous, "names": list(names), "relayed": relayed})
        return super().serve(*args, **kwargs)


def uploads(spec: RunSpec, seed: int) -> dict[int, dict[str, torch.Tensor]]:
    return {p: peer_upload(spec, p, seed=seed) for p in range(spec.num_peers)}


def two_rounds(spec: RunSpec, codec: RecordingCodec, **second: Any) -> tuple[Completed, Completed]:
    first = build_round(1, uploads(spec, 1), {}, WHOLE, None, spec, codec)
    done = build_round(2, uploads(spec, 2), second.pop("relayed", {}), WHOLE, first, spec, codec, **second)
    return first, done


def test_a_diloco_round_takes_the_previous_global_model_and_momentum() -> None:
    """Each round's outer Nesterov step starts from the round before's global model and momentum (the first round's
    mean is the starting point, with no momentum yet): each round is what `build_global` makes of them."""
    codec, rounds = RecordingCodec(), []
    for step in (1, 2, 3):
        rounds.append(
            build_round(step, uploads(DILOCO, step), {}, WHOLE, rounds[-1] if rounds else None, DILOCO, codec)
        )
    assert not rounds[0].momentum and rounds[1].momentum
    for before, done in zip(rounds, rounds[1:]):
        want = build_global(
            uploads(DILOCO, done.round),
            spec=DILOCO,
            step=done.round,
            previous=before.global_model,
            momentum=before.momentum,
        )
        assert done.global_model.keys() == want.tensors.keys() == done.momentum.keys()
        for name, tensor in want.tensors.items():
            assert torch.equal(done.global_model[name], tensor), (done.round, name)
            assert torch.equal(done.momentum[name], want.momentum[name]), (done.round, name)
    assert rounds[2].peers == frozenset({0, 1}) and rounds[2].alpha == 0.0


def test_a_fragments_round_covers_its_tensors_and_carries_the_rest() -> None:
    spec = tiny_spec(overlap_fragments=2, sync_steps=2, server=NO_MERGE)
    codec = RecordingCodec()
    first = build_round(1, uploads(spec, 1), {}, WHOLE, None, spec, codec)
    part = spec.layout.names(1, spec.manifest or {})
    fragment_uploads = {p: {n: t for n, t in u.items() if n in part} for p, u in uploads(spec, 2).items()}
    done = build_round(2, fragment_uploads, {}, 1, first, spec, codec)
    want = build_global(uploads(spec, 2), spec=spec, step=2, names=part)
    assert 0 < len(part) < len(first.global_model)
    for name, tensor in first.global_model.items():
        expected = want.tensors[name] if name in part else tensor
        assert torch.equal(done.global_model[name], expected), name
    assert list(done.global_model) == list(spec.manifest or {})
    assert codec.served[-1]["names"] == part and done.fragment == 1


def test_the_mean_is_summed_into_the_uploads_and_kept_buffers() -> None:
    """With `consume` the fp32 mean of a shared tensor is summed in place in the first peer's upload (no new
    tensor), and a mean of bf16 uploads into a buffer `empty` supplies."""
    spec = tiny_spec(server=NO_MERGE)
    fp32 = uploads(spec, 3)
    firsts = {n: t for n, t in fp32[0].items()}
    done = build_round(1, fp32, {}, WHOLE, None, spec, RecordingCodec())
    shared = [n for n in spec.manifest or {} if spec.owner(n) is None]
    assert shared and all(done.global_model[n] is firsts[n] for n in shared)
    made: list[Shape] = []

    def empty(shape: Shape, dtype: torch.dtype) -> torch.Tensor:
        made.append(shape)
        return torch.empty(shape, dtype=dtype)

    bf16 = {p: {n: t.bfloat16() for n, t in u.items()} for p, u in uploads(spec, 3).items()}
    build_round(1, bf16, {}, WHOLE, None, spec, RecordingCodec(), empty)
    assert sorted(made) == sorted(tuple((spec.manifest or {})[n]) for n in shared)


def test_the_codec_serves_the_round_with_what_it_needs() -> None:
    """The codec gets the round's step, the previous round's served model and the names the round changed; the
    payloads it may relay unchanged reach it only when no merge changed the blocks."""
    relayed: dict[str, Payload] = {"x": object()}  # type: ignore[dict-item]
    spec = tiny_spec(server=NO_MERGE)
    codec = RecordingCodec()
    first, done = two_rounds(spec, codec, relayed=relayed)
    asked = codec.served[-1]
    assert asked["step"] == 2 and asked["previous"] is first.served and asked["relayed"] is relayed
    assert asked["names"] == list(spec.manifest or {}) and done.served.round == 2
    assert codec.served[0]["previous"] is None
    merging = RecordingCodec()
    _, merged = two_rounds(tiny_spec(server=MERGING), merging, relayed=relayed)
    assert merged.alpha > 0 and merging.served[-1]["relayed"] == {}


def test_a_non_finite_aggregate_is_refused_naming_the_tensor() -> None:
    spec = tiny_spec(server=NO_MERGE)
    big = uploads(spec, 4)
    for upload in big.values():
        upload["lm_head.weight"].fill_(3.0e38)
    with pytest.raises(NonFiniteRound) as err:
        build_round(7, big, {}, WHOLE, None, spec, RecordingCodec())
    assert str(err.value) == (
        "round 7: the aggregate of tensor 'lm_head.weight' holds NaN or Inf (the peers' uploads were finite: their "
        "mean, the outer step or the merge overflowed fp32); the round is refused and the global model stays at the "
        "previous round"
    )
