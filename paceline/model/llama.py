"""Llama-family transformer (Llama, SmolLM2, Mistral, Qwen2) over a flat batch of tokens with a paged KV cache.

Load-time choices that keep a step's op count low (batch-1 decode on CPU is bound by per-op overhead):
- q/k/v are one matmul and gate/up are one matmul (weights concatenated once at load).
- RoPE is one complex multiply: q and k rows are permuted within each head at load from Hugging Face's
  half-split layout (pairs i, i + d/2) to interleaved pairs (2i, 2i + 1). q.k is unchanged by applying the
  same permutation to both, so attention output is identical; only the cache's internal layout differs.
- The rotation for each position comes from a table built once; a step indexes it by `positions` once.
"""
from __future__ import annotations

import contextlib
import math
import os
import threading
import warnings
from typing import Generator, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from paceline.model import (f32_rows_kernel, fused_kernel, int4_amx_kernel, int4_kernel, layer_loop, logits_kernel,
                            q8_kernel, w4a8_kernel, w8a8_kernel)
from paceline.model.arch import ModelArch
from paceline.model.attention import AttnMetadata, SeqSlice, build_metadata, paged_attention, write_kv


T = TypeVar("T")


def drain(steps: Generator[None, None, T]) -> T:
    """Run a generator that yields between pieces of work (forward_layers, ModelRunner.execute_iter,
    Engine.step_iter) to its end; its return value."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def cpu_has_bf16_math() -> bool:
    """Whether oneDNN has native bfloat16 kernels on this CPU (AVX512-BF16, AMX or AVX-NE-CONVERT).

    Without them (e.g. a VM that exposes only AVX2), a bfloat16 matmul converts to float32 inside every call and
    runs several times slower than a float32 one of the same shape: bfloat16 then only pays where memory
    bandwidth bounds a step (few rows), never where compute does (prompt chunks)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (RuntimeError, AttributeError):
        return False


_defer = threading.local()
# float32 products on a Linear's plain weight (not yet packed) run oneDNN's linear, not aten's (Linear.onednn_weight);
# PACELINE_PLAIN_ONEDNN=0: aten's, as before 2026-11-29 (the A/B)
PLAIN_ONEDNN = os.environ.get("PACELINE_PLAIN_ONEDNN", "1") != "0"


@contextlib.contextmanager
def deferred_packing():
    """Linears built on this thread inside the block keep plain weights; the caller packs them later with
    Linear._pack (engine/residency.py: a model loaded beside others packs after it has started serving)."""
    _defer.on = True
    try:
        yield
    finally:
        _defer.on = False


class Linear:
    """y = x W^T (+ b). On CPU the weight is prepacked once into oneDNN's blocked layout when this torch build
    has the op inductor uses for frozen linears: measured here 2-4x faster than F.linear (MKL) for fp32 at
    3..2048 rows and ~2x for bf16 matrix-vector products. Elsewhere it is plain F.linear.

    `wide`, when set, is the copy of the weight that serves float32 inputs (float32 or Int8Linear): on a CPU
    without native bf16 math the model runs steps with many rows in float32 (see LlamaModel's wide_above).

    `few_rows`: a float32 weight that serves decode steps keeps its plain copy beside the packed one where
    f32_rows_kernel's op runs (AVX-512): steps of up to f32_rows_kernel.MAX_ROWS rows read it there, faster than
    oneDNN's packed product at one or two rows. The copies that serve only wide steps pass False."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, pack: bool = True,
                 few_rows: bool = True):
        self.weight, self.bias, self.dtype = weight, bias, weight.dtype
        self.packed = self._pack(weight, bias) if pack else None
        self.keep_plain = few_rows and f32_rows_kernel.keeps_plain(weight)  # then the weight is never dropped
        self.drop_plain()
        self.wide: Linear | Int8Linear | None = None  # serves float32 inputs (make_linear's wide)

    def drop_plain(self) -> None:
        """The packed copy replaces the plain weight once there is one, unless few-row steps read it (keep_plain)."""
        if self.packed is not None and not self.keep_plain:
            self.weight = None

    def few_rows(self, rows: int, dtype: torch.dtype) -> bool:
        """Whether f32_rows_kernel's op serves a step of `rows` rows of `dtype` (the layer loop asks the same)."""
        return self.keep_plain and dtype == torch.float32 and rows <= f32_rows_kernel.MAX_ROWS

    @staticmethod
    def _pack(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available() or getattr(_defer, "on", False):
            return None
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
            probe = torch.ones(2, weight.shape[1], dtype=weight.dtype)
            torch.ops.mkldnn._linear_pointwise(probe, packed, bias, "none", [], "")
            return packed
        except (RuntimeError, AttributeError):
            return None

    def onednn_weight(self) -> torch.Tensor | None:
        """The weight oneDNN's linear runs on: the packed copy, else (PLAIN_ONEDNN) a plain float32 CPU weight not
        yet packed, else None (aten's linear). Why the plain one: unpacked (a model loaded on demand serves before
        its packing, engine/residency.py), oneDNN's product on the plain weight took 133 ms for the bundled model's
        64-row float32 linears against 193 ms for aten's (MKL's) and 105 ms packed (/tmp script, 2 threads,
        2026-11-29 11:40 UTC). The layer loop's dense path asks the same."""
        if self.packed is not None:
            return self.packed
        w = self.weight
        if (PLAIN_ONEDNN and w is not None and w.dtype == torch.float32 and w.device.type == "cpu" and w.dim() == 2
                and w.is_contiguous() and torch.backends.mkldnn.is_available()):
            return w
        return None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.wide is not None and x.dtype == torch.float32:
            return self.wide(x)
        if x.dim() == 2 and self.few_rows(x.shape[0], x.dtype):
            op = f32_rows_kernel.op()
            if op is not None:
                return op(x, self.weight, self.bias)
        w = self.onednn_weight()
        if w is not None and (w is self.packed or x.dtype == torch.float32):
            return torch.ops.mkldnn._linear_pointwise(x, w, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


class Int8Linear:
    """y = x W^T (+ b) for float32 x, with W held as 7-bit integers per output channel (symmetric, one float scale
    per row) and x quantized to 8 bits at every call (dynamic quantization), run by torch's x86 quantized engine
    (fbgemm); a few outlier input channels stay float32. It costs some quality (benchmarks/summaries/int8_wide.md).

    This serves the wide steps (many rows, where compute bounds the step): an int8 matmul does about twice the
    multiply-adds per instruction of a float32 one on AVX2. Measured on this VM (2 threads, the int8 product alone),
    against the prepacked float32 Linear: [576 -> 3072] at 512 rows 11.9 -> 6.6 ms, [1536 -> 576] 6.4 -> 3.7 ms,
    the LM head [576 -> 49152] at 32 rows 15.2 -> 6.8 ms; at 1-8 rows there is nothing to gain (memory bounds them).

    Per row: the engine's own activation quantization is per tensor (one scale and zero point over every row),
    which would let one row with large values coarsen every other request's rows in the batch. So each row is
    first divided by its largest magnitude and one anchor row [1, -1, 0, ...] is added: the tensor then always
    spans exactly [-1, 1], each row is quantized on its own scale, and a row's result does not depend on which
    other rows share its step; the output rows are multiplied back.

    8-bit activations, 7-bit weights: without AVX512-VNNI, fbgemm's u8 x s8 kernel adds pairs of products in
    16 bits with saturation. With weights in -63..63 a pair is at most 2 x 255 x 63 = 32130 < 32767, so it can
    never saturate; measured on the bundled model this split (8/7) loses less than 7-bit activations with 8-bit
    weights (the other split that fits).

    input_absmax (SmoothQuant, Xiao et al. 2023): a transformer's activations have a few input channels far larger
    than the rest, which a per-row scale then spends most of its bits on. Given each input channel's largest
    magnitude on calibration tokens, the channel is divided by s = sqrt(absmax_x / absmax_w) and the weight's
    column multiplied by it: the product is unchanged, and activations and weights share the range. Then the
    `outliers` channels that are still the largest (LLM.int8(), Dettmers et al. 2022, chosen once at load so
    that a row's result still does not depend on the other rows) are taken out of the int8 product and
    multiplied in float32: a [rows, outliers] x [outliers, out] matmul, small next to the int8 one."""

    WEIGHT_LEVELS = 63  # 7-bit weights: see the class docstring (no 16-bit saturation with 8-bit activations)
    REDUCE_RANGE = False  # 8-bit activations

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 input_absmax: torch.Tensor | None = None, outliers: int = 0):
        w = weight.float().clone()
        self.inv_smooth = None
        channel_size = torch.ones(w.shape[1])
        if input_absmax is not None:
            smooth = (input_absmax.float().clamp_min(1e-5) / w.abs().amax(0).clamp_min(1e-5)).sqrt()
            w = w * smooth
            self.inv_smooth = 1.0 / smooth
            channel_size = input_absmax.float() / smooth
        self.outlier_idx, self.outlier_weight = None, None
        if outliers > 0 and input_absmax is not None:
            self.outlier_idx = channel_size.topk(min(outliers, w.shape[1])).indices.sort().values
            self.outlier_weight = w[:, self.outlier_idx].t().contiguous()  # [outliers, out], float32
            w[:, self.outlier_idx] = 0  # the int8 product leaves them out (their inputs are zeroed too)
        scale = (w.abs().amax(1) / self.WEIGHT_LEVELS).clamp_min(1e-12).double()
        with warnings.catch_warnings():  # torch 2.13 marks quantized tensors deprecated; linear_prepack takes one
            warnings.simplefilter("ignore", UserWarning)
            qweight = torch.quantize_per_channel(w, scale, torch.zeros(w.shape[0], dtype=torch.long), 0, torch.qint8)
        with _x86_quantized_engine():
            self.packed = torch.ops.quantized.linear_prepack(qweight, None)
        self.bias = None if bias is None else bias.float()
        self.dtype = torch.float32
        self.in_features = w.shape[1]

    @staticmethod
    def supports(weight: torch.Tensor) -> bool:
        """A CPU weight and a torch build with the x86/fbgemm quantized engine (elsewhere: the float32 copy)."""
        engines = torch.backends.quantized.supported_engines
        return weight.device.type == "cpu" and ("x86" in engines or "fbgemm" in engines)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        m = rows.shape[0]
        scaled = rows.new_zeros(m + 1, self.in_features)
        body = scaled[:m]
        if self.inv_smooth is not None:
            torch.mul(rows, self.inv_smooth, out=body)
        else:
            body.copy_(rows)
        outlier_part = None
        if self.outlier_idx is not None:
            outlier_part = body.index_select(1, self.outlier_idx) @ self.outlier_weight
            body.index_fill_(1, self.outlier_idx, 0.0)
        peak = body.abs().amax(-1, keepdim=True).clamp_min_(1e-30)
        body.div_(peak)
        scaled[m, 0], scaled[m, 1] = 1.0, -1.0  # the anchor: the tensor's range is [-1, 1] whatever the rows
        y = torch.ops.quantized.linear_dynamic(scaled, self.packed, self.REDUCE_RANGE)[:m].mul_(peak)
        if outlier_part is not None:
            y += outlier_part
        if self.bias is not None:
            y += self.bias
        return y.view(*x.shape[:-1], y.shape[-1])


class _x86_quantized_engine:
    """Pack under the x86 (or fbgemm) quantized engine, whatever the process-wide choice is: the packed weight
    carries its engine, so linear_dynamic runs it the same way later."""

    def __enter__(self):
        self.before = torch.backends.quantized.engine
        engines = torch.backends.quantized.supported_engines
        if self.before not in ("x86", "fbgemm"):
            torch.backends.quantized.engine = "x86" if "x86" in engines else "fbgemm"

    def __exit__(self, *exc):
        torch.backends.quantized.engine = self.before


class W8A8Linear:
    """y = x W^T (+ b) for bfloat16 (or float32) x with W held as int8 per output channel and x quantized to int8
    per row at every call, the product an int8 GEMM (w8a8_kernel.py: the numerics, and why it pays on a CPU with
    AVX512-VNNI). Each row has its own scale, so a request's result does not depend on the other rows of its step.
    Serves an int4 model's bfloat16 steps of many rows where int4_wide_choice() is "int8" (Int4Linear's dense).

    inv_smooth [K] (optional): SmoothQuant's per-input-channel factor, applied to x inside the op; the weight's
    columns are divided by it here, so the product is unchanged."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                 inv_smooth: torch.Tensor | None = None, outliers: int = 0):
        w = weight.float()
        self.outliers = outliers  # each row's largest |x| multiplied in float32 (w8a8_kernel.py)
        if inv_smooth is not None:
            inv_smooth = inv_smooth.float().contiguous()
            w = w / inv_smooth
        self.wq, self.col_scale = w8a8_kernel.quantize_weight(w)
        self.inv_smooth = inv_smooth
        self.bias = None if bias is None else bias.float().contiguous()
        self.dtype = dtype
        self.op = w8a8_kernel.load()  # None: the same definition in torch ops (slower)
        # the build whose gated op serves gated() (a name, not the op: the model's snapshot pickles this object),
        # None where it does not (op off, or PACELINE_W8A8_FUSED_SILU=0); and whether it rounds gate and up first
        fused = w8a8_fused_silu()
        self.gated_build = (w8a8_kernel.isa() if self.op is not None and fused != "0"
                            and w8a8_kernel.load_gated() is not None else None)
        self.gated_rounded = fused == "1"

    @staticmethod
    def _rows(x: torch.Tensor) -> torch.Tensor:
        """x as [M, K] rows with unit column stride, what the op takes."""
        rows = x.reshape(-1, x.shape[-1])
        return rows if rows.stride(-1) == 1 else rows.contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = self._rows(x)
        if self.op is not None:
            y = self.op(rows, self.wq, self.col_scale, self.bias, self.inv_smooth, self.outliers)
        else:
            y = w8a8_kernel.reference(rows, self.wq, self.col_scale, self.bias, self.inv_smooth, self.outliers)
        return y.view(*x.shape[:-1], y.shape[-1])

    def gated(self, x: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up of a gate/up linear's product (gate its first half of columns) in one op: the epilogue
        that holds a row's gate and up values writes the gated row, so the [rows, N] product is never written
        and read back by silu_mul. By default (gated_rounded) gate and up are rounded to bfloat16 first and the
        SiLU is silu_mul's own arithmetic: the same bits as `silu_mul(self(x))`. None where it cannot run."""
        op = w8a8_kernel.gated_op_for(self.gated_build) if self.gated_build is not None else None
        if op is None:
            return None
        y = op(self._rows(x), self.wq, self.col_scale, self.bias, self.inv_smooth, self.outliers, self.gated_rounded)
        return y.view(*x.shape[:-1], y.shape[-1])


# PACELINE_W8A8_FUSED_SILU, for W8A8Linears built afterwards: "1" (default) gate_up's SiLU * up in the int8 op's
# epilogue with the unfused path's bits; "f32" from the float32 gate and up values (not rounded to bf16 first, a
# reciprocal in place of the division: ~8 % faster on gate_up at 1,500 rows, no faster at 160-512, and top-1
# agreement with fp32 97.08 % against 97.28 %, perplexity 22.398 against 22.404: benchmarks/summaries/w8a8.md,
# 2026-11-24 23:16-23:33 UTC); "0" silu_mul after the op (A/B runs)
W8A8_FUSED_SILU = ("1", "f32", "0")


def w8a8_fused_silu() -> str:
    """PACELINE_W8A8_FUSED_SILU: one of W8A8_FUSED_SILU."""
    value = os.environ.get("PACELINE_W8A8_FUSED_SILU", "1")
    if value not in W8A8_FUSED_SILU:
        raise ValueError(f"PACELINE_W8A8_FUSED_SILU must be one of {', '.join(W8A8_FUSED_SILU)}, got {value!r}")
    return value


# What the wide steps' linears run (LlamaModel's wide_linears): "fp32", float32 copies of the weights; "int8",
# Int8Linear where the x86 quantized engine exists. "auto" is AUTO_WIDE_LINEARS (benchmarks/summaries/int8_wide.md:
# quality and speed of both).
WIDE_LINEARS = ("auto", "fp32", "int8")
AUTO_WIDE_LINEARS = "fp32"
# int8 wide steps: the input channels per linear that stay float32 (Int8Linear's outliers)
OUTLIER_CHANNELS = 64


class Calibrating(Linear):
    """A float32 Linear that records the largest magnitude of each input channel it sees, and keeps its weight:
    the stand-in for an Int8Linear until LlamaModel has run its calibration tokens (see Int8Linear)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, pack: bool):
        super().__init__(weight.float().contiguous(), None if bias is None else bias.float(), pack, few_rows=False)
        self.source = (weight, bias)
        self.input_absmax: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        seen = x.detach().reshape(-1, x.shape[-1]).abs().amax(0).float()
        self.input_absmax = seen if self.input_absmax is None else torch.maximum(self.input_absmax, seen)
        return super().__call__(x)

    def int8(self) -> "Int8Linear | Linear":
        try:
            return Int8Linear(*self.source, input_absmax=self.input_absmax, outliers=OUTLIER_CHANNELS)
        except (RuntimeError, AttributeError):  # a torch build whose quantized ops are gone: float32 serves
            return Linear(self.source[0].float().contiguous(), None if self.source[1] is None else
                          self.source[1].float(), True, few_rows=False)


def wide_linear(weight: torch.Tensor, bias: torch.Tensor | None, pack: bool, kind: str) -> "Linear | Calibrating":
    """The copy of a weight that serves the wide (float32) steps: float32, or for "int8" a Calibrating stand-in
    that LlamaModel turns into an Int8Linear."""
    if kind == "int8" and Int8Linear.supports(weight):
        return Calibrating(weight, bias, pack)
    return Linear(weight.float().contiguous(), None if bias is None else bias.float(), pack, few_rows=False)


# A bfloat16 model on a CPU without native bf16 math runs steps of more tokens than this in float32. There a bf16
# matmul converts inside every call: measured on this VM (AVX2 only), 3072x576 weights, 2 threads, F.linear bf16
# vs prepacked float32: 8 rows 1.68 vs 0.29 ms, 32 rows 6.7 vs 0.90, 512 rows 92.7 vs 11.9; LM head at 32 rows
# 91.7 vs 15.4 ms. At 1 row they are even (0.22 vs 0.14 ms, int4 0.14), and the int4 kernel wins at few rows.
WIDE_ABOVE = 8

INT4_GROUP = 32  # input features per scale/offset pair, as in GGUF's Q4_0/Q4_1 blocks
# int4 models: steps of up to this many rows run paceline's own int4 op (int4_kernel.py) on the 4-bit codes, float32
# (wide) steps included; larger ones the dense copy. A step of a few dozen rows is bound by reading the weights,
# 8x fewer bytes as codes than as float32 (first measured with the op's few-row path alone: 9 rows 80.0 -> 33.9 ms,
# 32 rows 116.7 -> 81.7, and the dense copy ahead from ~95 rows). Since the op's many-row path (a float32 GEMM over
# each dequantized block) it keeps up with the dense float32 matmul in compute too: whole steps of the bundled
# model, op vs dense copy (benchmarks/profile_step.py --compare "int4_rows=96,int4_rows=512", 2026-11-23 21:49 UTC)
# 128 rows 320.2 vs 319.5 ms (198.8 vs 243.7 in a run 25 minutes earlier), 192 rows 436.6 vs 468.4, 256 rows 567.3
# vs 560.2, a 512-token prefill 1181.3 vs 1170.2. The switch sits where the two lines meet (~256 rows), so a step's
# cost has no jump there: the step-time model is linear in rows, and a jump just past the rows a step-time target
# allows would make those steps run over their prediction (a first switch at 64 rows did: the 32-stream probe's p99
# TBT 215 ms against 173, benchmarks/summaries/vs_vllm.md). Prompt chunks of the default budget (512) keep the
# float32 copy, where oneDNN is as fast and the linears alone were ahead (0.88x for the op at 512 rows,
# benchmarks/summaries/profile_after.md).
# 0 or anything up to Int4Linear.DENSE_ABOVE: only the few-row steps.
INT4_KERNEL_ROWS = 256
# int4 models: the layer linears (by LlamaLayer's names) that run the int4 x int8 op (w4a8_kernel.py) for steps of
# at least W4A8_FROM_ROWS rows; fewer rows keep the int4 op, and a linear the op serves builds no dense copy. One
# linear at a time the op's first version (no outlier taken out) was 1.35-4.6x faster than the float32 copy's
# oneDNN matmul at 1-512 rows (benchmarks/int4_linear.py --w4a8, 2026-11-23 23:52 UTC) but cost top-1 agreement
# (97.70 % of fp32); with each block's largest activation taken out of the int8 block, top-1 is 99.11 % and
# perplexity +0.09 % (benchmarks/summaries/quality.md) and whole steps gain 1.10-1.11x on prompts, ~even at 32
# decodes (benchmarks/summaries/profile_after.md, 2026-11-24 00:53 UTC). From 7 rows: one decode stays on the int4
# op, which was faster in the model's steps. The default since the side by side against vLLM CPU (2026-11-24
# 01:01 UTC, benchmarks/summaries/vs_vllm.md): with it the lone 1,500-token TTFT was 2,650 against 2,985 ms without
# and 3,496 for vLLM, 32 streams 177 against 169 tok/s, and it meets the quality bar; it also spares the 424 MB
# float32 copy. PACELINE_W4A8_LINEARS=qkv:o:gate_up:down / "all" / "" picks the linears for a model built
# afterwards ("" restores the float32 copy); PACELINE_W4A8_KERNEL=0 keeps the op from loading at all.
W4A8_FROM_ROWS = 7
ALL_LINEARS = ("qkv", "o", "gate_up", "down")
W4A8_LINEARS: tuple[str, ...] = ALL_LINEARS


def linears_from_env(var: str, default: tuple[str, ...]) -> tuple[str, ...]:
    """`default`, or the linear names the environment variable `var` gives (":"- or ","-separated; "all"; "" for
    none)."""
    env = os.environ.get(var)
    if env is None:
        return default
    names = tuple(n for n in env.replace(",", ":").split(":") if n)
    names = ALL_LINEARS if names == ("all",) else names
    unknown = set(names) - set(ALL_LINEARS)
    if unknown:
        raise ValueError(f"{var}: unknown linear(s) {', '.join(sorted(unknown))}; "
                         f"use {', '.join(ALL_LINEARS)} or all")
    return names


def w4a8_linears() -> tuple[str, ...]:
    """W4A8_LINEARS, or the names PACELINE_W4A8_LINEARS gives."""
    return linears_from_env("PACELINE_W4A8_LINEARS", W4A8_LINEARS)


# int4 models on a CPU with native bf16 math (cpu_has_bf16_math): steps of at least INT4_BF16_FROM_ROWS rows run
# the layer linears on a dense bfloat16 copy of the dequantized codes (oneDNN's AVX512-BF16 matmul, prepacked), fewer
# rows keep the int4 op (1-6 rows) and the w4a8 op (7-11 rows). Once a step has a dozen rows it is compute-bound,
# and oneDNN's prepacked bf16 GEMM (AVX512-BF16 dot products) outruns the w4a8 op (AVX2 integer dot products plus its
# per-block work): whole steps of the bundled model, w4a8 vs the bf16 copy (AMD Zen 4, 2 threads;
# `benchmarks/profile_step.py --modes int4 --compare "int4_wide=w4a8,int4_wide=bf16+int4_bf16_from=16,
# int4_wide=bf16+int4_bf16_from=12"`, 2026-11-24, ended 05:56 UTC, ms): 32 decodes 56.9 -> 45.6, a 512-token
# prefill 594.5 -> 392.8, 1,500 tokens in 512-chunks 2110.2 -> 1559.9; by rows, 12 rows 20.7 vs 20.5 (even), 16
# rows 26.5 vs 23.2, 24 rows 34.0 vs 28.5, 128 rows 150.1 vs 104.5; at 9 rows w4a8 is ahead (15.7 vs 18.6 with the
# copy from 7 rows, an earlier run ended 05:48 UTC). So the switch sits where the two lines meet
# (12 rows) and a step's cost has no jump there (the step-time model is linear in rows: INT4_KERNEL_ROWS's comment).
# The copy costs 2 bytes a weight: 212 MB for the bundled model's layers; the LM head and the activations of every
# step stay bfloat16 as they were (no float32 wide steps on such a CPU), the KV cache too. Quality there, whole
# 512-token windows: top-1 97.70 % of fp32's, perplexity +0.06 %, against 97.82 % / +0.18 % for the w4a8 op with
# the same bf16 activations; the 99 % top-1 bar needs float32 activations (benchmarks/summaries/quality.md).
INT4_BF16_FROM_ROWS = 12
# Beside the w4a8 op's AVX512-VNNI build (w4a8_kernel.isa() == "vnni") the op keeps up longer: whole steps, one
# process, the VNNI op vs the bf16 copy from 12 rows (`benchmarks/profile_step.py --modes int4 --compare
# "int4_wide=w4a8,int4_wide=bf16" --only "b=32,chunk 64,prefill 512,in 512,rows 12,rows 24,probe32" --repeats 3`,
# 2026-11-24 06:39 UTC, ms): 12 rows 18.8 vs 21.1, 24 rows 28.6 vs 28.8, 32 decodes 39.2 vs 43.8, a 64-token chunk
# + 6 decodes (70 rows) 66.1 vs 72.7, but a 48-token chunk + 32 decodes (80 rows) 83.4 vs 76.5, 128 rows 106.9 vs
# 96.0, a 512-token prefill 423.3 vs 379.5. The lines cross between 70 and 80 rows, so there the copy starts.
INT4_BF16_FROM_ROWS_VNNI = 72
# On a CPU with AMX tiles for bf16 (Intel Sapphire Rapids and later: amx_bf16), oneDNN's bf16 matmul runs on the
# tiles (the layer linears of a whole 1,500-token step, ~318 GFLOP, in 130 ms: ~2.4 TFLOP/s on 2 cores; docs/
# performance.md, "On a CPU with AMX"), and the dense copy wins from a dozen rows on, whatever build of the w4a8 op serves the rows below. Whole steps of the bundled model, one process
# (Intel Xeon with AMX, 2 threads; `benchmarks/profile_step.py --modes int4 --compare "int4_wide=w4a8,
# int4_wide=bf16+int4_bf16_from=16,int4_wide=bf16+int4_bf16_from=8" --only "b=32,prefill 512,1500 in 512,rows 12 ,
# rows 32 ,rows 128 ,probe32" --repeats 3`, 2026-11-25 07:13 UTC, ms, w4a8 op at every row / copy from 16 / from 8):
# 12 rows 15.9 / 16.3 / 17.3, 32 rows 25.9 / 23.6 / 21.2, 128 rows 70.3 / 38.9 / 36.8, 32 decodes 36.7 / 35.0 /
# 32.3, the probe's 128 prompt tokens + 32 decodes 96.3 / 55.5 / 52.0, a 512-token prefill 286.0 / 144.4 / 138.6,
# 1,500 tokens in 512-chunks 1126.8 / 693.3 / 679.8. The lines meet at ~12 rows, but the switch sits at 128 rows:
# below it a chat prompt is served by the same op whether it is prefilled whole (n=2: both copies in one step, ~80
# rows) or after a cached prefix (its last few rows), so a seeded sample repeats; with the copy from 16 or 72 rows
# tests/entrypoints/test_openai_features_real.py's n=2 chat sample changed on the second request. The price: steps
# of 16-127 rows keep the op (in the run above the 32-stream probe's 25-token chunk + 17 decodes 34.2 against
# 29.2 ms, 32 decodes 36.7 against 35.0, a 48-token chunk + 32 decodes 59.1 against 39.8).
INT4_BF16_FROM_ROWS_AMX = 128
# ... but a step holding at least INT4_BF16_FROM_DECODES_AMX decodes runs the copy whatever its rows: a decode's
# logits already depend on its batch (the int4 op serves 1-6 rows, the w4a8 op 7+), and a chat prompt alone keeps
# its op. Whole steps (`benchmarks/profile_step.py --modes int4 --only "b=32,probe32"`, with the rule and without,
# 2026-11-25 08:25 UTC, ms, without / with): 25 prompt tokens + 17 decodes 37.8 / 33.2, a 100-token prompt + 17
# decodes 72.3 / 46.1, 48 prompt tokens + 32 decodes 62.6 / 45.4, 32 decodes 39.7 / 38.4; one decode 13.3 / 13.3.
INT4_BF16_FROM_DECODES_AMX = 16
# With AMX the codes themselves go through the tiles (int4_amx_kernel.py: expanded to the dense copy's bf16 values
# in registers) for bf16 steps from W4A8_FROM_ROWS rows (in place of the w4a8 op, which is then not built) up to the
# dense copy's threshold: such steps wait on streaming weights, and the codes are a quarter of the copy's bytes.
# A step of many decodes (INT4_BF16_FROM_DECODES_AMX) runs the copy from INT4_AMX_DENSE_FROM_ROWS_DECODES rows,
# where oneDNN's tiles outrun the expansion (76 prompt rows + 20 decodes 40.0 ms on this op, 39.0 on the copy; 100 +
# 17: 47.9 / 40.7, one-off A/B, 09:17 UTC). Whole steps, `benchmarks/profile_step.py --modes int4 --compare
# "int4_amx=0,int4_amx=1" --only "b=1 ,b=32,probe32,rows 16,rows 32,rows 64" --repeats 5` (2026-11-25 09:48 UTC, ms,
# off / on): 32 decodes 33.4 / 27.1, 16 prompt rows 18.5 / 14.1, 64 rows 39.0 / 27.2, one decode 10.9 / 10.6 (the
# int4 op either way: from 1 row this op took 14.2 ms there); with the op's fused path for up to 32 rows (10:37 UTC)
# 32 decodes 35.1 / 26.0, 16 rows 18.3 / 12.5.
INT4_AMX_FROM_ROWS = W4A8_FROM_ROWS
INT4_AMX_DENSE_FROM_ROWS_DECODES = 96


def cpu_has_amx_bf16() -> bool:
    """Whether the CPU has AMX tiles for bfloat16 (oneDNN's bf16 matmul then runs on them)."""
    return "amx_bf16" in int4_kernel.cpu_flags()


def int4_bf16_from_rows() -> int:
    """From how many rows an int4 model's bf16 steps run the dense bf16 copy: PACELINE_INT4_DENSE_FROM_ROWS; with AMX
    bf16 tiles INT4_BF16_FROM_ROWS_AMX; where the w4a8 op's VNNI build serves the rows below INT4_BF16_FROM_ROWS_VNNI;
    else INT4_BF16_FROM_ROWS."""
    if rows := dense_rows_from_env():
        return rows
    if cpu_has_amx_bf16():
        return INT4_BF16_FROM_ROWS_AMX
    return INT4_BF16_FROM_ROWS_VNNI if w4a8_kernel.isa() == "vnni" else INT4_BF16_FROM_ROWS


# what an int4 model's bfloat16 steps of many rows run: "bf16" (the dense bfloat16 copy from int4_bf16_from_rows()
# rows), "w4a8" (the int4 x int8 op from W4A8_FROM_ROWS rows as before, no dense copy); "auto": bf16 where the CPU
# has native bf16 math, else w4a8 (without it a bf16 matmul converts inside every call, WIDE_ABOVE's comment, and
# steps of more than 8 rows run in float32 anyway). PACELINE_INT4_WIDE=auto|bf16|w4a8 picks it for models built
# afterwards (a faster w4a8 op may take the wide steps back: compare with profile_step.py --compare
# "int4_wide=w4a8,int4_wide=bf16"); forcing bf16 on a CPU without bf16 math is for tests.
INT4_WIDE_CHOICES = ("auto", "bf16", "w4a8", "int8")
# "int8": the same steps from INT4_INT8_FROM_ROWS rows run W8A8Linear (int8 weights per output channel requantized
# from the dequantized codes at load, int8 activations per row, an int8 GEMM: w8a8_kernel.py) on the linears
# INT4_INT8_LINEARS names, in place of the dense bf16 copy (1 byte a weight instead of 2); the w4a8 op serves the
# rows below it as with "bf16". "auto" picks it where int8_gemm_pays(). On every linear and without outliers (the
# first version) it lost too much: top-1 agreement with fp32 91.41 %, perplexity 23.030 against 97.92 % / 22.295
# for the bf16 copy (fp32 22.319); on o and gate_up with 4 outliers a row it holds 97.28 % / 22.404 and whole steps
# gain 1.11-1.19x from 80 rows, 1.00x at 32 (benchmarks/summaries/w8a8.md, 2026-11-24 09:31-09:35 UTC).
# The threshold: the op on every linear (first version) from 16 rows against the bf16 default (w4a8 op below 72 rows,
# bf16 copy from 72), whole steps, one process (`benchmarks/profile_step.py --modes int4 --compare
# "int4_wide=bf16,int4_wide=int8+int4_bf16_from=16" --only "b=32,prefill 512,1500 in 512,rows 16,rows 24,rows
# 32,rows 64,rows 128,48-token" --repeats 3`, ended 09:19 UTC, ms): 16 rows 18.1 vs 21.7, 24 rows 21.4 vs 24.2,
# 32 rows 26.1 vs 26.7, 32 decodes 37.5 vs 37.7, 64 rows 42.9 vs 35.9, 80 rows (48-token chunk + 32 decodes) 68.5
# vs 50.9, 128 rows 83.4 vs 56.3. The w4a8 op and the int8 op meet between 32 and 64 rows, but the default starts
# it where the bf16 copy starts beside the VNNI op (72): with it at 36 (2026-11-24 09:35-10:14 UTC) a chat prompt of
# ~40 tokens ran int8 when prefilled whole and the w4a8 op once its prefix was cached, so a seeded sample changed
# between two identical requests (tests/entrypoints/test_openai_features_real.py); at 64 rows it gained only 1.05x.
INT4_INT8_FROM_ROWS = 72
# "int8" serves only these linears (LlamaLayer's names; the others keep the bf16 copy from int4_bf16_from_rows()),
# each row's INT4_INT8_OUTLIERS largest activations taken out of the int8 product. Why: per-row int8 activations
# cost most on qkv (its input, the normed residual, has a few huge channels) and down (large tokens); emulated on
# 4 held-out windows (benchmarks/summaries/w8a8.md, 09:20 UTC) o and gate_up with 4 outliers a row gave top-1
# 97.50 % and perplexity 21.278 (fp32 21.273), with qkv too 96.97 %. PACELINE_INT4_INT8_LINEARS=o:gate_up / "all"
# picks them for models built afterwards.
INT4_INT8_LINEARS: tuple[str, ...] = ("o", "gate_up")
INT4_INT8_OUTLIERS = 4


def int4_dense_from_rows(choice: str) -> int:
    """From how many rows an int4 model's steps leave the w4a8 / int4 ops for the dense path `choice` ("bf16" or
    "int8"): PACELINE_INT4_DENSE_FROM_ROWS (A/B runs; every dense linear alike) or the measured default."""
    return int4_bf16_from_rows() if choice == "bf16" else dense_rows_from_env() or INT4_INT8_FROM_ROWS


def dense_rows_from_env() -> int:
    """PACELINE_INT4_DENSE_FROM_ROWS as an int, 0 when unset."""
    env = os.environ.get("PACELINE_INT4_DENSE_FROM_ROWS", "")
    try:
        rows = int(env) if env else 0
    except ValueError:
        rows = -1
    if env and rows < W4A8_FROM_ROWS:
        raise ValueError(f"PACELINE_INT4_DENSE_FROM_ROWS must be an integer >= {W4A8_FROM_ROWS}, got {env!r}")
    return rows


def int4_int8_outliers() -> int:
    """INT4_INT8_OUTLIERS, or PACELINE_INT4_INT8_OUTLIERS (0..8, for A/B runs of quality and speed)."""
    env = os.environ.get("PACELINE_INT4_INT8_OUTLIERS")
    if env is None:
        return INT4_INT8_OUTLIERS
    if not env.isdigit() or int(env) > 8:
        raise ValueError(f"PACELINE_INT4_INT8_OUTLIERS must be an integer in 0..8, got {env!r}")
    return int(env)


def int4_int8_linears() -> tuple[str, ...]:
    """The linears an "int8" int4 model serves with W8A8Linear: INT4_INT8_LINEARS, or PACELINE_INT4_INT8_LINEARS."""
    return linears_from_env("PACELINE_INT4_INT8_LINEARS", INT4_INT8_LINEARS)


def int4_wide_choice(choice: str | None = None) -> str:
    """"bf16", "w4a8" or "int8": `choice`, else PACELINE_INT4_WIDE, else "auto", resolved for this CPU."""
    choice = choice or os.environ.get("PACELINE_INT4_WIDE") or "auto"
    if choice not in INT4_WIDE_CHOICES:
        raise ValueError(f"PACELINE_INT4_WIDE / int4_wide must be one of {', '.join(INT4_WIDE_CHOICES)}, "
                         f"got {choice!r}")
    if choice == "auto":
        if cpu_has_amx_bf16() and cpu_has_bf16_math():  # the tiles outrun every int8 op here (INT4_BF16_FROM_ROWS_AMX)
            return "bf16"
        if not cpu_has_bf16_math() or w4a8_serves_every_row():
            return "w4a8"
        return "int8" if int8_gemm_pays() else "bf16"
    return choice


# "auto" on a CPU where the w4a8 op runs its VNNI build with the row numerics (w4a8_kernel.numerics(): one
# conversion and two FMAs per row and block of 32 besides the 8 vpdpbusd, where the block numerics spent 5
# FMA-pipe operations) serves every int4 step of W4A8_FROM_ROWS rows or more with that op, and no dense copy is
# built (212 MB of bf16 copies spared for the bundled model, and their start-up). Whole steps of the bundled model,
# one process, the dense default ("int4_wide=int8": w4a8 op below 72 rows, then the int8 / bf16 copies) vs the op at
# every row count (`benchmarks/profile_step.py --modes int4 --compare "int4_wide=int8,kernels=ab9e9dd+int4_wide=w4a8,
# int4_wide=w4a8" --only "b=32,prefill 512,1500 in 512,128 prompt tokens,rows 12 ,rows 32 ,rows 128 ,rows 256 "
# --repeats 3`, 2026-11-25 03:40-03:50 UTC, ms; the middle column is the block numerics at every row count): a
# 512-token prefill 341.5 / 392.9 / 353.6, 1,500 tokens in 512-chunks 975.7 / 1106.1 / 974.7, 128 rows 81.1 /
# 74.0 / 66.9, 256 rows 149.0 / 168.7 / 133.6, 128 prompt tokens + 32 decodes 100.5 / 95.4 / 92.0; quality
# (whole 512-token windows, top-1 vs fp32 / KL) in benchmarks/summaries/w4a8_rows.md. Below 72 rows both already
# ran the op. PACELINE_W4A8_NUMERICS=block or PACELINE_INT4_WIDE=int8 / bf16 bring the dense copies back.
def w4a8_serves_every_row() -> bool:
    """Whether "auto" serves an int4 model's many-row steps with the w4a8 op (no dense copy): its VNNI build with
    the row numerics loads here."""
    return (w4a8_kernel.enabled() and w4a8_kernel.isa() == "vnni" and w4a8_kernel.numerics() == "row"
            and w4a8_kernel.load() is not None)


def int8_gemm_pays() -> bool:
    """Whether "auto" serves an int4 model's many-row steps with the int8 op: the CPU has AVX512-VNNI (an int8
    GEMM there does twice the multiply-adds per cycle of a bf16 one; without it oneDNN's int8 GEMM has no such
    lead) and the op's AVX-512 build loads (its torch stand-in is slower than the bf16 copy)."""
    return ("avx512_vnni" in int4_kernel.cpu_flags() and w8a8_kernel.isa() == "avx512"
            and w8a8_kernel.load() is not None)


def w8a8_build() -> str:
    """Which build of the int8 x int8 op serves an "int8" model's many-row steps ("off": torch ops), for keys of
    measured step times (the engine's start-up profile): the torch fallback's steps cost more."""
    build = w8a8_kernel.isa() if w8a8_kernel.enabled() else "off"
    silu = {"1": "", "f32": ":silu32", "0": ":nosilu"}[w8a8_fused_silu()]
    return f"{build}:{'+'.join(int4_int8_linears())}:t{int4_int8_outliers()}{silu}"


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


# A float32 model's layer linears whose weights are exactly a 4-bit GGUF's dequantized codes (exact_int4_codes):
# steps of up to F32_CODES_ROWS rows run paceline's int4 op on the codes with float32 scales and zeros (the same
# weights, 0.75 bytes each read instead of 4; the sums in another order, float32 rounding), more rows the float32
# copy. Why: a float32 decode step was bound by streaming ~540 MB of weights; on the codes, decode at batch 1 ran
# 76.8-92.6 against 43.0-46.9 tok/s (docs/performance.md, benchmarks/f32_from_codes.py). PACELINE_F32_CODES=0: the
# float32 copy alone (the A/B)
F32_CODES = os.environ.get("PACELINE_F32_CODES", "1") != "0"
F32_CODES_ROWS = 6  # the op's few-row path (int4_kernel FEW_ROWS); at 8 rows neither way won clearly (2026-11-29)


def q4_1_grid(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes, scale, minimum, float32 weight) of `weight` on Q4_1's grid: int4_codes with the scale rounded to
    float16 as Q4_1's d is, and code * d + minimum per group of INT4_GROUP inputs."""
    n, k = weight.shape
    codes, scale, lo = int4_codes(weight)
    d = scale.to(torch.float16).float()
    return codes, d, lo, (codes.view(n, -1, INT4_GROUP).float() * d[..., None] + lo[..., None]).view(n, k)


def exact_int4_codes(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(codes, scale, minimum) per group of INT4_GROUP inputs that give the float32 `weight` back bit for bit as
    code * scale + minimum (q4_1_grid); None for any other weight."""
    if weight.shape[1] % INT4_GROUP or weight.dtype != torch.float32:
        return None
    codes, d, lo, back = q4_1_grid(weight)
    return (codes, d, lo) if torch.equal(back, weight) else None


class Int4Linear:
    """y = x W^T (+ b) with W held as 4-bit codes in groups of INT4_GROUP inputs (see int4_codes): 8x fewer bytes
    than float32 to stream per step, which is what small-batch decode on a CPU waits for. Uses torch's CPU int4
    matmul, whose activations are bfloat16; the kernel computes (code - 8) * scale + zero, so zero = min + 8 scale.
    Where paceline's own C++ op builds (int4_kernel.py: each tile of codes read once for all of a step's rows, the
    same numbers within float32 rounding), it replaces torch's op and holds the codes in its own layout instead.

    Both re-expand the codes per step, so they lose to a dense bfloat16 matmul once a step has more than a few
    rows (measured here with torch's op: decode at batch 8 about even, batch 32 int4 545 vs bf16 672 tok/s,
    prefill int4 0.4-0.7x). Steps with more than DENSE_ABOVE rows therefore use a dense bfloat16 copy of the same
    dequantized weights: int4 speed where bandwidth bounds, bf16 speed where compute does, for 1.25x the
    memory of the bf16 weights alone."""

    DENSE_ABOVE = 8
    is_exact = False  # a float32 weight held as its exact codes too (Int4Linear.exact)

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, wide: str | None = None,
                 kernel_rows: int = 0, w4a8: bool = False, bf16_from: int | None = None, dense: str = "bf16"):
        codes, scale, lo = int4_codes(weight)
        self.kernel = int4_kernel.load()
        # rows up to which paceline's own int4 op serves any step, float32 (wide) inputs included; 0: DENSE_ABOVE
        self.kernel_rows = max(kernel_rows, self.DENSE_ABOVE) if self.kernel is not None else 0
        if self.kernel is not None:
            self.packed = int4_kernel.pack(codes, scale, lo + 8 * scale)
        else:
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
            self.scales_zeros = torch.stack([scale, lo + 8 * scale], -1).transpose(0, 1).contiguous().to(dtype)
        self.bias = bias
        n, k = codes.shape
        self.out_features = n
        # w4a8: the int4 x int8 op (w4a8_kernel.py) serves steps of at least W4A8_FROM_ROWS rows where it builds:
        # the same codes with exact float32 scales and minimums, activations rounded to int8 (per block of 32, or per
        # row refined per block by powers of two: w4a8_kernel.numerics()). It
        # was faster than the float32 copy and the int4 op at every row count measured, so with it (and float32
        # wide steps) the dense copy, 4 bytes a weight, is not built at all.
        # bf16_from (bfloat16 steps only, no float32 wide steps): steps of at least this many rows run the dense
        # bfloat16 copy (dense="bf16"), or its int8 requantization (dense="int8": W8A8Linear); the w4a8 op then
        # serves only the rows between W4A8_FROM_ROWS and bf16_from, if any
        self.bf16_from = bf16_from if bf16_from is not None and not wide and dtype == torch.bfloat16 else None
        # with AMX bf16 tiles a step of this many decodes runs the dense copy too (INT4_BF16_FROM_DECODES_AMX)
        self.bf16_decodes_from = (INT4_BF16_FROM_DECODES_AMX if self.bf16_from is not None and dense == "bf16"
                                  and cpu_has_amx_bf16() else None)
        # the codes in the AMX op's layout (INT4_AMX_FROM_ROWS), where it builds and the dense copy is bf16
        self.amx = (int4_amx_kernel.pack(codes, scale, lo) if self.bf16_decodes_from is not None
                    and int4_amx_kernel.supports(*codes.shape) and int4_amx_kernel.load() is not None else None)
        use_w4a8 = (w4a8 and self.kernel is not None and wide != "int8" and self.amx is None
                    and (self.bf16_from is None or self.bf16_from > W4A8_FROM_ROWS) and w4a8_kernel.load() is not None)
        self.w4a8 = w4a8_kernel.pack(codes, scale, lo, nibbles=True) if use_w4a8 else None
        if use_w4a8 and self.bf16_from is None and W4A8_FROM_ROWS <= self.kernel_rows + 1:
            self.dense = None  # fewer rows: the int4 op; more: this op
            return
        dequantized = (lo[..., None] + codes.view(n, -1, INT4_GROUP) * scale[..., None]).view(n, k)
        # wide: the dense copy serves the float32 steps the model runs for many rows (float32 or int8); else bf16
        if wide:
            self.dense = wide_linear(dequantized, bias, True, wide)
        elif dense == "int8" and self.bf16_from is not None:
            self.dense = W8A8Linear(dequantized, bias, dtype, outliers=int4_int8_outliers())
        else:
            self.dense = Linear(dequantized.to(dtype).contiguous(), None if bias is None else bias.to(dtype), pack=True,
                                few_rows=False)  # the int4 op serves the few rows

    @classmethod
    def exact(cls, weight: torch.Tensor, bias: torch.Tensor | None, codes: torch.Tensor, scale: torch.Tensor,
              lo: torch.Tensor, pack: bool) -> "Int4Linear":
        """A float32 weight held twice (F32_CODES): its 4-bit codes with float32 scales and zeros for steps of up to
        F32_CODES_ROWS rows (the int4 op), the float32 Linear for more."""
        self = cls.__new__(cls)
        self.kernel = int4_kernel.load()
        self.kernel_rows = F32_CODES_ROWS
        self.packed = int4_kernel.pack(codes, scale, lo + 8 * scale, exact=True)
        self.bias, self.out_features = bias, weight.shape[0]
        self.bf16_from = self.bf16_decodes_from = self.amx = self.w4a8 = None
        self.dense = Linear(weight, bias, pack, few_rows=False)
        self.is_exact = True
        return self

    @staticmethod
    def supports(weight: torch.Tensor, dtype: torch.dtype) -> bool:
        return (weight.device.type == "cpu" and dtype == torch.bfloat16 and weight.shape[1] % INT4_GROUP == 0
                and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"))

    def gated(self, x: torch.Tensor, decodes: int = 0) -> torch.Tensor | None:
        """silu(gate) * up of this (gate/up) linear's output where the step runs W8A8Linear and it fuses them
        (W8A8Linear.gated); None elsewhere, where the caller runs silu_mul over __call__'s output."""
        if isinstance(self.dense, W8A8Linear) and self.path(x.shape[0], x.dtype, decodes) == "dense":
            return self.dense.gated(x)
        return None

    def path(self, rows: int, dtype: torch.dtype, decodes: int = 0) -> str:
        """Which product serves a step of `rows` rows of `dtype` (the same in every layer of a step): "dense" (the
        dense copy, as it is), "amx" (the codes on the AMX tiles), "w4a8" (the int4 x int8 op), "int4" (paceline's
        int4 op), "dense_cast" (the dense copy in its own dtype, cast back) or "torch_int4" (torch's int4 op).
        __call__ runs it; the C++ layer loop (layer_loop.py) asks it once per step."""
        if self.is_exact:
            return "int4" if rows <= self.kernel_rows else "dense"
        if self.bf16_from is not None and dtype == torch.bfloat16 and rows >= self.bf16_from:
            return "dense"
        if (self.amx is not None and dtype == torch.bfloat16 and rows >= INT4_AMX_FROM_ROWS
                and int4_amx_kernel.load() is not None):  # None: a snapshot made here, switched off since
            many = self.bf16_decodes_from is not None and decodes >= self.bf16_decodes_from
            return "dense" if many and rows >= INT4_AMX_DENSE_FROM_ROWS_DECODES else "amx"
        if self.bf16_from is not None and dtype == torch.bfloat16 and (
                self.bf16_decodes_from is not None and decodes >= self.bf16_decodes_from):
            return "dense"
        # w4a8_kernel.op() None: a snapshot built with the op, mapped where it cannot build (int4 op below)
        if self.w4a8 is not None and rows >= W4A8_FROM_ROWS and w4a8_kernel.op() is not None:
            return "w4a8"
        if self.kernel is not None and (rows <= self.kernel_rows or self.dense is None or self.bf16_from is not None):
            return "int4"  # reads x as float32, returns x's dtype
        if rows > self.DENSE_ABOVE or dtype == torch.float32:
            return "dense_cast"
        return "int4" if self.kernel is not None else "torch_int4"

    def __call__(self, x: torch.Tensor, decodes: int = 0) -> torch.Tensor:
        path = self.path(x.shape[0], x.dtype, decodes)
        if path == "dense":
            return self.dense(x)
        if path == "amx":
            return int4_amx_kernel.load()(x, *self.amx, self.bias)
        if path == "w4a8":
            return w4a8_kernel.op()(x, self.w4a8, self.out_features, self.bias, True, w4a8_kernel.MAX_R)
        if path == "int4":
            return self.kernel(x, self.packed, self.out_features, self.bias)
        if path == "dense_cast":
            return self.dense(x.to(self.dense.dtype)).to(x.dtype)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, INT4_GROUP, self.scales_zeros)
        return y if self.bias is None else y + self.bias


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None, pack: bool, quantization: str,
                dtype: torch.dtype, wide: str | None = None, int4_rows: int = 0, name: str = "",
                bf16_from: int | None = None, int4_dense: str = "bf16") -> "Linear | Int4Linear":
    """wide: None, or what serves the model's float32 (wide) steps: "fp32" or "int8" (see wide_linear). name: the
    layer's name for it (W4A8_LINEARS). bf16_from: int4 steps of at least this many rows run a dense bf16 copy,
    or with int4_dense="int8" a W8A8Linear."""
    if quantization == "int4":
        if not Int4Linear.supports(weight, dtype):
            raise ValueError(f"int4 quantization needs a CPU, dtype bfloat16 and input sizes that are multiples "
                             f"of {INT4_GROUP}; got {weight.device.type}, {dtype} and {weight.shape[1]}")
        if int4_dense == "int8" and name not in int4_int8_linears():  # this one keeps the bf16 copy
            int4_dense, bf16_from = "bf16", int4_bf16_from_rows() if bf16_from is not None else None
        return Int4Linear(weight, None if bias is None else bias.to(dtype), dtype, wide, int4_rows,
                          w4a8=name in w4a8_linears(), bf16_from=bf16_from, dense=int4_dense)
    if (F32_CODES and dtype == torch.float32 and weight.dim() == 2 and weight.device.type == "cpu"
            and int4_kernel.load() is not None):
        weight = weight.float()
        exact = exact_int4_codes(weight)
        if exact is not None:
            return Int4Linear.exact(weight.contiguous(), None if bias is None else bias.float(), *exact, pack)
    # the wide copy comes from the checkpoint's weight, not from its rounding to the run dtype
    lin = Linear(weight.to(dtype).contiguous(), None if bias is None else bias.to(dtype), pack)
    if wide and dtype != torch.float32:
        lin.wide = wide_linear(weight, bias, pack, wide)
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
                 dtype: torch.dtype | None = None, wide: str | None = None, int4_rows: int = 0,
                 bf16_from: int | None = None, int4_dense: str = "bf16"):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.eps = arch.rms_norm_eps
        self.scale = arch.head_dim ** -0.5
        dtype = dtype or w["qkv"].dtype
        self.qkv = make_linear(w["qkv"], w.get("qkv_bias"), pack, quantization, dtype, wide, int4_rows, "qkv",
                               bf16_from, int4_dense)
        self.o = make_linear(w["o"], None, pack, quantization, dtype, wide, int4_rows, "o", bf16_from, int4_dense)
        self.gate_up = make_linear(w["gate_up"], None, pack, quantization, dtype, wide, int4_rows, "gate_up",
                                   bf16_from, int4_dense)
        # int8 wide steps keep `down` in float32: its input has outliers that belong to tokens (up to ~90x the
        # row's median), which neither smoothing nor fixed outlier channels catch; int8 there alone cost ~3 % of
        # top-1 agreement on the bundled model (benchmarks/summaries/int8_wide.md)
        # (and the int4 x int8 op does not serve it either there: int8 wide steps are a choice of their own)
        self.down = make_linear(w["down"], None, pack, quantization, dtype, "fp32" if wide == "int8" else wide,
                                int4_rows, "" if wide == "int8" else "down", bf16_from, int4_dense)
        self.int4 = all(isinstance(lin, Int4Linear) for lin in (self.qkv, self.o, self.gate_up, self.down))
        self.register_buffer("input_norm", w["input_norm"])
        self.register_buffer("post_norm", w["post_norm"])
        # float32 steps (wide) read float32 norm weights: rms_norm wants its input's dtype
        self.norms32 = (w["input_norm"].float(), w["post_norm"].float()) if wide else None
        # on CPU the norms, RoPE and SiLU * up run as one C++ pass each (fused_kernel.py) where the sizes fit
        inter = w["down"].shape[1]
        self.fused = (fused_kernel.load() if w["qkv"].device.type == "cpu"
                      and fused_kernel.supports(w["input_norm"].shape[0], self.head_dim, inter) else None)

    def forward(self, h: torch.Tensor, rope: torch.Tensor, meta: AttnMetadata, k_cache: torch.Tensor,
                v_cache: torch.Tensor, keep: tuple[torch.Tensor, AttnMetadata | None] | None = None) -> torch.Tensor:
        """keep (row indices, their metadata as one-token slices, None for no rows): a step's last layer where only
        those rows feed logits (LlamaModel.forward_layers): every row's K/V still goes into the cache, then only the
        kept rows go on through attention, o and the MLP, and the result holds those rows, in keep's order."""
        t = h.shape[0]
        nh, nkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        input_norm, post_norm = self.input_norm, self.post_norm
        if h.dtype != input_norm.dtype and self.norms32 is not None:
            input_norm, post_norm = self.norms32
        f = self.fused
        # an int4 layer's linears also hear how many decodes the step holds (Int4Linear.path)
        kw = {"decodes": meta.num_decodes} if self.int4 else {}
        if f is not None and h.dtype in (torch.float32, torch.bfloat16):
            qkv = self.qkv(f.rms_norm(h, input_norm, self.eps), **kw)
            qk = f.rope(qkv, torch.view_as_real(rope), nh + nkv, d)  # rope [T, 1, d/2] complex: (cos, sin) pairs
            v = qkv[:, (nh + nkv) * d:].view(t, nkv, d)
            if keep is not None:
                qk, v, h, meta, kw = self._keep(qk, v, h, meta, k_cache, v_cache, keep)
                if meta is None:  # no row feeds logits: the K/V were all this layer owed the step
                    return h
            attn = paged_attention(qk[:, :nh], qk[:, nh:], v, k_cache, v_cache, meta, self.scale)
            h, x = f.add_rms_norm(h, self.o(attn, **kw), post_norm, self.eps)
            gated = self.gate_up.gated(x, **kw) if self.int4 else None
            return h + self.down(gated if gated is not None else f.silu_mul(self.gate_up(x, **kw)), **kw)
        x = F.rms_norm(h, (h.shape[-1],), input_norm, self.eps)
        qkv = self.qkv(x, **kw)
        qk = qkv[:, : (nh + nkv) * d].view(t, nh + nkv, d // 2, 2)
        if qk.dtype != torch.float32:
            qk = qk.float()
        qk = torch.view_as_real(torch.view_as_complex(qk) * rope).view(t, nh + nkv, d).to(h.dtype)
        v = qkv[:, (nh + nkv) * d:].view(t, nkv, d)
        if keep is not None:
            qk, v, h, meta, kw = self._keep(qk, v, h, meta, k_cache, v_cache, keep)
            if meta is None:
                return h
        attn = paged_attention(qk[:, :nh], qk[:, nh:], v, k_cache, v_cache, meta, self.scale)
        h = h + self.o(attn, **kw)
        x = F.rms_norm(h, (h.shape[-1],), post_norm, self.eps)
        gate, up = self.gate_up(x, **kw).chunk(2, dim=-1)
        return h + self.down(F.silu(gate).mul_(up), **kw)

    def _keep(self, qk: torch.Tensor, v: torch.Tensor, h: torch.Tensor, meta: AttnMetadata, k_cache: torch.Tensor,
              v_cache: torch.Tensor, keep: tuple[torch.Tensor, AttnMetadata | None]) -> tuple:
        """forward's keep: every row's K/V into the cache (later steps read them), then the kept rows' qk, v, h, their
        metadata and the linears' keywords."""
        write_kv(qk[:, self.num_heads:], v, k_cache, v_cache, meta.slot_mapping)
        rows, meta = keep
        kw = {"decodes": meta.num_decodes} if self.int4 and meta is not None else {}
        return qk[rows], v[rows], h[rows], meta, kw


class LlamaModel(nn.Module):
    """Inference-only Llama-family model; weights are buffers built by `from_weights`."""

    # the linears the C++ layer loop knows, by role (layer_loop.LayerLoop reads them here)
    LINEAR_CLASSES = {"int4": Int4Linear, "plain": Linear, "w8a8": W8A8Linear}

    def __init__(self, arch: ModelArch, layers: list[dict[str, torch.Tensor]], embed: torch.Tensor, norm: torch.Tensor,
                 lm_head: torch.Tensor | None, max_positions: int | None = None, pack: bool = True,
                 quantization: str = "none", wide_above: int | str | None = "auto", wide_linears: str = "auto",
                 int4_rows: int | None = None, int4_wide: str | None = None, int4_bf16_from: int | None = None,
                 head_source: torch.Tensor | None = None):
        super().__init__()
        self.arch = arch
        self.quantization = quantization
        if wide_above == "auto":
            wide_above = (WIDE_ABOVE if embed.device.type == "cpu" and embed.dtype != torch.float32
                          and not cpu_has_bf16_math() else None)
        # Steps with more than `wide_above` tokens run in float32 (None: never), reading float32 copies of the
        # layer weights; the KV cache, the LM head and small steps stay in the run dtype.
        self.wide_above = wide_above if embed.dtype != torch.float32 else None
        if wide_linears not in WIDE_LINEARS:
            raise ValueError(f"wide_linears must be one of {', '.join(WIDE_LINEARS)}, got {wide_linears!r}")
        if wide_linears == "auto":
            wide_linears = AUTO_WIDE_LINEARS
        if wide_linears == "int8" and not Int8Linear.supports(embed):
            wide_linears = "fp32"  # no x86 quantized engine (or not a CPU): float32 copies serve
        # what the wide steps' linears run: None when there are no wide steps
        self.wide_linears = wide = wide_linears if self.wide_above is not None else None
        # the LM head (and the embedding it may share) stays in the run dtype: GGUFs keep it at 6-8 bits
        int4_rows = INT4_KERNEL_ROWS if int4_rows is None else int4_rows
        # int4 steps that stay in bfloat16 (no float32 wide steps): from how many rows a dense bf16 copy serves them
        # and whether that copy is bfloat16 ("bf16") or int8 (W8A8Linear)
        self.int4_bf16_from, self.int4_dense = None, "bf16"
        choice = int4_wide_choice(int4_wide) if quantization == "int4" else None
        if quantization == "int4" and wide is None and embed.dtype == torch.bfloat16 and choice in ("bf16", "int8"):
            self.int4_dense = choice
            default_from = int4_dense_from_rows(choice)
            self.int4_bf16_from = default_from if int4_bf16_from is None else int4_bf16_from
        self.layers = nn.ModuleList(LlamaLayer(arch, w, pack, quantization, embed.dtype, wide, int4_rows,
                                               self.int4_bf16_from, self.int4_dense) for w in layers)
        self.norm32 = norm.float() if wide else None
        self.register_buffer("embed", embed)
        self.register_buffer("norm", norm)
        head = embed if lm_head is None else lm_head  # tied: shares the embedding
        # a bfloat16 model whose head was a GGUF's Q8_0 tensor (head_source: its values before the rounding to
        # bfloat16): the head runs on those codes against int8 activations (q8_kernel.py), every row of every
        # step, where the op loads (AVX512-VNNI): half the bytes of the bf16 head and twice its multiply-adds per
        # instruction (whole int4 steps 1.02-1.19x; top-1 vs fp32 97.82 against 96.99 %, KL 0.0017 against 0.0021:
        # benchmarks/summaries/q8_head.md). The bf16 weight then stays plain (no packed copy, no float32 copy): the
        # embedding itself.
        self.q8_head = None
        if (head_source is not None and head.dtype == torch.bfloat16 and head.device.type == "cpu"
                and q8_kernel.load() is not None):
            self.q8_head = q8_kernel.Q8Head.from_weight(head_source, q8_kernel.outliers())
        q8 = self.q8_head is not None
        # the few rows of a decode or a verification on a CPU without native bf16 math: paceline's op reads the
        # bf16 weight once for all rows (logits_kernel.py). With wide steps, oneDNN's bf16 matmul would then serve
        # no row at all, so it is left unpacked (the plain weight is the embedding itself when tied: no copy).
        op = (logits_kernel.load() if head.device.type == "cpu" and head.dtype == torch.bfloat16
              and head.shape[1] % 8 == 0 and not cpu_has_bf16_math() and not q8 else None)
        self.few_row_logits = logits_kernel.FewRowLogits(head, op) if op is not None else None
        self.lm_head = Linear(head, None, pack and not q8 and not (self.few_row_logits is not None and wide))
        if wide and not q8:  # logits of many rows (a batch of decodes) in float32 too: several times faster than bf16
            self.lm_head.wide = wide_linear(head, None, pack, wide)
        self.max_positions = max_positions or arch.max_position_embeddings
        self.register_buffer("rope", rope_table(arch, self.max_positions, embed.device))
        # whether a step's layers run in one C++ call (layer_loop.py; PACELINE_LAYER_LOOP, read at build)
        self.layer_loop = layer_loop.enabled()
        if wide == "int8":
            self._calibrate_int8()

    def few_rows(self) -> int:
        """Steps of up to this many rows run the float32 few-row product (f32_rows_kernel) in every layer; 0: none.
        The step-time model prices the step up to oneDNN's packed weights above it (core/step_time.py)."""
        lin = self.layers[0].qkv if len(self.layers) else None
        if isinstance(lin, Linear) and lin.keep_plain and f32_rows_kernel.op() is not None:
            return f32_rows_kernel.MAX_ROWS
        return 0

    CALIBRATION_TOKENS = 128

    def _wide_slots(self) -> list[tuple[object, str]]:
        """(owner, attribute) of every copy that serves wide steps."""
        slots = []
        for layer in self.layers:
            for lin in (layer.qkv, layer.o, layer.gate_up, layer.down):
                slots.append((lin, "dense" if isinstance(lin, Int4Linear) else "wide"))
        return slots + [(self.lm_head, "wide")]

    @torch.inference_mode()
    def _calibrate_int8(self) -> None:
        """Run CALIBRATION_TOKENS fixed pseudo-random token ids as one wide prefill through the float32 stand-ins,
        then replace each by an Int8Linear smoothed with the input magnitudes it saw. Random ids stand in for
        text: the large channels come from the weights (they are the same for any input), which is what the
        smoothing needs; the held-out quality (benchmarks/quality.py) is the check that this holds."""
        # more rows than the int4 codes serve (Int4Linear.kernel_rows): the stand-ins must see the calibration pass
        kernel_rows = max((getattr(lin, "kernel_rows", 0) for lin, _ in self._wide_slots()), default=0)
        n, bs = min(max(self.CALIBRATION_TOKENS, self.wide_above + 1, kernel_rows + 1), self.max_positions), 16
        ids = torch.randint(0, self.arch.vocab_size, (n,), generator=torch.Generator().manual_seed(0))
        blocks = (n + bs - 1) // bs
        kv = torch.zeros(len(self.layers), 2, blocks, bs, self.arch.num_kv_heads, self.arch.head_dim,
                         dtype=self.dtype, device=self.device)
        meta = build_metadata([SeqSlice(0, n, list(range(blocks)))], bs, self.device)
        hidden = self.forward(ids.to(self.device), torch.arange(n, device=self.device), meta, kv)
        self.compute_logits(hidden)
        for owner, attr in self._wide_slots():
            stand_in = getattr(owner, attr)
            if isinstance(stand_in, Calibrating):
                setattr(owner, attr, stand_in.int8())

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
                     wide_above: int | str | None = "auto", wide_linears: str = "auto",
                     int4_rows: int | None = None, int4_wide: str | None = None,
                     int4_bf16_from: int | None = None) -> "LlamaModel":
        """Build from Hugging Face-named tensors; a missing tensor is a ValueError naming it.

        pack=False keeps plain F.linear weights (no oneDNN prepacking). quantization="int4" holds the layers'
        linear weights as 4-bit codes (Int4Linear; CPU, bfloat16): give it the float32 weights, so that a
        Q4_1 GGUF's codes are recovered before any rounding to the run dtype.

        wide_above: steps with more tokens than this run in float32 ("auto": WIDE_ABOVE for a bfloat16/float16
        model on a CPU without native bf16 math, else never; None: never). wide_linears: what those steps' linears
        run, "fp32" (float32 copies of the weights) or "int8" (Int8Linear, where torch has the x86 quantized
        engine); "auto": AUTO_WIDE_LINEARS.

        int4_wide: "auto", "bf16" or "w4a8" (None: PACELINE_INT4_WIDE, else auto; see int4_wide_choice): whether
        an int4 model's bfloat16 steps of at least int4_bf16_from rows (None: int4_bf16_from_rows()) run a dense
        bf16 copy."""
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
            lm_head, head_source = None, weights["model.embed_tokens.weight"]
        else:
            lm_head, head_source = put(weights["lm_head.weight"]), weights["lm_head.weight"]
        # the head's values before the rounding to bfloat16, where they can still be a Q8_0 tensor's (q8_kernel)
        head_source = head_source if dtype == torch.bfloat16 and head_source.dtype == torch.float32 else None
        return cls(arch, layers, embed, put(get("model.norm.weight")), lm_head, max_positions, pack, quantization,
                   wide_above, wide_linears, int4_rows, int4_wide, int4_bf16_from, head_source)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata,
                kv_cache: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [T] -> final-normed hidden states [T, hidden]; kv_cache [layers, 2, blocks, bs, kvh, d]."""
        return drain(self.forward_layers(input_ids, positions, meta, kv_cache))

    def forward_layers(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata,
                       kv_cache: torch.Tensor, span: int | None = None,
                       keep: tuple[torch.Tensor, AttnMetadata | None] | None = None
                       ) -> Generator[None, None, torch.Tensor]:
        """forward, suspended after every layer (a bare `yield`); returns the hidden states. Why: several models in
        one loop (engine/multi.py) run another model's whole step between two layers of a long one, so that
        model's streams wait for one layer of it rather than the whole step. forward is this, run through.

        Where the C++ layer loop runs the step (layer_loop.py), it yields after every `span` layers instead (None:
        every layer in one call): the runner asks for 1 where the step may be suspended (ModelRunner.execute_iter)
        and None where nothing suspends it (execute).

        keep (row indices, their metadata as one-token slices; ModelRunner.keep_rows): the rows whose hidden states
        the caller needs (those that feed logits). The last layer then runs only those rows past its K/V (Layer's
        keep), and the result holds them, in keep's order. Why: a prompt chunk needs the last layer's K/V of every
        token but its attention, o and MLP for its last token at most (~3 % of a 1,500-token prompt's step)."""
        h = F.embedding(input_ids, self.embed)
        norm = self.norm
        if self.wide_above is not None and h.shape[0] > self.wide_above:
            h, norm = h.float(), self.norm32
        rope = self.rope[positions].unsqueeze(1)  # [T, 1, d/2], shared by every layer
        loop = self._layer_loop(h, meta)
        if loop is not None:  # the same ops, called from C++: the same bits without ~10 Python op calls a layer
            stack, paths = loop
            rot, n = torch.view_as_real(rope), len(self.layers)
            whole = n - 1 if keep is not None else n  # the layers run for every row
            span = span or n
            for first in range(0, whole, span):
                h = stack.run(h, rot, kv_cache, meta, first, min(first + span, whole), paths)
                yield
            if keep is not None:
                h = self.layers[-1](h, rope, meta, kv_cache[n - 1, 0], kv_cache[n - 1, 1], keep)
                yield
        else:
            last = len(self.layers) - 1
            for i, layer in enumerate(self.layers):
                h = layer(h, rope, meta, kv_cache[i, 0], kv_cache[i, 1], keep if i == last else None)
                yield
        fused = self.layers[0].fused if len(self.layers) else None
        if fused is not None and h.dtype in (torch.float32, torch.bfloat16):
            return fused.rms_norm(h, norm, self.arch.rms_norm_eps)
        return F.rms_norm(h, (h.shape[-1],), norm, self.arch.rms_norm_eps)

    def _layer_loop(self, h: torch.Tensor, meta: AttnMetadata) -> tuple[layer_loop.LayerLoop, tuple] | None:
        """The C++ layer loop and this step's products, where it runs this step exactly as the Python loop
        would (layer_loop.py): on, built here, the fused path and the attention op, a step in the layers' dtype."""
        # (a bf16 step whose long prompt chunks run SDPA beside the op, attention.prefill_sdpa, runs in Python)
        if (not getattr(self, "layer_loop", False) or meta.kernel is None or not len(self.layers)
                or (meta.sdpa_prefill and h.dtype == torch.bfloat16)
                or h.dtype not in (torch.float32, torch.bfloat16) or h.dtype != self.layers[0].input_norm.dtype):
            return None
        loop = layer_loop.for_model(self)
        paths = loop.paths(h.shape[0], h.dtype, meta.num_decodes) if loop is not None else None
        return None if paths is None else (loop, paths)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [N, vocab] for the rows that need a sample, in float32."""
        if self.q8_head is not None:
            logits = self.q8_head(hidden)
            # None: a snapshot built with the op, mapped where it does not load: the plain bf16 weight serves
            return logits if logits is not None else self.lm_head(hidden.to(self.dtype)).float()
        wide = self.wide_above is not None and hidden.shape[0] > self.wide_above
        if not wide and self.few_row_logits is not None and hidden.shape[0] <= logits_kernel.MAX_ROWS:
            return self.few_row_logits(hidden)
        return self.lm_head(hidden.float() if wide else hidden.to(self.dtype)).float()
