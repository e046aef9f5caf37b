"""The run spec: what the server and every peer of one run agree on, built once from the run's YAML.

`run_spec(cfg, manifest)` is the one function that makes it, on the server (`python -m spes.server RUN.yaml`, the
manifest of the model its YAML builds) and on every node (its own model's manifest): the mode, the peers, who
trains which tensor (`block_owners`, data: block b of every MoE layer belongs to peer `block_owners[b]`), the
round schedule (`sync_steps`, fragments), the codec and its settings, and the model's manifest. The server's
`server:` section (merge warm-up, outer optimizer, dead peers) rides along for the server; a node's copy of it is
not compared. A Join sends the peer's spec; `differences` names the first field that differs from the server's,
root causes first (the mode, then the layout, then the schedule, then the codec).

A server started without the run's YAML (the first implementation's habit, `TOTAL_PEERS=4
run_scripts/run_parameter_server.sh`) has a spec whose manifest, `sync_steps` and block owners are open (None): the
first node to join completes it (`completed_by`), and from then on it is held like any other.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import TYPE_CHECKING, Any

from spes.config import ServerSection
from spes.moe import parse_expert_block
from spes.sync.codecs.registry import Codec, build_codec
from spes.sync.fragments import Layout
from spes.sync.proto import spes_pb2 as pb
from spes.sync.protocol import Manifest, Mode

if TYPE_CHECKING:
    from spes.config import TrainConfig

FIELD_KEYS = {
    "mode": "using_spes / using_dilico",
    "num_peers": "spes_config.num_peers",
    "experts_per_block": "spes_config.num_train_experts_per_node",
    "block_owners": "spes_config.num_peers and num_train_experts_per_node",
    "sync_steps": "spes_config.sync_steps",
    "last_step": "max_duration",
    "overlap_fragments": "spes_config.overlap_fragments",
    "codec": "spes_config.codec",
    "codec_settings": "spes_config.codec_settings",
}
"""The fields a join compares, in the order they are compared, and the config keys that set each."""


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    """One run's settings that every end must share (see the module docstring)."""

    mode: Mode
    num_peers: int
    experts_per_block: int | None
    """Experts per ownership block of a MoE layer (`num_train_experts_per_node`; DiLoCo: every expert, one block);
    None: open."""
    block_owners: tuple[int, ...] | None
    """SPES: the peer that trains expert block b of every layer is `block_owners[b]`; DiLoCo: () (all train all);
    None: open (a server without the run's YAML does not know the model's experts)."""
    sync_steps: int | None
    """Steps between two rounds over the same tensors; None: open, taken from the first node to join."""
    last_step: int | None = None
    """The run's last step (`max_duration`): with fragments its round covers the whole model; None: open."""
    overlap_fragments: int = 1
    """Fragments of the model synchronized on staggered steps (`spes.sync.fragments`; 1: none)."""
    codec: str = "fp32"
    codec_settings: tuple[tuple[str, int], ...] = ()
    """The codec's settings, every one of them (defaults filled in), sorted by name."""
    manifest: Manifest | None = field(default=None, compare=False, repr=False)
    """Every tensor of the model (name -> shape); None: open, taken from the first node to join."""
    server: ServerSection = field(default_factory=ServerSection, compare=False, repr=False)
    """The run's `server:` section: the server's own say (a node's copy is not compared)."""
    origin: str = field(default="", compare=False)
    """Where the spec came from (a YAML path, "the server's command line"), for messages."""

    def __post_init__(self) -> None:
        if self.mode not in ("spes", "diloco"):
            raise ValueError(f"run mode {self.mode!r}: a parameter server runs 'spes' or 'diloco'")
        if self.num_peers < 1 or (self.experts_per_block is not None and self.experts_per_block < 1):
            raise ValueError(
                f"a run needs num_peers >= 1 and experts per block >= 1, got {self.num_peers}, {self.experts_per_block}"
            )
        if any(not 0 <= p < self.num_peers for p in self.block_owners or ()):
            raise ValueError(f"block_owners {self.block_owners} name peers outside [0, {self.num_peers})")
        if self.overlap_fragments < 1:
            raise ValueError(f"config key 'spes_config.overlap_fragments' = {self.overlap_fragments} must be >= 1")
        if self.sync_steps is not None and (self.sync_steps < 1 or self.sync_steps % self.overlap_fragments):
            raise ValueError(
                f"config key 'spes_config.sync_steps' = {self.sync_steps} must be >= 1 and a multiple of "
                f"spes_config.overlap_fragments={self.overlap_fragments}"
            )
        object.__setattr__(self, "codec_settings", tuple(sorted(self.codec_impl.settings.items())))

    # -- who trains what ------------------------------------------------------------------------
    def owner(self, name: str) -> int | None:
        """The peer that alone trains tensor `name` (an expert block in SPES mode), or None when every peer does."""
        parsed = parse_expert_block(name) if self.mode == "spes" else None
        if parsed is None:
            return None
        if self.block_owners is None:
            raise ValueError("the run spec's ownership is open (no node has joined a server started without YAML)")
        if parsed.block >= len(self.block_owners):
            raise ValueError(f"expert block {name!r} has no owner: the run has {len(self.block_owners)} blocks")
        return self.block_owners[parsed.block]

    def trainable(self, peer: int, names: Iterable[str] | None = None) -> list[str]:
        """What `peer` trains and uploads, in manifest order: the shared tensors and the blocks it owns."""
        return [n for n in self._names(names) if self.owner(n) in (None, peer)]

    def downloads(self, peer: int, names: Iterable[str] | None = None, *, merged: bool) -> list[str]:
        """What `peer` needs back from a round: all but its own blocks, which it has already (its own too when a
        merge round changed them)."""
        return [n for n in self._names(names) if merged or self.owner(n) != peer]

    def own(self, peer: int, names: Iterable[str] | None = None) -> list[str]:
        """The tensors only `peer` trains: its expert blocks (SPES)."""
        return [n for n in self._names(names) if self.owner(n) == peer]

    def round_bytes(self, peer: int, *, merged: bool) -> tuple[int, int]:
        """Payload bytes (up, down) of `peer` in a round once every end holds a model (the codec's steady state):
        uploads in the peers' format; a block relayed from its owner comes down as uploaded, anything the server
        re-encodes (averaged tensors, every block on a merge round) in its own (`Codec.down_bytes`)."""
        codec = self.codec_impl

        def size(name: str) -> int:
            return math.prod(self._shape(name))

        up = sum(codec.round_bytes(size(n)) for n in self.trainable(peer))
        down = sum(
            (codec.round_bytes if self.owner(n) is not None and not merged else codec.down_bytes)(size(n))
            for n in self.downloads(peer, merged=merged)
        )
        return up, down

    def _shape(self, name: str) -> tuple[int, ...]:
        return tuple((self.manifest or {})[name])

    def _names(self, names: Iterable[str] | None) -> Iterable[str]:
        if names is not None:
            return names
        if self.manifest is None:
            raise ValueError("the run spec has no manifest yet (no node has joined a server started without YAML)")
        return self.manifest

    # -- derived ------------------------------------------------------------------------------
    @cached_property
    def codec_impl(self) -> Codec:
        """The codec with these settings (`spes.sync.codecs`)."""
        return build_codec(self.codec, dict(self.codec_settings))

    @cached_property
    def layout(self) -> Layout:
        """How the model is cut into fragments and when each has its round."""
        if self.manifest is None or self.sync_steps is None:
            raise ValueError("the run spec is open (manifest or sync_steps): a node must join first")
        return Layout.of(self.manifest, self.overlap_fragments, self.sync_steps, self.mode)

    @property
    def round_interval(self) -> int:
        """Steps between two rounds: `sync_steps`, or `sync_steps / overlap_fragments` with fragments."""
        assert self.sync_steps is not None
        return self.sync_steps // self.overlap_fragments

    def next_round(self, after: int | None) -> int | None:
        """The round the run expects after round `after` (None: before the first one): the next multiple of
        `round_interval`, or with fragments the run's last step when that comes first; None once the run is over.

            next = (floor(after / interval) + 1) * interval,  min(next, last_step) with fragments
        """
        done, interval, last = after or 0, self.round_interval, self.last_step
        step = (done // interval + 1) * interval
        if last is not None and step > last:
            return last if self.overlap_fragments > 1 and done < last else None
        return step

    @property
    def complete(self) -> bool:
        """No field is open (see `completed_by`); a run without a known last step simply has no end."""
        return all(getattr(self, name) is not None for name in (*FIELD_KEYS, "manifest") if name != "last_step")

    # -- a join -------------------------------------------------------------------------------
    def first_difference(self, theirs: RunSpec) -> tuple[str, Any, Any] | None:
        """The first compared field (in `FIELD_KEYS` order: root causes first) where `theirs` differs from this
        spec, with this spec's value and theirs; None when they agree. An open field here agrees with anything."""
        for name in FIELD_KEYS:
            ours, other = getattr(self, name), getattr(theirs, name)
            if ours is not None and ours != other:
                return name, ours, other
        return None

    def differences(self, theirs: RunSpec, who: str) -> str:
        """'' when `theirs` (the spec of `who`) agrees with this one; else the first field that differs, with both
        values, where each came from, and the key that sets it."""
        found = self.first_difference(theirs)
        if found is None:
            return ""
        name, ours, other = found
        where = f" (from {self.origin})" if self.origin else ""
        return (
            f"{who} has {name} = {_shown(other)} but the run has {name} = {_shown(ours)}{where}: set "
            f"{FIELD_KEYS[name]} alike in every node's YAML and the server's"
        )

    def completed_by(self, theirs: RunSpec) -> RunSpec:
        """This spec with its open fields (None: the manifest, sync_steps, block owners...) taken from `theirs`."""
        open_fields = [name for name in (*FIELD_KEYS, "manifest") if getattr(self, name) is None]
        return replace(self, **{name: getattr(theirs, name) for name in open_fields})

    def to_proto(self) -> pb.RunSpec:
        return pb.RunSpec(
            mode=self.mode,
            num_peers=self.num_peers,
            experts_per_block=self.experts_per_block or 0,
            block_owners=list(self.block_owners or ()),
            sync_steps=self.sync_steps or 0,
            last_step=self.last_step or 0,
            overlap_fragments=self.overlap_fragments,
            codec=self.codec,
            codec_settings=dict(self.codec_settings),
        )

    @classmethod
    def from_proto(cls, message: pb.RunSpec, manifest: Manifest, origin: str) -> RunSpec:
        """A peer's spec as it announced it (ValueError naming what is not a valid spec)."""
        return cls(
            mode=message.mode,  # type: ignore[arg-type]  # checked in __post_init__
            num_peers=message.num_peers,
            experts_per_block=message.experts_per_block or None,
            block_owners=tuple(message.block_owners),
            sync_steps=message.sync_steps or None,
            last_step=message.last_step or None,
            overlap_fragments=message.overlap_fragments,
            codec=message.codec,
            codec_settings=tuple(sorted((str(k), int(v)) for k, v in message.codec_settings.items())),
            manifest=manifest,
            origin=origin,
        )


def _shown(value: Any) -> str:
    return repr(list(value) if isinstance(value, tuple) else value)


def uniform_owners(num_experts: int, experts_per_block: int) -> tuple[int, ...]:
    """The paper's ownership: block b (experts [b k, (b + 1) k)) belongs to peer b."""
    return tuple(range(math.ceil(num_experts / experts_per_block)))


def run_spec(cfg: TrainConfig, manifest: Mapping[str, tuple[int, ...]] | None, *, origin: str = "") -> RunSpec:
    """The run spec of a SPES or DiLoCo run's config and its model's `manifest` (None: left open).

    ValueError naming the key for a centralized run or a codec setting that is not valid."""
    if not cfg.sync_enabled:
        raise ValueError(
            f"{origin or 'the config'} is a centralized run (using_spes: false), which has no parameter server: "
            "set using_spes: true (SPES) or using_dilico: true (DiLoCo)"
        )
    s = cfg.spes_config
    mode: Mode = "diloco" if cfg.mode == "diloco" else "spes"
    owners = uniform_owners(cfg.model.moe_num_experts, cfg.experts_per_block) if mode == "spes" else ()
    return RunSpec(
        mode=mode,
        num_peers=s.num_peers,
        experts_per_block=cfg.experts_per_block,
        block_owners=owners,
        sync_steps=s.sync_steps,
        last_step=cfg.duration_steps,
        overlap_fragments=s.overlap_fragments,
        codec=s.codec,
        codec_settings=tuple(sorted(s.codec_settings.items())),
        manifest=None if manifest is None else {n: tuple(int(d) for d in shape) for n, shape in manifest.items()},
        server=cfg.server,
        origin=origin,
    )
