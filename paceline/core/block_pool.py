"""A fixed pool of KV blocks: ref counts, a free queue in LRU order, and hash -> block for prefix caching.

A free block may still hold a cached prefix: it stays findable by its hash until the free queue hands it out
for fresh use. The free queue is an OrderedDict used as an O(1) doubly linked list: the head is evicted first.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

BlockHash = bytes


def hash_block(parent: BlockHash | None, tokens: list[int], cache_salt: str | None = None) -> BlockHash:
    """Chained hash of one full block: the parent's hash pins the whole prefix, the salt separates tenants.

    blake2b rather than hash(): Python's tuple hash is easy to collide on purpose, and a collision here would
    hand one request another request's KV.
    """
    h = hashlib.blake2b(digest_size=16)
    if parent is None:
        h.update(b"s" + cache_salt.encode() if cache_salt else b"-")
    else:
        h.update(parent)
    h.update(array("q", tokens).tobytes())
    return h.digest()


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[BlockHash | None] = [None] * num_blocks
        self.cached: dict[BlockHash, int] = {}
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        """Blocks with no owner, cached or not: all of them can be handed out."""
        return len(self.free_queue)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def allocate(self, n: int) -> list[int]:
        """n fresh blocks (ref count 1) from the head of the free queue, evicting their cached prefixes."""
        if n > len(self.free_queue):
            raise ValueError(f"cannot allocate {n} blocks, only {len(self.free_queue)} are free")
        out = []
        pop = self.free_queue.popitem
        for _ in range(n):
            block, _ = pop(last=False)
            h = self.block_hashes[block]
            if h is not None:
                self.block_hashes[block] = None
                if self.cached.get(h) == block:
                    del self.cached[h]
                self.num_evictions += 1
            self.ref_counts[block] = 1
            out.append(block)
        return out

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block, in the given order: the first to reach 0 is evicted first.

        Callers pass a sequence tail-first so its end goes before its start. Blocks holding no cached prefix
        go to the head: handing them out first keeps cached prefixes alive longer.
        """
        refs, queue, hashes = self.ref_counts, self.free_queue, self.block_hashes
        for block in blocks:
            r = refs[block] - 1
            if r < 0:
                raise RuntimeError(f"block {block} freed more often than allocated")
            refs[block] = r
            if r == 0:
                queue[block] = None
                if hashes[block] is None:
                    queue.move_to_end(block, last=False)

    def lookup(self, block_hash: BlockHash) -> int | None:
        return self.cached.get(block_hash)

    def touch(self, blocks: list[int]) -> None:
        """Take one more reference to cached blocks found by lookup(); free ones leave the free queue."""
        refs = self.ref_counts
        for block in blocks:
            if refs[block] == 0:
                del self.free_queue[block]
            refs[block] += 1

    def cache_block(self, block: int, block_hash: BlockHash) -> None:
        """Make a full, computed block findable. A prefix already cached elsewhere keeps its first block."""
        if not self.enable_caching or self.block_hashes[block] is not None:
            return
        if block_hash not in self.cached:
            self.cached[block_hash] = block
            self.block_hashes[block] = block_hash


class HostPool:
    """Host-memory blocks that swapped-out KV is copied to. No caching, no order: a free list."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.free_list = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self.free_list)

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free_list):
            raise ValueError(f"cannot allocate {n} host blocks, only {len(self.free_list)} are free")
        out = self.free_list[-n:] if n else []
        del self.free_list[len(self.free_list) - n:]
        return out

    def free(self, blocks: list[int]) -> None:
        self.free_list.extend(blocks)
