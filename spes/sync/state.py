"""Crash-safe persistence of the parameter server's round state under `--state_dir`.

After every completed round, before any peer may download it, the server writes

    round-<step>.safetensors   the global model (fp32), under `momentum/<name>` the DiLoCo outer momentum and,
                               under `codec/<name>`, what the codec serves beyond the global model (a held-model
                               codec's held model; a held tensor that is the global one is written once, listed in
                               state.json)
    state.json                 the round (step, peers that built it, fragment, merge alpha), the run spec it was
                               written under (`spes.sync.spec.RunSpec`: mode, peers, ownership, schedule, codec),
                               its `server:` section, the model manifest, and the name, size and XXH3-128 of the
                               tensor file (a restart refuses a file whose bytes changed)

each through a temporary file in the same directory, fsync and `os.replace`; `state.json` is replaced last and
is the commit point, so a server killed at any moment (SIGKILL included) leaves either the previous round or
the new one, never a mix. A restarted server with the same `--state_dir` resumes from that round if its run spec
agrees (the open fields of a server started without the run's YAML are taken from the state; a `server:` setting
it changed is named in its log); the peers' retries
(re-join, re-upload) then complete the round that was open. Nothing is unpickled: tensors are read with
safetensors, the rest is JSON. One server at a time: it holds `server.lock` there for its whole life
(`lock_state_dir`), and a second one on the same directory is refused.
"""

from __future__ import annotations

import json
import math
import re
import time
import uuid
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from spes.atomic import LockHeld, hold_lock, write_atomic
from spes.config import ServerSection
from spes.save_folder import checksums_of
from spes.sync.fragments import WHOLE
from spes.sync.joins import manifest_differences
from spes.sync.protocol import Manifest, Tensors
from spes.sync.spec import FIELD_KEYS, RunSpec
from spes.sync.wire import RAW_DTYPES, finite

STATE_FILE = "state.json"
RUN_FILE = "run.json"
"""The run's identity, written when a server first starts with this --state_dir (before any round)."""
LOCK_FILE = "server.lock"
"""Held (flock) by the one server that uses this --state_dir, with its pid in it (`lock_state_dir`)."""
FORMAT = 2
"""2: the run spec and the codec's tensors (`codec/`); 1: wire dtype and int8 held model (`held/`)."""
MOMENTUM_PREFIX = "momentum/"
CODEC_PREFIX = "codec/"
_ROUND_FILE = re.compile(r"^round-(\d+)\.safetensors$")


@dataclass(frozen=True)
class SavedRound:
    """The latest completed round as persisted: enough to resume serving and aggregating."""

    step: int
    peers: tuple[int, ...]
    fragment: int
    """The part of the model the round covered. Until every fragment has had a round, the global model holds
    only the fragments that have."""
    alpha: float
    global_model: Tensors
    momentum: Tensors
    codec_state: Tensors
    """`ServerCodec.persisted`: empty for a raw codec."""
    spec: RunSpec
    """The server's spec, its open fields (manifest, sync_steps) completed from the state."""
    length_was: int | None = None
    """The run's last step as the state recorded it, when this restart changed it (`with_length`)."""
    server_changed: tuple[str, ...] = ()
    """The `server:` settings this restart changed (`server_changes`)."""


def run_id_of(state_dir: str | Path) -> str:
    """The id of the run whose state lives in `state_dir`: the one recorded there, or a new one (recorded at once, so
    nodes that join before the first round completes belong to the run a restarted server resumes)."""
    recorded = recorded_run_id(state_dir)
    if recorded is not None:
        return recorded
    path = Path(state_dir) / RUN_FILE
    run_id = new_run_id()
    record = json.dumps({"run_id": run_id, "created": time.strftime("%Y-%m-%dT%H:%M:%S")}) + "\n"
    try:
        write_atomic(path, record.encode())
    except OSError as exc:  # NOTE: a full disk, as the server starts: refused as the lock's failure is
        raise ValueError(
            f"--state_dir {state_dir}: cannot write {RUN_FILE} ({exc.strerror}); free space there or pick another "
            "--state_dir"
        ) from None
    return run_id


def recorded_run_id(state_dir: str | Path, fix: str = "move it away or pick another --state_dir") -> str | None:
    """The id of the run recorded in `state_dir` (None: none recorded); ValueError naming the file and `fix` when it
    is not a run record (emptied by a crash, edited by hand)."""
    path = Path(state_dir) / RUN_FILE
    if not path.is_file():
        return None
    try:
        return str(json.loads(path.read_text())["run_id"])
    except (ValueError, KeyError, TypeError, RecursionError) as exc:  # NOTE: RecursionError: JSON nested too deep
        raise ValueError(f"{path}: not a spes run record ({exc}); {fix}") from None


def lock_state_dir(state_dir: str | Path) -> int:
    """Claim `state_dir` for this process: an exclusive `flock` on its `server.lock`, held on the returned
    descriptor until it is closed (`os.close`, or the process's exit, a crash or SIGKILL included, so a dead
    server never blocks its restart). The holder's pid is written into the file for the refusal to name.

    Why: two servers on one state directory would each write their rounds over the other's, and a run must never
    be mixed. ValueError naming `--state_dir` (and the holder's pid) when another process holds it."""
    try:
        Path(state_dir).mkdir(parents=True, exist_ok=True)
        return hold_lock(Path(state_dir) / LOCK_FILE)
    except LockHeld as held:
        raise ValueError(
            f"--state_dir {state_dir} is in use by another parameter server ({held.holder or 'pid unknown'}); stop it "
            "or pass another --state_dir"
        ) from None
    except OSError as exc:
        raise ValueError(f"--state_dir {state_dir}: cannot use it ({exc.strerror}); pick another --state_dir") from None


def new_run_id() -> str:
    return uuid.uuid4().hex[:16]


def spec_record(spec: RunSpec) -> dict[str, Any]:
    """The compared fields of a spec as JSON."""
    return {name: list(v) if isinstance(v := getattr(spec, name), tuple) else v for name in FIELD_KEYS}


def save_round(state_dir: str | Path, saved: SavedRound) -> Path:
    """Persist `saved` (its spec must be complete)."""
    assert saved.spec.manifest is not None
    directory = Path(state_dir)
    directory.mkdir(parents=True, exist_ok=True)
    tensor_file = directory / f"round-{saved.step}.safetensors"
    # NOTE: safetensors writes straight from each tensor's memory: no second copy of the model is made.
    shared = sorted(n for n, t in saved.codec_state.items() if t is saved.global_model.get(n))
    tensors = {
        **saved.global_model,
        **{MOMENTUM_PREFIX + n: t for n, t in saved.momentum.items()},
        **{CODEC_PREFIX + n: t for n, t in saved.codec_state.items() if n not in shared},
    }
    write_atomic(tensor_file, lambda tmp: save_file({n: t.contiguous() for n, t in tensors.items()}, tmp))
    record = {
        "format": FORMAT,
        "round": saved.step,
        "peers": list(saved.peers),
        "fragment": saved.fragment,
        "alpha": saved.alpha,
        "spec": spec_record(saved.spec),
        "server": asdict(saved.spec.server),
        "manifest": {name: list(shape) for name, shape in saved.spec.manifest.items()},
        "codec_is_global": shared,
        "tensor_file": tensor_file.name,
        "tensor_file_bytes": tensor_file.stat().st_size,
        "tensor_file_xxh3_128": checksums_of([tensor_file])[0],
    }
    write_atomic(directory / STATE_FILE, (json.dumps(record, indent=1) + "\n").encode())
    for old in directory.iterdir():
        if (_ROUND_FILE.match(old.name) and old.name != tensor_file.name) or old.name.endswith(".tmp"):
            old.unlink(missing_ok=True)
    return tensor_file


def load_round(state_dir: str | Path, spec: RunSpec) -> SavedRound | None:
    """The persisted round in `state_dir` for the run `spec`, or None when there is none yet (a fresh run).

    Raises ValueError naming the file and field when the state belongs to a run with another spec or is
    damaged; FileNotFoundError when `state.json` names a tensor file that is gone.
    """
    directory = Path(state_dir)
    state_path = directory / STATE_FILE
    if not state_path.is_file():
        return None
    try:
        record = json.loads(state_path.read_text())
        _check_format(state_path, record.get("format"))
        step, peers, tensor_name = int(record["round"]), [int(p) for p in record["peers"]], record["tensor_file"]
        tensor_bytes, tensor_checksum = int(record["tensor_file_bytes"]), record.get("tensor_file_xxh3_128")
        if not isinstance(tensor_name, str):
            raise TypeError(f"tensor_file {tensor_name!r} is not a file name")
        if not isinstance(tensor_checksum, (str, type(None))):
            raise TypeError(f"tensor_file_xxh3_128 {tensor_checksum!r} is not a checksum")
        manifest = {str(n): tuple(int(d) for d in shape) for n, shape in record["manifest"].items()}
        recorded = _recorded_spec(spec, record["spec"], manifest)
        codec_is_global = [str(n) for n in record.get("codec_is_global", [])]
        fragment, alpha = int(record.get("fragment", WHOLE)), float(record["alpha"])
        if not math.isfinite(alpha):
            raise ValueError(f"merge alpha {alpha} is not a number")
        server_changed = tuple(server_changes(dict(record.get("server", {})), spec.server))
    except _OtherFormat:
        raise
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise ValueError(
            f"{state_path}: not a spes server state of this version ({exc}); move it away or pick another --state_dir"
        ) from None
    resized = with_length(recorded, spec.last_step, step)
    _check_spec(state_path, step, spec, resized)
    _check_model(state_path, manifest, spec)
    global_model, momentum, codec_state = _read_tensors(
        directory, state_path, tensor_name, tensor_bytes, tensor_checksum
    )
    codec_state.update({n: global_model[n] for n in codec_is_global if n in global_model})
    shapes = {name: tuple(t.shape) for name, t in global_model.items()}
    mismatched = any(manifest.get(name) != shape for name, shape in shapes.items())
    partial = shapes != manifest and fragment == WHOLE
    codec_shapes = {name: tuple(t.shape) for name, t in codec_state.items()}
    # NOTE: a codec's state is of the tensors the global model holds (before every fragment has had a round, a part)
    if mismatched or partial or not set(momentum) <= set(manifest) or codec_shapes not in ({}, shapes):
        raise ValueError(f"{directory / tensor_name}: its tensors do not match the manifest in {state_path}")
    ordered = {name: global_model[name] for name in manifest if name in global_model}  # the order served before
    codec_state = {name: codec_state[name] for name in manifest if name in codec_state}
    complete = spec.completed_by(resized)
    length_was = recorded.last_step if resized.last_step != recorded.last_step else None
    return SavedRound(
        step, tuple(peers), fragment, alpha, ordered, momentum, codec_state, complete, length_was, server_changed
    )


def _check_spec(state_path: Path, step: int, spec: RunSpec, recorded: RunSpec) -> None:
    """Raises ValueError naming the first setting in which this server's `spec` differs from the one the state at
    round `step` was written under (`recorded`, its length that of `spec`), and what to do."""
    found = spec.first_difference(recorded)
    if found is not None and found[0] == "last_step":
        raise ValueError(
            f"{state_path}: the run has completed round {step}, this server's max_duration ends it at step "
            f"{spec.last_step}; restart it with a max_duration past step {step}, or use a fresh --state_dir for a "
            "new run"
        )
    if found is not None:
        name, ours, theirs = found
        raise ValueError(
            f"{state_path}: written by a run with {name}={theirs!r}, this server has {name}={ours!r}; restart it "
            f"with {FIELD_KEYS[name]} as that run had it, or use a fresh --state_dir for a new run"
        )


class _OtherFormat(ValueError):
    """A state.json another spes version wrote: `load_round` raises it as it is, what to do said."""


def _check_format(state_path: Path, found: Any) -> None:
    """Raises for a `format` other than FORMAT; one an earlier or a later spes wrote, as what to do: moving it away
    would start the run again at its first round, where its resuming nodes are refused."""
    if found == FORMAT:
        return
    if not isinstance(found, int) or isinstance(found, bool):
        raise ValueError(f"format {found!r}, this spes reads format {FORMAT}")
    if found > FORMAT:
        raise _OtherFormat(
            f"{state_path}: written by a later spes (server state format {found}, this one reads format {FORMAT}); "
            "run the spes version that wrote it on the server and every node"
        )
    raise _OtherFormat(
        f"{state_path}: written by an earlier spes (server state format {found}, this one reads format {FORMAT}); "
        "finish this run with the spes version that started it (server and every node), or start a new run (a fresh "
        "--state_dir, every node without --resume)"
    )


def server_changes(recorded: dict[str, Any], now: ServerSection) -> list[str]:
    """`server.<key>: <was> -> <now>` for each setting of the `server:` section that differs from the one a state
    recorded. They may change at a restart (they are the server's alone, as a learning rate may change at an OLMo
    resume), but the nodes' logs would not show it."""
    current = asdict(now)
    return [f"server.{k}: {recorded[k]!r} -> {v!r}" for k, v in current.items() if k in recorded and recorded[k] != v]


def _check_model(state_path: Path, manifest: Manifest, spec: RunSpec) -> None:
    """Refuse a state whose model is not the one this server's YAML builds: it would serve the run's tensors to nodes
    of another shape, and refuse the run's own nodes as if theirs were the wrong model."""
    diff = "" if spec.manifest is None else manifest_differences(manifest, spec.manifest)
    if diff:
        where = f" ({spec.origin})" if spec.origin else ""
        raise ValueError(
            f"{state_path}: written by a run with another model than this server's{where}: {diff}; restart it with "
            "the model settings that run had, or use a fresh --state_dir for a new run"
        )


def with_length(recorded: RunSpec, last_step: int | None, step: int) -> RunSpec:
    """`recorded` (a saved run's spec, at round `step`) with the run length `last_step` a restarted server was given,
    when the run has not reached it: as in OLMo, `max_duration` may grow (or shrink) between a stop and a resume.
    Every node must then resume with it too: one with the old length is refused when it joins. A length at or before
    the saved round is left a difference (the run has already passed it)."""
    if last_step is None or recorded.last_step is None or last_step <= step:
        return recorded
    return replace(recorded, last_step=last_step)


def _recorded_spec(spec: RunSpec, fields: dict[str, Any], manifest: Manifest) -> RunSpec:
    """The spec a state was written under, from its `spec_record` (KeyError/TypeError/ValueError if malformed)."""
    return replace(
        spec,
        mode=fields["mode"],
        num_peers=int(fields["num_peers"]),
        experts_per_block=int(fields["experts_per_block"]),
        block_owners=tuple(int(p) for p in fields["block_owners"]),
        sync_steps=int(fields["sync_steps"]),
        last_step=None if fields["last_step"] is None else int(fields["last_step"]),
        overlap_fragments=int(fields["overlap_fragments"]),
        codec=str(fields["codec"]),
        codec_settings=tuple((str(k), int(v)) for k, v in fields["codec_settings"]),
        manifest=manifest,
    )


def _read_tensors(
    directory: Path, state_path: Path, tensor_name: str, tensor_bytes: int, tensor_checksum: str | None
) -> tuple[Tensors, Tensors, Tensors]:
    """The global model, momentum and codec tensors of the file `state.json` names, its size and checksum (absent from
    a state saved before it) checked first: a flipped byte would otherwise become the model every peer downloads."""
    tensor_path = directory / Path(tensor_name).name
    if not tensor_path.is_file():
        raise FileNotFoundError(f"{state_path} names {tensor_path}, which is missing: the state directory is damaged")
    if tensor_path.stat().st_size != tensor_bytes:
        raise ValueError(
            f"{tensor_path} has {tensor_path.stat().st_size} bytes, {STATE_FILE} recorded "
            f"{tensor_bytes}: the state directory is damaged"
        )
    if tensor_checksum is not None and checksums_of([tensor_path])[0] != tensor_checksum:
        raise ValueError(
            f"{tensor_path}: its bytes differ from the checksum {STATE_FILE} recorded (changed on disk since the "
            "round was saved): the state directory is damaged"
        )
    global_model: Tensors = {}
    momentum: Tensors = {}
    codec_state: Tensors = {}
    try:
        with safe_open(str(tensor_path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                for prefix, into in ((MOMENTUM_PREFIX, momentum), (CODEC_PREFIX, codec_state), ("", global_model)):
                    if name.startswith(prefix):
                        into[name[len(prefix) :]] = _checked(tensor_path, name, f.get_tensor(name))
                        break
    except SafetensorError as exc:
        raise ValueError(f"{tensor_path}: unreadable ({exc}): the state directory is damaged") from None
    return global_model, momentum, codec_state


def _checked(tensor_path: Path, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A tensor of the state as the server wrote it, in a wire dtype (a bf16 run keeps its experts in bf16) and
    finite (it publishes only such rounds), or ValueError: a damaged file must not become the model every peer
    downloads."""
    if tensor.dtype not in RAW_DTYPES.values():
        raise ValueError(
            f"{tensor_path}: tensor {name!r} is {tensor.dtype}, not one of the wire's dtypes: the state directory is "
            "damaged"
        )
    if not finite(tensor):
        raise ValueError(f"{tensor_path}: tensor {name!r} holds NaN or Inf: the state directory is damaged")
    return tensor
