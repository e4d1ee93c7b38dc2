"""Paged attention over a flat batch that mixes prompt chunks and decodes.

The KV cache is one preallocated tensor `[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`
(2 = K, V). A token at position `p` of a request lives in slot `block_table[p // bs] * bs + p % bs`.

On CPU, when it builds (attention_kernel.py: a small C++ op compiled once and cached), each layer is ONE call of
that op for the whole flat batch: it writes this step's K/V into their slots, reads every context straight from
its blocks (no gather), shares each KV head's loads between the query heads of its GQA group, and accumulates a
flash-style softmax in float32. Why: the gathers copied every context position once per layer and SDPA read it
again, in a handful of ops per decode group; one layer of SmolLM2-135M (9 query / 3 KV heads, head_dim 64,
float32), best of 15 in one process: 32 decodes at 100-200 tokens 1.35 -> 0.38 ms, 6 decodes at 1,900 tokens
2.78 -> 0.79 ms, a 64-token chunk at 1,000 + 6 decodes 2.81 -> 1.71 ms, a fresh 512-token prompt 4.95 -> 3.02 ms,
a 512-token chunk at 1,000 15.2 -> 14.3 ms (benchmarks/summaries/attention.md; the AVX2 machine). Elsewhere (CUDA,
no compiler, `PACELINE_ATTN_KERNEL=0`) the eager path below runs.

Prompt chunks run in the op's row tiles (query rows transposed, scores and P.V as register-blocked GEMMs), built for
AVX-512 where the CPU has it and, for a bfloat16 cache with a bfloat16 model's queries, with bfloat16 pair dot
products (vdpbf16ps). Why: long chunks are compute-bound, and on the AVX-512 machine attention was 644 of 1,555 ms
of a 1,500-token prompt (bf16, 512-token chunks). Torch's SDPA (flash, bf16 native) was no way out: it lost to the
op on every shape. One layer, best of 15, 2026-11-24 06:25 UTC, `benchmarks/decode_attention.py --layer --variants
rev=0695ec0,avx2,avx512,eager`: a 512-token chunk at 1,000 11.14 -> 5.24 ms (bf16; SDPA 14.36), 10.95 -> 7.99 ms
(float32), a fresh 512-token prompt 2.56 -> 1.43 ms (bf16), decodes unchanged; whole bf16 model
(`profile_step.py --compare kernels=0695ec0,kernels=b3e1ac8`): the 1,500-token prompt in 512-token chunks
1,484.6 -> 1,165.7 ms. Decodes (slices of up to 4 tokens) run in the op's position tiles in the AVX-512 build
(16 context positions in the vector lanes, the GQA group's rows sharing each key row; bf16 pair dot products for a
bf16 cache and a bf16 model's queries). Why: their per-score horizontal sums and scalar softmax dominated; one
layer, best of 15, 08:44 UTC, `decode_attention.py --layer --variants rev=c757601,avx512,avx2`: 32 bf16 decodes at
100-200 tokens 0.194 -> 0.124 ms, 6 at 1,900 0.477 -> 0.270 ms (float32 decodes unchanged on Zen 4).
`PACELINE_ATTN_ISA=avx2` forces the AVX2 build (attention_kernel.py). On a CPU with AMX bf16 tiles a bf16 step's
prompt chunks of SDPA_PREFILL_FROM_PAIRS+ causal query-key pairs run the AMX op (or torch's SDPA) instead and its
decodes the op (`prefill_sdpa`, below).

The eager path:

The flat batch is laid out as: every multi-token chunk first (prompt chunks), then every single-token
sequence (decodes, or a prompt chunk of one token). All index tensors are built once per step in
`build_metadata`; each layer then does a fixed handful of ops whatever the batch holds:

- write: one `index_copy_` of this step's K and one of V into their slots;
- decodes: one `index_select` gathers a group of decodes' contexts, whole blocks from a padded `[B, nblocks]` index,
  then one SDPA call. GQA costs no copy: the query heads sharing a KV head become that head's query rows
  (`[B, kv_heads, group, head_dim]`), so SDPA sees plain multi-head attention with `group` queries. Decodes whose
  contexts differ a lot go in separate groups (`group_decodes`), so a short one is not padded to a long one.
- prompt chunks: one chunk that starts at position 0 (the common prefill) attends to its own fresh K/V with
  `is_causal=True`, which lets the CPU flash kernel skip the masked half. Otherwise the chunks are padded to
  `[B, Qmax]` and their contexts gathered like decodes, with one boolean mask (causal, offset by each
  chunk's start), in one SDPA call.

Why padded-gather + SDPA rather than one flat varlen pass: on CPU there is no varlen kernel, and a flat
block-diagonal mask over all requests costs T x sum(context) work; padding wastes only Lmax - L per sequence,
and grouping decodes by length keeps that waste below what one more group of ops per layer costs.

The gathers write into a GatherWorkspace the runner keeps: a fresh multi-MiB tensor per layer is fresh mmap'd
memory on CPU, faulted in page by page at every gather (below).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
import torch.nn.functional as F

from paceline.model import amx_attention_kernel, attention_kernel, int4_kernel


@dataclass
class SeqSlice:
    """One request's part of the flat batch: tokens start..start+num_tokens-1 through its block table."""
    start: int
    num_tokens: int
    block_table: list[int]


@dataclass
class AttnMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot of each flat token, where its K/V are written
    num_prefill_tokens: int  # flat rows [0, Tp) are multi-token chunks, [Tp, T) single tokens
    # prompt chunks
    num_prefills: int = 0
    prefill_fresh: bool = False  # one chunk starting at 0: attend to its own K/V, causal
    prefill_starts: list[int] = field(default_factory=list)  # each chunk's first position
    prefill_lens: list[int] = field(default_factory=list)  # each chunk's tokens
    prefill_q_index: torch.Tensor | None = None  # [Bp * Qmax] flat row per padded query (None: Bp == 1)
    prefill_out_index: torch.Tensor | None = None  # [Tp] padded row of each real query (None: Bp == 1)
    prefill_kv_index: torch.Tensor | None = None  # [Bp * Lmax / block_size] blocks of each chunk's context
    prefill_mask: torch.Tensor | None = None  # [Bp, 1, Qmax, Lmax] True where a query may look
    prefill_q_max: int = 0
    prefill_kv_max: int = 0
    # where the prompt chunks' gathers write: (K, V) views of a GatherWorkspace, or None to allocate per layer
    prefill_kv_out: tuple[torch.Tensor, torch.Tensor] | None = None
    # single tokens, in consecutive groups
    num_decodes: int = 0
    decode_groups: list["DecodeGroup"] = field(default_factory=list)
    # the C++ op (attention_kernel.py), when it runs this step: the whole batch in one call per layer
    kernel: Callable | None = None
    kernel_tables: torch.Tensor | None = None  # [S, max_blocks] int32 block table of every sequence
    kernel_seqs: torch.Tensor | None = None  # [S, 3] int32: first flat row, tokens, position of the first token
    # AMX (prefill_sdpa): the prompt chunks run SDPA (the fields above the decodes') and the op the decodes only,
    # from these tables (rows counted from the first decode); a float32 step still runs the op on everything
    sdpa_prefill: bool = False
    kernel_decode_tables: torch.Tensor | None = None
    kernel_decode_seqs: torch.Tensor | None = None


@dataclass
class DecodeGroup:
    """Consecutive single-token rows that attend in one SDPA call, their contexts padded to the longest."""
    num_decodes: int
    kv_index: torch.Tensor  # [B * Lmax / block_size] blocks of each decode's context
    kv_max: int  # Lmax
    mask: torch.Tensor | None  # [B, 1, 1, Lmax] (None when no padding is needed)
    kv_out: tuple[torch.Tensor, torch.Tensor] | None = None  # where the gathers write


# One more decode group costs every layer two gathers and an SDPA call more; a padded context position costs a
# gather row and a masked key. One-off timings here (2 cores, SmolLM2-135M fp32): a group ~0.5-1 ms a step, a padded
# position ~3.4 us, so a split pays when it removes more than ~300 padded positions. Groups are also kept to a
# few MiB of gathered K/V, which SDPA then reads while still in cache: at most 8 MiB a group beat one group on
# every uniform batch tried (16 decodes at 1,000 tokens 134 -> 120 ms, 32 at 500 159 -> 128 ms) and mixed
# batches gain most (16 at 100..1,900 tokens 195 -> 96 ms): `benchmarks/decode_attention.py`.
GROUP_COST_POSITIONS = 300
GROUP_MAX_BYTES = 8 << 20
# On a CPU with AMX tiles for bf16, torch's SDPA (flash, bf16 GEMMs through oneDNN on the tiles) outruns the op's
# AVX512-BF16 row tiles on long prompt chunks, while the op stays ahead on decodes and short chunks. One layer, bf16,
# best of 15 (`benchmarks/decode_attention.py --layer --variants eager,auto --dtypes bfloat16`, Intel Xeon with AMX,
# 2026-11-25 07:20 UTC, ms, SDPA / op): a fresh 512-token prompt 0.957 / 1.745, a 512-token chunk at 1,000 3.077 /
# 7.424, 1,500 whole 5.346 / 13.588, a 64-token chunk at 1,000 + 6 decodes 0.966 / 0.934, 32 decodes 0.508 / 0.171.
# So a bf16 step whose prompt chunks hold enough causal query-key pairs runs them through SDPA and its decodes
# through the op. (Since, _prefill_attention runs such chunks on paceline's own AMX op where it builds,
# amx_attention_kernel.py, faster again than SDPA.) The bar is a fresh 256-token prompt's pairs: until 2026-11-25 it
# was 256 prompt rows, which left a chunk deep in its context on the op: a 157-token chunk after 400 cached tokens
# beside 32 decodes took 1.76 ms a layer there against 0.26 on the tiles (the step 94.1 -> 85.1 ms; a 64-token
# chunk at 512 beside 6 decodes 44.8 -> 41.3), the steps of an overloaded chat server. Why pairs and not rows: a
# prompt's last r tokens after a cached prefix hold at most the pairs of the whole prompt (r (n - r/2) <= n^2 / 2),
# so a prompt below the bar, whole or after any cached prefix, runs on the op either way and its logits do not
# depend on the cache (a seeded n=2 chat sample repeats), as under the row rule; fresh short chunks (the 32-stream
# probe's) stay on the op, where the C++ layer loop serves the step.
SDPA_PREFILL_FROM_PAIRS = 256 * 257 // 2


def causal_pairs(slices: Iterable[tuple[int, int]]) -> int:
    """Query-key pairs of prompt chunks [(start, num_tokens), ...] under the causal mask."""
    return sum(n * s + n * (n + 1) // 2 for s, n in slices)


def prefill_sdpa(prompt_pairs: int) -> bool:
    """Whether a step whose prompt chunks hold `prompt_pairs` causal query-key pairs runs them through SDPA or the
    AMX op beside the paged-attention op's decodes (AMX only; PACELINE_ATTN_SDPA_PREFILL=0 keeps the op on every
    row, =1 forces it wherever there are prompt rows, for tests)."""
    env = os.environ.get("PACELINE_ATTN_SDPA_PREFILL", "")
    if env == "0" or prompt_pairs == 0:
        return False
    if env == "1":
        return True
    return prompt_pairs >= SDPA_PREFILL_FROM_PAIRS and "amx_bf16" in int4_kernel.cpu_flags()


def group_decodes(lengths: list[int], group_cost: int = GROUP_COST_POSITIONS, max_positions: int = 1 << 62) -> list[int]:
    """Sizes of consecutive groups that minimise sum(group_cost + size * longest) over the groups (what decode
    attention reads, padding included, plus a per-group charge), no group over max_positions padded positions
    unless it is one decode. Optimal partitions for lengths sorted ascending."""
    n = len(lengths)
    if n * max(lengths) <= max_positions and n * max(lengths) - sum(lengths) <= group_cost:
        return [n]
    best = [0.0] * (n + 1)  # best[j]: cost of the first j decodes
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        longest, best[j] = 0, float("inf")
        for i in range(j - 1, -1, -1):  # group i..j-1
            longest = max(longest, lengths[i])
            if (j - i) * longest > max_positions and j - i > 1:
                break
            c = best[i] + group_cost + (j - i) * longest
            if c < best[j]:
                best[j], cut[j] = c, i
    sizes = []
    j = n
    while j:
        sizes.append(j - cut[j])
        j = cut[j]
    return sizes[::-1]


class GatherWorkspace:
    """Memory reused by every layer's K/V gathers, grown when a step needs more.

    Why: glibc can serve an allocation of a few MiB from fresh mmap'd pages and give them back on free, so a new
    gather output per layer paid a page fault per 4 KiB, in every layer of every step, depending on the allocator's
    state. 6 decodes at 1,900 tokens of context: 296 ms a step with 127,560 minor faults, 76 ms with this
    (`benchmarks/decode_attention.py`). On CUDA the caching allocator already reuses memory; this costs nothing there.
    """

    def __init__(self, row_elems: int, dtype: torch.dtype, device: torch.device | str):
        self.row_elems = row_elems
        self.buffer = torch.empty(0, dtype=dtype, device=device)

    def bytes_per_position(self, block_size: int) -> int:
        """Bytes one context position takes once gathered, K and V."""
        return 2 * self.row_elems // block_size * self.buffer.element_size()

    def views(self, *rows: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(K, V) buffers of rows[i] block rows each, not overlapping, valid until the next call."""
        need = 2 * sum(rows) * self.row_elems
        if self.buffer.numel() < need:
            self.buffer = torch.empty(need, dtype=self.buffer.dtype, device=self.buffer.device)
        out, at = [], 0
        for r in rows:
            n = r * self.row_elems
            k = self.buffer[at:at + n].view(r, self.row_elems)
            v = self.buffer[at + n:at + 2 * n].view(r, self.row_elems)
            out.append((k, v))
            at += 2 * n
        return out


def _blocks(block_tables: list[list[int]], lengths: list[int], block_size: int, device) -> tuple[torch.Tensor, int]:
    """[B * nblocks] block ids covering positions 0..Lpad-1 of each sequence (Lpad = nblocks * block_size).

    Gathering whole blocks (rows of block_size * kv_heads * head_dim) copies ~1.5x faster than gathering slots;
    positions past a sequence's length are masked. Padding entries point at block 0, which is always valid.
    """
    nblocks = (max(lengths) + block_size - 1) // block_size
    table = [bt[:nblocks] + [0] * (nblocks - len(bt[:nblocks])) for bt in block_tables]
    return torch.tensor(table, dtype=torch.long).reshape(-1).to(device, non_blocking=True), nblocks * block_size


def build_metadata(seqs: list[SeqSlice], block_size: int, device: torch.device | str = "cpu",
                   workspace: GatherWorkspace | None = None, kernel: bool | None = None) -> AttnMetadata:
    """Index tensors for one step. `seqs` must list every multi-token chunk before any single-token one.

    kernel: run attention with the C++ op (True; a ValueError if it cannot be built here), with gathers + SDPA
    (False), or the op wherever it is available: CPU, a compiler, not switched off (None)."""
    if not seqs:
        raise ValueError("a step needs at least one sequence")
    for s in seqs:
        if s.num_tokens < 1:
            raise ValueError(f"a scheduled slice needs at least one token, got {s.num_tokens}")
        if len(s.block_table) * block_size < s.start + s.num_tokens:
            raise ValueError(f"block table of {len(s.block_table)} blocks cannot hold {s.start + s.num_tokens} tokens")
    prefills = [s for s in seqs if s.num_tokens > 1]
    decodes = seqs[len(prefills):]
    if any(s.num_tokens > 1 for s in decodes):
        raise ValueError("multi-token chunks must come before single-token sequences in the flat batch")

    # plain Python ints: cheaper than a few tiny tensor ops per sequence when the batch is mostly decodes
    bs = block_size
    slots = [s.block_table[p // bs] * bs + p % bs for s in seqs for p in range(s.start, s.start + s.num_tokens)]
    slot_mapping = torch.tensor(slots, dtype=torch.long)
    tp = sum(s.num_tokens for s in prefills)
    meta = AttnMetadata(slot_mapping=slot_mapping.to(device, non_blocking=True), num_prefill_tokens=tp)

    op = attention_kernel.load() if kernel is not False and torch.device(device).type == "cpu" else None
    if kernel and op is None:
        raise ValueError("the C++ paged-attention kernel is not available here (CPU only; see the log for why)")
    if op is not None:
        nblocks = max(-(-(s.start + s.num_tokens) // bs) for s in seqs)
        meta.kernel = op
        meta.kernel_tables = torch.tensor([s.block_table[:nblocks] + [0] * (nblocks - len(s.block_table[:nblocks]))
                                           for s in seqs], dtype=torch.int32)
        rows, row = [], 0
        for s in seqs:
            rows.append((row, s.num_tokens, s.start))
            row += s.num_tokens
        meta.kernel_seqs = torch.tensor(rows, dtype=torch.int32)
        meta.num_prefills, meta.num_decodes = len(prefills), len(decodes)
        if prefill_sdpa(causal_pairs((s.start, s.num_tokens) for s in prefills)):
            meta.sdpa_prefill = True
            _prefill_fields(meta, prefills, block_size, device)
            if meta.prefill_kv_index is not None and workspace is not None:
                meta.prefill_kv_out = workspace.views(len(meta.prefill_kv_index))[0]
            if decodes:
                meta.kernel_decode_tables = meta.kernel_tables[len(prefills):]
                meta.kernel_decode_seqs = torch.tensor([(i, 1, s.start) for i, s in enumerate(decodes)],
                                                       dtype=torch.int32)
        return meta

    if prefills:
        _prefill_fields(meta, prefills, block_size, device)

    if decodes:
        meta.num_decodes = len(decodes)
        lengths = [s.start + 1 for s in decodes]
        first = 0
        cap = 1 << 62 if workspace is None else GROUP_MAX_BYTES // workspace.bytes_per_position(bs)
        for n in group_decodes([-(-length // bs) * bs for length in lengths], GROUP_COST_POSITIONS, cap):
            group_lengths = lengths[first:first + n]
            kv_index, lmax = _blocks([s.block_table for s in decodes[first:first + n]], group_lengths, bs, device)
            mask = None
            if min(group_lengths) != lmax:
                mask = (torch.arange(lmax)[None, :] < torch.tensor(group_lengths)[:, None])[:, None, None, :]
                mask = mask.to(device, non_blocking=True)
            meta.decode_groups.append(DecodeGroup(n, kv_index, lmax, mask))
            first += n
    if workspace is not None:
        p_rows = 0 if meta.prefill_kv_index is None else len(meta.prefill_kv_index)
        outs = workspace.views(p_rows, *(len(g.kv_index) for g in meta.decode_groups))
        meta.prefill_kv_out = outs[0] if p_rows else None
        for g, out in zip(meta.decode_groups, outs[1:]):
            g.kv_out = out
    return meta


def _prefill_fields(meta: AttnMetadata, prefills: list[SeqSlice], block_size: int, device) -> None:
    """The SDPA path's fields for the prompt chunks: one fresh chunk attends to its own K/V (causal), else
    padded queries over gathered contexts with a mask."""
    meta.num_prefills = len(prefills)
    meta.prefill_starts = [s.start for s in prefills]
    meta.prefill_lens = [s.num_tokens for s in prefills]
    if len(prefills) == 1 and prefills[0].start == 0:
        meta.prefill_fresh = True
        return
    qlens = [s.num_tokens for s in prefills]
    starts = torch.tensor([s.start for s in prefills])
    qmax = max(qlens)
    kv_index, lmax = _blocks([s.block_table for s in prefills], [s.start + s.num_tokens for s in prefills],
                             block_size, device)
    qpos = starts[:, None] + torch.arange(qmax)[None, :]  # [Bp, Qmax] position of each padded query
    mask = torch.arange(lmax)[None, None, :] <= qpos[:, :, None]
    meta.prefill_kv_index, meta.prefill_kv_max, meta.prefill_q_max = kv_index, lmax, qmax
    meta.prefill_mask = mask[:, None].to(device, non_blocking=True)
    if len(prefills) > 1:
        lens = torch.tensor(qlens)
        first_row = torch.cumsum(lens, 0) - lens
        i = torch.arange(qmax)[None, :]
        # padded queries repeat the chunk's last row; their outputs are dropped
        meta.prefill_q_index = (first_row[:, None] + torch.minimum(i, lens[:, None] - 1)).reshape(-1).to(device)
        valid = (i < lens[:, None]).reshape(-1)
        meta.prefill_out_index = torch.nonzero(valid).squeeze(1).to(device)


def _gather(blocks: torch.Tensor, index: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    return blocks.index_select(0, index) if out is None else torch.index_select(blocks, 0, index, out=out)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor) -> None:
    """K/V rows [T, KVH, D] into their cache slots [T] (a step's meta.slot_mapping, or its first rows'), in the
    cache's dtype (a float32 step of a bfloat16 model, LlamaModel.wide_above, stores bfloat16). 2-D views:
    index_copy_ over whole rows takes the memcpy fast path (3-D ones do not)."""
    t, kvh, d = k.shape
    k_cache.view(-1, kvh * d).index_copy_(0, slots, k.reshape(t, kvh * d).to(k_cache.dtype))
    v_cache.view(-1, kvh * d).index_copy_(0, slots, v.reshape(t, kvh * d).to(v_cache.dtype))


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttnMetadata, scale: float) -> torch.Tensor:
    """q [T, H, D], k/v [T, KVH, D] for this step's tokens; caches [num_blocks, block_size, KVH, D] -> [T, H*D].

    Writes this step's K/V into the cache first, then each token attends to its request's context.
    """
    t, h, d = q.shape
    kvh = k.shape[1]
    if meta.kernel is not None and meta.sdpa_prefill and q.dtype == torch.bfloat16:
        return _sdpa_prefill_op_decodes(q, k, v, k_cache, v_cache, meta, scale)
    # 2-D views: index_select/index_copy_ over whole rows take the memcpy fast path (3-D ones do not)
    if meta.kernel is not None:
        # one call: writes this step's K/V into their slots, then attends (float32 or bfloat16 queries, the output
        # in their dtype; row views of qkv are fine, the op takes any row stride)
        o = meta.kernel(q if q.dtype in (torch.float32, torch.bfloat16) else q.float(), k, v, k_cache, v_cache,
                        meta.slot_mapping, meta.kernel_tables, meta.kernel_seqs, scale)
        return o.view(t, h * d).to(q.dtype)
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    k_blocks = k_cache.view(k_cache.shape[0], -1)
    v_blocks = v_cache.view(v_cache.shape[0], -1)

    tp = meta.num_prefill_tokens
    outs = []
    if meta.num_prefills:
        outs.append(_prefill_attention(q, k, v, k_blocks, v_blocks, meta, scale))
    row = tp
    for g in meta.decode_groups:
        bd, lmax = g.num_decodes, g.kv_max
        k_out, v_out = g.kv_out or (None, None)
        kc = _gather(k_blocks, g.kv_index, k_out).view(bd, lmax, kvh, d).transpose(1, 2).to(q.dtype)
        vc = _gather(v_blocks, g.kv_index, v_out).view(bd, lmax, kvh, d).transpose(1, 2).to(q.dtype)
        # query heads h = kv_head * group + g, so [bd, H, D] is already [bd, kv_heads, group, D]
        qd = q[row:row + bd].reshape(bd, kvh, h // kvh, d)
        o = F.scaled_dot_product_attention(qd, kc, vc, attn_mask=g.mask, scale=scale)
        outs.append(o.reshape(bd, h * d))
        row += bd
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_blocks: torch.Tensor,
                       v_blocks: torch.Tensor, meta: AttnMetadata, scale: float) -> torch.Tensor:
    """The prompt chunks' rows [0, Tp) through SDPA, or the AMX op where it runs (their K/V already in the
    cache) -> [Tp, H*D]."""
    t, h, d = q.shape
    kvh = k.shape[1]
    tp = meta.num_prefill_tokens
    amx = _amx_op(q, h, kvh, d)
    if meta.prefill_fresh:
        if amx is not None:
            return amx(q[:tp], k[:tp], v[:tp], 0, scale).view(tp, h * d)
        # 4-D on purpose: CPU's flash kernel rejects 3-D inputs and SDPA would fall back to the T x T math path
        o = F.scaled_dot_product_attention(q[:tp].transpose(0, 1)[None], k[:tp].transpose(0, 1)[None],
                                           v[:tp].transpose(0, 1)[None], is_causal=True, scale=scale,
                                           enable_gqa=True)
        return o[0].transpose(0, 1).reshape(tp, h * d)
    bp, qmax, lmax = meta.num_prefills, meta.prefill_q_max, meta.prefill_kv_max
    k_out, v_out = meta.prefill_kv_out or (None, None)
    kc = _gather(k_blocks, meta.prefill_kv_index, k_out).view(bp, lmax, kvh, d).to(q.dtype)
    vc = _gather(v_blocks, meta.prefill_kv_index, v_out).view(bp, lmax, kvh, d).to(q.dtype)
    if amx is not None:  # one call per chunk over its gathered context: no padded queries, no mask
        outs, row = [], 0
        for i, (start, n) in enumerate(zip(meta.prefill_starts, meta.prefill_lens)):
            outs.append(amx(q[row:row + n], kc[i], vc[i], start, scale).view(n, h * d))
            row += n
        return outs[0] if bp == 1 else torch.cat(outs)
    qp = q[:tp] if meta.prefill_q_index is None else q.index_select(0, meta.prefill_q_index)
    o = F.scaled_dot_product_attention(qp.view(bp, qmax, h, d).transpose(1, 2), kc.transpose(1, 2),
                                       vc.transpose(1, 2), attn_mask=meta.prefill_mask, scale=scale,
                                       enable_gqa=True)
    o = o.transpose(1, 2).reshape(bp * qmax, h * d)
    return o if meta.prefill_out_index is None else o.index_select(0, meta.prefill_out_index)


def _amx_op(q: torch.Tensor, heads: int, kv_heads: int, head_dim: int) -> Callable | None:
    """The AMX attention op for bfloat16 prompt rows on a CPU with the tiles (amx_attention_kernel.py), else None."""
    if q.dtype != torch.bfloat16 or q.device.type != "cpu" or not amx_attention_kernel.supports(head_dim, heads,
                                                                                                 kv_heads):
        return None
    return amx_attention_kernel.load()


def _sdpa_prefill_op_decodes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                             v_cache: torch.Tensor, meta: AttnMetadata, scale: float) -> torch.Tensor:
    """AMX, a bf16 step with long prompt chunks (prefill_sdpa): the chunks through _prefill_attention (the AMX
    op, or SDPA), the decodes through the op (which writes their K/V itself)."""
    t, h, d = q.shape
    tp = meta.num_prefill_tokens
    write_kv(k[:tp], v[:tp], k_cache, v_cache, meta.slot_mapping[:tp])  # the prompt rows' (the op writes the decodes')
    o = _prefill_attention(q, k, v, k_cache.view(k_cache.shape[0], -1), v_cache.view(v_cache.shape[0], -1),
                           meta, scale)
    if t == tp:
        return o
    od = meta.kernel(q[tp:], k[tp:], v[tp:], k_cache, v_cache, meta.slot_mapping[tp:],
                     meta.kernel_decode_tables, meta.kernel_decode_seqs, scale)
    return torch.cat([o, od.view(t - tp, h * d).to(q.dtype)])


def dense_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """Plain causal attention of one request's queries (positions start..) over its whole context k/v [L, KVH, D].

    Used by the tests as the reference the paged path must match.
    """
    t, h, d = q.shape
    group = h // k.shape[1]
    kk = k.repeat_interleave(group, 1).transpose(0, 1).float()  # [H, L, D]
    vv = v.repeat_interleave(group, 1).transpose(0, 1).float()
    scores = torch.matmul(q.transpose(0, 1).float(), kk.transpose(1, 2)) * scale  # [H, T, L]
    pos = torch.arange(start, start + t)[:, None]
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > pos, float("-inf"))
    return torch.matmul(torch.softmax(scores, -1), vv).transpose(0, 1).reshape(t, h * d).to(q.dtype)
