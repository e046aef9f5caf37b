"""The trainer's side of a SPES round: gather what this node trained, exchange it, load the global model.

One rank per node (rank 0) talks to the parameter server; the others take part only in the collective
gather and load (`spes.distributed.gather_full` / `load_full`, one whole tensor at a time, frozen experts
never gathered), so under DDP and FSDP2 every rank ends the round holding the same global weights.
Weights are loaded in place (`copy_` into the existing parameters or their shards), so the local AdamW
state is kept, as in the paper. A node the run has moved past (restarted from an older checkpoint, or left out of a
quorum round) loads the whole global model; the `SyncResult` says the step the trainer continues from.

With `spes_config.overlap_sync` the node does not stop for the round (`OverlappedSync`): it uploads a snapshot
of what it trained from a background thread, trains on, and applies the round's global model a fixed number
of steps later together with the progress made meanwhile (the rule is `spes.sync.overlap.apply_overlapped`).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import grpc
import torch
import torch.distributed as dist
from torch import nn

from spes.config import TrainConfig
from spes.distributed import DistInfo, gather_full, load_full, unwrap
from spes.sync.auth import read_token
from spes.sync.client import SyncClient, SyncStats
from spes.sync.fragments import WHOLE, Layout, fragment_at
from spes.sync.overlap import PendingRound, apply_overlapped
from spes.sync.protocol import Manifest, SyncError, Tensors

PENDING_FILE = "pending_round.st"
"""The checkpoint file (safetensors) holding an overlapped round still in flight when the checkpoint was taken.

NOTE: not named `*.safetensors`: a sharded checkpoint's reader takes every such file of the directory for a shard."""
T = TypeVar("T")
Exchange = tuple[Tensors, SyncStats | None, Exception | None]
"""What rank 0's exchange with the server gave: the download, its statistics, or the failure."""


@dataclass(frozen=True)
class SyncResult:
    """What one round did for this node; every rank gets the same `step` and `caught_up`."""

    step: int
    """The step to continue from: the round's own, or the run's when this node had fallen behind."""
    caught_up: bool = False
    """True when this node had fallen behind the run and loaded the whole global model of round `step`."""
    stats: SyncStats | None = None
    """What the exchange cost and what the server did (rank 0 only: the other ranks do not meet the server)."""
    rounds: int = 1
    """Rounds whose global model was applied: 1 for a blocking round; overlapped, 0 when a round was only started,
    and 2 at the run's last step (the round due then and the one uploaded then)."""
    waited_s: float | None = None
    """Overlapped rounds: seconds training stood still for them (waiting for the global model and applying it)."""

    def then(self, later: SyncResult) -> SyncResult:
        """This result and a `later` one of the same step as one: rounds, bytes, seconds and waits added up."""
        stats = self.stats if later.stats is None else later.stats
        if self.stats is not None and later.stats is not None:
            stats = replace(
                later.stats,
                seconds=self.stats.seconds + later.stats.seconds,
                bytes_up=self.stats.bytes_up + later.stats.bytes_up,
                bytes_down=self.stats.bytes_down + later.stats.bytes_down,
                merged=self.stats.merged or later.stats.merged,
            )
        waits = [w for w in (self.waited_s, later.waited_s) if w is not None]
        return replace(later, stats=stats, rounds=self.rounds + later.rounds, waited_s=sum(waits) if waits else None)

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
        if self.waited_s is not None:
            metrics["sync_wait_s"] = self.waited_s
            metrics["sync_rounds"] = self.rounds
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
        "fragments": s.overlap_fragments,
        "sync_steps": s.sync_steps,
    }
    return SyncClient(s.server_addr, **{**settings, **overrides})


def node_sync(cfg: TrainConfig, model: nn.Module, info: DistInfo, log: Callable[[str], None] = print) -> PeerSync:
    """This node's side of the rounds: `OverlappedSync` with `spes_config.overlap_sync`, else a blocking `PeerSync`."""
    return (OverlappedSync if cfg.spes_config.overlap_sync else PeerSync)(cfg, model, info, log)


class PeerSync:
    """Pushes this node's trained tensors and pulls the global model every `sync_steps` steps."""

    def __init__(self, cfg: TrainConfig, model: nn.Module, info: DistInfo, log: Callable[[str], None] = print) -> None:
        self.model, self.info, self.log = model, info, log
        self.distributed = info.world_size > 1
        self.shapes, self.trainable = model_manifest(unwrap(model))  # NOTE: DDP's own names carry a `module.` prefix
        self.server_addr = cfg.spes_config.server_addr
        self.interval = cfg.spes_config.round_interval
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

    def syncs_at(self, step: int) -> bool:
        """Whether `step` is a sync step (one at which the node uploads a round)."""
        return step % self.interval == 0

    def sync(self, step: int) -> SyncResult:
        """One round at `step`: upload, wait for the global model, load it; every rank returns the same step."""
        upload = gather_full(self.model, self.trainable, self.info)
        downloaded, stats, error = self._exchange(step, upload)
        del upload
        return self._load(step, downloaded, stats, error, what=f"synchronize at step {step}")

    def land(self, step: int) -> SyncResult | None:
        """Nothing to do between sync steps: a blocking round is loaded before `sync` returns."""
        return None

    def checkpoint_files(self) -> dict[str, Callable[[Path], None]]:
        """Files a checkpoint needs beside the model, optimizer and trainer state: none, nothing is in flight."""
        return {}

    def resume(self, checkpoint: Path) -> None:
        """Refuse a checkpoint taken while an overlapped round was in flight: a blocking node would drop it."""
        if (checkpoint / PENDING_FILE).is_file():
            raise ValueError(
                f"checkpoint {checkpoint} was taken while an overlapped round was in flight ({PENDING_FILE}); "
                "resume it with spes_config.overlap_sync=true, or from a checkpoint taken without overlap"
            )

    def _exchange(self, step: int, upload: Tensors, fragment: int = WHOLE) -> Exchange:
        """Rank 0's exchange with the server (nothing on the other ranks); a failure is returned, for `_agree`."""
        if self.client is None:
            return {}, None, None
        try:
            downloaded, stats = self.client.sync(step, upload, fragment)
        except SyncError as e:
            return {}, None, e
        return downloaded, stats, None

    def _load(
        self,
        step: int,
        downloaded: Tensors,
        stats: SyncStats | None,
        error: Exception | None,
        *,
        what: str,
        snapshot: Tensors | None = None,
        correction: float = 1.0,
        trained: list[str] | None = None,
    ) -> SyncResult:
        """Load a round's global model on every rank (a collective): as downloaded, or, given the `snapshot` it was
        uploaded from (rank 0; {} elsewhere) of the tensors `trained` (every rank), with the local progress made
        since (`apply_overlapped`, on whole tensors on rank 0). A node that had fallen behind loads the whole
        global model and continues from its step.
        """
        self._agree(error, what)
        caught_up_to = stats.round if stats is not None and stats.caught_up else -1
        if self.distributed:  # every rank's trainer must continue from the same step
            flag = torch.tensor([caught_up_to], device=self.info.device)
            dist.broadcast(flag, src=0)
            caught_up_to = int(flag.item())
        if caught_up_to >= 0:
            self.log(
                f"step {step}: this node had fallen behind the run; loaded the whole global model of "
                f"round {caught_up_to} and continues from step {caught_up_to}"
            )
        elif snapshot is not None:
            now = gather_full(self.model, self.trainable if trained is None else trained, self.info)
            if self.info.is_main:
                frozen = {n: p.detach() for n, p in unwrap(self.model).named_parameters() if n not in now}
                downloaded = apply_overlapped(downloaded, {**frozen, **now}, snapshot, correction)
            del now
        load_full(self.model, downloaded, self.info)
        if caught_up_to >= 0:
            return SyncResult(step=caught_up_to, caught_up=True, stats=stats)
        return SyncResult(step=step, stats=stats)

    def _agree(self, error: Exception | None, what: str) -> None:
        """Raise on every rank when rank 0's exchange with the server failed: the other ranks would otherwise wait
        in the next collective until torchrun kills them, with a traceback instead of the reason."""
        if self.distributed:
            flag = torch.tensor([int(error is not None)], device=self.info.device)
            dist.broadcast(flag, src=0)
            if flag.item() and error is None:
                raise SyncError(f"rank 0 failed to {what}; its error line says why")
        if isinstance(error, SyncError) and error.code == grpc.StatusCode.UNAVAILABLE:
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


class OverlappedSync(PeerSync):
    """PeerSync that trains on while its round is in flight (`spes_config.overlap_sync`).

    At sync step `s` every rank takes part in gathering what the node trains; rank 0 keeps the whole fp32 tensors
    on the CPU as the round's snapshot, uploads them from a background thread, and training goes on. At step
    `s + overlap_steps` (the run's last step if that comes first) every rank waits for the round and applies
        theta <- global + (theta_now - theta_snapshot)   to what the node trains (`overlap_correction` c < 1:
                                                         theta_now + c * (global - theta_snapshot)),
        theta <- global                                  to the rest,
    computed on rank 0 from whole tensors and loaded into every rank's parameters or shards, so DDP replicas and
    FSDP shards end alike; the optimizer state is kept. A fixed step rather than "when the round arrives" keeps a
    run deterministic whatever the link: a delay of 0 (with c = 1) is the blocking run bit for bit, a resumed run
    repeats the uninterrupted one. A failed round raises at that step on every rank, as a blocking one does.

    Checkpoints do not wait for the round: one taken while it is in flight holds its snapshot (`PENDING_FILE`,
    safetensors), and `resume` uploads it again (the server counts a repeated upload once) and applies the round
    at the step the interrupted run would have. A node the run moved past loads the latest global model instead.
    """

    def __init__(self, cfg: TrainConfig, model: nn.Module, info: DistInfo, log: Callable[[str], None] = print) -> None:
        super().__init__(cfg, model, info, log)
        s = cfg.spes_config
        self.delay, self.last_step, self.correction = s.overlap_delay, cfg.duration_steps, s.overlap_correction
        self.sync_steps, self.layout = (
            s.sync_steps,
            Layout.of(self.shapes, s.overlap_fragments, s.sync_steps, "diloco" if cfg.mode == "diloco" else "spes"),
        )
        self._taken: int | None = None
        """The step at which the round in flight was uploaded (every rank); None when none is."""
        self._pending: PendingRound | None = None
        """Rank 0: the round in flight, with its snapshot."""
        self._exchanged: Future[Exchange] | None = None
        """Rank 0: its exchange with the server, running on a background thread."""

    def sync(self, step: int) -> SyncResult:
        """Apply the round in flight (due by now), then upload the snapshot of `step` in the background; apply that
        at once when it is due now (a delay of 0, or the run's last step)."""
        landed = self._land(step) if self._taken is not None else SyncResult(step=step, rounds=0)
        if landed.caught_up:  # the run has moved past this node: it continues from the round it loaded
            return landed
        snapshot = gather_full(self.model, self._trained_at(step), self.info)
        self._start(PendingRound(round_id=step, step=step, snapshot=snapshot) if self.info.is_main else None, step)
        return landed.then(self._land(step)) if self._due(step) else landed

    def land(self, step: int) -> SyncResult | None:
        """Apply the round in flight if it is due at `step` (a collective then); None otherwise."""
        return self._land(step) if self._due(step) else None

    def checkpoint_files(self) -> dict[str, Callable[[Path], None]]:
        """The round in flight, if any, as `PENDING_FILE` (rank 0 holds it and writes the checkpoint's files)."""
        return {PENDING_FILE: self._pending.save} if self._pending is not None else {}

    def resume(self, checkpoint: Path) -> None:
        """Take up the round a checkpoint left in flight: upload its snapshot again and apply the round when due."""
        path = checkpoint / PENDING_FILE
        pending, error = None, None
        if self.info.is_main and path.is_file():
            try:
                pending = PendingRound.load(path, self.shapes)
                if sorted(pending.snapshot) != sorted(self._trained_at(pending.step)):
                    raise ValueError(
                        f"pending round {path}: its snapshot is not of the tensors this node trains at step "
                        f"{pending.step} (was it written by another spes_config.peer_id, mode, sync_steps or "
                        "overlap_fragments?)"
                    )
            except (OSError, ValueError) as e:
                error = e
        self._agree(error, f"read {path}")
        taken = torch.tensor([pending.step if pending is not None else -1], device=self.info.device)
        if self.distributed:
            dist.broadcast(taken, src=0)
        if taken.item() >= 0:
            self._start(pending, int(taken.item()))
            self.log(f"resumed the round of step {int(taken.item())} that {checkpoint} holds in flight")

    def join(self) -> None:
        """Join, and with fragments say what each round uploads: a fragment much larger than the others takes
        longer than `sync_steps / F` steps on a link sized for the whole model."""
        super().join()
        if self.layout.count > 1:
            sizes = [
                sum(math.prod(self.shapes[n]) * 4 for n in self.layout.names(k, self.trainable)) / 2**20
                for k in range(1, self.layout.count + 1)
            ]
            self.log(
                f"{self.layout.count} fragments, one every {self.interval} steps, uploading "
                + ", ".join(f"{mb:.1f}" for mb in sizes)
                + " MiB (fp32) of what this node trains"
            )

    def syncs_at(self, step: int) -> bool:
        """Every `sync_steps / F` steps; with fragments also the run's last step, which syncs the whole model."""
        return super().syncs_at(step) or (self.layout.count > 1 and step == self.last_step)

    def _fragment(self, step: int) -> int:
        return fragment_at(step, self.sync_steps, self.layout.count, self.last_step)

    def _trained_at(self, step: int) -> list[str]:
        """What this node uploads at sync step `step`: the tensors it trains, of that step's fragment."""
        return self.layout.names(self._fragment(step), self.trainable)

    def _due(self, step: int) -> bool:
        return self._taken is not None and step >= min(self._taken + self.delay, self.last_step)

    def _start(self, pending: PendingRound | None, step: int) -> None:
        """Track the round uploaded at `step` (every rank); rank 0 runs its exchange on a background thread."""
        self._taken = step
        if self.client is not None:
            assert pending is not None
            self._pending = pending
            round_id, snapshot, fragment = pending.round_id, pending.snapshot, self._fragment(step)
            self._exchanged = _in_background(
                lambda: self._exchange(round_id, snapshot, fragment), f"spes-round-{round_id}"
            )

    def _land(self, step: int) -> SyncResult:
        """Wait for the round in flight and apply it on every rank (a collective)."""
        started = time.perf_counter()
        downloaded: Tensors = {}
        stats, error, snapshot = None, None, {}
        if self._exchanged is not None and self._pending is not None:
            try:
                downloaded, stats, error = self._exchanged.result()
            except Exception as e:  # noqa: BLE001 -- raised on every rank by _load
                error = e
            snapshot = self._pending.snapshot
        taken = self._taken
        assert taken is not None
        self._taken, self._pending, self._exchanged = None, None, None
        result = self._load(
            step,
            downloaded,
            stats,
            error,
            what=f"apply the round of step {taken}",
            snapshot=snapshot,
            correction=self.correction,
            trained=self._trained_at(taken),
        )
        return replace(result, waited_s=time.perf_counter() - started)


def _in_background(fn: Callable[[], T], name: str) -> Future[T]:
    """Run `fn` on a daemon thread (a round stuck at exit must not keep the process alive); its Future."""
    future: Future[T] = Future()

    def run() -> None:
        try:
            future.set_result(fn())
        except BaseException as e:  # noqa: BLE001 -- handed to the waiting trainer
            future.set_exception(e)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future
