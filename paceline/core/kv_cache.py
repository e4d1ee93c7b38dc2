"""Per-request block tables over the block pool: allocate per step, prefix lookup, free, swap out/in.

Block hashes are kept per request and extended incrementally (a request's tokens only ever grow), so no
step rehashes a sequence from scratch. A block is made findable only once its KV has been computed.
"""
from __future__ import annotations

from paceline.core.block_pool import BlockHash, BlockPool, HostPool, hash_block
from paceline.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, num_host_blocks: int = 0,
                 enable_prefix_caching: bool = True, watermark: float = 0.0) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.host = HostPool(num_host_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.watermark_blocks = int(watermark * num_blocks)
        self.tables: dict[str, list[int]] = {}  # device blocks of running requests
        self.host_tables: dict[str, list[int]] = {}  # host blocks of swapped requests
        self.hashes: dict[str, list[BlockHash]] = {}  # chained hashes of each request's full blocks
        self.num_registered: dict[str, int] = {}  # leading blocks of the table already made findable
        self._host_to_release: list[int] = []  # host blocks read by this step's swap-ins
        self.prefix_queries = 0  # tokens looked up
        self.prefix_hits = 0  # tokens found

    # ---- sizes ----
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    # ---- hashing ----
    def block_hashes(self, request: Request, num_blocks: int) -> list[BlockHash]:
        """Hashes of the request's first num_blocks full blocks, extending the cached list as needed."""
        hashes = self.hashes.get(request.request_id)
        if hashes is None:
            hashes = self.hashes[request.request_id] = []
        bs, tokens = self.block_size, request.token_ids
        for i in range(len(hashes), num_blocks):
            hashes.append(hash_block(hashes[-1] if hashes else None, tokens[i * bs:(i + 1) * bs], request.cache_salt))
        return hashes

    # ---- prefix cache ----
    def find_cached_prefix(self, request: Request) -> list[int]:
        """Cached blocks matching the request's leading full blocks, for a request that holds none.

        Covers at most num_tokens - 1 tokens: the last known token is always computed, so there are logits.
        Nothing is referenced yet; pass the result to allocate().
        """
        if not self.enable_prefix_caching:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        found = []
        if max_blocks > 0:
            lookup = self.pool.lookup
            for h in self.block_hashes(request, max_blocks):
                block = lookup(h)
                if block is None:
                    break
                found.append(block)
        return found

    def record_prefix_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries += num_query_tokens
        self.prefix_hits += num_hit_tokens

    # ---- allocation ----
    def can_allocate(self, request: Request, num_new_tokens: int, cached: list[int] = (),
                     reserve: int = 0) -> bool:
        table = self.tables.get(request.request_id, ())
        num_computed = len(cached) * self.block_size if cached else request.num_computed_tokens
        need = cdiv(num_computed + num_new_tokens, self.block_size) - len(table) - len(cached)
        refs = self.pool.ref_counts
        taken_from_free = sum(1 for b in cached if refs[b] == 0)
        return need + taken_from_free + reserve <= self.pool.num_free

    def allocate(self, request: Request, num_new_tokens: int, cached: list[int] = (), reserve: int = 0) -> bool:
        """Grow the request's table to cover num_computed_tokens + num_new_tokens; False (and no change) when
        that would leave fewer than `reserve` free blocks. `cached` (from find_cached_prefix) starts a new
        table and moves num_computed_tokens past the hit."""
        rid = request.request_id
        table = self.tables.get(rid)
        if cached:
            if table:
                raise RuntimeError(f"request {rid} already holds blocks; a prefix hit must start a table")
            num_computed = len(cached) * self.block_size
        else:
            num_computed = request.num_computed_tokens
        need = cdiv(num_computed + num_new_tokens, self.block_size) - (len(table) if table else 0) - len(cached)
        if cached:
            refs = self.pool.ref_counts
            if need + sum(1 for b in cached if refs[b] == 0) + reserve > self.pool.num_free:
                return False
            self.pool.touch(cached)
            table = self.tables[rid] = list(cached)
            self.num_registered[rid] = len(cached)
            request.num_computed_tokens = num_computed
        else:
            if need + reserve > self.pool.num_free:
                return False
            if table is None:
                table = self.tables[rid] = []
                self.num_registered[rid] = 0
        if need > 0:
            table.extend(self.pool.allocate(need))
        return True

    def trim(self, request: Request, num_tokens: int) -> None:
        """Free the tail blocks past the first num_tokens tokens: slots taken for proposals that were rejected.
        They were never registered (only blocks of computed tokens are), so they go to the head of the free queue."""
        table = self.tables.get(request.request_id)
        keep = self.blocks_for(num_tokens)
        if table and len(table) > keep:
            self.pool.free(table[:keep - 1:-1] if keep else table[::-1])
            del table[keep:]

    def register_computed(self, request: Request) -> None:
        """Make the request's full, computed blocks findable by later requests."""
        rid = request.request_id
        full = request.num_computed_tokens // self.block_size
        done = self.num_registered.get(rid, 0)
        if full <= done or not self.enable_prefix_caching:
            return
        table = self.tables[rid]
        full = min(full, len(table))
        hashes = self.block_hashes(request, full)
        cache_block = self.pool.cache_block
        for i in range(done, full):
            cache_block(table[i], hashes[i])
        self.num_registered[rid] = full

    def free(self, request: Request) -> None:
        """Release the request's device blocks (tail first: the end of a sequence is evicted before its start)
        and its host blocks. Hashes are kept only while the request may come back."""
        rid = request.request_id
        table = self.tables.pop(rid, None)
        if table:
            self.pool.free(table[::-1])
        self.num_registered.pop(rid, None)
        host = self.host_tables.pop(rid, None)
        if host:
            self.host.free(host)

    def forget(self, request_id: str) -> None:
        """The request is gone for good: drop its hashes too."""
        self.hashes.pop(request_id, None)

    # ---- swap ----
    def can_swap_out(self, request: Request) -> bool:
        return len(self.tables.get(request.request_id, ())) <= self.host.num_free

    def swap_out(self, request: Request) -> list[tuple[int, int]]:
        """Copy every device block to a fresh host block and free the device blocks; (device, host) pairs."""
        rid = request.request_id
        table = self.tables.get(rid, [])
        host = self.host.allocate(len(table))
        mapping = list(zip(table, host))
        self.free(request)
        self.host_tables[rid] = host
        return mapping

    def can_swap_in(self, request: Request, num_new_tokens: int, reserve: int = 0) -> bool:
        # the host may hold more blocks than the computed tokens fill: a request preempted in the step that had
        # grown its table swaps all of it out, and swap_in brings all of it back before growing it
        need = max(len(self.host_tables[request.request_id]),
                   self.blocks_for(request.num_computed_tokens + num_new_tokens))
        return need + reserve <= self.pool.num_free

    def swap_in(self, request: Request, num_new_tokens: int) -> list[tuple[int, int]]:
        """Copy the host blocks back to fresh device blocks and grow the table for this step's tokens."""
        rid = request.request_id
        host = self.host_tables.pop(rid)
        device = self.pool.allocate(len(host))
        self.tables[rid] = device
        self.num_registered[rid] = 0
        # a host block read by this step's swap-in must not be written by a later swap-out of the same step
        self._host_to_release.extend(host)
        if not self.allocate(request, num_new_tokens):
            raise RuntimeError("swap_in called without can_swap_in")
        return list(zip(host, device))

    def end_step(self) -> None:
        """The executor has done last step's copies: host blocks read by swap-ins can be reused."""
        if self._host_to_release:
            self.host.free(self._host_to_release)
            self._host_to_release = []
