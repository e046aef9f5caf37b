"""The trainer's side of a SPES round: gather what this node trained, exchange it, load the global model.

One rank per node (rank 0) talks to the parameter server; the others take part only in the collective
gather and load (`spes.distributed.gather_full` / `load_full`, one whole tensor at a time, frozen experts
never gathered), so under DDP and FSDP2 every rank ends the round holding the same global weights.
Weights are loaded in place (`copy_` into the existing parameters or their shards), so the local AdamW
state is kept, as in the paper. A node the run has moved past (restarted from an older checkpoint, or left out of a
quorum round) loads the whole global model; the `SyncResult` says the step the trainer continues from.

Every round follows one path (`PeerSync`): at a sync step the node snapshots what it trained, uploads it, and
applies the round `overlap_steps` steps later together with the progress made meanwhile (the rule is
`spes.sync.overlap.apply_overlapped`, defined on what the codec serves: the global model, or a held-model codec's
held model). A blocking run (no `spes_config.overlap_sync`) is the case `overlap_steps = 0`: the round is applied at
the step it was uploaded, exactly as downloaded. With `overlap_sync` the exchange runs on a background thread and
training goes on.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import grpc
import torch
import torch.distributed as dist
from torch import nn

from spes.config import MODE_TITLES, TrainConfig
from spes.distributed import DistInfo, gather_full, load_full, unwrap
from spes.interrupt import Interrupted
from spes.sync.auth import read_token
from spes.sync.channel import tls_fix
from spes.sync.client import SERVER_SETTING, RoundPhases, SyncClient, SyncStats
from spes.sync.fragments import WHOLE
from spes.sync.node_files import (
    CODEC_FILE,
    PENDING_FILE,
    RUN_FILE,
    load_codec_state,
    read_pending,
    read_run_id,
    save_codec_state,
    write_run_id,
)
from spes.sync.overlap import PendingRound, apply_overlapped
from spes.sync.protocol import Manifest, Reason, SyncError, Tensors
from spes.sync.spec import RunSpec, run_spec
from spes.sync.status import REPORT_S, completed, describe

POLL_S = 0.2
"""How often rank 0, waiting for a round, looks whether a stop was requested."""
DRY_JOIN_RPC_S = 15.0
"""The longest a dry join waits for the server's answer (less when spes_config.rpc_timeout_s is): it asks once."""
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
                phases=_sum_phases(self.stats.phases, later.stats.phases),
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
            if self.stats.phases is not None:
                metrics.update({f"sync_{k}": v for k, v in asdict(self.stats.phases).items()})
        if self.waited_s is not None:
            metrics["sync_wait_s"] = self.waited_s
            metrics["sync_rounds"] = self.rounds
        if self.caught_up:
            metrics["caught_up_to"] = self.step
        return metrics


def _sum_phases(first: RoundPhases | None, then: RoundPhases | None) -> RoundPhases | None:
    """Two exchanges' phases added up; None unless both have them (a catch-up has none)."""
    return None if first is None or then is None else first + then


def model_manifest(model: nn.Module) -> tuple[Manifest, list[str]]:
    """What a node announces at Join: name -> shape of every parameter, and the names it trains."""
    named = list(model.named_parameters())
    return {n: tuple(p.shape) for n, p in named}, [n for n, p in named if p.requires_grad]


def node_spec(cfg: TrainConfig, manifest: Manifest, origin: str = "this node's config") -> RunSpec:
    """This node's run spec (`spes.sync.spec.run_spec` of its config and its model's manifest)."""
    return run_spec(cfg, manifest, origin=origin)


def sync_client(cfg: TrainConfig, spec: RunSpec, run_id: str | None = None, **settings: Any) -> SyncClient:
    """A client for this node's `spes_config` (`settings`: spes_config keys that replace the config's) in the run
    `run_id` (its checkpoint's; None: `spes_config.run_id`, or a fresh node's)."""
    s = replace(cfg.spes_config, **settings)
    token = read_token(s.token_file, "config key 'spes_config.token_file'")
    return SyncClient(spec, s.peer_id, s, token=token, reuse_buffers=True, run_id=run_id)


def dry_join_client(cfg: TrainConfig, manifest: Manifest, run_id: str | None = None) -> SyncClient:
    """A client for one dry join (`SyncClient.check_join`) of this node with `manifest`: asked once, no retries, a
    short deadline; what preflight and a node about to build its model ask the server."""
    s = cfg.spes_config
    spec = node_spec(cfg, manifest)
    return sync_client(cfg, spec, run_id, max_retries=0, rpc_timeout_s=min(s.rpc_timeout_s, DRY_JOIN_RPC_S))


def check_admitted(
    cfg: TrainConfig, model: nn.Module, info: DistInfo, checkpoint: Path | None, log: Callable[[str], None]
) -> None:
    """Ask the server whether it would admit this node (a dry join of `model`, built on the meta device, as the
    node resuming `checkpoint`) before the node allocates its weights and loads its checkpoint: a node of another
    mode, model, codec or credentials is refused in seconds, not after minutes of building. Raises on every rank
    on the server's definite refusal; a server not up yet (or too old to answer) is left to the real join, which
    waits for it."""
    error = _refusal(cfg, model, checkpoint, log) if info.is_main else None
    if info.world_size > 1:
        _share_failure(error, "be admitted by the parameter server", info)
    if error is not None:
        raise error


def _refusal(
    cfg: TrainConfig, model: nn.Module, checkpoint: Path | None, log: Callable[[str], None]
) -> Exception | None:
    """Rank 0's dry join: the server's definite refusal, or a setting no client can be made from; None when the
    server admits the node or did not answer."""
    try:
        run_id = read_run_id(checkpoint)
        client = dry_join_client(cfg, model_manifest(model)[0], run_id)
    except (ValueError, OSError) as exc:  # NOTE: on rank 0 alone: the other ranks hear of it from `_share_failure`
        return exc
    addr = cfg.spes_config.server_addr
    try:
        client.check_join(f"dry join of the parameter server at {SERVER_SETTING}={addr} (before building the model)")
    except SyncError as exc:
        if not exc.retryable and exc.reason != Reason.OLD_SERVER:
            return exc
        log(f"note: {exc}; building the model, then joining (waiting for the server as a join does)")
    finally:
        client.close()
    return None


class PeerSync:
    """Pushes this node's trained tensors and applies the global model: every `round_interval` steps a round is
    uploaded, and applied `overlap_steps` steps later (0 without `overlap_sync`).

    At sync step `s` every rank takes part in gathering what the node trains; rank 0 keeps the whole fp32 tensors on
    the CPU as the round's snapshot and exchanges it with the server (on a background thread when the round lands
    later). At step `s + overlap_steps` (the run's last step if that comes first) every rank waits for the round and
    applies
        theta <- served + (theta_now - theta_snapshot)   to what the node trains (`overlap_correction` c < 1:
                                                         theta_now + c * (served - theta_snapshot)),
        theta <- served                                  to the rest,
    computed on rank 0 from whole tensors and loaded into every rank's parameters or shards, so DDP replicas and FSDP
    shards end alike; the optimizer state is kept. A round applied at the step it was uploaded (c = 1) is loaded as
    downloaded: a blocking run. A fixed step rather than "when the round arrives" keeps a run deterministic whatever
    the link, and a resumed run repeats the uninterrupted one: a checkpoint taken while a round is in flight holds
    its snapshot (`PENDING_FILE`) and the codec's state from before it (`CODEC_FILE`); `resume` uploads the snapshot
    again (the server counts a repeated upload once) and applies the round when the interrupted run would have. A
    node the run moved past loads the latest global model instead.
    """

    def __init__(
        self,
        cfg: TrainConfig,
        model: nn.Module,
        info: DistInfo,
        log: Callable[[str], None] = print,
        run_id: str | None = None,
    ) -> None:
        """`run_id`: the run of the checkpoint the node resumes (`read_run_id`; None: a fresh node)."""
        self.model, self.info, self.log = model, info, log
        self.distributed = info.world_size > 1
        shapes, self.trainable = model_manifest(unwrap(model))  # NOTE: DDP's own names carry a `module.` prefix
        s = cfg.spes_config
        self.spec = node_spec(cfg, shapes)
        assert self.trainable == self.spec.trainable(s.peer_id), "the model trains other tensors than the run spec"
        self.layout, self.server_addr, self.last_step = self.spec.layout, s.server_addr, cfg.duration_steps
        self.tls_files = s.tls_ca, s.tls_cert
        self.overlap_steps = s.overlap_delay if s.overlap_sync else 0
        self.correction = s.overlap_correction if s.overlap_sync else 1.0
        # NOTE: `load_full` copies every result into the model at once, so the client may reuse its buffers
        self.client = sync_client(cfg, self.spec, run_id) if info.is_main else None
        self._taken: int | None = None
        """The step at which the round in flight was uploaded (every rank); None when none is."""
        self._pending: PendingRound | None = None
        """Rank 0: the round in flight, with its snapshot."""
        self._codec_before: tuple[dict[str, str], Tensors] = ({}, {})
        """Rank 0: the codec's state before the round in flight (what a checkpoint taken meanwhile holds)."""
        self._exchanged: Future[Exchange] | None = None
        """Rank 0: its exchange with the server."""
        self.stopping: Callable[[], bool] = lambda: False
        """Whether a stop was requested (the trainer's Ctrl-C): rank 0 then stops waiting for a round."""

    def join(self) -> None:
        """Announce this node's spec and manifest (the server refuses a node whose run differs); with fragments, say
        what each round uploads: a fragment much larger than the others takes longer than its share of the link."""
        error = None
        if self.client is not None:
            try:
                current = self.client.join()
                title, total = MODE_TITLES[self.spec.mode], len(self.spec.manifest or {})
                self.log(
                    f"joined parameter server as a {title} node ({completed(current)}); uploading "
                    f"{len(self.trainable)} of {total} tensors per round ({self.spec.codec})"
                )
            except SyncError as e:
                error = e
        self._agree(error, "join the parameter server")
        count = self.layout.overlap_fragments
        if count > 1:
            manifest = self.spec.manifest or {}
            sizes = [
                sum(math.prod(manifest[n]) * 4 for n in self.layout.names(k, self.trainable)) / 2**20
                for k in range(1, count + 1)
            ]
            self.log(
                f"{count} fragments, one every {self.layout.round_interval} steps, uploading "
                + ", ".join(f"{mb:.1f}" for mb in sizes)
                + " MiB (fp32) of what this node trains"
            )

    def syncs_at(self, step: int) -> bool:
        """Whether `step` is a sync step (one at which the node uploads a round)."""
        return self.layout.syncs_at(step, self.last_step)

    def sync(self, step: int) -> SyncResult:
        """Apply the round in flight (due by now), then upload the snapshot of `step`; apply that at once when it is
        due now (a blocking run, or the run's last step)."""
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
        """Files a checkpoint holds beside the model (rank 0 writes them): the run it belongs to, the round in flight,
        if any, and the codec's state before it."""
        files: dict[str, Callable[[Path], None]] = {}
        if self.client is not None and self.client.run_id:
            run_id = self.client.run_id
            files[RUN_FILE] = lambda path: write_run_id(path, run_id)
        if self._pending is not None:
            files[PENDING_FILE] = self._pending.save
        metadata, tensors = self._codec_before if self._pending is not None else self._codec_state()
        if metadata:
            files[CODEC_FILE] = lambda path: save_codec_state(path, metadata, tensors)
        return files

    def resume(self, checkpoint: Path, step: int) -> SyncResult | None:
        """Take up what the checkpoint of `step` holds: the codec's state, and the round it left in flight (uploaded
        again and applied when due). A round already due was being waited for when a stop request saved the
        checkpoint: it is applied now, with what that step had still to do (the upload of a sync step), as the
        uninterrupted run did; its result is returned."""
        codec_path = checkpoint / CODEC_FILE
        pending, error = None, None
        if self.client is not None:
            try:
                if codec_path.is_file():
                    self.client.codec.load_state_dict(*load_codec_state(codec_path))
                pending = read_pending(checkpoint, self.spec.manifest, self._trained_at)
            except (OSError, ValueError) as e:
                error = e
        self._agree(error, f"read {checkpoint}")
        taken = torch.tensor([pending.step if pending is not None else -1], device=self.info.device)
        if self.distributed:
            dist.broadcast(taken, src=0)
        if taken.item() < 0:
            return None
        self._start(pending, int(taken.item()))
        self.log(f"resumed the round of step {int(taken.item())} that {checkpoint} holds in flight")
        if not self._due(step):
            return None
        return self.sync(step) if int(taken.item()) < step and self.syncs_at(step) else self._land(step)

    def catch_up(self, step: int) -> SyncResult | None:
        """At start, with no round in flight: the run's whole global model when it has completed a round past `step`
        (a replacement node, or one resumed from an older checkpoint), loaded on every rank to continue from that
        round's step (else None). Trained on from `step`, it would be refused as stale a whole interval later."""
        if self._taken is not None:  # the round in flight catches up when it lands
            return None
        got, error = None, None
        if self.client is not None:
            try:
                got = self.client.catch_up(step)
            except SyncError as e:
                error = e
        self._agree(error, "catch up with the run")
        behind = torch.tensor([int(got is not None)], device=self.info.device)
        if self.distributed:
            dist.broadcast(behind, src=0)
        if not behind.item():
            return None
        downloaded, stats = got if got is not None else ({}, None)
        return self._load(step, downloaded, stats, snapshot=None, trained=[])

    def close(self) -> None:
        if self.client is not None:
            self.client.close()

    # -- the round's life -------------------------------------------------------------------------
    def _trained_at(self, step: int) -> list[str]:
        """What this node uploads at sync step `step`: the tensors it trains, of that step's fragment."""
        return self.layout.names(self.layout.fragment_at(step, self.last_step), self.trainable)

    def _due(self, step: int) -> bool:
        return self._taken is not None and step >= min(self._taken + self.overlap_steps, self.last_step)

    def _codec_state(self) -> tuple[dict[str, str], Tensors]:
        return self.client.codec.state_dict() if self.client is not None else ({}, {})

    def _start(self, pending: PendingRound | None, step: int) -> None:
        """Track the round uploaded at `step` (every rank); rank 0 runs its exchange, on a background thread when
        the round lands later."""
        self._taken = step
        if self.client is None:
            return
        assert pending is not None
        self._pending, self._codec_before = pending, self._codec_state()
        fragment = self.layout.fragment_at(step, self.last_step)

        def exchange() -> Exchange:
            return self._exchange(pending.round_id, pending.snapshot, fragment)

        self._exchanged = _in_background(exchange, f"spes-round-{step}")

    def _land(self, step: int) -> SyncResult:
        """Wait for the round in flight and apply it on every rank (a collective)."""
        started = time.perf_counter()
        downloaded: Tensors = {}
        stats, error, snapshot = None, None, {}
        if self._exchanged is not None and self._pending is not None:
            try:
                downloaded, stats, error = self._wait(self._exchanged, step)
            except Exception as e:  # noqa: BLE001 -- raised on every rank by _agree
                error = e
            snapshot = self._pending.snapshot
        taken = self._taken
        assert taken is not None
        self._agree(error, f"apply the round of step {taken}")  # NOTE: an interrupted round stays in flight
        self._taken, self._pending, self._exchanged = None, None, None
        as_downloaded = step == taken and self.correction == 1.0  # NOTE: nothing trained since the snapshot
        result = self._load(
            step, downloaded, stats, snapshot=None if as_downloaded else snapshot, trained=self._trained_at(taken)
        )
        return replace(result, waited_s=time.perf_counter() - started)

    def _wait(self, exchange: Future[Exchange], step: int) -> Exchange:
        """Rank 0's wait for its round, saying every `REPORT_S` what the run waits for (a node started before the
        others, a peer gone)."""
        reported = time.monotonic()
        while True:
            try:
                return exchange.result(timeout=POLL_S)
            except FutureTimeout:
                pass
            if self.stopping():
                raise Interrupted(f"stopped while waiting for the round of step {self._taken}")
            if time.monotonic() - reported >= REPORT_S:
                reported = time.monotonic()
                assert self.client is not None
                waiting = f"step {step}: waiting for the round of step {self._taken}"
                try:
                    self.log(f"{waiting}: {describe(self.client.status_reply())}")
                except SyncError as exc:
                    self.log(f"{waiting}; the server's status: {exc}")

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
        *,
        snapshot: Tensors | None,
        trained: list[str],
    ) -> SyncResult:
        """Load a round's served model on every rank (a collective): as downloaded, or, given the `snapshot` it was
        uploaded from (rank 0; {} elsewhere) of the tensors `trained`, with the local progress made since
        (`apply_overlapped`, on whole tensors on rank 0). A node that had fallen behind loads the whole global model
        and continues from its step.
        """
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
            now = gather_full(self.model, trained, self.info)
            if self.info.is_main:
                frozen = {n: p.detach() for n, p in unwrap(self.model).named_parameters() if n not in now}
                downloaded = apply_overlapped(downloaded, {**frozen, **now}, snapshot, self.correction)
            del now
        load_full(self.model, downloaded, self.info)
        if caught_up_to >= 0:
            return SyncResult(step=caught_up_to, caught_up=True, stats=stats)
        return SyncResult(step=step, stats=stats)

    def _agree(self, error: Exception | None, what: str) -> None:
        """Raise on every rank when rank 0's exchange with the server failed (`_share_failure`); rank 0's own line
        asks whether the server runs when it could not be reached."""
        if self.distributed:
            _share_failure(error, what, self.info)
        if isinstance(error, SyncError) and error.code == grpc.StatusCode.UNAVAILABLE and error.retryable:
            where = "there" if SERVER_SETTING in str(error) else f"at {SERVER_SETTING}={self.server_addr}"
            raise SyncError(
                f"{error}; is the parameter server running {where} and reachable from this node? "
                f"({tls_fix(*self.tls_files)})",
                error.code,
            ) from None
        if error is not None:
            raise error


def _share_failure(error: Exception | None, what: str, info: DistInfo) -> None:
    """Rank 0 tells the others whether its call to the server failed (a collective); they raise then: else they
    would wait in the next collective until torchrun kills them, with a traceback instead of the reason."""
    code = 0 if error is None else 2 if isinstance(error, Interrupted) else 1
    flag = torch.tensor([code], device=info.device)
    dist.broadcast(flag, src=0)
    if flag.item() == 2 and error is None:
        raise Interrupted(f"rank 0 stopped waiting to {what}")
    if flag.item() == 1 and error is None:
        raise SyncError(f"rank 0 failed to {what}; its error line says why")


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
