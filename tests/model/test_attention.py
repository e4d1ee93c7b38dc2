"""Paged attention over mixed batches against a dense per-request reference."""
from __future__ import annotations

import pytest
import torch

import paceline.model.attention as attention
from paceline.model import attention_kernel, int4_kernel
from paceline.model.attention import (GatherWorkspace, SeqSlice, build_metadata, dense_attention_reference, group_decodes,
                                      paged_attention)

H, KVH, D, BS, NB = 6, 2, 8, 4, 40
SCALE = D ** -0.5


KERNEL = attention_kernel.load() is not None
needs_kernel = pytest.mark.skipif(not KERNEL, reason="the C++ attention kernel cannot be built here")
PATHS = [False, pytest.param(True, marks=needs_kernel)]  # eager gathers + SDPA, the C++ op


def _run(seqs: list[SeqSlice], ctx_k: list[torch.Tensor], ctx_v: list[torch.Tensor], qs: list[torch.Tensor],
         workspace: GatherWorkspace | None = None, kernel: bool | None = False, bs: int = BS,
         cache_dtype: torch.dtype = torch.float32):
    """Fill each request's earlier context into its blocks, then run this step's tokens through paged attention."""
    kvh, d = ctx_k[0].shape[1:]
    nb = max(b for s in seqs for b in s.block_table) + 1
    k_cache = torch.zeros(nb, bs, kvh, d, dtype=cache_dtype)
    v_cache = torch.zeros(nb, bs, kvh, d, dtype=cache_dtype)
    for s, k, v in zip(seqs, ctx_k, ctx_v):
        for p in range(s.start):
            k_cache[s.block_table[p // bs], p % bs] = k[p]
            v_cache[s.block_table[p // bs], p % bs] = v[p]
    q = torch.cat(qs)
    k = torch.cat([k[s.start:s.start + s.num_tokens] for s, k in zip(seqs, ctx_k)])
    v = torch.cat([v[s.start:s.start + s.num_tokens] for s, v in zip(seqs, ctx_v)])
    meta = build_metadata(seqs, bs, workspace=workspace, kernel=kernel)
    assert (meta.kernel is not None) == bool(kernel)
    return paged_attention(q, k, v, k_cache, v_cache, meta, q.shape[-1] ** -0.5), k_cache, v_cache


@pytest.mark.parametrize("shape", [
    [(0, 13)],  # one fresh prompt: the causal fast path
    [(9, 6)],  # one chunk after earlier context
    [(0, 5), (7, 9), (3, 4), (20, 1), (5, 1), (33, 1)],  # prompt chunks and decodes of different lengths
    [(11, 1), (2, 1)],  # decodes only, different context lengths (padding mask)
    [(0, 1)],  # a one-token prompt is a "decode" with no earlier context
])
@pytest.mark.parametrize("kernel", PATHS)
def test_paged_matches_dense(shape, kernel):
    g = torch.Generator().manual_seed(len(shape))
    free = torch.randperm(NB, generator=g).tolist()  # scattered, out-of-order blocks
    seqs, ks, vs, qs = [], [], [], []
    for start, n in shape:
        total = start + n
        nblocks = (total + BS - 1) // BS
        seqs.append(SeqSlice(start, n, [free.pop() for _ in range(nblocks)]))
        ks.append(torch.randn(total, KVH, D, generator=g))
        vs.append(torch.randn(total, KVH, D, generator=g))
        qs.append(torch.randn(n, H, D, generator=g))
    out, k_cache, _ = _run(seqs, ks, vs, qs, kernel=kernel)
    row = 0
    for s, k, v, q in zip(seqs, ks, vs, qs):
        ref = dense_attention_reference(q, k, v, s.start, SCALE)
        torch.testing.assert_close(out[row:row + s.num_tokens], ref, atol=1e-5, rtol=1e-5)
        row += s.num_tokens
        # this step's keys landed in the right slots
        last = s.start + s.num_tokens - 1
        torch.testing.assert_close(k_cache[s.block_table[last // BS], last % BS], k[last])


def test_metadata_rejects_bad_layouts():
    with pytest.raises(ValueError, match="before"):
        build_metadata([SeqSlice(5, 1, [0, 1]), SeqSlice(0, 3, [2])], BS)
    with pytest.raises(ValueError, match="cannot hold"):
        build_metadata([SeqSlice(0, 9, [0, 1])], BS)
    with pytest.raises(ValueError, match="at least one"):
        build_metadata([], BS)


def _brute_force_cost(lengths: list[int], cost: int, cap: int) -> float:
    """Cheapest split of `lengths` into consecutive groups, by trying every one."""
    n, best = len(lengths), float("inf")
    for mask in range(1 << (n - 1)):
        total, first = 0.0, 0
        for i in range(1, n + 1):
            if i == n or mask >> (i - 1) & 1:
                size, longest = i - first, max(lengths[first:i])
                if size > 1 and size * longest > cap:
                    break
                total += cost + size * longest
                first = i
        else:
            best = min(best, total)
    return best


def test_group_decodes_keeps_similar_lengths_together():
    assert group_decodes([64] * 8) == [8]  # nothing padded: one group
    assert group_decodes([16, 32, 32, 48]) == [4]  # a little padding is cheaper than a second group
    assert group_decodes([16] * 6 + [1904]) == [6, 1]  # a long context no longer pads six short ones
    assert group_decodes([64] * 8, max_positions=128) == [2, 2, 2, 2]
    assert group_decodes([4096], max_positions=128) == [1]  # one decode over the cap still gets a group


@pytest.mark.parametrize("seed", range(20))
def test_group_decodes_is_optimal(seed):
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 9, (1,), generator=g))
    lengths = sorted((torch.randint(1, 40, (n,), generator=g) * 16).tolist())
    cost, cap = int(torch.randint(0, 400, (1,), generator=g)), int(torch.randint(600, 3000, (1,), generator=g))
    sizes = group_decodes(lengths, cost, cap)
    assert sum(sizes) == n and min(sizes) >= 1
    got, first = 0.0, 0
    for size in sizes:
        got += cost + size * max(lengths[first:first + size])
        assert size == 1 or size * max(lengths[first:first + size]) <= cap
        first += size
    assert got == _brute_force_cost(lengths, cost, cap)


def test_decode_groups_and_workspace_match_dense(monkeypatch):
    """Decodes split into several groups, every gather written into one workspace: same answer as the reference,
    and the workspace is reused by the next step rather than reallocated."""
    monkeypatch.setattr(attention, "GROUP_COST_POSITIONS", 1)  # split wherever padded lengths differ
    shape = [(0, 5), (9, 3), (2, 1), (3, 1), (17, 1), (29, 1), (30, 1)]
    g = torch.Generator().manual_seed(7)
    free = torch.randperm(NB, generator=g).tolist()
    seqs, ks, vs, qs = [], [], [], []
    for start, n in shape:
        seqs.append(SeqSlice(start, n, [free.pop() for _ in range(-(-(start + n) // BS))]))
        ks.append(torch.randn(start + n, KVH, D, generator=g))
        vs.append(torch.randn(start + n, KVH, D, generator=g))
        qs.append(torch.randn(n, H, D, generator=g))
    workspace = GatherWorkspace(BS * KVH * D, torch.float32, "cpu")
    out, _, _ = _run(seqs, ks, vs, qs, workspace)
    meta = build_metadata(seqs, BS, workspace=workspace, kernel=False)
    assert [grp.num_decodes for grp in meta.decode_groups] == [2, 1, 2]  # contexts 3-4, 18, 30-31 (in blocks of 4)
    assert all(grp.kv_out[0].untyped_storage().data_ptr() == workspace.buffer.untyped_storage().data_ptr()
               for grp in meta.decode_groups)
    row = 0
    for s, k, v, q in zip(seqs, ks, vs, qs):
        torch.testing.assert_close(out[row:row + s.num_tokens], dense_attention_reference(q, k, v, s.start, SCALE),
                                   atol=1e-5, rtol=1e-5)
        row += s.num_tokens
    buffer = workspace.buffer
    assert buffer.numel() > 0
    build_metadata(seqs, BS, workspace=workspace, kernel=False)
    assert workspace.buffer is buffer  # same size of step: nothing new allocated
    build_metadata([SeqSlice(0, 1, list(range(NB))), SeqSlice(NB * BS - 1, 1, list(range(NB)))], BS,
                   workspace=workspace, kernel=False)
    assert workspace.buffer.numel() > buffer.numel()  # a bigger step grows it


def _random_step(shape, kvh, h, d, bs, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    nb = sum(-(-(start + n) // bs) for start, n in shape) + 3
    free = torch.randperm(nb, generator=g).tolist()
    seqs, ks, vs, qs = [], [], [], []
    for start, n in shape:
        seqs.append(SeqSlice(start, n, [free.pop() for _ in range(-(-(start + n) // bs))]))
        # a common offset in the keys makes scores large and the online softmax's rescaling matter
        ks.append((torch.randn(start + n, kvh, d, generator=g) + 2).to(dtype))
        vs.append(torch.randn(start + n, kvh, d, generator=g).to(dtype))
        qs.append(torch.randn(n, h, d, generator=g))
    return seqs, ks, vs, qs


@needs_kernel
@pytest.mark.parametrize("kvh,h,d,bs", [(3, 9, 64, 16), (2, 2, 128, 16), (1, 4, 12, 5), (4, 8, 40, 16), (1, 7, 16, 8)])
def test_kernel_matches_dense_at_model_shapes(kvh, h, d, bs):
    """The C++ op on SmolLM2's shapes (9 query heads on 3 KV heads, head_dim 64), a 128-wide head, a head size that
    is not a multiple of 8 (the plain loops), one with a partial last vector slab and 7 query heads per KV head
    (groups of 3, 2, 2): prompt chunks longer than one work item (16 tokens) over contexts of several 64-position
    chunks, and decodes."""
    shape = [(0, 37), (70, 45), (150, 1), (1, 1), (200, 1), (63, 1), (64, 1)]
    seqs, ks, vs, qs = _random_step(shape, kvh, h, d, bs, seed=d)
    out, _, _ = _run(seqs, ks, vs, qs, kernel=True, bs=bs)
    row = 0
    for s, k, v, q in zip(seqs, ks, vs, qs):
        ref = dense_attention_reference(q, k, v, s.start, d ** -0.5)
        torch.testing.assert_close(out[row:row + s.num_tokens], ref, atol=2e-5, rtol=1e-4)
        row += s.num_tokens


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("new_dtype", [torch.float32, "cache"])
def test_kernel_reads_half_precision_caches(dtype, new_dtype):
    """A bfloat16 / float16 cache is widened inside the op, and this step's K/V are rounded into it (float32 ones
    from a wide step, or already in the cache's dtype): the same answer as the reference on the rounded K/V."""
    shape = [(20, 17), (90, 1), (5, 1)]
    seqs, ks, vs, qs = _random_step(shape, 3, 9, 64, 16, seed=3)
    if new_dtype == "cache":
        ks, vs = [k.to(dtype) for k in ks], [v.to(dtype) for v in vs]
    out, k_cache, _ = _run(seqs, ks, vs, qs, kernel=True, bs=16, cache_dtype=dtype)
    row = 0
    for s, k, v, q in zip(seqs, ks, vs, qs):
        ref = dense_attention_reference(q, k.to(dtype).float(), v.to(dtype).float(), s.start, 64 ** -0.5)
        torch.testing.assert_close(out[row:row + s.num_tokens], ref, atol=2e-5, rtol=1e-4)
        last = s.start + s.num_tokens - 1
        assert torch.equal(k_cache[s.block_table[last // 16], last % 16], k[last].to(dtype))
        row += s.num_tokens


def test_kernel_falls_back_without_a_compiler(monkeypatch, tmp_path):
    """No compiler (and nothing built yet): the eager path runs, one warning; asking for the op is a ValueError."""
    monkeypatch.setenv("PACELINE_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr(int4_kernel, "_loaded", {})  # the ops' shared load-once cache
    assert attention_kernel.load() is None
    seqs = [SeqSlice(3, 1, [0])]
    meta = build_metadata(seqs, BS)
    assert meta.kernel is None and len(meta.decode_groups) == 1
    with pytest.raises(ValueError, match="not available"):
        build_metadata(seqs, BS, kernel=True)
    monkeypatch.setenv("PACELINE_ATTN_KERNEL", "0")  # switched off: not even tried
    assert attention_kernel.load() is None


def test_kernel_rejects_a_bad_sequence_table():
    if not KERNEL:
        pytest.skip("the C++ attention kernel cannot be built here")
    op = attention_kernel.load()
    q, kv = torch.zeros(2, 6, 8), torch.zeros(2, 2, 8)
    cache = torch.zeros(4, BS, 2, 8)
    table, slots = torch.zeros(1, 2, dtype=torch.int32), torch.tensor([0, 1])
    with pytest.raises(RuntimeError, match="does not fit"):  # 2 tokens at position 20 need 6 blocks, the table has 2
        op(q, kv, kv, cache, cache, slots, table, torch.tensor([[0, 2, 20]], dtype=torch.int32), 1.0)
    with pytest.raises(RuntimeError, match="outside the cache"):
        op(q, kv, kv, cache, cache, torch.tensor([0, 4 * BS]), table, torch.tensor([[0, 2, 0]], dtype=torch.int32), 1.0)


@needs_kernel
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_kernel_many_decodes_read_all_kv_heads_at_once_and_match_dense(cache_dtype):
    """Enough few-token slices (here 20 decodes and 3-token verifications, more than 4 per thread) run as items of
    all KV heads at once, the long chunk one KV head at a time: each row equals the dense reference and, bit for bit,
    the same slice run alone (a lone slice takes the one-head items)."""
    g = torch.Generator().manual_seed(7)
    shape = [(40, 9), (30, 3), (55, 3)] + [(int(torch.randint(0, 70, (1,), generator=g)), 1) for _ in range(20)]
    free = torch.randperm(400, generator=g).tolist()
    seqs, ks, vs, qs = [], [], [], []
    for start, n in shape:
        seqs.append(SeqSlice(start, n, [free.pop() for _ in range(-(-(start + n) // BS))]))
        ks.append(torch.randn(start + n, KVH, D, generator=g).to(cache_dtype).float())
        vs.append(torch.randn(start + n, KVH, D, generator=g).to(cache_dtype).float())
        qs.append(torch.randn(n, H, D, generator=g))
    out, _, _ = _run(seqs, ks, vs, qs, kernel=True, cache_dtype=cache_dtype)
    row = 0
    for s, k, v, q in zip(seqs, ks, vs, qs):
        want = dense_attention_reference(q, k, v, s.start, SCALE)
        torch.testing.assert_close(out[row:row + s.num_tokens], want, atol=1e-5, rtol=1e-5)
        alone, _, _ = _run([s], [k], [v], [q], kernel=True, cache_dtype=cache_dtype)
        assert torch.equal(out[row:row + s.num_tokens], alone)
        row += s.num_tokens


# the op's builds: this CPU's best (AVX-512 where it has it) and the forced AVX2 one (AVX2-only machines' path)
ISAS = [pytest.param(isa, marks=pytest.mark.skipif(not (KERNEL and isa in attention_kernel.supported_isas()),
                                                   reason=f"no {isa} build of the attention kernel here"))
        for isa in ("avx512", "avx2")]

# prompt chunks of more than 4 tokens run in row tiles: fresh prompts, chunks at context (several 64-position chunks,
# one ending mid-block), GQA groups of 1, 3 and 4 rows per token (panels of 1-4 row vectors), and mixed with decodes
TILE_SHAPES = {
    "fresh": [(0, 130)],
    "at context": [(200, 77)],
    "mixed": [(0, 5), (64, 40), (33, 17), (150, 1), (1, 1), (63, 1)],
}


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kvh,h,d", [(3, 9, 64), (2, 8, 128), (4, 4, 64), (1, 7, 40)])
@pytest.mark.parametrize("name", list(TILE_SHAPES))
def test_kernel_tiles_match_dense(monkeypatch, isa, kvh, h, d, name):
    """float32 cache and queries: the row tiles (and the decodes beside them) equal the dense reference."""
    monkeypatch.setenv("PACELINE_ATTN_ISA", isa)
    seqs, ks, vs, qs = _random_step(TILE_SHAPES[name], kvh, h, d, 16, seed=h + d)
    out, _, _ = _run(seqs, ks, vs, qs, kernel=True, bs=16)
    row = 0
    for s, k, v, q in zip(seqs, ks, vs, qs):
        ref = dense_attention_reference(q, k, v, s.start, d ** -0.5)
        torch.testing.assert_close(out[row:row + s.num_tokens], ref, atol=2e-5, rtol=1e-4)
        row += s.num_tokens


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kvh,h,d", [(3, 9, 64), (2, 8, 128), (1, 7, 40)])
@pytest.mark.parametrize("name", list(TILE_SHAPES))
def test_kernel_tiles_bf16_cache_match_dense(monkeypatch, isa, kvh, h, d, name):
    """A bfloat16 cache with bfloat16-valued queries (a bfloat16 model's): where the CPU has AVX512_BF16 and
    head_dim is a multiple of 32, scores are bf16 pair dot products (exact products) and P is rounded to bfloat16
    for P.V, so the output is within bfloat16 rounding of the reference; float32 queries (a wide step) still take
    the float32 tiles, as exact as before."""
    monkeypatch.setenv("PACELINE_ATTN_ISA", isa)
    seqs, ks, vs, qs = _random_step(TILE_SHAPES[name], kvh, h, d, 16, seed=d, dtype=torch.bfloat16)
    for queries, tol in (("bf16", 4e-3), ("fp32", 2e-5)):
        qq = [q.to(torch.bfloat16).float() for q in qs] if queries == "bf16" else qs
        out, _, _ = _run(seqs, ks, vs, qq, kernel=True, bs=16, cache_dtype=torch.bfloat16)
        row = 0
        for s, k, v, q in zip(seqs, ks, vs, qq):
            ref = dense_attention_reference(q, k.float(), v.float(), s.start, d ** -0.5)
            torch.testing.assert_close(out[row:row + s.num_tokens], ref, atol=tol, rtol=tol)
            row += s.num_tokens


def test_isa_switch_rejects_unknown_values(monkeypatch):
    monkeypatch.setenv("PACELINE_ATTN_ISA", "sse9")
    with pytest.raises(ValueError, match="PACELINE_ATTN_ISA"):
        attention_kernel.isa()


@pytest.mark.skipif(not (KERNEL and "avx512" in attention_kernel.supported_isas() and "avx2" in attention_kernel.supported_isas()),
                    reason="needs both the AVX-512 and the AVX2 builds")
def test_isa_builds_have_their_own_libraries(monkeypatch):
    """The ISA is part of the library's file name and namespace: both builds load side by side in one process."""
    paths = {}
    for isa in ("avx512", "avx2"):
        monkeypatch.setenv("PACELINE_ATTN_ISA", isa)
        path, namespace, flags = attention_kernel._library_path()
        assert isa in path.name and isa in namespace and ("-mavx512f" in flags) == (isa == "avx512")
        paths[isa] = path
    assert paths["avx512"] != paths["avx2"]
