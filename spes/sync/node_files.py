"""What a node checkpoint holds for the sync wing beside the model: the run it belongs to, an overlapped round still
in flight, and the codec's state. Rank 0 writes them (`spes.sync.peer.PeerSync.checkpoint_files`); a resumed node
reads them back before its first step."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from spes.atomic import write_atomic
from spes.sync.overlap import PendingRound
from spes.sync.protocol import Manifest, Tensors

PENDING_FILE = "pending_round.st"
"""The checkpoint file (safetensors) holding an overlapped round still in flight when the checkpoint was taken.

NOTE: not named `*.safetensors`: a sharded checkpoint's reader takes every such file of the directory for a shard."""
RUN_FILE = "run.json"
"""The checkpoint file naming the run the node belongs to (`read_run_id`): a resumed node joins only that run."""
CODEC_FILE = "codec_state.st"
"""The checkpoint file (safetensors) holding the codec's state on rank 0 (a held-model codec's held model and
error feedback, as of the last round applied), so a resumed node sends what the uninterrupted one would."""


def read_run_id(checkpoint: Path | None) -> str | None:
    """The run a node checkpoint belongs to (None: no checkpoint, or one naming none, a centralized or older one)."""
    if checkpoint is None:
        return None
    path = checkpoint / RUN_FILE
    if not path.is_file():
        return None
    try:
        return str(json.loads(path.read_text())["run_id"])
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        raise ValueError(
            f"{path}: not a run record ({exc}): the checkpoint is damaged; write the run's id into it as "
            '{"run_id": "<id>"} (python -m spes.status names the run), or load an older checkpoint with '
            "--load_path=<save_folder>/step<N>"
        ) from None


def write_run_id(path: Path, run_id: str) -> None:
    """The record `read_run_id` reads, written atomically."""
    write_atomic(path, (json.dumps({"run_id": run_id}) + "\n").encode())


def read_pending(
    checkpoint: Path, manifest: Manifest | None, uploaded_at: Callable[[int], list[str]]
) -> PendingRound | None:
    """The round `checkpoint` holds in flight (None: none), refused unless its snapshot is of the tensors this node
    uploads at the round's step (`uploaded_at`): another peer id, mode or fragment layout wrote it."""
    path = checkpoint / PENDING_FILE
    if not path.is_file():
        return None
    pending = PendingRound.load(path, manifest)
    if sorted(pending.snapshot) != sorted(uploaded_at(pending.step)):
        raise ValueError(
            f"pending round {path}: its snapshot is not of the tensors this node trains at step {pending.step} (was "
            "it written by another spes_config.peer_id, mode, sync_steps or overlap_fragments?)"
        )
    return pending


def save_codec_state(path: Path, metadata: dict[str, str], tensors: Tensors) -> None:
    """The codec's state as safetensors (metadata in the header; never pickled), written atomically."""
    contiguous = {n: t.detach().to("cpu").contiguous() for n, t in tensors.items()}
    write_atomic(path, lambda tmp: save_file(contiguous, tmp, metadata=metadata))


def load_codec_state(path: Path) -> tuple[dict[str, str], Tensors]:
    """What `save_codec_state` wrote: (metadata, tensors)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return dict(f.metadata() or {}), {n: f.get_tensor(n) for n in f.keys()}  # noqa: SIM118
    except SafetensorError as exc:
        raise ValueError(f"codec state {path}: not a readable safetensors file ({exc})") from None
