"""The layout of a save folder, which needs no torch: the names in it, finding, resolving and pruning its checkpoints.

A save folder holds `step<N>/` (unsharded) and `step<N>-sharded/` checkpoint directories, each complete once its
meta.json is there, and `latest`, the name of the newest complete one (spes.checkpoint describes what a checkpoint
holds, and writes and reads it). Listing the checkpoints, resolving a path or a step to one, telling a foreign or
empty folder apart, pointing `latest`, pruning by schedule and removing what a killed save left behind look at
names and files only. They live here, apart from the tensors, so that a command line (`python -m spes.hf export
--run_dir`, `python -m spes.unshard`) and a launcher refuse a path that names no checkpoint without importing torch
(seconds of start-up), and the modules that only find checkpoints never import it.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal

import xxhash

from spes.atomic import ASIDE, write_atomic

MODEL_FILE, OPTIM_FILE, META_FILE, CONFIG_FILE, LATEST = (
    "model.safetensors",
    "optim.safetensors",
    "meta.json",
    "config.yaml",
    "latest",
)
SHARDED_SUFFIX = "-sharded"
_STEP_DIR = re.compile(r"^step(\d+)(-sharded)?$")
Kind = Literal["unsharded", "sharded"]
Schedule = tuple[int | None, int]
"""A save schedule and what it keeps: (its interval in steps, None: every checkpoint; its newest to keep, -1: all)."""
Keep = int | Sequence[Schedule]
"""How many checkpoints of a kind to keep: the newest N (-1: all), or what each schedule that writes it keeps
(`prune`)."""


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete or does not fit this run; the message says which file."""


def point_latest(final: Path, kind: Kind, keep: Keep) -> Path:
    """Point `latest` at a published checkpoint, then prune its kind to what `keep` keeps."""
    folder = final.parent
    write_atomic(folder / LATEST, f"{final.name}\n")
    prune(folder, kind, [(None, keep)] if isinstance(keep, int) else keep)
    return final


def free_space_fix(key: str) -> str:
    """What to do when the disk of the folder config key `key` names fills during a run."""
    return f"free space on that disk or point {key} at another one, then continue with --resume=auto"


def no_room_fix(save_folder: str | Path) -> str:
    """What a save that found no room in `save_folder` left, and what to do: the checkpoint a restart continues from
    is named (a failed save publishes nothing, so `latest` still names a complete one)."""
    latest = Path(save_folder) / LATEST
    kept = f"{latest} still names {latest.read_text().strip()}" if latest.is_file() else "no checkpoint was saved yet"
    return f"nothing of this save was kept ({kept}); {free_space_fix('save_folder')}"


def prune(save_folder: Path, kind: Kind, schedules: Sequence[Schedule]) -> None:
    """Delete the checkpoints of `kind` that no schedule keeps. A schedule keeps the newest of its own: those whose
    step is a multiple of its interval, or of no schedule's (saved off schedule: a last step's, a time limit's).

    NOTE: off FSDP, `save_interval` and `save_interval_unsharded` both write `step<N>/` (OLMo: two kinds); counted
    together, the first implementation's keep 1 of the one deleted the keep 5 of the other."""
    found = _checkpoint_steps(save_folder, kind)
    intervals = [interval for interval, _ in schedules if interval]
    kept: set[Path] = set()
    for interval, keep in schedules:
        own = [
            path
            for step, path in found
            if interval is None or step % interval == 0 or all(step % other for other in intervals)
        ]
        kept.update(own[-keep:] if keep > 0 else own)
    for _, path in found:
        if path not in kept:
            shutil.rmtree(path, ignore_errors=True)


_TEMPORARY = re.compile(r"^\.(step\d+(-sharded)?)\.(tmp|old)|^\.latest\.")


def remove_stale_temporaries(save_folder: Path) -> None:
    """Delete what saves killed midway left behind (one process writes a save folder at a time).

    A checkpoint moved aside to be replaced (`.<name>.old-<pid>`) goes back in place if the kill came
    before its replacement arrived.
    """
    for p in save_folder.iterdir():
        m = _TEMPORARY.match(p.name)
        if m is None:
            continue
        if m.group(3) == "old" and not (save_folder / m.group(1)).exists() and (p / META_FILE).is_file():
            os.replace(p, save_folder / m.group(1))
        elif p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


def list_checkpoints(save_folder: str | Path, kind: Kind | None = None) -> list[Path]:
    """Complete-looking checkpoint directories (of one kind, or both), oldest first."""
    return [p for _, p in _checkpoint_steps(save_folder, kind)]


def _checkpoint_steps(save_folder: str | Path, kind: Kind | None) -> list[tuple[int, Path]]:
    """(step, directory) of each of `list_checkpoints`, oldest first."""
    folder = Path(save_folder)
    if not folder.is_dir():
        return []
    found = []
    for p in folder.iterdir():
        m = _STEP_DIR.match(p.name)
        if m is None or not p.is_dir():
            continue
        sharded = m.group(2) is not None
        if kind is None or sharded == (kind == "sharded"):
            found.append((int(m.group(1)), sharded, p))
    return [(step, p) for step, _, p in sorted(found)]


CHECKPOINT_PATHS = (
    f"a checkpoint directory such as output/<run_name>/node0/step100, or a save folder holding '{LATEST}'"
)
"""What `resolve_checkpoint` takes, as a refusal tells the user."""


def resolve_checkpoint(path: str | Path, *, what: str = "checkpoint") -> Path:
    """A checkpoint directory as given, or the one a save folder's `latest` names (without `latest`, its newest
    complete checkpoint: a save killed after publishing its checkpoint, before pointing `latest` at it, loses
    nothing); a refusal names the path as `what` (the key or flag it came from) and what it could name instead."""
    p = Path(path)
    if (p / META_FILE).is_file():
        return p
    if (p / LATEST).is_file():
        target = p / _latest_name(p)
        moved_aside = sorted(p.glob(f".{target.name}{ASIDE}*/{META_FILE}"))
        if not target.exists() and moved_aside:  # killed while replacing it: the old copy is complete
            return moved_aside[0].parent
        if not (target / META_FILE).is_file():
            usable = [str(c) for c in list_checkpoints(p) if (c / META_FILE).is_file()]
            raise CheckpointError(
                f"{p / LATEST} names {target.name}, which is missing or incomplete; "
                + (
                    f"load a complete one by its path ({', '.join(usable)}) or write its name into {p / LATEST}"
                    if usable
                    else f"{p} holds no complete checkpoint: point {what} at another one, or remove {p / LATEST} "
                    "to start that save folder afresh"
                )
            )
        return target
    if not p.exists():
        raise FileNotFoundError(f"{what} {p}: no such directory (point it at {CHECKPOINT_PATHS})")
    if not p.is_dir():
        raise CheckpointError(f"{what} {p}: a file, not a directory (point it at {CHECKPOINT_PATHS})")
    complete = [c for c in list_checkpoints(p) if (c / META_FILE).is_file()]
    if complete:
        return complete[-1]
    inside = sorted(c.name for c in p.iterdir() if (c / META_FILE).is_file() or (c / LATEST).is_file())
    if inside:  # e.g. the run directory above the nodes' save folders
        raise CheckpointError(
            f"{what} {p} is neither a checkpoint nor a save folder itself, but holds them; point it at one: "
            + ", ".join(str(p / name) for name in inside)
        )
    foreign = _foreign_checkpoint(p)
    if foreign is not None:
        raise CheckpointError(
            f"{what} {p} is {foreign}, which spes does not read (its checkpoints are its own, pickle-free): write one "
            f"from Hugging Face weights with python -m spes.hf import --hf <HF model dir> --out <dir>/step0 "
            f"--num_train_experts_per_node K and point {what} at it (docs/migrating.md)"
        )
    incomplete = [c.name for c in list_checkpoints(p)]  # NOTE: none of them is complete here
    raise CheckpointError(
        f"{what} {p} holds no checkpoint: neither a checkpoint directory (a step<N> directory spes saved) nor a save "
        f"folder (holding such directories or a '{LATEST}' file)"
        + (f"; {', '.join(incomplete)} lack(s) the {META_FILE} a complete checkpoint holds" if incomplete else "")
        + f"; point it at {CHECKPOINT_PATHS}"
    )


def _latest_name(folder: Path) -> str:
    """The checkpoint name `latest` holds, or CheckpointError when it holds none (emptied by a crash, garbage): a
    plain name is all a save writes there, and `latest` is rewritten atomically, so anything else is damage."""
    latest = folder / LATEST
    raw = latest.read_bytes()
    try:
        name = raw.decode().strip()
    except UnicodeDecodeError:
        name = ""
    if name and name == Path(name).name and name not in (".", "..") and "\x00" not in name:
        return name
    complete = [c for c in list_checkpoints(folder) if (c / META_FILE).is_file()]
    fix = (
        f"remove it to resume from the newest complete checkpoint, {complete[-1]}, or write another one's name into it"
        if complete
        else f"{folder} holds no complete checkpoint: remove it to start that save folder afresh"
    )
    raise CheckpointError(f"{latest}: damaged (it holds {raw[:40]!r}, not a checkpoint's name); {fix}")


def earlier_checkpoint_fix(step_dir: Path) -> str:
    """What to do about the damaged checkpoint `step_dir`: the newest complete one before it in its save folder (what
    a resume goes back to) and how to resume from it, or that there is none."""
    match = _STEP_DIR.match(step_dir.name)
    before = [
        (step, c)
        for step, c in _checkpoint_steps(step_dir.parent, None)
        if (c / META_FILE).is_file() and c != step_dir and (match is None or step < int(match.group(1)))
    ]
    if not before:
        return f"use an earlier checkpoint (there is none in {step_dir.parent})"
    step, newest = before[-1]
    return (
        f"use an earlier checkpoint: the newest is step {step}, {newest} (write {newest.name} into "
        f"{step_dir.parent / LATEST} to resume from it)"
    )


def checksums_of(paths: Sequence[Path]) -> list[str]:
    """The XXH3-128 of each file (hex, as `xxh128sum` prints it), hashed in parallel threads (xxhash lets go of the
    GIL): the checksums that tell a checkpoint's or a server state's flipped bytes from the ones that were written.
    XXH3, not SHA-256: damage, not an adversary, is what it finds, and it hashes about ten times faster (a 1B node's
    checkpoint is GiBs, the server's round file is hashed before any peer may download the round)."""
    with ThreadPoolExecutor(max_workers=min(len(paths), os.cpu_count() or 1) or 1) as pool:
        return list(pool.map(_checksum, paths))


def _checksum(path: Path) -> str:
    digest = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def _foreign_checkpoint(directory: Path) -> str | None:
    """What another trainer's checkpoint `directory` is, by its files, or None. The first implementation's launcher
    passed its OLMo checkpoint as `--load_path`; spes said only that the directory held no checkpoint."""
    if any(directory.glob("*.pt")) or (directory / "model_and_optim").is_dir():
        return "an OLMo checkpoint (the first implementation's: convert it to Hugging Face with its converter first)"
    if (directory / "config.json").is_file() and any(directory.glob("*.safetensors*")):
        return "a Hugging Face model directory (a dense one is upcycled instead: python -m spes.upcycle)"
    return None


def not_a_save_folder(folder: Path) -> str:
    """What `folder`, which holds no checkpoint, is instead of a node's save folder, and which folder to pass: a run
    directory passed for its nodes' folders is the usual slip."""
    if (folder / META_FILE).is_file():
        number = re.fullmatch(r"step(\d+)(?:-sharded)?", folder.name)
        step = f" with step {number[1]}" if number else ""
        return f"is a checkpoint, not a save folder: pass the save folder it is in, {folder.parent}{step}"
    if (folder / "state.json").is_file():  # NOTE: spes.sync.state.STATE_FILE, beyond this layer
        return (
            "is the parameter server's state, which holds no checkpoint: pass a node's save folder, e.g. "
            f"{folder.parent / 'node0'}"
        )
    nodes = sorted(p.parent for p in folder.glob(f"*/{LATEST}"))
    if nodes:
        return f"holds the save folders of the nodes, not a checkpoint: pass one of them, e.g. {nodes[0]}"
    return (
        "holds no checkpoint (no latest file, no step<N> directory): pass a node's save folder, e.g. output/<run>/node0"
    )


def resolve_step(run_dir: str | Path, step: str | int) -> Path:
    """The checkpoint of a save folder: `step<N>` (else `step<N>-sharded`) for an int, or what `latest` names."""
    run = Path(run_dir)
    if not run.is_dir():
        where = "" if run.is_absolute() else f"relative to {Path.cwd()}; "
        raise FileNotFoundError(
            f"run directory {run} does not exist ({where}expected a spes save_folder, e.g. output/<run_name>/node0)"
        )
    steps = [p.name for p in list_checkpoints(run)]
    if not steps and not (run / LATEST).is_file():
        raise FileNotFoundError(f"run directory {run} {not_a_save_folder(run)}")
    available = f"available: {', '.join(steps) or 'none'}"
    if str(step) == "latest":
        if not (run / LATEST).is_file():
            raise FileNotFoundError(f"{run} has no '{LATEST}' file naming the latest checkpoint; {available}")
        return resolve_checkpoint(run)
    if not re.fullmatch(r"\d+", str(step)):
        raise ValueError(f"checkpoint step must be an integer or 'latest', got {step!r}")
    for path in (run / f"step{int(step)}", run / f"step{int(step)}{SHARDED_SUFFIX}"):  # unsharded preferred
        if path.is_dir():
            return path
    raise FileNotFoundError(f"checkpoint {run / f'step{int(step)}'} does not exist; {available}")
