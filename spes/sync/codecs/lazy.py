"""Mappings whose items are made when first read, each once, in whichever thread reads it first.

A codec's work per tensor (encoding a delta, say) is the expensive part of a round; made when a plane first reads
the tensor, it overlaps the transfer of the tensors before it instead of delaying the first byte. Several threads
may read one mapping (the server's downloads of a round, its closing thread): a lock per name makes each item once
while other names are made in parallel.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TypeVar

T = TypeVar("T")


class Lazy(Mapping[str, T]):
    """`make(name)` for each of `names`, made when first read and kept; thread-safe."""

    def __init__(self, names: Iterable[str], make: Callable[[str], T]) -> None:
        self._make = make
        self._locks = {name: threading.Lock() for name in names}
        self._made: dict[str, T] = {}

    def __getitem__(self, name: str) -> T:
        with self._locks[name]:  # KeyError for a name it does not have
            if name not in self._made:
                self._made[name] = self._make(name)
            return self._made[name]

    def __contains__(self, name: object) -> bool:  # NOTE: Mapping's would make the item
        return name in self._locks

    def __iter__(self) -> Iterator[str]:
        return iter(self._locks)

    def __len__(self) -> int:
        return len(self._locks)

    def made(self) -> dict[str, T]:
        """The items made so far (a snapshot; nothing is made)."""
        return dict(self._made)

    def complete(self) -> None:
        """Make every item not made yet, in order."""
        for name in self._locks:
            self[name]


class Overlay(Mapping[str, T]):
    """The items of `order`: those in `made`, the others `later(name)` (read only when asked for: a `Lazy`'s)."""

    def __init__(self, order: list[str], made: Mapping[str, T], later: Callable[[str], T]) -> None:
        self._order, self._names, self._made, self._later = order, frozenset(order), made, later

    def __getitem__(self, name: str) -> T:
        if name not in self._names:
            raise KeyError(name)
        return self._made[name] if name in self._made else self._later(name)

    def __contains__(self, name: object) -> bool:  # NOTE: Mapping's would read the item
        return name in self._names

    def __iter__(self) -> Iterator[str]:
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)
