"""spes.sync.codecs.lazy: items made when first read, once, whichever threads read them."""

from __future__ import annotations

import threading
import time

import pytest

from spes.sync.codecs.lazy import Lazy, Overlay


def test_each_item_is_made_once_when_first_read_by_many_threads_at_once() -> None:
    made: list[str] = []

    def make(name: str) -> str:
        made.append(name)
        time.sleep(0.05)  # long enough that the other readers arrive while it is being made
        return name.upper()

    lazy = Lazy(["a", "b"], make)
    assert "a" in lazy and "c" not in lazy
    assert made == [] and list(lazy) == ["a", "b"] and lazy.made() == {}
    got: list[str] = []
    readers = [threading.Thread(target=lambda: got.append(lazy["a"])) for _ in range(8)]
    for reader in readers:
        reader.start()
    for reader in readers:
        reader.join(timeout=10)
    assert got == ["A"] * 8 and made == ["a"] and lazy.made() == {"a": "A"}
    lazy.complete()
    assert made == ["a", "b"] and lazy.made() == {"a": "A", "b": "B"}
    with pytest.raises(KeyError):
        lazy["c"]


def test_an_overlay_reads_later_only_for_what_it_does_not_hold_and_only_its_names() -> None:
    asked: list[str] = []
    overlay = Overlay(["b", "a", "c"], {"a": 1, "x": 9}, lambda name: asked.append(name) or 2)
    assert "c" in overlay and "x" not in overlay
    assert list(overlay) == ["b", "a", "c"] and len(overlay) == 3 and asked == []
    assert overlay["a"] == 1 and asked == []
    assert overlay["c"] == 2 and asked == ["c"]
    with pytest.raises(KeyError) as err:
        overlay["x"]  # held, but not one of its names
    assert err.value.args == ("x",)
