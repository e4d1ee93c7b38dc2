"""The C++ layer loop (layer_loop.py): a step's layers run in one call give the Python loop's logits and KV cache
bit for bit, on every product a linear can run (int4 op, w4a8 op, dense bf16 copy, W8A8 copy with its fused SiLU,
plain float32 Linear), for decode, mixed and fresh-prefill steps whose row counts cross each switch; switched off it
never runs; bad input is an error, not a crash."""
from __future__ import annotations

import pytest
import torch

from paceline.engine.runner import ModelRunner
from paceline.model import attention_kernel, fused_kernel, int4_kernel, layer_loop
from paceline.model.attention import SeqSlice
from paceline.model.llama import LlamaModel

pytestmark = pytest.mark.skipif(
    layer_loop.load() is None or attention_kernel.load() is None or fused_kernel.load() is None,
    reason="the C++ layer loop, attention or fused ops are not available here")

BS = 16
BLOCKS = 200  # the largest step's sequences (90 decodes at up to 32 tokens: 2 blocks each)


def _runners(monkeypatch, arch, weights, dtype, quantization, blocks):
    """Two runners on one model build each: the Python loop (PACELINE_LAYER_LOOP=0) and the C++ one."""
    out = []
    for on in ("0", "1"):
        monkeypatch.setenv("PACELINE_LAYER_LOOP", on)
        model = LlamaModel.from_weights(arch, weights, "cpu", dtype, quantization=quantization)
        assert model.layer_loop == (on == "1")
        out.append(ModelRunner(model, arch, blocks, BS, dtype=dtype))
    kv = torch.randn(out[0].kv_cache.shape, generator=torch.Generator().manual_seed(0)).to(dtype)
    for r in out:
        r.kv_cache.copy_(kv)
    return out


def _steps() -> list[list[tuple[int, int]]]:
    """Steps as (start, tokens) per sequence, chunks first: decodes, mixed and fresh prefills whose row counts
    cross the int4 op / w4a8 op (7 rows) and dense copy (72 rows) switches."""
    steps = []
    for n in (1, 2, 3, 6, 7, 12, 40, 71, 72, 90):  # decodes at contexts 9..32 (1-3: float32's few-row op)
        steps.append([(8 + i % 24, 1) for i in range(n)])
    for chunk, decodes in ((5, 1), (20, 3), (64, 8), (100, 10)):  # a chunk at 30 + decodes
        steps.append([(30, chunk)] + [(10 + i, 1) for i in range(decodes)])
    for n in (6, 7, 71, 72, 150):  # fresh prompts
        steps.append([(0, n)])
    return steps


def _run_steps(runners, vocab: int) -> int:
    """Every step on both runners (each step's sequences on blocks 0.., the cache random); asserts equal logits
    (every row) and caches. Returns how many steps the C++ loop ran."""
    g = torch.Generator().manual_seed(1)
    ran = 0
    calls: list[int] = []
    real = layer_loop.LayerLoop.run

    def spy(self, *a, **kw):
        calls.append(1)
        return real(self, *a, **kw)

    for step in _steps():
        ids, pos, seqs, block = [], [], [], 0
        for start, n in step:
            ids += torch.randint(0, vocab, (n,), generator=g).tolist()
            pos += range(start, start + n)
            need = -(-(start + n) // BS)
            seqs.append(SeqSlice(start, n, list(range(block, block + need))))
            block += need
        rows = list(range(len(ids)))
        calls.clear()
        layer_loop.LayerLoop.run = spy
        try:
            got = [r.forward_tokens(ids, pos, seqs, rows) for r in runners]
        finally:
            layer_loop.LayerLoop.run = real
        assert torch.equal(got[0], got[1]), (step[:2], len(ids), (got[0] - got[1]).abs().max())
        assert torch.equal(runners[0].kv_cache, runners[1].kv_cache), len(ids)
        ran += bool(calls)
    return ran


def _tiny(tiny, kind="llama"):
    hf = tiny.make_hf_model(kind, hidden_size=64, intermediate_size=128, max_position_embeddings=512)
    return tiny.arch_of(hf), {k: v.float() for k, v in hf.state_dict().items()}


@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # qwen2: q/k/v biases
def test_tiny_float32_layer_loop_is_bit_for_bit(tiny, monkeypatch, kind):
    arch, weights = _tiny(tiny, kind)
    runners = _runners(monkeypatch, arch, weights, torch.float32, "none", BLOCKS)
    assert _run_steps(runners, arch.vocab_size) == len(_steps())


@pytest.mark.skipif(int4_kernel.load() is None, reason="the C++ int4 kernel is not available here")
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_tiny_int4_layer_loop_is_bit_for_bit_on_every_path(tiny, monkeypatch, kind):
    arch, weights = _tiny(tiny, kind)
    runners = _runners(monkeypatch, arch, weights, torch.bfloat16, "int4", BLOCKS)
    loop = layer_loop.for_model(runners[1].model)
    assert loop is not None
    # which product each linear runs by rows: at least the int4 op for one row; the rest as this CPU builds them
    assert loop.paths(1, torch.bfloat16) == (layer_loop.INT4,) * 4
    seen = {p for rows in (1, 7, 40, 72, 200) for p in (loop.paths(rows, torch.bfloat16) or ())}
    assert layer_loop.INT4 in seen
    assert _run_steps(runners, arch.vocab_size) == len(_steps())


@pytest.mark.skipif(int4_kernel.load() is None, reason="the C++ int4 kernel is not available here")
@pytest.mark.parametrize("wide", ["bf16", "w4a8"])
def test_tiny_int4_other_wide_choices(tiny, monkeypatch, wide):
    """The dense bf16 copy from 72 rows (o and gate_up too) and the w4a8 op for every many-row step."""
    monkeypatch.setenv("PACELINE_INT4_WIDE", wide)
    arch, weights = _tiny(tiny)
    runners = _runners(monkeypatch, arch, weights, torch.bfloat16, "int4", BLOCKS)
    assert _run_steps(runners, arch.vocab_size) == len(_steps())


def test_switched_off_the_python_loop_runs(tiny, monkeypatch):
    arch, weights = _tiny(tiny)
    monkeypatch.setenv("PACELINE_LAYER_LOOP", "0")
    model = LlamaModel.from_weights(arch, weights)
    assert not model.layer_loop and layer_loop.for_model(model) is None
    monkeypatch.setenv("PACELINE_LAYER_LOOP", "yes")
    with pytest.raises(ValueError, match="PACELINE_LAYER_LOOP"):
        LlamaModel.from_weights(arch, weights)


def test_eager_attention_and_float32_wide_steps_fall_back(tiny, monkeypatch):
    """Steps the stack does not cover (no attention op: PACELINE_ATTN_KERNEL=0) run the Python loop."""
    arch, weights = _tiny(tiny)
    monkeypatch.setenv("PACELINE_LAYER_LOOP", "1")
    runner = ModelRunner(LlamaModel.from_weights(arch, weights), arch, 64, BS)
    monkeypatch.setattr(layer_loop.LayerLoop, "run", lambda *a, **kw: pytest.fail("the loop ran"))
    monkeypatch.setenv("PACELINE_ATTN_KERNEL", "0")
    logits = runner.forward_tokens([1, 2, 3], [0, 1, 2], [SeqSlice(0, 3, [0])], [2])
    assert torch.isfinite(logits).all()


def test_bad_input_is_an_error_not_a_crash(tiny, monkeypatch):
    arch, weights = _tiny(tiny)
    monkeypatch.setenv("PACELINE_LAYER_LOOP", "1")
    model = LlamaModel.from_weights(arch, weights)
    loop = layer_loop.for_model(model)
    stack = loop.stack
    with pytest.raises(RuntimeError, match="must be set before run"):
        stack.run(torch.randn(3, arch.hidden_size), torch.zeros(3, 1, arch.head_dim // 2, 2),
                  torch.zeros(arch.num_layers, 2, 4, BS, arch.num_kv_heads, arch.head_dim), torch.zeros(3),
                  torch.zeros(3), torch.zeros(3), 0, 1, 2, 2, 2, 2, 0)
    loop._set_op("attention", attention_kernel.load())
    h = torch.randn(3, arch.hidden_size)
    kv = torch.zeros(arch.num_layers, 2, 4, BS, arch.num_kv_heads, arch.head_dim)
    rot = torch.zeros(3, 1, arch.head_dim // 2, 2)
    meta = torch.zeros(3, dtype=torch.long), torch.zeros(1, 1, dtype=torch.int32), torch.tensor([[0, 3, 0]],
                                                                                                dtype=torch.int32)
    with pytest.raises(RuntimeError, match="out of the stack"):
        stack.run(h, rot, kv, *meta, 0, arch.num_layers + 1, 2, 2, 2, 2, 0)
    with pytest.raises(RuntimeError, match="bad path"):
        stack.run(h, rot, kv, *meta, 0, 1, 2, 2, 9, 2, 0)
    with pytest.raises(RuntimeError, match="W8A8_SILU|bad path"):
        stack.run(h, rot, kv, *meta, 0, 1, layer_loop.W8A8_SILU, 2, 2, 2, 0)
    with pytest.raises(RuntimeError, match="has no weights"):  # a float32 model has no int4 codes
        stack.run(h, rot, kv, *meta, 0, 1, layer_loop.INT4, 2, 2, 2, 0)
    with pytest.raises(RuntimeError, match="kv_cache"):
        stack.run(h, rot, kv[:1], *meta, 0, 2, 2, 2, 2, 2, 0)
    with pytest.raises(RuntimeError, match="no layer"):
        stack.add_linear(99, 0, 2, h, None, None, None, 0, False)
    with pytest.raises(RuntimeError):  # an op name that is not registered
        stack.set_op("int4", "paceline_nowhere::int4_mm")


def test_a_linear_packed_after_the_first_step_is_picked_up(tiny, monkeypatch):
    """Deferred packing (engine/residency.py): Linears packed while the model serves; the loop follows."""
    from paceline.model import llama
    from paceline.model.loader import pack_linears, unpacked_linears

    arch, weights = _tiny(tiny)
    runners = []
    for on in ("0", "1"):
        monkeypatch.setenv("PACELINE_LAYER_LOOP", on)
        with llama.deferred_packing():
            model = LlamaModel.from_weights(arch, weights)
        runners.append(ModelRunner(model, arch, 64, BS))
    step = ([5, 6, 7, 8], [0, 1, 2, 3], [SeqSlice(0, 4, [0])], [0, 1, 2, 3])
    before = [r.forward_tokens(*step) for r in runners]
    assert torch.equal(before[0], before[1])
    for r in runners:
        pack_linears(unpacked_linears(r.model))
    step = ([9], [4], [SeqSlice(4, 1, [0, 1])], [0])
    after = [r.forward_tokens(*step) for r in runners]
    assert torch.equal(after[0], after[1])


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["int4", "fp32"])
def test_bundled_model_layer_loop_is_bit_for_bit(monkeypatch, mode):
    from paceline.model.loader import load_checkpoint

    ckpt = load_checkpoint(None, "float32")
    dtype = torch.bfloat16 if mode == "int4" else torch.float32
    weights = ckpt.weights
    runners = _runners(monkeypatch, ckpt.arch, weights, dtype, "int4" if mode == "int4" else "none", BLOCKS)
    assert _run_steps(runners, ckpt.arch.vocab_size) == len(_steps())


def test_linears_replaced_after_the_first_step_are_called(tiny, monkeypatch):
    """The tensor-parallel shards wrap o and down in an all-reduce (parallel/comm.py): a stack built before must
    not keep running the unwrapped linears."""
    arch, weights = _tiny(tiny)
    monkeypatch.setenv("PACELINE_LAYER_LOOP", "1")
    runner = ModelRunner(LlamaModel.from_weights(arch, weights), arch, 64, BS)
    step = ([5, 6, 7, 8], [0, 1, 2, 3], [SeqSlice(0, 4, [0])], [3])
    runner.forward_tokens(*step)
    assert layer_loop.for_model(runner.model) is not None
    calls = []

    class Wrapped:
        def __init__(self, lin):
            self.lin = lin

        def __call__(self, x):
            calls.append(1)
            return self.lin(x)

    for layer in runner.model.layers:
        layer.o = Wrapped(layer.o)
    runner.forward_tokens(*step)
    assert len(calls) == arch.num_layers
