"""The AMX int4 matmul (int4_amx_kernel.py): the dense bf16 copy's product within rounding, row by row the same
whatever the step's other rows, and where Int4Linear runs it."""
from __future__ import annotations

import pytest
import torch

from paceline.model import int4_amx_kernel, llama
from paceline.model.llama import Int4Linear, int4_codes

pytestmark = pytest.mark.skipif(int4_amx_kernel.load() is None, reason="this CPU has no AMX bf16 tiles")


def _weights(n: int, k: int, seed: int):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    codes, scale, lo = int4_codes(w)
    dense = (lo[..., None] + codes.view(n, -1, 32) * scale[..., None]).view(n, k)  # the dense copy's float32 values
    return codes, scale, lo, dense


@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (64, 32)])
@pytest.mark.parametrize("m", [1, 16, 17, 45, 130])
def test_matches_the_dense_copy(n, k, m):
    codes, scale, lo, dense = _weights(n, k, n + k)
    bias = torch.randn(n).to(torch.bfloat16)
    x = torch.randn(m + 3, k, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)[3:]  # a strided view
    y = int4_amx_kernel.load()(x, *int4_amx_kernel.pack(codes, scale, lo), bias)
    ref = x.float() @ dense.t() + bias.float()
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    # bfloat16 weights (one rounding of the dense copy's value) and a bfloat16 output
    torch.testing.assert_close(y.float(), ref, atol=0.02 * ref.abs().max().item(), rtol=1e-2)
    # a row's result does not depend on the step's other rows
    assert torch.equal(int4_amx_kernel.load()(x[5 % m:5 % m + 1], *int4_amx_kernel.pack(codes, scale, lo), bias)[0],
                       y[5 % m])


def test_pack_rejects_shapes_it_cannot_tile():
    codes, scale, lo, _ = _weights(48, 64, 0)
    with pytest.raises(ValueError, match="multiple of 32"):
        int4_amx_kernel.pack(codes, scale, lo)


def test_int4_linear_runs_it_between_its_thresholds():
    codes_w = torch.randn(96, 64, generator=torch.Generator().manual_seed(1))
    lin = Int4Linear(codes_w, None, torch.bfloat16, bf16_from=llama.INT4_BF16_FROM_ROWS_AMX)
    assert lin.amx is not None
    assert lin.path(llama.INT4_AMX_FROM_ROWS, torch.bfloat16) == "amx"
    assert lin.path(llama.INT4_BF16_FROM_ROWS_AMX, torch.bfloat16) == "dense"
    assert lin.path(llama.INT4_AMX_FROM_ROWS - 1, torch.bfloat16) != "amx"
    # many decodes: the copy from INT4_AMX_DENSE_FROM_ROWS_DECODES rows, where oneDNN's tiles win
    many = llama.INT4_BF16_FROM_DECODES_AMX
    assert lin.path(llama.INT4_AMX_DENSE_FROM_ROWS_DECODES - 1, torch.bfloat16, many) == "amx"
    assert lin.path(llama.INT4_AMX_DENSE_FROM_ROWS_DECODES, torch.bfloat16, many) == "dense"
    assert lin.path(llama.INT4_AMX_DENSE_FROM_ROWS_DECODES, torch.bfloat16, many - 1) == "amx"
    x = torch.randn(40, 64).to(torch.bfloat16)
    torch.testing.assert_close(lin(x).float(), lin.dense(x).float(), atol=0.05, rtol=2e-2)
