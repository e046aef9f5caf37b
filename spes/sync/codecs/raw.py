"""Raw codecs: values travel as they are, in fp32 or bf16 (`spes_config.codec: fp32 | bf16`).

Stateless: a peer uploads what it trained in the wire dtype, the server aggregates (a bf16 mean is summed in fp32,
`spes.sync.merge`) and serves its fp32 global model cast to the wire dtype, and each peer loads what it downloads.
bf16 rounds every value at every round with no error feedback (docs/differences.md).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import torch

from spes.sync.codecs.base import NO_BASE, Payload
from spes.sync.codecs.interface import Selection, Served, UploadBase
from spes.sync.proto import spes_pb2 as pb
from spes.sync.protocol import Shape, Tensors
from spes.sync.wire import DIVERGED, NOT_PUBLISHED, RAW_DTYPES, Item, TensorDecoder, upload_digest


class RawPeer:
    """A peer's end (`spes.sync.codecs.base.PeerCodec`): nothing kept between rounds."""

    def __init__(self, dtype: str) -> None:
        if dtype not in RAW_DTYPES:
            raise ValueError(f"raw codec dtype {dtype!r}: use one of {sorted(RAW_DTYPES)}")
        self.raw_dtype = dtype

    @property
    def base_round(self) -> int:
        return NO_BASE

    def upload(self, trained: Mapping[str, torch.Tensor], own: Collection[str]) -> dict[str, Item]:
        return dict(trained)

    def digest(self, trained: Mapping[str, torch.Tensor]) -> int:
        """Of the values in fp32, as trained (a view of fp32 parameters), not of their wire bytes: a bf16 digest
        converted the whole upload an extra time before its first byte could go (0.33 s a peer for bench_sync's
        model; its bf16 round's median went from 0.90 to 0.76 s without it). Equal values still give equal
        digests, which is all the server compares."""
        return upload_digest(trained, "fp32")

    def decoder(self, expected: Mapping[str, Shape], into: dict[str, torch.Tensor] | None) -> TensorDecoder:
        return TensorDecoder(expected, self.raw_dtype, into=into, non_finite=NOT_PUBLISHED)

    def whole(self, info: pb.RoundInfo) -> bool:
        return False

    def receive(
        self, info: pb.RoundInfo, decoder: TensorDecoder, *, caught_up: bool, serves: Collection[str] | None = None
    ) -> Tensors:
        return decoder.finish()

    def forget(self) -> bool:
        return False

    def state_dict(self) -> tuple[dict[str, str], Tensors]:
        return {}, {}

    def load_state_dict(self, metadata: Mapping[str, str], tensors: Tensors) -> None:
        if metadata or tensors:
            raise ValueError(f"codec state of {metadata.get('codec')!r}, this run's codec is {self.raw_dtype!r}")


class RawServer:
    """The server's end (`spes.sync.codecs.base.ServerCodec`): the global model is what every peer downloads."""

    def __init__(self, dtype: str) -> None:
        if dtype not in RAW_DTYPES:
            raise ValueError(f"raw codec dtype {dtype!r}: use one of {sorted(RAW_DTYPES)}")
        self.raw_dtype = dtype

    def upload_decoder(
        self, expected: Mapping[str, Shape], into: dict[str, torch.Tensor], base: UploadBase
    ) -> TensorDecoder:
        return TensorDecoder(expected, self.raw_dtype, into=into, non_finite=DIVERGED)

    def upload_values(
        self, decoder: TensorDecoder, raw: Tensors, base: UploadBase
    ) -> tuple[Tensors, dict[str, Payload]]:
        return raw, {}

    def serve(
        self,
        step: int,
        global_model: Tensors,
        previous: Served | None,
        names: Collection[str],
        relayed: Mapping[str, Payload],
    ) -> Served:
        return Served(step, global_model)

    def select(self, served: Served, *, full: bool, base_round: int) -> Selection:
        return Selection(served.tensors, "raw", whole=full)

    def persisted(self, served: Served) -> Tensors:
        return {}

    def restore(self, step: int, global_model: Tensors, persisted: Tensors) -> Served:
        return Served(step, global_model)
