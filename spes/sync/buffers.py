"""Receive buffers the parameter server keeps from round to round.

Every round the server receives about a model's worth of uploads. Fresh memory for them costs a page fault
per 4 KiB on first touch (2.5 GB/s here, against 16 GB/s for writing memory already touched), which was the
largest single cost of a round on loopback. The shapes never change during a run, so buffers are reused.

A buffer is free again only when nothing reads it: the global model is built in the uploads' own buffers
(an owner's expert blocks as they are, shared means summed into the first peer's upload), so the server
gives a round's tensors back once the round is superseded and its last download has finished, keeping any
tensor the current global model or outer momentum still holds (`give(..., keep=...)`). The same holds for the
copies its downloads send of what travels in a narrower dtype than it is held in (a bf16 wire's fp32 means).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Collection, Iterable, Mapping
from functools import partial

import torch

from spes.sync.protocol import Shape
from spes.sync.rounds import Completed
from spes.sync.spec import RunSpec
from spes.sync.wire import EncodedModel, Item, VerifiedChecksums

Key = tuple[Shape, torch.dtype]


class BufferPool:
    """Free tensors by (shape, dtype); thread-safe.

    It keeps no more of a key than one round of uploads takes (`set_limits`), so tensors that enter from
    elsewhere (an outer optimizer's results, a restored state) cannot make it grow round after round.
    """

    def __init__(self) -> None:
        self._limits: dict[Key, int] = {}
        self._free: dict[Key, list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def set_limits(self, limits: Mapping[Key, int]) -> None:
        """How many free tensors of each (shape, dtype) to keep at most; other keys are not kept."""
        with self._lock:
            self._limits = {(tuple(shape), dtype): n for (shape, dtype), n in limits.items()}
            for key, free in self._free.items():
                del free[self._limits.get(key, 0) :]

    def take(self, shape: Shape, dtype: torch.dtype) -> torch.Tensor:
        """A kept buffer of this shape and dtype (old contents), or a new one (not zero-filled)."""
        with self._lock:
            free = self._free.get((tuple(shape), dtype))
            if free:
                return free.pop()
        return torch.empty(shape, dtype=dtype)

    def give(self, tensors: Iterable[torch.Tensor], *, keep: Iterable[torch.Tensor] = ()) -> None:
        """Take back tensors nobody reads any more, except those sharing memory with `keep`.

        Only tensors that own their whole storage are kept (a view of a larger tensor, e.g. one expert block
        split from a merged layer, would pin the rest of it).
        """
        kept = {t.data_ptr() for t in keep}
        with self._lock:
            for tensor in tensors:
                if tensor.data_ptr() in kept or not _owns_storage(tensor):
                    continue
                kept.add(tensor.data_ptr())  # the same tensor given twice is kept once
                key = (tuple(tensor.shape), tensor.dtype)
                free = self._free.setdefault(key, [])
                if len(free) < self._limits.get(key, 0):
                    free.append(tensor)

    @property
    def nbytes(self) -> int:
        """Bytes held in free buffers."""
        with self._lock:
            return sum(t.nbytes for free in self._free.values() for t in free)


def _owns_storage(tensor: torch.Tensor) -> bool:
    return (
        tensor.is_contiguous() and tensor.storage_offset() == 0 and tensor.untyped_storage().nbytes() == tensor.nbytes
    )


def round_limits(spec: RunSpec, joined: Collection[int], dtype: torch.dtype) -> Counter[Key]:
    """What one round takes from the pool: every joined peer's uploads in the codec's raw `dtype`, and for shared
    tensors uploaded narrower than fp32 the fp32 sums and the copies of them in `dtype` that the downloads send."""
    manifest = spec.manifest or {}
    limits = Counter((manifest[n], dtype) for peer in joined for n in spec.trainable(peer))
    if dtype != torch.float32:
        averaged = {n for peer in joined for n in spec.trainable(peer) if spec.owner(n) is None}
        limits.update((manifest[n], wide) for n in averaged for wide in (torch.float32, dtype))
    return limits


class RoundMemory:
    """The server's tensors from round to round: the receive buffers (`BufferPool`), the downloads and uploads
    still reading a completed round (`pin`/`unpin`), the superseded rounds they keep alive, and each round's
    downloads encoded once (`encoded`). Not thread-safe: the coordinator calls it under its lock (the pool has
    its own, for the threads that take and give buffers)."""

    def __init__(self) -> None:
        self.pool = BufferPool()
        self.checksums = VerifiedChecksums()
        """Of every staged upload: downloads send the experts taken from it verbatim without hashing them again."""
        self._readers: dict[int, int] = {}
        """Readers per completed round: its tensors are reused only once none reads them."""
        self._retired: dict[int, list[list[torch.Tensor]]] = {}
        """Superseded rounds' tensors that readers still read, by round: the round's own, and its wire copies."""
        self._encoded: dict[str, EncodedModel] = {}
        """The latest round's downloads by selection key (`spes.sync.codecs.base.Selection.key`)."""
        self._copies: list[torch.Tensor] = []
        """The tensors the latest round's downloads were converted into (from the pool, back with the round)."""
        self._current: Completed | None = None

    def pin(self, step: int) -> None:
        """A reader (a download, or an upload whose deltas apply to it) starts reading round `step`."""
        self._readers[step] = self._readers.get(step, 0) + 1

    def unpin(self, step: int) -> None:
        """A reader of round `step` is done with its tensors."""
        self._readers[step] -= 1
        if not self._readers[step]:
            del self._readers[step]
            self._release()

    def publish(self, done: Completed) -> None:
        """`done` supersedes the current round: its tensors go back to the pool once nobody reads them."""
        if self._current is not None:
            # NOTE: the list of copies itself: a download still reading this round may add to it
            self._retired[self._current.round] = [self._current.tensors(), self._copies]
        self._current, self._encoded, self._copies = done, {}, []
        self._release()

    def encoded(self, key: str, items: Mapping[str, Item], dtype: str) -> EncodedModel:
        """The shared encoded form of one kind of download of the current round (made by the first to ask); what
        is converted (a bf16 wire's fp32 means) is converted into buffers of the pool, given back with the round."""
        if key not in self._encoded:
            empty = partial(_take_noted, self.pool, self._copies)
            self._encoded[key] = EncodedModel(items, dtype, self.checksums, empty)
        return self._encoded[key]

    def _release(self) -> None:
        """Give the pool the superseded rounds no reader reads any more."""
        current = self._current.tensors() if self._current is not None else []
        read = [t for step, parts in self._retired.items() if step in self._readers for part in parts for t in part]
        # NOTE: one `give`: a tensor a fragment's rounds carried over sits in several retired rounds, given once
        unread = [s for s in self._retired if s not in self._readers]
        done = [t for step in unread for part in self._retired.pop(step) for t in part]
        self.pool.give(done, keep=[*current, *read])


def _take_noted(pool: BufferPool, taken: list[torch.Tensor], shape: Shape, dtype: torch.dtype) -> torch.Tensor:
    """A buffer of the pool, noted in `taken` (list.append is atomic: downloads convert in threads of their own)."""
    tensor = pool.take(shape, dtype)
    taken.append(tensor)
    return tensor
