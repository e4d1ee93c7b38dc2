"""Step time with attention run two ways, interleaved on the same batches so machine noise hits both alike:
gathers + SDPA per decode group (the eager path) and the C++ paged-attention op (attention_kernel.py).
Prints, per batch, the median step ms and the median ms spent in attention (all layers) for each.

    flock -x /tmp/paceline-cpu.lock env PYTHONPATH=. .venv/bin/python benchmarks/decode_attention.py --repeats 5
    flock -x /tmp/paceline-cpu.lock env PYTHONPATH=. .venv/bin/python benchmarks/decode_attention.py --layer \
        --variants rev=0695ec0,avx2,avx512

--layer times one layer's `paged_attention` alone (its metadata built once outside the timing, as a step builds
it once for all layers; before 2026-11-24 08:30 UTC the timing included `build_metadata`, ~0.08 ms), SmolLM2-135M's
shapes, random K/V in scattered blocks, float32 and bfloat16, best of --repeats (default there 15; --cold: 64 MiB
written before each call, so K/V come from memory as in a whole step; --flush read: 64 MiB read instead, so the
evicted lines are clean as a step's weights are and no write-backs share the bandwidth), per --variants: eager
(gathers + SDPA),
this tree's op built for an ISA (auto, avx2, avx512) or the op at a git revision (rev=REV), and the largest
difference from the first.

Shapes: decode batches at one context length and mixed ones, and prompt chunks over earlier context with and
without decodes. (The workspace and decode-group figures in attention.py came from this script's earlier
version, which compared those three gather variants; see git history.)
"""
from __future__ import annotations

import argparse
import os
import time

import torch

import paceline.model.llama as llama
from paceline.config import EngineConfig
from paceline.engine.engine import Engine
from paceline.engine.profile import GridPoint, build_output
from paceline.model.attention import GatherWorkspace, SeqSlice, build_metadata, paged_attention

SHAPES = {
    "decode b=1 ctx 150": GridPoint([], [150]),
    "decode b=1 ctx 2000": GridPoint([], [2000]),
    "decode b=6 ctx 1900": GridPoint([], [1900] * 6),
    "decode b=32 ctx 100-200": GridPoint([], [100 + 3 * i for i in range(32)]),
    "decode b=32 ctx 500": GridPoint([], [500] * 32),
    "decode 16 mixed 100..1900": GridPoint([], [100 + 100 * i for i in range(15)] + [1900]),
    "chunk 64 @1000 + 6 decodes": GridPoint([(1000, 64, False)], [150, 250, 350, 450, 500, 1900]),
    "chunk 512 @1000": GridPoint([(1000, 512, False)], []),
    "chunk 476 @1024 (end)": GridPoint([(1024, 476, True)], []),
    "prefill 512 fresh": GridPoint([(0, 512, True)], []),
}
VARIANTS = {"gather + SDPA": "0", "C++ op": "1"}


LAYER_SHAPES = {
    "fresh 512": [(0, 512)],
    "512 at 1,000": [(1000, 512)],
    "1500 whole": [(0, 1500)],
    "64 at 1,000 + 6 decodes": [(1000, 64)] + [(c - 1, 1) for c in (150, 250, 350, 450, 500, 1900)],
    "32 decodes at 100-200": [(100 + 3 * i - 1, 1) for i in range(32)],
    "fresh 48 + 32 decodes": [(0, 48)] + [(100 + 3 * i - 1, 1) for i in range(32)],
    "6 decodes at 1,900": [(1899, 1)] * 6,
}


def _layer_variant(name: str):
    """(kernel argument of build_metadata, environment, attention_kernel.load to use) for one --variants entry:
    eager (gathers + SDPA), avx2 / avx512 / auto (this tree's op built for that ISA), rev=REV (the op at a git
    revision, built under its own name)."""
    if name == "eager":
        return False, {}, None
    if name.startswith("rev="):
        from benchmarks.int4_linear import kernel_module_at
        return True, {}, kernel_module_at(name[4:], "attention_kernel").load
    return True, {"PACELINE_ATTN_ISA": name}, None


def one_layer(repeats: int, only: list[str], variants: list[str], dtypes: list[str], cold: bool = False,
              flush_by: str = "write") -> None:
    from unittest.mock import patch

    from paceline.model import attention_kernel

    h, kvh, d, bs = 9, 3, 64, 16
    g = torch.Generator().manual_seed(0)
    print(f"one layer, {h} query / {kvh} KV heads, head_dim {d}; best of {repeats} ms (speed-up over the first "
          f"variant, max |diff| from it); bfloat16: cache and queries in bfloat16")
    setups = {v: _layer_variant(v) for v in variants}
    # --cold: 64 MiB written before every call evicts the K/V from the caches, as a whole step's other 29 layers
    # and weights do (a step of 32 decodes reads ~55 MiB of bfloat16 K/V over its 30 layers)
    # --flush read: a 64 MiB sum instead (clean lines evicted, as a step's int4 weights are; the written flush left
    # 32 MiB of dirty lines whose write-backs took ~10 % of a cold call's time, 2026-11-25 01:45 UTC)
    flush = torch.ones(16 << 20) if cold else None
    for dname in dtypes:
        dt = getattr(torch, dname)
        ws = GatherWorkspace(bs * kvh * d, dt, "cpu")
        for name, shape in LAYER_SHAPES.items():
            if only and not any(o in name for o in only):
                continue
            nb = sum(-(-(s + n) // bs) for s, n in shape) + 1
            free = torch.randperm(nb, generator=g).tolist()  # scattered blocks, as after a while of serving
            seqs = [SeqSlice(s, n, [free.pop() for _ in range(-(-(s + n) // bs))]) for s, n in shape]
            kc = torch.randn(nb, bs, kvh, d, generator=g).to(dt)
            vc = torch.randn(nb, bs, kvh, d, generator=g).to(dt)
            t = sum(n for _, n in shape)
            q, k, v = (torch.randn(t, h, d, generator=g).to(dt), torch.randn(t, kvh, d, generator=g).to(dt),
                       torch.randn(t, kvh, d, generator=g).to(dt))
            best, outs = {}, {}
            for var, (kernel, env, load) in setups.items():
                with patch.dict(os.environ, env), patch.object(attention_kernel, "load",
                                                               load or attention_kernel.load):
                    times = []
                    # built once, as a step builds it once for all its layers
                    meta = build_metadata(seqs, bs, workspace=ws, kernel=kernel)
                    for _ in range(repeats):
                        if flush is not None:
                            if flush_by == "read":
                                flush.sum()
                            else:
                                flush.fill_(1.0)
                        t0 = time.perf_counter()
                        outs[var] = paged_attention(q, k, v, kc, vc, meta, d ** -0.5).float()
                        times.append((time.perf_counter() - t0) * 1e3)
                best[var] = min(times)
            first = variants[0]
            cells = "  ".join(f"{var} {best[var]:7.3f} ({best[first] / best[var]:4.2f}x, "
                              f"{(outs[var] - outs[first]).abs().max().item():.1e})" for var in variants)
            print(f"{dname:9s} {name:24s} {cells}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32", help="engine dtype (auto picks int4 for the bundled GGUF)")
    ap.add_argument("--only", default="", help="comma-separated substrings of shape names")
    ap.add_argument("--layer", action="store_true", help="time one layer's attention alone")
    ap.add_argument("--variants", default="eager,auto", help="with --layer: eager, auto, avx2, avx512, rev=REV")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="with --layer: cache/query dtypes")
    ap.add_argument("--cold", action="store_true", help="with --layer: evict the caches before every call")
    ap.add_argument("--flush", choices=("write", "read"), default="write",
                    help="with --cold: evict by writing 64 MiB (dirty lines) or by reading it (clean ones)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.layer:
        one_layer(max(args.repeats, 15), [s for s in args.only.split(",") if s], args.variants.split(","),
                  args.dtypes.split(","), args.cold, args.flush)
        return
    engine = Engine(EngineConfig(dtype=args.dtype))
    runner = engine.runner
    attn_ms = [0.0]
    orig = llama.paged_attention

    def timed(*a, **kw):
        t0 = time.perf_counter()
        o = orig(*a, **kw)
        attn_ms[0] += (time.perf_counter() - t0) * 1e3
        return o

    llama.paged_attention = timed
    print(f"dtype {args.dtype}, {args.threads} threads; cells: median step ms / median attention ms over "
          f"{args.repeats} interleaved rounds")
    print(f"{'batch':30s}" + "".join(f"{v:>24s}" for v in VARIANTS) + f"{'step speed-up':>16s}")
    only = [s for s in args.only.split(",") if s]
    for name, point in SHAPES.items():
        if only and not any(o in name for o in only):
            continue
        out = build_output(point, engine.arch.vocab_size)
        step: dict[str, list[float]] = {v: [] for v in VARIANTS}
        attn: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for _ in range(args.repeats):
            for v, flag in VARIANTS.items():
                os.environ["PACELINE_ATTN_KERNEL"] = flag
                runner.execute(out)  # warm: a grown workspace, a first-touch buffer
                attn_ms[0] = 0.0
                t0 = time.perf_counter()
                runner.execute(out)
                step[v].append((time.perf_counter() - t0) * 1e3)
                attn[v].append(attn_ms[0])
        med = {v: sorted(t)[len(t) // 2] for v, t in step.items()}
        cells = [f"{med[v]:8.1f} / {sorted(attn[v])[len(attn[v]) // 2]:7.1f}" for v in VARIANTS]
        a, b = VARIANTS
        print(f"{name:30s}" + "".join(f"{c:>24s}" for c in cells) + f"{med[a] / med[b]:15.2f}x", flush=True)
    os.environ.pop("PACELINE_ATTN_KERNEL", None)


if __name__ == "__main__":
    main()
