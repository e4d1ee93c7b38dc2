"""paceline serve | generate | bench | simulate | profile."""
from __future__ import annotations

import argparse
import logging
import sys

from paceline.config import SCHEDULERS, CacheConfig, EngineConfig, SchedulerConfig, scheduler_name

SAMPLE_PROMPT = "Explain in two sentences why the sky is blue."


def _generate(args: argparse.Namespace) -> None:
    from paceline.entrypoints.llm import LLM
    from paceline.sampling import SamplingParams

    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                max_tokens=args.max_tokens, seed=args.seed, stop=args.stop or [])
    except ValueError as e:
        sys.exit(f"error: {e}")
    try:
        llm = LLM(args.model, dtype=args.dtype, quantization=args.quantization, policy=args.scheduler,
                  kv_cache_memory_gb=args.kv_cache_memory_gb, speculative_config=args.speculative_config,
                  tensor_parallel_size=args.tensor_parallel_size, pipeline_parallel_size=args.pipeline_parallel_size)
    except ValueError as e:
        sys.exit(f"error: {e}")
    prompts = args.prompt or [SAMPLE_PROMPT]
    if args.raw:
        outputs = llm.generate(prompts, params)
    else:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    for prompt, out in zip(prompts, outputs):
        if len(prompts) > 1:
            print(f"### {prompt}")
        print(out.outputs[0].text)


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text offline for one or more prompts")
    p.add_argument("prompt", nargs="*", help=f"prompts (default: {SAMPLE_PROMPT!r})")
    p.add_argument("--model", default=None, help="GGUF file or Hugging Face folder (default: bundled SmolLM2-135M-Instruct)")
    p.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--speculative-config", default=None,
                   help='JSON as vLLM: {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": N}')
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--tensor-parallel-size", type=int, default=EngineConfig.tensor_parallel_size)
    p.add_argument("--pipeline-parallel-size", type=int, default=EngineConfig.pipeline_parallel_size)
    p.add_argument("--dtype", default=EngineConfig.dtype, choices=["auto", "float32", "bfloat16"])
    p.add_argument("--quantization", default=EngineConfig.quantization, choices=["none", "int4"])
    p.add_argument("--scheduler", default=SchedulerConfig.policy, choices=SCHEDULERS, type=scheduler_name)
    p.add_argument("--kv-cache-memory-gb", type=float, default=CacheConfig.kv_cache_memory_gb)
    p.set_defaults(func=_generate)


def _add_serve(sub) -> None:
    from paceline.entrypoints.server import add_serve_args, run_server

    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    add_serve_args(p)
    p.set_defaults(func=run_server)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="paceline", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    _add_generate(sub)
    from paceline.bench.cli import add_parser as add_bench
    from paceline.sim.cli import add_parsers as add_sim
    add_bench(sub)
    add_sim(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args.func(args)


if __name__ == "__main__":
    main()
