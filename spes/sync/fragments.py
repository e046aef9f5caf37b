"""Rounds over fragments of the model on staggered steps (Streaming DiLoCo, Douillard et al. 2025, arXiv 2501.18512).

With `spes_config.overlap_fragments` F > 1 the model is cut into F fragments of whole decoder blocks and each is
synchronized once every `sync_steps` steps, fragment k at the steps `s` with `s / (sync_steps / F) = k (mod F)`:
a round every `sync_steps / F` steps, each moving about 1/F of the bytes. On a link where a whole round takes
`sync_steps` steps, a fragment's round takes `sync_steps / F` and lands that much later instead of `sync_steps`,
while the link stays busy all the time. Every tensor is still synchronized once per `sync_steps` steps.

Pure functions: the peers and the server cut the same manifest the same way, so only the fragment's number
travels with an upload (`WHOLE`, 0, is a round over every tensor: runs without fragments, and a fragmented run's
last step, so every node ends on the same global model).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from spes.moe import parse_expert_block
from spes.sync.protocol import Mode, Shape

WHOLE = 0
"""The fragment number of a round over the whole model; fragments are numbered 1..F."""

_BLOCK = re.compile(r"(blocks\.\d+)\.")


def fragment_unit(name: str) -> str:
    """The part of the model a tensor moves with: its decoder block (`blocks.{l}`: attention, router and every
    expert of the layer, which the merge warm-up needs together), or the tensor itself (embedding, final norm,
    LM head)."""
    match = _BLOCK.match(name)
    return match.group(1) if match else name


def wire_weight(name: str, mode: Mode) -> int:
    """What a value of tensor `name` costs a round on the wire, relative to the others: an expert block in SPES
    mode goes one way over each peer's link (its owner uploads it, the others download it), every other tensor
    both ways (each peer uploads and downloads it)."""
    return 1 if mode == "spes" and parse_expert_block(name) is not None else 2


def split_fragments(manifest: Mapping[str, Shape], count: int, mode: Mode = "spes") -> tuple[tuple[str, ...], ...]:
    """The model's tensors cut into `count` fragments of whole units (`fragment_unit`), balanced by the bytes a
    round moves (values times `wire_weight`).

    Units are taken heaviest first (ties: the first in manifest order) and each goes to the fragment holding
    the fewest bytes so far (ties: the lowest number), so fragments differ by at most one unit's bytes.
    Fragment k (1-based) is element k - 1; names keep the manifest's order. ValueError when the model has
    fewer units than `count`.
    """
    if count < 1:
        raise ValueError(f"the number of fragments must be >= 1, got {count}")
    units: dict[str, list[str]] = {}
    for name in manifest:
        units.setdefault(fragment_unit(name), []).append(name)
    if len(units) < count:
        raise ValueError(
            f"the model has {len(units)} parts that can be synchronized apart (decoder blocks and the tensors "
            f"outside them), fewer than the {count} fragments asked for: lower spes_config.overlap_fragments"
        )
    sizes = {unit: sum(math.prod(manifest[n]) * wire_weight(n, mode) for n in names) for unit, names in units.items()}
    order = sorted(units, key=lambda unit: -sizes[unit])  # NOTE: sorted() is stable: ties keep manifest order
    load, home = [0] * count, {}
    for unit in order:
        k = min(range(count), key=lambda i: load[i])
        home[unit], load[k] = k, load[k] + sizes[unit]
    return tuple(tuple(n for n in manifest if home[fragment_unit(n)] == k) for k in range(count))


def turn_of(step: int, sync_steps: int, count: int) -> int:
    """The fragment whose turn `step` is on the schedule (a multiple of `sync_steps / count`): 1..count, or
    `WHOLE` without fragments and for a step off the schedule."""
    interval = sync_steps // count
    if count == 1 or step % interval:
        return WHOLE
    return (step // interval - 1) % count + 1


def merge_step(step: int, sync_steps: int, fragment: int) -> int:
    """The step whose merge warm-up (`merge.round_alpha`) a round applies: its own for a whole round; for a
    fragment's, the next multiple of `sync_steps`, the whole round it stands in for, so every expert is merged
    as often and as strongly as in a run without fragments."""
    return step if fragment == WHOLE else -(-step // sync_steps) * sync_steps


@dataclass(frozen=True)
class Layout:
    """How a run cuts its model and when each part has its round: `overlap_fragments` fragments (1: none), a round
    every `round_interval = sync_steps / overlap_fragments` steps, and a whole round at the run's last step."""

    overlap_fragments: int
    sync_steps: int
    parts: tuple[tuple[str, ...], ...]
    """`split_fragments` of the run's manifest: fragment k is `parts[k - 1]`."""

    @classmethod
    def of(cls, manifest: Mapping[str, Shape], overlap_fragments: int, sync_steps: int, mode: Mode = "spes") -> Layout:
        """The layout of `overlap_fragments` fragments of `manifest` (ValueError when the model cannot be cut so)."""
        count = overlap_fragments
        if count > 1 and (sync_steps < count or sync_steps % count):
            raise ValueError(f"sync_steps={sync_steps} is not a multiple of the {count} fragments")
        return cls(count, sync_steps, split_fragments(manifest, count, mode) if count > 1 else (tuple(manifest),))

    @property
    def round_interval(self) -> int:
        return self.sync_steps // self.overlap_fragments

    def syncs_at(self, step: int, last_step: int) -> bool:
        """Whether a node uploads a round at `step`: every `round_interval` steps, and with fragments at the run's
        last step, which synchronizes the whole model."""
        return step % self.round_interval == 0 or (self.overlap_fragments > 1 and step == last_step)

    def fragment_at(self, step: int, last_step: int) -> int:
        """The fragment a node synchronizes at sync step `step`: its turn (`turn_of`), or `WHOLE` at the last step."""
        return WHOLE if step == last_step else turn_of(step, self.sync_steps, self.overlap_fragments)

    def names(self, fragment: int, names: Iterable[str]) -> list[str]:
        """Those of `names` that a round over `fragment` covers (all of them for `WHOLE`), in their order."""
        if fragment == WHOLE:
            return list(names)
        part = set(self.parts[fragment - 1])
        return [n for n in names if n in part]

    def merged_names(self, step: int, fragment: int, names: Iterable[str]) -> tuple[int, set[str] | None]:
        """What a round over `fragment` at `step` merges: the step whose warm-up it applies (`merge_step`) and the
        names whose layers it may merge (None: all it covers). A whole round of a fragmented run merges only the
        fragment whose turn its step is, which the rounds before did not merge for that whole round."""
        if fragment != WHOLE or self.overlap_fragments == 1:
            return merge_step(step, self.sync_steps, fragment), None
        turn = turn_of(step, self.sync_steps, self.overlap_fragments)
        return merge_step(step, self.sync_steps, turn), set(self.names(turn, names)) if turn != WHOLE else set()

    def check(self, fragment: int) -> None:
        """ValueError unless `fragment` is WHOLE or one of this layout's."""
        count = self.overlap_fragments
        if not 0 <= fragment <= (count if count > 1 else 0):
            allowed = f"0 or 1..{count}" if count > 1 else "0: it has no fragments"
            raise ValueError(f"fragment {fragment} is not one of this run's ({allowed})")
