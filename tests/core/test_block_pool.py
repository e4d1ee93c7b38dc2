"""Block pool and KV manager: ref counts, LRU eviction order, prefix hits, salts, swap."""
from __future__ import annotations

import pytest

from sched_util import make_request

from paceline.core.block_pool import BlockPool, HostPool, hash_block
from paceline.core.kv_cache import KVCacheManager


def test_allocate_and_free_keep_ref_counts() -> None:
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert pool.num_free == 1 and all(pool.ref_counts[b] == 1 for b in a)
    pool.touch([a[0]])
    pool.free(a)
    assert pool.ref_counts[a[0]] == 1 and pool.num_free == 3
    pool.free([a[0]])
    assert pool.num_free == 4
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free([a[0]])
    with pytest.raises(ValueError, match="cannot allocate 5"):
        pool.allocate(5)


def test_eviction_is_lru_and_a_sequence_end_goes_first() -> None:
    pool = BlockPool(6)
    first, second = pool.allocate(3), pool.allocate(3)
    for i, b in enumerate(first + second):
        pool.cache_block(b, hash_block(None, [i]))
    pool.free(first[::-1])  # tail first, as the KV manager does
    pool.free(second[::-1])
    # the oldest freed sequence goes first, and within it the end before the start
    assert pool.allocate(6) == first[::-1] + second[::-1]
    assert pool.cached == {} and pool.num_evictions == 6


def test_uncached_free_blocks_are_handed_out_before_cached_ones() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    pool.cache_block(blocks[0], hash_block(None, [1]))
    pool.free([blocks[0]])
    pool.free([blocks[1]])  # holds nothing worth keeping
    assert pool.allocate(1) == [blocks[1]]
    assert pool.lookup(hash_block(None, [1])) == blocks[0]


def test_touching_a_free_cached_block_takes_it_out_of_the_free_queue() -> None:
    pool = BlockPool(2)
    b = pool.allocate(1)[0]
    h = hash_block(None, [5, 6])
    pool.cache_block(b, h)
    pool.free([b])
    assert pool.num_free == 2
    pool.touch([pool.lookup(h)])
    assert pool.num_free == 1 and pool.ref_counts[b] == 1
    assert pool.allocate(1) != [b]


def test_hash_chains_the_parent_and_the_salt() -> None:
    a = hash_block(None, [1, 2])
    assert hash_block(None, [1, 2]) == a
    assert hash_block(None, [1, 2], "tenant") != a
    assert hash_block(a, [3, 4]) != hash_block(hash_block(None, [9, 9]), [3, 4])


def test_host_pool() -> None:
    host = HostPool(3)
    got = host.allocate(2)
    assert len(set(got)) == 2 and host.num_free == 1
    host.free(got)
    assert host.num_free == 3 and host.allocate(0) == []


def computed(kv: KVCacheManager, request, tokens: int | None = None) -> None:
    """Pretend the executor computed the request's tokens so far."""
    tokens = request.num_tokens if tokens is None else tokens
    assert kv.allocate(request, tokens - request.num_computed_tokens)
    request.num_computed_tokens = tokens
    kv.register_computed(request)


def test_allocation_covers_only_the_tokens_of_this_step() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4)
    r = make_request("a", 17)
    assert kv.allocate(r, 5)
    assert len(kv.tables["a"]) == 2
    r.num_computed_tokens = 5
    assert kv.allocate(r, 3) and len(kv.tables["a"]) == 2
    assert kv.allocate(r, 4) and len(kv.tables["a"]) == 3
    assert not kv.allocate(r, 100) and len(kv.tables["a"]) == 3  # no partial allocation on failure


def test_prefix_hit_never_covers_the_whole_prompt() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4)
    first = make_request("a", list(range(8)))
    computed(kv, first)
    kv.free(first)
    again = make_request("b", list(range(8)))  # exactly two full blocks: only the first may hit
    hit = kv.find_cached_prefix(again)
    assert len(hit) == 1
    assert kv.allocate(again, 4, hit)
    assert again.num_computed_tokens == 4 and kv.tables["b"][0] == hit[0]
    longer = make_request("c", list(range(9)))
    assert len(kv.find_cached_prefix(longer)) == 2


def test_shared_prefix_blocks_are_shared_with_ref_counts() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = make_request("a", list(range(10)))
    computed(kv, a)
    b = make_request("b", list(range(8)) + [50, 51, 52])
    hit = kv.find_cached_prefix(b)
    assert hit == kv.tables["a"][:2]
    assert kv.allocate(b, 3, hit)
    assert [kv.pool.ref_counts[x] for x in hit] == [2, 2]
    kv.free(a)
    assert [kv.pool.ref_counts[x] for x in hit] == [1, 1]


def test_cache_salt_separates_prefixes() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4)
    computed(kv, make_request("a", list(range(9)), salt="alice"))
    assert kv.find_cached_prefix(make_request("b", list(range(9)), salt="bob")) == []
    assert kv.find_cached_prefix(make_request("c", list(range(9)))) == []
    assert len(kv.find_cached_prefix(make_request("d", list(range(9)), salt="alice"))) == 2


def test_uncomputed_blocks_are_never_findable_and_disabled_cache_finds_nothing() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = make_request("a", list(range(9)))
    assert kv.allocate(a, 9)  # scheduled, not yet computed
    assert kv.find_cached_prefix(make_request("b", list(range(9)))) == []
    off = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=False)
    computed(off, make_request("a", list(range(9))))
    assert off.find_cached_prefix(make_request("b", list(range(9)))) == [] and not off.pool.cached


def test_freed_prefix_survives_until_its_blocks_are_needed() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = make_request("a", list(range(9)))
    computed(kv, a)
    kv.free(a)
    assert len(kv.find_cached_prefix(make_request("b", list(range(9))))) == 2
    filler = make_request("f", 4)
    assert kv.allocate(filler, 4)  # takes the uncached partial third block
    assert len(kv.find_cached_prefix(make_request("b2", list(range(9))))) == 2
    filler2 = make_request("g", 8)
    assert kv.allocate(filler2, 8)  # the never-used block, then an eviction: the sequence's end goes first
    assert len(kv.find_cached_prefix(make_request("b3", list(range(9))))) == 1


def test_swap_out_and_in_move_every_block() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=4, num_host_blocks=4)
    r = make_request("a", 10)
    computed(kv, r)
    device = list(kv.tables["a"])
    assert kv.can_swap_out(r)
    out = kv.swap_out(r)
    assert [d for d, _ in out] == device and "a" not in kv.tables and kv.host.num_free == 1
    assert kv.pool.num_free == 6
    host = [h for _, h in out]
    assert kv.can_swap_in(r, 1)
    back = kv.swap_in(r, 1)
    assert [h for h, _ in back] == host and len(kv.tables["a"]) == 3
    assert kv.host.num_free == 1  # the host blocks come back only after the step's copies
    kv.end_step()
    assert kv.host.num_free == 4


def test_swap_in_needs_room_for_every_host_block_even_past_the_computed_tokens() -> None:
    # preempted in the step that had grown its table: 16 tokens computed, blocks held for 21 (found by hypothesis)
    kv = KVCacheManager(num_blocks=8, block_size=4, num_host_blocks=8, enable_prefix_caching=False)
    r = make_request("a", 21)
    computed(kv, r, 16)
    assert kv.allocate(r, 5) and len(kv.tables["a"]) == 6
    kv.swap_out(r)
    filler = make_request("f", 12)
    computed(kv, filler)  # 3 of 8 blocks taken: 5 free, enough for 17 tokens but not for the 6 host blocks
    assert not kv.can_swap_in(r, 1)
    kv.free(filler)
    assert kv.can_swap_in(r, 1)
    assert len(kv.swap_in(r, 1)) == 6
