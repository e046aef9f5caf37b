"""Building one completed round from its uploads: the round math (`spes.sync.merge`) over the run spec, then what
the codec serves, checked before anything is published.

A pure function of its inputs (the buffers it consumes aside), called on the server's aggregation thread:

    done = build_round(step, uploads, relayed, fragment, previous, spec, codec, empty)

A fragment's round (`spes.sync.fragments`) covers its own tensors and carries every other one over from the
previous round. No non-finite value is ever published: a global tensor that is NaN or Inf after the mean, the
outer step or the merge warm-up (fp32 overflow of large uploads, say) refuses the round naming it, and the caller
keeps the previous round.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from spes.sync.codecs.base import Payload
from spes.sync.codecs.interface import ServerCodec
from spes.sync.merge import build_global
from spes.sync.protocol import Shape, Tensors
from spes.sync.rounds import Completed
from spes.sync.spec import RunSpec
from spes.sync.wire import finite


class NonFiniteRound(ValueError):
    """The round's aggregate holds NaN or Inf: nothing is published."""


def build_round(
    step: int,
    uploads: dict[int, Tensors],
    relayed: Mapping[str, Payload],
    fragment: int,
    previous: Completed | None,
    spec: RunSpec,
    codec: ServerCodec,
    empty: Callable[[Shape, torch.dtype], torch.Tensor] | None = None,
) -> Completed:
    """Round `step` over `fragment` from `uploads` (peer -> name -> tensor, consumed), after `previous`.

    `relayed`: the codec's payloads of blocks taken verbatim (relayed unless a merge changes them). Raises
    `NonFiniteRound` naming the first non-finite tensor, ValueError for an upload that does not fit.
    """
    assert spec.manifest is not None
    layout, manifest = spec.layout, spec.manifest
    prev_global = previous.global_model if previous else {}
    prev_momentum = previous.momentum if previous else {}
    names = layout.names(fragment, manifest)
    merge_at, mergeable = layout.merged_names(step, fragment, manifest)
    peers = frozenset(uploads)
    built = build_global(
        uploads,
        spec=spec,
        step=merge_at,
        mergeable=mergeable,
        names=names,
        previous=prev_global,
        momentum=prev_momentum,
        consume=True,
        empty=empty,
    )
    for name, tensor in built.tensors.items():
        if not finite(tensor):
            raise NonFiniteRound(
                f"round {step}: the aggregate of tensor {name!r} holds NaN or Inf (the peers' uploads were finite: "
                "their mean, the outer step or the merge overflowed fp32); the round is refused and the global model "
                "stays at the previous round"
            )
    carried = {**prev_global, **built.tensors}  # NOTE: a fragment's round leaves the other tensors as they were
    global_model = {n: carried[n] for n in manifest if n in carried}
    served = codec.serve(
        step, global_model, previous.served if previous else None, names, relayed if built.alpha == 0 else {}
    )
    momentum = {**prev_momentum, **built.momentum}
    return Completed(step, peers, fragment, built.alpha, global_model, momentum, served)
