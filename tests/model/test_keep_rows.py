"""A step whose logits come from a few of its rows runs its last layer past the K/V for those rows only
(ModelRunner.keep_rows, LlamaModel.forward_layers' keep): the same KV cache bit for bit, the same logits within
float rounding (the kept rows attend as one-token slices), and every other step as before."""
from __future__ import annotations

import pytest
import torch

from paceline.engine import runner as runner_module
from paceline.model.attention import SeqSlice


def _prompt_step(tiny, hf_llama, dtype, keep: str, monkeypatch):
    """Two prompts in one step (300 and 120 tokens, the second a chunk after 40 cached tokens) and two decodes;
    logits of each prompt's last row and of the decodes, and the cache after it."""
    monkeypatch.setenv("PACELINE_KEEP_ROWS", keep)
    r = tiny.make_runner(hf_llama, num_blocks=160, block_size=4, dtype=dtype)
    r.kv_cache.normal_(generator=torch.Generator().manual_seed(0))  # earlier context for the chunk and decodes
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 96, (300 + 120 + 2,), generator=g).tolist()
    seqs = [SeqSlice(0, 300, list(range(0, 75))), SeqSlice(40, 120, list(range(75, 115))),
            SeqSlice(57, 1, list(range(115, 130))), SeqSlice(9, 1, list(range(130, 133)))]
    positions = list(range(300)) + list(range(40, 160)) + [57, 9]
    rows = [299, 419, 420, 421]
    assert (r.keep_rows(seqs, rows, len(ids)) is not None) == (keep == "1")
    logits = r.forward_tokens(ids, positions, seqs, rows)
    return logits, r.kv_cache.clone()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kept_rows_give_the_cache_bits_and_close_logits(tiny, hf_llama, monkeypatch, dtype):
    full, cache_full = _prompt_step(tiny, hf_llama, dtype, "0", monkeypatch)
    kept, cache_kept = _prompt_step(tiny, hf_llama, dtype, "1", monkeypatch)
    assert torch.equal(cache_kept, cache_full)  # every row's K/V, the last layer's included
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(kept, full, atol=tol, rtol=0)


def test_only_steps_that_leave_out_many_rows_keep(runner):
    seqs = [SeqSlice(0, 300, list(range(75)))]
    assert runner.keep_rows(seqs, [299], 300) is not None
    assert runner.keep_rows(seqs, list(range(300)), 300) is None  # prompt logprobs: every row feeds logits
    rows, meta = runner.keep_rows(seqs, [], 300)  # a chunk that samples nothing: the last layer's K/V only
    assert rows.numel() == 0 and meta is None
    short = [SeqSlice(0, runner_module.KEEP_FROM_ROWS, list(range(75)))]
    assert runner.keep_rows(short, [runner_module.KEEP_FROM_ROWS - 1], runner_module.KEEP_FROM_ROWS) is None
    decodes = [SeqSlice(10, 1, [0, 1, 2])] * 40
    assert runner.keep_rows(decodes, list(range(40)), 40) is None


def test_a_chunk_that_samples_nothing_writes_every_layers_kv(tiny, hf_llama, monkeypatch):
    """The first 280 tokens of a prompt as a chunk of their own (no row feeds logits), then its last 20: the cache
    and the last row's logits as with the last layer run whole."""
    out = {}
    for keep in ("0", "1"):
        monkeypatch.setenv("PACELINE_KEEP_ROWS", keep)
        r = tiny.make_runner(hf_llama, num_blocks=80, block_size=4)
        ids = torch.randint(0, 96, (300,), generator=torch.Generator().manual_seed(2)).tolist()
        table = list(range(75))
        assert r.forward_tokens(ids[:280], list(range(280)), [SeqSlice(0, 280, table)], []).shape[0] == 0
        cache = r.kv_cache.clone()
        out[keep] = cache, r.forward_tokens(ids[280:], list(range(280, 300)), [SeqSlice(280, 20, table)], [19])
    assert torch.equal(out["1"][0], out["0"][0])
    assert torch.equal(out["1"][1], out["0"][1])
