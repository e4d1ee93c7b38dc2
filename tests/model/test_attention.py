"""Paged attention over mixed batches against a dense per-request reference."""
from __future__ import annotations

import pytest
import torch

import paceline.model.attention as attention
from paceline.model.attention import (GatherWorkspace, SeqSlice, build_metadata, dense_attention_reference, group_decodes,
                                      paged_attention)

H, KVH, D, BS, NB = 6, 2, 8, 4, 40
SCALE = D ** -0.5


def _run(seqs: list[SeqSlice], ctx_k: list[torch.Tensor], ctx_v: list[torch.Tensor], qs: list[torch.Tensor],
         workspace: GatherWorkspace | None = None):
    """Fill each request's earlier context into its blocks, then run this step's tokens through paged attention."""
    k_cache = torch.zeros(NB, BS, KVH, D)
    v_cache = torch.zeros(NB, BS, KVH, D)
    for s, k, v in zip(seqs, ctx_k, ctx_v):
        for p in range(s.start):
            k_cache[s.block_table[p // BS], p % BS] = k[p]
            v_cache[s.block_table[p // BS], p % BS] = v[p]
    q = torch.cat(qs)
    k = torch.cat([k[s.start:s.start + s.num_tokens] for s, k in zip(seqs, ctx_k)])
    v = torch.cat([v[s.start:s.start + s.num_tokens] for s, v in zip(seqs, ctx_v)])
    meta = build_metadata(seqs, BS, workspace=workspace)
    return paged_attention(q, k, v, k_cache, v_cache, meta, SCALE), k_cache, v_cache


@pytest.mark.parametrize("shape", [
    [(0, 13)],  # one fresh prompt: the causal fast path
    [(9, 6)],  # one chunk after earlier context
    [(0, 5), (7, 9), (3, 4), (20, 1), (5, 1), (33, 1)],  # prompt chunks and decodes of different lengths
    [(11, 1), (2, 1)],  # decodes only, different context lengths (padding mask)
    [(0, 1)],  # a one-token prompt is a "decode" with no earlier context
])
def test_paged_matches_dense(shape):
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
    out, k_cache, _ = _run(seqs, ks, vs, qs)
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
    meta = build_metadata(seqs, BS, workspace=workspace)
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
    build_metadata(seqs, BS, workspace=workspace)
    assert workspace.buffer is buffer  # same size of step: nothing new allocated
    build_metadata([SeqSlice(0, 1, list(range(NB))), SeqSlice(NB * BS - 1, 1, list(range(NB)))], BS,
                   workspace=workspace)
    assert workspace.buffer.numel() > buffer.numel()  # a bigger step grows it
