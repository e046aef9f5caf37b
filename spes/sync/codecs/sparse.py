"""Sparse low-bit deltas: the `sparse` codec's quantizer (`spes_config.codec: sparse`).

The flattened delta is cut into chunks of `chunk` values (the last one may be shorter). Of each chunk only the
`topk` entries of largest magnitude travel (all of a chunk shorter than that), each as its index in the chunk
(`index_bits` = ceil(log2 chunk) bits) and a `bits`-bit level, with one fp32 scale per chunk, the chunk's largest
magnitude s. With L = 2^bits levels, level q in [0, L) stands for

    v(q) = s * (2q - (L - 1)) / (L - 1)          (bits >= 2: L values evenly spaced over [-s, s], zero excluded)
    v(q) = (2q - 1) * m                          (bits == 1: the sign, times m = the mean magnitude sent)

and each sent value takes the nearest level (round half to even). Everything not sent, and what the levels
missed, stays in the sender's error-feedback buffer (`spes.sync.codecs.held`), so it travels in a later round.

A payload of n values in C = ceil(n / chunk) chunks sending S entries is `4 C + ceil(S index_bits / 8) +
ceil(S bits / 8)` bytes: the scales, then the indices, then the levels, each a little-endian bit stream (entry i
at bits [i w, (i + 1) w), bit j of a byte is its j-th). A peer's upload at the defaults (4096, 64, 2) is 0.227 bits
per value (SparseLoCo's choice, Sarfi et al. 2025, arXiv 2508.15706: top 64 of 4096, 2-bit values, 12-bit
indices); the server's deltas (`down_topk` 256, `down_bits` 8) are 1.26 bits per value of the tensors it re-encodes
(averaged tensors, and blocks on merge rounds; a block relayed from its owner travels as uploaded).
"""

from __future__ import annotations

import functools
import math
import os
import sys
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from spes.sync.codecs.base import Payload, Scattered
from spes.sync.protocol import Shape

NAME = "sparse"
SCALE_BYTES = 4
MAX_CHUNK = 1 << 20
"""Largest chunk: its indices take 20 bits."""
MAX_BITS = 8


def chunk_sizes(numel: int, chunk: int) -> tuple[int, int]:
    """(number of whole chunks, length of the last shorter one, 0 when none) of a tensor of `numel` values."""
    return numel // chunk, numel % chunk


def sent_entries(numel: int, chunk: int, topk: int) -> int:
    """Entries a payload of `numel` values sends: min(topk, length) per chunk."""
    whole, tail = chunk_sizes(numel, chunk)
    return whole * min(topk, chunk) + min(topk, tail)


def index_bits(chunk: int) -> int:
    """Bits of an index into a chunk: ceil(log2 chunk), at least 1."""
    return max(1, (chunk - 1).bit_length())


def payload_bytes(numel: int, chunk: int, topk: int, bits: int) -> int:
    """Bytes on the wire: fp32 scales, packed indices, packed levels."""
    whole, tail = chunk_sizes(numel, chunk)
    entries = sent_entries(numel, chunk, topk)
    return SCALE_BYTES * (whole + (tail > 0)) + -(-entries * index_bits(chunk) // 8) + -(-entries * bits // 8)


def _group_layout(width: int) -> tuple[int, list[tuple[int, int, int]]]:
    """How `pack_bits` lays out a group of g = 8 / gcd(width, 8) entries, the fewest that fill whole bytes
    (width * g / 8 of them): per entry j of the group, its first byte (j width // 8), its bit offset in that byte
    (j width % 8) and how many bytes it reaches into (at most 4 for width <= 20)."""
    group = 8 // math.gcd(width, 8)
    return group, [((j * width) // 8, (j * width) % 8, ((j * width) % 8 + width + 7) // 8) for j in range(group)]


def pack_bits(values: torch.Tensor, width: int) -> torch.Tensor:
    """Non-negative integers < 2^width as a little-endian bit stream of ceil(len * width / 8) bytes (uint8).

    Entry i occupies bits [i width, (i + 1) width) of the stream, bit j of a byte being its j-th. Built a group of
    entries at a time (`_group_layout`): each entry of a group, shifted to its offset, is OR-ed into the bytes it
    reaches, so the work is a few passes over the entries whatever the width (no per-bit intermediate); entries of
    8 bits are their own bytes.
    """
    if width == 8:
        return values.reshape(-1).to(torch.uint8)
    group, layout = _group_layout(width)
    count = values.numel()
    groups = -(-count // group)
    entries = torch.nn.functional.pad(values.reshape(-1).to(torch.int32), (0, groups * group - count))
    entries = entries.view(groups, group)
    out = torch.zeros(width * group // 8, groups, dtype=torch.int32)
    for j, (first, offset, reach) in enumerate(layout):
        shifted = entries[:, j] << offset
        for b in range(reach):
            out[first + b] |= (shifted >> (8 * b)) & 0xFF
    return out.t().reshape(-1)[: -(-count * width // 8)].to(torch.uint8)


def unpack_bits(data: torch.Tensor, count: int, width: int) -> torch.Tensor:
    """The `count` integers of `width` bits that `pack_bits` wrote into `data` (int64); ValueError if it is short."""
    need = -(-count * width // 8)
    if data.numel() < need:
        raise ValueError(f"a bit stream of {count} entries of {width} bits needs {need} bytes, got {data.numel()}")
    if width == 8:
        return data[:count].to(torch.int64)
    group, layout = _group_layout(width)
    groups = -(-count // group)
    stream = torch.nn.functional.pad(data[:need].to(torch.int64), (0, groups * width * group // 8 - need))
    columns = stream.view(groups, width * group // 8).t()
    out = torch.empty(groups, group, dtype=torch.int64)
    for j, (first, offset, reach) in enumerate(layout):
        word = columns[first].clone()
        for b in range(1, reach):
            word |= columns[first + b] << (8 * b)
        out[:, j] = (word >> offset) & ((1 << width) - 1)
    return out.reshape(-1)[:count]


@dataclass(frozen=True)
class SparsePayload:
    """One tensor's sparse delta as it travels: per chunk a scale, its sent entries' indices and levels."""

    name: str
    shape: Shape
    chunk: int
    topk: int
    bits: int
    scales: torch.Tensor
    """float32, one per chunk, each finite and >= 0."""
    indices: torch.Tensor
    """int64, the sent entries' positions within their chunk, strictly increasing within each chunk."""
    levels: torch.Tensor
    """int64 in [0, 2^bits), one per sent entry."""

    def __post_init__(self) -> None:
        numel = math.prod(self.shape)
        whole, tail = chunk_sizes(numel, self.chunk)
        entries = sent_entries(numel, self.chunk, self.topk)
        if tuple(self.scales.shape) != (whole + (tail > 0),) or self.scales.dtype != torch.float32:
            raise ValueError(f"tensor {self.name!r}: sparse payload needs {whole + (tail > 0)} float32 scales")
        if tuple(self.indices.shape) != (entries,) or tuple(self.levels.shape) != (entries,):
            raise ValueError(f"tensor {self.name!r}: sparse payload needs {entries} indices and levels")
        if self.scales.numel() and not bool((torch.isfinite(self.scales) & (self.scales >= 0)).all()):
            raise ValueError(f"tensor {self.name!r}: sparse payload has a negative, NaN or Inf scale")
        per = self._sent_rows[1]
        rows = [(self.indices[: whole * per].view(whole, per), self.chunk), (self.indices[whole * per :][None], tail)]
        if not all(_inside_and_increasing(r, limit) for r, limit in rows if r.numel()):
            raise ValueError(f"tensor {self.name!r}: sparse payload has an index outside its chunk or out of order")

    @functools.cached_property
    def _sent_rows(self) -> tuple[int, int]:
        """(whole chunks, entries each sends = min(topk, chunk)); the last, shorter chunk sends the rest."""
        return chunk_sizes(math.prod(self.shape), self.chunk)[0], min(self.topk, self.chunk)

    def per_entry(self, per_chunk: torch.Tensor) -> torch.Tensor:
        """A value of each chunk (its scale, its offset) repeated for every entry it sends."""
        whole, per = self._sent_rows
        body = per_chunk[:whole, None].expand(whole, per).reshape(-1)
        rest = self.indices.numel() - whole * per
        return torch.cat([body, per_chunk[whole:].expand(rest)]) if rest else body

    @functools.cached_property
    def positions(self) -> torch.Tensor:
        """Each sent entry's position in the flattened tensor: chunk * `chunk` + its index in the chunk."""
        return self.indices + self.per_entry(torch.arange(self.scales.numel()) * self.chunk)

    @property
    def codec(self) -> str:
        return NAME

    @property
    def num_bytes(self) -> int:
        return payload_bytes(math.prod(self.shape), self.chunk, self.topk, self.bits)

    def params(self) -> dict[str, int]:
        return {"chunk": self.chunk, "topk": self.topk, "bits": self.bits}

    def pack(self) -> torch.Tensor:
        """Scales (fp32, little-endian), then the index stream, then the level stream, as one uint8 tensor."""
        if sys.byteorder != "little":
            raise RuntimeError("the sparse codec needs a little-endian host (x86-64/aarch64)")
        parts = [
            self.scales.contiguous().view(torch.uint8),
            pack_bits(self.indices, index_bits(self.chunk)),
            pack_bits(self.levels, self.bits),
        ]
        return torch.cat(parts)


def _inside_and_increasing(rows: torch.Tensor, limit: int) -> bool:
    """Each row strictly increasing from at least 0 to below `limit`: every entry inside [0, limit), in order."""
    return bool((rows[:, 0] >= 0).all() and (rows[:, -1] < limit).all() and (rows[:, 1:] > rows[:, :-1]).all())


def _levels(bits: int) -> int:
    return 1 << bits


def _scale_and_levels(selected: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of `selected` (the sent values of each chunk): its scale and each value's nearest level."""
    magnitude = selected.abs()
    top = _levels(bits) - 1
    if bits == 1:
        scale = magnitude.mean(dim=1)
        return scale, (selected > 0).to(torch.int64)
    scale = magnitude.amax(dim=1)
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale))
    levels = torch.round((selected / divisor[:, None] * top + top) / 2).clamp_(0, top).to(torch.int64)
    return scale, levels


def _values(scale: torch.Tensor, levels: torch.Tensor, bits: int) -> torch.Tensor:
    """The values `levels` stand for, each with its own chunk's `scale` (`_scale_and_levels`' inverse, fp32)."""
    top = _levels(bits) - 1
    if bits == 1:
        return (2 * levels - 1).to(torch.float32) * scale
    return (2 * levels - top).to(torch.float32) * scale / top


def _rows(flat: torch.Tensor, chunk: int) -> list[torch.Tensor]:
    """The chunks of `flat` as views of rows x length: the whole chunks, then the last, shorter one."""
    whole, tail = chunk_sizes(flat.numel(), chunk)
    blocks = []
    if whole:
        blocks.append(flat[: whole * chunk].view(whole, chunk))
    if tail:
        blocks.append(flat[whole * chunk :].view(1, tail))
    return blocks


ROWS_PER_THREAD = 64
"""Fewest rows a thread of the selection takes (fewer and handing them over costs more than it saves)."""


@functools.cache
def _pool(threads: int, pid: int) -> ThreadPoolExecutor:
    """The selection threads of this process (`pid`): a forked child inherits the parent's pool without its
    threads, and work handed to it would wait forever."""
    return ThreadPoolExecutor(max_workers=threads, thread_name_prefix="spes-select")


def _by_rows(work: Callable[[np.ndarray], np.ndarray], rows: np.ndarray) -> torch.Tensor:
    """`work` of each row of `rows`, in blocks of rows on torch's intra-op threads (`torch.get_num_threads`, as
    every other op of the codec): numpy's selections and sorts run on one core, but without the GIL, and a row's
    result does not depend on the block it is in."""
    threads = max(1, min(torch.get_num_threads(), len(rows) // ROWS_PER_THREAD))
    if threads == 1:
        return torch.from_numpy(work(rows))
    step = -(-len(rows) // threads)
    return torch.from_numpy(
        np.concatenate(list(_pool(threads, os.getpid()).map(work, np.split(rows, range(step, len(rows), step)))))
    )


def _top(magnitudes: torch.Tensor, k: int) -> torch.Tensor:
    """Per row of `magnitudes` (rows x length, float32), the positions of its k largest entries in no particular
    order, NaN above every number. numpy's `argpartition` (introselect) is the selection: it costs half of
    `torch.topk`'s on CPU rows of a few hundred to a few thousand entries, where topk's per-row setup dominates."""
    keep = magnitudes.shape[1] - k
    return _by_rows(
        lambda rows: np.ascontiguousarray(np.argpartition(rows, keep, axis=1)[:, keep:]), magnitudes.numpy()
    )


def largest(values: torch.Tensor, k: int) -> torch.Tensor:
    """Per row of `values` (rows x length, float32 on the CPU), the positions of its k entries of largest
    magnitude, in increasing order; NaN ranks above every number, as in `torch.topk`.

    Two small selections instead of one over the whole row where that is cheaper (a row 16 or more times longer than
    k): cut into groups of g, a row's k largest entries all lie in the k groups of largest maxima (an entry of any
    other group is below k group maxima, k distinct entries), so they are the k largest of those k g entries. The
    work goes from the row's length to length / g + k g entries, least at g = sqrt(length / k). Group i holds the
    entries i, i + s, ..., i + (g - 1) s of stride s = length / g, so its largest magnitude is max(max, -min) of
    elementwise maxima and minima of g contiguous slices, and no magnitude of the whole row is made. The same
    entries as `torch.topk` of the magnitudes, up to which of several equal entries is taken.
    """
    rows, length = values.shape
    group = 1 << (max(0, (length // k).bit_length() - 1) // 2)  # NOTE: a power of two, at most sqrt(length / k)
    if length < 16 * k or length % group:
        return _increasing(_top(values.abs(), k))
    stride = length // group
    groups = values.view(rows, group, stride)
    peaks = torch.maximum(groups.amax(dim=1), groups.amin(dim=1).neg_())  # NOTE: NaN propagates through both
    best = _top(peaks, k)
    candidates = groups.gather(2, best[:, None, :].expand(rows, group, k)).reshape(rows, group * k).abs_()
    picked = _top(candidates, k)
    return _increasing(best.gather(1, picked % k) + picked // k * stride)


def _increasing(positions: torch.Tensor) -> torch.Tensor:
    """Each row sorted (numpy's sort: a tenth of `torch.sort`'s time on many short CPU rows)."""
    return _by_rows(lambda rows: np.sort(rows, axis=1), positions.numpy())


def quantize(name: str, x: torch.Tensor, chunk: int, topk: int, bits: int) -> SparsePayload:
    """The sparse payload of `x` (any float dtype, computed in fp32); ValueError naming `name` on NaN or Inf."""
    if not x.is_floating_point():
        raise ValueError(f"tensor {name!r}: cannot quantize dtype {x.dtype}, a floating-point delta is needed")
    flat = x.detach().reshape(-1).float()
    scales, indices, levels = [], [], []
    for rows in _rows(flat, chunk):
        picked = largest(rows, min(topk, rows.shape[1]))
        selected = rows.gather(1, picked)
        # NOTE: NaN ranks above every number, and Inf above the rest: a chunk holding either sends it
        if not bool(torch.isfinite(selected).all()):
            raise ValueError(
                f"tensor {name!r} holds NaN or Inf values: this peer's training diverged or its carried error is "
                "corrupt"
            )
        scale, level = _scale_and_levels(selected, bits)
        scales.append(scale)
        indices.append(picked.reshape(-1))
        levels.append(level.reshape(-1))
    empty = torch.zeros(0, dtype=torch.int64)
    return SparsePayload(
        name,
        tuple(x.shape),
        chunk,
        topk,
        bits,
        torch.cat(scales) if scales else torch.zeros(0),
        torch.cat(indices) if indices else empty,
        torch.cat(levels) if levels else empty,
    )


def scattered(payload: SparsePayload) -> Scattered:
    """The delta a payload stands for as its sent entries: each one's level value at its position."""
    scale = payload.per_entry(payload.scales)
    return Scattered(payload.positions, _values(scale, payload.levels, payload.bits))


def dequantize(payload: SparsePayload) -> torch.Tensor:
    """The dense fp32 delta a payload stands for: each sent entry's level value at its index, zeros elsewhere."""
    sent = scattered(payload)
    out = torch.zeros(math.prod(payload.shape), dtype=torch.float32)
    return out.index_copy_(0, sent.positions, sent.values).view(payload.shape)


@dataclass(frozen=True)
class Sparse:
    """The sparse quantizer of one run (`spes_config.codec_settings`), as `spes.sync.codecs.base.Quantizer`.

    Peers send `topk` entries of `bits` bits per chunk; the server sends what the round changed in its own, wider
    format (`down`): an averaged tensor's change is the mean of up to num_peers sparse uploads, whose entries fall
    in different places, and re-encoding it as narrowly as one upload would sparsify it a second time.
    """

    chunk: int = 4096
    """Values per chunk (each has one scale and sends its top `topk`)."""
    topk: int = 64
    """Entries a peer sends per chunk."""
    bits: int = 2
    """Bits per value a peer sends."""
    down_topk: int = 256
    """Entries the server sends per chunk, at most all of it (a block relayed from its owner travels as uploaded)."""
    down_bits: int = 8
    """Bits per value the server sends."""
    name: str = NAME

    def __post_init__(self) -> None:
        if not 2 <= self.chunk <= MAX_CHUNK:
            raise ValueError(
                f"config key 'spes_config.codec_settings.chunk' = {self.chunk} must be in [2, {MAX_CHUNK}]"
            )
        if not 1 <= self.topk <= self.chunk:
            raise ValueError(
                f"config key 'spes_config.codec_settings.topk' = {self.topk} must be in [1, chunk={self.chunk}]"
            )
        if self.down_topk < 1:
            raise ValueError(f"config key 'spes_config.codec_settings.down_topk' = {self.down_topk} must be >= 1")
        for key, bits in (("bits", self.bits), ("down_bits", self.down_bits)):
            if not 1 <= bits <= MAX_BITS:
                raise ValueError(f"config key 'spes_config.codec_settings.{key}' = {bits} must be in [1, {MAX_BITS}]")

    @property
    def down(self) -> Sparse:
        """The server's format (`down_topk` capped at the chunk)."""
        topk = min(self.down_topk, self.chunk)
        return Sparse(self.chunk, topk, self.down_bits, topk, self.down_bits)

    def params(self) -> dict[str, int]:
        return {"chunk": self.chunk, "topk": self.topk, "bits": self.bits}

    def _read(self, params: Mapping[str, int]) -> tuple[int, int]:
        """(topk, bits) of a payload header's parameters: the peers' format or the server's, nothing else."""
        for topk, bits in ((self.topk, self.bits), (min(self.down_topk, self.chunk), self.down_bits)):
            if dict(params) == {"chunk": self.chunk, "topk": topk, "bits": bits}:
                return topk, bits
        raise ValueError(
            f"sparse parameters {dict(params)}, this run's are {self.params()} (peers) and {self.down.params()} "
            "(server)"
        )

    def encode(self, name: str, x: torch.Tensor) -> SparsePayload:
        return quantize(name, x, self.chunk, self.topk, self.bits)

    def decode(self, payload: Payload) -> torch.Tensor:
        assert isinstance(payload, SparsePayload)
        return dequantize(payload)

    def delta(self, payload: Payload) -> Scattered:
        assert isinstance(payload, SparsePayload)
        return scattered(payload)

    def round_bytes(self, numel: int) -> int:
        return payload_bytes(numel, self.chunk, self.topk, self.bits)

    def payload_bytes(self, shape: Shape, params: Mapping[str, int]) -> int:
        return payload_bytes(math.prod(shape), self.chunk, *self._read(params))

    def unpack(self, name: str, shape: Shape, params: Mapping[str, int], data: torch.Tensor) -> SparsePayload:
        topk, bits = self._read(params)
        numel = math.prod(shape)
        whole, tail = chunk_sizes(numel, self.chunk)
        chunks, entries = whole + (tail > 0), sent_entries(numel, self.chunk, topk)
        index_end = SCALE_BYTES * chunks + -(-entries * index_bits(self.chunk) // 8)
        scales = data[: SCALE_BYTES * chunks].clone().view(torch.float32)
        indices = unpack_bits(data[SCALE_BYTES * chunks : index_end], entries, index_bits(self.chunk))
        levels = unpack_bits(data[index_end:], entries, bits)
        return SparsePayload(name, shape, self.chunk, topk, bits, scales, indices, levels)
