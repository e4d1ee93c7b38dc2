"""Every decoder layer of a step in one C++ call (CPU): the layer loop of LlamaModel.forward_layers, with the same
ops called through the c10 dispatcher instead of from Python.

Why: a one-row int4 decode step of the bundled model took ~10 ms, and `perf record` of 1,200 of them (2026-11-25
03:22 UTC) had ~44 % of the main thread in the interpreter and torch's Python bindings: ~300 op calls a step (30
layers x ~10: the fused norms and RoPE, the linear whose path Int4Linear.__call__ picks, the attention op's wrapper
with its casts, the views, the residual add), each paying the Python call, its argument parsing and the op lookup.
Here Python decides once per step which product serves each linear (the row count is the same in every layer:
Int4Linear.path, the one place those thresholds live), and a `LayerStack` object built once per model, holding
every layer's weights for every product it can run, runs the layers back to back in C++.

Bit for bit: the stack calls the very ops the Python loop calls (paceline's own through their registered schemas,
oneDNN's prepacked linear as `mkldnn::_linear_pointwise`, torch's `linear`, `to` and `add` through ATen), with the
same arguments in the same order, so every tensor it produces has the bits the Python loop's has
(tests/model/test_layer_loop.py checks the logits).

What it covers: the fused path (fused_kernel's ops) with the attention op (attention_kernel), on float32 and
bfloat16 steps of a model whose layers all run one kind of product per linear: Int4Linear's int4 op, w4a8 op, AMX
op, dense bf16 copy (oneDNN) or W8A8Linear copy (with its fused SiLU * up for gate_up), and plain Linear (oneDNN
prepacked, or F.linear before packing, or f32_rows_kernel's op for a float32 step of few rows). Anything else
(CUDA, float32 wide steps of a bf16 model, the eager attention, a product the stack does not know) returns None
from `LayerLoop.paths` and the Python loop runs.
`PACELINE_LAYER_LOOP=0` switches it off for models built afterwards (A/B runs).

A step that nothing suspends (ModelRunner.execute: one model serving) runs every layer in one call; a step that
several models' loop may suspend between two layers (ModelRunner.execute_iter, engine/multi.py) runs one call per
layer and yields after each, as the Python loop did.

Built once with the system compiler and cached like the other kernels (int4_kernel.load_op).
"""
from __future__ import annotations

import hashlib
import os
import weakref
from pathlib import Path
from typing import Any

import torch

from paceline.model import int4_amx_kernel, int4_kernel

SOURCE = r"""
#include <torch/custom_class.h>
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <array>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace {

using at::Tensor;
using OptTensor = std::optional<at::Tensor>;

// products a linear can run (LayerLoop.PATHS names them in this order)
enum Path : int64_t { INT4 = 0, W4A8 = 1, DENSE = 2, W8A8 = 3, W8A8_SILU = 4, INT4_AMX = 5, F32_ROWS = 6,
                      NUM_PATHS = 7 };
enum Kind : int64_t { QKV = 0, O = 1, GATE_UP = 2, DOWN = 3, NUM_KINDS = 4 };

// one layer's weights for one product of one linear
struct Lin {
  bool set = false;
  bool packed = false;   // DENSE: a oneDNN packed weight (else a plain one for aten::linear)
  Tensor w;              // the codes / packed or plain weight / int8 weight
  Tensor a;              // W8A8: column scales
  OptTensor bias;
  OptTensor smooth;      // W8A8: inverse SmoothQuant factors
  int64_t n = 0;         // INT4 / W4A8: output features; W8A8: outliers
  bool flag = false;     // W8A8_SILU: rounded
};

struct Layer {
  Tensor input_norm, post_norm;
  std::array<std::array<Lin, NUM_PATHS>, NUM_KINDS> lin;
};

template <typename F>
c10::TypedOperatorHandle<F> find(const std::string& name) {
  auto at = name.find("::");
  TORCH_CHECK(at != std::string::npos, "layer_loop: op name must be ns::name, got ", name);
  return c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), "").typed<F>();
}

using RmsNorm = Tensor(const Tensor&, const Tensor&, double);
using AddRmsNorm = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, double);
using Rope = Tensor(const Tensor&, const Tensor&, int64_t, int64_t);
using SiluMul = Tensor(const Tensor&);
using Int4Mm = Tensor(const Tensor&, const Tensor&, int64_t, const OptTensor&, int64_t);
using W4a8Mm = Tensor(const Tensor&, const Tensor&, int64_t, const OptTensor&, bool, int64_t);
using Int4AmxMm = Tensor(const Tensor&, const Tensor&, const Tensor&, const OptTensor&);
using W8a8Mm = Tensor(const Tensor&, const Tensor&, const Tensor&, const OptTensor&, const OptTensor&, int64_t);
using W8a8Silu = Tensor(const Tensor&, const Tensor&, const Tensor&, const OptTensor&, const OptTensor&, int64_t, bool);
using F32RowsMm = Tensor(const Tensor&, const Tensor&, const OptTensor&);
using Attn = Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                    const Tensor&, const Tensor&, double);
using MkldnnLinear = Tensor(const Tensor&, const Tensor&, const OptTensor&, std::string_view,
                            c10::List<std::optional<at::Scalar>>, std::optional<std::string_view>);

struct LayerStack : torch::CustomClassHolder {
  int64_t nh, nkv, d;
  double eps, scale;
  std::vector<Layer> layers;
  std::optional<c10::TypedOperatorHandle<RmsNorm>> rms_norm_;
  std::optional<c10::TypedOperatorHandle<AddRmsNorm>> add_rms_norm_;
  std::optional<c10::TypedOperatorHandle<Rope>> rope_;
  std::optional<c10::TypedOperatorHandle<SiluMul>> silu_mul_;
  std::optional<c10::TypedOperatorHandle<Int4Mm>> int4_;
  std::optional<c10::TypedOperatorHandle<W4a8Mm>> w4a8_;
  std::optional<c10::TypedOperatorHandle<Int4AmxMm>> int4_amx_;
  std::optional<c10::TypedOperatorHandle<W8a8Mm>> w8a8_;
  std::optional<c10::TypedOperatorHandle<W8a8Silu>> w8a8_silu_;
  std::optional<c10::TypedOperatorHandle<F32RowsMm>> f32_rows_;
  std::optional<c10::TypedOperatorHandle<Attn>> attn_;
  c10::TypedOperatorHandle<MkldnnLinear> mkldnn_;
  c10::List<std::optional<at::Scalar>> no_scalars_;

  LayerStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps_, double scale_)
      : nh(num_heads), nkv(num_kv_heads), d(head_dim), eps(eps_), scale(scale_),
        mkldnn_(find<MkldnnLinear>("mkldnn::_linear_pointwise")) {
    TORCH_CHECK(nh > 0 && nkv > 0 && d > 0 && nh % nkv == 0, "layer_loop: bad head counts");
  }

  // which op serves a role, by its qualified name ("ns::name")
  void set_op(const std::string& role, const std::string& name) {
    if (role == "rms_norm") rms_norm_ = find<RmsNorm>(name);
    else if (role == "add_rms_norm") add_rms_norm_ = find<AddRmsNorm>(name);
    else if (role == "rope") rope_ = find<Rope>(name);
    else if (role == "silu_mul") silu_mul_ = find<SiluMul>(name);
    else if (role == "int4") int4_ = find<Int4Mm>(name);
    else if (role == "w4a8") w4a8_ = find<W4a8Mm>(name);
    else if (role == "int4_amx") int4_amx_ = find<Int4AmxMm>(name);
    else if (role == "w8a8") w8a8_ = find<W8a8Mm>(name);
    else if (role == "w8a8_silu") w8a8_silu_ = find<W8a8Silu>(name);
    else if (role == "f32_rows") f32_rows_ = find<F32RowsMm>(name);
    else if (role == "attention") attn_ = find<Attn>(name);
    else TORCH_CHECK(false, "layer_loop: unknown op role ", role);
  }

  int64_t add_layer(Tensor input_norm, Tensor post_norm) {
    Layer l;
    l.input_norm = std::move(input_norm);
    l.post_norm = std::move(post_norm);
    layers.push_back(std::move(l));
    return int64_t(layers.size()) - 1;
  }

  void add_linear(int64_t layer, int64_t kind, int64_t path, Tensor w, OptTensor a, OptTensor bias,
                  OptTensor smooth, int64_t n, bool flag) {
    TORCH_CHECK(layer >= 0 && layer < int64_t(layers.size()), "layer_loop: no layer ", layer);
    TORCH_CHECK(kind >= 0 && kind < NUM_KINDS && path >= 0 && path < NUM_PATHS, "layer_loop: bad kind/path ",
                kind, "/", path);
    Lin& l = layers[layer].lin[kind][path];
    l.w = std::move(w);
    if (path == W8A8 || path == W8A8_SILU || path == INT4_AMX) {
      TORCH_CHECK(a.has_value(), "layer_loop: a W8A8 / AMX linear needs its column scales / scales and minimums");
      l.a = *a;
    }
    l.packed = path == DENSE && flag;
    l.bias = std::move(bias);
    l.smooth = std::move(smooth);
    l.n = n;
    l.flag = flag;
    l.set = true;
  }

  Tensor linear(int64_t i, int64_t kind, int64_t path, const Tensor& x, int64_t w4a8_rows) {
    const Lin& l = layers[i].lin[kind][path];
    TORCH_CHECK(l.set, "layer_loop: layer ", i, " has no weights for linear ", kind, " on path ", path);
    switch (path) {
      case INT4:
        TORCH_CHECK(int4_, "layer_loop: no int4 op set");
        return int4_->call(x, l.w, l.n, l.bias, -1);
      case W4A8:
        TORCH_CHECK(w4a8_, "layer_loop: no w4a8 op set");
        return w4a8_->call(x, l.w, l.n, l.bias, true, w4a8_rows);
      case DENSE:
        if (l.packed) return mkldnn_.call(x, l.w, l.bias, "none", no_scalars_, std::string_view(""));
        return at::linear(x, l.w, l.bias);
      case W8A8:
        TORCH_CHECK(w8a8_, "layer_loop: no w8a8 op set");
        return w8a8_->call(x, l.w, l.a, l.bias, l.smooth, l.n);
      case W8A8_SILU:
        TORCH_CHECK(w8a8_silu_, "layer_loop: no gated w8a8 op set");
        return w8a8_silu_->call(x, l.w, l.a, l.bias, l.smooth, l.n, l.flag);
      case INT4_AMX:
        TORCH_CHECK(int4_amx_, "layer_loop: no AMX int4 op set");
        return int4_amx_->call(x, l.w, l.a, l.bias);
      case F32_ROWS:
        TORCH_CHECK(f32_rows_, "layer_loop: no float32 few-row op set");
        return f32_rows_->call(x, l.w, l.bias);
    }
    TORCH_CHECK(false, "layer_loop: bad path ", path);
  }

  // layers [first, last) over hidden states h [T, D]; rot [T, 1, d / 2, 2] float32 (cos, sin); kv_cache
  // [layers, 2, blocks, bs, kvh, d]; slots / tables / seqs: the attention op's metadata; paths: one per linear kind
  // (QKV, O, GATE_UP, DOWN; GATE_UP may be W8A8_SILU: the gated product)
  Tensor run(Tensor h, Tensor rot, Tensor kv_cache, Tensor slots, Tensor tables, Tensor seqs, int64_t first,
             int64_t last, int64_t p_qkv, int64_t p_o, int64_t p_gate_up, int64_t p_down, int64_t w4a8_rows) {
    TORCH_CHECK(rms_norm_ && add_rms_norm_ && rope_ && silu_mul_ && attn_, "layer_loop: the fused and attention ops "
                "must be set before run");
    TORCH_CHECK(0 <= first && first <= last && last <= int64_t(layers.size()), "layer_loop: layers [", first, ", ",
                last, ") out of the stack's ", layers.size());
    TORCH_CHECK(h.dim() == 2, "layer_loop: hidden states must be [T, D], got ", h.dim(), " dims");
    TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.size(0) >= last && kv_cache.size(1) == 2,
                "layer_loop: kv_cache must be [layers, 2, blocks, bs, kvh, d] with every layer run");
    const int64_t paths[NUM_KINDS] = {p_qkv, p_o, p_gate_up, p_down};
    for (int k = 0; k < NUM_KINDS; ++k)
      TORCH_CHECK(paths[k] >= 0 && paths[k] < NUM_PATHS && (paths[k] != W8A8_SILU || k == GATE_UP),
                  "layer_loop: bad path ", paths[k], " for linear ", k);
    const int64_t t = h.size(0);
    for (int64_t i = first; i < last; ++i) {
      const Layer& L = layers[i];
      Tensor x = rms_norm_->call(h, L.input_norm, eps);
      Tensor qkv = linear(i, QKV, p_qkv, x, w4a8_rows);
      Tensor qk = rope_->call(qkv, rot, nh + nkv, d);
      Tensor v = qkv.slice(1, (nh + nkv) * d).view({t, nkv, d});
      Tensor q = qk.slice(1, 0, nh), k = qk.slice(1, nh);
      Tensor kv = kv_cache.select(0, i);
      Tensor attn = attn_->call(q, k, v, kv.select(0, 0), kv.select(0, 1), slots, tables, seqs, scale)
                        .view({t, nh * d});  // in q's dtype (float32 or bfloat16)
      auto hx = add_rms_norm_->call(h, linear(i, O, p_o, attn, w4a8_rows), L.post_norm, eps);
      Tensor gated = p_gate_up == W8A8_SILU ? linear(i, GATE_UP, W8A8_SILU, std::get<1>(hx), w4a8_rows)
                                            : silu_mul_->call(linear(i, GATE_UP, p_gate_up, std::get<1>(hx), w4a8_rows));
      h = std::get<0>(hx) + linear(i, DOWN, p_down, gated, w4a8_rows);
    }
    return h;
  }
};

int64_t abi() { return 1; }

}  // namespace

TORCH_LIBRARY(NAMESPACE, m) {
  m.def("abi() -> int");
  m.class_<LayerStack>("LayerStack")
      .def(torch::init<int64_t, int64_t, int64_t, double, double>())
      .def("set_op", &LayerStack::set_op)
      .def("add_layer", &LayerStack::add_layer)
      .def("add_linear", &LayerStack::add_linear)
      .def("run", &LayerStack::run);
}
TORCH_LIBRARY_IMPL(NAMESPACE, CatchAll, m) { m.impl("abi", &abi); }
"""

PATHS = ("int4", "w4a8", "dense", "w8a8", "w8a8_silu", "amx", "f32_rows")
KINDS = ("qkv", "o", "gate_up", "down")
INT4, W4A8, DENSE, W8A8, W8A8_SILU, INT4_AMX, F32_ROWS = range(7)


def enabled() -> bool:
    """PACELINE_LAYER_LOOP (default 1): whether models built afterwards run their layers in the C++ loop."""
    value = os.environ.get("PACELINE_LAYER_LOOP", "1")
    if value not in ("0", "1"):
        raise ValueError(f"PACELINE_LAYER_LOOP must be 0 or 1, got {value!r}")
    return value == "1"


def _flags() -> list[str]:
    return ["-O2", "-std=c++17", "-shared", "-fPIC", "-w",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]


def _library_path() -> tuple[Path, str, list[str]]:
    from paceline.model.cache_dir import cache_root
    flags = _flags()
    key = hashlib.sha256("\n".join([SOURCE, torch.__version__, *flags]).encode()).hexdigest()[:16]
    return cache_root() / "kernels" / f"layer_loop-{key}.so", f"paceline_loop_{key}", flags


_namespace: list[str | None] = []  # load()'s answer, once per process


def load() -> str | None:
    """The namespace whose LayerStack class runs the loop, building the library first if needed; None where it
    cannot be built or loaded (the reason is logged once)."""
    if not _namespace:
        path, namespace, flags = _library_path()
        op = int4_kernel.load_op(path, namespace, flags, SOURCE, "abi", "CPU layer loop unavailable, using Python's")
        _namespace.append(namespace if op is not None else None)
    return _namespace[0]


def _name(op: Any) -> str:
    """"ns::name" of a torch.ops op (an OpOverloadPacket)."""
    name = getattr(op, "_qualified_op_name", None)
    if not isinstance(name, str):
        raise TypeError(f"layer_loop: {op!r} is not a registered torch op")
    return name


class LayerLoop:
    """One model's LayerStack and what decides, per step, which product each linear runs."""

    def __init__(self, model: Any, namespace: str):
        # the model names its linear classes (llama.LlamaModel.LINEAR_CLASSES): llama imports this module, so this
        # one does not import llama
        classes = model.LINEAR_CLASSES
        self._Int4Linear, self._Linear, self._W8A8Linear = classes["int4"], classes["plain"], classes["w8a8"]
        layers = list(model.layers)
        first = layers[0]
        self.model = weakref.ref(model)
        self.num_layers = len(layers)
        self.kinds = [[getattr(layer, k) for layer in layers] for k in KINDS]  # [kind][layer] linears
        self.stack = getattr(torch.classes, namespace).LayerStack(
            first.num_heads, first.num_kv_heads, first.head_dim, float(first.eps), float(first.scale))
        f = first.fused
        for role in ("rms_norm", "add_rms_norm", "rope", "silu_mul"):
            self.stack.set_op(role, _name(getattr(f, role)))
        self.ops: dict[str, Any] = {}  # role -> the op object set for it (ops looked up at call time may change)
        self.dense_state = self._dense_state()
        self.identity = self._identity(model)
        for i, layer in enumerate(layers):
            self.stack.add_layer(layer.input_norm, layer.post_norm)
            for k, name in enumerate(KINDS):
                self._add(i, k, getattr(layer, name))

    def _dense(self, lin: Any) -> Any:
        """The plain Linear that serves lin's dense path, or None."""
        if isinstance(lin, self._Linear):  # its float32 copy (wide) serves only float32 steps: _path checks
            return lin
        if isinstance(lin, self._Int4Linear) and isinstance(lin.dense, self._Linear) and lin.dense.wide is None:
            return lin.dense
        return None

    @staticmethod
    def _identity(model: Any) -> tuple:
        """The first and last layers' linears and their dense copies: a model whose linears were replaced after the
        stack was built (the tensor-parallel shards wrap o and down in an all-reduce) needs a new stack."""
        out = []
        for layer in (model.layers[0], model.layers[-1]):
            for k in KINDS:
                lin = getattr(layer, k)
                out += [id(lin), id(getattr(lin, "dense", None))]
        return tuple(out)

    def current(self, model: Any) -> bool:
        """Whether this stack still holds the model's linears."""
        return self._identity(model) == self.identity

    def _dense_state(self) -> tuple:
        """What the dense paths hold now: a Linear packed after the stack was built (deferred packing) changes it."""
        return tuple(id(d.packed) if d is not None else 0 for lins in self.kinds for d in map(self._dense, lins))

    def _add(self, i: int, k: int, lin: Any) -> None:
        add = self.stack.add_linear
        if isinstance(lin, self._Int4Linear):
            if lin.kernel is not None:
                add(i, k, INT4, lin.packed, None, lin.bias, None, lin.out_features, False)
            if lin.w4a8 is not None:
                add(i, k, W4A8, lin.w4a8, None, lin.bias, None, lin.out_features, True)
            if lin.amx is not None:
                add(i, k, INT4_AMX, lin.amx[0], lin.amx[1], lin.bias, None, lin.out_features, False)
            dense = lin.dense
            if isinstance(dense, self._W8A8Linear):
                add(i, k, W8A8, dense.wq, dense.col_scale, dense.bias, dense.inv_smooth, dense.outliers, False)
                add(i, k, W8A8_SILU, dense.wq, dense.col_scale, dense.bias, dense.inv_smooth, dense.outliers,
                    dense.gated_rounded)
        dense = self._dense(lin)
        if dense is not None:
            self._add_dense(i, k, dense)
        if isinstance(lin, self._Linear) and lin.keep_plain:  # its plain weight is kept for good
            add(i, k, F32_ROWS, lin.weight, None, lin.bias, None, 0, False)

    def _add_dense(self, i: int, k: int, dense: Any) -> None:
        """The dense path of layer i's linear k: oneDNN's linear where Linear.__call__ runs it (packed, or a plain
        float32 weight; the stack's dense path runs float32 steps only on a float32 weight), else aten's."""
        w = dense.onednn_weight()
        self.stack.add_linear(i, k, DENSE, dense.weight if w is None else w, None, dense.bias, None, 0, w is not None)

    def _set_op(self, role: str, op: Any) -> bool:
        """Point the stack's `role` at `op`; False where op is None (that path cannot run)."""
        if op is None:
            return False
        if self.ops.get(role) is not op:
            self.stack.set_op(role, _name(op))
            self.ops[role] = op
        return True

    def _path(self, lins: list, rows: int, dtype: torch.dtype, gated: bool, decodes: int = 0) -> int | None:
        """Which product serves every layer's linear of one kind for a step of `rows` rows of `dtype`, the op it
        needs set; None where the stack cannot run it exactly as the Python loop would."""
        from paceline.model import f32_rows_kernel, w4a8_kernel, w8a8_kernel
        lin = lins[0]
        if isinstance(lin, self._Linear):
            if lin.wide is not None and dtype == torch.float32:
                return None
            if lin.few_rows(rows, dtype) and self._set_op("f32_rows", f32_rows_kernel.op()):
                return F32_ROWS  # as Linear.__call__ picks it
            return DENSE
        if not isinstance(lin, self._Int4Linear):
            return None
        path = lin.path(rows, dtype, decodes)
        if path == "int4":
            return INT4 if self._set_op("int4", lin.kernel) else None
        if path == "w4a8":
            return W4A8 if self._set_op("w4a8", w4a8_kernel.op()) else None
        if path == "amx":
            return INT4_AMX if self._set_op("int4_amx", int4_amx_kernel.load()) else None
        if path != "dense":
            return None
        dense = lin.dense
        if isinstance(dense, self._Linear):
            return DENSE if dense.wide is None else None
        if not isinstance(dense, self._W8A8Linear) or dense.op is None or not self._set_op("w8a8", dense.op):
            return None
        if gated and dense.gated_build is not None:
            op = w8a8_kernel.gated_op_for(dense.gated_build)
            if op is not None:
                return W8A8_SILU if self._set_op("w8a8_silu", op) else None
        return W8A8

    def paths(self, rows: int, dtype: torch.dtype, decodes: int = 0) -> tuple[int, int, int, int] | None:
        """The four linears' products for this step, or None (the Python loop runs it)."""
        out = []
        for k, lins in enumerate(self.kinds):
            p = self._path(lins, rows, dtype, KINDS[k] == "gate_up", decodes)
            if p is None:
                return None
            out.append(p)
        return tuple(out)

    def run(self, h: torch.Tensor, rot: torch.Tensor, kv_cache: torch.Tensor, meta: Any, first: int, last: int,
            paths: tuple[int, int, int, int]) -> torch.Tensor:
        """Layers [first, last) over h; rot = view_as_real of the step's rotations [T, 1, d / 2, 2]."""
        from paceline.model import w4a8_kernel
        if not self._set_op("attention", meta.kernel):
            raise ValueError("layer_loop: the step's metadata has no attention kernel")
        # once a step, at its first layer: the walk over every Linear took ~0.1 ms, and a sliced step calls run once a
        # layer (a float32 two-decode step sliced took 32.7-36.0 ms against 29.5-31.3 whole, /tmp script 2026-11-29);
        # a Linear packed mid-step serves from the next step
        state = self._dense_state() if first == 0 else self.dense_state
        if state != self.dense_state:  # a Linear was packed since: its layers get the packed weight
            for k, lins in enumerate(self.kinds):
                for i, lin in enumerate(lins):
                    dense = self._dense(lin)
                    if dense is not None:
                        self._add_dense(i, k, dense)
            self.dense_state = state
        return self.stack.run(h, rot, kv_cache, meta.slot_mapping, meta.kernel_tables, meta.kernel_seqs,
                              first, last, *paths, int(w4a8_kernel.MAX_R))


_loops: "weakref.WeakKeyDictionary[Any, LayerLoop | None]" = weakref.WeakKeyDictionary()


def for_model(model: Any) -> LayerLoop | None:
    """The model's LayerLoop, built on its first step (not at load: the model may be pickled into a snapshot, and
    its Linears may be packed after it starts serving); None where it cannot run: switched off when the model was
    built, not a CPU model, no fused ops, layers of different kinds, the library not built here."""
    loop = _loops.get(model, False)
    if loop is None or (loop is not False and loop.current(model)):
        return loop
    loop = None
    if (getattr(model, "layer_loop", False) and getattr(model, "LINEAR_CLASSES", None) and len(model.layers)
            and model.device.type == "cpu"):
        layers = list(model.layers)
        fused = layers[0].fused
        same = all(layer.fused == fused for layer in layers) and all(
            len({type(getattr(layer, k)) for layer in layers}) == 1 for k in KINDS)
        namespace = load() if fused is not None and same else None
        if namespace is not None:
            loop = LayerLoop(model, namespace)
    _loops[model] = loop
    return loop
