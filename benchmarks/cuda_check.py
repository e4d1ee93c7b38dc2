"""The CUDA path, checked on a GPU: exactness against the references the CPU tests use, and throughput figures.

    python benchmarks/cuda_check.py [--model PATH.gguf] [--device cuda] [--out DIR]

CI has no GPU, so this runs by hand where torch sees one (docs/serving.md, "CUDA"). Each check prints PASS or FAIL
with its numbers; --out writes them as cuda_check.json. On a machine without CUDA, `--device cpu` runs the same
checks (how the script itself is tested).
1. tiny random Llama: paceline's forward on the device against transformers' on the device, float32;
2. the bundled model in float32: greedy output equals transformers fp32 (teacher forcing, ties allowed: the rule of
   tests/model/test_hf_equivalence.py);
3. the engine: chunked prefill equals whole prompts; preempted (recompute, swap) equals uninterrupted;
4. bfloat16 and float16 against float32 greedy: tokens equal before the first difference (quality in numbers);
5. throughput of the offline LLM API: prompts x new tokens, generated tokens per second.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from paceline.entrypoints.llm import LLM
from paceline.model.loader import default_model_path, hf_config, load_checkpoint
from paceline.sampling import SamplingParams

NEW_TOKENS = 64
TIE = 1e-4  # a greedy token may differ from the reference's only where the reference's top two logits tie
PROMPTS = ["What is the capital of France?", "Write a haiku about the ocean.", "Explain how a hash map works.",
           "List three uses of copper.", "The quick brown fox", "def fibonacci(n):\n", "1, 2, 3, 5, 8, 13,"]


def long_prompt() -> str:
    lines = [f"In {1780 + 7 * i}, town {i} built bridge {i % 8}, which cost {120 + 13 * i} pounds." for i in range(60)]
    return "A short history of the valley. " + " ".join(lines) + " The most expensive project was"


def greedy(llm: LLM, prompts: list, max_tokens: int = NEW_TOKENS) -> tuple[list[list[int]], int]:
    """Greedy tokens of every prompt, and how many preemptions (recomputed or swapped out) the engine made."""
    engine, sp = llm.engine, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = [engine.add_request(f"g{i}", p, sp).request_id for i, p in enumerate(prompts)]
    out: dict[str, list[int]] = {rid: [] for rid in ids}
    preempted = 0
    while engine.has_unfinished():
        for o in engine.step():
            if o.error:
                raise RuntimeError(f"request {o.request_id} failed: {o.error}")
            out[o.request_id].extend(o.new_token_ids)
        if engine.last_step is not None:
            preempted += engine.last_step.num_preempted + engine.last_step.num_swapped_out
    return [out[rid] for rid in ids], preempted


def check_tiny(device: str) -> dict:
    import transformers

    from paceline.core.outputs import ScheduledRequest, SchedulerOutput
    from paceline.engine.runner import ModelRunner
    from paceline.model.arch import ModelArch
    from paceline.model.llama import LlamaModel
    from paceline.request import Request

    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   initializer_range=0.15, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    arch = ModelArch.from_hf_config({**cfg.to_dict(), "architectures": ["LlamaForCausalLM"], "rope_theta": 10000.0})
    ours = LlamaModel.from_weights(arch, hf.state_dict(), device, torch.float32)
    ids = torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = torch.log_softmax(hf.to(device)(torch.tensor([ids], device=device)).logits[0, -1].float(), -1)
    # the runner's own path: one prompt step of 40 tokens, the last row's top-5 logprobs
    req = Request("t", ids, SamplingParams(temperature=0.0, max_tokens=1, logprobs=5), arrival_time=0.0)
    res = ModelRunner(ours, arch, 16, 16, device=device).execute(
        SchedulerOutput(scheduled=[ScheduledRequest(req, 0, len(ids), [0, 1, 2])]))
    top = res.logprobs["t"].top
    diff = max(abs(lp - ref[t].item()) for t, lp in top)
    ok = diff < 1e-4 and [t for t, _ in top] == ref.topk(5).indices.tolist()
    return {"check": "tiny llama forward = transformers fp32", "ok": ok, "max_abs_logprob_diff": diff}


def check_bundled(model: str, device: str) -> dict:
    """paceline's greedy tokens on the device; the reference is transformers fp32 over the same dequantized weights,
    given the prompt and paceline's tokens at once: each of our tokens must be its argmax or tie with it."""
    import transformers

    ckpt = load_checkpoint(model, "float32")
    llm = LLM(model, dtype="float32", quantization="none", device=device)
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS + [long_prompt()]]
    t0 = time.perf_counter()
    ours, _ = greedy(llm, prompts)
    took = time.perf_counter() - t0
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_config(ckpt.arch)))
    hf.load_state_dict(ckpt.weights, strict=False)
    hf.tie_weights()
    hf = hf.eval().to(device)
    exact, ties, worst = 0, 0, 0.0
    for prompt, gen in zip(prompts, ours):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + gen], device=device)).logits[0, len(prompt) - 1:-1].float()
        ref = logits.argmax(-1).tolist()
        if ref == gen:
            exact += 1
            continue
        i = next(j for j in range(len(gen)) if ref[j] != gen[j])
        gap = (logits[i].max() - logits[i, gen[i]]).item()
        worst = max(worst, gap)
        ties += gap <= TIE
    ok = exact + ties == len(prompts) and exact >= len(prompts) - 1
    del llm
    return {"check": "bundled float32 greedy = transformers fp32", "ok": ok, "prompts": len(prompts),
            "exact": exact, "ties": ties, "worst_gap": worst, "longest_prompt": max(map(len, prompts)),
            "generate_s": round(took, 3)}


def check_engine(model: str, device: str) -> list[dict]:
    """Chunked = whole, preempted = uninterrupted, on the device; and reduced precisions against float32."""
    base = dict(dtype="float32", quantization="none", device=device)
    whole = LLM(model, max_num_batched_tokens=4096, **base)
    prompts = [whole.tokenizer.encode(p) for p in PROMPTS + [long_prompt()]]
    ref, _ = greedy(whole, prompts)
    del whole
    results = []
    chunked = LLM(model, max_num_batched_tokens=64, **base)
    got, _ = greedy(chunked, prompts)
    results.append({"check": "chunked prefill (64-token steps) = whole", "ok": got == ref})
    del chunked
    for mode in ("recompute", "swap"):
        small = LLM(model, num_blocks=110, block_size=16, preemption_mode=mode, swap_space_gb=0.05, **base)
        got, preempted = greedy(small, prompts)
        results.append({"check": f"preempted ({mode}) = uninterrupted", "ok": got == ref and preempted > 0,
                        "preemptions": preempted})
        del small
    for dtype in ("bfloat16", "float16"):
        low = LLM(model, dtype=dtype, quantization="none", device=device)
        got, _ = greedy(low, prompts)
        same = [next((j for j in range(NEW_TOKENS) if a[j] != b[j]), NEW_TOKENS) for a, b in zip(got, ref)]
        results.append({"check": f"{dtype} against float32 greedy", "ok": True, "identical_prompts": same.count(NEW_TOKENS),
                        "prompts": len(prompts), "tokens_before_first_difference": same})
        del low
    return results


def throughput(model: str, device: str, dtype: str, batch: int, new_tokens: int = 128) -> dict:
    llm = LLM(model, dtype=dtype, quantization="none", device=device)  # the dtype asked for, on CPU too (not int4)
    prompts = [llm.tokenizer.encode(f"{PROMPTS[i % len(PROMPTS)]} (variant {i})") for i in range(batch)]
    greedy(llm, prompts[:2], 8)  # warm-up: first-call set-up stays out of the figure
    t0 = time.perf_counter()
    out, _ = greedy(llm, prompts, new_tokens)
    took = time.perf_counter() - t0
    return {"check": f"throughput {dtype} batch {batch}", "ok": all(len(o) == new_tokens for o in out),
            "tokens": batch * new_tokens, "seconds": round(took, 3), "tok_per_s": round(batch * new_tokens / took, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="the GGUF (default: the bundled SmolLM2-135M-Instruct)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", default="1,16,64", help="throughput batch sizes")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    model = args.model or default_model_path()
    device = args.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("torch sees no CUDA device here")
    info = {"device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu", "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    print(json.dumps(info))
    results = []
    steps = [("tiny", lambda: [check_tiny(device)]), ("bundled", lambda: [check_bundled(model, device)]),
             ("engine", lambda: check_engine(model, device))]
    steps += [(f"throughput {d} {b}", lambda b=b, d=d: [throughput(model, device, d, b)])
              for d in ("float32", "bfloat16") for b in map(int, args.batches.split(","))]
    for name, step in steps:
        try:
            got = step()
        except Exception as e:  # one broken check must not hide the others' results
            got = [{"check": name, "ok": False, "error": f"{type(e).__name__}: {e}"}]
        for r in got:
            print(("PASS " if r["ok"] else "FAIL ") + json.dumps(r), flush=True)
        results += got
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "cuda_check.json").write_text(json.dumps({**info, "results": results}, indent=1))
    raise SystemExit(0 if all(r["ok"] for r in results) else 1)


if __name__ == "__main__":
    main()
