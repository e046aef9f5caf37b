import torch

from spes.sync.buffers import BufferPool


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
    assert pool.nbytes == 0


def test_kept_views_and_surplus_tensors_are_not_pooled() -> None:
    pool = BufferPool()
    pool.set_limits({((8,), torch.float32): 1})
    in_use, merged = torch.zeros(8), torch.zeros(16)
    pool.give([in_use, *torch.split(merged, 8)], keep=[in_use])  # views of a larger tensor pin all of it
    assert pool.nbytes == 0
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
