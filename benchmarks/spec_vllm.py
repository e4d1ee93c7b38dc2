"""One stream over HTTP, side by side: vLLM CPU (float32, its best mode here) with and without its n-gram
speculation, and paceline float32 with and without n-gram speculation (fixed k and adaptive k), on the prompts of
spec_speed.py. Decode tok/s of a streamed answer: (tokens - 1) / (last token's arrival - first token's).

    python benchmarks/spec_vllm.py --k 4 --tokens 96 --repeats 3 --output-dir /tmp/spec_vllm
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spec_speed import PROMPTS  # noqa: E402

from paceline.bench.peers import Server, paceline_system, vllm_cpu_system  # noqa: E402
from paceline.bench.prompts import bundled_gguf  # noqa: E402


def one_stream(url: str, model: str, prompt: str, tokens: int) -> tuple[float, int]:
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    times, n = [], 0
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                n = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                times.append(time.perf_counter())
    return (n - 1) / (times[-1] - times[0]), n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--output-dir", default="/tmp/spec_vllm")
    args = p.parse_args()
    model = bundled_gguf()
    ngram = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    vllm = vllm_cpu_system(model, dtype="float32")
    pace = paceline_system("stall-free", 512, model, extra=["--dtype", "float32"])
    systems = [("vLLM CPU fp32", vllm),
               (f"vLLM CPU fp32, n-gram k={args.k}", dataclasses.replace(
                   vllm, argv=vllm.argv + ["--speculative-config", json.dumps(ngram)])),
               ("paceline fp32", pace),
               (f"paceline fp32, n-gram fixed k={args.k}", dataclasses.replace(
                   pace, argv=pace.argv + ["--speculative-config", json.dumps({**ngram, "adaptive": False})])),
               (f"paceline fp32, n-gram adaptive k<={args.k}", dataclasses.replace(
                   pace, argv=pace.argv + ["--speculative-config", json.dumps(ngram)]))]
    print("| system | prompt | decode tok/s (median of %d) | tokens |" % args.repeats)
    print("|---|---|---:|---:|")
    for i, (label, system) in enumerate(systems):
        if system.skip:
            print(f"| {label} | - | skipped: {system.skip} | |")
            continue
        try:
            with Server(system, Path(args.output_dir) / f"{i}.log") as server:
                name = system.model or httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
                one_stream(server.url, name, "Hello", 8)  # warm-up
                for plabel, prompt in PROMPTS.items():
                    runs = [one_stream(server.url, name, prompt, args.tokens) for _ in range(args.repeats)]
                    print(f"| {label} | {plabel} | {statistics.median(r for r, _ in runs):.1f} | {runs[0][1]} |",
                          flush=True)
        except Exception as e:  # a peer that fails to start is reported, not dropped
            print(f"| {label} | - | failed: {type(e).__name__}: {str(e)[:200]} | |", flush=True)


if __name__ == "__main__":
    main()
