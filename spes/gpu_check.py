"""GPU smoke test of a node: the CUDA paths no CPU machine can run, in under a minute.

    python -m spes.preflight --gpu [CONFIG.yaml] [--section.key=value ...]

On a machine with CUDA: a bf16 forward and backward of one decoder block of the config through its MoE backend
(`model.moe_backend`) with tokens/s, MFU and peak memory; the node's whole optimizer step timed by `spes.speed`
(the GPU benchmark's measurement: tokens/s and MFU by `tflops_per_token` and by the FLOPs done); with several
GPUs it re-launches itself under torchrun for an NCCL all-reduce across them (bus bandwidth) and one FSDP2
training step of a two-layer version of the model. With the config's `compile` key set, the block and the step
are compiled as the trainer compiles them (the warm-up call pays the compile time, the timed calls do not).
Without CUDA it says so in one line and checks nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from spes import monitor
from spes.checks import Check, fail, gib, matmul_flops_per_s, ok, report, skip

if TYPE_CHECKING:
    from spes.config import TrainConfig

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "spes_1b" / "node_0.yaml"
ITERS = 5
ALL_REDUCE_BYTES = 256 << 20


def peak_flops(device: torch.device) -> tuple[float, str]:
    """The device's peak rate for MFU: a GPU's datasheet bf16 figure, else its measured matmul rate."""
    datasheet = monitor.peak_flops(device)
    if datasheet is not None:
        return datasheet, "datasheet"
    return matmul_flops_per_s(device.type), "measured matmul"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory(device: torch.device) -> str:
    return gib(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else "n/a (CPU)"


def timed(step: Callable[[], None], device: torch.device) -> float:
    """Seconds per call of `step`, after one warm-up call."""
    step()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(ITERS):
        step()
    synchronize(device)
    return (time.perf_counter() - start) / ITERS


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def check_block(cfg: object, device: torch.device) -> Check:
    """bf16 autocast forward + backward of one decoder block on one micro-batch."""
    from spes.config import TrainConfig
    from spes.distributed import compile_kwargs
    from spes.model import Block, analytic_param_counts, rope_tables

    assert isinstance(cfg, TrainConfig)
    m = cfg.model
    owned = cfg.owned_experts()
    block = Block(
        m, block_size=cfg.experts_per_block, trainable_block=None if owned is None else cfg.spes_config.peer_id
    ).to(device)
    compiled = compile_kwargs(cfg.compile)
    if compiled is not None:
        block.compile(**compiled)
    cos, sin = rope_tables(m.max_sequence_length, m.head_dim, m.rope_theta, device=device)
    x = torch.randn(
        cfg.device_train_microbatch_size, m.max_sequence_length, m.d_model, device=device, requires_grad=True
    )

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            y, lb, z, _ = block(x, cos, sin)
        (y.float().square().mean() + lb + z).backward()

    reset_peak_memory(device)
    seconds = timed(step, device)
    tokens = x.shape[0] * x.shape[1]
    assert m.embedding_size is not None
    counts = analytic_param_counts(m)
    # NOTE: a block's active matmul parameters: all active ones but the embedding, LM head and final norm
    per_block = (counts.active_per_token - 2 * m.embedding_size * m.d_model - m.d_model) / m.n_layers
    flops = (6 * per_block + 6 * m.d_model * m.max_sequence_length) * tokens
    peak, source = peak_flops(device)
    return ok(
        "block",
        f"one {'compiled ' if compiled is not None else ''}block (d_model {m.d_model}, "
        f"{m.moe_num_experts} experts, backend {m.moe_backend}), "
        f"micro-batch {x.shape[0]} x {x.shape[1]}: "
        f"{tokens / seconds:,.0f} tokens/s, MFU {flops / seconds / peak:.1%} (of {peak / 1e12:,.3g} TFLOP/s, "
        f"{source}), peak memory {peak_memory(device)}",
    )


def check_step(cfg: object, device: torch.device, world: int) -> Check:
    """The node's optimizer step as `spes.train` runs it, timed and reported by `spes.speed`, the code of the GPU
    benchmark (bench/bench_gpu.py): its tokens/s and MFU are the benchmark's for this config."""
    import tempfile
    from dataclasses import replace

    from spes import speed
    from spes.config import TrainConfig

    assert isinstance(cfg, TrainConfig)
    if world > 1:
        return skip("step", "several ranks: the fsdp check trains a step across them")
    with tempfile.TemporaryDirectory(prefix="spes_gpu_check_") as scratch:
        node_cfg = replace(cfg, save_folder=scratch)
        trainer = speed.build_timed_node(node_cfg, device)
        times = speed.time_steps(trainer, lambda n: speed.random_batch(node_cfg, n))
        share = speed.trained_expert_share(trainer, speed.random_batch(node_cfg, node_cfg.device_train_microbatch_size))
        figures = speed.step_figures(node_cfg, times, device, share)
        backend = speed.moe_backend_of(trainer.model)
    memory = gib(figures["peak_memory_bytes"]) if figures["peak_memory_bytes"] is not None else "n/a (CPU)"
    return ok("step", f"node step ({step_settings(cfg, backend)}): {speed.describe(figures)}; peak memory {memory}")


def step_settings(cfg: TrainConfig, backend: str) -> str:
    """What the step line says it stepped (the GPU benchmark compares its figures with the variant of that)."""
    return (
        f"backend {backend}, {'compiled' if cfg.compile else 'eager'}, "
        f"{'fused_loss' if cfg.fused_loss else 'whole logits'}, activation checkpointing {cfg.activation_checkpointing}"
    )


def check_all_reduce(world: int, device: torch.device, num_bytes: int = ALL_REDUCE_BYTES) -> Check:
    """All-reduce of `num_bytes` of bf16 ones across the node's ranks: bus bandwidth, and the sum checked."""
    import torch.distributed as dist

    if world == 1:
        return skip("nccl", "one GPU: no all-reduce to test")
    x = torch.full((num_bytes // 2,), 1.0, dtype=torch.bfloat16, device=device)
    seconds = timed(lambda: dist.all_reduce(x), device)
    x.fill_(1.0)
    dist.all_reduce(x)
    if not bool((x == world).all()):
        return fail(
            "nccl",
            f"all-reduce of ones over {world} GPUs did not give {world}",
            "check the NCCL installation and the GPUs' interconnect (NCCL_DEBUG=INFO)",
        )
    bus = 2 * (world - 1) / world * num_bytes / seconds
    return ok(
        "nccl",
        f"all-reduce of {gib(num_bytes)} bf16 over {world} {dist.get_backend()} ranks: "
        f"{seconds * 1e3:.1f} ms, "
        f"bus bandwidth {bus / 1e9:,.1f} GB/s",
    )


def check_fsdp(cfg: object, world: int, rank: int, device: torch.device) -> Check:
    """One FSDP2 training step of a two-layer version of the node's model."""
    from dataclasses import replace

    from spes.config import TrainConfig
    from spes.distributed import DistInfo, apply_fsdp
    from spes.model import Transformer
    from spes.objective import micro_batch_loss
    from spes.optim import build_optimizer

    assert isinstance(cfg, TrainConfig)
    if world == 1:
        return skip("fsdp", "one GPU: FSDP2 needs at least two")
    small = replace(cfg, model=replace(cfg.model, n_layers=min(2, cfg.model.n_layers)), distributed_strategy="fsdp")
    with torch.device("meta"):
        model = Transformer.for_run(small, training=True)
    apply_fsdp(model, small, DistInfo(rank=rank, world_size=world, local_rank=rank, device=device))
    model.to_empty(device=device)
    model.init_weights(small.seed)
    optimizer = build_optimizer(model, small.optimizer)
    batch = torch.randint(
        0,
        small.model.vocab_size,
        (small.device_train_microbatch_size, small.model.max_sequence_length + 1),
        device=device,
    )
    reset_peak_memory(device)
    start = time.perf_counter()
    with torch.autocast(device.type, dtype=torch.bfloat16):
        loss, _, _ = micro_batch_loss(model, batch, small)  # the node's objective: `fused_loss` as configured
    loss.backward()
    optimizer.step()
    synchronize(device)
    if not torch.isfinite(loss):
        return fail("fsdp", f"loss {loss.item()} after one FSDP2 step", "check the model config and precision")
    return ok(
        "fsdp",
        f"one FSDP2 step of a {small.model.n_layers}-layer model over {world} ranks: loss "
        f"{loss.item():.3f}, {time.perf_counter() - start:.2f} s (first step), peak memory {peak_memory(device)}",
    )


def guarded(name: str, check: Callable[[], Check]) -> Check:
    """A check that raised fails with the exception as its line."""
    try:
        return check()
    except Exception as exc:  # NOTE: any CUDA/NCCL/compile failure is exactly what this test is for
        return fail(name, f"{type(exc).__name__}: {exc}", "see the error; the training run would fail the same way")


def main(config: str | None, overrides: list[str]) -> int:
    from spes.config import load_config

    if not torch.cuda.is_available():
        print(
            f"gpu: no CUDA device on this machine (torch {torch.__version__}): nothing to check here; run "
            f"`python -m spes.preflight --gpu` on the GPU node"
        )
        return 0
    world = int(os.environ.get("WORLD_SIZE", "1"))
    num_gpus = torch.cuda.device_count()
    if "WORLD_SIZE" not in os.environ and num_gpus > 1:
        # NOTE: NCCL and FSDP2 need one process per GPU: the same check again under torchrun
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={num_gpus}",
            "-m",
            "spes.gpu_check",
            str(config or DEFAULT_CONFIG),
            *overrides,
        ]
        return subprocess.run(cmd).returncode
    try:
        cfg = load_config(config or DEFAULT_CONFIG, overrides)[0].on_device("cuda")
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    rank = int(os.environ.get("RANK", "0"))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("nccl")
    try:
        checks = [
            guarded("block", lambda: check_block(cfg, device)),
            guarded("step", lambda: check_step(cfg, device, world)),
            guarded("nccl", lambda: check_all_reduce(world, device)),
            guarded("fsdp", lambda: check_fsdp(cfg, world, rank, device)),
        ]
    finally:
        if world > 1:
            torch.distributed.destroy_process_group()
    if rank == 0:
        print(f"gpu check of {config or DEFAULT_CONFIG} on {num_gpus} x {torch.cuda.get_device_name(device)}")
        return report(checks)
    return 1 if any(c.failed for c in checks) else 0


if __name__ == "__main__":
    args = sys.argv[1:]
    raise SystemExit(
        main(next((a for a in args if not a.startswith("--")), None), [a for a in args if a.startswith("--")])
    )
