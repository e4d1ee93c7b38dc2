"""The profile's hand-built batches are what a real step would look like (no model needed)."""
from paceline.sim.cost_model import batch_shape
from paceline.sim.profile import BLOCK_SIZE, GridPoint, build_output, grid


def test_grid_covers_decode_prompt_and_mixed_batches_within_the_cache():
    for quick in (True, False):
        pts = grid(quick, max_kv_tokens=12288)
        assert all(p.kv_tokens <= 12288 for p in pts)
        assert any(p.decode_contexts and not p.chunks for p in pts)
        assert any(p.chunks and not p.decode_contexts for p in pts)
        assert any(p.chunks and p.decode_contexts for p in pts)
        # sampled and unsampled chunks, or the LM-head and per-request terms could not be told apart
        assert {s for p in pts for _, _, s in p.chunks} == {True, False}


def test_build_output_matches_the_grid_point():
    p = GridPoint([(0, 100, True), (64, 40, False)], [17, 300])
    out = build_output(p, vocab_size=1000)
    a, b, d1, d2 = out.scheduled
    assert (a.start, a.num_tokens, a.needs_sample, a.is_decode) == (0, 100, True, False)
    assert (b.start, b.num_tokens, b.needs_sample) == (64, 40, False)
    assert d1.is_decode and d2.is_decode and d2.start == 299
    tables = [x.block_table for x in out.scheduled]
    assert [len(t) for t in tables] == [-(-100 // BLOCK_SIZE), -(-104 // BLOCK_SIZE), 2, -(-300 // BLOCK_SIZE)]
    flat = [blk for t in tables for blk in t]
    assert len(flat) == len(set(flat))  # no two requests share a block
    assert all(0 <= t < 1000 for x in out.scheduled for t in x.request.token_ids)
    s = batch_shape(out)
    assert (s.num_prefill_tokens, s.num_decodes, s.decode_context, s.num_sampled) == (140, 2, 317, 3)
