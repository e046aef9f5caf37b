"""The sparse codec's math alone: what is sent is rebuilt exactly, chunk edges, levels, bit streams, sizes and
refusals (error feedback over rounds and the held model on real servers: tests/sync/codecs/test_held.py)."""

from __future__ import annotations

import math
import os
import signal
import threading
import time

import numpy as np
import pytest
import torch

from spes.sync.codecs import sparse
from spes.sync.codecs.base import Scattered
from spes.sync.codecs.held import apply_delta, encode_delta
from spes.sync.codecs.sparse import (
    MAX_CHUNK,
    ROWS_PER_THREAD,
    Sparse,
    SparsePayload,
    _by_rows,
    dequantize,
    index_bits,
    largest,
    pack_bits,
    payload_bytes,
    quantize,
    unpack_bits,
)


@pytest.mark.parametrize("width", range(1, 21))
@pytest.mark.parametrize("count", [0, 1, 7, 37])
def test_bit_streams_hold_each_entrys_bits_in_order_at_every_width(width: int, count: int) -> None:
    values = torch.randint(0, 1 << width, (count,), generator=torch.Generator().manual_seed(width))
    # the stream as one integer: entry i at bits [i width, (i + 1) width), read out least significant byte first
    expected = sum(v << (i * width) for i, v in enumerate(values.tolist())).to_bytes(-(-count * width // 8), "little")
    packed = pack_bits(values, width)
    assert packed.dtype == torch.uint8 and bytes(packed.tolist()) == expected
    assert torch.equal(unpack_bits(torch.tensor(list(expected), dtype=torch.uint8), count, width), values)


def test_the_bit_stream_is_little_endian_entry_by_entry() -> None:
    # entry i at bits [3i, 3i + 3), bit j of a byte its j-th: 5 = 101, 3 = 011 -> bits 1,0,1,1,1,0 -> 0b011101
    assert pack_bits(torch.tensor([5, 3]), 3).tolist() == [0b011101]
    assert pack_bits(torch.tensor([0xABC, 0x123]), 12).tolist() == [0xBC, 0x3A, 0x12]


def test_a_short_bit_stream_is_refused() -> None:
    assert message(unpack_bits, torch.zeros(2, dtype=torch.uint8), 2, 12) == (
        "a bit stream of 2 entries of 12 bits needs 3 bytes, got 2"
    )


def test_nan_or_inf_anywhere_in_a_chunk_is_refused() -> None:
    for bad in (float("nan"), float("inf"), float("-inf")):
        x = torch.randn(3 * 4096)
        x[4096 + 1234] = bad  # one value in the middle of a chunk, which sends 64 of its 4096
        assert "holds NaN or Inf values" in message(quantize, "w", x, 4096, 64, 2)


@pytest.mark.parametrize("kind", ["normal", "heavy-tailed", "ties", "nan and inf"])
def test_the_largest_entries_of_each_row_are_topks_though_found_in_two_small_selections(kind: str) -> None:
    """k of 1 .. 256 of 4096 take the grouped path, 300 and all 4096 one selection: the same magnitudes as `topk`
    either way (which of equal entries is taken may differ), each position once, in increasing order."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(16, 4096, generator=gen)
    if kind == "heavy-tailed":
        x = x**5
    elif kind == "ties":
        x = torch.randint(-20, 20, (16, 4096), generator=gen).float()
    elif kind == "nan and inf":
        x[3, 100], x[3, 4000], x[5, 7] = float("nan"), float("inf"), float("-inf")
    magnitudes = x.abs()
    for k in (1, 8, 64, 128, 256, 300, 4096):
        got = largest(x, k)
        assert got.shape == (16, k) and bool((got[:, 1:] > got[:, :-1]).all())  # NOTE: each position once, in order
        values = magnitudes.gather(1, got).sort(dim=1, descending=True).values
        torch.testing.assert_close(values, magnitudes.topk(k, dim=1).values, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("rows", [64, 129, 1000])
def test_the_selection_is_the_same_on_any_number_of_threads(rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks of rows go to as many threads as torch's intra-op threads (at least `ROWS_PER_THREAD` rows each, the
    last block shorter): each row's positions are those of one thread, whatever the split.

    The thread count is what the codec reads, not torch's own: torch's OpenMP pool, once grown, hangs in a forked
    child (as the mutation runs fork one per mutant), and the split is the codec's alone."""
    x = torch.randn(rows, 4096, generator=torch.Generator().manual_seed(5))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    alone = [largest(x, k) for k in (64, 256, 300)]
    for n in (2, 3, 7):
        monkeypatch.setattr(torch, "get_num_threads", lambda n=n: n)
        assert all(torch.equal(largest(x, k), want) for k, want in zip((64, 256, 300), alone))
    assert ROWS_PER_THREAD * 2 <= 129  # NOTE: so 129 and 1000 rows are split, 64 is not


@pytest.mark.parametrize(
    ("length", "k", "widths"),
    [
        (4096, 64, [512, 512]),  # g = 8 = sqrt(4096 / 64): 512 group peaks, then 64 groups of 8
        (1024, 64, [256, 256]),  # 16 k: g = 4, the largest power of two at most sqrt(16)
        (1000, 8, [125, 64]),  # g = 8 at most sqrt(125)
        (1000, 64, [1000]),  # under 16 k: one selection
        (1001, 8, [1001]),  # no power-of-two group divides the row: one selection
    ],
)
def test_the_two_selections_cover_length_over_g_then_k_g_entries(
    length: int, k: int, widths: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the grouping is for: selections over `length / g` group peaks and `k g` candidates, g the largest power
    of two at most sqrt(length / k) (least work), where the row is 16 k or longer and g divides it."""
    seen: list[int] = []

    def top(magnitudes: torch.Tensor, k: int) -> torch.Tensor:
        seen.append(magnitudes.shape[1])
        return magnitudes.topk(k, dim=1).indices

    monkeypatch.setattr(sparse, "_top", top)
    x = torch.randn(2, length, generator=torch.Generator().manual_seed(1))
    assert torch.equal(largest(x, k), x.abs().topk(k, dim=1).indices.sort(dim=1).values)
    assert seen == widths


@pytest.mark.timeout(60)
def test_a_forked_child_selects_on_threads_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """A child forked once the parent's selection threads are idle inherits their pool but not the threads; it
    makes its own (the mutation runs fork one child per mutant: each waited forever)."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    rows = np.random.default_rng(0).random((200, 64))
    want = _by_rows(lambda block: np.sort(block, axis=1), rows)
    time.sleep(0.2)  # NOTE: the pool's threads finish and wait for work
    pid = os.fork()
    if pid == 0:  # the child: exit 0 once its selection comes back, else killed by the alarm (not pytest's handler)
        try:
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            signal.alarm(10)
            os._exit(0 if torch.equal(_by_rows(lambda block: np.sort(block, axis=1), rows), want) else 1)
        finally:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.parametrize(
    ("rows", "threads", "blocks"), [(200, 3, [67, 67, 66]), (200, 8, [67, 67, 66]), (127, 4, [127])]
)
def test_rows_are_cut_into_one_block_per_thread_in_order(
    rows: int, threads: int, blocks: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """As many blocks as threads, but none under `ROWS_PER_THREAD` rows (200 rows: at most 3), the first ones
    ceil(rows / blocks) long, each on a pool thread, their results in row order; one block runs where it is."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    seen: list[tuple[int, str]] = []

    def work(block: np.ndarray) -> np.ndarray:
        seen.append((len(block), threading.current_thread().name))
        return block * 2

    values = np.arange(rows * 3, dtype=np.int64).reshape(rows, 3)
    assert torch.equal(_by_rows(work, values), torch.from_numpy(values * 2))
    assert sorted(n for n, _ in seen) == sorted(blocks)
    split = len(blocks) > 1
    assert all(name.startswith("spes-select") == split for _, name in seen)


@pytest.mark.parametrize("numel", [1, 5, 63, 64, 100, 4096, 4096 * 2 + 17])
def test_each_chunk_sends_its_topk_largest_and_the_rest_is_zero(numel: int) -> None:
    torch.manual_seed(numel)
    x = torch.randn(numel)
    payload = quantize("w", x, chunk=64, topk=8, bits=8)
    got = dequantize(payload)
    for start in range(0, numel, 64):
        part, sent = x[start : start + 64], got[start : start + 64]
        k = min(8, part.numel())
        largest = set(part.abs().topk(k).indices.tolist())
        assert set(sent.nonzero().flatten().tolist()) == largest  # NOTE: no level stands for zero
    assert payload.num_bytes == payload_bytes(numel, 64, 8, 8) == payload.pack().numel()


def test_levels_are_evenly_spaced_over_the_chunks_largest_magnitude_and_never_zero() -> None:
    x = torch.tensor([3.0, -3.0, 1.2, -0.9, 0.1, 0.0])
    got = dequantize(quantize("w", x, chunk=6, topk=4, bits=2))
    # levels of 2 bits over [-3, 3]: -3, -1, 1, 3; 0.1 and 0.0 are not among the top 4
    assert got.tolist() == [3.0, -3.0, 1.0, -1.0, 0.0, 0.0]
    sign = dequantize(quantize("w", torch.tensor([2.0, -4.0, 0.5]), chunk=3, topk=2, bits=1))
    assert sign.tolist() == [3.0, -3.0, 0.0]  # 1 bit: the sign times the mean magnitude sent


def test_what_was_sent_is_rebuilt_exactly_from_the_wire_bytes() -> None:
    codec = Sparse(chunk=256, topk=16, bits=3)
    x = torch.randn(1000, 3)
    payload = codec.encode("w", x)
    again = codec.unpack("w", (1000, 3), payload.params(), payload.pack())
    assert torch.equal(codec.decode(again), codec.decode(payload))
    assert again.params() == {"chunk": 256, "topk": 16, "bits": 3}


def test_error_feedback_carries_exactly_what_the_payload_missed() -> None:
    codec = Sparse(chunk=128, topk=4, bits=2)
    base, value, carried = torch.randn(500), torch.randn(500), torch.randn(500) * 0.01
    sent = encode_delta(codec, "w", value, base, carried)
    target = value - base + carried
    assert torch.equal(sent.error, target - codec.decode(sent.payload))
    assert torch.equal(sent.reconstruction, base + codec.decode(sent.payload))


def test_a_delta_is_its_sent_entries_and_applying_it_touches_nothing_else() -> None:
    """`delta` is the sent entries at their positions in the flattened tensor (chunk edges and the shorter last
    chunk included); applying it leaves every other entry's bits as they were, -0.0 included (a dense add of the
    decoded zeros would make it +0.0: the work and the memory of a dense delta, for nothing)."""
    codec = Sparse(chunk=64, topk=4, bits=2)
    x = torch.randn(3, 50)  # 150 values: 2 whole chunks and one of 22
    payload = codec.encode("w", x)
    sent = codec.delta(payload)
    assert isinstance(sent, Scattered) and sent.positions.numel() == 12
    dense = torch.zeros(150).index_copy_(0, sent.positions, sent.values).view(3, 50)
    assert torch.equal(dense, codec.decode(payload))
    assert sorted(sent.positions.tolist()) == sent.positions.tolist() and sent.positions.max() < 150
    base = torch.randn(3, 50)
    untouched = torch.ones(150, dtype=torch.bool)
    untouched[sent.positions] = False
    base.view(-1)[untouched.nonzero()[0]] = -0.0
    held = apply_delta(base, payload, codec)
    assert torch.equal(held.view(-1)[untouched].view(torch.int32), base.view(-1)[untouched].view(torch.int32))
    assert torch.equal(held.view(-1)[~untouched], (base + codec.decode(payload)).view(-1)[~untouched])


def test_the_server_sends_in_its_own_format_and_both_formats_are_read() -> None:
    codec = Sparse(chunk=64, topk=4, bits=2, down_topk=16, down_bits=8)
    assert (codec.down.topk, codec.down.bits, codec.down.chunk) == (16, 8, 64)
    x = torch.randn(300)
    for payload in (codec.encode("w", x), codec.down.encode("w", x)):
        assert codec.payload_bytes((300,), payload.params()) == payload.num_bytes
        assert torch.equal(
            codec.decode(codec.unpack("w", (300,), payload.params(), payload.pack())), dequantize(payload)
        )
    assert codec.down.round_bytes(300) > codec.round_bytes(300)


def test_bad_settings_headers_and_payloads_are_refused_naming_them() -> None:
    with pytest.raises(ValueError, match=r"codec_settings.topk' = 0 must be in \[1, chunk=64\]"):
        Sparse(chunk=64, topk=0)
    with pytest.raises(ValueError, match=r"codec_settings.down_bits' = 9 must be in \[1, 8\]"):
        Sparse(down_bits=9)
    codec = Sparse(chunk=64, topk=4, bits=2)
    with pytest.raises(ValueError, match=r"sparse parameters \{'chunk': 64, 'topk': 5, 'bits': 2\}"):
        codec.payload_bytes((100,), {"chunk": 64, "topk": 5, "bits": 2})
    with pytest.raises(ValueError, match=r"tensor 'w' holds NaN or Inf"):
        codec.encode("w", torch.tensor([1.0, float("nan")]))
    payload = codec.encode("w", torch.randn(100))
    data = payload.pack().clone()
    data[4 * 2 : 4 * 2 + 1] = 0xFF  # the first index byte: entries out of order within their chunk
    with pytest.raises(ValueError, match=r"tensor 'w': sparse payload has an index outside its chunk or out of order"):
        codec.unpack("w", (100,), payload.params(), data)
    data = payload.pack().clone()
    data[:4] = torch.tensor([0, 0, 0xC0, 0xFF], dtype=torch.uint8)  # a NaN scale
    with pytest.raises(ValueError, match=r"sparse payload has a negative, NaN or Inf scale"):
        codec.unpack("w", (100,), payload.params(), data)


def message(call, *args, **kwargs) -> str:  # type: ignore[no-untyped-def]
    """The message of the ValueError that `call(*args, **kwargs)` raises."""
    with pytest.raises(ValueError) as err:
        call(*args, **kwargs)
    return str(err.value)


def test_index_widths_and_exact_byte_counts() -> None:
    assert [index_bits(c) for c in (2, 3, 4, 5, 4096, 4097)] == [1, 2, 2, 3, 12, 13]
    # 100 values in chunks of 64 (64 + 36), 3 entries each: 2 scales (8 bytes), 6 x 6 index bits (5 bytes), 6 x 2
    # level bits (2 bytes)
    assert payload_bytes(100, 64, 3, 2) == 8 + 5 + 2


@pytest.mark.parametrize("numel", [64, 65, 128, 200])
def test_a_tensor_of_whole_chunks_or_a_short_last_one_round_trips_through_the_wire(numel: int) -> None:
    codec = Sparse(chunk=64, topk=4, bits=3)
    x = torch.randn(numel)
    payload = codec.encode("w", x)
    again = codec.unpack("w", (numel,), codec.params(), payload.pack())
    assert (again.name, again.scales.numel()) == ("w", math.ceil(numel / 64))
    assert torch.equal(codec.decode(again), codec.decode(payload))


def test_small_magnitudes_zeros_and_the_sign_levels() -> None:
    """Levels are relative to the chunk's largest magnitude whatever its size (below 1 too); a zero chunk sends
    zeros with levels in range; at 1 bit a positive value below 1 is positive and a zero sent takes the negative
    level. Levels are int64 at every width."""
    small = quantize("w", torch.tensor([0.3, -0.3, 0.1]), chunk=3, topk=3, bits=2)
    torch.testing.assert_close(dequantize(small), torch.tensor([0.3, -0.3, 0.1]))
    zeros = quantize("w", torch.zeros(8), chunk=4, topk=2, bits=2)  # level 2 of 0..3: round(1.5), half to even
    assert zeros.scales.tolist() == [0.0, 0.0] and zeros.levels.tolist() == [2, 2, 2, 2]
    assert not dequantize(zeros).any()
    sign = quantize("w", torch.tensor([0.5, -0.25, 0.0]), chunk=3, topk=3, bits=1)
    assert sign.levels.tolist() == [1, 0, 0] and sign.levels.dtype == small.levels.dtype == torch.int64
    assert dequantize(sign).tolist() == [0.25, -0.25, -0.25]  # the mean magnitude sent, 0.25


def test_an_empty_tensor_is_an_empty_payload() -> None:
    payload = quantize("w", torch.zeros(0, 5), chunk=64, topk=4, bits=2)
    assert payload.name == "w" and payload.num_bytes == payload.pack().numel() == 0
    assert [t.dtype for t in (payload.scales, payload.indices, payload.levels)] == [torch.float32, torch.int64] * 1 + [
        torch.int64
    ]
    assert [t.numel() for t in (payload.scales, payload.indices, payload.levels)] == [0, 0, 0]
    assert dequantize(payload).shape == (0, 5)


def test_the_settings_bounds_and_what_the_header_carries() -> None:
    for ok in (Sparse(chunk=2, topk=1, bits=1, down_topk=1, down_bits=1), Sparse(chunk=MAX_CHUNK)):
        assert ok.params() == {"chunk": ok.chunk, "topk": ok.topk, "bits": ok.bits}
    assert Sparse(chunk=256, topk=16, bits=3).params() == {"chunk": 256, "topk": 16, "bits": 3}
    assert message(Sparse, chunk=1) == "config key 'spes_config.codec_settings.chunk' = 1 must be in [2, 1048576]"
    assert message(Sparse, down_topk=0) == "config key 'spes_config.codec_settings.down_topk' = 0 must be >= 1"
    assert message(Sparse, bits=0) == "config key 'spes_config.codec_settings.bits' = 0 must be in [1, 8]"
    assert message(Sparse(chunk=64, topk=4, bits=2).payload_bytes, (100,), {"chunk": 64, "topk": 5, "bits": 2}) == (
        "sparse parameters {'chunk': 64, 'topk': 5, 'bits': 2}, this run's are {'chunk': 64, 'topk': 4, 'bits': 2} "
        "(peers) and {'chunk': 64, 'topk': 64, 'bits': 8} (server)"
    )
    assert message(quantize, "w", torch.ones(3, dtype=torch.int64), 64, 4, 2) == (
        "tensor 'w': cannot quantize dtype torch.int64, a floating-point delta is needed"
    )
    assert message(quantize, "w", torch.tensor([1.0, float("inf")]), 64, 4, 2) == (
        "tensor 'w' holds NaN or Inf values: this peer's training diverged or its carried error is corrupt"
    )


def payload_of(numel: int, scales: list[float], indices: list[int], levels: list[int]) -> SparsePayload:
    """A payload of `numel` values in chunks of 64, two entries each, built by hand (as `unpack` would)."""
    return SparsePayload(
        "w", (numel,), 64, 2, 2, torch.tensor(scales), torch.tensor(indices), torch.tensor(levels, dtype=torch.int64)
    )


def test_a_payload_that_does_not_fit_its_shape_is_refused_in_full() -> None:
    payload_of(65, [1.0, 0.0], [3, 40, 0], [0, 3, 1])  # fits: a zero scale is a zero chunk
    assert message(payload_of, 65, [1.0], [3, 40, 0], [0, 3, 1]) == "tensor 'w': sparse payload needs 2 float32 scales"
    assert (
        message(payload_of, 128, [1.0], [3, 40, 0, 1], [0] * 4) == "tensor 'w': sparse payload needs 2 float32 scales"
    )
    wide = torch.ones(2, dtype=torch.float64)
    assert "needs 2 float32 scales" in message(
        SparsePayload, "w", (65,), 64, 2, 2, wide, torch.tensor([3, 40, 0]), wide
    )
    assert (
        message(payload_of, 65, [1.0, 1.0], [3, 40, 0], [0, 3])
        == "tensor 'w': sparse payload needs 3 indices and levels"
    )
    assert message(payload_of, 65, [1.0, -1.0], [3, 40, 0], [0, 3, 1]) == (
        "tensor 'w': sparse payload has a negative, NaN or Inf scale"
    )
    bad_index = "tensor 'w': sparse payload has an index outside its chunk or out of order"
    # past the chunk (in order), a repeat, reversed, before the chunk (in order), past the last 1-value chunk
    for indices in ([3, 64, 0], [3, 70, 0], [3, 3, 0], [40, 3, 0], [-1, 3, 0], [3, 40, 1], [3, 40, -1]):
        assert message(payload_of, 65, [1.0, 1.0], indices, [0, 3, 1]) == bad_index
    levels = torch.zeros(3, dtype=torch.int64)
    assert "out of order" in message(
        SparsePayload, "w", (64,), 64, 3, 2, torch.ones(1), torch.tensor([0, 5, 3]), levels
    )
