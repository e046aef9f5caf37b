"""Atomic, pickle-free checkpoints, unsharded and sharded, behind one `latest` pointer.

Layout of a save folder:
    step<N>/           unsharded: the main rank writes the whole state
        model.safetensors   the full model state, fp32
        optim.safetensors   optimizer state tensors, keyed `<param fqn>/<state key>`
        meta.json           kind, step, optimizer param groups, trainer state (step, tokens, data, RNG), the size and
                            XXH3-128 checksum of every file (a load refuses a file changed since the save), its own
        config.yaml         the resolved run config
        (extra files)       whatever else the run's state needs, named in meta.json's `extra` (an overlapped SPES
                            node's round in flight: spes.sync.node_files.PENDING_FILE)
    step<N>-sharded/   sharded (FSDP): every rank writes its shards through torch.distributed.checkpoint
        shard-<r>-model-00001-of-00001.safetensors   rank r's pieces of `model/<fqn>` and `optim/<fqn>/<key>`,
                                                     with their offsets in the safetensors header
        meta.json, config.yaml                       as above (kind "sharded", world_size)
    latest             the name of the newest complete checkpoint of either kind

Both kinds are written into a temporary sibling directory and renamed into place only when complete;
then `latest` is replaced atomically. A crash at any moment leaves `latest` naming a complete checkpoint
(or absent). Nothing is unpickled: safetensors and JSON only; the sharded reader takes tensor offsets from
the safetensors headers, not from DCP's pickled `.metadata`. A sharded checkpoint loads into any number
of ranks (DCP reshards on load) and `python -m spes.unshard` turns it into the unsharded layout.
A trainer needs two calls, both collectives over a parallelized (single, DDP or FSDP2) model: `save` and `restore`.
The layout's names, finding a checkpoint in a save folder and pruning it are `spes.save_folder`'s (torch-free).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

import torch
import xxhash
import yaml
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from spes.atomic import NO_ROOM, os_errno, publish_dir, room_for, staging_dir
from spes.distributed import all_ranks_min, all_ranks_ok, barrier, is_dtensor, process_rank, process_world_size, unwrap
from spes.moe import fuse_expert_blocks, split_expert_blocks
from spes.save_folder import (
    CONFIG_FILE,
    META_FILE,
    MODEL_FILE,
    OPTIM_FILE,
    SHARDED_SUFFIX,
    CheckpointError,
    Keep,
    checksums_of,
    earlier_checkpoint_fix,
    no_room_fix,
    point_latest,
    remove_stale_temporaries,
    resolve_checkpoint,
)
from spes.schema import yaml_error_text

MODEL_KEY, OPTIM_KEY = "model/", "optim/"  # prefixes of the tensors in a sharded checkpoint
Extra = Mapping[str, Callable[[Path], None]]
"""More files of a checkpoint, by name: each function writes its file to the path it is given."""
# NOTE: torch.distributed.checkpoint is imported where it is used, not above: with the DTensor and sympy it pulls
# in, it costs over a second of start-up that a trainer which never saves, restores or shards should not pay.


def model_state_dict(model: nn.Module, *, full: bool = False) -> dict[str, torch.Tensor]:
    """`get_model_state_dict` (whole tensors gathered to CPU if `full`, else this rank's view), typed as what a
    model's state is: tensors (torch annotates any state's values)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return cast("dict[str, torch.Tensor]", get_model_state_dict(model, options=_options(full, cpu_offload=True)))


def _optim_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, *, full: bool = False) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return cast("dict[str, Any]", get_optimizer_state_dict(model, optimizer, options=_options(full, cpu_offload=True)))


def _load_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    model_state: Mapping[str, torch.Tensor],
    optim_state: dict[str, Any] | None,
    *,
    full: bool,
) -> None:
    """Put a model state, and an optimizer state if given, into a (parallelized) model: whole tensors if `full`."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    options = _options(full, cpu_offload=False)
    set_model_state_dict(model, dict(model_state), options=options)
    if optim_state is not None:
        set_optimizer_state_dict(model, optimizer, optim_state, options=options)


def _options(full: bool, *, cpu_offload: bool) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload) if full else None


@dataclass
class Checkpoint:
    path: Path
    model: dict[str, torch.Tensor]
    optim: dict[str, Any] | None
    trainer: dict[str, Any]
    config: dict[str, Any]
    reblocked: bool = False
    """Restored into another expert layout: the weights alone carried over (a new run from them, not a resume)."""


def _flatten_optim(optim_state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """{'state': {fqn: {key: tensor}}, 'param_groups': [...]} -> ({'fqn/key': tensor}, JSON-able groups)."""
    tensors = {}
    for fqn, state in optim_state["state"].items():
        for key, value in state.items():
            tensors[f"{fqn}/{key}"] = value if isinstance(value, torch.Tensor) else torch.tensor(value)
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in optim_state["param_groups"]]
    return tensors, groups


def _unflatten_optim(tensors: Mapping[str, torch.Tensor], groups: list[dict]) -> dict[str, Any]:
    state: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        fqn, slash, name = key.rpartition("/")
        if not slash:
            raise CheckpointError(
                f"optimizer tensor {key!r} is not named <param>/<state key>: the checkpoint is corrupt"
            )
        state.setdefault(fqn, {})[name] = t
    groups = [dict(g) for g in groups]
    for g in groups:
        if "betas" in g:
            g["betas"] = tuple(g["betas"])
    return {"state": state, "param_groups": groups}


# ---------------------------------------------------------------------------------------------------------------
# Writing


def save_checkpoint(
    save_folder: str | Path,
    step: int,
    *,
    model_state: Mapping[str, torch.Tensor],
    optim_state: dict[str, Any] | None,
    trainer_state: dict[str, Any],
    config: dict[str, Any],
    keep: Keep = -1,
    extra: Extra | None = None,
) -> Path:
    """Write the unsharded `step<step>/` atomically, point `latest` at it, keep the `keep` newest (-1: all)."""
    folder = Path(save_folder)
    folder.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(folder)
    final = folder / f"step{step}"
    with staging_dir(final) as tmp:
        write_unsharded(
            tmp,
            step,
            model_state=model_state,
            optim_state=optim_state,
            trainer_state=trainer_state,
            config=config,
            extra=extra,
        )
    return point_latest(final, "unsharded", keep)


def write_unsharded(
    directory: Path,
    step: int,
    *,
    model_state: Mapping[str, torch.Tensor],
    optim_state: dict[str, Any] | None,
    trainer_state: dict[str, Any],
    config: dict[str, Any],
    extra: Extra | None = None,
) -> None:
    """The files of an unsharded checkpoint into an existing (temporary) directory."""
    save_file({k: v.detach().cpu().contiguous() for k, v in model_state.items()}, directory / MODEL_FILE)
    groups: list[dict] = []
    if optim_state is not None:
        tensors, groups = _flatten_optim(optim_state)
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, directory / OPTIM_FILE)
    _write_meta(
        directory,
        {"kind": "unsharded", "step": step, "trainer": trainer_state, "optim_param_groups": groups},
        config,
        extra,
    )


def _write_meta(directory: Path, meta: dict[str, Any], config: dict[str, Any], extra: Extra | None) -> None:
    """The `extra` files, config.yaml, then meta.json with the size (the completeness check on load) and XXH3-128 (the
    integrity check: a flipped byte is refused, not trained on) of every file, and a checksum of its own."""
    for name, write in (extra or {}).items():
        write(directory / name)
    (directory / CONFIG_FILE).write_text(yaml.safe_dump(config, sort_keys=False))
    files = [p for p in sorted(directory.iterdir()) if p.name != META_FILE]
    sizes = {p.name: p.stat().st_size for p in files}
    digests = dict(zip(sizes, checksums_of(files), strict=True))
    meta = {**meta, **({"extra": sorted(extra)} if extra else {}), "files": sizes, _FILE_DIGESTS: digests}
    meta[_META_DIGEST] = _meta_digest(meta)
    (directory / META_FILE).write_text(json.dumps(meta, indent=1))


def _meta_digest(meta: dict[str, Any]) -> str:
    """The XXH3-128 of meta.json's content but this checksum itself (its keys sorted, so the layout does not count)."""
    content = {k: v for k, v in meta.items() if k != _META_DIGEST}
    return xxhash.xxh3_128_hexdigest(json.dumps(content, sort_keys=True).encode())


def training_state(
    model: nn.Module, optimizer: torch.optim.Optimizer | None
) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """This rank's view of model + optimizer as flat `model/<fqn>`, `optim/<fqn>/<key>` tensors (DTensors under
    FSDP), and the optimizer's param groups (none without an optimizer)."""
    flat = {MODEL_KEY + k: v for k, v in model_state_dict(model).items()}
    if optimizer is None:
        return flat, []
    tensors, groups = _flatten_optim(_optim_state_dict(model, optimizer))
    flat.update({OPTIM_KEY + k: v for k, v in tensors.items()})
    return flat, groups


def save_sharded_checkpoint(
    save_folder: str | Path,
    step: int,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    trainer_state: dict[str, Any],
    config: dict[str, Any],
    keep: Keep = -1,
    extra: Extra | None = None,
) -> Path:
    """Write `step<step>-sharded/` from every rank (a collective), point `latest` at it, keep `keep` newest.

    Every rank writes its own shard file into one temporary directory; rank 0 adds meta.json once all are
    written, then renames and updates `latest`. Any rank's failure fails the save on every rank, before
    anything is published.
    """
    folder = Path(save_folder)
    final = folder / f"step{step}{SHARDED_SUFFIX}"
    tmp = folder / f".{final.name}.tmp"
    main = process_rank() == 0
    if main:
        folder.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(folder)
        tmp.mkdir()
    barrier()
    flat, groups = training_state(model, _stepped(optimizer))
    try:
        _write_shards(flat, tmp)
    except BaseException:
        if main:  # NOTE: DCP fails a save on every rank at once: no rank writes into `tmp` any more
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    del flat
    ok, error = True, None
    if main:
        try:
            _write_meta(
                tmp,
                {
                    "kind": "sharded",
                    "step": step,
                    "world_size": process_world_size(),
                    "trainer": trainer_state,
                    "optim_param_groups": groups,
                },
                config,
                extra,
            )
            publish_dir(tmp, final)
            point_latest(final, "sharded", keep)
        except Exception as e:  # noqa: BLE001 -- re-raised below after telling the other ranks
            ok, error = False, e
    if not all_ranks_ok(ok):
        if error is not None:
            raise error
        raise CheckpointError(f"rank 0 failed to finish {final}; see its log")
    return final


def _write_shards(flat: dict[str, torch.Tensor], tmp: Path) -> None:
    """This rank's shards of `flat` into `tmp` (a collective). A rank that finds no room fails the save on every
    rank as the OSError it met, not as DCP's exception that wraps every rank's traceback."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with _single_process_quiet():
            dcp.save(flat, storage_writer=dcp.HuggingFaceStorageWriter(str(tmp), save_distributed=True))
    except CheckpointException as e:
        codes = [os_errno(error) for error, _ in e.failures.values()]
        code = next((c for c in codes if c in NO_ROOM), None)
        if code is None:
            raise
        raise OSError(code, os.strerror(code), str(tmp)) from e


def save(
    save_folder: str | Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    trainer_state: dict[str, Any],
    config: dict[str, Any],
    sharded: bool,
    keep: Keep = -1,
    extra: Extra | None = None,
) -> Path | None:
    """Save a parallelized (single, DDP or FSDP2) model and its optimizer: the counterpart of `restore`.

    A collective when a process group exists: every rank calls it. `sharded`: every rank writes its shards
    (`step<N>-sharded/`); else the whole state is gathered to the main rank, which writes `step<N>/`. The main
    rank writes the `extra` files into either kind. The checkpoint's path, or None on the ranks that wrote no
    unsharded checkpoint. A full disk (or quota, or file-size limit) fails it as one OutOfRoom naming the save folder,
    what it still holds and what to do.
    """
    with room_for(f"cannot save the checkpoint of step {step} in {save_folder}", lambda: no_room_fix(save_folder)):
        if sharded:
            return save_sharded_checkpoint(
                save_folder,
                step,
                model=model,
                optimizer=optimizer,
                trainer_state=trainer_state,
                config=config,
                keep=keep,
                extra=extra,
            )
        model_state = model_state_dict(model, full=True)
        stepped = _stepped(optimizer)
        optim_state = None if stepped is None else _optim_state_dict(model, stepped, full=True)
        if process_rank() != 0:
            return None
        return save_checkpoint(
            save_folder,
            step,
            model_state=model_state,
            optim_state=optim_state,
            trainer_state=trainer_state,
            config=config,
            keep=keep,
            extra=extra,
        )


def _stepped(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer | None:
    """The optimizer if it has taken a step, else None (a step-0 checkpoint has no optimizer state).

    NOTE: asked for the state of an optimizer that has none, torch's `get_optimizer_state_dict` creates it
    with a zero-gradient step, which would advance Adam's step count and change the run that saved it.
    """
    return optimizer if optimizer.state else None


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """Silence DCP's warning that it runs in one process: without a process group that is what we ask for."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


# ---------------------------------------------------------------------------------------------------------------
# Validating


_META_FIELDS = {"kind": str, "step": int, "trainer": dict, "optim_param_groups": list, "files": dict}  # every save's
_FILE_DIGESTS, _META_DIGEST = "xxh3_128", "meta_xxh3_128"
"""meta.json's checksums of the files and of itself (`spes.save_folder.checksums_of`), absent from checkpoints saved
before them."""


def _read_meta(step_dir: Path) -> dict[str, Any]:
    """meta.json of a checkpoint, after checking every file it lists is there at its recorded size."""
    meta_path = step_dir / META_FILE
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError, RecursionError) as e:  # NOTE: ValueError: not UTF-8 or not JSON; too deep: recursion
        raise CheckpointError(
            f"{meta_path}: unreadable checkpoint metadata ({e}); {earlier_checkpoint_fix(step_dir)}"
        ) from None
    if not _is_meta(meta):
        raise CheckpointError(f"{meta_path}: not a checkpoint's metadata; {earlier_checkpoint_fix(step_dir)}")
    if _META_DIGEST in meta and meta[_META_DIGEST] != _meta_digest(meta):
        raise CheckpointError(
            f"{meta_path}: damaged (its content does not match the checksum it was saved with); {_corrupt(step_dir)}"
        )
    for name, size in meta["files"].items():
        f = step_dir / name
        if not f.is_file() or f.stat().st_size != size:
            raise CheckpointError(f"{f}: missing or truncated (expected {size} bytes); {_corrupt(step_dir)}")
    return meta


def _corrupt(step_dir: Path) -> str:
    return f"the checkpoint is corrupt, {earlier_checkpoint_fix(step_dir)}"


def _damaged_file(step_dir: Path, meta: dict[str, Any], *, with_optim: bool, share: bool) -> CheckpointError | None:
    """The first file a load reads whose bytes differ from the checksum meta.json recorded, as the error to raise, or
    None. `share` (a collective): each rank hashes its share of the files, and every rank learns the first damaged
    one, so that each names it (torchrun may stop the rank that found it before it prints)."""
    digests = meta.get(_FILE_DIGESTS, {})
    names = sorted(n for n in digests if with_optim or n != OPTIM_FILE)
    mine = range(len(names))[process_rank() :: process_world_size()] if share else range(len(names))
    sums = checksums_of([step_dir / names[i] for i in mine])
    first = min((i for i, digest in zip(mine, sums, strict=True) if digest != digests[names[i]]), default=len(names))
    if share:
        first = all_ranks_min(first)
    if first == len(names):
        return None
    return CheckpointError(
        f"{step_dir / names[first]}: its bytes differ from the checksum meta.json recorded (changed on disk since the "
        f"save); {_corrupt(step_dir)}"
    )


def _is_meta(meta: Any) -> bool:
    """Whether `meta` has every field of a save's meta.json, of its type: the files plain names with byte sizes, the
    optimizer's param groups mappings (AdamW's betas a pair), so a damaged file is refused here, naming it."""
    if not isinstance(meta, dict) or not all(isinstance(meta.get(k), t) for k, t in _META_FIELDS.items()):
        return False
    files = all(
        isinstance(size, int) and name == Path(name).name and name not in ("", ".", "..") and "\x00" not in name
        for name, size in meta["files"].items()
    )
    groups = meta["optim_param_groups"]
    betas = [g["betas"] for g in groups if isinstance(g, dict) and "betas" in g]
    pairs = all(
        isinstance(b, list) and len(b) == 2 and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in b)
        for b in betas
    )
    digests = meta.get(_FILE_DIGESTS, {})
    sums = isinstance(digests, dict) and all(isinstance(d, str) for d in digests.values())
    return files and pairs and sums and all(isinstance(g, dict) for g in groups)


def trainer_state(path: str | Path) -> dict[str, Any]:
    """The trainer state a checkpoint (a step directory, or a save folder: its latest) recorded: step, tokens, the
    data loader's place."""
    return dict(_read_meta(resolve_checkpoint(path))["trainer"])


def _read_config(step_dir: Path) -> dict[str, Any]:
    """The run config saved with a checkpoint ({} for one written without it)."""
    path = step_dir / CONFIG_FILE
    if not path.is_file():
        return {}
    try:
        config = yaml.safe_load(path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise CheckpointError(
            f"{path}: not valid YAML ({yaml_error_text(e)}); {earlier_checkpoint_fix(step_dir)}"
        ) from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: not a run config (a YAML mapping); {earlier_checkpoint_fix(step_dir)}")
    return config


def is_sharded(path: str | Path) -> bool:
    """Whether the checkpoint at `path` (or named by a save folder's `latest`) is a sharded one."""
    return _read_meta(resolve_checkpoint(path)).get("kind") == "sharded"


def _sharded_shapes(step_dir: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Global shape and dtype of every tensor of a sharded checkpoint, from its safetensors headers."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    try:
        metadata = HuggingFaceStorageReader(str(step_dir)).read_metadata()
    except (SafetensorError, OSError, ValueError, KeyError) as e:
        raise CheckpointError(f"{step_dir}: unreadable shard files ({e}); {_corrupt(step_dir)}") from None
    entries = metadata.state_dict_metadata.items()
    return {k: (tuple(md.size), md.properties.dtype) for k, md in entries}  # type: ignore[union-attr]


def check_model_compatible(ckpt_model: Mapping[str, Any], model_state: Mapping[str, Any], source: Path) -> None:
    """Refuse a checkpoint of another model config before anything is loaded.

    Values may be tensors or shapes; under FSDP a DTensor's shape is the global one.
    """
    missing = sorted(set(model_state) - set(ckpt_model))
    unexpected = sorted(set(ckpt_model) - set(model_state))
    if missing or unexpected:
        raise CheckpointError(
            f"{source}: checkpoint does not match this model config: missing {missing[:3]}, "
            f"unexpected {unexpected[:3]} (was it written with other model or spes_config keys?)"
        )
    for name, t in model_state.items():
        want, have = _shape(t), _shape(ckpt_model[name])
        if want != have:
            raise CheckpointError(
                f"{source}: tensor {name} has shape {have} in the checkpoint but {want} in this "
                f"model config (was it written with other model keys?)"
            )


def _shape(t: Any) -> tuple[int, ...]:
    return tuple(t.shape) if hasattr(t, "shape") else tuple(t)


def _check_optim_compatible(ckpt_fqns: set[str], trainable: set[str], source: Path) -> None:
    """Refuse optimizer state for other parameters (e.g. a checkpoint of another SPES peer)."""
    if ckpt_fqns and ckpt_fqns != trainable:
        extra, lacking = sorted(ckpt_fqns - trainable), sorted(trainable - ckpt_fqns)
        raise CheckpointError(
            f"{source}: the optimizer state is for other parameters than this run trains "
            f"(checkpoint only: {extra[:3]}, run only: {lacking[:3]}); was it written by another "
            f"spes_config.peer_id or with using_spes/using_dilico set otherwise?"
        )


# ---------------------------------------------------------------------------------------------------------------
# Reading


def load_checkpoint(path: str | Path, *, with_optim: bool = True) -> Checkpoint:
    """Load a whole checkpoint of either kind into this process; every problem is a CheckpointError naming the file.

    A sharded checkpoint is assembled from its shard files without any process group.
    """
    step_dir = resolve_checkpoint(path)
    meta = _read_meta(step_dir)
    damaged = _damaged_file(step_dir, meta, with_optim=with_optim, share=False)
    if damaged is not None:
        raise damaged
    return _read_whole(step_dir, meta, with_optim=with_optim)


def _read_whole(step_dir: Path, meta: dict[str, Any], *, with_optim: bool) -> Checkpoint:
    """The tensors, trainer state and config of a checkpoint whose meta.json has been read (and files verified)."""
    config = _read_config(step_dir)
    if meta.get("kind") == "sharded":
        model, optim_tensors = _read_sharded(step_dir, with_optim)
        optim = _unflatten_optim(optim_tensors, meta["optim_param_groups"]) if optim_tensors else None
    else:
        model = _load_tensors(step_dir / MODEL_FILE)
        optim = None
        if with_optim and (step_dir / OPTIM_FILE).is_file():
            optim = _unflatten_optim(_load_tensors(step_dir / OPTIM_FILE), meta["optim_param_groups"])
    return Checkpoint(path=step_dir, model=model, optim=optim, trainer=meta["trainer"], config=config)


def load_model_state(path: str | Path) -> dict[str, torch.Tensor]:
    """Only the model tensors of a checkpoint (for export and evaluation)."""
    return load_checkpoint(path, with_optim=False).model


def _read_sharded(step_dir: Path, with_optim: bool) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Whole tensors of a sharded checkpoint: (model, flat optimizer state)."""
    shapes = _sharded_shapes(step_dir)
    wanted = {k: v for k, v in shapes.items() if k.startswith(MODEL_KEY) or (with_optim and k.startswith(OPTIM_KEY))}
    target = {k: torch.empty(shape, dtype=dtype) for k, (shape, dtype) in wanted.items()}
    _dcp_load(target, step_dir, no_dist=True)
    model = {k[len(MODEL_KEY) :]: v for k, v in target.items() if k.startswith(MODEL_KEY)}
    optim = {k[len(OPTIM_KEY) :]: v for k, v in target.items() if k.startswith(OPTIM_KEY)}
    return model, optim


def _dcp_load(target: dict[str, Any], step_dir: Path, *, no_dist: bool = False) -> None:
    """DCP's load into `target`: collective under a process group unless `no_dist` (DCP itself runs in this process
    alone when there is no group)."""
    import torch.distributed.checkpoint as dcp

    try:
        with _single_process_quiet():
            dcp.load(target, storage_reader=dcp.HuggingFaceStorageReader(str(step_dir)), no_dist=no_dist)
    except (SafetensorError, OSError, RuntimeError, ValueError) as e:
        raise CheckpointError(
            f"{step_dir}: cannot read the shards ({str(e).splitlines()[0]}); {_corrupt(step_dir)}"
        ) from None


def _load_tensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(path)
    except (SafetensorError, OSError, ValueError) as e:
        raise _unreadable(path, e) from None


def _unreadable(path: Path, error: Exception) -> CheckpointError:
    return CheckpointError(f"{path}: not a readable safetensors file ({error}); {_corrupt(path.parent)}")


def restore(
    path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer, *, with_optim: bool = True
) -> Checkpoint:
    """Load a checkpoint of either kind into a parallelized (single, DDP or FSDP2) model and its optimizer
    (not its optimizer state when `with_optim` is false: OLMo's `reset_optimizer_state`).

    A collective when a process group exists: every rank calls it. Under FSDP each rank reads only its own
    pieces of either kind (DCP slices the safetensors files: a rank's host memory never holds the whole
    model); a single or DDP process reads an unsharded checkpoint whole, as it holds the whole model. The
    model and optimizer must fit (same tensor names and shapes, same trainable set), and the files' bytes the
    checksums meta.json recorded, else CheckpointError before anything is loaded. Returns the checkpoint's path,
    trainer state and config (no tensors).
    """
    step_dir = resolve_checkpoint(path)
    meta = _read_meta(step_dir)
    damaged = _damaged_file(step_dir, meta, with_optim=with_optim, share=True)
    if damaged is not None:
        raise damaged
    config = _read_config(step_dir)
    if meta.get("kind") == "sharded":
        trainer, reblocked = _restore_sharded(step_dir, meta, model, optimizer, with_optim), False
    else:
        trainer, reblocked = _restore_unsharded(step_dir, meta, model, optimizer, with_optim)
    return Checkpoint(path=step_dir, model={}, optim=None, trainer=trainer, config=config, reblocked=reblocked)


def _restore_sharded(
    step_dir: Path, meta: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer, with_optim: bool
) -> dict[str, Any]:
    """This rank's shards of a sharded checkpoint, resharded by DCP to this run's ranks; its trainer state."""
    shapes = {k: s for k, (s, _) in _sharded_shapes(step_dir).items()}
    _restore_sliced(step_dir, meta, shapes, model, optimizer, with_optim, file_key=str)
    return meta["trainer"]


def _restore_sliced(
    step_dir: Path,
    meta: dict[str, Any],
    shapes: Mapping[str, tuple[int, ...]],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    with_optim: bool,
    *,
    file_key: Callable[[str], str],
) -> None:
    """Load this rank's view of model + optimizer from `step_dir`'s safetensors files through DCP, which reads
    only the slices each rank holds. `shapes`: the stored global shapes by `model/<fqn>` and `optim/<fqn>/<key>`;
    `file_key`: the name such a tensor has in the files."""
    check_model_compatible(
        {k[len(MODEL_KEY) :]: s for k, s in shapes.items() if k.startswith(MODEL_KEY)},
        model_state_dict(model),
        step_dir,
    )
    optim_fqns = {k[len(OPTIM_KEY) :].rsplit("/", 1)[0] for k in shapes if k.startswith(OPTIM_KEY) and with_optim}
    _check_optim_compatible(optim_fqns, _trainable(model), step_dir)
    flat, _ = training_state(model, optimizer if optim_fqns else None)
    _dcp_load({file_key(k): v for k, v in flat.items()}, step_dir)
    optim_tensors = {k[len(OPTIM_KEY) :]: v for k, v in flat.items() if k.startswith(OPTIM_KEY)}
    model_state = {k[len(MODEL_KEY) :]: v for k, v in flat.items() if k.startswith(MODEL_KEY)}
    optim_state = _unflatten_optim(optim_tensors, meta["optim_param_groups"]) if optim_fqns else None
    _load_state(model, optimizer, model_state, optim_state, full=False)


def _restore_unsharded(
    step_dir: Path, meta: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer, with_optim: bool
) -> tuple[dict[str, Any], bool]:
    """An unsharded checkpoint into this rank: (its trainer state, whether its experts had to be re-blocked: then
    only the weights carry over, and the trainer state is {}).

    Under FSDP each rank reads only its slices of the files (their tensors are named `<fqn>` and `<fqn>/<key>`);
    otherwise, or to re-block, the files are read whole.
    """
    model_state = model_state_dict(model)
    stored = _header_shapes(step_dir / MODEL_FILE)
    reblocked = set(stored) != set(model_state)  # another expert layout (e.g. centralized -> SPES)
    if not reblocked and any(is_dtensor(t) for t in model_state.values()):
        shapes = {MODEL_KEY + k: s for k, s in stored.items()}
        if with_optim and (step_dir / OPTIM_FILE).is_file():
            shapes |= {OPTIM_KEY + k: s for k, s in _header_shapes(step_dir / OPTIM_FILE).items()}
        _restore_sliced(step_dir, meta, shapes, model, optimizer, with_optim, file_key=_unprefixed)
        return meta["trainer"], False
    ckpt = _read_whole(step_dir, meta, with_optim=with_optim)
    if reblocked:
        ckpt = replace(ckpt, model=_reblock(ckpt.model, model_state), optim=None, trainer={})
    check_model_compatible(ckpt.model, model_state, step_dir)
    if ckpt.optim is not None:
        _check_optim_compatible(set(ckpt.optim["state"]), _trainable(model), step_dir)
    _load_state(model, optimizer, ckpt.model, ckpt.optim, full=True)
    return ckpt.trainer, reblocked


def _unprefixed(key: str) -> str:
    """`model/<fqn>` -> `<fqn>`, `optim/<fqn>/<key>` -> `<fqn>/<key>`: a tensor's name in an unsharded checkpoint."""
    return key.partition("/")[2]


def _header_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor of a safetensors file, from its header alone."""
    try:
        with safe_open(path, framework="pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except (SafetensorError, OSError, ValueError) as e:
        raise _unreadable(path, e) from None


def _trainable(model: nn.Module) -> set[str]:
    """Names of the parameters this run trains (those with optimizer state)."""
    return {n for n, p in unwrap(model).named_parameters() if p.requires_grad}


def _reblock(weights: dict[str, torch.Tensor], model_state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """`weights` re-blocked to the model's expert-block size (every spes model has experts).

    Optimizer and trainer state cannot follow (frozen blocks have no moments), so the caller starts a
    new run from these weights; what still differs after re-blocking (say, the layer count) is what the
    compatibility check then names.
    """
    block = next(t.shape[0] for n, t in model_state.items() if n.endswith(".experts.w1.0"))
    return split_expert_blocks(fuse_expert_blocks(weights), block)


# ---------------------------------------------------------------------------------------------------------------
# Unsharding


def unshard(sharded: str | Path, out_dir: str | Path) -> Path:
    """Turn a sharded checkpoint (or a save folder whose `latest` is one) into an unsharded checkpoint at `out_dir`.

    The result has the same model, optimizer and trainer state, loads with `load_checkpoint` and resumes
    training with any number of ranks. `out_dir` must not exist yet; it appears complete or not at all (OutOfRoom
    naming it when its disk fills up).
    """
    src = resolve_checkpoint(sharded)
    out = Path(out_dir)
    meta = _read_meta(src)
    if meta.get("kind") != "sharded":
        raise CheckpointError(f"{src} is already an unsharded checkpoint (it has {MODEL_FILE}); nothing to do")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        suggestion = src.parent / src.name.removesuffix(SHARDED_SUFFIX)
        raise FileExistsError(f"{out} already exists; choose a new directory (e.g. {suggestion})")
    ckpt = load_checkpoint(src)
    fix = "nothing half-written is left; free space on that disk or choose another directory"
    with room_for(f"cannot write the unsharded checkpoint {out}", fix), staging_dir(out) as tmp:
        write_unsharded(
            tmp,
            int(meta["step"]),
            model_state=ckpt.model,
            optim_state=ckpt.optim,
            trainer_state=ckpt.trainer,
            config=ckpt.config,
            extra={name: functools.partial(shutil.copyfile, src / name) for name in meta.get("extra", [])},
        )
    return out
