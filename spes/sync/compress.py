"""The pure math of compressed deltas on the wire (`spes_config.wire_dtype: int8`).

A peer and the server send what changed since a model both sides hold (the base), quantized blockwise to
int8: the flattened delta is cut into blocks of `block` values (the last one may be shorter), each block has
one fp32 scale `absmax / 127`, and each value becomes `round(x / scale)` in [-127, 127] (round half to even).
The receiver multiplies back (`dequantize`) and adds the result to its base (`apply_delta`). The sender
calls the very same `apply_delta` (`encode_delta`), so both ends hold the same reconstruction bit for bit.

Error feedback: what quantization lost of one delta (`target - dequantize(payload)`) is carried and added to
the next delta of the same tensor, so over many rounds the reconstructed deltas sum to the true ones up to
the last carried error (at most half a step per value), instead of drifting.

    sent = encode_delta("w", theta, base, carried)  # sender: payload, carried error, its reconstruction
    held = apply_delta(base, sent.payload)          # receiver: bit-identical to sent.reconstruction

In a round (docs/sync_next.md), the server keeps its full-precision global model G and the model H that every
up-to-date peer holds (G itself on a lossless wire). Peers upload `encode_deltas(theta, H, carried)`; the
server turns each upload into values (`upload_values`), aggregates them as on any other wire, and sends
`download_payloads(G_new, H)`; every peer applies them to its H and loads the result.

Why fp32 scales and not bf16: a bf16 scale would save 2 bytes per block (0.8% of the payload at `block` 256,
0.2% at 1024) and change the error little (its rounding moves a block's step by at most 0.2%), but the scale
would no longer be exactly `absmax / 127` and both ends would need one more rounding rule to agree on. With fp32
scales the bound is plain (|error| <= scale / 2 up to fp32 rounding), the round-level byte target holds from
`block` 128 on (docs/sync_next.md), and a payload is `n + 4 * ceil(n / block)` bytes: for `n` a multiple of
`block`, `(1 + 4 / block) / 4 = 1/4 + 1/block` of the fp32 bytes (0.2539 at 256, 0.2510 at 1024).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import torch

from spes.sync.protocol import Shape, Tensors

QMAX = 127
"""Largest quantized magnitude: symmetric, so -128 is never produced."""
DEFAULT_BLOCK = 256
"""Values per scale: 1.6% of the payload for scales, and one outlier coarsens only its own 256 values."""
MIN_BLOCK = 128
"""Smallest block a receiver accepts: below it the scales' bytes break the round's 0.16x byte target."""
MAX_BLOCK = 1 << 16
"""Largest block a receiver accepts (one outlier would coarsen the step of that many values)."""
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
    def num_bytes(self) -> int:
        """Bytes on the wire (values and scales; framing aside)."""
        return payload_bytes(self.values.numel(), self.block)


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


def apply_delta(base: torch.Tensor, payload: Int8Payload) -> torch.Tensor:
    """What a receiver holding `base` reconstructs: base + dequantize(payload), in fp32, cast to base's dtype.

    Sender and receiver must both call this (not a fused or reordered form of it) to agree bit for bit:
    an elementwise multiply then add is exactly rounded on any device, a fused multiply-add is not the same.
    """
    if tuple(base.shape) != payload.shape:
        raise ValueError(
            f"tensor {payload.name!r}: delta of shape {list(payload.shape)} against a base of shape {list(base.shape)}"
        )
    return _plus(base, dequantize(payload))


def _plus(base: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """base + delta in fp32 (summed into `delta`, which it consumes), cast to base's dtype."""
    return delta.to(base.device).add_(base.float()).to(base.dtype)


@dataclass(frozen=True)
class EncodedDelta:
    """What `encode_delta` returns: the payload to send and what both ends make of it."""

    payload: Int8Payload
    error: torch.Tensor
    """The carried error for the next delta of this tensor: target - dequantize(payload), fp32."""
    reconstruction: torch.Tensor
    """`apply_delta(base, payload)`: what the receiver will hold, bit for bit."""


def encode_delta(
    name: str,
    value: torch.Tensor,
    base: torch.Tensor,
    carried: torch.Tensor | None = None,
    block: int = DEFAULT_BLOCK,
) -> EncodedDelta:
    """Quantize `value - base + carried` with error feedback (`carried` None: no error carried yet).

    The new error is measured on the delta (what the receiver's `dequantize` misses), so the sum of
    reconstructed deltas over rounds equals the sum of true deltas plus the first carried error minus the
    last one: the drift stays within half a quantization step per value, whatever the number of rounds.
    """
    for what, tensor in (("base", base), ("carried error", carried)):
        if tensor is not None and tuple(tensor.shape) != tuple(value.shape):
            raise ValueError(f"tensor {name!r}: shape {list(value.shape)}, its {what} has shape {list(tensor.shape)}")
    target = value.float() - base.float().to(value.device)
    if carried is not None:
        target += carried.to(value.device)
    payload = quantize(name, target, block)
    delta = dequantize(payload)
    error = target.sub_(delta)  # NOTE: in place, as every step below: a large tensor is held at most twice more
    return EncodedDelta(payload, error, _plus(base, delta))


def encode_deltas(
    values: Mapping[str, torch.Tensor],
    bases: Mapping[str, torch.Tensor],
    carried: Mapping[str, torch.Tensor],
    block: int = DEFAULT_BLOCK,
) -> dict[str, EncodedDelta]:
    """`encode_delta` for every tensor of `values` (a name missing from `carried` carries no error yet)."""
    missing = sorted(set(values) - set(bases))
    if missing:
        raise ValueError(f"no base for tensor(s) {missing}: a peer without the base gets full values, not deltas")
    return {n: encode_delta(n, v, bases[n], carried.get(n), block) for n, v in values.items()}


def upload_values(
    payloads: Mapping[str, Int8Payload],
    global_model: Mapping[str, torch.Tensor],
    held: Mapping[str, torch.Tensor],
    verbatim: Collection[str],
) -> Tensors:
    """What the server counts as a peer's upload, from its payloads (deltas against the held model H).

    A tensor taken verbatim from this peer (its own expert blocks in SPES): apply_delta(H, q), the value the
    peer itself reconstructs, so the server can relay the payload to the others unchanged. An averaged
    tensor: apply_delta(G, q), the peer's progress applied to the full-precision global G, so what the last
    download's quantization left out (G - H) stays in the model instead of being lost every round.
    """
    return {
        name: apply_delta((held if name in verbatim else global_model)[name], payload)
        for name, payload in payloads.items()
    }


def download_payloads(
    new_global: Mapping[str, torch.Tensor],
    held: Mapping[str, torch.Tensor],
    relayed: Mapping[str, Int8Payload],
    block: int = DEFAULT_BLOCK,
) -> tuple[dict[str, Int8Payload], Tensors]:
    """The payloads every peer holding `held` downloads, and the held model they all reconstruct from them.

    `relayed` holds the uploaded payloads of tensors taken verbatim in this round (no merge changed them):
    their new global already is apply_delta(held, payload) (`upload_values`), so the payload is sent on as it
    came and nothing is quantized twice. Every other tensor is quantized as new_global - held, with no carried
    error: the next round's delta is measured against what the peers then hold, which feeds the error back.
    """
    payloads: dict[str, Int8Payload] = {}
    new_held: Tensors = {}
    for name, value in new_global.items():
        if name in relayed:
            payloads[name], new_held[name] = relayed[name], value
        else:
            sent = encode_delta(name, value, held[name], None, block)
            payloads[name], new_held[name] = sent.payload, sent.reconstruction
    return payloads, new_held
