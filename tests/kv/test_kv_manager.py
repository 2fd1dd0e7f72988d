"""KV manager, block pool, layouts and prefix cache: pure host-side bookkeeping."""
from __future__ import annotations

import pytest

from loopline.kv.block_pool import BlockPool
from loopline.kv.layout import LastExitedLayout, SharedLayout, make_layout
from loopline.kv.manager import KVCacheManager


def test_blocks_are_accounted_per_plane():
    kv = KVCacheManager(100, 4, LastExitedLayout(4))
    assert kv.blocks_needed(9) == 4 * 3
    alloc = kv.allocate("a", 9)
    assert [len(t) for t in alloc.block_tables] == [3, 3, 3, 3]
    assert len({b for t in alloc.block_tables for b in t}) == 12  # no block shared between planes
    assert kv.num_used_blocks == 12
    kv.free("a")
    assert kv.num_used_blocks == 0
    shared = KVCacheManager(100, 4, SharedLayout(4))
    assert shared.blocks_needed(9) == 3


def test_allocation_never_overcommits():
    kv = KVCacheManager(20, 4, LastExitedLayout(4))
    assert kv.allocate("a", 16) is not None  # 16 blocks
    assert kv.allocate("b", 8) is None  # needs 8, 4 free
    assert kv.allocate("c", 4) is not None
    assert kv.num_free_blocks == 0 and not kv.fits_ever(21)
    assert kv.allocate("d", 1, keep_free=1) is None


def test_incremental_growth():
    kv = KVCacheManager(12, 4, LastExitedLayout(2))
    kv.allocate("a", 4)
    assert kv.grow("a", 4) == [[], []]
    added = kv.grow("a", 5)
    assert [len(x) for x in added] == [1, 1] and kv.get("a").num_logical_blocks == 2
    assert kv.growth_blocks("a", 16) == 4
    assert kv.grow("a", 100) is None


def test_layout_planes_and_exit_copies():
    le, sh = make_layout("last_exited", 4), make_layout("shared", 4)
    assert [le.plane(r) for r in (1, 2, 3, 4)] == [0, 1, 2, 3] and le.num_planes == 4
    assert list(le.exit_copy_planes(2)) == [2, 3] and list(le.exit_copy_planes(4)) == []
    assert [sh.plane(r) for r in (1, 4)] == [0, 0] and list(sh.exit_copy_planes(1)) == []
    with pytest.raises(ValueError):
        make_layout("bogus", 4)


def test_last_exited_prefill_wavefront():
    le = LastExitedLayout(4)
    # chunk 1 may run loop d once chunk 0 finished (or runs in this step) loop d
    assert le.chunk_may_run([2, 1], [2, 1], 1, True)
    assert not le.chunk_may_run([1, 1], [1, 1], 1, True)
    assert le.chunk_may_run([1, 1], [2, 1], 1, True)  # chunk 0 runs loop 2 in the same step
    assert not le.chunk_may_run([4], [4], 0, True)


def test_shared_prefill_is_depth_major():
    sh = SharedLayout(4)
    assert sh.chunk_may_run([1, 0], [1, 0], 1, False)  # new chunk at loop 1
    assert not sh.chunk_may_run([1, 1], [1, 1], 0, False)  # loop 2 before the prompt is fully chunked
    assert sh.chunk_may_run([1, 1], [1, 1], 0, True)
    assert not sh.chunk_may_run([2, 1], [2, 1], 0, True)  # chunk 0 may not run ahead to loop 3
    assert sh.chunk_may_run([2, 1], [2, 2], 1, True)
    assert sh.chunk_may_run([2, 1], [2, 1], 1, True)  # chunk 0 finished loop 2 in an earlier step


def test_block_pool_refcounts_and_lru_eviction():
    pool = BlockPool(3)
    evicted = []
    a = pool.allocate(2)
    pool.ref(a[0])
    pool.release(a, cached=lambda b: (lambda blk: evicted.append(blk)))
    assert pool.num_free == 2  # a[1] idle; a[0] still referenced
    pool.release([a[0]], cached=lambda b: (lambda blk: evicted.append(blk)))
    assert pool.num_free == 3 and pool.num_cached_idle == 2
    got = pool.allocate(2)  # one truly free block, then the oldest idle one (a[1])
    assert evicted == [a[1]] and a[1] in got


def test_prefix_cache_hits_only_full_pages_before_last_token():
    kv = KVCacheManager(64, 4, LastExitedLayout(2), enable_prefix_caching=True)
    prompt = list(range(10, 23))  # 13 tokens: 3 full pages
    kv.allocate("a", 16, prompt, salt=0)
    kv.cache_prompt("a", prompt, salt=0)
    assert kv.prefix_cache.num_pages == 3
    b = kv.allocate("b", 16, prompt, salt=0)
    assert b.num_cached_tokens == 12
    assert [t[:3] for t in b.block_tables] == [t[:3] for t in kv.get("a").block_tables]
    exact = list(range(10, 22))  # 12 tokens: the last page holds the last token, so only 2 pages hit
    assert kv.allocate("c", 12, exact, salt=0).num_cached_tokens == 8
    assert kv.allocate("d", 16, prompt, salt=1).num_cached_tokens == 0  # another weight version
    assert kv.allocate("e", 16, [99] + prompt[1:], salt=0).num_cached_tokens == 0  # chained: first page differs


def test_grow_keeps_blocks_free():
    kv = KVCacheManager(12, 4, LastExitedLayout(2))
    kv.allocate("a", 4)  # 2 blocks, 10 free
    assert kv.grow("a", 20, keep_free=3) is None and kv.num_used_blocks == 2  # needs 8: only 7 may go
    assert [len(x) for x in kv.grow("a", 20, keep_free=2)] == [4, 4] and kv.num_free_blocks == 2


def test_share_cached_prefix_swaps_own_pages_for_pages_cached_later():
    """A handed-off request's pages are reserved before an earlier request with its prefix was
    cached; at admission its own copies of the now-cached pages are freed and the cached ones shared."""
    kv = KVCacheManager(40, 4, LastExitedLayout(2), enable_prefix_caching=True)
    prompt = list(range(3, 14))  # 11 tokens: 2 full pages before the last token
    kv.allocate("early", 11, prompt, salt=0)
    kv.allocate("late", 11, prompt, salt=0)  # nothing cached yet: its own 3 pages per plane
    assert kv.num_used_blocks == 12
    own = [list(t) for t in kv.get("late").block_tables]
    kv.cache_prompt("early", prompt, salt=0)
    kv.share_cached_prefix("late", prompt, salt=0)
    early, late = kv.get("early").block_tables, kv.get("late").block_tables
    assert [t[:2] for t in late] == [t[:2] for t in early] and [t[2] for t in late] == [t[2] for t in own]
    assert kv.num_used_blocks == 12 - 2 * 2 and kv.get("late").num_cached_tokens == 8
    assert kv.prefix_cache.stats.hits == 8
    kv.share_cached_prefix("late", prompt, salt=0)  # again: nothing changes
    assert kv.num_used_blocks == 8 and kv.prefix_cache.stats.hits == 8
    kv.free("early")
    kv.free("late")
    assert kv.num_used_blocks == 0
    assert kv.allocate("other-weights", 11, prompt, salt=1).num_cached_tokens == 0  # keys include the salt
