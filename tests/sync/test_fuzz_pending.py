"""Fuzz findings in modules another change owns (spes/sync/codecs/*): kept failing here until they are fixed there.

Each test names its input, the exception it raises now and the contract it should keep; the lead moves the fix
in and these tests beside the module's other tests."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fuzz_helpers import FUZZ, refused_only
from spes.sync.codecs.registry import build_codec

pytestmark = pytest.mark.timeout(60)


@FUZZ
@given(
    st.sampled_from(["int8", "sparse"]),
    st.dictionaries(st.sampled_from(["codec", "round"]), st.sampled_from(["int8", "sparse", "x", "", "-7", "3"])),
)
def test_a_damaged_codec_state_is_refused_with_a_value_error(codec: str, metadata: dict[str, str]) -> None:
    """`HeldPeer.load_state_dict` reads `codec_state.st`'s header metadata, a file a damaged checkpoint holds;
    `PeerSync.resume` takes only OSError and ValueError. Now {"codec": "int8"} (no "round") raises KeyError
    (spes/sync/codecs/held.py, `int(metadata["round"])`) and a negative round is taken as the held model's."""
    peer = build_codec(codec).peer()
    refused_only(lambda: peer.load_state_dict(metadata, {"held/w": torch.ones(2)}), ValueError)
    assert peer.base_round >= -1


def test_a_codec_state_without_its_round_is_refused() -> None:
    peer = build_codec("int8").peer()
    with pytest.raises(ValueError, match="round"):
        peer.load_state_dict({"codec": "int8"}, {"held/w": torch.ones(2)})
