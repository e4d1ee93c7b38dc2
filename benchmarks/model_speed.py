"""Executor speed: paceline's ModelRunner against Hugging Face transformers' own forward with its KV cache.

Prints prefill tokens/s (one prompt of each length) and decode tokens/s (a batch of requests each with ~256
tokens of context, one new token per request per step), for each dtype, both engines in the same run.

Decode contexts are filled with random K/V instead of prefilling them (the values do not change the cost), so a
batch of 128 needs no 32k-token prefill. paceline's decode step is a full `ModelRunner.execute` (batch build,
forward, logits, greedy sampling); transformers' is `model(input_ids, past_key_values=DynamicCache)` + argmax. Prefill of both computes logits
for the last prompt token only (transformers: logits_to_keep=1, as its generate() does).

    python benchmarks/model_speed.py                      # everything (several minutes)
    python benchmarks/model_speed.py --quick              # 128/512 prefill, batches 1/8/32, fewer steps
    python benchmarks/model_speed.py --dtypes bfloat16 --batches 1,64 --no-hf
    python benchmarks/model_speed.py --dtypes int4     # 4-bit weights (bf16 activations) vs transformers bf16
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


class Paceline:
    """paceline's executor: a full `ModelRunner.execute` per decode step."""

    name = "paceline"

    def __init__(self, ckpt, dtype, args, quantization="none"):
        from paceline.engine.runner import ModelRunner
        from paceline.model.llama import LlamaModel

        self.arch, self.args = ckpt.arch, args
        self.bs = 16
        self.per_req = (args.context + args.steps + 2 + self.bs - 1) // self.bs
        need = max([max(args.batches or [1]) * self.per_req] + [(n + self.bs - 1) // self.bs for n in args.prefill])
        model = LlamaModel.from_weights(ckpt.arch, ckpt.weights, "cpu", dtype, quantization=quantization)
        self.runner = ModelRunner(model, ckpt.arch, need,
                                  self.bs, dtype=dtype)
        self.runner.kv_cache.normal_()  # stands in for each decoding request's context

    def prefill(self, n: int) -> float:
        from paceline.model.attention import SeqSlice

        prompt = torch.randint(0, self.arch.vocab_size, (n,)).tolist()
        table = list(range((n + self.bs - 1) // self.bs))
        # as in serving: logits only for the last prompt token
        run = lambda: self.runner.forward_tokens(prompt, list(range(n)), [SeqSlice(0, n, table)], [n - 1])  # noqa: E731
        return n / _best(run, self.args.repeats)

    def decode(self, b: int) -> float:
        from paceline.core.outputs import ScheduledRequest, SchedulerOutput
        from paceline.request import Request
        from paceline.sampling import SamplingParams

        ctx, greedy = self.args.context, SamplingParams(temperature=0.0, max_tokens=None)
        reqs = []
        for i in range(b):
            r = Request(str(i), torch.randint(0, self.arch.vocab_size, (ctx,)).tolist(), greedy, 0.0)
            r.append_token(1, 0.0)
            r.num_computed_tokens = ctx
            reqs.append(r)
        tables = [list(range(i * self.per_req, (i + 1) * self.per_req)) for i in range(b)]

        def step() -> float:
            sched = [ScheduledRequest(r, r.num_tokens - 1, 1, t) for r, t in zip(reqs, tables)]
            res = self.runner.execute(SchedulerOutput(scheduled=sched))
            for r in reqs:
                r.num_computed_tokens += 1
                r.append_token(res.token_ids[r.request_id], 0.0)
            return res.duration

        step()  # warm-up
        return b / statistics.median([step() for _ in range(self.args.steps)])


class Transformers:
    """Hugging Face transformers: model(input_ids, past_key_values=DynamicCache) + argmax per decode step."""

    name = "transformers"

    def __init__(self, ckpt, dtype, args):
        import transformers

        from paceline.model.loader import hf_config

        self.arch, self.args, self.dtype = ckpt.arch, args, dtype
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_config(ckpt.arch)))
        hf.load_state_dict(ckpt.weights, strict=False)
        hf.tie_weights()
        self.hf = hf.to(dtype).eval()

    @torch.inference_mode()
    def prefill(self, n: int) -> float:
        from transformers import DynamicCache

        ids = torch.randint(0, self.arch.vocab_size, (1, n))
        run = lambda: self.hf(ids, past_key_values=DynamicCache(config=self.hf.config), use_cache=True,  # noqa: E731
                              logits_to_keep=1)
        return n / _best(run, self.args.repeats)

    @torch.inference_mode()
    def decode(self, b: int) -> float:
        from transformers import DynamicCache

        arch, ctx = self.arch, self.args.context
        cache = DynamicCache(config=self.hf.config)
        shape = (b, arch.num_kv_heads, ctx, arch.head_dim)
        for layer in range(arch.num_layers):
            cache.update(torch.randn(shape, dtype=self.dtype), torch.randn(shape, dtype=self.dtype), layer)
        ids = torch.ones(b, 1, dtype=torch.long)
        durations = []
        for i in range(self.args.steps + 1):
            pos = ctx + i
            t = time.perf_counter()
            logits = self.hf(ids, past_key_values=cache, use_cache=True, position_ids=torch.full((b, 1), pos),
                             attention_mask=torch.ones(b, pos + 1, dtype=torch.long)).logits
            ids = logits[:, -1].argmax(-1, keepdim=True)
            durations.append(time.perf_counter() - t)
        return b / statistics.median(durations[1:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="GGUF path or HF folder (default: bundled SmolLM2-135M-Instruct)")
    p.add_argument("--dtypes", default="float32,bfloat16,int4",
                   help="int4: paceline's 4-bit weights with bfloat16 activations, against transformers in bfloat16")
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

    # each measurement runs paceline then transformers back to back, so both see the same machine load
    print(f"threads={args.threads} context={args.context} (decode) -- tokens/s, higher is better", flush=True)
    print(f"{'dtype':<9} {'phase':<14} {'paceline':>10} {'transformers':>13} {'ratio':>7}", flush=True)
    ckpt = load_checkpoint(args.model, "float32")
    for dtype_name in args.dtypes.split(","):
        quantization = "int4" if dtype_name == "int4" else "none"
        dtype = torch.bfloat16 if quantization == "int4" else getattr(torch, dtype_name)
        engines = [Paceline(ckpt, dtype, args, quantization)] + ([] if args.no_hf else [Transformers(ckpt, dtype, args)])
        jobs = [("prefill", n) for n in args.prefill] + [("decode", b) for b in args.batches]
        for phase, n in jobs:
            ours, *theirs = [getattr(e, phase)(n) for e in engines]
            ref = theirs[0] if theirs else None
            label = f"prefill {n}" if phase == "prefill" else f"decode b={n}"
            ref_s = f"{ref:13.1f}" if ref else f"{'-':>13}"
            ratio = f"{ours / ref:6.2f}x" if ref else f"{'-':>7}"
            print(f"{dtype_name:<9} {label:<14} {ours:10.1f} {ref_s} {ratio}", flush=True)
        del engines


if __name__ == "__main__":
    main()
