"""ZeRO's pool of collective buffers (``zero_layout.BufferPool``)."""

import torch

from loomtrain.distributed.zero_layout import BufferPool

CPU = torch.device("cpu")


def test_a_returned_buffer_is_reused():
    """Catches: a pool that allocates every time (the fresh-page cost it exists to avoid)."""
    pool = BufferPool()
    first = pool.take(1000, torch.float32, CPU)
    ptr = first.data_ptr()
    pool.give(first)
    again = pool.take(800, torch.float32, CPU)
    assert again.data_ptr() == ptr and again.numel() == 800
    assert pool.nbytes == 4000


def test_a_buffer_in_use_is_never_lent_twice():
    """Catches: two collectives in flight writing into one buffer."""
    pool = BufferPool()
    a = pool.take(100, torch.float32, CPU)
    b = pool.take(100, torch.float32, CPU)
    assert a.data_ptr() != b.data_ptr()
    c = pool.take(100, torch.bfloat16, CPU)  # another dtype: another buffer even when one is free
    pool.give(a)
    assert c.data_ptr() not in (a.data_ptr(), b.data_ptr())


def test_the_pool_holds_no_more_than_was_in_use_at_once():
    """Catches: a pool that keeps every size it ever lent (units of different sizes taking
    turns would then pile up buffers without bound)."""
    pool = BufferPool()
    for numel in (100, 5000, 300, 8000, 100, 8000, 2000) * 3:
        pool.give(pool.take(numel, torch.float32, CPU))
    assert pool.nbytes == 8000 * 4
