"""Fuzz of Join admission (`spes.sync.joins.check_join`): the run's own Join is admitted; a JoinRequest damaged on
the wire, or one whose spec or manifest carries hostile values (huge or negative dims, many of them, counts past any
memory, unknown codecs), is admitted as a valid spec or refused with `Refused`, never anything else."""

from __future__ import annotations

from dataclasses import replace

import pytest
from google.protobuf.message import DecodeError
from hypothesis import given
from hypothesis import strategies as st

from fuzz_helpers import FUZZ, hostile_ints, memory_cap, mutated, refused_only
from spes.sync.joins import check_join
from spes.sync.proto import spes_pb2 as pb
from spes.sync.protocol import Refused
from sync_helpers import join_request, tiny_spec

pytestmark = pytest.mark.timeout(120)

SPEC = tiny_spec()
OPEN = replace(SPEC, manifest=None, sync_steps=None, block_owners=None)
"""A server started without the run's YAML: the first Join's manifest is sized only by --max_model_gb."""
int64s = st.integers(-(2**63), 2**63 - 1)


@FUZZ
@given(st.integers(0, SPEC.num_peers - 1), st.sampled_from([SPEC, OPEN]))
def test_the_runs_join_is_admitted(peer: int, run: object) -> None:
    assert check_join(join_request(peer, SPEC), run) == SPEC  # type: ignore[arg-type]


@FUZZ
@given(st.data(), st.sampled_from([SPEC, OPEN]))
def test_damaged_joins_are_refused(data: st.DataObject, run: object) -> None:
    raw = data.draw(mutated(join_request(1, SPEC).SerializeToString()))
    try:
        request = pb.JoinRequest.FromString(raw)
    except DecodeError:
        return  # gRPC refuses what is not a JoinRequest before the handler
    refused_only(lambda: check_join(request, run), Refused)  # type: ignore[arg-type]


@st.composite
def hostile_manifests(draw: st.DrawFn) -> list[pb.TensorSpec]:
    """The run's manifest with one tensor's shape replaced by hostile dims (up to 24 of them), maybe more tensors."""
    manifest = [pb.TensorSpec(name=n, shape=s) for n, s in (SPEC.manifest or {}).items()]
    at = draw(st.integers(0, len(manifest) - 1))
    huge = st.lists(st.sampled_from([2**62, 2**63 - 1]), min_size=16, max_size=24)
    dims = draw(huge | st.lists(st.one_of(st.sampled_from([2**62, 2**63 - 1, -1, 0]), hostile_ints()), max_size=24))
    manifest[at] = pb.TensorSpec(name=manifest[at].name, shape=[max(-(2**63), min(d, 2**63 - 1)) for d in dims])
    extra = draw(st.lists(st.text(max_size=30), max_size=3))
    return manifest + [pb.TensorSpec(name=n, shape=[2**40, 2**40]) for n in extra]


@FUZZ
@given(hostile_manifests(), st.sampled_from([SPEC, OPEN]))
def test_hostile_manifests_are_refused(manifest: list[pb.TensorSpec], run: object) -> None:
    request = join_request(0, SPEC)
    del request.manifest[:]
    request.manifest.extend(manifest)
    with memory_cap():
        refused_only(lambda: check_join(request, run), Refused)  # type: ignore[arg-type]


def test_a_manifest_too_large_for_a_float_is_refused() -> None:
    """Seventeen dims of 2^62 make a model of 2^1054 values: its size in GB is past a float's range."""
    request = join_request(0, SPEC)
    request.manifest.append(pb.TensorSpec(name="lm_head.huge", shape=[2**62] * 17))
    for run in (SPEC, OPEN):
        with pytest.raises(Refused):
            check_join(request, run)


@FUZZ
@given(
    st.text(max_size=8),
    int64s,
    int64s,
    st.lists(st.integers(-(2**31), 2**31 - 1), max_size=6),
    int64s,
    int64s,
    st.sampled_from(["fp32", "bf16", "int8", "sparse", "", "zip"]),
    st.dictionaries(st.sampled_from(["block", "chunk", "topk", "bits", "down_topk", "down_bits", "x"]), int64s),
)
def test_hostile_specs_are_refused(
    mode: str,
    peers: int,
    experts: int,
    owners: list[int],
    sync_steps: int,
    fragments: int,
    codec: str,
    settings: dict[str, int],
) -> None:
    request = join_request(0, SPEC)
    request.spec.CopyFrom(
        pb.RunSpec(
            mode=mode if mode else "spes",
            num_peers=max(-(2**31), min(peers, 2**31 - 1)),
            experts_per_block=max(-(2**31), min(experts, 2**31 - 1)),
            block_owners=owners,
            sync_steps=sync_steps,
            last_step=sync_steps,
            overlap_fragments=max(0, min(fragments, 2**32 - 1)),
            codec=codec,
            codec_settings=settings,
        )
    )
    with memory_cap():
        refused_only(lambda: check_join(request, OPEN), Refused)
