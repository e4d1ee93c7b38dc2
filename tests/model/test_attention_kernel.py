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
