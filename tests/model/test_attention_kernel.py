"""The C++ paged-attention op inside whole models: the same logits as the eager gathers + SDPA path."""
from __future__ import annotations

import pytest
import torch

from paceline.engine.runner import ModelRunner
from paceline.model import attention_kernel
from paceline.model.attention import SeqSlice
from paceline.model.llama import LlamaModel

pytestmark = pytest.mark.skipif(attention_kernel.load() is None, reason="the C++ attention kernel cannot be built here")


def _mixed_step(runner: ModelRunner, prompts: list[list[int]], split: int) -> torch.Tensor:
    """Each prompt's first `split` tokens in one step (one fresh chunk each), then a step of one more chunk of the
    first prompt next to one-token decodes of the others; the last-row logits of that second step."""
    bs = runner.block_size
    tables = []
    first = 0
    for p in prompts:
        tables.append(list(range(first, first + -(-len(p) // bs))))
        first += len(tables[-1])
    for p, t in zip(prompts, tables):
        runner.forward_tokens(p[:split], list(range(split)), [SeqSlice(0, split, t)], [split - 1])
    ids, pos, seqs, rows = list(prompts[0][split:]), list(range(split, len(prompts[0]))), [], []
    seqs.append(SeqSlice(split, len(prompts[0]) - split, tables[0]))
    rows.append(len(ids) - 1)
    for p, t in zip(prompts[1:], tables[1:]):
        ids.append(p[split])
        pos.append(split)
        seqs.append(SeqSlice(split, 1, t))
        rows.append(len(ids) - 1)
    return runner.forward_tokens(ids, pos, seqs, rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiny_model_kernel_matches_eager(tiny, hf_llama, monkeypatch, dtype):
    prompts = [torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (90, 40, 75)]
    got = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("PACELINE_ATTN_KERNEL", flag)
        got[flag] = _mixed_step(tiny.make_runner(hf_llama, num_blocks=64, block_size=4, dtype=dtype), prompts, 30)
    # bf16: the two paths sum in different orders and every layer rounds its hidden state to bf16, so the gap grows
    # with depth. Where the CPU has native bf16 math every step runs in bf16 (2026-11-24, AVX512_BF16: up to 0.043
    # on logits of magnitude ~1); elsewhere steps of 9+ rows run in float32, which hid most of it (within 0.03).
    tol = 1e-4 if dtype == torch.float32 else 6e-2
    torch.testing.assert_close(got["1"], got["0"], atol=tol, rtol=0)


def test_bundled_model_kernel_matches_eager(monkeypatch):
    from paceline.model.loader import load_checkpoint

    ckpt = load_checkpoint(None, "float32")
    text = ("The history of the printing press begins in East Asia, where woodblock printing spread long before "
            "movable type reached Europe. In the fifteenth century")
    ids = ckpt.tokenizer.encode(text)
    prompts = [ids, ids[::-1], ids[5:] + ids[:5]]
    model = LlamaModel.from_weights(ckpt.arch, ckpt.weights)
    got = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("PACELINE_ATTN_KERNEL", flag)
        got[flag] = _mixed_step(ModelRunner(model, ckpt.arch, 16, 16), prompts, 20)
    torch.testing.assert_close(got["1"], got["0"], atol=2e-3, rtol=0)
    assert (got["1"].argmax(-1) == got["0"].argmax(-1)).all()


# ---- decodes (slices of up to 4 tokens) in position tiles: the op against a dense reference ----

# the op's builds: this CPU's best (AVX-512, where the decode tiles run) and the forced AVX2 one (its AVX2 loops)
BUILDS = [pytest.param(isa, marks=pytest.mark.skipif(isa not in attention_kernel.supported_isas(),
                                                     reason=f"no {isa} build here"))
          for isa in ("avx512", "avx2")]

# (earlier positions, tokens): decodes at block and 16-position tile boundaries (15/16/17, 31/32/33), a first token
# (no context), long contexts, 2-4 token verifications (causal inside the slice, across a tile edge) and a prompt
# chunk beside them (the row tiles), in one flat batch
DECODE_SHAPES = {
    "decodes": [(0, 1), (1, 1), (14, 1), (15, 1), (16, 1), (30, 1), (31, 1), (32, 1), (150, 1), (700, 1)],
    "mixed": [(40, 21), (13, 3), (30, 2), (62, 4), (0, 1), (16, 1), (199, 1)],
}


def _paged_step(shape, kvh, h, d, cache_dtype, bf16_queries, seed, first=0, bf16_tensors=False):
    """Random K/V for each slice's context and tokens (slice i's from seed + first + i), scattered over the cache's
    blocks (block size 16); q rounded to bfloat16 values where bf16_queries (what a bfloat16 model's queries are).
    bf16_tensors: q, k and v passed as bfloat16 tensors (a bfloat16 model's step).
    Returns the op's output, the per-slice references on the cache's rounded K/V, and the slices."""
    from paceline.model.attention import build_metadata, dense_attention_reference, paged_attention

    bs = 16
    nb = sum(-(-(s + n) // bs) for s, n in shape) + 2
    free = torch.randperm(nb, generator=torch.Generator().manual_seed(seed)).tolist()
    seqs, ks, vs, qs = [], [], [], []
    for i, (start, n) in enumerate(shape):
        g = torch.Generator().manual_seed(seed + first + i)
        seqs.append(SeqSlice(start, n, [free.pop() for _ in range(-(-(start + n) // bs))]))
        # an offset in the keys makes the scores large: the online softmax's rescaling between tiles matters
        ks.append((torch.randn(start + n, kvh, d, generator=g) + 2).to(cache_dtype).float())
        vs.append(torch.randn(start + n, kvh, d, generator=g).to(cache_dtype).float())
        q = torch.randn(n, h, d, generator=g)
        qs.append(q.to(torch.bfloat16).float() if bf16_queries else q)
    k_cache = torch.zeros(nb, bs, kvh, d, dtype=cache_dtype)
    v_cache = torch.zeros(nb, bs, kvh, d, dtype=cache_dtype)
    for s, k, v in zip(seqs, ks, vs):
        for p in range(s.start):
            k_cache[s.block_table[p // bs], p % bs] = k[p].to(cache_dtype)
            v_cache[s.block_table[p // bs], p % bs] = v[p].to(cache_dtype)
    q = torch.cat(qs)
    k = torch.cat([k[s.start:] for s, k in zip(seqs, ks)])
    v = torch.cat([v[s.start:] for s, v in zip(seqs, vs)])
    if bf16_tensors:
        q, k, v = q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16)
    out = paged_attention(q, k, v, k_cache, v_cache, build_metadata(seqs, bs, kernel=True), d ** -0.5)
    refs = [dense_attention_reference(qq, kk, vv, s.start, d ** -0.5) for s, kk, vv, qq in zip(seqs, ks, vs, qs)]
    return out, refs, seqs


@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bf16_queries", [False, True])
@pytest.mark.parametrize("kvh,h,d", [(3, 9, 64), (2, 8, 128), (1, 4, 32), (4, 4, 64), (1, 7, 64), (2, 6, 40)])
@pytest.mark.parametrize("name", list(DECODE_SHAPES))
def test_decodes_match_dense(monkeypatch, isa, cache_dtype, bf16_queries, kvh, h, d, name):
    """Decodes and short verifications equal the dense reference: SmolLM2's GQA (3 rows per KV head), 128- and
    32-wide heads, one row per KV head (MHA), 7 rows per KV head (groups of 4 + 3), and head_dim 40 (not taken by
    the tiles: the plain loops). float32 math throughout, except a bfloat16 cache with bfloat16 queries on
    AVX512_BF16: pair dot products, with P rounded to bfloat16 for P.V (as the prompt tiles and torch's bfloat16
    SDPA do), so within bfloat16 rounding there."""
    monkeypatch.setenv("PACELINE_ATTN_ISA", isa)
    out, refs, seqs = _paged_step(DECODE_SHAPES[name], kvh, h, d, cache_dtype, bf16_queries, seed=h + d)
    tol = 4e-3 if cache_dtype == torch.bfloat16 and bf16_queries else 2e-5
    row = 0
    for s, ref in zip(seqs, refs):
        torch.testing.assert_close(out[row:row + s.num_tokens], ref, atol=tol, rtol=tol)
        row += s.num_tokens


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_many_decodes_equal_each_decode_alone(monkeypatch, cache_dtype):
    """40 decodes run as items of all KV heads at once, a lone decode as one item per KV head: every head's
    arithmetic is the same either way, so each row is bit for bit the one the decode gets alone."""
    shape = [(int(c), 1) for c in torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(5))]
    out, refs, _ = _paged_step(shape, 3, 9, 64, cache_dtype, True, seed=11)
    for i in (0, 7, 39):
        alone, _, _ = _paged_step(shape[i:i + 1], 3, 9, 64, cache_dtype, True, seed=11, first=i)
        assert torch.equal(out[i], alone[0])
        torch.testing.assert_close(out[i], refs[i][0], atol=4e-3, rtol=4e-3)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_prompt_chunk_rows_equal_those_of_a_shorter_chunk(cache_dtype):
    """A chunk of 45 tokens over 100 earlier positions, then its first 16 tokens alone: the first work item's rows
    are the same bits. With a bfloat16 cache the long chunk's K/V are packed once for all its items (rows copied,
    values paired) while the 16-token chunk gathers and pairs them in place: the same arithmetic on other copies."""
    from paceline.model.attention import build_metadata, paged_attention

    bs, kvh, h, d, start = 16, 3, 9, 64, 100
    g = torch.Generator().manual_seed(3)
    nb = -(-(start + 45) // bs) + 2
    table = torch.randperm(nb, generator=g).tolist()[:-(-(start + 45) // bs)]
    k_cache = torch.randn(nb, bs, kvh, d, generator=g).to(cache_dtype)
    v_cache = torch.randn(nb, bs, kvh, d, generator=g).to(cache_dtype)
    q = torch.randn(45, h, d, generator=g).to(torch.bfloat16).float()
    k, v = torch.randn(45, kvh, d, generator=g), torch.randn(45, kvh, d, generator=g)
    outs = []
    for n in (45, 16):
        meta = build_metadata([SeqSlice(start, n, table)], bs, kernel=True)
        outs.append(paged_attention(q[:n], k[:n], v[:n], k_cache, v_cache, meta, d ** -0.5))
    assert torch.equal(outs[0][:16], outs[1])


@pytest.mark.parametrize("amx", ["0", "1"])
@pytest.mark.parametrize("shape", [[(0, 40), (2, 1), (50, 1)], [(30, 45), (0, 20), (5, 1), (70, 1)], [(0, 33)]])
def test_sdpa_prefill_beside_the_op_decodes(monkeypatch, shape, amx):
    """The AMX path (attention.prefill_sdpa, forced here): a bfloat16 step's prompt chunks (one fresh, or several
    over earlier context) run SDPA, or the AMX attention op where this CPU has it (amx=1), and its decodes the op.
    The chunks' rows stay within bfloat16 rounding of the dense reference; the decodes' rows are bit for bit what
    the op alone gives them."""
    monkeypatch.setenv("PACELINE_ATTN_AMX", amx)
    got = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("PACELINE_ATTN_SDPA_PREFILL", flag)
        got[flag], refs, seqs = _paged_step(shape, 3, 9, 64, torch.bfloat16, True, seed=3, bf16_tensors=True)
    tp = sum(s.num_tokens for s in seqs if s.num_tokens > 1)
    assert got["1"].dtype == torch.bfloat16 and got["1"].shape == got["0"].shape
    assert torch.equal(got["1"][tp:], got["0"][tp:])
    row = 0
    for s, ref in zip(seqs, refs):
        torch.testing.assert_close(got["1"][row:row + s.num_tokens].float().view(ref.shape), ref.float(),
                                   atol=2e-2, rtol=2e-2)
        row += s.num_tokens


def test_prefill_sdpa_only_on_amx_and_chunks_with_enough_pairs(monkeypatch):
    from paceline.model import attention, int4_kernel

    monkeypatch.delenv("PACELINE_ATTN_SDPA_PREFILL", raising=False)
    monkeypatch.setattr(int4_kernel, "cpu_flags", lambda: frozenset({"avx512f", "amx_bf16"}))
    pairs = attention.causal_pairs
    assert pairs([(0, 3)]) == 6 and pairs([(10, 2)]) == 23 and pairs([(0, 3), (10, 2)]) == 29
    assert attention.prefill_sdpa(pairs([(0, 256)])) and not attention.prefill_sdpa(pairs([(0, 255)]))
    assert attention.prefill_sdpa(pairs([(400, 157)]))  # a chunk deep in its context: on the tiles
    assert not attention.prefill_sdpa(pairs([(0, 100)] * 4)) and not attention.prefill_sdpa(0)  # fresh short ones
    # a prompt below the bar stays below it after any cached prefix: whole or not, the same op
    for n in range(2, 256):
        assert all(pairs([(n - r, r)]) <= pairs([(0, n)]) for r in range(1, n + 1))
    monkeypatch.setattr(int4_kernel, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))
    assert not attention.prefill_sdpa(10**7)
    monkeypatch.setenv("PACELINE_ATTN_SDPA_PREFILL", "1")
    assert attention.prefill_sdpa(2) and not attention.prefill_sdpa(0)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_bfloat16_queries_give_the_bits_of_the_casts_around_the_op(cache_dtype):
    """A bfloat16 model passes its queries as they are (a row view of the RoPE output) and gets a bfloat16 output:
    the same bits as widening them first and rounding the float32 output, the casts its layer made before."""
    from paceline.model.attention import build_metadata

    shape = DECODE_SHAPES["mixed"]
    bs, kvh, h, d = 16, 3, 9, 64
    nb = sum(-(-(s + n) // bs) for s, n in shape) + 2
    free = torch.randperm(nb, generator=torch.Generator().manual_seed(2)).tolist()
    seqs = [SeqSlice(s, n, [free.pop() for _ in range(-(-(s + n) // bs))]) for s, n in shape]
    t = sum(n for _, n in shape)
    g = torch.Generator().manual_seed(9)
    k_cache = torch.randn(nb, bs, kvh, d, generator=g).to(cache_dtype)
    v_cache = torch.randn(nb, bs, kvh, d, generator=g).to(cache_dtype)
    qk = torch.randn(t, h + kvh, d, generator=g).bfloat16()  # queries and keys in one tensor, as RoPE returns them
    q, k = qk[:, :h], qk[:, h:]
    v = torch.randn(t, kvh, d, generator=g).bfloat16()
    if cache_dtype == torch.float32:  # new K/V come in the cache's dtype (or float32)
        k, v = k.float(), v.float()
    meta = build_metadata(seqs, bs, kernel=True)
    run = lambda queries: meta.kernel(queries, k, v, k_cache, v_cache, meta.slot_mapping, meta.kernel_tables,
                                      meta.kernel_seqs, d ** -0.5)
    got = run(q)
    assert got.dtype == torch.bfloat16 and got.shape == (t, h, d)
    assert torch.equal(got, run(q.float()).to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        run(q.half())
