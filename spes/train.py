"""Train one SPES node (or a centralized / DiLoCo run) from a YAML config.

    # one process, no parameter server (centralized)
    python -m spes.train configs/tiny.yaml --using_spes=false
    # one process, one SPES node (a parameter server must be running)
    python -m spes.train configs/tiny.yaml --spes_config.peer_id=0
    # one node, 4 GPUs (DDP or FSDP2 per `distributed_strategy`)
    torchrun --standalone --nproc_per_node=4 -m spes.train configs/spes_1b/node_0.yaml
    # several nodes: run_scripts/run_single_node.sh <node_id> on each, or run_scripts/run_cluster.sh under SLURM

Any key can be overridden as `--section.key=value`; `--resume` continues from `<save_folder>/latest`, and
`--resume=auto` (`try_load_latest_save: true`) does when a checkpoint exists there and starts fresh otherwise.
A failure the user can cause or meet ends in one line `error: ...` on stderr and a non-zero exit.
Order of construction: config -> process group -> data (checked before any model exists) -> model on meta ->
weights -> parallelize (under FSDP2: parallelize, then each rank's shards of the weights) -> optimizer ->
sync client -> trainer (`start_node`) -> fit, torn down in `finally`.
"""

from __future__ import annotations

import gc
import os
import sys
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from spes.checkpoint import Checkpoint, list_checkpoints, restore
from spes.config import ConfigError, TrainConfig, config_help, load_config
from spes.data import BatchLoader, TokenSequenceDataset, iterate_eval_batches
from spes.distributed import DistInfo, init_distributed, parallelize, shutdown_distributed, unwrap, uses_fsdp
from spes.guard import NonFiniteError, check_weights_finite
from spes.model import Transformer, count_params
from spes.optim import build_optimizer, optimizer_state_bytes
from spes.shards import resolve_paths
from spes.sync.client import SyncError
from spes.tokenizer import check_vocab, load_tokenizer
from spes.torchrun import ERROR_DIR_ENV
from spes.trainer import Trainer

if TYPE_CHECKING:  # the sync wing (grpc) is imported only by runs that sync
    from spes.sync.peer import PeerSync

USAGE = """usage: python -m spes.train CONFIG.yaml [--section.key=value ...] [--resume[=auto]]

Train one node of a SPES run (or a centralized / DiLoCo run) described by an OLMo-style YAML file.
  CONFIG.yaml          e.g. configs/tiny.yaml, configs/spes_1b/node_0.yaml
  --section.key=value  override any key, e.g. --spes_config.peer_id=1 --data.seed=6198
  --resume             continue from <save_folder>/latest (same as --load_path=<save_folder>)
  --resume=auto        continue from it if it exists, else start fresh (same as --try_load_latest_save=true)
  --help               this text and every config key with its default
"""


# What a user can cause or meet: each ends the run with its message as one line and this exit code (the first
# that matches). OSError: a full disk or an unwritable save_folder; KeyboardInterrupt: a second Ctrl-C.
USER_ERRORS: dict[type[BaseException], int] = {
    ValueError: 2,
    FileNotFoundError: 2,
    SyncError: 3,
    NonFiniteError: 4,
    torch.OutOfMemoryError: 5,
    OSError: 6,
    KeyboardInterrupt: 130,
}
HINTS: dict[type[BaseException], str] = {
    torch.OutOfMemoryError: "lower device_train_microbatch_size or set activation_checkpointing",
    KeyboardInterrupt: "interrupted without saving; resume from the last checkpoint with --resume",
}


def parse_args(argv: list[str]) -> tuple[str | None, list[str], str | None]:
    """(config file, overrides, resume: None, "always" or "auto")."""
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE + "\nconfig keys:\n" + "\n".join(config_help()))
        raise SystemExit(0)
    positional = [a for a in argv if not a.startswith("--")]
    if len(positional) > 1:
        raise ConfigError(f"expected one config file, got {positional}; overrides must look like --section.key=value")
    flags = [a for a in argv if a == "--resume" or a.startswith("--resume=")]
    if any(a not in ("--resume", "--resume=auto") for a in flags):
        raise ConfigError(f"command line: {flags[0]!r} is not an option; use --resume or --resume=auto")
    overrides = [a for a in argv if a.startswith("--") and a not in flags]
    resume = None if not flags else ("auto" if flags[-1] == "--resume=auto" else "always")
    return (positional[0] if positional else None), overrides, resume


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        path, overrides, resume = parse_args(argv)
        if path is None:
            raise ConfigError("no config file given; try: python -m spes.train configs/tiny.yaml (or --help)")
        cfg, inert = load_config(path, overrides)
        if resume == "always":
            cfg.load_path = cfg.save_folder
        cfg.try_load_latest_save |= resume == "auto"
        return run(cfg, inert)
    except tuple(USER_ERRORS) as e:
        return _report(e)


def _report(e: BaseException) -> int:
    """Print the failure as one line (and leave it for `spes.torchrun`); its exit code."""
    hint = next((h for kind, h in HINTS.items() if isinstance(e, kind)), None)
    line = "error: " + "; ".join(" ".join(part.split()) for part in (str(e), hint) if part)
    print(line, file=sys.stderr, flush=True)
    if os.environ.get(ERROR_DIR_ENV):
        with open(os.path.join(os.environ[ERROR_DIR_ENV], f"rank{os.environ.get('RANK', '0')}.txt"), "w") as f:
            f.write(line + "\n")
    return next(code for kind, code in USER_ERRORS.items() if isinstance(e, kind))


def _start_from(cfg: TrainConfig, log: Callable[[str], None]) -> str | None:
    """The checkpoint to load: save_folder's latest under `try_load_latest_save` when it has one, else load_path."""
    if cfg.try_load_latest_save:
        if list_checkpoints(cfg.save_folder):
            return cfg.save_folder
        log(f"no checkpoint in {cfg.save_folder} yet: starting {'from ' + cfg.load_path if cfg.load_path else 'fresh'}")
    return cfg.load_path


def check_shard_vocab(dataset: TokenSequenceDataset, embedding_size: int) -> None:
    """Refuse shards whose token ids may exceed the embedding (they would crash mid-step), naming the first."""
    for path, info in zip(dataset.paths, dataset.shard_infos):
        if info is not None and info.vocab_size > embedding_size:  # NOTE: a bare OLMo file records none
            raise ValueError(
                f"token shard {path} was written with a vocabulary of {info.vocab_size} but the model "
                f"embeds only {embedding_size} ids (model.embedding_size); re-tokenize it with "
                f"tokenizer.identifier's tokenizer or drop it from data.paths"
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
    """Data (checked first: a wrong path or vocabulary fails in seconds) -> model on meta -> weights ->
    parallelize -> optimizer -> checkpoint (either kind, any rank count).

    Under FSDP2 the model is sharded while still on meta and each rank allocates only its shards.
    """
    tokenizer = load_tokenizer(cfg.tokenizer.identifier)
    check_vocab(tokenizer.vocab_size, cfg.model.vocab_size, cfg.model.embedding_size)
    dataset = _dataset(cfg, cfg.data.paths)
    assert cfg.model.embedding_size is not None  # set from vocab_size in ModelConfig.__post_init__
    check_shard_vocab(dataset, cfg.model.embedding_size)
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
    log(f"data order seed {cfg.data_seed} (data.seed {cfg.data.seed} + 1000 * peer_id {cfg.spes_config.peer_id})")
    eval_batches = _validation(cfg)
    torch.manual_seed(cfg.seed)
    with torch.device("meta"):
        transformer = Transformer.for_run(cfg)
    log(count_params(transformer).describe())
    model: nn.Module = transformer  # wrapped by parallelize below
    sharded = uses_fsdp(cfg, info)
    if sharded:
        model = parallelize(model, cfg, info)
    model.to_empty(device=info.device)
    cast(Transformer, unwrap(model)).init_weights(cfg.seed)
    if not sharded:  # NOTE: DDP broadcasts rank 0's weights at wrapping, so they must exist first
        model = parallelize(model, cfg, info)
    optimizer = build_optimizer(model, cfg.optimizer)
    ckpt = None
    load_path = _start_from(cfg, log)
    if load_path:
        ckpt = restore(load_path, model, optimizer)
        check_weights_finite(model, info, f"checkpoint {ckpt.path}", "pass an earlier checkpoint as load_path")
        log(f"loaded {ckpt.path} (step {ckpt.trainer.get('step', 0)})")
    return Node(model=model, optimizer=optimizer, loader=loader, eval_batches=eval_batches, checkpoint=ckpt)


def run(cfg: TrainConfig, inert: list[str] | None = None) -> int:
    info = init_distributed(cfg)
    finished = False
    try:
        _train(cfg, info, inert)
        finished = True
        return 0
    except BaseException as e:
        # NOTE: the traceback's frames still hold the DDP wrapper; freed after the process group is gone, its
        # C++ reducer would tear gloo down with the GIL held (see shutdown_distributed). Drop them first.
        traceback.clear_frames(e.__traceback__)
        raise
    finally:
        gc.collect()  # and the reference cycles that may hold it
        shutdown_distributed(clean=finished)
        gc.freeze()  # NOTE: else the interpreter's exit scans the ~300k objects left again: seconds on a busy host


def _train(cfg: TrainConfig, info: DistInfo, inert: list[str] | None) -> None:
    """Build the node and fit it; every reference to the wrapped model dies with this frame."""
    log = print if info.is_main else (lambda _msg: None)
    if inert:
        log(f"note: these config keys change nothing in spes and are ignored: {', '.join(inert)}")
    trainer, syncer = start_node(cfg, info, log)
    try:
        trainer.fit()
        log(
            f"done: step {trainer.step}, {trainer.tokens:,} tokens, optimizer state "
            f"{optimizer_state_bytes(trainer.optimizer) / 2**20:.1f} MiB"
        )
    finally:
        if syncer is not None:
            syncer.close()


def start_node(cfg: TrainConfig, info: DistInfo, log: Callable[[str], None] = print) -> tuple[Trainer, PeerSync | None]:
    """What `python -m spes.train` fits: the node built, its side of the rounds joined to the server (None for a
    centralized run), the trainer resumed from the node's checkpoint with the round it held in flight, if any.
    The caller closes the syncer once done."""
    node = build_node(cfg, info, log)
    syncer = None
    if cfg.sync_enabled:
        from spes.sync.peer import PeerSync, read_run_id

        run_id = read_run_id(node.checkpoint.path) if node.checkpoint is not None else None
        syncer = PeerSync(cfg, node.model, info, log=log, run_id=run_id)
    try:
        if syncer is not None:
            syncer.join()
        trainer = Trainer(
            cfg=cfg,
            model=node.model,
            optimizer=node.optimizer,
            loader=node.loader,
            info=info,
            eval_batches=node.eval_batches,
            syncer=syncer,
            log=log,
        )
        if node.checkpoint is not None:
            trainer.load_state_dict(node.checkpoint.trainer)
            landed = syncer.resume(node.checkpoint.path, trainer.step) if syncer is not None else None
            if landed is not None:
                trainer.step = landed.step  # NOTE: moves on when this node had fallen behind the run
                log(f"step {trainer.step}: applied the round the interrupted run was waiting for")
    except BaseException:
        if syncer is not None:
            syncer.close()
        raise
    return trainer, syncer


def _dataset(cfg: TrainConfig, paths: list[str]) -> TokenSequenceDataset:
    """Windows of `model.max_sequence_length` tokens over the shards `paths` name."""
    return TokenSequenceDataset(resolve_paths(paths), cfg.model.max_sequence_length, cfg.data.memmap_dtype)


def _validation(cfg: TrainConfig) -> Callable[[], Iterator[torch.Tensor]] | None:
    """A callable returning a fresh iterator of validation batches, or None without validation data."""
    if not cfg.data.validation_paths or not cfg.eval_interval:
        return None
    dataset = _dataset(cfg, cfg.data.validation_paths)
    limit = None if cfg.eval_subset_num_batches < 0 else cfg.eval_subset_num_batches

    def batches() -> Iterator[torch.Tensor]:
        return iterate_eval_batches(dataset, cfg.device_eval_batch_size, limit)

    return batches


if __name__ == "__main__":
    raise SystemExit(main())
