"""Fuzz of the raw-TCP data plane's framing (`spes.sync.plane_tcp`: the preamble, length-prefixed control frames,
header frames before raw payloads): valid frames round-trip; any bytes a peer sends are read as a message or refused
with a TransportError / FrameError (a refused length before a byte of the frame is allocated), never anything else."""

from __future__ import annotations

import socket
import threading

import grpc
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fuzz_helpers import FUZZ, hostile_ints, memory_cap, mutated, refused_only
from spes.sync import plane_tcp, wire
from spes.sync.proto import spes_pb2 as pb
from spes.sync.protocol import Reason, SyncError, classify

pytestmark = pytest.mark.timeout(120)

REFUSALS = (plane_tcp.TransportError, plane_tcp.FrameError, ValueError)
"""What reading hostile bytes may raise: a broken framing, a frame that is not the message, a refused header."""


def _read(data: bytes, read: object) -> object:
    """`read(sock)` over a socket that holds `data` and then ends (the sender closes it)."""
    ours, theirs = socket.socketpair()
    ours.settimeout(5)
    sender = threading.Thread(target=lambda: (theirs.sendall(data), theirs.close()))
    sender.start()
    try:
        return refused_only(lambda: read(ours), *REFUSALS)  # type: ignore[operator]
    finally:
        sender.join()
        ours.close()


def _hello_bytes(hello: pb.DataHello) -> bytes:
    body = hello.SerializeToString()
    return plane_tcp._PREAMBLE.pack(plane_tcp.MAGIC, plane_tcp.VERSION) + plane_tcp._LENGTH.pack(len(body)) + body


@FUZZ
@given(st.integers(0, 2**31 - 1), st.text(max_size=20), st.integers(0, 2**63 - 1))
def test_hellos_round_trip(peer: int, token: str, round_: int) -> None:
    hello = pb.DataHello(peer_id=peer, token=token, step=round_)
    assert _read(_hello_bytes(hello), plane_tcp.recv_hello) == hello


@FUZZ
@given(st.data())
def test_damaged_hellos_are_refused(data: st.DataObject) -> None:
    damaged = data.draw(mutated(_hello_bytes(pb.DataHello(peer_id=3, token="secret", step=40))))
    with memory_cap():
        result = _read(damaged, lambda s: plane_tcp.recv_hello(s, plane_tcp.SERVER_MAX_FRAME_BYTES))
    assert result is None or isinstance(result, pb.DataHello)


@FUZZ
@given(
    st.one_of(st.sampled_from([0, 1, 2**20, 2**20 + 1, 2**31, 2**32 - 1]), st.integers(0, 2**32 - 1)),
    st.binary(max_size=64),
)
def test_frame_lengths_past_the_limit_are_refused_unread(length: int, body: bytes) -> None:
    with memory_cap():
        result = _read(
            plane_tcp._LENGTH.pack(length) + body,
            lambda s: plane_tcp.recv_frame(s, pb.DataReply, plane_tcp.SERVER_MAX_FRAME_BYTES),
        )
    assert result is None or length <= len(body)


@FUZZ
@given(st.data(), st.lists(hostile_ints(), max_size=3))
def test_damaged_tensor_streams_are_refused(data: st.DataObject, shape: list[int]) -> None:
    """Header frames and raw payloads as `send_tensors` writes them, damaged, read by `recv_tensors`."""
    tensors = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(4)}
    ours, theirs = socket.socketpair()
    plane_tcp.send_tensors(theirs, tensors, "fp32")
    theirs.close()
    stream = b"".join(iter(lambda: ours.recv(1 << 16), b""))
    ours.close()
    damaged = data.draw(mutated(stream))
    if data.draw(st.booleans()):  # a hostile shape in the first header frame instead
        header = wire.header_for("w", tensors["w"], "fp32")
        header.shape[:] = [max(-(2**63), min(d, 2**63 - 1)) for d in shape]
        body = header.SerializeToString()
        damaged = plane_tcp._LENGTH.pack(len(body)) + body + stream[plane_tcp._LENGTH.size + header.ByteSize() :]
    expected = {n: tuple(t.shape) for n, t in tensors.items()}
    with memory_cap():
        _read(damaged, lambda s: plane_tcp.recv_tensors(s, wire.TensorDecoder(expected, "fp32"), len(tensors)))


@FUZZ
@given(st.text(max_size=20), st.text(max_size=40), st.text(max_size=20))
def test_any_error_frame_is_classified(code: str, message: str, reason: str) -> None:
    """A server's `DataError` carries a gRPC status name, a message and a reason, each any text on the wire: the
    client maps an unknown status or reason to UNKNOWN / NONE (`spes.sync.protocol.classify`), never raises."""
    known = grpc.StatusCode.__members__.get(code, grpc.StatusCode.UNKNOWN)
    error = classify("upload", known, message, reason)
    assert error.reason in set(Reason) and isinstance(error.retryable, bool)


@FUZZ
@given(
    st.one_of(
        st.sampled_from(["__class__", "mro", "__init__", "_member_map_", "OK", "UNAVAILABLE"]), st.text(max_size=12)
    ),
    st.text(max_size=12),
)
def test_any_error_frame_code_is_a_sync_error(code: str, reason: str) -> None:
    """A server's data-plane error frame names its gRPC status as text: an attribute of `grpc.StatusCode` that is
    not a member ("__class__", "mro", "_member_map_") made `classify` raise AttributeError or TypeError."""
    error = plane_tcp.refusal_of("upload", pb.DataError(code=code, message="refused", reason=reason))
    assert isinstance(error, SyncError) and isinstance(error.code, grpc.StatusCode)
