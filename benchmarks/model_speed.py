"""Executor speed: paceline's ModelRunner against Hugging Face transformers' own forward with its KV cache.

Prints prefill tokens/s (one prompt of each length) and decode tokens/s (a batch of requests each with ~256
tokens of context, one new token per request per step), for each dtype, both engines in the same run.

Decode contexts are filled with random K/V instead of prefilling them (the values do not change the cost), so a
batch of 128 needs no 32k-token prefill. paceline's decode step is a full `ModelRunner.execute` (batch build,
forward, logits, greedy sampling); transformers' is `model(input_ids, past_key_values=DynamicCache)` + argmax.

    python benchmarks/model_speed.py                      # everything (several minutes)
    python benchmarks/model_speed.py --quick              # 128/512 prefill, batches 1/8/32, fewer steps
    python benchmarks/model_speed.py --dtypes bfloat16 --batches 1,64 --no-hf
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def _best(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def paceline_speeds(ckpt, dtype, args) -> dict[tuple[str, int], float]:
    from paceline.core.outputs import ScheduledRequest, SchedulerOutput
    from paceline.engine.runner import ModelRunner
    from paceline.model.llama import LlamaModel
    from paceline.request import Request
    from paceline.sampling import SamplingParams

    arch = ckpt.arch
    model = LlamaModel.from_weights(arch, ckpt.weights, "cpu", dtype)
    bs = 16
    ctx = args.context
    per_req = (ctx + args.steps + 2 + bs - 1) // bs
    need = max([max(args.batches or [1]) * per_req] + [(n + bs - 1) // bs for n in args.prefill])
    runner = ModelRunner(model, arch, need, bs, dtype=dtype)
    out: dict[tuple[str, int], float] = {}
    g = torch.Generator().manual_seed(0)
    for n in args.prefill:
        prompt = torch.randint(0, arch.vocab_size, (n,), generator=g).tolist()
        t = _best(lambda: runner.prefill_logits(prompt), args.repeats)
        out[("prefill", n)] = n / t
    runner.kv_cache.normal_(generator=g)  # stands in for each request's 256 tokens of context
    greedy = SamplingParams(temperature=0.0, max_tokens=None)
    for b in args.batches:
        reqs = []
        for i in range(b):
            r = Request(str(i), torch.randint(0, arch.vocab_size, (ctx,), generator=g).tolist(), greedy, 0.0)
            r.append_token(1, 0.0)
            r.num_computed_tokens = ctx
            reqs.append(r)
        tables = [list(range(i * per_req, (i + 1) * per_req)) for i in range(b)]

        def step():
            sched = [ScheduledRequest(r, r.num_tokens - 1, 1, t) for r, t in zip(reqs, tables)]
            res = runner.execute(SchedulerOutput(scheduled=sched))
            for r in reqs:
                r.num_computed_tokens += 1
                r.append_token(res.token_ids[r.request_id], 0.0)
            return res.duration

        step()  # warm-up
        durations = [step() for _ in range(args.steps)]
        out[("decode", b)] = b / statistics.median(durations)
    return out


def transformers_speeds(ckpt, dtype, args) -> dict[tuple[str, int], float]:
    import transformers
    from transformers import DynamicCache

    from paceline.model.loader import hf_config

    arch = ckpt.arch
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_config(arch)))
    hf.load_state_dict(ckpt.weights, strict=False)
    hf.tie_weights()
    hf = hf.to(dtype).eval()
    out: dict[tuple[str, int], float] = {}
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for n in args.prefill:
            ids = torch.randint(0, arch.vocab_size, (1, n), generator=g)
            t = _best(lambda: hf(ids, past_key_values=DynamicCache(config=hf.config), use_cache=True), args.repeats)
            out[("prefill", n)] = n / t
        ctx = args.context
        for b in args.batches:
            cache = DynamicCache(config=hf.config)
            for layer in range(arch.num_layers):
                shape = (b, arch.num_kv_heads, ctx, arch.head_dim)
                cache.update(torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype), layer)
            ids = torch.ones(b, 1, dtype=torch.long)
            durations = []
            for i in range(args.steps + 1):
                pos = ctx + i
                t = time.perf_counter()
                logits = hf(ids, past_key_values=cache, use_cache=True, attention_mask=torch.ones(b, pos + 1, dtype=torch.long),
                            position_ids=torch.full((b, 1), pos)).logits
                ids = logits[:, -1].argmax(-1, keepdim=True)
                durations.append(time.perf_counter() - t)
            out[("decode", b)] = b / statistics.median(durations[1:])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="GGUF path or HF folder (default: bundled SmolLM2-135M-Instruct)")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--prefill", type=_ints, default=[128, 512, 2048], help="prompt lengths")
    p.add_argument("--batches", type=_ints, default=[1, 8, 32, 64, 128], help="decode batch sizes")
    p.add_argument("--context", type=int, default=256, help="context length of each decoding request")
    p.add_argument("--steps", type=int, default=8, help="decode steps timed per batch size (median)")
    p.add_argument("--repeats", type=int, default=2, help="prefill repeats (best)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-hf", action="store_true", help="skip transformers")
    p.add_argument("--quick", action="store_true", help="prefill 128,512; batches 1,8,32; 4 steps; 1 repeat")
    args = p.parse_args()
    if args.quick:
        args.prefill, args.batches, args.steps, args.repeats = [128, 512], [1, 8, 32], 4, 1
    torch.set_num_threads(args.threads)

    from paceline.model.loader import load_checkpoint

    rows = []
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        ckpt = load_checkpoint(args.model, "float32")
        ours = paceline_speeds(ckpt, dtype, args)
        theirs = {} if args.no_hf else transformers_speeds(ckpt, dtype, args)
        for key, v in ours.items():
            rows.append((dtype_name, key, v, theirs.get(key)))

    print(f"\nthreads={args.threads} context={args.context} (decode) — tokens/s, higher is better")
    print(f"{'dtype':<9} {'phase':<14} {'paceline':>10} {'transformers':>13} {'ratio':>7}")
    for dtype_name, (phase, n), v, ref in rows:
        label = f"prefill {n}" if phase == "prefill" else f"decode b={n}"
        ref_s = f"{ref:13.1f}" if ref else f"{'-':>13}"
        ratio = f"{v / ref:6.2f}x" if ref else f"{'-':>7}"
        print(f"{dtype_name:<9} {label:<14} {v:10.1f} {ref_s} {ratio}")


if __name__ == "__main__":
    main()
