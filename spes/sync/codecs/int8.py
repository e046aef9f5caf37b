"""Blockwise int8 quantization of deltas: the `int8` codec's quantizer (`spes_config.codec: int8`).

The flattened delta is cut into blocks of `block` values (the last one may be shorter), each block has one fp32
scale `absmax / 127`, and each value becomes `round(x / scale)` in [-127, 127] (round half to even). The receiver
multiplies back (`dequantize`). Both ends then add the result to the held model the same way
(`spes.sync.codecs.held.apply_delta`), so they hold the same reconstruction bit for bit; error feedback there
carries what quantization lost into the next round.

Why fp32 scales and not bf16: a bf16 scale would save 2 bytes per block (0.8% of the payload at `block` 256,
0.2% at 1024) and change the error little, but the scale would no longer be exactly `absmax / 127` and both ends
would need one more rounding rule to agree on. With fp32 scales the bound is plain (|error| <= scale / 2 up to
fp32 rounding) and a payload is `n + 4 * ceil(n / block)` bytes: for `n` a multiple of `block`,
`(1 + 4 / block) / 4 = 1/4 + 1/block` of the fp32 bytes (0.2539 at 256, 0.2510 at 1024).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from spes.sync.codecs.base import Payload
from spes.sync.protocol import Shape

NAME = "int8"
QMAX = 127
"""Largest quantized magnitude: symmetric, so -128 is never produced."""
DEFAULT_BLOCK = 256
"""Values per scale: 1.6% of the payload for scales, and one outlier coarsens only its own 256 values."""
MIN_BLOCK = 128
"""Smallest block: below it the scales' bytes break the round's 0.16x byte target (docs/benchmarks.md 2b)."""
MAX_BLOCK = 1 << 16
"""Largest block (one outlier would coarsen the step of that many values)."""
SCALE_BYTES = 4
_CHUNK_ELEMS = 1 << 20
"""Quantize this many values at a time, so a large tensor never has several fp32 copies alive at once."""


def num_blocks(numel: int, block: int) -> int:
    """Scales of a tensor of `numel` values: ceil(numel / block)."""
    if block < 1:
        raise ValueError(f"int8 block size must be >= 1, got {block}")
    return -(-numel // block)


def payload_bytes(numel: int, block: int) -> int:
    """Bytes of a quantized tensor on the wire: `numel` int8 values and ceil(numel / block) fp32 scales."""
    return numel + SCALE_BYTES * num_blocks(numel, block)


def fp32_ratio(numel: int, block: int) -> float:
    """Quantized bytes over the tensor's fp32 bytes; exactly 1/4 + 1/block when `block` divides `numel`."""
    if numel < 1:
        raise ValueError(f"the fp32 ratio needs at least one value, got numel={numel}")
    return payload_bytes(numel, block) / (4 * numel)


@dataclass(frozen=True)
class Int8Payload:
    """One tensor's quantized delta, as it travels: int8 values and one fp32 scale per block."""

    name: str
    shape: Shape
    block: int
    values: torch.Tensor
    """int8, flat, one per element of `shape`."""
    scales: torch.Tensor
    """float32, flat, ceil(numel / block) of them, each finite and >= 0."""

    def __post_init__(self) -> None:
        numel = math.prod(self.shape)
        if self.values.dtype != torch.int8 or tuple(self.values.shape) != (numel,):
            raise ValueError(
                f"tensor {self.name!r}: int8 payload needs {numel} int8 values for shape {list(self.shape)}, "
                f"got {self.values.dtype} of shape {list(self.values.shape)}"
            )
        want = num_blocks(numel, self.block)
        if self.scales.dtype != torch.float32 or tuple(self.scales.shape) != (want,):
            raise ValueError(
                f"tensor {self.name!r}: int8 payload needs {want} float32 scales (block {self.block}), "
                f"got {self.scales.dtype} of shape {list(self.scales.shape)}"
            )
        if want and not bool((torch.isfinite(self.scales) & (self.scales >= 0)).all()):
            raise ValueError(f"tensor {self.name!r}: int8 payload has a negative, NaN or Inf scale")

    @property
    def codec(self) -> str:
        return NAME

    @property
    def num_bytes(self) -> int:
        """Bytes on the wire (values and scales; framing aside)."""
        return payload_bytes(self.values.numel(), self.block)

    def params(self) -> dict[str, int]:
        return {"block": self.block}

    def pack(self) -> torch.Tensor:
        """The wire bytes: the values, then the fp32 scales (little-endian), as one uint8 tensor."""
        if sys.byteorder != "little":
            raise RuntimeError("the int8 codec needs a little-endian host (x86-64/aarch64)")
        numel = self.values.numel()
        packed = torch.empty(self.num_bytes, dtype=torch.uint8)
        packed[:numel] = self.values.view(torch.uint8)
        packed[numel:] = self.scales.contiguous().view(torch.uint8)
        return packed


def quantize(name: str, x: torch.Tensor, block: int = DEFAULT_BLOCK) -> Int8Payload:
    """Blockwise symmetric int8 of `x` (any float dtype, computed in fp32): scale = absmax / 127 per block.

    A block of zeros gets scale 0 and values 0. Raises ValueError naming `name` when `x` holds NaN or Inf.
    """
    if not x.is_floating_point():
        raise ValueError(f"tensor {name!r}: cannot quantize dtype {x.dtype}, a floating-point delta is needed")
    flat = x.detach().reshape(-1)
    numel = flat.numel()
    values = torch.empty(numel, dtype=torch.int8, device=flat.device)
    scales = torch.empty(num_blocks(numel, block), dtype=torch.float32, device=flat.device)
    chunk = max(block, _CHUNK_ELEMS // block * block)  # whole blocks, so chunks quantize independently
    for start in range(0, numel, chunk):
        part = flat[start : start + chunk].float()
        rows = num_blocks(part.numel(), block)
        padded = torch.nn.functional.pad(part, (0, rows * block - part.numel())).view(rows, block)
        absmax = padded.abs().amax(dim=1)
        if not bool(torch.isfinite(absmax).all()):
            first = start // block + int((~torch.isfinite(absmax)).nonzero()[0])
            raise ValueError(
                f"tensor {name!r} holds NaN or Inf values (first in block {first} of {scales.numel()}): "
                "this peer's training diverged or its carried error is corrupt"
            )
        scale = absmax / QMAX
        divisor = torch.where(scale > 0, scale, torch.ones_like(scale))  # zero blocks: 0 / 1 = 0
        q = torch.round(padded / divisor[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
        values[start : start + part.numel()] = q.view(-1)[: part.numel()]
        scales[start // block : start // block + rows] = scale
    return Int8Payload(name, tuple(x.shape), block, values, scales)


def dequantize(payload: Int8Payload) -> torch.Tensor:
    """The fp32 delta a payload stands for: value * its block's scale, one rounding per element.

    Computed block-shaped in the one output tensor (no per-value copy of the scales): a large delta costs one fp32
    copy of itself, not three.
    """
    values, scales, block = payload.values, payload.scales, payload.block
    out = torch.empty(values.numel(), dtype=torch.float32, device=values.device)
    whole = values.numel() // block * block
    out[:whole].view(-1, block).copy_(values[:whole].view(-1, block)).mul_(scales[: whole // block, None])
    if whole < values.numel():  # the last, shorter block
        out[whole:].copy_(values[whole:]).mul_(scales[-1])
    return out.view(payload.shape)


@dataclass(frozen=True)
class Int8:
    """The int8 quantizer of one run (`spes_config.codec_settings.block`), as `spes.sync.codecs.base.Quantizer`."""

    block: int = DEFAULT_BLOCK
    name: str = NAME

    def __post_init__(self) -> None:
        if not MIN_BLOCK <= self.block <= MAX_BLOCK:
            raise ValueError(
                f"config key 'spes_config.codec_settings.block' = {self.block} must be in [{MIN_BLOCK}, {MAX_BLOCK}]"
            )

    @property
    def down(self) -> Int8:
        """The server's deltas: the same format."""
        return self

    def encode(self, name: str, x: torch.Tensor) -> Int8Payload:
        return quantize(name, x, self.block)

    def decode(self, payload: Payload) -> torch.Tensor:
        assert isinstance(payload, Int8Payload)
        return dequantize(payload)

    def delta(self, payload: Payload) -> torch.Tensor:
        return self.decode(payload)

    def round_bytes(self, numel: int) -> int:
        return payload_bytes(numel, self.block)

    def payload_bytes(self, shape: Shape, params: Mapping[str, int]) -> int:
        if dict(params) != {"block": self.block}:
            raise ValueError(f"int8 parameters {dict(params)}, this run's are {{'block': {self.block}}}")
        return payload_bytes(math.prod(shape), self.block)

    def unpack(self, name: str, shape: Shape, params: Mapping[str, int], data: torch.Tensor) -> Int8Payload:
        numel = math.prod(shape)
        scales = data[numel:].clone().view(torch.float32)  # NOTE: a copy, so the fp32 view starts aligned
        return Int8Payload(name, shape, self.block, data[:numel].view(torch.int8), scales)
