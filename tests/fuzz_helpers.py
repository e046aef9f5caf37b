"""Shared pieces of the fuzz tests (`tests/**/test_*_fuzz.py`): hostile byte strings and values, and the one check
they all make, that a decoder either decodes or refuses with its documented exception.

Why hypothesis with `derandomize`: a peer on an open network or a damaged file may hand a decoder any bytes, and the
project's rule is that they decode correctly or are refused with one clear error (never an IndexError, a
struct.error, a torch RuntimeError, a giant allocation or a hang). Derandomized runs make CI reproducible; the
example counts keep the whole fuzz suite within ~40 s on two busy cores.
"""

from __future__ import annotations

import json
import math
import resource
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

FUZZ = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
"""The settings every fuzz test runs under (more or fewer examples with `FUZZ.max_examples`-relative overrides)."""

FEW = settings(FUZZ, max_examples=25)
"""For a test whose every example reads files or builds tensors."""

HOSTILE_INTS = [-(2**63), -(2**31), -1, 0, 1, 2, 3, 255, 2**16, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1]
"""Integers a header's length, count, dim or id field may carry: negative, zero, boundary and past any memory."""
HOSTILE_FLOATS = [math.nan, math.inf, -math.inf, 1e308, -0.0, 3.4e38]


def hostile_ints() -> st.SearchStrategy[int]:
    return st.one_of(st.sampled_from(HOSTILE_INTS), st.integers(-(2**63), 2**63 - 1))


def hostile_json() -> st.SearchStrategy[Any]:
    """JSON values of every kind, including the ones a field never holds (None where a number goes, a number where a
    string goes, NaN, huge integers, nesting)."""
    scalars = st.one_of(
        st.none(),
        st.booleans(),
        hostile_ints(),
        st.integers(),
        st.sampled_from(HOSTILE_FLOATS),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=8),
    )
    return st.recursive(
        scalars,
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
        max_leaves=6,
    )


@st.composite
def mutated(draw: st.DrawFn, data: bytes) -> bytes:
    """`data` damaged as a file or a link damages bytes: cut short, bits flipped, bytes overwritten, inserted or
    deleted, or replaced by random bytes altogether."""
    kind = draw(st.sampled_from(["truncate", "flip", "overwrite", "insert", "delete", "random", "extend"]))
    if kind == "random" or not data:
        return draw(st.binary(max_size=2 * len(data) + 16))
    at = draw(st.integers(0, len(data) - 1))
    if kind == "truncate":
        return data[:at]
    if kind == "flip":
        flipped = bytearray(data)
        for _ in range(draw(st.integers(1, 4))):
            spot = draw(st.integers(0, len(data) - 1))
            flipped[spot] ^= 1 << draw(st.integers(0, 7))
        return bytes(flipped)
    if kind == "overwrite":
        patch = draw(st.binary(min_size=1, max_size=16))
        return data[:at] + patch + data[at + len(patch) :]
    if kind == "insert":
        return data[:at] + draw(st.binary(min_size=1, max_size=16)) + data[at:]
    if kind == "delete":
        return data[:at] + data[at + draw(st.integers(1, 16)) :]
    return data + draw(st.binary(min_size=1, max_size=64))


@st.composite
def mutated_json(draw: st.DrawFn, record: Any) -> Any:
    """`record` (a JSON object as a file holds it) with one value somewhere in it replaced by a hostile one, or a key
    dropped."""
    copy = json.loads(json.dumps(record))
    path: list[Any] = []
    node = copy
    while isinstance(node, (dict, list)) and node and draw(st.booleans()):
        key = draw(st.sampled_from(sorted(node) if isinstance(node, dict) else range(len(node))))
        path.append(key)
        node = node[key]
    if not path:
        return draw(hostile_json())
    parent = copy
    for key in path[:-1]:
        parent = parent[key]
    if isinstance(parent, dict) and draw(st.booleans()):
        del parent[path[-1]]
    else:
        parent[path[-1]] = draw(hostile_json())
    return copy


def refused_only(call: Callable[[], object], *allowed: type[BaseException]) -> object | None:
    """Run `call`: what it returns, or None when it raises one of `allowed` (the decoder's contract); any other
    exception fails the test with the input that caused it shown by hypothesis."""
    try:
        return call()
    except allowed:
        return None


@contextmanager
def memory_cap(gib: float = 2.0) -> Iterator[None]:
    """Bound this process's address space to `gib` more than it maps now while decoding, so a header that asks for a
    giant buffer fails the test (a MemoryError or torch's RuntimeError, not the contract's exception) instead of
    taking the machine's memory (Linux overcommits: an unbounded `torch.empty` of 100 GB would succeed)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/status") as status:
        mapped = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
    cap = mapped + int(gib * (1 << 30))
    resource.setrlimit(resource.RLIMIT_AS, (cap if soft == resource.RLIM_INFINITY else min(soft, cap), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
