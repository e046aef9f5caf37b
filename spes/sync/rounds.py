"""Round bookkeeping of the parameter server: who may join, who may upload what, and when a round may close.

The server calls `RoundState` under its lock (and `spes.sync.merge.build_global`, the round's math, on its
aggregation thread); nothing here touches sockets or files, so every rule is tested directly (tests/test_rounds.py).

A round is keyed by the global step at which the peers synchronize. It opens with its first verified upload
and closes when every peer is in, or, under `--dead_peer_policy quorum`, once `--round_timeout` seconds have
passed since it opened and enough peers are in:

- shared tensors are averaged over the peers that arrived (in peer order, so the result is reproducible);
- an expert block whose owner did not arrive keeps its value in the previous global model;
- the very first round has no previous global model, so in SPES mode it cannot close without every owner
  of an expert block (`close_blocker` says so, and the waiting downloads fail with that message); with fragments
  (`spes.sync.fragments`), neither can the first round of each fragment.

Under `wait` (the reference behaviour) a round closes only with every peer.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import grpc

from spes.config import ServerSection
from spes.moe import parse_expert_block
from spes.sync.compress import Int8Payload
from spes.sync.deltas import HeldRound
from spes.sync.fragments import WHOLE, Layout
from spes.sync.merge import trainable_names
from spes.sync.proto import spes_pb2 as pb
from spes.sync.protocol import (
    INT8,
    PROTOCOL_VERSION,
    WIRE_CHOICES,
    Mode,
    Reason,
    Refused,
    Shape,
    Tensors,
    version_refusal,
)

MAX_MODEL_GB = 48.0
"""Default --max_model_gb: the paper's largest config (configs/upcycled_9b, 9.4B parameters) is 37.7 GB in fp32."""
MAX_TENSORS = 16384
"""Default --max_tensors: configs/upcycled_9b has 591 tensors."""
DeadPeerPolicy = Literal["wait", "quorum"]


@dataclass(frozen=True, kw_only=True)
class RoundPolicy:
    """When a round may close without every peer (the run config's `server.round_timeout_s`, `dead_peer_policy`
    and `min_peers`, whose defaults these are)."""

    num_peers: int
    """Peers in the run."""
    timeout_s: float = ServerSection.round_timeout_s
    """Seconds after a round's first upload after which it has timed out."""
    dead_peer_policy: DeadPeerPolicy = ServerSection.dead_peer_policy
    """`wait`: never close without every peer (downloads fail after the timeout); `quorum`: close with those in."""
    min_peers: int | None = ServerSection.min_peers
    """Fewest peers a quorum round needs; None means a majority (num_peers // 2 + 1)."""

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise ValueError(f"--round_timeout must be > 0 seconds, got {self.timeout_s}")
        if self.dead_peer_policy not in ("wait", "quorum"):
            raise ValueError(f"--dead_peer_policy must be 'wait' or 'quorum', got {self.dead_peer_policy!r}")
        if self.min_peers is not None and not 1 <= self.min_peers <= self.num_peers:
            raise ValueError(f"--min_peers must be in [1, num_peers={self.num_peers}], got {self.min_peers}")

    @property
    def quorum(self) -> int:
        return self.min_peers if self.min_peers is not None else self.num_peers // 2 + 1


@dataclass(frozen=True)
class RoundSnapshot:
    """A consistent picture of the round state (for Status, logs and persistence)."""

    open_round: int | None
    completed_round: int | None
    uploaded_peers: tuple[int, ...]
    round_peers: tuple[int, ...]
    aggregating: bool
    merged: bool
    alpha: float
    open_age_s: float


class RoundState:
    """One open round collecting uploads, and the latest completed round's global model.

    Not thread-safe by itself: the server calls it under its condition's lock. Memory held: the global
    model (+ DiLoCo momentum; on an int8 wire the held model and its deltas) and the committed uploads of the open
    round, handed to the aggregator (and dropped from here) when the round closes.
    """

    def __init__(self, num_peers: int) -> None:
        self.num_peers = num_peers
        self.open_round: int | None = None
        self.opened_at = 0.0
        self.uploaded: set[int] = set()
        self.staged: dict[int, Tensors] = {}
        self.relayed: dict[str, Int8Payload] = {}
        """Int8 wire: the uploaded payloads of the blocks the open round takes verbatim (relayed on download)."""
        self.aggregating = False
        self.completed_round: int | None = None
        self.completed_peers: frozenset[int] = frozenset()
        self.global_model: Tensors = {}
        self.outer_momentum: Tensors = {}
        self.held: HeldRound | None = None
        """Int8 wire: the held model of the completed round (None on other wires)."""
        self.merged = False
        self.alpha = 0.0
        self.failure: tuple[int, str] | None = None
        self.fragment = WHOLE
        """The part of the model the open round covers (`spes.sync.fragments`; WHOLE: every tensor)."""
        self.completed_fragment = WHOLE
        """The part of the model the latest completed round covers."""

    def missing_peers(self) -> list[int]:
        return [p for p in range(self.num_peers) if p not in self.uploaded]

    def admit(self, peer: int, step: int, fragment: int = WHOLE) -> bool:
        """May `peer` upload `fragment` of round `step`? True: already committed (idempotent no-op); raises Refused
        if not."""
        if step == self.completed_round and peer in self.completed_peers:
            return True
        if self.open_round is not None:
            if step == self.open_round and fragment != self.fragment:
                raise Refused(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"peer {peer} uploads fragment {fragment} for round {step}, whose other uploads are of fragment "
                    f"{self.fragment}: do all peers use the same spes_config.sync_steps and overlap_fragments?",
                )
            if step == self.open_round and (peer in self.uploaded or not self.aggregating):
                return peer in self.uploaded
            if step == self.open_round:
                raise Refused(
                    grpc.StatusCode.UNAVAILABLE,
                    f"round {step} timed out and is closing without peer {peer}; retry to catch up once it completes",
                    Reason.BUSY,
                )
            if step < self.open_round:
                raise Refused(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"round {step} is old: round {self.open_round} is open now",
                    Reason.STALE_ROUND,
                )
            if self.aggregating:
                raise Refused(
                    grpc.StatusCode.UNAVAILABLE,
                    f"round {step} cannot open while round {self.open_round} is being aggregated; retry shortly",
                    Reason.BUSY,
                )
            raise Refused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"round {step} is ahead of the open round {self.open_round}, which still waits for peers "
                f"{self.missing_peers()}: do all peers use the same sync_steps?",
                Reason.FUTURE_ROUND,
            )
        if self.completed_round is not None and step <= self.completed_round:
            raise Refused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"round {step} is old: round {self.completed_round} has already completed"
                + ("" if step < self.completed_round else f" without peer {peer}"),
                Reason.STALE_ROUND,
            )
        return False

    def stage_upload(
        self,
        peer: int,
        step: int,
        tensors: Tensors,
        relayed: Mapping[str, Int8Payload] | None = None,
        fragment: int = WHOLE,
    ) -> bool:
        """Commit a complete, verified upload of `fragment` (and, int8 wire, the payloads of its verbatim blocks);
        opens the round if needed. True when every peer is in."""
        if self.open_round is None:
            self.open_round, self.opened_at, self.failure, self.fragment = step, time.monotonic(), None, fragment
        assert step == self.open_round and peer not in self.uploaded and not self.aggregating
        self.failure = None
        self.uploaded.add(peer)
        self.staged[peer] = tensors
        self.relayed.update(relayed or {})
        return len(self.uploaded) == self.num_peers

    def check_download(self, peer: int, step: int, full: bool) -> bool:
        """May a download of round `step` be served now (True), wait (False), or never (raises Refused)?"""
        if self.completed_round == step:
            return True
        if self.failure is not None and self.failure[0] == step:
            raise Refused(grpc.StatusCode.INTERNAL, self.failure[1])
        if self.completed_round is not None and step < self.completed_round:
            raise Refused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"round {step} is no longer available: the latest completed round is {self.completed_round}",
                Reason.STALE_ROUND,
            )
        if step != self.open_round or (peer not in self.uploaded and not full):
            raise Refused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"the server holds no upload of peer {peer} for round {step} (open round: {self.open_round}, "
                f"latest completed: {self.completed_round}): upload it first",
                Reason.UNKNOWN_ROUND,
            )
        return False

    def seconds_left(self, policy: RoundPolicy, now: float | None = None) -> float:
        """Seconds until the open round times out (0 once it has; inf while it is aggregating)."""
        if self.open_round is None or self.aggregating:
            return float("inf")
        now = time.monotonic() if now is None else now
        return max(0.0, self.opened_at + policy.timeout_s - now)

    def must_close(self, policy: RoundPolicy, owners: frozenset[int], now: float | None = None) -> bool:
        """True when the open round timed out and may close with the peers in (quorum).

        Raises Refused (reason `round_timeout`, naming the missing peers) when it timed out and may not.
        """
        if self.seconds_left(policy, now) > 0:
            return False
        blocker = self.close_blocker(policy, owners)
        if blocker:
            raise Refused(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"round {self.open_round} did not complete within --round_timeout={policy.timeout_s:g} s of its "
                f"first upload: {blocker}",
                Reason.ROUND_TIMEOUT,
            )
        return True

    def close_blocker(self, policy: RoundPolicy, owners: frozenset[int]) -> str:
        """Why the open round cannot close with the peers in now ('' when it can); `owners` own expert blocks the
        round covers of which the global model holds no copy yet (`spes.sync.coordinator`), so they must be in."""
        missing = self.missing_peers()
        if policy.dead_peer_policy == "wait":
            return f"still waiting for peers {missing} (--dead_peer_policy wait needs every peer)"
        if len(self.uploaded) < policy.quorum:
            return f"only peers {sorted(self.uploaded)} arrived, fewer than --min_peers={policy.quorum}"
        unseen = sorted(owners & set(missing))
        if unseen:
            return (
                f"still waiting for peers {missing}: no global copy of the experts of peers {unseen} exists yet "
                "(the run's first round, or the first of their fragment), so this round needs every such owner"
            )
        return ""

    def take_uploads(self) -> tuple[dict[int, Tensors], dict[str, Int8Payload]]:
        """Hand the round's uploads and relayed payloads to the aggregator (they are no longer held here); the round
        is aggregating."""
        assert self.uploaded and not self.aggregating
        self.aggregating = True
        uploads, self.staged = self.staged, {}
        relayed, self.relayed = self.relayed, {}
        return uploads, relayed

    def complete(
        self,
        step: int,
        global_model: Tensors,
        outer_momentum: Tensors,
        merged: bool,
        alpha: float,
        held: HeldRound | None = None,
    ) -> None:
        """Publish the global model of round `step`, built from the uploads of `self.uploaded`."""
        assert step == self.open_round and self.aggregating
        self.restore(step, self.uploaded, global_model, outer_momentum, merged, alpha, held, self.fragment)

    def restore(
        self,
        step: int,
        peers: set[int] | frozenset[int],
        global_model: Tensors,
        outer_momentum: Tensors,
        merged: bool,
        alpha: float,
        held: HeldRound | None = None,
        fragment: int = WHOLE,
    ) -> None:
        """Make round `step`, over `fragment`, the latest completed one (also how a restarted server resumes); no
        round is open."""
        self.completed_round, self.completed_peers, self.completed_fragment = step, frozenset(peers), fragment
        self.global_model, self.outer_momentum, self.held = global_model, outer_momentum, held
        self.merged, self.alpha = merged, alpha
        self.open_round, self.uploaded, self.staged, self.aggregating = None, set(), {}, False
        self.relayed, self.failure = {}, None

    def fail(self, step: int, message: str) -> None:
        """Aggregation failed: drop the uploads so the peers can upload round `step` again."""
        self.failure = (step, message)
        self.uploaded, self.staged, self.relayed, self.aggregating = set(), {}, {}, False

    def snapshot(self) -> RoundSnapshot:
        return RoundSnapshot(
            open_round=self.open_round,
            completed_round=self.completed_round,
            uploaded_peers=tuple(sorted(self.uploaded)),
            round_peers=tuple(sorted(self.completed_peers)),
            aggregating=self.aggregating,
            merged=self.merged,
            alpha=self.alpha,
            open_age_s=time.monotonic() - self.opened_at if self.open_round is not None else 0.0,
        )


def describe_names(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def check_join(
    request: pb.JoinRequest,
    *,
    num_peers: int,
    experts_per_peer: int,
    mode: Mode,
    wire_dtype: str = "fp32",
    max_tensors: int = MAX_TENSORS,
    max_model_gb: float | None = MAX_MODEL_GB,
) -> tuple[dict[str, Shape], list[str]]:
    """Validate a Join against the run: settings, wire dtype, manifest, and the names the peer claims to train.

    The manifest's tensor count is checked before anything else is read and its size (fp32) against
    `max_model_gb` (None: unbounded, when the server knows the run's model), so no buffer is ever sized by
    a peer's numbers past those bounds. Returns (name -> shape of every tensor, the names it trains);
    raises Refused saying what differs.
    """
    peer = request.peer_id
    for what, count in (("manifest", len(request.manifest)), ("trainable list", len(request.trainable))):
        if count > max_tensors:
            raise Refused(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"peer {peer}'s {what} names {count} tensors, more than --max_tensors={max_tensors}",
            )
    if request.protocol != PROTOCOL_VERSION:
        raise version_refusal(f"peer {peer}", request.protocol)
    if not 0 <= peer < num_peers:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"peer_id {peer} is outside [0, {num_peers}) for this run")
    for what, theirs, ours in (  # NOTE: named as the run's YAML names them (spes_config.*)
        ("num_peers", request.num_peers, num_peers),
        ("num_train_experts_per_node", request.experts_per_peer, experts_per_peer),
        ("mode", request.mode, mode),
    ):
        if theirs != ours:
            raise Refused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"peer {peer} has {what}={theirs!r} but the server runs with {what}={ours!r}",
            )
    if request.wire_dtype not in WIRE_CHOICES:
        raise Refused(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"peer {peer}: unknown wire_dtype {request.wire_dtype!r}, use one of {list(WIRE_CHOICES)}",
        )
    if (request.wire_dtype == INT8) != (wire_dtype == INT8):  # NOTE: fp32 and bf16 peers may mix, int8 is run-wide
        raise Refused(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"peer {peer} has wire_dtype={request.wire_dtype!r} but the server runs with wire_dtype={wire_dtype!r}: "
            "int8 deltas need the server's held model, so every node and the server must use int8 or none does "
            "(set spes_config.wire_dtype alike in every node's YAML and the server's)",
        )
    shapes = {spec.name: tuple(int(d) for d in spec.shape) for spec in request.manifest}
    if len(shapes) != len(request.manifest):
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"peer {peer}: the manifest names a tensor twice")
    try:
        check_manifest(shapes, num_peers=num_peers, experts_per_peer=experts_per_peer, mode=mode)
    except ValueError as exc:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"peer {peer}: {exc}") from None
    _check_fragments(request, shapes, mode)
    size_gb = 4 * sum(math.prod(shape) for shape in shapes.values()) / 1e9
    if max_model_gb is not None and size_gb > max_model_gb:
        raise Refused(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"peer {peer}'s manifest declares a model of {size_gb:.4g} GB in fp32, more than "
            f"--max_model_gb={max_model_gb:g} (start the server with the run's YAML, or raise the limit)",
        )
    given = list(request.trainable)
    expected = set(trainable_names(list(shapes), peer, mode))
    if len(set(given)) != len(given) or set(given) != expected:
        wrong, lacking = sorted(set(given) - expected), sorted(expected - set(given))
        raise Refused(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"peer {peer} in {mode} mode must train exactly the shared tensors"
            + (" and its own expert blocks" if mode == "spes" else " and all experts")
            + (f"; it also claims {describe_names(wrong)}" if wrong else "")
            + (f"; it lacks {describe_names(lacking)}" if lacking else "")
            + ("; it lists a name twice" if not (wrong or lacking) else ""),
        )
    return shapes, given


def _check_fragments(request: pb.JoinRequest, shapes: Mapping[str, Shape], mode: Mode) -> None:
    """A Join's fragment layout (`spes.sync.fragments`) must be one its model can be cut into; raises Refused."""
    count, sync_steps, peer = request.fragments, request.sync_steps, request.peer_id
    if count <= 1:
        return
    problem = "fragments cannot be combined with wire_dtype='int8'" if request.wire_dtype == INT8 else ""
    if not problem:
        try:
            Layout.of(shapes, count, sync_steps, mode)
        except ValueError as exc:
            problem = str(exc)
    if problem:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"peer {peer} asks for {count} fragments: {problem}")


def check_manifest(shapes: Mapping[str, Shape], *, num_peers: int, experts_per_peer: int, mode: Mode) -> None:
    """Validate a model manifest's expert blocks against the run's ownership layout (ValueError)."""
    if not shapes:
        raise ValueError("the manifest is empty: send the name and shape of every tensor of the model")
    for name, shape in shapes.items():
        if any(d < 0 for d in shape):
            raise ValueError(f"tensor {name!r} has a negative dimension in shape {list(shape)}")
        parsed = parse_expert_block(name)
        if parsed is None:
            continue
        if not shape or shape[0] > experts_per_peer:
            raise ValueError(
                f"expert block {name!r} has shape {list(shape)}: dim 0 must hold "
                f"<= num_train_experts_per_node={experts_per_peer} experts"
            )
        if mode == "spes" and parsed.block >= num_peers:
            raise ValueError(
                f"expert block {name!r} would be owned by peer {parsed.block}, but the run has only {num_peers} peers"
            )


def manifest_differences(known: Mapping[str, Shape], given: Mapping[str, Shape]) -> str:
    """A human-readable list of how `given` differs from `known` ('' when equal)."""
    problems = []
    missing = sorted(set(known) - set(given))
    extra = sorted(set(given) - set(known))
    reshaped = sorted(n for n in set(known) & set(given) if tuple(known[n]) != tuple(given[n]))
    if missing:
        problems.append(f"missing {describe_names(missing)}")
    if extra:
        problems.append(f"unknown {describe_names(extra)}")
    problems.extend(f"{n!r} has shape {list(given[n])}, the run's is {list(known[n])}" for n in reshaped[:5])
    return "; ".join(problems)
