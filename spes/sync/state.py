"""Crash-safe persistence of the parameter server's round state under `--state_dir`.

After every completed round, before any peer may download it, the server writes

    round-<step>.safetensors   the global model (fp32) and, under `momentum/<name>`, the DiLoCo outer momentum
                               and, under `held/<name>`, the held model of an int8 wire (`spes.sync.deltas`;
                               a held tensor that is the global one is written once, listed in state.json)
    state.json                 the round (step, peers that built it, merge flag and alpha), the run's settings,
                               the model manifest, and the name and size of the tensor file

each through a temporary file in the same directory, fsync and `os.replace`; `state.json` is replaced last and
is the commit point, so a server killed at any moment (SIGKILL included) leaves either the previous round or
the new one, never a mix. A restarted server with the same `--state_dir` resumes from that round; the
peers' retries (re-join, re-upload) then complete the round that was open. Nothing is unpickled: tensors are
read with safetensors, the rest is JSON.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from spes.atomic import write_atomic
from spes.sync.fragments import WHOLE
from spes.sync.protocol import Shape, Tensors

STATE_FILE = "state.json"
FORMAT = 1
MOMENTUM_PREFIX = "momentum/"
HELD_PREFIX = "held/"
_ROUND_FILE = re.compile(r"^round-(\d+)\.safetensors$")


@dataclass(frozen=True)
class SavedRound:
    """The latest completed round as persisted: enough to resume serving and aggregating."""

    step: int
    peers: tuple[int, ...]
    merged: bool
    alpha: float
    manifest: dict[str, Shape]
    global_model: Tensors
    momentum: Tensors
    held: Tensors = field(default_factory=dict)
    """Int8 wire: the held model of this round (every tensor), empty on other wires."""
    fragment: int = WHOLE
    """The part of the model the round covered (`spes.sync.fragments`). Until every fragment has had a round, the
    global model holds only the fragments that have."""
    fragments: int = 1
    """How the run cuts its model (`spes_config.overlap_fragments`; 1: not at all)..."""
    sync_steps: int = 0
    """...every `sync_steps` steps: a restarted server holds its peers to both."""


def save_round(state_dir: str | Path, saved: SavedRound, run: Mapping[str, Any]) -> Path:
    """Persist `saved` for the run described by `run` (JSON-able settings that must not change on restart)."""
    directory = Path(state_dir)
    directory.mkdir(parents=True, exist_ok=True)
    tensor_file = directory / f"round-{saved.step}.safetensors"
    # NOTE: safetensors writes straight from each tensor's memory: no second copy of the model is made.
    shared = sorted(n for n, t in saved.held.items() if t is saved.global_model.get(n))
    tensors = {
        **saved.global_model,
        **{MOMENTUM_PREFIX + n: t for n, t in saved.momentum.items()},
        **{HELD_PREFIX + n: t for n, t in saved.held.items() if n not in shared},
    }
    write_atomic(tensor_file, lambda tmp: save_file({n: t.contiguous() for n, t in tensors.items()}, tmp))
    record = {
        "format": FORMAT,
        "round": saved.step,
        "peers": list(saved.peers),
        "merged": saved.merged,
        "alpha": saved.alpha,
        "run": dict(run),
        "manifest": {name: list(shape) for name, shape in saved.manifest.items()},
        "held_is_global": shared,
        "fragment": saved.fragment,
        "fragments": saved.fragments,
        "sync_steps": saved.sync_steps,
        "tensor_file": tensor_file.name,
        "tensor_file_bytes": tensor_file.stat().st_size,
    }
    data = (json.dumps(record, indent=1) + "\n").encode()
    write_atomic(directory / STATE_FILE, data)
    for old in directory.iterdir():
        if (_ROUND_FILE.match(old.name) and old.name != tensor_file.name) or old.name.endswith(".tmp"):
            old.unlink(missing_ok=True)
    return tensor_file


def load_round(state_dir: str | Path, run: Mapping[str, Any]) -> SavedRound | None:
    """The persisted round in `state_dir`, or None when there is none yet (a fresh run).

    Raises ValueError naming the file and key when the state belongs to a run with other settings or is
    damaged; FileNotFoundError when `state.json` names a tensor file that is gone.
    """
    directory = Path(state_dir)
    state_path = directory / STATE_FILE
    if not state_path.is_file():
        return None
    try:
        record = json.loads(state_path.read_text())
        step, peers, tensor_name = int(record["round"]), [int(p) for p in record["peers"]], record["tensor_file"]
        manifest = {str(n): tuple(int(d) for d in shape) for n, shape in record["manifest"].items()}
        if record["format"] != FORMAT:
            raise ValueError(f"format {record['format']!r}, this spes reads format {FORMAT}")
        held_is_global = [str(n) for n in record.get("held_is_global", [])]
        fragment = int(record.get("fragment", WHOLE))
        layout = int(record.get("fragments", 1)), int(record.get("sync_steps", 0))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(
            f"{state_path}: not a spes server state ({exc}); move it away or pick another --state_dir"
        ) from None
    recorded = dict(record["run"])
    if "total_peers" in recorded:  # NOTE: a state written before the server's settings named it num_peers
        recorded["num_peers"] = recorded.pop("total_peers")
    for key, value in run.items():
        if recorded.get(key) != value:
            raise ValueError(
                f"{state_path}: written by a run with {key}={recorded.get(key)!r}, this server has "
                f"{key}={value!r}; restart with the same settings or use a fresh --state_dir"
            )
    tensor_path = directory / Path(tensor_name).name
    if not tensor_path.is_file():
        raise FileNotFoundError(f"{state_path} names {tensor_path}, which is missing: the state directory is damaged")
    if tensor_path.stat().st_size != record["tensor_file_bytes"]:
        raise ValueError(
            f"{tensor_path} has {tensor_path.stat().st_size} bytes, {STATE_FILE} recorded "
            f"{record['tensor_file_bytes']}: the state directory is damaged"
        )
    global_model: Tensors = {}
    momentum: Tensors = {}
    held: Tensors = {}
    try:
        with safe_open(str(tensor_path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                for prefix, into in ((MOMENTUM_PREFIX, momentum), (HELD_PREFIX, held), ("", global_model)):
                    if name.startswith(prefix):
                        into[name[len(prefix) :]] = f.get_tensor(name)
                        break
    except SafetensorError as exc:
        raise ValueError(f"{tensor_path}: unreadable ({exc}): the state directory is damaged") from None
    shapes = {name: tuple(t.shape) for name, t in global_model.items()}
    held.update({name: global_model[name] for name in held_is_global if name in global_model})
    held_shapes = {name: tuple(t.shape) for name, t in held.items()}
    mismatched = any(manifest.get(name) != shape for name, shape in shapes.items())
    partial = shapes != manifest and fragment == WHOLE
    if mismatched or partial or not set(momentum) <= set(manifest) or held_shapes not in ({}, manifest):
        raise ValueError(f"{tensor_path}: its tensors do not match the manifest in {state_path}")
    ordered = {name: global_model[name] for name in manifest if name in global_model}  # the order served before
    held = {name: held[name] for name in manifest} if held else {}
    return SavedRound(
        step,
        tuple(peers),
        bool(record["merged"]),
        float(record["alpha"]),
        manifest,
        ordered,
        momentum,
        held,
        fragment,
        *layout,
    )
