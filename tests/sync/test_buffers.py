"""The server's receive buffers: the pool by shape and dtype, the rounds it takes them back from, and what a round
takes."""

from __future__ import annotations

from collections import Counter

import torch

from spes.sync.buffers import BufferPool, RoundMemory, round_limits
from sync_helpers import completed, tiny_spec


def test_take_returns_given_buffers_by_shape_and_dtype() -> None:
    pool = BufferPool()
    pool.set_limits({((3, 4), torch.float32): 2, ((3, 4), torch.bfloat16): 1})
    a, b = torch.zeros(3, 4), torch.zeros(3, 4, dtype=torch.bfloat16)
    pool.give([a, b])
    assert pool.nbytes == a.nbytes + b.nbytes
    assert pool.take((3, 4), torch.float32) is a
    assert pool.take((3, 4), torch.bfloat16) is b
    fresh = pool.take((3, 4), torch.float32)
    assert fresh.shape == (3, 4) and fresh.data_ptr() not in (a.data_ptr(), b.data_ptr())
    assert pool.take((3, 4), torch.bfloat16).dtype == torch.bfloat16  # a new one, of the dtype asked for
    assert pool.nbytes == 0


def test_kept_views_and_surplus_tensors_are_not_pooled() -> None:
    pool = BufferPool()
    pool.set_limits({((8,), torch.float32): 1})
    in_use, merged = torch.zeros(8), torch.zeros(16)
    pool.give([in_use, *torch.split(merged, 8)], keep=[in_use])  # views of a larger tensor pin all of it
    assert pool.nbytes == 0
    unlimited = BufferPool()
    unlimited.give([torch.zeros(8)])
    assert unlimited.nbytes == 0  # no limits set: nothing is kept
    free = torch.zeros(8)
    pool.give([in_use, free], keep=[in_use])  # a kept tensor is passed over, not the end of the list
    assert pool.take((8,), torch.float32) is free
    pool.give([torch.zeros(8), torch.zeros(8)])
    assert pool.nbytes == torch.zeros(8).nbytes  # at most the limit per shape
    pool.give([torch.zeros(2)])
    assert pool.nbytes == torch.zeros(8).nbytes  # no limit: not kept
    pool.set_limits({((8,), torch.float32): 4})
    t = torch.zeros(8)
    pool.give([t, t])
    assert pool.nbytes == 2 * t.nbytes  # the same tensor given twice is kept once
    pool.set_limits({})
    assert pool.nbytes == 0


def test_a_superseded_round_is_pooled_once_its_last_reader_is_done_keeping_what_the_current_one_holds() -> None:
    memory = RoundMemory()
    memory.pool.set_limits({((4,), torch.float32): 4})
    first, carried, second = torch.zeros(4), torch.ones(4), torch.full((4,), 2.0)
    memory.publish(completed(1, model={"a": first, "b": carried}))
    memory.pin(1)
    memory.pin(1)  # two downloads of round 1
    memory.publish(completed(2, model={"a": second, "b": carried}))  # b carried over (a fragment's round)
    memory.unpin(1)
    assert memory.pool.nbytes == 0  # one download still reads round 1
    memory.unpin(1)
    assert memory.pool.nbytes == first.nbytes  # round 1's own tensor only: round 2 holds b
    assert memory.pool.take((4,), torch.float32) is first
    memory.pin(2)
    memory.publish(completed(3, model={"a": torch.zeros(4), "b": torch.zeros(4)}))
    assert memory.pool.nbytes == 0  # round 2 is read
    memory.unpin(2)
    assert memory.pool.nbytes == second.nbytes + carried.nbytes


def test_each_kind_of_download_of_a_round_is_encoded_once() -> None:
    memory = RoundMemory()
    memory.pin(0)
    memory.unpin(0)  # a reader done before any round was published: nothing to give back
    items = {"a": torch.ones(3)}
    memory.checksums.record(items, {"a": 12345}, "fp32")  # a verified upload's buffer: its checksum is not redone
    assert memory.encoded("first", items, "fp32").get("a")[1] == 12345
    assert torch.equal(memory.encoded("narrow", items, "bf16").get("a")[0], items["a"].bfloat16())  # a wire copy
    memory.publish(completed(1, model=items))
    encoded = memory.encoded("raw", items, "bf16")
    assert memory.encoded("raw", {"a": torch.zeros(3)}, "fp32") is encoded  # the first to ask made it
    assert memory.encoded("raw+whole", items, "fp32") is not encoded
    data, _ = encoded.get("a")
    assert data.dtype == torch.bfloat16 and torch.equal(data.float(), items["a"])
    memory.publish(completed(2, model=items))
    assert memory.encoded("raw", items, "fp32") is not encoded  # a new round: made again


def test_a_rounds_wire_copies_come_from_the_pool_and_go_back_with_the_round() -> None:
    """A bf16 wire's copies of fp32 means are converted into kept buffers (no fresh memory to fault in), given back
    once the round is superseded and no download reads it."""
    memory = RoundMemory()
    memory.pool.set_limits({((4,), torch.bfloat16): 1})
    kept = torch.zeros(4, dtype=torch.bfloat16)
    memory.pool.give([kept])
    mean = torch.arange(4.0) / 3
    memory.publish(completed(1, model={"a": mean}))
    memory.pin(1)
    data, _ = memory.encoded("raw", {"a": mean}, "bf16")["a"]
    assert data.data_ptr() == kept.data_ptr() and torch.equal(data, mean.bfloat16())
    memory.publish(completed(2, model={"a": torch.ones(4)}))
    assert memory.pool.nbytes == 0  # a download still reads round 1
    memory.unpin(1)
    assert memory.pool.take((4,), torch.bfloat16) is kept


def test_one_round_takes_every_joined_peers_uploads_and_the_fp32_sums_and_copies_of_narrower_shared_tensors() -> None:
    spec = tiny_spec(num_peers=3)
    manifest = spec.manifest or {}
    shared = [n for n in manifest if spec.owner(n) is None]
    assert shared and len(shared) < len(manifest)

    def shapes(names: list[str], dtype: torch.dtype) -> Counter:
        return Counter((manifest[n], dtype) for n in names)

    joined = [0, 2]
    uploads = shapes([n for p in joined for n in spec.trainable(p)], torch.bfloat16)
    wide_and_copied = shapes(shared, torch.float32) + shapes(shared, torch.bfloat16)
    assert round_limits(spec, joined, torch.bfloat16) == uploads + wide_and_copied
    fp32 = shapes([n for p in joined for n in spec.trainable(p)], torch.float32)
    assert round_limits(spec, joined, torch.float32) == fp32
