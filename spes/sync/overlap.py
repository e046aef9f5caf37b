"""The pure math of an overlapped round (`spes_config.overlap_sync`): training goes on while a round is in flight.

At a sync step the node snapshots what it trains, uploads the snapshot and keeps training. When the global
model of that round arrives (at the latest `sync_steps` steps later, before the next snapshot), the node
applies it together with the progress it made since the snapshot (`apply_overlapped`). A checkpoint taken
while the round is in flight holds the snapshot and the round's identity (`PendingRound`, saved with
safetensors), so a resumed node applies the same round to the same snapshot.

    pending = PendingRound.take(step=step, round_id=step, params={n: params[n] for n in trained})
    ...                                                   # upload pending.snapshot, keep training
    params.update(apply_overlapped(global_model, params, pending.snapshot))

Nothing here does I/O except `PendingRound.save`/`load`; the trainer and the sync client call these functions.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from spes.atomic import write_atomic
from spes.sync.protocol import Shape, Tensors

PENDING_FORMAT = "1"
"""Version of the pending-round file; a file of another version is refused by name."""


def apply_overlapped(
    global_model: Mapping[str, torch.Tensor],
    now: Mapping[str, torch.Tensor],
    snapshot: Mapping[str, torch.Tensor],
    correction: float = 1.0,
) -> Tensors:
    """The node's new values once the global model of an in-flight round arrives.

    For every tensor this node trains (the names of `snapshot`, taken when the round was uploaded), with c the
    `correction` (`spes_config.overlap_correction`):

        theta <- theta_now + c * (global - theta_snapshot)      (c = 1: global + (theta_now - theta_snapshot))

    and for every other tensor of `global_model` (frozen here, so it did not move locally): theta <- global.
    Why c < 1 helps at long delays: the correction is the node's disagreement with the mean *at the snapshot*;
    training since has already shrunk part of it, so applying all of it late overshoots to the other side, and
    nodes swing around the mean instead of meeting on it. With the server's plain mean over the peers the
    corrections sum to zero, so c leaves the mean of the nodes untouched and only damps their disagreement.
    A trained name missing from `global_model` is one the server took verbatim from this node's upload
    (its own expert blocks on a round without merging, see `merge.download_names`): its global value is the
    snapshot itself, so it keeps theta_now.

    Results have the dtype and device of `now` (the node's parameters); `global_model` may be narrower (the
    wire dtype) and is widened as loading it would. With theta_now == theta_snapshot (no step taken since
    the snapshot) the result is the global model bit for bit, as in a blocking round. Returns new tensors
    for the names of `global_model` and `snapshot`; the inputs are not modified.
    """
    for name in snapshot:
        if name not in now:
            raise ValueError(f"tensor {name!r} is in the round's snapshot but not among the node's parameters")
    result: Tensors = {}
    for name, glob in global_model.items():
        if name not in now:
            raise ValueError(f"tensor {name!r} is in the global model but not among the node's parameters")
        current = now[name]
        _check_pair(name, "global model", glob, current, same_dtype=False)
        widened = glob.to(device=current.device, dtype=current.dtype)
        if name not in snapshot:
            result[name] = widened.clone() if widened is glob else widened
            continue
        snap = snapshot[name]
        _check_pair(name, "snapshot", snap, current, same_dtype=True)
        if correction == 1.0:
            # NOTE: global - (snap - now), not global + (now - snap): equal in value, but snap - now is +0.0
            # where nothing moved and x - (+0.0) == x for every x, -0.0 included, so a zero delay is bit-exact.
            result[name] = widened - (snap.to(current.device) - current)
        else:
            result[name] = current + correction * (widened - snap.to(current.device))
    for name in snapshot:
        if name not in global_model:
            result[name] = now[name].clone()
    return result


def _check_pair(name: str, what: str, tensor: torch.Tensor, current: torch.Tensor, *, same_dtype: bool) -> None:
    """`tensor` (from `what`) fits the parameter `current` of the same name: shape, and dtype when asked."""
    if tuple(tensor.shape) != tuple(current.shape):
        raise ValueError(
            f"tensor {name!r}: shape {list(tensor.shape)} in the {what}, the node's parameter has {list(current.shape)}"
        )
    if same_dtype and tensor.dtype != current.dtype:
        raise ValueError(
            f"tensor {name!r}: dtype {tensor.dtype} in the {what}, the node's parameter has {current.dtype} "
            "(the snapshot must be an exact copy)"
        )
    if not tensor.is_floating_point():
        raise ValueError(f"tensor {name!r}: dtype {tensor.dtype} in the {what} is not a floating-point dtype")


@dataclass(frozen=True, kw_only=True)
class PendingRound:
    """A round uploaded but not yet applied: the snapshot it was built from and which round it is."""

    round_id: int
    """The server's round (the sync step the peers uploaded at)."""
    step: int
    """The node's optimizer step when the snapshot was taken."""
    snapshot: Tensors
    """An exact copy of every tensor this node trains, as uploaded."""

    def __post_init__(self) -> None:
        if self.round_id < 0 or self.step < 0:
            raise ValueError(f"a pending round needs round_id and step >= 0, got {self.round_id} and {self.step}")

    @classmethod
    def take(cls, *, round_id: int, step: int, params: Mapping[str, torch.Tensor]) -> PendingRound:
        """Snapshot `params` (copied: training goes on modifying the originals) for round `round_id`."""
        return cls(round_id=round_id, step=step, snapshot={n: t.detach().clone() for n, t in params.items()})

    def due(self, sync_steps: int) -> int:
        """The last step at which the round may be applied: before the next round's snapshot is taken."""
        return self.step + sync_steps

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the round atomically as safetensors (ids in the header metadata; never pickled)."""
        metadata = {"format": PENDING_FORMAT, "round_id": str(self.round_id), "step": str(self.step)}
        tensors = {n: t.detach().to("cpu").contiguous() for n, t in self.snapshot.items()}
        write_atomic(path, lambda tmp: save_file(tensors, tmp, metadata=metadata))

    @classmethod
    def load(cls, path: str | os.PathLike[str], manifest: Mapping[str, Shape] | None = None) -> PendingRound:
        """Read a round written by `save`; with `manifest` (name -> shape), every tensor must fit it.

        Raises FileNotFoundError or ValueError naming the file (and the tensor or key) when it is missing,
        not a pending-round file, or does not fit this model.
        """
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"pending round {path}: file not found")
        try:
            with safe_open(str(path), framework="pt") as f:
                metadata = f.metadata() or {}
                snapshot = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (not a mapping)
        except SafetensorError as exc:
            raise ValueError(f"pending round {path}: not a readable safetensors file ({exc})") from None
        if metadata.get("format") != PENDING_FORMAT:
            raise ValueError(
                f"pending round {path}: format {metadata.get('format')!r}, this spes reads format {PENDING_FORMAT}"
            )
        try:
            round_id, step = int(metadata["round_id"]), int(metadata["step"])
        except (KeyError, ValueError) as exc:
            raise ValueError(f"pending round {path}: bad or missing round_id/step in its metadata ({exc})") from None
        if manifest is not None:
            for name, tensor in snapshot.items():
                if name not in manifest:
                    raise ValueError(f"pending round {path}: tensor {name!r} is not a tensor of this model")
                if tuple(tensor.shape) != tuple(manifest[name]):
                    raise ValueError(
                        f"pending round {path}: tensor {name!r} has shape {list(tensor.shape)}, "
                        f"this model's is {list(manifest[name])}"
                    )
        return cls(round_id=round_id, step=step, snapshot=snapshot)
