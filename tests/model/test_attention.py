"""Paged attention over mixed batches against a dense per-request reference."""
from __future__ import annotations

import pytest
import torch

from paceline.model.attention import SeqSlice, build_metadata, dense_attention_reference, paged_attention

H, KVH, D, BS, NB = 6, 2, 8, 4, 40
SCALE = D ** -0.5


def _run(seqs: list[SeqSlice], ctx_k: list[torch.Tensor], ctx_v: list[torch.Tensor], qs: list[torch.Tensor]):
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
    meta = build_metadata(seqs, BS)
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
