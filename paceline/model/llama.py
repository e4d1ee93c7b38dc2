"""Llama-family transformer (Llama, SmolLM2, Mistral, Qwen2) over a flat batch of tokens with a paged KV cache.

Load-time choices that keep a step's op count low (batch-1 decode on CPU is bound by per-op overhead):
- q/k/v are one matmul and gate/up are one matmul (weights concatenated once at load).
- RoPE is one complex multiply: q and k rows are permuted within each head at load from Hugging Face's
  half-split layout (pairs i, i + d/2) to interleaved pairs (2i, 2i + 1). q.k is unchanged by applying the
  same permutation to both, so attention output is identical; only the cache's internal layout differs.
- The rotation for each position comes from a table built once; a step indexes it by `positions` once.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from paceline.model.arch import ModelArch
from paceline.model.attention import AttnMetadata, paged_attention


def cpu_has_bf16_math() -> bool:
    """Whether oneDNN has native bfloat16 kernels on this CPU (AVX512-BF16, AMX or AVX-NE-CONVERT).

    Without them (e.g. a VM that exposes only AVX2), a bfloat16 matmul converts to float32 inside every call and
    runs several times slower than a float32 one of the same shape: bfloat16 then only pays where memory
    bandwidth bounds a step (few rows), never where compute does (prompt chunks)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (RuntimeError, AttributeError):
        return False


class Linear:
    """y = x W^T (+ b). On CPU the weight is prepacked once into oneDNN's blocked layout when this torch build
    has the op inductor uses for frozen linears: measured here 2-4x faster than F.linear (MKL) for fp32 at
    3..2048 rows and ~2x for bf16 matrix-vector products. Elsewhere it is plain F.linear.

    `wide`, when set, is a float32 copy of the weight that serves float32 inputs: on a CPU without native bf16
    math the model runs steps with many rows in float32 (see LlamaModel's wide_rows)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, pack: bool = True):
        self.weight, self.bias, self.dtype = weight, bias, weight.dtype
        self.packed = self._pack(weight, bias) if pack else None
        if self.packed is not None:
            self.weight = None  # the packed copy replaces the plain one
        self.wide: Linear | None = None  # a float32 copy for float32 inputs (make_linear's wide=True)

    @staticmethod
    def _pack(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
            return None
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
            probe = torch.ones(2, weight.shape[1], dtype=weight.dtype)
            torch.ops.mkldnn._linear_pointwise(probe, packed, bias, "none", [], "")
            return packed
        except (RuntimeError, AttributeError):
            return None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.wide is not None and x.dtype == torch.float32:
            return self.wide(x)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


# A bfloat16 model on a CPU without native bf16 math runs steps of more tokens than this in float32. There a bf16
# matmul converts inside every call: measured on this VM (AVX2 only), 3072x576 weights, 2 threads, F.linear bf16
# vs prepacked float32: 8 rows 1.68 vs 0.29 ms, 32 rows 6.7 vs 0.90, 512 rows 92.7 vs 11.9; LM head at 32 rows
# 91.7 vs 15.4 ms. At 1 row they are even (0.22 vs 0.14 ms, int4 0.14), and the int4 kernel wins at few rows.
WIDE_ABOVE = 8

INT4_GROUP = 32  # input features per scale/offset pair, as in GGUF's Q4_0/Q4_1 blocks


def int4_codes(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest 4-bit codes [N, K] (int32, 0..15) with a float32 scale and minimum per group of
    INT4_GROUP inputs [N, K / INT4_GROUP]: w ~ min + code * scale.

    A Q4_1 GGUF tensor, dequantized, comes back exactly: each of its groups spans min .. min + 15 * d with the
    smallest value at code 0 and the largest at code 15, so this recovers Q4_1's own codes, scale and minimum."""
    n, k = weight.shape
    g = weight.float().view(n, k // INT4_GROUP, INT4_GROUP)
    lo = g.amin(-1)
    scale = (g.amax(-1) - lo) / 15
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # a constant group: code 0 is its value
    codes = torch.round((g - lo[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.int32)
    return codes.view(n, k), scale, lo


class Int4Linear:
    """y = x W^T (+ b) with W held as 4-bit codes in groups of INT4_GROUP inputs (see int4_codes): 8x fewer bytes
    than float32 to stream per step, which is what small-batch decode on a CPU waits for. Uses torch's CPU int4
    matmul, whose activations are bfloat16; the kernel computes (code - 8) * scale + zero, so zero = min + 8 scale.

    That kernel re-expands the codes for every use, so it loses to a dense bfloat16 matmul once a step has more
    than a few rows (measured here: decode at batch 8 about even, batch 32 int4 545 vs bf16 672 tok/s, prefill
    int4 0.4-0.7x). Steps with more than DENSE_ABOVE rows therefore use a dense bfloat16 copy of the same
    dequantized weights: int4 speed where bandwidth bounds, bf16 speed where compute does, for 1.25x the
    memory of the bf16 weights alone."""

    DENSE_ABOVE = 8

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, wide: bool = False):
        codes, scale, lo = int4_codes(weight)
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        self.scales_zeros = torch.stack([scale, lo + 8 * scale], -1).transpose(0, 1).contiguous().to(dtype)
        self.bias = bias
        n, k = codes.shape
        dequantized = (lo[..., None] + codes.view(n, -1, INT4_GROUP) * scale[..., None]).view(n, k)
        # wide: the dense copy is float32 and serves the float32 steps the model runs for many rows; else bf16
        dense_dtype = torch.float32 if wide else dtype
        self.dense = Linear(dequantized.to(dense_dtype).contiguous(), None if bias is None else bias.to(dense_dtype),
                            pack=True)

    @staticmethod
    def supports(weight: torch.Tensor, dtype: torch.dtype) -> bool:
        return (weight.device.type == "cpu" and dtype == torch.bfloat16 and weight.shape[1] % INT4_GROUP == 0
                and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.DENSE_ABOVE or x.dtype == torch.float32:
            return self.dense(x.to(self.dense.dtype)).to(x.dtype)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, INT4_GROUP, self.scales_zeros)
        return y if self.bias is None else y + self.bias


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None, pack: bool, quantization: str,
                dtype: torch.dtype, wide: bool = False) -> "Linear | Int4Linear":
    if quantization == "int4":
        if not Int4Linear.supports(weight, dtype):
            raise ValueError(f"int4 quantization needs a CPU, dtype bfloat16 and input sizes that are multiples "
                             f"of {INT4_GROUP}; got {weight.device.type}, {dtype} and {weight.shape[1]}")
        return Int4Linear(weight, None if bias is None else bias.to(dtype), dtype, wide)
    # the float32 copy comes from the checkpoint's weight, not from its rounding to the run dtype
    lin = Linear(weight.to(dtype).contiguous(), None if bias is None else bias.to(dtype), pack)
    if wide and dtype != torch.float32:
        lin.wide = Linear(weight.float().contiguous(), None if bias is None else bias.float(), pack)
    return lin


def rope_inv_freq(arch: ModelArch) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the position scale, following the rope_scaling field of a HF config."""
    d = arch.head_dim
    inv_freq = 1.0 / (arch.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    rs = arch.rope_scaling or {}
    kind = rs.get("rope_type") or rs.get("type") or "default"
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / float(rs["factor"]), 1.0
    if kind == "llama3":
        factor = float(rs["factor"])
        low, high = float(rs.get("low_freq_factor", 1.0)), float(rs.get("high_freq_factor", 4.0))
        old_len = float(rs.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv_freq
        # long wavelengths are stretched by `factor`, short ones kept, the band between blended smoothly
        smooth = ((old_len / wavelen - low) / (high - low)).clamp(0.0, 1.0)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        out = torch.where(wavelen > old_len / low, inv_freq / factor, blended)
        return torch.where(wavelen < old_len / high, inv_freq, out), 1.0
    raise ValueError(f"unsupported rope_scaling type {kind!r}; paceline supports default, linear and llama3")


def rope_table(arch: ModelArch, max_positions: int, device) -> torch.Tensor:
    """[max_positions, head_dim / 2] complex64 rotations e^{i * pos * inv_freq}, computed as HF does in fp32."""
    inv_freq, _ = rope_inv_freq(arch)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    return torch.polar(torch.ones_like(freqs), freqs).to(device)


def _interleave_perm(head_dim: int) -> torch.Tensor:
    """Row order that turns half-split RoPE pairs (i, i + d/2) into adjacent pairs (2i, 2i + 1)."""
    half = head_dim // 2
    return torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).reshape(-1)


def _permute_heads(w: torch.Tensor, num_heads: int, head_dim: int) -> torch.Tensor:
    perm = _interleave_perm(head_dim)
    return w.reshape(num_heads, head_dim, *w.shape[1:])[:, perm].reshape(w.shape)


class LlamaLayer(nn.Module):
    def __init__(self, arch: ModelArch, w: dict[str, torch.Tensor], pack: bool = True, quantization: str = "none",
                 dtype: torch.dtype | None = None, wide: bool = False):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.eps = arch.rms_norm_eps
        self.scale = arch.head_dim ** -0.5
        dtype = dtype or w["qkv"].dtype
        self.qkv = make_linear(w["qkv"], w.get("qkv_bias"), pack, quantization, dtype, wide)
        self.o = make_linear(w["o"], None, pack, quantization, dtype, wide)
        self.gate_up = make_linear(w["gate_up"], None, pack, quantization, dtype, wide)
        self.down = make_linear(w["down"], None, pack, quantization, dtype, wide)
        self.register_buffer("input_norm", w["input_norm"])
        self.register_buffer("post_norm", w["post_norm"])
        # float32 steps (wide) read float32 norm weights: rms_norm wants its input's dtype
        self.norms32 = (w["input_norm"].float(), w["post_norm"].float()) if wide else None

    def forward(self, h: torch.Tensor, rope: torch.Tensor, meta: AttnMetadata, k_cache: torch.Tensor,
                v_cache: torch.Tensor) -> torch.Tensor:
        t = h.shape[0]
        nh, nkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        input_norm, post_norm = self.input_norm, self.post_norm
        if h.dtype != input_norm.dtype and self.norms32 is not None:
            input_norm, post_norm = self.norms32
        x = F.rms_norm(h, (h.shape[-1],), input_norm, self.eps)
        qkv = self.qkv(x)
        qk = qkv[:, : (nh + nkv) * d].view(t, nh + nkv, d // 2, 2)
        if qk.dtype != torch.float32:
            qk = qk.float()
        qk = torch.view_as_real(torch.view_as_complex(qk) * rope).view(t, nh + nkv, d).to(h.dtype)
        v = qkv[:, (nh + nkv) * d:].view(t, nkv, d)
        attn = paged_attention(qk[:, :nh], qk[:, nh:], v, k_cache, v_cache, meta, self.scale)
        h = h + self.o(attn)
        x = F.rms_norm(h, (h.shape[-1],), post_norm, self.eps)
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return h + self.down(F.silu(gate).mul_(up))


class LlamaModel(nn.Module):
    """Inference-only Llama-family model; weights are buffers built by `from_weights`."""

    def __init__(self, arch: ModelArch, layers: list[dict[str, torch.Tensor]], embed: torch.Tensor, norm: torch.Tensor,
                 lm_head: torch.Tensor | None, max_positions: int | None = None, pack: bool = True,
                 quantization: str = "none", wide_above: int | str | None = "auto"):
        super().__init__()
        self.arch = arch
        self.quantization = quantization
        if wide_above == "auto":
            wide_above = (WIDE_ABOVE if embed.device.type == "cpu" and embed.dtype != torch.float32
                          and not cpu_has_bf16_math() else None)
        # Steps with more than `wide_above` tokens run in float32 (None: never), reading float32 copies of the
        # layer weights; the KV cache, the LM head and small steps stay in the run dtype.
        self.wide_above = wide_above if embed.dtype != torch.float32 else None
        wide = self.wide_above is not None
        # the LM head (and the embedding it may share) stays in the run dtype: GGUFs keep it at 6-8 bits
        self.layers = nn.ModuleList(LlamaLayer(arch, w, pack, quantization, embed.dtype, wide) for w in layers)
        self.norm32 = norm.float() if wide else None
        self.register_buffer("embed", embed)
        self.register_buffer("norm", norm)
        self.lm_head = Linear(embed if lm_head is None else lm_head, None, pack)  # tied: shares the embedding
        if wide:  # logits of many rows (a batch of decodes) in float32 too: several times faster than bf16 here
            self.lm_head.wide = Linear((embed if lm_head is None else lm_head).float(), None, pack)
        self.max_positions = max_positions or arch.max_position_embeddings
        self.register_buffer("rope", rope_table(arch, self.max_positions, embed.device))

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @classmethod
    def from_weights(cls, arch: ModelArch, weights: dict[str, torch.Tensor], device: torch.device | str = "cpu",
                     dtype: torch.dtype = torch.float32, max_positions: int | None = None,
                     pack: bool = True, quantization: str = "none",
                     wide_above: int | str | None = "auto") -> "LlamaModel":
        """Build from Hugging Face-named tensors; a missing tensor is a ValueError naming it.

        pack=False keeps plain F.linear weights (no oneDNN prepacking). quantization="int4" holds the layers'
        linear weights as 4-bit codes (Int4Linear; CPU, bfloat16): give it the float32 weights, so that a
        Q4_1 GGUF's codes are recovered before any rounding to the run dtype.

        wide_above: steps with more tokens than this run in float32 ("auto": WIDE_ABOVE for a bfloat16/float16
        model on a CPU without native bf16 math, else never; None: never)."""
        rope_inv_freq(arch)  # reject unsupported rope scaling before any work
        if quantization not in ("none", "int4"):
            raise ValueError(f"quantization must be 'none' or 'int4', got {quantization!r}")

        def get(name: str) -> torch.Tensor:
            if name not in weights:
                raise ValueError(f"checkpoint is missing tensor {name!r}")
            return weights[name]

        def put(t: torch.Tensor) -> torch.Tensor:
            return t.to(device=device, dtype=dtype).contiguous()

        def put_linear(t: torch.Tensor) -> torch.Tensor:  # make_linear casts: int4 quantizes from full precision
            return t.to(device=device).contiguous()

        nh, nkv, d = arch.num_heads, arch.num_kv_heads, arch.head_dim
        if nh % nkv:
            raise ValueError(f"num_heads ({nh}) must be a multiple of num_kv_heads ({nkv})")
        layers = []
        for i in range(arch.num_layers):
            p = f"model.layers.{i}."
            q = _permute_heads(get(p + "self_attn.q_proj.weight"), nh, d)
            k = _permute_heads(get(p + "self_attn.k_proj.weight"), nkv, d)
            w = {
                "qkv": put_linear(torch.cat([q, k, get(p + "self_attn.v_proj.weight")])),
                "o": put_linear(get(p + "self_attn.o_proj.weight")),
                "gate_up": put_linear(torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")])),
                "down": put_linear(get(p + "mlp.down_proj.weight")),
                "input_norm": put(get(p + "input_layernorm.weight")),
                "post_norm": put(get(p + "post_attention_layernorm.weight")),
            }
            if arch.attention_bias:
                qb = _permute_heads(get(p + "self_attn.q_proj.bias"), nh, d)
                kb = _permute_heads(get(p + "self_attn.k_proj.bias"), nkv, d)
                w["qkv_bias"] = put(torch.cat([qb, kb, get(p + "self_attn.v_proj.bias")]))
            layers.append(w)
        embed = put(get("model.embed_tokens.weight"))
        if arch.tie_word_embeddings or "lm_head.weight" not in weights:
            if not arch.tie_word_embeddings:
                raise ValueError("checkpoint is missing tensor 'lm_head.weight' (and embeddings are not tied)")
            lm_head = None
        else:
            lm_head = put(weights["lm_head.weight"])
        return cls(arch, layers, embed, put(get("model.norm.weight")), lm_head, max_positions, pack, quantization,
                   wide_above)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata,
                kv_cache: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [T] -> final-normed hidden states [T, hidden]; kv_cache [layers, 2, blocks, bs, kvh, d]."""
        h = F.embedding(input_ids, self.embed)
        norm = self.norm
        if self.wide_above is not None and h.shape[0] > self.wide_above:
            h, norm = h.float(), self.norm32
        rope = self.rope[positions].unsqueeze(1)  # [T, 1, d/2], shared by every layer
        for i, layer in enumerate(self.layers):
            h = layer(h, rope, meta, kv_cache[i, 0], kv_cache[i, 1])
        return F.rms_norm(h, (h.shape[-1],), norm, self.arch.rms_norm_eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [N, vocab] for the rows that need a sample, in float32."""
        wide = self.wide_above is not None and hidden.shape[0] > self.wide_above
        return self.lm_head(hidden.float() if wide else hidden.to(self.dtype)).float()
