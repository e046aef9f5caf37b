"""Data parallelism inside one SPES node, applied to a plain model from outside (torchtitan's `parallelize`).

A SPES node is an ordinary trainer: `single` (one process), `ddp`, or `fsdp` (FSDP2 `fully_shard` per
decoder block) under `torchrun`. The process group spans the node's ranks only; nodes meet only at
the parameter server. Frozen experts carry `requires_grad=False`, so neither DDP nor FSDP allocates
gradient buffers for them or communicates their gradients (tests/grad_meter.py measures it).

The SPES round needs whole tensors on the one rank that talks to the server and the merged tensors back
on every rank: `gather_full` and `load_full` move them one tensor at a time, so a rank never holds more
than the trainable tensors plus one full tensor, and frozen experts are never gathered.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeGuard

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from spes.config import TrainConfig
from spes.schema import ConfigError

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _env_int(name: str, env: Mapping[str, str]) -> int:
    value = env[name]
    if not re.fullmatch(r"\d+", value.strip()):
        raise ConfigError(f"environment variable {name}={value!r} must be a non-negative integer (set by torchrun)")
    return int(value)


def check_launch(cfg: TrainConfig, env: Mapping[str, str], num_gpus: int) -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from torchrun's variables, or (0, 1, 0) without them.

    Refuses, before any process group exists, a half-set torchrun environment, a strategy that cannot use
    the ranks, and a global batch the ranks cannot split into whole micro-batches.
    """
    present = [v for v in TORCHRUN_VARS if v in env]
    if not present:
        return 0, 1, 0
    world = _env_int("WORLD_SIZE", env) if "WORLD_SIZE" in env else None
    missing = [v for v in TORCHRUN_VARS if v not in env]
    if missing and world != 1:
        raise ConfigError(
            f"{', '.join(present)} are set but {', '.join(missing)} are not: launch multi-process "
            f"runs with torchrun (e.g. torchrun --standalone --nproc_per_node=N -m spes.train ...) "
            f"or unset them to run one process"
        )
    assert world is not None
    rank = _env_int("RANK", env) if "RANK" in env else 0
    local_rank = _env_int("LOCAL_RANK", env) if "LOCAL_RANK" in env else 0
    if world < 1 or rank >= world:
        raise ConfigError(f"RANK={rank} must be in [0, WORLD_SIZE={world}); check the launcher's variables")
    if num_gpus and local_rank >= num_gpus:
        raise ConfigError(
            f"LOCAL_RANK={local_rank} but this machine has {num_gpus} GPU(s): run at most --nproc_per_node={num_gpus}"
        )
    if world > 1:
        if cfg.distributed_strategy in (None, "single"):
            raise ConfigError(
                f"config key 'distributed_strategy' = {cfg.distributed_strategy!r} cannot run on "
                f"{world} processes; use ddp or fsdp (or launch one process)"
            )
        per_step = world * cfg.device_train_microbatch_size
        if cfg.global_train_batch_size % per_step != 0:
            raise ConfigError(
                f"config key 'global_train_batch_size' = {cfg.global_train_batch_size} must be divisible "
                f"by world_size ({world}) x device_train_microbatch_size "
                f"({cfg.device_train_microbatch_size}) = {per_step}; change one of them or the number "
                f"of processes"
            )
    return rank, world, local_rank


def init_distributed(cfg: TrainConfig) -> DistInfo:
    """Join the node's process group (torchrun's env vars) or run as one process; pick the device."""
    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    rank, world, local_rank = check_launch(cfg, os.environ, num_gpus)
    device = torch.device("cuda", local_rank) if num_gpus else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return DistInfo(rank=rank, world_size=world, local_rank=local_rank, device=device)


def shutdown_distributed(clean: bool) -> None:
    """Leave the process group.

    NOTE: gloo's worker threads free finished work (tensors with Python objects: they need the GIL) a moment
    after `wait()` returns, and freeing the process group joins those threads. The Python handle frees it with
    the GIL released; DDP's C++ reducer, if it holds the last reference, does not, and the process hangs at
    exit. So the caller drops every DDP wrapper first (spes.node.run), and on a clean exit the ranks meet at a
    barrier so no rank leaves while another still talks to it.
    """
    if not dist.is_initialized():
        return
    if clean:
        dist.barrier()
    dist.destroy_process_group()


def uses_fsdp(cfg: TrainConfig, info: DistInfo) -> bool:
    """Whether `parallelize` shards the model (FSDP2 on more than one rank)."""
    return cfg.distributed_strategy == "fsdp" and info.world_size > 1


def parallelize(model: nn.Module, cfg: TrainConfig, info: DistInfo) -> nn.Module:
    """Activation checkpointing, torch.compile per block, then DDP or FSDP2 per block, as the config asks."""
    apply_checkpointing_and_compile(model, cfg.activation_checkpointing, cfg.compile)
    if info.world_size == 1 or cfg.distributed_strategy in (None, "single"):
        return model
    if cfg.distributed_strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(
            model,
            device_ids=[info.local_rank] if info.device.type == "cuda" else None,
            find_unused_parameters=cfg.ddp.find_unused_params,
        )
    return apply_fsdp(model, cfg, info)


def apply_fsdp(model: nn.Module, cfg: TrainConfig, info: DistInfo) -> nn.Module:
    """FSDP2 with the reference `fsdp` keys mapped onto `fully_shard`.

    sharding_strategy: FULL_SHARD reshards parameters after forward; SHARD_GRAD_OP keeps them gathered
    until backward; NO_SHARD replicates them (a (world, 1) mesh: HSDP with shards of one); HYBRID_SHARD
    is FULL_SHARD, since a SPES node's group never spans nodes. wrapping_strategy by_block shards each
    decoder block as its own unit (null: one unit for the whole model). precision under amp_bf16: mixed
    gathers bf16 parameters and reduces gradients in fp32, pure reduces in bf16, float keeps fp32.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    fsdp = cfg.fsdp
    if fsdp.sharding_strategy == "NO_SHARD":
        mesh = init_device_mesh(info.device.type, (info.world_size, 1), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(info.device.type, (info.world_size,), mesh_dim_names=("shard",))
    mp = MixedPrecisionPolicy()
    if cfg.precision == "amp_bf16" and fsdp.precision in ("mixed", "pure"):
        mp = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32 if fsdp.precision == "mixed" else torch.bfloat16
        )
    reshard = fsdp.sharding_strategy != "SHARD_GRAD_OP"
    if fsdp.wrapping_strategy == "by_block":
        for block in model.blocks:  # type: ignore[union-attr]  # torch types a submodule as Tensor | Module
            fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    return model


def apply_checkpointing_and_compile(model: nn.Module, mode: str | bool | None, options: dict | bool | None) -> None:
    """Activation checkpointing (config key `activation_checkpointing`), then `torch.compile` per block (`compile`).

    Checkpointing recomputes in backward whole blocks, a block's attention and expert sublayers separately
    (`fine_grained`: `Block.attn_sublayer`, `Block.ffn_sublayer`, each with its norm and residual add), or one in N
    blocks. The unit's method is wrapped in place (rather than with `checkpoint_wrapper`), so parameter names, which
    the sync path and checkpoints rely on, do not change; FSDP2's hooks run in the block's `__call__`, outside the
    wrapped methods, so a block's parameters are gathered before its recomputation.

    Compile goes per block, as torchtitan does: one block's graph is compiled once and reused by every layer, and
    the MoE's data-dependent routing breaks only the graph it lives in. A recomputed unit is compiled inside its
    checkpoint, `checkpoint(torch.compile(unit))`, rather than traced through it: Inductor (torch 2.11, CUDA)
    failed on a block graph holding the checkpoint (bench/results/bench_gpu.json). The final norm and
    `fused_loss`'s chunk of the LM head and loss are compiled too: nothing the size of the residual stream runs
    eager.
    `compile` null/false keeps eager mode; true uses torch's defaults; a mapping passes `mode`, `fullgraph`,
    `dynamic`, `backend` on (OLMo's `compile:` section).
    """
    kwargs = compile_kwargs(options)
    every = {"one_in_two": 2, "one_in_four": 4}.get(str(mode), 1)
    units = ["attn_sublayer", "ffn_sublayer"] if mode == "fine_grained" else ["forward"]  # a block's methods
    for i, block in enumerate(model.blocks):  # type: ignore[arg-type]  # torch types a submodule as Tensor | Module
        recomputed = [] if not mode or i % every else units
        for name in recomputed:
            unit = getattr(block, name)
            unit = unit if kwargs is None else torch.compile(unit, **kwargs)
            setattr(block, name, functools.partial(checkpoint, unit, use_reentrant=False))
        if kwargs is not None and not recomputed:
            block.compile(**kwargs)
    if kwargs is not None:  # the final norm, and `fused_loss`'s head: a chunk's loss and gradient in one pass
        model.norm.compile(**kwargs)  # type: ignore[union-attr]
        model.head_chunk_fns = model.head_chunk_fns.compiled(**kwargs)  # type: ignore[union-attr,operator]


COMPILE_OPTIONS = ("mode", "fullgraph", "dynamic", "backend")


def compile_kwargs(options: dict | bool | None) -> dict | None:
    """The `torch.compile` keyword arguments the config key `compile` asks for; None for eager mode."""
    if not options:
        return None
    kwargs = dict(options) if isinstance(options, dict) else {}
    unknown = sorted(set(kwargs) - set(COMPILE_OPTIONS))
    if unknown:
        raise ConfigError(
            f"config key 'compile.{unknown[0]}' is not a torch.compile option spes passes on; "
            f"use {list(COMPILE_OPTIONS)}"
        )
    modes = list(torch._inductor.list_mode_options())  # what torch.compile's docstring points to for its modes
    backends = torch.compiler.list_backends(exclude_tags=())  # by name; a callable backend (Python only) is its own
    for key, allowed in (("mode", modes), ("backend", backends)):
        if key in kwargs and not callable(kwargs[key]) and kwargs[key] not in allowed:
            raise ConfigError(f"config key 'compile.{key}' = {kwargs[key]!r} is not one of torch.compile's {allowed}")
    if kwargs.get("mode") == "default":
        kwargs.pop("mode")  # OLMo's configs spell torch's default mode out
    return kwargs


@contextlib.contextmanager
def grad_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Skip the gradient all-reduce/reduce-scatter on all but the last micro-batch of a step."""
    if enabled:
        yield
    elif (no_sync := getattr(model, "no_sync", None)) is not None:  # DDP
        with no_sync():
            yield
    elif (set_sync := getattr(model, "set_requires_gradient_sync", None)) is not None:  # FSDP2
        set_sync(False)
        try:
            yield
        finally:
            set_sync(True)
    else:
        yield


def is_dtensor(t: object) -> TypeGuard[DTensor]:
    """Whether `t` is an FSDP2 shard, asked without importing DTensor: that import (with the sympy it pulls in)
    costs every trainer that never shards over a second of start-up, and no DTensor exists before it."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def unwrap(model: nn.Module) -> nn.Module:
    """The plain Transformer inside a DDP wrapper (FSDP2 shards in place, so it is the model itself)."""
    return model.module if hasattr(model, "module") and isinstance(model.module, nn.Module) else model


def all_reduce_mean(values: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Mean of a metric tensor over the node's ranks (identity for one process)."""
    if info.world_size > 1:
        values = values.clone()
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
        values /= info.world_size
    return values


def process_rank() -> int:
    """This process's rank in the default process group (0 without one)."""
    return dist.get_rank() if dist.is_initialized() else 0


def process_world_size() -> int:
    """The default process group's size (1 without one)."""
    return dist.get_world_size() if dist.is_initialized() else 1


def barrier() -> None:
    """Wait for every rank (nothing to wait for without a process group)."""
    if dist.is_initialized():
        dist.barrier()


def all_ranks_ok(ok: bool) -> bool:
    """Whether every rank reports ok (a collective)."""
    return bool(all_ranks_min(int(ok)))


def all_ranks_min(value: int) -> int:
    """The smallest of every rank's `value` (a collective; int64)."""
    if not dist.is_initialized():
        return value
    flag = torch.tensor([value], dtype=torch.int64, device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return int(flag.item())


# ---------------------------------------------------------------------------------------------------------------
# Whole tensors for the SPES round: gathered to the main rank, loaded back on every rank.


def gather_full(model: nn.Module, names: list[str], info: DistInfo) -> dict[str, torch.Tensor]:
    """Full fp32 CPU copies of the named parameters on the main rank ({} elsewhere); collective under FSDP.

    One tensor is gathered at a time, so no rank holds more than the result plus one full tensor; names
    not asked for (the frozen experts, for a SPES upload) are never gathered.
    """
    params = dict(unwrap(model).named_parameters())
    out: dict[str, torch.Tensor] = {}
    for name in names:
        p = params[name].detach()
        full = p.full_tensor() if is_dtensor(p) else p
        if info.is_main:
            out[name] = full.to("cpu", torch.float32, copy=True)
        del full
    return out


@torch.no_grad()
def load_full(model: nn.Module, tensors: dict[str, torch.Tensor], info: DistInfo) -> None:
    """Copy whole tensors held by the main rank into every rank's parameters (their shards, under FSDP).

    Only the main rank's `tensors` are read; the names travel as JSON and each tensor is broadcast on its
    own, so ranks hold one full tensor at a time. Parameters are updated in place, which keeps the
    optimizer's state attached to them.
    """
    params = dict(unwrap(model).named_parameters())
    names = _broadcast_names(sorted(tensors) if info.is_main else [], info)
    unknown = [n for n in names if n not in params]
    if unknown:
        raise ValueError(f"received tensors this model does not have: {unknown[:3]}")
    for name in names:
        p = params[name]
        if info.is_main:
            full = tensors[name]
            if tuple(full.shape) != tuple(p.shape):
                raise ValueError(f"received {name} of shape {tuple(full.shape)}, the model has {tuple(p.shape)}")
            if info.world_size > 1 or is_dtensor(p):  # broadcast and sharding need p's device and dtype
                full = full.to(info.device, p.dtype)
        else:
            full = torch.empty(p.shape, dtype=p.dtype, device=info.device)
        if info.world_size > 1:
            dist.broadcast(full, src=0)
        if is_dtensor(p):
            from torch.distributed.tensor import distribute_tensor

            shard = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
            p.to_local().copy_(shard.to_local())
        else:
            p.copy_(full)
        del full


def _broadcast_names(names: list[str], info: DistInfo) -> list[str]:
    """The main rank's list of names on every rank, as UTF-8 JSON (no pickle)."""
    if info.world_size == 1:
        return names
    payload = json.dumps(names).encode() if info.is_main else b""
    size = torch.tensor([len(payload)], dtype=torch.int64, device=info.device)
    dist.broadcast(size, src=0)
    buf = torch.empty(int(size.item()), dtype=torch.uint8, device=info.device)
    if info.is_main:
        buf.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    dist.broadcast(buf, src=0)
    return json.loads(bytes(buf.cpu().tolist()).decode())
