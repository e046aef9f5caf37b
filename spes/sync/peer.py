"""The trainer's side of a SPES round: gather what this node trained, exchange it, load the global model.

One rank per node (rank 0) talks to the parameter server; the others take part only in the collective
gather and load (`spes.distributed.gather_full` / `load_full`, one whole tensor at a time, frozen experts
never gathered), so under DDP and FSDP2 every rank ends the round holding the same global weights.
Weights are loaded in place (`copy_` into the existing parameters or their shards), so the local AdamW
state is kept, as in the paper. A node the run has moved past (restarted from an older checkpoint, or left out of a
quorum round) loads the whole global model; the `SyncResult` says the step the trainer continues from.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
import torch
import torch.distributed as dist
from torch import nn

from spes.config import TrainConfig
from spes.distributed import DistInfo, gather_full, load_full, unwrap
from spes.sync.auth import read_token
from spes.sync.client import SyncClient, SyncStats
from spes.sync.protocol import Manifest, SyncError


@dataclass(frozen=True)
class SyncResult:
    """What one round did for this node; every rank gets the same `step` and `caught_up`."""

    step: int
    """The step to continue from: the round's own, or the run's when this node had fallen behind."""
    caught_up: bool = False
    """True when this node had fallen behind the run and loaded the whole global model of round `step`."""
    stats: SyncStats | None = None
    """What the exchange cost and what the server did (rank 0 only: the other ranks do not meet the server)."""

    def metrics(self) -> dict[str, Any]:
        """The round's figures for the training log (seconds, MB up/down, whether the merge warm-up ran)."""
        metrics: dict[str, Any] = {}
        if self.stats is not None:
            metrics = {
                "sync_s": self.stats.seconds,
                "sync_mb_up": self.stats.bytes_up / 2**20,
                "sync_mb_down": self.stats.bytes_down / 2**20,
                "sync_round": self.stats.round,
                "merged": self.stats.merged,
                "merge_alpha": self.stats.alpha,
            }
        if self.caught_up:
            metrics["caught_up_to"] = self.step
        return metrics


def model_manifest(model: nn.Module) -> tuple[Manifest, list[str]]:
    """What a node announces at Join: name -> shape of every parameter, and the names it trains."""
    named = list(model.named_parameters())
    return {n: tuple(p.shape) for n, p in named}, [n for n, p in named if p.requires_grad]


def sync_client(cfg: TrainConfig, **overrides: Any) -> SyncClient:
    """A client for this node's `spes_config` (`overrides`: SyncClient keywords that replace the config's)."""
    s = cfg.spes_config
    settings: dict[str, Any] = {
        "peer_id": s.peer_id,
        "num_peers": s.num_peers,
        "experts_per_peer": cfg.experts_per_peer,
        "mode": cfg.mode,
        "wire_dtype": s.wire_dtype,
        "token": read_token(s.token_file, "config key 'spes_config.token_file'"),
        "tls_ca": s.tls_ca,
        "tls_cert": s.tls_cert,
        "tls_key": s.tls_key,
        "rpc_timeout_s": s.rpc_timeout_s,
        "round_timeout_s": s.round_timeout_s,
        "max_retries": s.max_retries,
        "data_plane": s.data_plane,
    }
    return SyncClient(s.server_addr, **{**settings, **overrides})


class PeerSync:
    """Pushes this node's trained tensors and pulls the global model every `sync_steps` steps."""

    def __init__(self, cfg: TrainConfig, model: nn.Module, info: DistInfo, log: Callable[[str], None] = print) -> None:
        self.model, self.info, self.log = model, info, log
        self.distributed = info.world_size > 1
        self.shapes, self.trainable = model_manifest(unwrap(model))  # NOTE: DDP's own names carry a `module.` prefix
        self.server_addr = cfg.spes_config.server_addr
        self.client: SyncClient | None = None
        if info.is_main:
            # NOTE: `load_full` copies every result into the model at once, so the client may reuse its buffers
            self.client = sync_client(cfg, reuse_buffers=True)

    def join(self) -> None:
        """Announce this node's model manifest; the server refuses a node whose model differs from the run's."""
        error = None
        if self.client is not None:
            try:
                current = self.client.join(self.shapes, self.trainable)
                self.log(
                    f"joined parameter server (current round: step {current}); "
                    f"uploading {len(self.trainable)} of {len(self.shapes)} tensors per round"
                )
            except SyncError as e:
                error = e
        self._agree(error, "join the parameter server")

    def sync(self, step: int) -> SyncResult:
        """One round at `step`: upload, wait for the global model, load it; every rank returns the same step."""
        upload = gather_full(self.model, self.trainable, self.info)
        downloaded: dict[str, torch.Tensor] = {}
        stats, error = None, None
        if self.client is not None:
            try:
                downloaded, stats = self.client.sync(step, upload)
            except SyncError as e:
                error = e
        self._agree(error, f"synchronize at step {step}")
        caught_up_to = -1
        if stats is not None and stats.caught_up:
            caught_up_to = stats.round
            self.log(
                f"step {step}: this node had fallen behind the run; loaded the whole global model of "
                f"round {stats.round} and continues from step {stats.round}"
            )
        del upload
        load_full(self.model, downloaded, self.info)
        if self.distributed:  # every rank's trainer must continue from the same step
            flag = torch.tensor([caught_up_to], device=self.info.device)
            dist.broadcast(flag, src=0)
            caught_up_to = int(flag.item())
        if caught_up_to >= 0:
            return SyncResult(step=caught_up_to, caught_up=True, stats=stats)
        return SyncResult(step=step, stats=stats)

    def _agree(self, error: SyncError | None, what: str) -> None:
        """Raise on every rank when rank 0's exchange with the server failed: the other ranks would otherwise wait
        in the next collective until torchrun kills them, with a traceback instead of the reason."""
        if self.distributed:
            flag = torch.tensor([int(error is not None)], device=self.info.device)
            dist.broadcast(flag, src=0)
            if flag.item() and error is None:
                raise SyncError(f"rank 0 failed to {what}; its error line says why")
        if error is not None and error.code == grpc.StatusCode.UNAVAILABLE:
            raise SyncError(
                f"{error}; is the parameter server running at spes_config.server_addr={self.server_addr} "
                f"and reachable from this node?",
                error.code,
            ) from None
        if error is not None:
            raise error

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
