"""The AMX attention op (amx_attention_kernel.py) against a float32 dense reference, alone and inside a step."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from paceline.model import amx_attention_kernel

pytestmark = pytest.mark.skipif(amx_attention_kernel.load() is None, reason="this CPU has no AMX bf16 tiles")


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    t, s = q.shape[0], start + q.shape[0]
    mask = torch.ones(t, s, dtype=torch.bool).tril(start)
    o = F.scaled_dot_product_attention(q.float().transpose(0, 1)[None], k[:s].float().transpose(0, 1)[None],
                                       v[:s].float().transpose(0, 1)[None], attn_mask=mask, scale=scale,
                                       enable_gqa=True)
    return o[0].transpose(0, 1)


@pytest.mark.parametrize("t,start,h,kvh,d", [(1500, 0, 9, 3, 64), (37, 0, 9, 3, 64), (100, 412, 9, 3, 64),
                                             (1, 63, 9, 3, 64), (50, 0, 4, 4, 32), (16, 5, 8, 1, 64),
                                             (200, 31, 16, 2, 64)])
def test_matches_dense_reference(t, start, h, kvh, d):
    g = torch.Generator().manual_seed(t + start)
    qkv = torch.randn(t, h + 2 * kvh, d, generator=g).to(torch.bfloat16)
    q = qkv[:, :h]  # rows strided as a fused projection's output is
    k = torch.randn(start + t + 7, kvh, d, generator=g).to(torch.bfloat16)  # keys past the chunk are ignored
    v = torch.randn(start + t + 7, kvh, d, generator=g).to(torch.bfloat16)
    out = amx_attention_kernel.load()(q, k, v, start, d ** -0.5)
    assert out.dtype == torch.bfloat16 and out.shape == (t, h, d)
    # the output's bfloat16 rounding (~4e-3 at magnitude 1) and P's dominate the error
    torch.testing.assert_close(out.float(), _reference(q, k, v, start, d ** -0.5), atol=1.2e-2, rtol=1e-2)


def test_large_scores_stay_finite():
    """Scores far from 0 (a softmax without its max subtracted would overflow): rows stay finite and exact."""
    g = torch.Generator().manual_seed(1)
    q = (torch.randn(40, 3, 64, generator=g) * 30).to(torch.bfloat16)
    k = (torch.randn(40, 1, 64, generator=g) * 30).to(torch.bfloat16)
    v = torch.randn(40, 1, 64, generator=g).to(torch.bfloat16)
    out = amx_attention_kernel.load()(q, k, v, 0, 0.125)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), _reference(q, k, v, 0, 0.125), atol=1.2e-2, rtol=1e-2)


def test_bad_input_is_a_clear_error():
    op = amx_attention_kernel.load()
    q = torch.zeros(4, 3, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="bfloat16"):
        op(q.float(), q[:, :1].float(), q[:, :1].float(), 0, 1.0)
    with pytest.raises(RuntimeError, match="too few keys"):
        op(q, q[:, :1], q[:, :1], 2, 1.0)
    with pytest.raises(RuntimeError, match="head_dim"):
        op(torch.zeros(4, 3, 48, dtype=torch.bfloat16), torch.zeros(4, 1, 48, dtype=torch.bfloat16),
           torch.zeros(4, 1, 48, dtype=torch.bfloat16), 0, 1.0)


def test_supports():
    assert amx_attention_kernel.supports(64, 9, 3) and amx_attention_kernel.supports(32, 8, 1)
    assert not amx_attention_kernel.supports(128, 9, 3) and not amx_attention_kernel.supports(64, 18, 1)
