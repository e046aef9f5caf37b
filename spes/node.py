"""One node of a run, built and trained: what `python -m spes.train` runs once its command line and config hold.

Order of construction: config -> process group -> data (checked before any model exists) -> model on meta ->
the server's answer to a dry join (a node it would refuse stops here, in seconds) -> weights -> parallelize (under
FSDP2: parallelize, then each rank's shards of the weights) -> optimizer -> sync client -> trainer (`start_node`) ->
fit, torn down in `finally`. Apart from `spes.train` (the command line, torch-free) because this module imports torch,
its data, model and checkpoint modules: seconds that `--help` or a mistyped key need not wait for.
"""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import tempfile
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from spes.atomic import LockHeld, hold_lock, write_atomic
from spes.checkpoint import Checkpoint, restore
from spes.config import MODE_TITLES, TrainConfig, changed_settings, passed_over
from spes.data import BatchLoader, TokenSequenceDataset, check_eos, iterate_eval_batches
from spes.distributed import DistInfo, init_distributed, parallelize, shutdown_distributed, unwrap, uses_fsdp
from spes.evaluators import evaluators_of
from spes.failures import leave_for_launcher
from spes.guard import check_weights_finite
from spes.interrupt import Stopped, Unsaved
from spes.model import Transformer, count_params
from spes.optim import build_optimizer, optimizer_state_bytes
from spes.save_folder import LATEST, CheckpointError, list_checkpoints, resolve_checkpoint
from spes.schema import to_dict
from spes.shards import resolve_paths
from spes.tokenizer import check_vocab, load_tokenizer
from spes.trainer import Syncer, Trainer, scheduler_in_steps

if TYPE_CHECKING:  # the sync wing (grpc) is imported only by runs that sync
    from spes.sync.peer import PeerSync


def start_checkpoint(cfg: TrainConfig, log: Callable[[str], None]) -> Path | None:
    """The checkpoint to load: save_folder's latest under `try_load_latest_save` when it has one, else load_path's;
    resolved here, so that a path naming no checkpoint fails before the model is built."""
    if cfg.try_load_latest_save:
        if list_checkpoints(cfg.save_folder):
            if note := passed_over(cfg):
                log(note)
            return resolve_checkpoint(cfg.save_folder, what="save_folder")
        log(f"no checkpoint in {cfg.save_folder} yet: starting {'from ' + cfg.load_path if cfg.load_path else 'fresh'}")
    folder = Path(cfg.save_folder)
    resuming = cfg.load_path is not None and Path(cfg.load_path).resolve() == folder.resolve()
    if resuming and not (folder / LATEST).is_file() and not list_checkpoints(folder):
        raise ValueError(
            f"nothing to resume: save_folder {folder} holds no checkpoint yet (--resume, or load_path naming it); "
            "use --resume=auto, which starts afresh when there is none, or drop --resume"
        )
    return resolve_checkpoint(cfg.load_path, what="load_path") if cfg.load_path else None


def _continues_run(cfg: TrainConfig, load_path: Path | None) -> bool:
    """Whether loading checkpoint `load_path` continues the run of `save_folder` (OLMo: the checkpoint lives in it)."""
    return load_path is not None and load_path.resolve().parent == Path(cfg.save_folder).resolve()


RUN_FILES = ("metrics.jsonl", LATEST)
"""What a run leaves in its save folder besides its step<N> checkpoints."""


def claim_save_folder(cfg: TrainConfig, continuing: bool, is_main: bool, log: Callable[[str], None]) -> None:
    """Refuse a start that is not a resume into a save folder holding a run's saves (another run's, or this one's
    started again without --resume), unless save_overwrite (then the main rank removes them: an old run's later
    checkpoints would otherwise outrank the new run's; a dry run says so and removes nothing). An unusable folder
    was refused already (`holding_save_folder`)."""
    folder = Path(cfg.save_folder)
    saves = [*list_checkpoints(folder), *(p for p in map(folder.joinpath, RUN_FILES) if p.exists())]
    if continuing or not saves:
        return
    names = ", ".join(p.name for p in saves[:4]) + (f" and {len(saves) - 4} more" if len(saves) > 4 else "")
    if not cfg.save_overwrite:
        raise ValueError(
            f"save_folder {folder} already holds a run's saves ({names}): continue that run with --resume, or set "
            "save_overwrite=true to start over (it removes them), or choose another save_folder (or run_name)"
        )
    if cfg.dry_run:
        log(f"dry run: save_overwrite would remove the earlier run's saves in {folder} ({names})")
        return
    if is_main:
        for path in saves:
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
    log(f"save_overwrite: removed the earlier run's saves in {folder} ({names})")


def check_save_folder(cfg: TrainConfig) -> None:
    """Refuse (ValueError) what a start of `cfg` would refuse in its save folder, writing nothing: for
    `spes.preflight`, whose passing node must not then stop at start over another run's saves or a `--resume` of
    nothing. A `load_path` not made yet (an upcycled start) counts as a fresh start: the node names it at start."""
    try:
        load_path = start_checkpoint(cfg, log=lambda note: None)
    except FileNotFoundError:
        load_path = None
    _usable_folder(cfg)
    continuing = _continues_run(cfg, load_path) or cfg.try_load_latest_save
    claim_save_folder(replace(cfg, dry_run=True), continuing, is_main=False, log=lambda note: None)


def _usable_folder(cfg: TrainConfig) -> Path:
    """save_folder, refused (ValueError) when it is a file or cannot be written here."""
    folder = Path(cfg.save_folder)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"save_folder {folder} is a file, not a folder; choose another save_folder (or run_name)")
    nearest = next(p for p in (folder.absolute(), *folder.absolute().parents) if p.exists())
    if not os.access(nearest, os.W_OK | os.X_OK):
        raise ValueError(f"save_folder {folder}: {nearest} is not writable here; choose another save_folder")
    return folder


SAVE_FOLDER_LOCK = "node.lock"
"""Held (flock) in a save folder by the main rank of the one node that writes it, with its pid and host in it."""


@contextlib.contextmanager
def holding_save_folder(cfg: TrainConfig, info: DistInfo, log: Callable[[str], None]) -> Iterator[None]:
    """Claim save_folder for this node while it runs (its main rank, which writes it; a dry run writes nothing),
    every rank refusing an unusable one first: before the model is built (minutes for a large node).

    Why: two nodes given one save_folder (a YAML whose save_folder lacks the peer id, a copied command, a node
    started again while it still runs) would delete each other's half-written checkpoints, interleave their metrics
    and leave `latest` naming the other node's weights."""
    folder = _usable_folder(cfg)
    if not info.is_main or cfg.dry_run:
        yield
        return
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd = hold_lock(folder / SAVE_FOLDER_LOCK)
    except LockHeld as held:
        raise ValueError(
            f"save_folder {folder} is in use by another node ({held.holder or 'pid unknown'}): give each node its own "
            "save_folder (e.g. output/${run_name}/node${spes_config.peer_id}), or stop that process first"
        ) from None
    except OSError as exc:  # NOTE: a filesystem without flock (some Lustre mounts) must not stop a run
        log(f"warning: cannot lock save_folder {folder} ({exc.strerror}): nothing keeps a second node out of it")
        yield
        return
    try:
        yield
    finally:
        os.close(fd)


def _name_latest(folder: Path, loaded: Path, is_main: bool, log: Callable[[str], None]) -> None:
    """Point `latest` at the checkpoint this run continues from when it names another (a rewind to an older one).

    Why: else a crash before this run's first save resumed the abandoned checkpoint `latest` still named, its
    metrics (cut back to the loaded step) then skipping that checkpoint's steps. The newer checkpoints stay (a
    rewind may be a mistake) until this run saves their steps over them."""
    found = [p.name for p in list_checkpoints(folder)]  # NOTE: by name: load_path may be relative, save_folder not
    named = (folder / LATEST).read_text().strip() if (folder / LATEST).is_file() else None
    if loaded.name not in found or named == loaded.name:  # NOTE: not a copy a killed save moved aside
        return
    if is_main:
        write_atomic(folder / LATEST, f"{loaded.name}\n")
    newer = found[found.index(loaded.name) + 1 :]
    log(
        f"note: {folder / LATEST} now names {loaded.name}, which this run continues"
        + (f"; {', '.join(newer)} (from before it) stay until this run saves those steps" if newer else "")
    )


def _trainer_state(cfg: TrainConfig, ckpt: Checkpoint, continuing: bool, log: Callable[[str], None]) -> dict[str, Any]:
    """The part of a checkpoint's trainer state this start takes up (OLMo's reset_* and restore_dataloader keys)."""
    asked = cfg.reset_optimizer_state or cfg.reset_trainer_state or not cfg.restore_dataloader
    if continuing:
        if asked:
            log(
                f"note: {ckpt.path} continues this save_folder's run, so reset_optimizer_state, reset_trainer_state "
                "and restore_dataloader=false are ignored (as OLMo does on a resume)"
            )
        return ckpt.trainer
    if cfg.reset_trainer_state:
        state: dict[str, Any] = {}
    elif not cfg.restore_dataloader:  # NOTE: OLMo then starts its step, tokens and data at 0 too
        state = {k: v for k, v in ckpt.trainer.items() if k == "rng"}
    else:
        state = dict(ckpt.trainer)
    if cfg.reset_optimizer_state and not cfg.reset_trainer_state:
        step = int(state.get("step", 0))
        state["lr_rewarm"] = [step, step + scheduler_in_steps(cfg).t_warmup]
    if asked:
        log(
            f"from {ckpt.path}: weights{'' if cfg.reset_optimizer_state else ', optimizer state'}"
            f"{', trainer state' if state.get('step') else ''}; starting at step {state.get('step', 0)}"
            + (f", learning rate warming up again until step {state['lr_rewarm'][1]}" if "lr_rewarm" in state else "")
        )
    return state


def check_shard_vocab(dataset: TokenSequenceDataset, vocab_size: int, key: str = "data.paths") -> None:
    """Refuse shards written for another vocabulary than the tokenizer's (another tokenizer: its ids mean other text,
    and a larger one's would crash mid-step), naming the first; preflight refuses the same."""
    for path, info in zip(dataset.paths, dataset.shard_infos):
        if info is not None and info.vocab_size != vocab_size:  # NOTE: a bare OLMo file records none
            raise ValueError(
                f"token shard {path} was written with a vocabulary of {info.vocab_size} but the tokenizer has "
                f"{vocab_size} (model.vocab_size); re-tokenize it with tokenizer.identifier's tokenizer or drop it "
                f"from {key}"
            )


@dataclass
class Node:
    """Everything a node trains with, built in the documented order."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    loader: BatchLoader
    eval_batches: Callable[[], Iterator[torch.Tensor]] | None
    checkpoint: Checkpoint | None


def build_node(cfg: TrainConfig, info: DistInfo, log: Callable[[str], None] = print) -> Node:
    """Data (checked first: a wrong path or vocabulary fails in seconds) -> model on meta -> the server asked
    whether it admits this node (`check_admitted`: a refusal in seconds, not after the weights exist, nor after
    `save_overwrite` removed an earlier run's saves) -> the save folder claimed -> weights ->
    parallelize -> optimizer -> checkpoint (either kind, any rank count), its data position checked against this
    data: a resume over other data is refused before the node joins a server.

    Under FSDP2 the model is sharded while still on meta and each rank allocates only its shards.
    """
    loader = _training_loader(cfg, info, log)
    eval_batches = _validation(cfg)
    load_path = start_checkpoint(cfg, log)
    continuing = _continues_run(cfg, load_path)
    torch.manual_seed(cfg.seed)
    with torch.device("meta"):
        transformer = Transformer.for_run(cfg, training=True)
    if cfg.sync_enabled and not cfg.dry_run:  # NOTE: a dry run meets no server
        from spes.sync.peer import check_admitted

        check_admitted(cfg, transformer, info, load_path, log)
    # NOTE: after the server admitted the node (save_overwrite removes saves); --resume=auto claims the folder as this
    # run's even before its first checkpoint; a dry run only checks it
    claim_save_folder(cfg, continuing or cfg.try_load_latest_save, info.is_main, log)
    log(count_params(transformer).describe())
    log(describe_experts(cfg))
    model: nn.Module = transformer  # wrapped by parallelize below
    sharded = uses_fsdp(cfg, info)
    if sharded:
        model = parallelize(model, cfg, info)
    model.to_empty(device=info.device)
    cast(Transformer, unwrap(model)).init_weights(cfg.seed)
    if not sharded:  # NOTE: DDP broadcasts rank 0's weights at wrapping, so they must exist first
        model = parallelize(model, cfg, info)
    optimizer = build_optimizer(model, cfg.optimizer)
    ckpt = _load(cfg, load_path, continuing, model, optimizer, log)
    if ckpt is not None and "data" in ckpt.trainer:  # NOTE: refused here, not after a join (or its minutes of retries)
        loader.check_same_data(ckpt.trainer["data"])  # the trainer loads it
    if ckpt is not None and continuing and not cfg.dry_run:
        _name_latest(Path(cfg.save_folder), ckpt.path, info.is_main, log)
    return Node(model=model, optimizer=optimizer, loader=loader, eval_batches=eval_batches, checkpoint=ckpt)


def _training_loader(cfg: TrainConfig, info: DistInfo, log: Callable[[str], None]) -> BatchLoader:
    """This rank's loader of the training data, its tokenizer, vocabulary and EOS checked first."""
    tokenizer = load_tokenizer(cfg.tokenizer.identifier, "tokenizer.identifier")
    check_vocab(tokenizer.vocab_size, cfg.model.vocab_size, cfg.model.embedding_size)
    dataset = _dataset(cfg, "paths")
    check_shard_vocab(dataset, tokenizer.vocab_size)
    check_eos(dataset.paths, dataset.shard_infos, cfg.model.eos_token_id)
    if dataset.fingerprint is not None and dataset.fingerprint != tokenizer.fingerprint:
        log(
            f"warning: the training shards were written with another tokenizer "
            f"(fingerprint {dataset.fingerprint[:12]}) than {cfg.tokenizer.identifier} "
            f"({tokenizer.fingerprint[:12]}); check data.paths and tokenizer.identifier"
        )
    loader = BatchLoader(
        dataset,
        batch_size=cfg.global_train_batch_size,
        seed=cfg.data_seed,
        rank=info.rank,
        world_size=info.world_size,
        num_workers=cfg.data.num_workers,
        pin_memory=cfg.data.pin_memory,
        drop_last=cfg.data.drop_last,
    )
    source = "data.seed" if cfg.data.seed is not None else "seed (data.seed unset)"
    log(f"data order seed {cfg.data_seed} ({source})")
    return loader


def _load(
    cfg: TrainConfig,
    load_path: Path | None,
    continuing: bool,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    log: Callable[[str], None],
) -> Checkpoint | None:
    """The checkpoint this start loads into the built model and optimizer, with the trainer state it takes up; a
    resume names the settings changed since the checkpoint (an accidental change shows at once)."""
    if not load_path:
        if cfg.reset_optimizer_state or cfg.reset_trainer_state:
            log("note: reset_optimizer_state / reset_trainer_state change nothing without a load_path (as in OLMo)")
        return None
    ckpt = restore(load_path, model, optimizer, with_optim=not (cfg.reset_optimizer_state and not continuing))
    changes = changed_settings(ckpt.config, to_dict(cfg)) if continuing else []
    if continuing and ckpt.reblocked:  # NOTE: step 0 of a new run among the old run's saves: two runs mixed
        raise ValueError(_another_layout(cfg, ckpt.path, changes))
    check_weights_finite(model, f"checkpoint {ckpt.path}", "pass an earlier checkpoint as load_path")
    if ckpt.reblocked:
        log(
            f"loaded only the weights of {ckpt.path}: it has another expert layout, re-blocked to this run's; its "
            "optimizer and trainer state fit only its own layout, so this run starts at step 0 with a fresh optimizer, "
            "the data from the start and the learning-rate schedule (warm-up included) from its beginning"
        )
        return ckpt
    log(f"loaded {ckpt.path} (step {ckpt.trainer.get('step', 0)})")
    if changes:
        log(f"resuming with {len(changes)} setting(s) changed since that checkpoint: {'; '.join(changes)}")
    return replace(ckpt, trainer=_trainer_state(cfg, ckpt, continuing, log))


LAYOUT_KEYS = ("using_spes", "using_dilico", "spes_config.num_train_experts_per_node", "model.moe_num_experts")
"""The settings that decide how a node stores each MoE layer's experts in blocks (`TrainConfig.experts_per_block`)."""


def _another_layout(cfg: TrainConfig, path: Path, changes: list[str]) -> str:
    """The refusal of a resume into another expert layout than its checkpoint's: the layout's settings that changed
    and this run's layout, not every change (a longer max_duration or another token file is a resume's right)."""
    layout = "; ".join(c for c in changes if c.partition(": ")[0] in LAYOUT_KEYS)
    n, block = cfg.model.moe_num_experts, cfg.experts_per_block
    blocks = f"blocks of {block}" if block < n else "one block"
    return (
        f"{path} holds this save_folder's run with another expert layout ({f'{layout}: ' if layout else ''}this run "
        f"stores each MoE layer's {n} experts in {blocks}): a resume continues that run as it was saved; to start "
        f"this layout from its weights, choose another save_folder with --load_path={path}"
    )


def run(cfg: TrainConfig, notes: list[str] | None = None) -> int:
    """Train `cfg` on this process (one rank of a torchrun job); `notes` are logged once, by the main rank."""
    info = init_distributed(cfg)
    cfg = cfg.on_device(info.device.type)
    finished = False
    try:
        with holding_save_folder(cfg, info, print):
            _train(cfg, info, notes or [])
        finished = True
        return 0
    except BaseException as e:
        # NOTE: the traceback's frames still hold the DDP wrapper; freed after the process group is gone, its
        # C++ reducer would tear gloo down with the GIL held (see shutdown_distributed). Drop them first.
        traceback.clear_frames(e.__traceback__)
        if isinstance(e, KeyboardInterrupt):  # NOTE: a signal before the training loop, or a second one in it
            raise Unsaved(f"interrupted without saving; {_what_is_saved(Path(cfg.save_folder))}") from None
        raise
    finally:
        gc.collect()  # and the reference cycles that may hold it
        shutdown_distributed(clean=finished)
        gc.freeze()  # NOTE: else the interpreter's exit scans the ~300k objects left again: seconds on a busy host


def _train(cfg: TrainConfig, info: DistInfo, notes: list[str]) -> None:
    """Build the node and fit it (or only build it: dry_run); every reference to the wrapped model dies with this
    frame."""
    log = print if info.is_main else (lambda _msg: None)
    for note in notes:
        log(note)
    if info.world_size == 1 and cfg.distributed_strategy in ("fsdp", "ddp"):
        log(
            f"note: distributed_strategy={cfg.distributed_strategy} on one process: the model is not wrapped (one "
            "rank holds all of it either way) and checkpoints are unsharded; launch with torchrun "
            "--nproc_per_node=N to shard or replicate it"
        )
    if cfg.dry_run:
        node = build_node(cfg, info, log)
        _check_start(cfg, node, info, log)
        log(
            f"dry run: built the node ({type(node.model).__name__}, data, optimizer) and checked its save folder, "
            "run spec and evaluators; not training (dry_run=true)"
        )
        return
    trainer, syncer = start_node(cfg, info, log)
    try:
        trainer.fit()
        log(
            f"done: step {trainer.step}, {trainer.tokens:,} tokens, optimizer state "
            f"{optimizer_state_bytes(trainer.optimizer) / 2**20:.1f} MiB{unfinished(cfg, trainer.step)}"
        )
    except Stopped as stop:  # its last step saved: the word spes.torchrun prints
        leave_for_launcher(
            f"error: saved step {stop.step}'s checkpoint in {cfg.save_folder} and stopped; continue with --resume (or "
            "--resume=auto)",
            stopped=True,
        )
        raise
    finally:
        if syncer is not None:
            syncer.close()


def unfinished(cfg: TrainConfig, step: int) -> str:
    """What a node's last line adds when `stop_at` ended its launch before the run's end (max_duration): only the
    progress bar said so, and `done:` read as a finished run."""
    if step >= cfg.duration_steps:
        return ""
    return (
        f"; stopped at step {step} of {cfg.duration_steps} (stop_at): the run is unfinished, continue with --resume "
        "and a larger stop_at or none"
    )


def _what_is_saved(folder: Path) -> str:
    """What a start after an interrupt that saved nothing continues from: the save folder's latest checkpoint (this
    run's earlier saves included), or none yet (then a plain start again may meet this start's metrics)."""
    if not list_checkpoints(folder) and not (folder / LATEST).is_file():
        return f"save_folder {folder} holds no checkpoint yet: start again with --resume=auto (it starts afresh then)"
    try:
        latest = resolve_checkpoint(folder, what="save_folder")
    except CheckpointError as e:
        return str(e)
    return f"save_folder {folder}'s latest checkpoint is {latest.name}: continue from it with --resume or --resume=auto"


def _check_start(cfg: TrainConfig, node: Node, info: DistInfo, log: Callable[[str], None]) -> None:
    """What a start checks beyond the node, without its side effects (no join, no metrics or trackers, nothing in
    save_folder): the run spec (codec, its settings, token and TLS files) and the downstream evaluators' data."""
    with tempfile.TemporaryDirectory() as scratch:
        evaluators_of(replace(cfg, save_folder=scratch), info, log)
    if cfg.sync_enabled:
        from spes.sync.peer import PeerSync

        PeerSync(cfg, node.model, info, log=log).close()


def node_trainer(
    cfg: TrainConfig, node: Node, info: DistInfo, *, syncer: Syncer | None, log: Callable[[str], None]
) -> Trainer:
    """The trainer of a built node (its model, optimizer, data and validation), its rounds through `syncer`: one
    place, so a test's node trains as `python -m spes.train`'s does."""
    return Trainer(
        cfg=cfg,
        model=node.model,
        optimizer=node.optimizer,
        loader=node.loader,
        info=info,
        eval_batches=node.eval_batches,
        syncer=syncer,
        log=log,
    )


def start_node(cfg: TrainConfig, info: DistInfo, log: Callable[[str], None] = print) -> tuple[Trainer, PeerSync | None]:
    """What `python -m spes.train` fits: the node built, its side of the rounds joined to the server (None for a
    centralized run), the trainer resumed from the node's checkpoint with the round it held in flight, if any.
    The caller closes the syncer once done."""
    node = build_node(cfg, info, log)
    syncer = None
    if cfg.sync_enabled:
        from spes.sync.node_files import read_run_id
        from spes.sync.peer import PeerSync

        run_id = read_run_id(node.checkpoint.path) if node.checkpoint is not None else None
        syncer = PeerSync(cfg, node.model, info, log=log, run_id=run_id)
    try:
        if syncer is not None:
            syncer.join()
        trainer = node_trainer(cfg, node, info, syncer=syncer, log=log)
        if node.checkpoint is not None:
            trainer.load_state_dict(node.checkpoint.trainer)
        if syncer is not None:
            rejoin(trainer, syncer, node.checkpoint, log)
    except BaseException:
        if syncer is not None:
            syncer.close()
        raise
    return trainer, syncer


def rejoin(trainer: Trainer, syncer: PeerSync, checkpoint: Checkpoint | None, log: Callable[[str], None]) -> None:
    """Where a joined node continues: at its checkpoint's step, with the round the interrupted run held in flight
    (applied when due); or, when the run has moved past that step, at the run's latest round."""
    if checkpoint is not None and checkpoint.trainer.get("step"):  # NOTE: not when its step is reset
        landed = syncer.resume(checkpoint.path, trainer.step)
        if landed is not None:
            trainer.resumed_round(landed)  # NOTE: moves on when this node had fallen behind the run
            log(f"step {trainer.step}: applied the round the interrupted run was waiting for")
    behind = syncer.catch_up(trainer.step)
    if behind is not None:
        trainer.resumed_round(behind)


def describe_experts(cfg: TrainConfig) -> str:
    """The node's mode (a DiLoCo baseline's log must not read as a SPES node's) and which experts it trains: a SPES
    peer a range of every MoE layer's (a layout may leave a peer none, which is legal but worth saying), any other
    node all of them."""
    owned, n = cfg.owned_experts(), cfg.model.moe_num_experts
    node = f"{MODE_TITLES[cfg.mode]} node, peer {cfg.spes_config.peer_id} of {cfg.num_peers}"
    if owned is None:
        who = node if cfg.sync_enabled else "centralized run"
        return f"{who}; experts: trains all {n} of every MoE layer"
    lo, hi = owned
    if lo == hi:
        return (
            f"{node}; experts: trains none ({cfg.experts_per_block} per peer leave it none of {n}), only the shared "
            "parameters"
        )
    return f"{node}; experts: trains {lo}..{hi - 1} of {n} in every MoE layer, the others frozen"


def _dataset(cfg: TrainConfig, key: str) -> TokenSequenceDataset:
    """Windows of `model.max_sequence_length` tokens over the shards `data.<key>` names (a path that names nothing
    is refused naming the key: the training data's and the validation data's look alike)."""
    try:
        shards = resolve_paths(getattr(cfg.data, key), ranged=cfg.data.url_reads == "range")
    except (FileNotFoundError, ValueError) as exc:
        raise type(exc)(f"data.{key}: {exc}") from None
    return TokenSequenceDataset(
        shards,
        cfg.model.max_sequence_length,
        cfg.data.memmap_dtype,
        vocab_size=cfg.model.vocab_size,
    )


def _validation(cfg: TrainConfig) -> Callable[[], Iterator[torch.Tensor]] | None:
    """A callable returning a fresh iterator of validation batches, or None without validation data."""
    if not cfg.data.validation_paths or not cfg.eval_interval:
        return None
    dataset = _dataset(cfg, "validation_paths")
    check_shard_vocab(dataset, cfg.model.vocab_size, "data.validation_paths")  # its loss would be of other text
    check_eos(dataset.paths, dataset.shard_infos, cfg.model.eos_token_id)
    if len(dataset) == 0:  # NOTE: else every evaluation reports a loss of 0 over no tokens
        raise ValueError(
            f"data.validation_paths hold no sequence of {dataset.seq_len} tokens: add validation data, or set "
            "data.validation_paths=[] to train without validation"
        )
    limit = None if cfg.eval_subset_num_batches < 0 else cfg.eval_subset_num_batches

    def batches() -> Iterator[torch.Tensor]:
        return iterate_eval_batches(dataset, cfg.device_eval_batch_size, limit)

    return batches
