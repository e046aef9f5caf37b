#!/usr/bin/env python
"""The 1B SPES node on one GPU: tokens/s, MFU, peak memory and a kernel profile per training variant.

    bash bench/run_gpu.sh                                    # on the lent GPU machine: this, the GPU tests, $OUT
    python bench/bench_gpu.py --device cuda --out X.json     # the benchmark alone
    python bench/bench_gpu.py --quick                        # CPU smoke run on a cut-down shape (tests)

The node is `configs/spes_1b/node_0.yaml` as `spes.train` builds it (peer 0, amp_bf16, fine-grained activation
checkpointing), timed by `spes.speed`, the measurement `python -m spes.preflight --gpu` reports too. Variants
change one thing at a time from there: `model.moe_backend` (torch, grouped_mm, megablocks when importable),
`compile` off/on (and in torch's reduce-overhead mode: CUDA graphs), `fused_loss` off/on, the micro-batch (4, 8,
16), activation checkpointing off, larger chunks of `fused_loss`'s head (`spes.head_loss.LOSS_CHUNK_ELEMENTS`, set
for the variant), liger-kernel's fused linear cross entropy in place of `spes.head_loss` (the well-kept kernel
library measured against the project's own head; its wheel carried by `bench/prepare_gpu.sh`); the variant of the
CUDA defaults runs once more after those, so the record shows how much one run drifts.

What a variant measures, honestly: a step of the config's 256 sequences takes seconds, so steps of 1 and of 4
micro-batches of the variant's real shape (micro-batch x 2,048 tokens) are timed (5 each, after two warm-up
steps of 4, the first of which also compiles), and the whole step is projected from the line through their medians
(`spes.speed`; `timed_spread` says how far apart the timings of 4 were):
`step_s`, `tokens_per_s`, `mfu` (by `tflops_per_token`) and `mfu_done` (by the FLOPs done: frozen experts skip
their weight gradients; the share of routed copies on trained experts is read from a forward). The largest
timed step's own figures are kept beside them (`measured_*`). Peak memory is `torch.cuda.max_memory_allocated`
over the timed steps. One step of 2 micro-batches runs under `torch.profiler` (the 20 kernels with the most
device time, and the 20 eager aten ops by input shapes whose kernels took the most: what launched a kernel) and
one under CUDA's sync debug mode (host-device synchronizations per step; on the CPU, `spes.speed.SyncCounter`
counts the sync points of spes code instead).

Each variant runs in a process of its own (`--variant NAME`), so none is measured in what an earlier one left
behind: its compiled graphs, the allocator's cache, a grown Python heap, a sticky CUDA error. Each row's
`device_busy` is the profiled step's kernel time over the timed step of as many micro-batches: below 1, the
device waited for the host (or a sync, or a pause) that long. The record is rewritten after every variant, so a
variant that fails (out of memory, a compile error, a crash, a hang past `--variant_timeout_s`) is recorded as
such and a run cut short keeps what it measured; variants past `--budget_s` are recorded as skipped. With more
than one GPU, an NCCL all-reduce and an FSDP2 step run too (`spes.gpu_check`, under torchrun); with one, the record
says they did not.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
import xml.etree.ElementTree as ET
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from unittest import mock

import torch

import spes.head_loss
import spes.model
from common import REPO_ROOT, format_table, git_commit, machine_info, parser, vocabulary
from records import CUDA_DEFAULTS, PROFILED_MICRO_BATCHES
from spes import speed
from spes.atomic import write_atomic
from spes.checks import matmul_flops_per_s
from spes.config import load_config
from spes.gpu_check import step_settings
from spes.trainer import Trainer

CONFIG = REPO_ROOT / "configs" / "spes_1b" / "node_0.yaml"
CUT = [  # --quick / the CPU: the 1B layout (16 experts, top-2, 4 peers) at a shape a CPU steps in a second
    "--model.d_model=64",
    "--model.n_heads=4",
    "--model.n_layers=2",
    "--model.mlp_hidden_size=128",
    "--model.max_sequence_length=32",
    *vocabulary(512),
    "--precision=fp32",
]
TOP_KERNELS = 20
MICRO_BATCHES = {False: (1, 4), True: (1, 2)}
"""Micro-batches per timed step (full run, quick run): the step is projected from the line through the two."""


@dataclass(frozen=True)
class Variant:
    name: str
    backend: str
    compile: bool
    fused_loss: bool
    micro_batch: int
    checkpointing: bool = True
    loss_chunk: int | None = None  # `spes.head_loss.LOSS_CHUNK_ELEMENTS` for this variant (no config key sets it)
    head: str | None = None  # "liger": liger-kernel's head and loss instead of spes.head_loss's (no config key)
    compile_mode: str | None = None  # the config's `compile.mode` (torch.compile's; None: its default)

    def overrides(self) -> list[str]:
        flags = [
            f"--model.moe_backend={self.backend}",
            f"--fused_loss={str(self.fused_loss).lower()}",
            f"--device_train_microbatch_size={self.micro_batch}",
        ]
        return flags + ([] if self.checkpointing else ["--activation_checkpointing=null"])


AGAIN = f"{CUDA_DEFAULTS} again"
"""The CUDA defaults' variant measured once more after the open questions: its two figures bound the drift within
one run."""


def variants(quick: bool) -> list[Variant]:
    """One change at a time from the CUDA defaults (grouped_mm, compiled, `fused_loss`, micro-batch 8), the
    questions open first (a run cut short by its budget keeps those) with the two likeliest wins together (so a
    default changed to both rests on a measurement of both), the defaults again after them."""
    if quick:
        return [
            Variant("torch", "torch", False, False, 4),
            Variant("grouped_mm", "grouped_mm", False, False, 4),
            Variant("grouped_mm+fused", "grouped_mm", False, True, 8),
        ]
    return [
        Variant(CUDA_DEFAULTS, "grouped_mm", True, True, 8),
        # NOTE: without checkpointing first: its profile in bench_gpu_head.json had 18% less kernel time per
        # micro-batch than the default's (its clock time there is not its own: the GPU waited), at 21 GiB
        Variant("grouped_mm+fused+compile no-ckpt", "grouped_mm", True, True, 8, checkpointing=False),
        Variant("grouped_mm+fused+compile chunk x4", "grouped_mm", True, True, 8, loss_chunk=1 << 28),
        Variant(
            "grouped_mm+fused+compile chunk x4 no-ckpt",
            "grouped_mm",
            True,
            True,
            8,
            checkpointing=False,
            loss_chunk=1 << 28,
        ),
        Variant("grouped_mm+liger+compile", "grouped_mm", True, True, 8, head="liger"),
        Variant("grouped_mm+fused+compile chunk x16", "grouped_mm", True, True, 8, loss_chunk=1 << 30),
        # NOTE: CUDA graphs for a host that cannot keep the GPU fed (`device_busy` below 1); without checkpointing,
        # as a compiled module inside a non-reentrant checkpoint fails under them (pytorch/pytorch#154306)
        Variant(
            "grouped_mm+fused+compile reduce-overhead no-ckpt",
            "grouped_mm",
            True,
            True,
            8,
            checkpointing=False,
            compile_mode="reduce-overhead",
        ),
        Variant("grouped_mm+compile", "grouped_mm", True, False, 8),
        Variant("grouped_mm+fused", "grouped_mm", False, True, 8),
        Variant(AGAIN, "grouped_mm", True, True, 8),
        Variant("grouped_mm+fused+compile mb16", "grouped_mm", True, True, 16),
        Variant("grouped_mm+fused+compile mb4", "grouped_mm", True, True, 4),
        Variant("grouped_mm", "grouped_mm", False, False, 8),
        Variant("torch+fused", "torch", False, True, 8),
        Variant("torch", "torch", False, False, 8),
        Variant("megablocks+fused", "megablocks", False, True, 8),
    ]


def compile_option(v: Variant, quick: bool) -> dict | bool:
    """The config's `compile` for a variant: static shapes on the GPU (one compile per micro-batch shape), in the
    variant's mode; on a quick run dynamo's tracing without Inductor (seconds)."""
    if not v.compile:
        return False
    if quick:
        return {"backend": "eager"}
    return {"dynamic": False, **({"mode": v.compile_mode} if v.compile_mode else {})}


def device_info(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {"device": str(device), "gpus": torch.cuda.device_count() if device.type == "cuda" else 0}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(
            name=props.name,
            capability=list(torch.cuda.get_device_capability(device)),
            memory_bytes=props.total_memory,
            cuda=torch.version.cuda,
        )
    return info


def megablocks_status() -> dict[str, Any]:
    found = {m: importlib.util.find_spec(m) is not None for m in ("megablocks", "grouped_gemm")}
    why = (
        "importable"
        if all(found.values())
        else "not installed: neither is on the device image, and megablocks ships only an sdist that needs a CUDA "
        "build (carry a wheel built for this torch in .whl/ to measure it)"
    )
    return {"importable": all(found.values()), "modules": found, "why": why}


def check_grouped(device: torch.device) -> dict[str, Any]:
    """grouped_mm against the per-expert loop on one SPES layer under bf16 autocast, with experts that get no
    token (8 tokens, 16 experts): the output and the trained block's gradients, as relative errors."""
    from spes.moe import MoE

    layers = {}
    for backend in ("torch", "grouped_mm"):
        torch.manual_seed(0)
        moe = MoE(
            d_model=256,
            hidden=512,
            num_experts=16,
            top_k=2,
            block_size=4,
            trainable_block=1,
            num_layers=1,
            lb_weight=0.01,
            z_weight=0.001,
            normalize_p=None,
            backend=backend,
        ).to(device)
        for p in moe.parameters():
            torch.nn.init.normal_(p, std=0.05)
        layers[backend] = moe
    x = torch.randn(8, 256, device=device)
    results = {}
    for backend, moe in layers.items():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            y = moe(x)[0].float()
        (y * torch.linspace(-1, 1, y.numel(), device=device).reshape(y.shape)).sum().backward()
        results[backend] = [y.detach()] + [
            p.grad.float() for p in (moe.experts.w1[1], moe.experts.v1[1], moe.experts.w2[1])
        ]

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).norm() / b.norm().clamp_min(1e-12))

    errors = [rel(a, b) for a, b in zip(results["grouped_mm"], results["torch"])]
    return {"output_rel_err": errors[0], "trained_grad_rel_err": max(errors[1:]), "ok": max(errors) < 2e-2}


def profile_step(trainer: Trainer, batch: torch.Tensor) -> dict[str, Any]:
    """One step under `torch.profiler`: the `TOP_KERNELS` GPU kernels (CPU ops on the CPU) with the most self
    time (`top_kernels`), the eager aten ops, by input shapes, whose own kernels took the most device time
    (`top_ops`: which op of spes launched a row of the first table; a compiled graph's kernels have no aten op),
    and the time of all the kernels (`profiled_kernel_ms`)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = trainer.info.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, record_shapes=True) as prof:
        trainer.train_step(batch)
        if cuda:
            torch.cuda.synchronize()

    def self_time(e: Any) -> float:  # microseconds
        return float(getattr(e, "self_device_time_total", 0) if cuda else e.self_cpu_time_total)

    # NOTE: on the GPU a record_function range (`Optimizer.step#AdamW.step`) is an event too, spanning kernels that
    # are rows of their own; on the CPU its self time is work no aten op covers (a compiled graph's kernels)
    kernels = [
        e
        for e in prof.key_averages()
        if (e.device_type == DeviceType.CUDA) == cuda and not (cuda and getattr(e, "is_user_annotation", False))
    ]
    ops = [e for e in prof.key_averages(group_by_input_shape=True) if e.key.startswith("aten::")]
    return {
        "top_kernels": _top(kernels, self_time),
        "top_ops": _top(ops, self_time, shapes=True),
        "profiled_kernel_ms": sum(self_time(e) for e in kernels) / 1e3,
    }


def _top(events: list[Any], time_of: Any, shapes: bool = False) -> list[dict[str, Any]]:
    """The `TOP_KERNELS` events with the most time, each with its share of all the events' time."""
    rows = sorted((e for e in events if time_of(e) > 0), key=time_of, reverse=True)
    total = sum(time_of(e) for e in rows) or 1.0
    return [
        {
            "name": e.key[:160],
            **({"shapes": str(e.input_shapes)[:200]} if shapes else {}),
            "calls": e.count,
            "ms": time_of(e) / 1e3,
            "share": time_of(e) / total,
        }
        for e in rows[:TOP_KERNELS]
    ]


def syncs_per_step(trainer: Trainer, batch: torch.Tensor) -> dict[str, Any]:
    """Host-device synchronizations of one step: CUDA's sync debug mode warnings (GPU), else SyncCounter's."""
    if trainer.info.device.type == "cuda":
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                trainer.train_step(batch)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        found = [str(w.message).splitlines()[0][:160] for w in caught if "synchroniz" in str(w.message)]
        return {"how": "torch.cuda.set_sync_debug_mode('warn')", "count": len(found), "first": found[:5]}
    with speed.SyncCounter() as counter:
        trainer.train_step(batch)
    events = [f"{where} {name}" for where, name in counter.events]
    return {"how": "spes.speed.SyncCounter (CPU test double)", "count": len(events), "first": events[:5]}


def loss_chunk(elements: int | None) -> contextlib.AbstractContextManager:
    """Logits per chunk of `fused_loss`'s head for one variant: compiled, a chunk holds no fp32 copy of its logits,
    so larger chunks (fewer weight casts, fewer fp32 adds of the head's weight gradient) may fit and win."""
    if elements is None:
        return contextlib.nullcontext()
    return mock.patch.object(spes.head_loss, "LOSS_CHUNK_ELEMENTS", elements)


def liger_head_loss_sums(
    h_ND: torch.Tensor, weight_VD: torch.Tensor, labels_N: torch.Tensor, *, logit_z_weight: float | None, **_: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`spes.head_loss.head_loss_sums`'s (ce + w z, ce, z) from liger-kernel's fused linear cross entropy: with sum
    reduction its loss is ce + w z over the kept labels and its `z_loss` the w z term (liger 0.8.5's ops)."""
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    w = logit_z_weight or 0.0
    loss, wz = liger_fused_linear_cross_entropy(
        h_ND,
        weight_VD,
        labels_N,
        ignore_index=spes.head_loss.IGNORE_INDEX,
        lse_square_scale=w,
        reduction="sum",
        return_z_loss=True,
        accum_dtype=torch.float32,
    )
    loss, wz = loss.float(), wz.float()
    return loss, (loss - wz).detach(), (wz / w if w else wz).detach()


def head(kind: str | None) -> contextlib.AbstractContextManager:
    """The head and loss the model computes with `fused_loss` for one variant: spes.head_loss's (None) or
    liger-kernel's ("liger"; a missing wheel is the variant's error, naming the fix)."""
    if kind is None:
        return contextlib.nullcontext()
    if importlib.util.find_spec("liger_kernel") is None:
        raise RuntimeError("liger-kernel is not importable: bash bench/prepare_gpu.sh downloads its wheel into .whl")
    return mock.patch.object(spes.model, "head_loss_sums", liger_head_loss_sums)


def run_variant(v: Variant, device: torch.device, quick: bool) -> dict[str, Any]:
    """Build, time, profile and count one variant; out of memory and errors are results too."""
    row: dict[str, Any] = {"name": v.name, "settings": {**v.__dict__, "overrides": v.overrides()}}
    if v.backend == "megablocks" and not megablocks_status()["importable"]:
        return {**row, "status": "skipped", "why": megablocks_status()["why"]}
    started = time.perf_counter()
    try:
        with loss_chunk(v.loss_chunk), head(v.head), tempfile.TemporaryDirectory(prefix="bench_gpu_") as scratch:
            cfg, _ = load_config(CONFIG, [f"--save_folder={scratch}", *(CUT if quick else []), *v.overrides()])
            cfg = replace(cfg, compile=compile_option(v, quick))
            trainer = speed.build_timed_node(cfg, device)
            batch_of = lambda n: speed.random_batch(cfg, n)  # noqa: E731
            repeats = {"steps": 1, "warmup": 1} if quick else {}  # the full run: spes.speed's, as the preflight's
            times = speed.time_steps(trainer, batch_of, micro_batches=MICRO_BATCHES[quick], **repeats)
            share = speed.trained_expert_share(trainer, speed.random_batch(cfg, v.micro_batch))
            figures = speed.step_figures(cfg, times, device, share)
            profile_batch = speed.random_batch(cfg, PROFILED_MICRO_BATCHES * v.micro_batch, seed=1)
            profile = profile_step(trainer, profile_batch)
            row.update(
                status="ok",
                moe_backend=speed.moe_backend_of(trainer.model),
                **figures,
                **profile,
                device_busy=profile["profiled_kernel_ms"] / 1e3 / times.projected_step_s(PROFILED_MICRO_BATCHES),
                top_kernels_step=f"one step of {PROFILED_MICRO_BATCHES} micro-batches",
                syncs_per_step=syncs_per_step(trainer, profile_batch),
            )
    except torch.OutOfMemoryError as exc:
        row.update(status="oom", error=str(exc).splitlines()[0][:500])
    except Exception as exc:  # NOTE: a compile or kernel failure is a finding: the variant's row says which
        row.update(status="error", error=f"{type(exc).__name__}: {str(exc)[:1500]}")
    row["wall_s"] = time.perf_counter() - started
    return row


def run_isolated(v: Variant, device: torch.device, quick: bool, timeout_s: float) -> dict[str, Any]:
    """`run_variant` in a process of its own (this script's `--variant`); its output goes to this one's log, and a
    process that dies or hangs without writing its row is the variant's error.

    NOTE: in one process, later variants ran in what earlier ones left: in bench_gpu_head.json (2d1090a) each of the
    three after the first kept the GPU less busy than the first did, where the same variants measured in
    bench_gpu_compile.json (1e16eba) were all about as busy as its first (the README's "GPU busy" column).
    """
    with tempfile.TemporaryDirectory(prefix="bench_gpu_variant_") as scratch:
        out = Path(scratch) / "row.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--variant", v.name, "--device", device.type]
        cmd += ["--out", str(out), *(["--quick"] if quick else [])]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=REPO_ROOT)
        except subprocess.TimeoutExpired:
            why = f"still running after --variant_timeout_s {timeout_s:g}"
            return {"name": v.name, "status": "timeout", "why": why}
        sys.stdout.write(proc.stdout)
        sys.stderr.write(proc.stderr[-4000:])
        if out.is_file():
            return json.loads(out.read_text())
    why = f"its process exited with status {proc.returncode} and no row; stderr ends: {proc.stderr[-1500:]}"
    return {"name": v.name, "status": "error", "error": why}


def multi_gpu(device: torch.device) -> dict[str, Any]:
    """NCCL all-reduce and one FSDP2 step across the GPUs (spes.gpu_check under torchrun), or why not."""
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    if gpus < 2:
        return {"ran": False, "why": f"{gpus} GPU(s): the NCCL all-reduce and the FSDP2 step need at least two"}
    proc = subprocess.run(
        [sys.executable, "-m", "spes.gpu_check", str(CONFIG)], capture_output=True, text=True, timeout=300
    )
    return {"ran": True, "returncode": proc.returncode, "output": proc.stdout[-4000:], "stderr": proc.stderr[-2000:]}


def preflight_gpu(timeout_s: float = 90) -> dict[str, Any]:
    """`python -m spes.preflight --gpu` on the same config: its step line comes from the same `spes.speed` code."""
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "spes.preflight", "--gpu", str(CONFIG)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            cwd=REPO_ROOT,
        )
    except subprocess.TimeoutExpired:
        return {"ran": False, "why": f"timed out after {timeout_s:g} s"}
    return {"ran": True, "returncode": proc.returncode, "output": proc.stdout[-4000:], "stderr": proc.stderr[-2000:]}


PREFLIGHT_STEP = re.compile(
    r"^ok\s+step\s+node step \((?P<settings>[^)]*)\): (?P<tps>[0-9,]+) tokens/s.*?"
    r"MFU (?P<mfu>[0-9.]+)% by tflops_per_token",
    re.MULTILINE,
)


def preflight_agreement(output: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The preflight's tokens/s and MFU against this run's `CUDA_DEFAULTS` variants (issue 29: the same figures):
    compared only when the preflight stepped the same setting, and as its ratio to their median."""
    found = PREFLIGHT_STEP.search(output)
    if found is None:
        return {"compared": False, "why": "no 'ok step' line in the preflight's output"}
    defaults = step_settings(load_config(CONFIG, [])[0].on_device("cuda"), "grouped_mm")  # CUDA_DEFAULTS' setting
    if found["settings"] != defaults:
        return {"compared": False, "why": f"the preflight stepped '{found['settings']}', not {CUDA_DEFAULTS}"}
    bench = [v for v in rows if v["name"] in (CUDA_DEFAULTS, AGAIN) and v["status"] == "ok"]
    if not bench:
        return {"compared": False, "why": f"{CUDA_DEFAULTS} did not run to the end here"}
    tps, mfu = float(found["tps"].replace(",", "")), float(found["mfu"]) / 100
    bench_tps = statistics.median(v["tokens_per_s"] for v in bench)
    return {
        "compared": True,
        "preflight_tokens_per_s": tps,
        "preflight_mfu": mfu,
        "bench_tokens_per_s": {v["name"]: v["tokens_per_s"] for v in bench},
        "ratio": tps / bench_tps,
    }


def junit_summary(path: Path) -> dict[str, Any]:
    """Counts of a pytest --junitxml file (bench/run_gpu.sh runs `pytest -m gpu` first)."""
    if not path.is_file():
        return {"ran": False, "why": f"{path.name} not found"}
    suite = ET.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")  # type: ignore[assignment]
    assert suite is not None
    keys = ("tests", "failures", "errors", "skipped")
    failed = [
        f"{c.get('classname')}::{c.get('name')}"
        for c in suite.iter("testcase")
        if c.find("failure") is not None or c.find("error") is not None
    ]
    return {"ran": True, **{k: int(suite.get(k, 0)) for k in keys}, "failed": failed}


def write_record(path: Path, record: dict[str, Any]) -> None:
    write_atomic(path, json.dumps(record, indent=1) + "\n")


def print_table(record: dict[str, Any]) -> None:
    rows = []
    for r in record["variants"]:
        if r["status"] != "ok":
            rows.append([r["name"], r["status"], "", "", "", "", "", ""])
            continue
        mem = f"{r['peak_memory_bytes'] / 2**30:.1f}" if r["peak_memory_bytes"] else "n/a"
        mfu = f"{r['mfu']:.1%} / {r['mfu_done']:.1%}" if "mfu" in r else "n/a"
        figures = [f"{r['step_s']:.3g}", f"{r['tokens_per_s']:,.0f}", mfu, mem, f"{r['device_busy']:.0%}"]
        rows.append([r["name"], "ok", *figures, r["syncs_per_step"]["count"]])
    head = ["variant", "status", "step s", "tokens/s", "MFU / of done", "peak GiB", "busy", "syncs"]
    print(format_table(head, rows))


def main(argv: list[str] | None = None) -> int:
    p = parser("bench_gpu", __doc__)
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when there is one")
    p.add_argument("--budget_s", type=float, default=420.0, help="start no variant after this many seconds")
    p.add_argument("--only", default=None, help="comma-separated variant names to run (default: all)")
    p.add_argument(
        "--variant",
        default=None,
        help="run this one variant in this process and write its row to --out (how the benchmark runs each variant)",
    )
    p.add_argument(
        "--variant_timeout_s",
        type=float,
        default=150.0,
        help="a variant still running after this long is recorded as timed out",
    )
    p.add_argument("--pytest_junit", type=Path, default=None, help="a `pytest -m gpu --junitxml` file to summarize")
    p.add_argument(
        "--preflight",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="also record `python -m spes.preflight --gpu`'s output",
    )
    args = p.parse_args(argv)
    device_kind = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device_kind == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda needs a CUDA GPU and a CUDA build of torch")
    device = torch.device("cuda", 0) if device_kind == "cuda" else torch.device("cpu")
    quick = args.quick or device.type == "cpu"
    threads = torch.get_num_threads()
    if device.type == "cpu":  # NOTE: on a shared CPU, threads that wait for each other make tiny steps 10x slower
        torch.set_num_threads(1)
    try:
        return run_one(args, device, quick) if args.variant is not None else run(args, device, quick)
    finally:
        torch.set_num_threads(threads)


def run_one(args: Any, device: torch.device, quick: bool) -> int:
    """The child's side of `run_isolated`: one variant's row, written to --out."""
    by_name = {v.name: v for v in variants(quick)}
    if args.variant not in by_name:
        raise SystemExit(f"error: no variant named {args.variant!r} in this mode; the variants: {', '.join(by_name)}")
    write_record(args.out, {**run_variant(by_name[args.variant], device, quick), "process": os.getpid()})
    return 0


def run(args: Any, device: torch.device, quick: bool) -> int:
    chosen = [v for v in variants(quick) if args.only is None or v.name in args.only.split(",")]
    started = time.perf_counter()
    record: dict[str, Any] = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "commit": git_commit(),
        "machine": {**machine_info(), **device_info(device)},
        "config": str(CONFIG.relative_to(REPO_ROOT)),
        "mode": "quick (cut-down shape)" if quick else "full",
        "status": "running",
        "measures": f"steps of {' and '.join(map(str, MICRO_BATCHES[quick]))} micro-batches of each variant's shape, "
        "projected to the config's step (spes.speed)",
        "matmul_tflops_measured": matmul_flops_per_s(device.type) / 1e12,
        "megablocks": megablocks_status(),
        "grouped_mm_vs_loop": check_grouped(device),
        "variants": [],
    }
    if args.pytest_junit is not None:
        record["gpu_tests"] = junit_summary(args.pytest_junit)
    write_record(args.out, record)
    for v in chosen:
        if time.perf_counter() - started > args.budget_s:
            record["variants"].append(
                {"name": v.name, "status": "skipped", "why": f"past --budget_s {args.budget_s:g}"}
            )
            continue
        print(f"=== {v.name} (t={time.perf_counter() - started:.0f}s)", flush=True)
        record["variants"].append(run_isolated(v, device, quick, args.variant_timeout_s))
        record["elapsed_s"] = time.perf_counter() - started
        write_record(args.out, record)
    record["multi_gpu"] = multi_gpu(device)
    if args.preflight:
        record["preflight_gpu"] = preflight_gpu()
        record["preflight_agreement"] = preflight_agreement(
            record["preflight_gpu"].get("output", ""), record["variants"]
        )
    record["status"] = "complete"
    record["elapsed_s"] = time.perf_counter() - started
    write_record(args.out, record)
    print_table(record)
    if "preflight_agreement" in record:
        print(f"preflight --gpu against {CUDA_DEFAULTS}: {record['preflight_agreement']}")
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
