"""paceline's C++ int4 matmul (int4_kernel.py): the dense dequantized product within float32 rounding, torch's int4
op within bfloat16 rounding, at any few-row shape; Int4Linear falls back to torch's op when it is switched off; the
bundled model decodes and verifies the same greedy tokens with either op."""
from __future__ import annotations

import pytest
import torch

from paceline.model import int4_kernel
from paceline.model.llama import INT4_GROUP, Int4Linear, LlamaModel, int4_codes, q4_1_grid

pytestmark = pytest.mark.skipif(int4_kernel.load() is None or not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"),
                                reason="the C++ int4 kernel (or torch's CPU int4 matmul) is not available here")


def _weight(n: int, k: int, seed: int):
    """codes, scale, zero of a random [n, k] weight, and its dequantized float64 matrix with the scales and zeros
    rounded to bfloat16 (as both ops hold them)."""
    codes, scale, lo = int4_codes(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)))
    zero = lo + 8 * scale
    s, z = scale.to(torch.bfloat16).double(), zero.to(torch.bfloat16).double()
    deq = ((codes.view(n, -1, INT4_GROUP) - 8).double() * s[..., None] + z[..., None]).view(n, k)
    return codes, scale, zero, deq


@pytest.mark.parametrize("n,k", [(1, 32), (37, 64), (77, 96), (48, 64), (160, 576)])
def test_kernel_equals_dense_reference_and_torch_op(n, k):
    op = int4_kernel.load()
    codes, scale, zero, deq = _weight(n, k, n * k)
    packed = int4_kernel.pack(codes, scale, zero)
    torch_op = n % 16 == 0  # torch's packing takes whole tiles of 16 outputs only; ours pads
    if torch_op:
        tpack = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        sz = torch.stack([scale, zero], -1).transpose(0, 1).contiguous().to(torch.bfloat16)
    g = torch.Generator().manual_seed(k)
    for m in (1, 2, 3, 5, 6, 7, 8, 13, 16):
        x = torch.randn(m, k, generator=g).to(torch.bfloat16)
        ref = x.double() @ deq.T
        # float32 in, float32 out: only float32 rounding of the sums
        got32 = op(x.float(), packed, n, None)
        assert got32.dtype == torch.float32 and got32.shape == (m, n)
        torch.testing.assert_close(got32.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
        # bfloat16 in and out: torch's op, up to the rounding of the result to bfloat16
        got = op(x, packed, n, None)
        assert got.dtype == torch.bfloat16
        if torch_op:
            want = torch.ops.aten._weight_int4pack_mm_for_cpu(x, tpack, INT4_GROUP, sz)
            torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-3 * ref.abs().max().item())
        torch.testing.assert_close(got.double(), ref, rtol=2 ** -8, atol=1e-4 * ref.abs().max().item())


@pytest.mark.parametrize("n,k", [(45, 288), (160, 576), (960, 576), (576, 1536)])
def test_bfloat16_rows_give_the_bits_of_float32_rows_rounded(n, k):
    """Few rows of bfloat16 x run on vdpbf16ps where the CPU has AVX512-BF16, float32 x on the AVX2 loop: the same
    sums in the same order, so the bfloat16 result is the float32 one rounded once, bit for bit (on a CPU without
    AVX512-BF16 both run the AVX2 loop and this holds as well)."""
    op = int4_kernel.load()
    codes, scale, zero, _ = _weight(n, k, 3 * n + k)
    packed = int4_kernel.pack(codes, scale, zero)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(k)).to(torch.bfloat16)
    g = torch.Generator().manual_seed(n)
    for m in range(1, 7):
        x = (torch.randn(m, k, generator=g) * 4).to(torch.bfloat16)
        assert torch.equal(op(x, packed, n, None), op(x.float(), packed, n, None).to(torch.bfloat16))
        assert torch.equal(op(x, packed, n, bias), op(x.float(), packed, n, bias.float()).to(torch.bfloat16))


@pytest.mark.parametrize("n,k", [(45, 288), (160, 576), (16, 1536)])
def test_both_paths_equal_the_dense_reference_at_any_rows(n, k):
    """The few-row path (codes expanded per pass of up to 6 rows) and the many-row path (each K block of a tile
    dequantized once, then a float32 GEMM micro-kernel over all rows) both give the dense product: K = 288 is 9
    groups (K blocks of 5 and 4), 1536 is 48 (6 blocks of 8); 45 outputs end in a partial tile."""
    op = int4_kernel.load()
    codes, scale, zero, deq = _weight(n, k, n + k)
    packed = int4_kernel.pack(codes, scale, zero)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(n))
    g = torch.Generator().manual_seed(k)
    for m in (1, 6, 7, 33, 100):
        x = torch.randn(m, k, generator=g)
        ref = x.double() @ deq.T + bias.double()
        tol = dict(rtol=1e-5, atol=1e-5 * ref.abs().max().item())
        few, many = op(x, packed, n, bias, 1 << 20), op(x, packed, n, bias, 0)
        torch.testing.assert_close(few.double(), ref, **tol)
        torch.testing.assert_close(many.double(), ref, **tol)
        # the default switch (few_rows=-1) picks one of the two, whichever it is at these rows
        default = op(x, packed, n, bias)
        assert torch.equal(default, few) or torch.equal(default, many)
        # bfloat16 in and out on the many-row path too: the product rounded once
        got = op(x.to(torch.bfloat16), packed, n, bias, 0)
        ref16 = x.to(torch.bfloat16).double() @ deq.T + bias.double()
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.double(), ref16, rtol=2 ** -8, atol=1e-4 * ref16.abs().max().item())


def test_bias_and_strided_input():
    op = int4_kernel.load()
    n, k = 45, 128
    codes, scale, zero, deq = _weight(n, k, 1)
    packed = int4_kernel.pack(codes, scale, zero)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(2))
    wide = torch.randn(5, 3 * k, generator=torch.Generator().manual_seed(3))
    for x in (wide[:, k: 2 * k], wide[:, ::3]):  # a row-strided slice and a column-strided view
        ref = x.double() @ deq.T + bias.double()
        torch.testing.assert_close(op(x, packed, n, bias).double(), ref, rtol=1e-5, atol=1e-4)
        # the many-row path reads float32 rows in place, with their row stride
        torch.testing.assert_close(op(x, packed, n, bias, 0).double(), ref, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(op(x, packed, n, bias.to(torch.bfloat16)).double(),
                                   x.double() @ deq.T + bias.to(torch.bfloat16).double(), rtol=1e-5, atol=1e-4)
    assert op(wide[:0, :k], packed, n, None).shape == (0, n)
    assert op(wide[:0, :k], packed, n, None, 0).shape == (0, n)


def test_bad_shapes_are_plain_errors():
    op = int4_kernel.load()
    codes, scale, zero, _ = _weight(16, 64, 4)
    packed = int4_kernel.pack(codes, scale, zero)
    with pytest.raises(ValueError, match="multiple of 32"):
        int4_kernel.pack(codes[:, :40], scale[:, :2], zero[:, :2])
    with pytest.raises(RuntimeError, match="packed"):
        op(torch.randn(2, 96), packed, 16, None)  # K does not match the packed weight
    with pytest.raises(RuntimeError, match="packed"):
        op(torch.randn(2, 64), packed, 40, None)  # n does not match
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        op(torch.randn(2, 64).half(), packed, 16, None)


def test_int4_linear_falls_back_to_torch_op_when_switched_off(monkeypatch):
    w = torch.randn(80, 3 * INT4_GROUP, generator=torch.Generator().manual_seed(5))
    bias = torch.randn(80, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    fast = Int4Linear(w, bias, torch.bfloat16)
    monkeypatch.setenv("PACELINE_INT4_KERNEL", "0")
    assert int4_kernel.load() is None
    slow = Int4Linear(w, bias, torch.bfloat16)
    assert fast.kernel is not None and slow.kernel is None
    for rows in (1, 5, Int4Linear.DENSE_ABOVE, Int4Linear.DENSE_ABOVE + 1):  # the last: the dense copy for both
        x = torch.randn(rows, 3 * INT4_GROUP, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
        a, b = fast(x).float(), slow(x).float()
        # the two differ by summation order and bfloat16 roundings (torch's op rounds y before adding the bias)
        torch.testing.assert_close(a, b, rtol=2 ** -6, atol=0.02 * b.abs().max().item())


def test_bundled_model_greedy_tokens_are_the_same_with_either_op(monkeypatch):
    """One-row decode steps (32 tokens), then a 6-row step as a verification of five proposals makes: the C++ op
    picks torch's op's greedy token wherever that token leads by more than bfloat16 noise, logits within it.

    Both ops are fed the same tokens (torch's op's greedy ones): on a CPU with native bf16 math (2026-11-24,
    AVX512_BF16) the two ops broke a near-tie at the 27th token differently, and free-running they then diverge."""
    from paceline.engine.runner import ModelRunner
    from paceline.model.attention import SeqSlice
    from paceline.model.loader import load_checkpoint

    ckpt = load_checkpoint(None, "float32")
    prompt = ckpt.tokenizer.encode("The history of the printing press begins in East Asia, where woodblock printing")
    monkeypatch.setenv("PACELINE_W4A8_LINEARS", "")  # not the int4 x int8 op (test_w4a8.py): the int4 ops alone
    ids: list[int] = []
    results = {}
    for flag in ("0", "1"):  # "0" (torch's op) chooses the tokens, "1" (the C++ op) is fed the same ones
        monkeypatch.setenv("PACELINE_INT4_KERNEL", flag)
        # int4_rows=0: the prompt's rows take the dense copy with either op (by default the C++ op serves them)
        model = LlamaModel.from_weights(ckpt.arch, ckpt.weights, dtype=torch.bfloat16, quantization="int4",
                                        int4_rows=0)
        assert (model.layers[0].qkv.kernel is None) == (flag == "0")
        runner = ModelRunner(model, ckpt.arch, 8, 16, dtype=torch.bfloat16)
        table = list(range(8))
        steps = [runner.prefill_logits(prompt)[-1]]  # many rows: the dense copy, the same for both
        for i in range(32):
            if flag == "0":
                ids.append(int(steps[-1].argmax()))
            pos = len(prompt) + i
            steps.append(runner.forward_tokens([ids[i]], [pos], [SeqSlice(pos, 1, table)], [0])[0])
        n = len(prompt) + len(ids)
        fed = ids[-1:] + ids[:5]  # the last token again, then five made-up proposals
        verify = runner.forward_tokens(fed, list(range(n - 1, n + 5)), [SeqSlice(n - 1, 6, table)], list(range(6)))
        results[flag] = torch.cat([torch.stack(steps[1:]), verify]).float()
    got, ref = results["1"], results["0"]
    torch.testing.assert_close(got, ref, rtol=0, atol=1.0)  # logits of 10-30 in bf16 steps: 0.59 seen
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 1.0  # a lead that noise within the tolerance cannot overturn
    assert clear.sum() >= 16  # 21 of the 38 positions on 2026-11-24: this text has many close calls
    assert torch.equal(got.argmax(-1)[clear], ref.argmax(-1)[clear])


@pytest.mark.parametrize("n,k", [(37, 64), (160, 576)])
def test_the_exact_layout_holds_float32_scales_and_zeros(n, k):
    """pack(exact=True): scales and zeros kept in float32 (blocks of 384 bytes, the op tells them by their size), so
    a weight that is code * scale + minimum comes back within float32 rounding of the sums, at few rows and many."""
    # scale as Q4_1's d, a float16 value: code * scale is exact in float32
    codes, scale, lo, w = q4_1_grid(torch.randn(n, k, generator=torch.Generator().manual_seed(n + k)))
    packed = int4_kernel.pack(codes, scale, lo + 8 * scale, exact=True)
    assert packed.shape == (-(-n // 16), k // INT4_GROUP, 384)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(k)
    for m in (1, 2, 6, 7, 16, 40):
        x = torch.randn(m, k, generator=g)
        ref = x.double() @ w.double().T + bias.double()
        got = int4_kernel.load()(x, packed, n, bias)
        torch.testing.assert_close(got.double(), ref, rtol=1e-6, atol=1e-6 * ref.abs().max().item())
        # the same layout in bfloat16 (bfloat16 pair dot products where the CPU has them): bfloat16 rounding
        xb = x.to(torch.bfloat16)
        refb = xb.double() @ w.double().T + bias.double()
        gotb = int4_kernel.load()(xb, packed, n, bias)
        torch.testing.assert_close(gotb.double(), refb, rtol=2 ** -7, atol=1e-2 * refb.abs().max().item())


def test_a_float32_model_of_4bit_weights_reads_their_codes_with_the_logits_of_transformers(tiny, monkeypatch):
    """F32_CODES: a float32 model whose layer weights are exactly code * scale + minimum (a 4-bit GGUF's, loaded in
    float32) holds each as Int4Linear.exact: steps of up to F32_CODES_ROWS rows run the int4 op on the codes, more
    the float32 copy; both give transformers' float32 logits. A weight that is not such a grid stays a Linear."""
    from paceline.model import llama

    monkeypatch.setattr(llama, "F32_CODES", True)
    hf = tiny.make_hf_model("llama", seed=7)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() == 2 and "layers." in name:  # the layer linears onto Q4_1's grid: code * d + m, d a float16
                p.copy_(q4_1_grid(p.float())[3])
        hf.model.layers[1].mlp.down_proj.weight.add_(1e-3)  # off the grid: stays a plain Linear
    runner = tiny.make_runner(hf)
    layers = runner.model.layers
    assert all(isinstance(lin, Int4Linear) and lin.is_exact for lin in (layers[0].qkv, layers[0].down, layers[1].qkv))
    assert not isinstance(layers[1].down, Int4Linear)
    assert llama.F32_CODES_ROWS == 6
    for n in (5, 6, 7, 40):  # prompt steps of 5 and 6 rows read the codes, 7 and 40 the float32 copy
        ids = torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].float()
        torch.testing.assert_close(runner.prefill_logits(ids), ref, atol=1e-4, rtol=0)
