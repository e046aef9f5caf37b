"""Fuzz findings in modules another change owns (spes/sync/codecs/held.py, spes/sync/node_files.py,
spes/sync/plane_tcp.py): kept failing here until they are fixed there.

Each test names its input, the exception it raises now and the contract it should keep; the lead moves the fix
in and these tests beside the module's other tests."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fuzz_helpers import FUZZ, refused_only
from spes.sync.codecs.registry import build_codec
from spes.sync.node_files import RUN_FILE, read_run_id
from spes.sync.plane_tcp import refusal_of
from spes.sync.proto import spes_pb2 as pb
from spes.sync.protocol import SyncError

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


def test_a_run_record_nested_too_deep_is_refused(tmp_path: Path) -> None:
    """`node_files.read_run_id` catches ValueError, KeyError and TypeError around `json.loads`; JSON nested deeper
    than the interpreter's recursion limit raises RecursionError (spes/sync/node_files.py, `read_run_id`): add it
    to the caught errors, as `spes.sync.state.run_id_of` does."""
    (tmp_path / RUN_FILE).write_bytes(b"[" * 100_000)
    with pytest.raises(ValueError, match="not a run record"):
        read_run_id(tmp_path)


@FUZZ
@given(
    st.one_of(
        st.sampled_from(["__class__", "mro", "__init__", "_member_map_", "OK", "UNAVAILABLE"]), st.text(max_size=12)
    ),
    st.text(max_size=12),
)
def test_any_error_frame_code_is_a_sync_error(code: str, reason: str) -> None:
    """A server's data-plane error frame names its gRPC status as text; `plane_tcp.refusal_of` looks it up with
    `getattr(grpc.StatusCode, error.code, UNKNOWN)`, so "__class__", "mro" or "__init__" return a non-member and
    `classify` raises AttributeError (`code.name`), "_member_map_" a TypeError (spes/sync/plane_tcp.py,
    `refusal_of`). Fix: `grpc.StatusCode.__members__.get(error.code, grpc.StatusCode.UNKNOWN)`."""
    error = refusal_of("upload", pb.DataError(code=code, message="refused", reason=reason))
    assert isinstance(error, SyncError) and isinstance(error.code, grpc.StatusCode)
