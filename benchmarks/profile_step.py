"""Where a step's milliseconds go: one full `ModelRunner.execute` per step, broken down by category.

Categories (exclusive time: a category does not include the ones nested in it):
- linears: the layers' q/k/v, o, gate/up and down matmuls (`Linear`, `Int4Linear`)
- attention: `paged_attention` (K/V cache writes, gathers, masks, SDPA)
- norms/rope/elem: the rest of the model's forward (embedding, RMSNorms, RoPE, SiLU*mul, residual adds)
- lm_head: `compute_logits` (the LM head matmul and the cast of its output)
- sampler: the runner's `Sampler`
- metadata: `build_metadata` (attention index tensors)
- host: the rest of `execute` (ordering, id/position lists, tensor builds, row selection)

Scenarios follow the issue's probes: one decode, 32 decodes (contexts 100..200), a 64-token prompt chunk with
6 decodes (the stall probe's step), a fresh 512-token prefill, a 1,500-token prompt in chunks of 512 (the default
budget: the sum of its 3 steps is the TTFT's compute) and whole. The KV cache is filled with random values in
place of real contexts (values do not change the cost).

(From a checkout, run with PYTHONPATH=. so this tree's paceline is imported, not an installed one.)

    python benchmarks/profile_step.py                       # fp32, bf16, int4 (a few minutes)
    python benchmarks/profile_step.py --modes int4 --compare "wide_above=none,wide_above=auto" --only decode
    python benchmarks/profile_step.py --modes bf16 --repeats 3
    python benchmarks/profile_step.py --modes int4 --compare "int4_kernel=98a8064+fused=0,fused=0,fused=1" --only "b=32,probe32"
    python benchmarks/profile_step.py --modes int4 --compare "kernels=6a4ec79,w4a8=all" --only "b=32,probe32"
    python benchmarks/profile_step.py --modes int4 --compare "kernels=6a4ec79,w4a8=all" --check-same   # logits equal?
    python benchmarks/profile_step.py --modes int4 --compare "w4a8_kernel=3b853d8,layer_loop=1" --only "b=32"  # the op alone
"""
from __future__ import annotations

import argparse
import os
import random
import time
from contextlib import contextmanager
from unittest.mock import patch

import torch

CATEGORIES = ["linears", "attention", "norms/rope/elem", "lm_head", "sampler", "metadata", "host"]


class Timers:
    """Exclusive wall time per category, kept on a stack so nested calls are charged to the innermost one."""

    def __init__(self):
        self.totals = {c: 0.0 for c in CATEGORIES}
        self.stack: list[list] = []  # [category, start, time spent in children]

    @contextmanager
    def charge(self, category: str):
        if category == "linears" and any(f[0] == "lm_head" for f in self.stack):
            category = "lm_head"
        frame = [category, time.perf_counter(), 0.0]
        self.stack.append(frame)
        try:
            yield
        finally:
            self.stack.pop()
            spent = time.perf_counter() - frame[1]
            self.totals[category] += spent - frame[2]
            if self.stack:
                self.stack[-1][2] += spent

    def wrap(self, fn, category: str):
        def wrapped(*a, **kw):
            with self.charge(category):
                return fn(*a, **kw)
        return wrapped


def install(timers: Timers, runner) -> None:
    """Wrap the executor's functions with timers (for this process only)."""
    import paceline.engine.runner as runner_mod
    import paceline.model.llama as llama

    for cls in [c for c in (getattr(llama, n, None) for n in ("Linear", "Int4Linear", "Int8Linear")) if c is not None]:
        if not getattr(cls, "_profiled", False):
            cls.__call__ = (lambda orig: lambda self, *a, **kw: TIMERS[0].wrap(orig, "linears")(self, *a, **kw))(cls.__call__)
            cls._profiled = True
    if not getattr(llama, "_profiled", False):
        llama.paged_attention = (lambda orig: lambda *a, **kw: TIMERS[0].wrap(orig, "attention")(*a, **kw))(llama.paged_attention)
        runner_mod.build_metadata = (lambda orig: lambda *a, **kw: TIMERS[0].wrap(orig, "metadata")(*a, **kw))(runner_mod.build_metadata)
        llama._profiled = True
    model = runner.model
    # the breakdown times the Python layer loop's calls: the C++ one (layer_loop.py) makes them invisible here, so
    # it is off for the breakdown (--compare "layer_loop=0,layer_loop=1" times it)
    model.layer_loop = False
    model.forward = timers.wrap(model.forward, "norms/rope/elem")
    model.compute_logits = timers.wrap(model.compute_logits, "lm_head")
    runner.sampler = (lambda s: lambda *a, **kw: TIMERS[0].wrap(s, "sampler")(*a, **kw))(runner.sampler)
    runner.execute = timers.wrap(runner.execute, "host")


TIMERS: list[Timers] = [Timers()]
TEMPERATURE = [0.0]  # every request's (--temperature): 0 greedy, else a sampled draw per row


def scenarios(vocab: int, bs: int):
    """name -> list of steps; a step is a list of (prompt_len, output_len, start, num_tokens) per request."""
    rng = random.Random(0)
    ctx32 = [rng.randint(100, 200) for _ in range(32)]
    return {
        "decode b=1 (ctx 150)": [[(150, 1, 150, 1)]],
        "decode b=2 (ctx 150, 350)": [[(150, 1, 150, 1), (350, 1, 350, 1)]],  # multi_model's float32 streams
        "decode b=32 (ctx 100-200)": [[(c, 1, c, 1) for c in ctx32]],
        "chunk 64 + 6 decodes": [[(1500, 0, 512, 64)] + [(150, 1, 150, 1)] * 6],
        "prefill 512 (fresh)": [[(512, 0, 0, 512)]],
        "prefill 1500 in 512-chunks": [[(1500, 0, s, min(512, 1500 - s))] for s in range(0, 1500, 512)],
        "prefill 1500 in 1024-chunks": [[(1500, 0, s, min(1024, 1500 - s))] for s in range(0, 1500, 1024)],
        "prefill 1500 whole": [[(1500, 0, 0, 1500)]],
        # vs_vllm's 32-stream probe under the 150 ms step target: the step log's steady step (16-17 decodes at
        # context ~150 beside a ~25-token chunk of a fresh 100-token prompt), and the 64 decode-only steps
        "probe32: 25-token chunk + 17 decodes": [[(100, 0, 0, 25)] + [(c, 1, c, 1) for c in ctx32[:17]]],
        "probe32: 100-token prompt + 17 decodes": [[(100, 0, 0, 100)] + [(c, 1, c, 1) for c in ctx32[:17]]],
        "probe32: 4 prompts of 100 + 16 decodes": [[(100, 0, 0, 100)] * 4 + [(c, 1, c, 1) for c in ctx32[:16]]],
        # a full batch of 32 decodes beside a 48-token chunk of a fresh prompt: 80 rows, the int4 op's range
        "probe32: 48-token chunk + 32 decodes": [[(100, 0, 0, 48)] + [(c, 1, c, 1) for c in ctx32]],
        # the served probe's mixed step under the 120 ms target (step log, 2026-11-24 16:00 UTC: ~125-148 prompt
        # tokens beside the 32 decodes)
        "probe32: 128 prompt tokens + 32 decodes": [[(100, 0, 0, 100), (100, 0, 0, 28)] + [(c, 1, c, 1) for c in ctx32]],
        # a wide step's cost against its rows (fresh prompt chunks): the intercept is the per-step cost
        **{f"rows {n} (fresh chunk)": [[(n, 0, 0, n)]] for n in (9, 12, 16, 24, 32, 64, 128, 192, 256)},
    }


def build_outputs(steps, vocab: int, bs: int):
    from paceline.core.outputs import ScheduledRequest, SchedulerOutput
    from paceline.request import Request
    from paceline.sampling import SamplingParams

    greedy = SamplingParams(temperature=TEMPERATURE[0], max_tokens=None)
    outs, next_block = [], 0
    reqs: dict[tuple, tuple] = {}
    for step in steps:
        sched = []
        for i, (plen, olen, start, n) in enumerate(step):
            key = (plen, olen, i)
            if key not in reqs:  # a request's chunks over several steps share one request and block table
                r = Request(str(len(reqs)), torch.randint(0, vocab, (plen,)).tolist(), greedy, 0.0)
                for _ in range(olen):
                    r.append_token(1, 0.0)
                nb = (plen + olen + 1 + bs - 1) // bs
                reqs[key] = (r, list(range(next_block, next_block + nb)))
                next_block += nb
            r, table = reqs[key]
            sched.append(ScheduledRequest(r, start, n, table))
        outs.append(SchedulerOutput(scheduled=sched))
    return outs, next_block


def make_runner(ckpt, mode: str, blocks: int, bs: int, **model_kw):
    """model_kw: LlamaModel.from_weights keywords, and int4_kernel=REV: the int4 op as it was at git revision REV
    (built under its own name) for the model's Int4Linears, for a before/after of the op in one process; fused=0:
    without the fused norm/RoPE/SiLU ops; w4a8=all (or names joined by ":", or none): the layer linears that run
    the int4 x int8 op (paceline/model/w4a8_kernel.py)."""
    from paceline.engine.runner import ModelRunner
    from paceline.model import int4_kernel
    from paceline.model.llama import LlamaModel

    # w4a8=all / down:o / none: the layer linears that run the int4 x int8 op; fused=0: the layers' norms, RoPE and
    # SiLU * up as torch's ops (fused_kernel.py off). Both are read from the environment while the model is built.
    # w8a8_silu=0: gate_up's SiLU * up as silu_mul after the int8 op, not in its epilogue
    # q8_head=0|1: the LM head on the GGUF's Q8_0 codes (q8_kernel.py) or the bf16 weight; q8_out=0: with each
    # block's largest activation left in; layer_loop=0|1: the layers of a step in Python or in one C++ call
    # (layer_loop.py); int4_amx=0|1: an int4 model's 7-127-row bf16 steps off / on the AMX op (int4_amx_kernel.py);
    # f32_rows=0|1: a float32 model's steps of few rows on oneDNN's packed weights / f32_rows_kernel's op.
    # (The AMX attention op is chosen per call: run the whole command with PACELINE_ATTN_AMX=0 and without.)
    for key, var in (("w4a8", "PACELINE_W4A8_LINEARS"), ("fused", "PACELINE_FUSED_KERNEL"),
                     ("int4_amx", "PACELINE_INT4_AMX"), ("f32_rows", "PACELINE_F32_ROWS"),
                     ("w8a8_silu", "PACELINE_W8A8_FUSED_SILU"), ("q8_head", "PACELINE_Q8_HEAD"),
                     ("q8_out", "PACELINE_Q8_HEAD_OUTLIERS"), ("layer_loop", "PACELINE_LAYER_LOOP")):
        if key in model_kw:
            value = model_kw.pop(key)
            with patch.dict(os.environ, {var: "" if value is None else str(value)}):
                return make_runner(ckpt, mode, blocks, bs, **model_kw)
    rev = model_kw.pop("kernels", None)
    if rev is not None:  # kernels=REV: the w4a8 and attention ops as they were at git revision REV, for this runner
        return _with_kernels_at(str(rev), lambda: make_runner(ckpt, mode, blocks, bs, **model_kw))
    rev = model_kw.pop("w4a8_kernel", None)
    if rev is not None:  # w4a8_kernel=REV: the w4a8 op alone (an older attention op may no longer fit the layers)
        return _with_kernels_at(str(rev), lambda: make_runner(ckpt, mode, blocks, bs, **model_kw), attention=False)
    rev = model_kw.pop("w8a8_kernel", None)
    if rev is not None:  # w8a8_kernel=REV: the int8 x int8 op of revision REV (held by the model's W8A8Linears)
        from benchmarks.int4_linear import kernel_module_at
        from paceline.model import w8a8_kernel
        old, saved = kernel_module_at(str(rev), "w8a8_kernel"), (w8a8_kernel.load, w8a8_kernel.load_gated)
        w8a8_kernel.load = old.load
        w8a8_kernel.load_gated = getattr(old, "load_gated", lambda: None)
        try:
            return make_runner(ckpt, mode, blocks, bs, **model_kw)
        finally:
            w8a8_kernel.load, w8a8_kernel.load_gated = saved
    rev = model_kw.pop("int4_kernel", None)
    if rev is not None:
        from benchmarks.int4_linear import kernel_module_at
        old, saved = kernel_module_at(str(rev)), (int4_kernel.load, int4_kernel.pack)
        int4_kernel.load, int4_kernel.pack = old.load, old.pack
        try:
            return make_runner(ckpt, mode, blocks, bs, **model_kw)
        finally:
            int4_kernel.load, int4_kernel.pack = saved

    quantization = "int4" if mode == "int4" else "none"
    dtype = torch.float32 if mode == "fp32" else torch.bfloat16
    model = LlamaModel.from_weights(ckpt.arch, ckpt.weights, "cpu", dtype, quantization=quantization, **model_kw)
    runner = ModelRunner(model, ckpt.arch, blocks, bs, dtype=dtype)
    runner.kv_cache.normal_()
    return runner


def _with_kernels_at(rev: str, build, attention: bool = True):
    """Build a runner whose w4a8 op (and attention op, with attention) are those of revision `rev`: the model looks
    them up at call time (w4a8_kernel.op, attention_kernel.load), so they are swapped in for its build and for each
    of its steps."""
    from paceline.model import attention_kernel, w4a8_kernel

    from benchmarks.int4_linear import kernel_module_at
    old_w4a8 = kernel_module_at(rev, "w4a8_kernel")
    swaps = [(w4a8_kernel, "op", old_w4a8.op), (w4a8_kernel, "load", old_w4a8.load),
             (w4a8_kernel, "pack", old_w4a8.pack),
             # llama.py passes MAX_R to the op: an older op takes 1-6 only (before "0: the build's best")
             (w4a8_kernel, "MAX_R", getattr(old_w4a8, "MAX_R", 4))]
    if attention:
        swaps.append((attention_kernel, "load", kernel_module_at(rev, "attention_kernel").load))

    def swapped(fn):
        def call(*a, **kw):
            saved = [(m, n, getattr(m, n)) for m, n, _ in swaps]
            for m, n, f in swaps:
                setattr(m, n, f)
            try:
                return fn(*a, **kw)
            finally:
                for m, n, f in saved:
                    setattr(m, n, f)
        return call

    runner = swapped(build)()
    runner.execute, runner.forward_tokens = swapped(runner.execute), swapped(runner.forward_tokens)
    return runner


def built_scenarios(ckpt, bs: int = 16):
    scen = scenarios(ckpt.arch.vocab_size, bs)
    built = {name: build_outputs(steps, ckpt.arch.vocab_size, bs) for name, steps in scen.items()}
    return built, max(n for _, n in built.values()) + 1


def parse_variant(text: str) -> dict:
    """'wide_above=none' -> {'wide_above': None}; values are ints, none, or strings."""
    out = {}
    for part in filter(None, text.split("+")):
        key, value = part.split("=")
        out[key] = None if value == "none" else int(value) if value.lstrip("-").isdigit() else value
    return out


def compare(ckpt, mode: str, variants: list[str], repeats: int) -> None:
    """A/B: the same scenarios on one runner per variant, interleaved repeat by repeat in this process."""
    built, blocks = built_scenarios(ckpt)
    runners = [make_runner(ckpt, mode, blocks, 16, **parse_variant(v)) for v in variants]
    print(f"\n### {mode}: total ms per scenario, median of {repeats} interleaved repeats\n")
    print("| scenario | " + " | ".join(variants) + " | ratio (first / last) |")
    print("|---|" + "---:|" * (len(variants) + 1))
    for name, (outs, _) in built.items():
        times = [[] for _ in runners]
        for runner in runners:  # warm-up
            for o in outs:
                runner.execute(o)
        for _ in range(repeats):
            for i, runner in enumerate(runners):
                t = time.perf_counter()
                for o in outs:
                    runner.execute(o)
                times[i].append(time.perf_counter() - t)
        med = [sorted(ts)[len(ts) // 2] * 1e3 for ts in times]
        print(f"| {name} | " + " | ".join(f"{m:.1f}" for m in med) + f" | {med[0] / med[-1]:.2f}x |", flush=True)


def check_same(ckpt, mode: str, variants: list[str]) -> None:
    """Whether the variants give the same logits bit for bit: every scenario's steps on one runner per variant,
    each from the same random KV cache, through forward_tokens (the runner's model call, no sampling)."""
    from paceline.model.attention import SeqSlice

    built, blocks = built_scenarios(ckpt)
    runners = [make_runner(ckpt, mode, blocks, 16, **parse_variant(v)) for v in variants]
    kv = torch.randn(runners[0].kv_cache.shape, generator=torch.Generator().manual_seed(0)).to(runners[0].kv_cache.dtype)
    print(f"\n### {mode}: logits of each variant against the first ({variants[0]})\n")
    print("| scenario | " + " | ".join(variants[1:]) + " |")
    print("|---|" + "---|" * (len(variants) - 1))
    for name, (outs, _) in built.items():
        logits = []
        for runner in runners:
            runner.kv_cache.copy_(kv)
            got = []
            for o in outs:
                order = sorted(o.scheduled, key=lambda s: (s.num_tokens == 1, s.start if s.num_tokens == 1 else 0))
                ids, pos, seqs, rows = [], [], [], []
                for s in order:
                    ids += s.request.token_ids[s.start:s.start + s.num_tokens]
                    pos += range(s.start, s.start + s.num_tokens)
                    seqs.append(SeqSlice(s.start, s.num_tokens, s.block_table))
                    rows.append(len(ids) - 1)
                got.append(runner.forward_tokens(ids, pos, seqs, rows))
            logits.append(torch.cat(got))
        cells = ["bit for bit" if torch.equal(logits[0], x) else f"max diff {(logits[0] - x).abs().max().item():.3g}"
                 for x in logits[1:]]
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


def profile_mode(ckpt, mode: str, repeats: int, **model_kw) -> dict[str, dict[str, float]]:
    built, blocks = built_scenarios(ckpt)
    runner = make_runner(ckpt, mode, blocks, 16, **model_kw)
    timers = Timers()
    TIMERS[0] = timers
    install(timers, runner)
    results = {}
    for name, (outs, _) in built.items():
        for o in outs:  # warm-up
            runner.execute(o)
        per_rep = []
        for _ in range(repeats):
            timers.totals = {c: 0.0 for c in CATEGORIES}
            t = time.perf_counter()
            for o in outs:
                runner.execute(o)
            total = time.perf_counter() - t
            per_rep.append((total, dict(timers.totals)))
        per_rep.sort(key=lambda x: x[0])
        total, cats = per_rep[len(per_rep) // 2]  # the median repeat, with its own breakdown
        tokens = sum(s.num_tokens for o in outs for s in o.scheduled)
        results[name] = {"total": total * 1e3, "tok/s": tokens / total, **{c: v * 1e3 for c, v in cats.items()}}
    return results


def print_table(mode: str, results: dict) -> None:
    cols = ["total", "tok/s"] + CATEGORIES
    print(f"\n### {mode} (ms per step or per sequence of steps; median of repeats)\n")
    print("| scenario | " + " | ".join(cols) + " |")
    print("|---|" + "---:|" * len(cols))
    for name, r in results.items():
        print(f"| {name} | " + " | ".join(f"{r[c]:.1f}" for c in cols) + " |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="fp32,bf16,int4")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--temperature", type=float, default=0.0, help="the requests' temperature (the sampler's cost)")
    p.add_argument("--model-kw", default="", help="LlamaModel.from_weights keywords, e.g. wide_above=none")
    p.add_argument("--compare", default="",
                   help="A/B instead of the breakdown: variants separated by ',' (keywords joined by '+'), "
                        "e.g. 'wide_above=none,wide_above=auto'")
    p.add_argument("--only", default="", help="scenario names containing this text (comma-separated)")
    p.add_argument("--check-same", action="store_true",
                   help="with --compare: whether the variants' logits are bit for bit the same (no timing)")
    args = p.parse_args()
    TEMPERATURE[0] = args.temperature
    torch.set_num_threads(args.threads)
    from paceline.model.loader import load_checkpoint

    if args.only:
        keep = args.only.split(",")
        all_scenarios = scenarios
        globals()["scenarios"] = lambda *a: {k: v for k, v in all_scenarios(*a).items() if any(x in k for x in keep)}
    ckpt = load_checkpoint(None, "float32")
    print(f"threads={torch.get_num_threads()} torch={torch.__version__} cpu={torch.backends.cpu.get_cpu_capability()}")
    for mode in args.modes.split(","):
        if args.compare and args.check_same:
            check_same(ckpt, mode, args.compare.split(","))
        elif args.compare:
            compare(ckpt, mode, args.compare.split(","), args.repeats)
        else:
            print_table(mode, profile_mode(ckpt, mode, args.repeats, **parse_variant(args.model_kw)))


if __name__ == "__main__":
    main()
