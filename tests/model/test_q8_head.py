"""The LM head on Q8_0 codes (q8_kernel.py): the codes come back exactly from the dequantized bundled GGUF (against
the file's own block bytes); the op equals a float64 emulation of its numerics within float32 rounding and the exact
product within the activations' int8 rounding; each row's logits are bitwise the same whatever rows share the call
and however many threads run it; bad input is a plain error; a bfloat16 model serves its head with it, a float32
model and PACELINE_Q8_HEAD=0 do not."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from paceline.model import q8_kernel
from paceline.model.llama import LlamaModel

needs_op = pytest.mark.skipif(q8_kernel.op() is None, reason="the Q8_0 op needs AVX512-VNNI and a compiler")


def q8_weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q8_0-shaped weight as a GGUF holds one: codes in -127..127 with a +-127 in every block (d = max|w| / 127),
    fp16 scales; returns (codes, scales, the dequantized float32 weight)."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-126, 127, (n, k // 32, 32), generator=g, dtype=torch.int16)
    at = torch.randint(0, 32, (n, k // 32, 1), generator=g)
    sign = torch.randint(0, 2, (n, k // 32, 1), generator=g, dtype=torch.int16) * 2 - 1
    codes.scatter_(2, at, 127 * sign)
    scales = (torch.rand(n, k // 32, generator=g) * 0.02 + 1e-3).half().float()
    weight = (codes.float() * scales[..., None]).view(n, k)
    return codes.view(n, k).to(torch.int8), scales, weight


def emulated(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, outliers: bool) -> torch.Tensor:
    """The op's numerics in float64 from the same integers: x rounded per block of 32 exactly as the op does
    (float32 127 / max, a float32 product, round half to even; with outliers the block's largest value out first
    and back as an int16 in units of the rest's scale), then exact sums."""
    m, k = x.shape
    xb = x.float().view(m, k // 32, 32).clone()
    xt = torch.zeros(m, k // 32)
    top = torch.zeros(m, k // 32, dtype=torch.long)
    if outliers:
        top = xb.abs().argmax(-1)  # the first of equal ones, as the op picks
        xt = xb.gather(-1, top[..., None])[..., 0]
        xb.scatter_(-1, top[..., None], 0.0)
    amax = xb.abs().amax(-1)
    if outliers:
        amax = torch.maximum(amax, xt.abs() * (torch.tensor(127.0) / torch.tensor(32767.0)))
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros(()))
    xq = torch.round(xb * inv[..., None])
    kt = torch.round(xt * inv).clamp(-32767, 32767)
    a = (amax / 127).double()
    q = codes.double().view(-1, k // 32, 32)  # [n, G, 32]
    d = scales.double()
    dots = torch.einsum("mgk,ngk->mng", xq.double(), q)  # exact integer block sums
    if outliers:
        qt = q[:, torch.arange(k // 32)[None, :].expand(m, -1), top]  # [n, m, G]: each block's taken-out code
        dots += qt.permute(1, 0, 2) * kt.double()[:, None]
    return (dots * d[None] * a[:, None]).sum(-1)


@needs_op
@pytest.mark.parametrize("outliers", [False, True])
@pytest.mark.parametrize("n,k", [(16, 32), (37, 64), (1001, 576)])
def test_op_equals_its_float64_emulation_and_the_exact_product_within_int8_rounding(n, k, outliers):
    codes, scales, weight = q8_weight(n, k, seed=n)
    head = q8_kernel.Q8Head(codes, scales, outliers)
    for m in (1, 2, 5, 8, 13, 40):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * torch.linspace(0.2, 3.0, k)
        x[:, 5] *= 30  # a large channel, as a residual stream has
        x = x.to(torch.bfloat16)
        got = head(x)
        assert got.dtype == torch.float32 and got.shape == (m, n)
        # the same int8 activations: only float32 rounding of the per-block products and their sums differs
        ref = emulated(x, codes, scales, outliers)
        scale = (x.double().abs() @ weight.double().abs().T)  # sum |x| |w|: what the float32 rounding scales with
        assert ((got.double() - ref).abs() <= 1e-6 * scale + 1e-6).all()
        # the exact product: the activations' int8 rounding, at most half a step (max|x_block| / 254) per input
        exact = x.double() @ weight.double().T
        step = x.float().view(m, -1, 32).abs().amax(-1).double() / 254  # [m, G]
        bound = step @ weight.double().abs().view(n, -1, 32).sum(-1).T  # sum over blocks of step * sum |w|
        assert ((got.double() - exact).abs() <= bound + 1e-5 * scale + 1e-6).all()


@needs_op
def test_each_row_is_bitwise_the_same_whatever_rows_share_the_call_and_the_threads():
    codes, scales, _ = q8_weight(203, 96, seed=1)
    x = torch.randn(30, 96, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    for outliers in (False, True):
        head = q8_kernel.Q8Head(codes, scales, outliers)
        whole = head(x)
        for i in range(30):  # one row alone, and within passes of 12 / 10 rows
            assert torch.equal(head(x[i:i + 1])[0], whole[i])
        assert torch.equal(head(x[3:8]), whole[3:8])
        before = torch.get_num_threads()
        try:
            torch.set_num_threads(2)
            assert torch.equal(head(x), whole)
        finally:
            torch.set_num_threads(before)
        assert head(x[:0]).shape == (0, 203)
        assert torch.equal(head(x.float()), whole)  # float32 rows of the same (bfloat16) values: the same bits


def test_codes_come_back_only_from_exact_q8_0_values():
    codes, scales, weight = q8_weight(40, 64, seed=3)
    got = q8_kernel.q8_codes(weight)
    assert got is not None and torch.equal(got[0], codes) and torch.equal(got[1], scales)
    assert q8_kernel.q8_codes(weight.to(torch.bfloat16)) is None  # rounded: the products are no longer exact
    assert q8_kernel.q8_codes(torch.randn(40, 64)) is None
    assert q8_kernel.q8_codes(weight[:, :48]) is None  # not whole blocks of 32
    zero = weight.clone()
    zero[:, :32] = 0  # an all-zero block: scale 0, codes 0
    got = q8_kernel.q8_codes(zero)
    assert got is not None and not got[0][:, :32].any() and not got[1][:, 0].any()


def test_q8_0_codes_of_the_bundled_gguf_come_back_exactly():
    """Against the file's own Q8_0 block bytes (fp16 scale, 32 int8 codes) of token_embd, the tied LM head."""
    from paceline.model.loader import default_model_path, load_checkpoint, read_gguf

    path = default_model_path()
    raw = read_gguf(path)[1]["token_embd.weight"]
    assert raw.qtype == 8  # GGML Q8_0
    blocks = np.ascontiguousarray(raw.data).reshape(-1, 34)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32).reshape(raw.shape[0], -1)
    q = blocks[:, 2:].copy().view(np.int8).reshape(raw.shape[0], -1)
    got = q8_kernel.q8_codes(load_checkpoint(path, "float32").weights["model.embed_tokens.weight"])
    assert got is not None
    assert np.array_equal(got[1].numpy(), d)
    assert np.array_equal(got[0].numpy()[d.repeat(32, 1) != 0], q[d.repeat(32, 1) != 0])


def test_bad_input_is_a_plain_error(monkeypatch):
    codes, scales, _ = q8_weight(16, 64, seed=4)
    with pytest.raises(ValueError, match="-127..127"):
        q8_kernel.pack(torch.full((16, 64), -128, dtype=torch.int8), scales)
    with pytest.raises(ValueError, match="multiple of 32"):
        q8_kernel.pack(codes[:, :48], scales[:, :1])
    monkeypatch.setenv("PACELINE_Q8_HEAD", "yes")
    with pytest.raises(ValueError, match="PACELINE_Q8_HEAD must be 0 or 1"):
        q8_kernel.enabled()
    if q8_kernel.op() is None:
        return
    head = q8_kernel.Q8Head(codes, scales)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        head(torch.ones(2, 64, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        q8_kernel.op()(torch.ones(2, 48), head.packed, 16, False)
    with pytest.raises(RuntimeError, match="packed"):
        head(torch.ones(2, 32))  # K not the weight's


def _q8_model_weights(tiny, hf_llama, tied: bool) -> tuple:
    """The tiny model's float32 weights with a Q8_0-shaped head (the embedding too when tied)."""
    arch = tiny.arch_of(hf_llama)
    weights = {k: v.float() for k, v in hf_llama.state_dict().items()}
    codes, scales, head = q8_weight(arch.vocab_size, arch.hidden_size, seed=5)
    weights["model.embed_tokens.weight" if tied else "lm_head.weight"] = head
    if tied:
        weights.pop("lm_head.weight", None)
        arch = dataclasses.replace(arch, tie_word_embeddings=True)
    return arch, weights, codes, scales, head


@needs_op
@pytest.mark.parametrize("tied", [False, True])
def test_bf16_model_serves_its_head_with_the_op_and_not_when_switched_off(tiny, hf_llama, monkeypatch, tied):
    arch, weights, codes, scales, head = _q8_model_weights(tiny, hf_llama, tied)
    on = LlamaModel.from_weights(arch, weights, "cpu", torch.bfloat16)
    fp32 = LlamaModel.from_weights(arch, weights, "cpu", torch.float32)
    monkeypatch.setenv("PACELINE_Q8_HEAD", "0")
    off = LlamaModel.from_weights(arch, weights, "cpu", torch.bfloat16)
    assert on.q8_head is not None and off.q8_head is None and fp32.q8_head is None
    assert on.lm_head.packed is None  # the op serves every row: no packed bf16 copy
    h = torch.randn(9, arch.hidden_size, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    with torch.inference_mode():
        got = on.compute_logits(h)
        assert on.q8_head.outliers  # the default
        assert torch.equal(got, q8_kernel.Q8Head(codes, scales, outliers=True)(h))
        for i in range(9):  # a decode and row i of a verification: the same logits exactly
            assert torch.equal(on.compute_logits(h[i:i + 1])[0], got[i])
        exact = h.double() @ head.double().T
        # the op within its activations' rounding; the bf16 head rounds its weights and its output
        assert (got.double() - exact).abs().max() < 0.02 * exact.abs().max()
        torch.testing.assert_close(off.compute_logits(h).double(), exact, rtol=2 ** -6, atol=0.02 * exact.abs().max())
    # a head that is not Q8_0 codes keeps the bf16 matmul
    weights["lm_head.weight" if not tied else "model.embed_tokens.weight"] = head + 1e-4
    monkeypatch.setenv("PACELINE_Q8_HEAD", "1")
    assert LlamaModel.from_weights(arch, weights, "cpu", torch.bfloat16).q8_head is None


@needs_op
def test_bundled_model_head_on_real_hidden_states():
    """The bundled head (the tied Q8_0 embedding) on the final hidden states of a real text from the fp32 model:
    within the activations' int8 rounding of the exact product, and the same greedy token at nearly every
    position (the held-out measure is benchmarks/quality.py)."""
    from paceline.model.attention import SeqSlice, build_metadata
    from paceline.model.loader import default_model_path, load_checkpoint

    ckpt = load_checkpoint(default_model_path(), "float32")
    model = LlamaModel.from_weights(ckpt.arch, ckpt.weights, "cpu", torch.float32, pack=False)
    ids = ckpt.tokenizer.encode("The Python standard library offers modules for file handling, regular "
                                "expressions, dates and times, and many more tasks that programs need often.")
    n, bs = len(ids), 16
    blocks = -(-n // bs)
    kv = torch.zeros(len(model.layers), 2, blocks, bs, ckpt.arch.num_kv_heads, ckpt.arch.head_dim)
    with torch.inference_mode():
        hidden = model.forward(torch.tensor(ids), torch.arange(n),
                               build_metadata([SeqSlice(0, n, list(range(blocks)))], bs, "cpu"), kv)
    weight = ckpt.weights["model.embed_tokens.weight"]
    head = q8_kernel.Q8Head.from_weight(weight)
    assert head is not None
    x = hidden.to(torch.bfloat16)  # what a bfloat16 model's head receives
    got = head(x).double()
    exact = x.double() @ weight.double().T
    step = x.float().view(n, -1, 32).abs().amax(-1).double() / 254
    bound = step @ weight.double().abs().view(weight.shape[0], -1, 32).sum(-1).T
    assert ((got - exact).abs() <= bound + 1e-4).all()
    agree = (got.argmax(-1) == exact.argmax(-1)).double().mean()
    assert agree >= 0.9, float(agree)


def test_the_switches_enter_the_snapshot_and_start_up_profile_keys(monkeypatch):
    """A model built with the other head must neither map the other's snapshot nor reuse its measured step times."""
    from types import SimpleNamespace

    from paceline.engine.engine import Engine
    from paceline.model.loader import snapshot_path

    setup = SimpleNamespace(config=SimpleNamespace(model=None, dtype="bfloat16", quantization="int4",
                                                   wide_linears="auto"),
                            device="cpu", block_size=16, num_blocks=64, max_model_len=512)
    keys = {}
    for on, out in (("1", "0"), ("0", "0"), ("1", "1")):
        monkeypatch.setenv("PACELINE_Q8_HEAD", on)
        monkeypatch.setenv("PACELINE_Q8_HEAD_OUTLIERS", out)
        keys[on, out] = (q8_kernel.build_key(), snapshot_path(None, "bfloat16", "int4", "auto"),
                         Engine._profile_cache_path(setup))
    assert keys["0", "0"][0] == "off"
    if q8_kernel.op() is not None:
        assert keys["1", "1"][0] == "vnni" and keys["1", "0"][0] == "vnni:t0"
        for part in (1, 2):  # the snapshot and the profile differ with each switch
            assert len({k[part] for k in keys.values()}) == 3
