"""Node preflight: before a week-long run, prove in about a minute that this node can take part.

    python -m spes.preflight configs/spes_1b/node_3.yaml --spes_config.peer_id=3 [--section.key=value ...]
    run_scripts/run_single_node.sh 3 --preflight          # the same, with the launch script's settings
    python -m spes.preflight --gpu [CONFIG]               # CUDA smoke test (spes.gpu_check)

Prints one line per check with what it measured: the devices the launch will use; the memory this node's
config needs (model state + activations of one micro-batch) against what a device has; the parameter server
(reachable, protocol, token and certificates accepted, run settings and model manifest match: a dry join that
changes nothing on the server); the link (round-trip time and throughput each way over the plane the node will
use, the predicted seconds per round and the fraction of time spent not training); free disk where checkpoints
go, and a save folder the node would refuse to start in; the training data, and for shards at URLs how long a
step's windows take to read. `--resume[=auto]` is taken as the node takes it. Exit status: 0 all passed, 1 some
failed (named, each with what to do), 2 bad config.

torch (and the model, the sync wing and the data modules) is imported by the checks that need it, so `--help`, a
mistyped flag or key and a config that does not load are answered in a fraction of a second; `--devices` and `--gpu`
import it.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

from spes.checks import GIB, Check, fail, gib, matmul_flops_per_s, ok, report, skip
from spes.cli import ArgumentParser
from spes.config import TrainConfig, load_config
from spes.interrupt import outliving_readers
from spes.schema import ConfigError, number_flag
from spes.train import apply_resume
from spes.train import parse_args as train_args

if TYPE_CHECKING:
    from spes.data import TokenSequenceDataset
    from spes.sync.client import ServerStatus, SyncClient, SyncError

FP32 = 4
BF16 = 2
ADAM_MOMENTS = 2
LOGIT_COPIES = 7
"""fp32-sized copies of the logits alive at the backward's peak: fitted to the 1B config's measured GPU peaks
(H200, amp_bf16: 28.1 / 44.3 / 76.7 GiB at micro-batch 2 / 4 / 8, 8.1 GiB per 2,048-token sequence, most of it the
151,936-row LM head; bench/results/bench_wan_gpu_steps.json); the three copies counted before left 36 GiB out."""
USABLE_MEMORY = 0.9
"""Fraction of a device's memory a run may plan for (the rest: allocator slack, CUDA context, fragmentation)."""
SAMPLE_TOKENS = 1 << 20
"""Tokens read from the start of each shard to check their ids against the vocabulary."""
URL_SAMPLE_TOKENS = 1 << 14
"""The same for a shard at a URL (a list may name thousands, each read over the network)."""
URL_READ_SAMPLES = 8
"""Windows timed from shards at URLs, spread over them."""
TARGET_SYNC_FRACTION = 0.1
"""The link share the failed link check's sync_steps advice aims at (--max_sync_fraction when that is lower)."""


# -- devices ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Devices:
    """What the launch will use: `nproc` processes on CUDA GPUs (their memory) or on the CPU (its RAM)."""

    nproc: int
    kind: str  # "cuda" | "cpu"
    memory_bytes: int
    """Memory one process may use: the smallest GPU's, or the host's available RAM shared by the processes."""
    describe: str


def find_devices(nproc: int | None) -> Devices:
    """The devices of this machine and how many processes the launch scripts start (NPROC_PER_NODE or all GPUs)."""
    import torch

    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if num_gpus:
        props = [torch.cuda.get_device_properties(i) for i in range(num_gpus)]
        names = sorted({p.name for p in props})
        count = nproc or num_gpus
        return Devices(
            count,
            "cuda",
            min(p.total_memory for p in props),
            f"{num_gpus} CUDA GPU(s) ({', '.join(names)}, {gib(min(p.total_memory for p in props))} each); "
            f"the launch uses {count} process(es)",
        )
    count = nproc or 1
    available = psutil.virtual_memory().available
    return Devices(
        count,
        "cpu",
        available // count,
        f"the CPU (no CUDA GPU), {os.cpu_count()} cores, {gib(available)} RAM available; the launch uses "
        f"{count} process(es)",
    )


def check_devices(cfg: TrainConfig, devices: Devices) -> Check:
    import torch

    from spes.distributed import check_launch

    num_gpus = torch.cuda.device_count() if devices.kind == "cuda" else 0
    env = {
        "WORLD_SIZE": str(devices.nproc),
        "RANK": "0",
        "LOCAL_RANK": str(devices.nproc - 1),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "0",
    }
    try:
        check_launch(cfg, env, num_gpus)
    except ConfigError as exc:
        return fail("devices", devices.describe, str(exc))
    return ok("devices", devices.describe)


# -- memory -------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StateBytes:
    """Model state of one replica: fp32 weights of every parameter (frozen experts too), fp32 gradients and two
    fp32 AdamW moments of the parameters this node trains."""

    params: int
    trained: int
    weights: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer


def model_state_bytes(cfg: TrainConfig) -> StateBytes:
    """From the config alone (`spes.model.analytic_param_counts`); bench/bench_memory.py checks it against a run."""
    from spes.model import analytic_param_counts

    owned = cfg.owned_experts()
    counts = analytic_param_counts(cfg.model, None if owned is None else owned[1] - owned[0])
    return StateBytes(
        params=counts.total,
        trained=counts.trainable,
        weights=FP32 * counts.total,
        grads=FP32 * counts.trainable,
        optimizer=ADAM_MOMENTS * FP32 * counts.trainable,
    )


def activation_bytes_per_sequence(cfg: TrainConfig) -> int:
    """Estimated activation memory kept for backward per sequence of a micro-batch.

    Per token and layer: attention keeps ~10 d values (norm, q/k/v, output, residual) and, on the math path,
    n_heads x seq attention probabilities; the MoE keeps the router logits and per routed copy its input and
    output (2 d) and four expert-hidden values. Activation checkpointing keeps only a layer's input for the
    recomputed layers (fine-grained: ~4 d). The logits cost `LOGIT_COPIES` fp32-sized copies at the backward's
    peak (the autocast output, its fp32 upcast, the log-softmax and z-loss terms kept for backward, and their
    gradients).
    """
    m = cfg.model
    d, s, f = m.d_model, m.max_sequence_length, m.expert_hidden_size
    full_layer = 10 * d + m.n_heads * s + m.moe_num_experts + m.moe_top_k * (2 * d + 4 * f)
    mode = cfg.activation_checkpointing
    if mode in ("whole_layer", True):
        per_layer = [d] * (m.n_layers - 1) + [full_layer]
    elif mode == "fine_grained":
        per_layer = [4 * d] * (m.n_layers - 1) + [full_layer]
    elif mode in ("one_in_two", "one_in_four"):
        every = 2 if mode == "one_in_two" else 4
        per_layer = [d if i % every == 0 else full_layer for i in range(m.n_layers)]
    else:
        per_layer = [full_layer] * m.n_layers
    element = 2 if cfg.precision == "amp_bf16" else FP32
    assert m.embedding_size is not None
    # NOTE: with fused_loss the logits exist a chunk at a time: `memory_need` counts that chunk once instead
    logits = 0 if cfg.fused_loss else LOGIT_COPIES * FP32 * m.embedding_size
    return s * (sum(per_layer) * element + logits)


def memory_need(cfg: TrainConfig, nproc: int) -> tuple[int, int]:
    """(model-state bytes one process holds, activation bytes per sequence): FSDP2 shards the state over the
    node's processes, DDP adds gradient buckets as large as the gradients, and under `amp_bf16` autocast keeps a
    bf16 copy of every weight it casts for the step."""
    from spes.head_loss import LOSS_CHUNK_ELEMENTS

    state = model_state_bytes(cfg)
    per_rank = state.total
    if nproc > 1 and cfg.distributed_strategy == "fsdp" and cfg.fsdp.sharding_strategy != "NO_SHARD":
        per_rank = math.ceil(state.total / nproc)
    elif nproc > 1 and cfg.distributed_strategy == "ddp":
        per_rank += state.grads
    if cfg.precision == "amp_bf16":
        per_rank += BF16 * state.params
    if cfg.fused_loss:
        # one chunk of logits, whatever the micro-batch, and the head's fp32 gradient sum, held from the forward to
        # the backward (`spes.head_loss.head_loss_sums`)
        assert cfg.model.embedding_size is not None
        per_rank += LOGIT_COPIES * FP32 * LOSS_CHUNK_ELEMENTS + FP32 * cfg.model.embedding_size * cfg.model.d_model
    return per_rank, activation_bytes_per_sequence(cfg)


def check_memory(cfg: TrainConfig, devices: Devices, budget_bytes: int | None) -> Check:
    state = model_state_bytes(cfg)
    static, per_seq = memory_need(cfg, devices.nproc)
    micro = cfg.device_train_microbatch_size
    have = budget_bytes if budget_bytes is not None else devices.memory_bytes
    where = (
        "the stated budget"
        if budget_bytes is not None
        else ("the smallest GPU" if devices.kind == "cuda" else "available RAM per process")
    )
    usable = USABLE_MEMORY * have
    need = static + micro * per_seq
    largest = max(0, int((usable - static) // per_seq)) if per_seq else 0
    detail = (
        f"needs {gib(need)} per process (model state {gib(static)}: {state.params / 1e6:,.1f}M weights, "
        f"{state.trained / 1e6:,.1f}M trained with grads + AdamW"
        f"{', bf16 weight copies' if cfg.precision == 'amp_bf16' else ''}; activations ~{gib(micro * per_seq)} for "
        f"micro-batch {micro}) of {gib(have)} ({where}; {gib(usable)} usable at {USABLE_MEMORY:.0%}); "
        f"largest micro-batch that fits: {largest}"
    )
    if need <= usable:
        return ok("memory", detail)
    if static > usable:
        fix = (
            "the model state alone does not fit: shard it with distributed_strategy=fsdp over more GPUs "
            "(NPROC_PER_NODE), or use a device with more memory"
        )
    else:
        per_rank = cfg.global_train_batch_size // devices.nproc
        fitting = max(m for m in range(1, max(largest, 1) + 1) if per_rank % m == 0)
        fix = (
            f"set device_train_microbatch_size={fitting} (the largest that fits and divides the "
            f"{per_rank} sequences per process and step), or enable activation_checkpointing=whole_layer"
        )
        if not cfg.fused_loss:  # at a large vocabulary most of the activations are the LM head's logits
            static_f, per_seq_f = memory_need(replace(cfg, fused_loss=True), devices.nproc)
            if (fused_need := static_f + micro * per_seq_f) <= usable:
                fix = f"set fused_loss=true (the LM head and loss a chunk at a time: ~{gib(fused_need)}), or {fix}"
    return fail("memory", detail, fix)


# -- server and link ----------------------------------------------------------------------------------------------
def manifest(cfg: TrainConfig) -> tuple[dict[str, tuple[int, ...]], list[str]]:
    """The manifest this node would announce at Join, read off the model built on the meta device."""
    import torch

    from spes.model import Transformer
    from spes.sync.peer import model_manifest

    with torch.device("meta"):
        return model_manifest(Transformer.for_run(cfg))


def check_server(
    cfg: TrainConfig, shapes: dict[str, tuple[int, ...]], trainable: list[str]
) -> tuple[list[Check], SyncClient | None]:
    """The server and run-settings checks (a dry join); returns the checks and the client for the link test."""
    from spes.node import start_checkpoint
    from spes.sync.client import SyncError
    from spes.sync.node_files import read_run_id
    from spes.sync.peer import dry_join_client
    from spes.sync.protocol import PROTOCOL_VERSION

    s = cfg.spes_config
    if not cfg.sync_enabled:
        return [skip("server", "centralized run (using_spes=false): no parameter server")], None
    try:  # NOTE: as the node joins: a resumed one in the run its checkpoint names
        start = start_checkpoint(cfg, log=lambda note: None)
    except (ValueError, FileNotFoundError):  # not made yet (an upcycled start): the node names it when it starts
        start = None
    try:  # NOTE: a damaged run record was asked about as a fresh node's, which the node refuses to start as
        run_id = read_run_id(start)
    except ValueError as exc:
        return [
            skip("server", "not asked: the node would refuse to start before it joins"),
            fail("settings", str(exc), "fix it as the line says: until then the node refuses to start (exit 2)"),
        ], None
    try:
        client = dry_join_client(cfg, shapes, run_id)
    except (ValueError, FileNotFoundError) as exc:
        return [fail("server", f"cannot set up a client: {exc}", "fix the spes_config keys named above")], None
    settings = (
        f"mode {cfg.mode}, {cfg.num_peers} peers, {cfg.experts_per_block} experts per block, peer {s.peer_id}, "
        f"manifest of {len(shapes)} tensors"
    )
    try:
        checked = client.check_join()
        position = run_position(client.status())
    except SyncError as exc:
        client.close()
        return _refused_join(cfg, exc), None
    known = "matches the run's" if checked else "will set the run's (no peer has joined yet)"
    reached = f"{s.server_addr} reachable, protocol v{PROTOCOL_VERSION}"
    return [
        ok("server", f"{reached}, credentials accepted ({_security(cfg)})"),
        ok("settings", f"{settings}: the server accepts them; the manifest {known}; {position}"),
    ], client


def run_position(status: ServerStatus) -> str:
    """Where the server's run stands, for a node about to join it (its latest round named as `spes.status` and the
    join line name it): one that starts behind it catches up at once."""
    from spes.sync.status import completed

    latest = f"run {status.run_id}" if status.run_id else "the run"
    latest += f": {completed(status.current_round)}"
    if status.current_round < 0:
        return latest
    return f"{latest} (a node starting before that step loads its global model as soon as it joins)"


def _security(cfg: TrainConfig) -> str:
    """How this node authenticates to the server, in words."""
    from spes.sync.auth import TOKEN_ENV

    s = cfg.spes_config
    parts = (
        "token" if s.token_file or os.environ.get(TOKEN_ENV) else "",
        "TLS" if s.tls_ca or s.tls_cert else "",
        f"client certificate {s.tls_cert}" if s.tls_cert else "",
    )
    return ", ".join(p for p in parts if p) or "no token, no TLS"


_JOIN_FIXES = {
    "UNAVAILABLE": "start the server, or check spes_config.server_addr and the firewall; ",
    "DEADLINE_EXCEEDED": "the server does not answer in time: check spes_config.server_addr and the network",
    "UNAUTHENTICATED": "set SPES_TOKEN (or spes_config.token_file) to the run's shared secret",
    "PERMISSION_DENIED": "use the client certificate issued for this peer (common name peer-<peer_id>) "
    "in spes_config.tls_cert/tls_key, or check spes_config.peer_id",
}
"""The fix for each way a server may refuse a dry join, or not answer it, before it looks at the settings."""


def _refused_join(cfg: TrainConfig, exc: SyncError) -> list[Check]:
    """The server and settings checks of a dry join the server refused: the link or the credentials, the version,
    or (the server reachable and the credentials accepted) the settings."""
    from spes.sync.channel import tls_fix
    from spes.sync.protocol import Reason

    s = cfg.spes_config
    addr = s.server_addr
    code = exc.code.name if exc.code is not None else ""
    if code == "UNAVAILABLE" and not exc.retryable:  # a refused TLS handshake: its line says what it means
        return [
            fail("server", f"{addr}: {exc}", "fix what the line names (docs/running.md, Security)"),
            skip("settings", "not checked: the TLS handshake failed"),
        ]
    if code in _JOIN_FIXES:
        return [
            fail(
                "server",
                f"{addr}: {exc}",
                _JOIN_FIXES[code] + (tls_fix(s.tls_ca, s.tls_cert) if code == "UNAVAILABLE" else ""),
            ),
            skip("settings", "not checked: the server refused or did not answer"),
        ]
    if exc.reason == Reason.OLD_SERVER:
        fix = "update the parameter server to this spes version (the training protocol is the same); its settings "
        return [
            fail("server", f"{addr}: {exc}", fix + "were accepted"),
            skip("settings", "not checked by an older server"),
        ]
    if exc.reason == Reason.WRONG_PROTOCOL or "wire protocol" in str(exc):  # NOTE: a v3 server gives no reason
        return [
            fail("server", f"{addr}: {exc}", "run the same spes version on the server and every node"),
            skip("settings", "not checked: the server speaks another protocol"),
        ]
    # NOTE: another run's node is no config to match: its line names the three ways in
    fix = (
        "the node and the server hold different runs: resume, join or restart as the line says (docs/running.md, "
        "Run identity)"
        if exc.reason == Reason.OTHER_RUN
        else "make this node's config match the run's (the YAML the server was started with and the other nodes' "
        "configs)"
    )
    return [ok("server", f"{addr} reachable, credentials accepted ({_security(cfg)})"), fail("settings", str(exc), fix)]


def estimated_step_s(cfg: TrainConfig, devices: Devices) -> tuple[float, str]:
    """Seconds per optimizer step from the config's FLOPs and this device's measured matmul rate (MFU 40% on GPU)."""
    from spes.model import tflops_per_token

    flops = tflops_per_token(cfg.model) * 1e12 * cfg.global_train_batch_size * cfg.model.max_sequence_length
    # NOTE: each GPU adds its rate; CPU processes share the cores one measurement already used
    rate = matmul_flops_per_s(devices.kind) * (devices.nproc if devices.kind == "cuda" else 1)
    efficiency = 0.4 if devices.kind == "cuda" else 1.0
    return flops / (rate * efficiency), (
        f"estimated from {flops / 1e12:.3g} TFLOP per step at "
        f"{rate / 1e12:.3g} TFLOP/s measured matmul rate" + (" x 40% MFU" if devices.kind == "cuda" else "")
    )


def check_link(
    cfg: TrainConfig,
    client: SyncClient,
    devices: Devices,
    link_bytes: int,
    step_s: float | None,
    max_fraction: float,
) -> Check:
    from spes.sync.client import SyncError

    s = cfg.spes_config
    try:
        stats = client.connection.measure_link(link_bytes)
    except SyncError as exc:
        return fail("link", str(exc), "check the network between this node and the server (and its data port)")
    up, down = client.spec.round_bytes(s.peer_id, merged=False)
    # NOTE: an upload and a download each open a connection and exchange a request and a reply: ~4 round trips.
    round_s = up / stats.up_bytes_per_s + down / stats.down_bytes_per_s + 4 * stats.rtt_s
    how = "measured (--step_time_s)"
    if step_s is None:
        step_s, how = estimated_step_s(cfg, devices)
    fraction = round_s / (s.sync_steps * step_s + round_s)
    detail = (
        f"{stats.plane} plane: RTT {stats.rtt_s * 1e3:.1f} ms, up {stats.up_bytes_per_s / 2**20:,.0f} MiB/s, "
        f"down {stats.down_bytes_per_s / 2**20:,.0f} MiB/s ({link_bytes / 2**20:g} MiB each way); a round moves "
        f"{gib(up)} up + {gib(down)} down ({s.codec}): ~{round_s:.3g} s; step ~{step_s:.3g} s "
        f"({how}); at sync_steps={s.sync_steps} the node waits on the link "
        f"{fraction:.1%} of the time"
    )
    if fraction <= max_fraction:
        return ok("link", detail)
    # NOTE: advice aimed above a stricter --max_sync_fraction would fail this same check again
    target = min(TARGET_SYNC_FRACTION, max_fraction)
    steps_needed = math.ceil(round_s * (1 - target) / (target * step_s))
    return fail(
        "link",
        detail,
        f"raise spes_config.sync_steps to {steps_needed} (link time <= {target * 100:.3g}%), use "
        "spes_config.codec=bf16, int8 or sparse (1/2, about 1/4 or about 1/100 of the fp32 bytes), or a faster link"
        + (
            "; open the server's --data_port to this node (gRPC is several times slower)"
            if stats.plane == "grpc"
            else ""
        ),
    )


# -- disk and data ------------------------------------------------------------------------------------------------
def saves(max_steps: int, interval: int | None, keep: int, final: bool) -> int:
    """How many checkpoints of one kind exist at the end of the run (written, then pruned to `keep`)."""
    if not interval:
        return 0
    written = max_steps // interval + (1 if final and max_steps % interval else 0)
    return min(written, keep) if keep > 0 else written


def check_disk(cfg: TrainConfig) -> Check:
    """Free disk for the checkpoints the run keeps, and the save folder as a start takes it (another run's saves,
    a `--resume` of nothing: refused by the node at start, so failed here)."""
    from spes.node import check_save_folder

    folder = Path(cfg.save_folder).expanduser().absolute()
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    free = shutil.disk_usage(existing).free
    state = model_state_bytes(cfg)
    size = state.weights + state.optimizer
    steps = cfg.max_steps
    kept = saves(steps, cfg.save_interval, cfg.save_num_checkpoints_to_keep, final=True) + saves(
        steps, cfg.save_interval_unsharded, cfg.save_num_unsharded_checkpoints_to_keep, final=False
    )
    need = (kept + 1) * size if kept else 0  # NOTE: the next checkpoint is written before the oldest is pruned
    detail = (
        f"{cfg.save_folder}: {gib(free)} free; checkpoints of {gib(size)} (weights + AdamW), {kept} kept + 1 being "
        f"written = {gib(need)}"
    )
    try:
        check_save_folder(cfg)
    except ValueError as exc:
        return fail("disk", detail, f"the node would refuse to start: {exc}")
    if need <= free:
        return ok("disk", detail)
    return fail(
        "disk",
        detail,
        f"free {gib(need - free)} there, point save_folder at a larger disk, or lower save_num_checkpoints_to_keep",
    )


def check_data(cfg: TrainConfig) -> tuple[Check, TokenSequenceDataset | None]:
    """The training data: shards found, tokenizer matched, enough sequences; and the dataset when it opened."""
    from spes.data import TokenSequenceDataset, check_eos
    from spes.shards import resolve_paths
    from spes.tokenizer import check_vocab, load_tokenizer

    try:
        tokenizer = load_tokenizer(cfg.tokenizer.identifier)
        check_vocab(tokenizer.vocab_size, cfg.model.vocab_size, cfg.model.embedding_size)
    except (ValueError, FileNotFoundError, OSError) as exc:
        return fail(
            "data", f"tokenizer {cfg.tokenizer.identifier}: {exc}", "fix tokenizer.identifier / model.vocab_size"
        ), None
    paths = []
    for entry in cfg.data.paths or [""]:
        try:
            paths.extend(resolve_paths([entry] if entry else [], ranged=cfg.data.url_reads == "range"))
        except (ValueError, FileNotFoundError) as exc:
            return fail(
                "data", str(exc), "fix data.paths (files, globs, directories or .txt lists of .npy shards)"
            ), None
    try:
        dataset = TokenSequenceDataset(paths, cfg.model.max_sequence_length, cfg.data.memmap_dtype)
    except (ValueError, OSError) as exc:
        return fail("data", str(exc), "fix or re-tokenize the shard named above"), None
    mismatch = _vocab_mismatch(cfg, dataset, tokenizer.vocab_size)
    if mismatch is not None:
        return mismatch, dataset
    try:
        check_eos(dataset.paths, dataset.shard_infos, cfg.model.eos_token_id)
    except ValueError as exc:
        return fail("data", str(exc), "set model.eos_token_id to the EOS the shards were written with"), dataset
    note = ""
    if dataset.fingerprint is None:
        note = "; note: no shard has a sidecar, so the tokenizer they were written with cannot be checked"
    elif dataset.fingerprint != tokenizer.fingerprint:
        note = "; note: written with another tokenizer file of the same vocabulary size"
    dtype = dataset.shard_array(0).dtype  # as training reads it
    need = cfg.max_steps * cfg.global_train_batch_size
    detail = (
        f"{len(paths)} shard(s) from {len(cfg.data.paths)} data.paths entries, {dtype}, "
        f"{dataset.num_tokens:,} tokens = {len(dataset):,} sequences of {cfg.model.max_sequence_length}; the run "
        f"reads {need:,} (max_duration x global_train_batch_size)" + note
    )
    if len(dataset) >= need:
        return ok("data", detail), dataset
    return fail(
        "data",
        detail,
        f"add shards to data.paths or shorten max_duration (the data would be read "
        f"{need / max(len(dataset), 1):.1f} times)",
    ), dataset


def _vocab_mismatch(cfg: TrainConfig, dataset: TokenSequenceDataset, vocab_size: int) -> Check | None:
    """A failed check for the first shard written for another vocabulary than the tokenizer's, or None."""
    for index, (path, info) in enumerate(zip(dataset.paths, dataset.shard_infos)):
        sample = URL_SAMPLE_TOKENS if isinstance(path, str) else SAMPLE_TOKENS
        tokens = dataset.shard_array(index)[:sample]  # headerless OLMo files too
        top = int(tokens.max()) if len(tokens) else 0
        if (info is not None and info.vocab_size != vocab_size) or top >= vocab_size:
            # NOTE: a bare OLMo-style shard has no sidecar, so only its largest id can be checked
            written = f"written for a vocabulary of {info.vocab_size}" if info is not None else "no sidecar"
            return fail(
                "data",
                f"{path}: {written} (largest id seen {top}), the tokenizer {cfg.tokenizer.identifier} has {vocab_size}",
                "re-tokenize the data with this tokenizer or point tokenizer.identifier at the one it used",
            )
    return None


def check_url_reads(cfg: TrainConfig, dataset: TokenSequenceDataset, devices: Devices, step_s: float | None) -> Check:
    """Whether the loaders read a step's windows from shards at URLs (one range request each) within the step:
    the median time of a window read, times a rank's windows, over its `data.num_workers` loader processes."""
    remote = [i for i, path in enumerate(dataset.paths) if isinstance(path, str) and dataset.shard_windows(i)]
    shards = [remote[round(k)] for k in _spread(len(remote), URL_READ_SAMPLES)]
    times = []
    try:
        for index in shards:
            windows = dataset.shard_windows(index)
            started = time.perf_counter()
            dataset[windows[len(windows) // 2]]
            times.append(time.perf_counter() - started)
    except OSError as exc:
        return fail("reads", str(exc), "check the URLs and the network, or set data.url_reads=download")
    per_window = statistics.median(times)
    loaders = max(1, cfg.data.num_workers)
    rank_windows = cfg.global_train_batch_size // devices.nproc
    read_s = rank_windows * per_window / loaders
    how = "measured (--step_time_s)"
    if step_s is None:
        step_s, how = estimated_step_s(cfg, devices)
    detail = (
        f"a window reads from its URL in {per_window * 1e3:.1f} ms (median of {len(times)}); a step's "
        f"{rank_windows} windows per rank take ~{read_s:.3g} s over {loaders} loader process(es); step ~{step_s:.3g} "
        f"s ({how})"
    )
    if read_s <= step_s:
        return ok("reads", detail)
    return fail(
        "reads",
        detail,
        f"set data.num_workers={math.ceil(rank_windows * per_window / step_s)} (loader processes read in parallel), "
        "or data.url_reads=download to read local copies",
    )


def _spread(n: int, k: int) -> list[float]:
    """min(n, k) positions spread evenly over [0, n - 1]."""
    count = min(n, k)
    return [i * (n - 1) / max(count - 1, 1) for i in range(count)]


# -- the report ---------------------------------------------------------------------------------------------------
def run_checks(cfg: TrainConfig, args: argparse.Namespace) -> list[Check]:
    devices = find_devices(args.nproc)
    cfg = cfg.on_device(devices.kind)
    checks = [check_devices(cfg, devices)]
    budget = int(args.memory_budget_gb * GIB) if args.memory_budget_gb is not None else None
    checks.append(check_memory(cfg, devices, budget))
    shapes, trainable = manifest(cfg)
    server_checks, client = check_server(cfg, shapes, trainable)
    checks.extend(server_checks)
    if client is not None:
        try:
            checks.append(
                check_link(
                    cfg,
                    client,
                    devices,
                    int(args.link_mb * 2**20),
                    args.step_time_s,
                    args.max_sync_fraction,
                )
            )
        finally:
            client.close()
    elif cfg.sync_enabled:
        checks.append(skip("link", "not measured: the server check did not pass"))
    checks.append(check_disk(cfg))
    data, dataset = check_data(cfg)
    checks.append(data)
    if dataset is not None and any(isinstance(path, str) for path in dataset.paths):
        checks.append(check_url_reads(cfg, dataset, devices, args.step_time_s))
    return checks


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="python -m spes.preflight",
        takes_overrides=True,
        usage="python -m spes.preflight CONFIG.yaml [--section.key=value ...] [--resume[=auto]] [options] "
        "| --gpu [CONFIG.yaml]",
        description="Check that this node can take part in the run CONFIG.yaml describes: devices, memory, the "
        "parameter server (a dry join: nothing changes on the server), the link, disk and data. One line per check; "
        "exit 1 naming the failed checks, 2 for a bad config.",
        epilog="Config keys are overridden as --section.key=value, and --resume[=auto] given, exactly as for "
        "spes.train.",
    )
    parser.add_argument("config", nargs="?", help="the node's YAML config")
    parser.add_argument(
        "--gpu", action="store_true", help="instead: CUDA smoke test (bf16 block fwd+bwd, NCCL all-reduce, FSDP2 step)"
    )
    parser.add_argument(
        "--devices",
        action="store_true",
        help="instead: print the number of processes the launch starts and the devices (one line)",
    )
    parser.add_argument(
        "--nproc",
        type=number_flag(int, ge=1),
        default=None,
        help="processes the launch starts (default: NPROC_PER_NODE, else every GPU, else 1)",
    )
    parser.add_argument(
        "--memory_budget_gb",
        type=number_flag(gt=0),
        default=None,
        help="memory one process may use, GiB (default: the smallest GPU's, or available RAM)",
    )
    parser.add_argument(
        "--link_mb", type=number_flag(gt=0, le=256), default=16.0, help="MiB sent each way by the link test"
    )
    parser.add_argument(
        "--step_time_s",
        type=number_flag(gt=0),
        default=None,
        help="measured seconds per optimizer step (default: estimated from FLOPs and a matmul test)",
    )
    parser.add_argument(
        "--max_sync_fraction",
        type=number_flag(gt=0, le=1),
        default=0.5,
        help="fail the link check when the node would wait on the link more than this fraction",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args, overrides = parser.parse_known_args(argv)  # NOTE: every other --key=value is a config override
    parser.refuse_unknown_flags(allowed=["--resume"])  # as spes.train takes it
    stray = [a for a in overrides if not a.startswith("--")]
    if stray:
        parser.error(f"unexpected arguments {stray}: give one config file; overrides look like --section.key=value")
    if args.gpu:
        from spes.gpu_check import main as gpu_main

        return gpu_main(args.config, overrides)
    env_nproc = os.environ.get("NPROC_PER_NODE")
    if args.nproc is None and env_nproc:
        if not env_nproc.isdigit() or int(env_nproc) < 1:
            parser.error(f"NPROC_PER_NODE={env_nproc!r} must be a positive integer")
        args.nproc = int(env_nproc)
    if args.devices:  # for the launch scripts: `<processes> <what they run on>`
        devices = find_devices(args.nproc)
        print(devices.nproc, devices.describe.split(";")[0])
        return 0
    if args.config is None:
        parser.error("no config file given, e.g. python -m spes.preflight configs/tiny.yaml")
    try:  # NOTE: --resume[=auto] as the node takes it: a resumed node joins, and claims its save folder, as its run's
        _, overrides, resume = train_args(overrides)
        cfg, _ = load_config(args.config, overrides)
        apply_resume(cfg, resume)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    s = cfg.spes_config
    print(
        f"preflight of {args.config}: peer {s.peer_id} of {cfg.num_peers}, server {s.server_addr}"
        if cfg.sync_enabled
        else f"preflight of {args.config} (centralized run)"
    )
    try:
        return report(run_checks(cfg, args))
    except KeyboardInterrupt:  # NOTE: Ctrl-C during a check (the link test) was a traceback; nothing is kept
        print("preflight interrupted: nothing was changed; run it again to check", file=sys.stderr)
        return 130


if __name__ == "__main__":
    # NOTE: `| head` ended it in a BrokenPipeError traceback; its exit code is the verdict
    with outliving_readers(None):
        raise SystemExit(main())
