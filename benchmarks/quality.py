"""What each numeric mode costs in quality on the bundled model: fp32, bf16 and int4 (the Q4_1 file's own codes),
with the wide steps in float32 or int8.

    flock -x /tmp/paceline-cpu.lock /work/main/.venv/bin/python benchmarks/quality.py

Held-out text: the last --tokens tokens of paceline/bench/data/corpus.txt (Python documentation prose), cut into
--window-token windows; nothing in paceline was tuned on it (the benchmarks draw prompts from the whole corpus, but
only for their lengths and timing). Each window is prefilled whole through the engine's own runner (the kernels
that serve), and again in 8-token chunks: on a CPU without native bf16 math a step of more than 8 tokens runs its
linears in float32 (paceline/model), so only the narrow steps, the decode path, run bf16 / int4 math. At every
position we compare the next-token distribution with fp32's (whole-window prefill):
  top-1 agreement  the share of positions whose argmax equals fp32's
  perplexity       exp(mean negative log-likelihood of the text's actual next token)
  KL               mean KL(fp32 || mode) in nats
Prints a markdown table; writes JSON under benchmarks/results/.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from paceline.config import CacheConfig, EngineConfig  # noqa: E402
from paceline.engine.engine import Engine  # noqa: E402

# "+ int8 wide": the steps of more than 8 tokens run int8 linears (paceline/model/llama.py Int8Linear) instead of
# float32 copies of the weights
MODES = {"fp32": {"dtype": "float32", "quantization": "none"},
         "bf16": {"dtype": "bfloat16", "quantization": "none", "wide_linears": "fp32"},
         "int4": {"dtype": "bfloat16", "quantization": "int4", "wide_linears": "fp32"},
         "bf16 + int8 wide": {"dtype": "bfloat16", "quantization": "none", "wide_linears": "int8"},
         "int4 + int8 wide": {"dtype": "bfloat16", "quantization": "int4", "wide_linears": "int8"},
         # int4 as before the int4 x int8 op (paceline/model/w4a8_kernel.py), which "int4" runs by default
         "int4 no w4a8": {"dtype": "bfloat16", "quantization": "int4", "wide_linears": "fp32",
                          "env": {"PACELINE_W4A8_KERNEL": "0"}},
         # the w4a8 op on some linears only (llama.W4A8_LINEARS), the others as before
         "int4 w4a8 all": {"dtype": "bfloat16", "quantization": "int4", "wide_linears": "fp32",
                           "w4a8_linears": ("qkv", "o", "gate_up", "down")},
         "int4 w4a8 not down": {"dtype": "bfloat16", "quantization": "int4", "wide_linears": "fp32",
                                     "w4a8_linears": ("qkv", "o", "gate_up")},
         "int4 w4a8 down only": {"dtype": "bfloat16", "quantization": "int4", "wide_linears": "fp32",
                            "w4a8_linears": ("down",)},
         "int4 w4a8 o+down": {"dtype": "bfloat16", "quantization": "int4", "wide_linears": "fp32",
                              "w4a8_linears": ("o", "down")},
         # what int4's bfloat16 steps of many rows run (llama.int4_wide_choice; "int4" above: auto, bf16 where the
         # CPU has native bf16 math): the dense bf16 copy from INT4_BF16_FROM_ROWS rows, or the w4a8 op
         "int4 wide bf16": {"dtype": "bfloat16", "quantization": "int4", "wide_linears": "fp32",
                            "env": {"PACELINE_INT4_WIDE": "bf16"}},
         "int4 wide w4a8": {"dtype": "bfloat16", "quantization": "int4", "wide_linears": "fp32",
                            "env": {"PACELINE_INT4_WIDE": "w4a8"}},
         # the int8 x int8 linear (llama.W8A8Linear) from INT4_INT8_FROM_ROWS rows in place of the bf16 copy
         "int4 wide int8": {"dtype": "bfloat16", "quantization": "int4", "wide_linears": "fp32",
                            "env": {"PACELINE_INT4_WIDE": "int8"}}}


def int8_wide_mode(linears: str | None, outliers: int | None) -> dict:
    """"int4 wide int8" on other linears (llama.py's PACELINE_INT4_INT8_LINEARS) and/or with more of each row's
    largest activations in float32 (PACELINE_INT4_INT8_OUTLIERS)."""
    env = {"PACELINE_INT4_WIDE": "int8"}
    if linears is not None:
        env["PACELINE_INT4_INT8_LINEARS"] = linears
    if outliers is not None:
        env["PACELINE_INT4_INT8_OUTLIERS"] = str(outliers)
    return {"dtype": "bfloat16", "quantization": "int4", "wide_linears": "fp32", "env": env}


MODES.update({"int4 wide int8 +down": int8_wide_mode("o:gate_up:down", None),
              "int4 wide int8 +down t8": int8_wide_mode("o:gate_up:down", 8),
              "int4 wide int8 +qkv t8": int8_wide_mode("qkv:o:gate_up", 8),
              "int4 wide int8 t8": int8_wide_mode(None, 8),
              "int4 wide int8 all t8": int8_wide_mode("all", 8)})



def w4a8_fake_quant(x: torch.Tensor, spec: str) -> torch.Tensor:
    """The activations as a w4a8 numerics `spec` sees them, dequantized (float32): "block" (the op's per-block
    numerics: each block of 32's largest |x| out, then a scale per block) or "row k<K> f<F>": each row's K largest
    |x| out (exact), one scale per row (max|rest| / 127) refined per block by a power of two 2^-f, f in 0..F (F 0:
    one scale for the whole row; the op then shifts each block's integer sum left instead of scaling it)."""
    m, k = x.shape
    x = x.float()
    if spec == "block":
        xb = x.reshape(m, k // 32, 32).clone()
        top = xb.abs().argmax(-1, keepdim=True)
        xo = xb.gather(-1, top)
        xb.scatter_(-1, top, 0.0)
        amax = xb.abs().amax(-1, keepdim=True)
        inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
        out = torch.round(xb * inv) * (amax / 127)
        return out.scatter_(-1, top, xo).reshape(m, k)
    got = dict(re.findall(r"([kf])(\d+)", spec))
    topk, fmax = int(got.get("k", 0)), int(got.get("f", 0))
    xr = x.clone()
    if topk:
        idx = x.abs().topk(topk, -1).indices
        xr.scatter_(-1, idx, 0.0)
    amax = xr.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    xb = xr.reshape(m, k // 32, 32)
    bmax = xb.abs().amax(-1)
    f = torch.zeros_like(bmax)  # the largest f <= fmax with bmax * 2^f <= amax (exact: powers of two)
    for step in range(fmax):
        f += ((f == step) & ((bmax == 0) | (bmax * 2.0 ** (step + 1) <= amax))).float()
    scale = torch.exp2(f)[..., None]
    out = (torch.round(xb * (inv[..., None] * scale)) * ((amax / 127)[..., None] / scale)).reshape(m, k)
    if topk:
        out.scatter_(-1, idx, x.gather(-1, idx))
    return out


def w4a8_emulation(spec: str):
    """An op with w4a8_mm's call that computes `spec`'s numerics in torch (the exact weights times the activations
    of w4a8_fake_quant), to weigh numerics before they are built."""
    from paceline.model import w4a8_kernel
    weights: dict[int, torch.Tensor] = {}

    def op(x, packed, n, bias, nibbles, max_rows=0):
        w = weights.get(packed.data_ptr())
        if w is None:
            codes, scale, lo = w4a8_kernel.unpack(packed, n, nibbles)
            w = (codes.float().view(n, -1, 32) * scale[..., None] + lo[..., None]).view(n, -1)
            weights[packed.data_ptr()] = w
        y = w4a8_fake_quant(x, spec) @ w.T
        return (y if bias is None else y + bias.float()).to(x.dtype)
    return op


NARROW = 8  # tokens per step of the second pass: the decode path's width
CORPUS = ROOT / "paceline" / "bench" / "data" / "corpus.txt"


def build_engine(model: str | None, env: dict[str, str], w4a8_linears: tuple | None, kw: dict) -> Engine:
    """An engine of the mode, with `env` set while its model is built (kernel switches are read then), and
    llama.W4A8_LINEARS patched if given. Such a mode skips the runtime snapshot, whose key holds neither."""
    import contextlib
    import os
    from unittest import mock

    from paceline.model import llama, loader

    with contextlib.ExitStack() as stack:
        if w4a8_linears is not None:
            stack.enter_context(mock.patch.object(llama, "W4A8_LINEARS", w4a8_linears))
        if env or w4a8_linears is not None:
            stack.enter_context(mock.patch.dict(os.environ, env))
            stack.enter_context(mock.patch.object(loader, "snapshot_path", lambda *a, **k: None))
        return Engine(EngineConfig(model=model, tbt_goal_ms=0, cache=CacheConfig(kv_cache_memory_gb=0.1), **kw))


def held_out_windows(engine: Engine, num_tokens: int, window: int) -> list[list[int]]:
    ids = engine.tokenizer.encode(CORPUS.read_text(encoding="utf-8"), add_special_tokens=False)
    tail = ids[-num_tokens:]
    return [tail[i:i + window] for i in range(0, len(tail) - window + 1, window)]


def logits_of(engine: Engine, windows: list[list[int]], chunk: int | None) -> list[torch.Tensor]:
    """Float32 logits [len, vocab] of every position of each window, prefilled from block 0 in chunks of `chunk`."""
    return [engine.runner.prefill_logits(w, chunk=chunk) for w in windows]


def compare(windows: list[list[int]], logits: list[torch.Tensor], reference: list[torch.Tensor]) -> dict:
    nll = agree = kl = n = 0.0
    for w, lg, ref in zip(windows, logits, reference):
        target = torch.tensor(w[1:])
        logp = torch.log_softmax(lg[:-1], dim=-1)
        ref_logp = torch.log_softmax(ref[:-1], dim=-1)
        nll += float(-logp.gather(1, target[:, None]).sum())
        agree += float((lg[:-1].argmax(-1) == ref[:-1].argmax(-1)).sum())
        kl += float((ref_logp.exp() * (ref_logp - logp)).sum())
        n += len(w) - 1
    return {"top1_agreement": agree / n, "perplexity": math.exp(nll / n), "kl_nats": kl / n, "positions": int(n)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="GGUF or HF folder (default: the bundled SmolLM2-135M Q4_1)")
    ap.add_argument("--tokens", type=int, default=4096, help="held-out tokens from the end of the corpus")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated, from: " + ", ".join(MODES))
    ap.add_argument("--whole-only", action="store_true", help="skip the 8-token-chunk pass (the narrow path)")
    ap.add_argument("--chunks", default="", help="further chunk sizes to prefill in, e.g. 64 (int4: steps up to "
                    "INT4_KERNEL_ROWS rows run the int4 op on float32 activations)")
    ap.add_argument("--output", default=None, help="default benchmarks/results/quality-<time>.json")
    args = ap.parse_args()
    torch.manual_seed(0)

    reference: list[torch.Tensor] | None = None
    windows: list[list[int]] | None = None
    rows = []
    for mode in ["fp32"] + [m for m in args.modes.split(",") if m != "fp32"]:  # fp32 first: the reference
        # "emu SPEC": the w4a8 op at every row count (int4 wide w4a8) with SPEC's numerics emulated in torch
        emulate = mode[4:] if mode.startswith("emu ") else None
        kw = dict(MODES["int4 wide w4a8" if emulate else mode])
        engine = build_engine(args.model, kw.pop("env", {}), kw.pop("w4a8_linears", None), kw)
        if emulate:
            from unittest import mock

            from paceline.model import w4a8_kernel
            emulation = w4a8_emulation(emulate)
            patch = mock.patch.object(w4a8_kernel, "op", lambda emulation=emulation: emulation)
            patch.start()
        if windows is None:
            windows = held_out_windows(engine, args.tokens, args.window)
        extra = [int(c) for c in args.chunks.split(",") if c]
        for chunk in ((None,) if args.whole_only else (None, NARROW)) + tuple(extra):
            t0 = time.perf_counter()
            logits = logits_of(engine, windows, chunk)
            elapsed = time.perf_counter() - t0
            if reference is None:
                reference = logits
            rows.append({"mode": mode, "steps": "whole window" if chunk is None else f"{chunk}-token chunks",
                         **compare(windows, logits, reference), "seconds": elapsed})
            print(json.dumps(rows[-1]), flush=True)
        if emulate:
            patch.stop()
        del engine

    lines = ["| mode | steps | top-1 agreement with fp32 | perplexity | KL(fp32 ‖ mode), nats/token |",
             "|---|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['steps']} | {100 * r['top1_agreement']:.2f} % | {r['perplexity']:.3f} | "
                     f"{r['kl_nats']:.4f} |")
    md = "\n".join(lines)
    print(f"\n{md}\n\n{rows[0]['positions']} positions: the last {args.tokens} tokens of {CORPUS.relative_to(ROOT)}, "
          f"{len(windows)} windows of {args.window}")
    out = Path(args.output or ROOT / "benchmarks" / "results" / f"quality-{time.strftime('%Y%m%d-%H%M%S')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": " ".join(sys.argv), "tokens": args.tokens, "window": args.window,
                               "rows": rows}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
