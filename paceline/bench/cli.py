"""`paceline bench serve | compare | capacity`: argument parsing only; the work lives in the other bench modules."""
from __future__ import annotations

import argparse


def _ms(x: float | None) -> float | None:
    return None if x is None else x / 1e3


def add_workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", default="chat", help="chat | long-prompt | bursty-priority | a YAML path | a trace CSV")
    p.add_argument("--rate", type=float, default=None, help="mean request rate (req/s)")
    p.add_argument("--duration", type=float, default=None, help="send requests arriving within this many seconds")
    p.add_argument("--num-requests", type=int, default=None, help="send this many requests")
    p.add_argument("--seed", type=int, default=0,
                   help="workload and prompt seed; against a server with a prefix cache, repeat runs need a new seed")
    p.add_argument("--max-model-len", type=int, default=None, help="clip prompt + output to this context (default: the workload's)")
    p.add_argument("--tokenizer", default=None, help="GGUF or Hugging Face folder whose tokenizer cuts prompts (default: the bundled model)")
    p.add_argument("--ttft-slo", type=float, default=None, help="TTFT SLO in ms, for goodput")
    p.add_argument("--tbt-slo", type=float, default=None, help="TBT SLO in ms, for goodput")
    p.add_argument("--stall-threshold", type=float, default=None, help="ms; default 5x the median gap of the run")
    p.add_argument("--output-dir", default=None, help="where JSON and PNGs go (default bench-results/<workload>-<time>)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--html", action="store_true",
                   help="also write report.html: the run drawn by the dashboard's charts (steps from a paceline server)")


def add_parser(subparsers) -> argparse.ArgumentParser:
    bench = subparsers.add_parser("bench", help="benchmark OpenAI-compatible servers")
    sub = bench.add_subparsers(dest="bench_command", required=True)

    serve = sub.add_parser("serve", help="run a workload against a running server")
    serve.add_argument("--url", required=True, help="base URL, e.g. http://127.0.0.1:8000")
    serve.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    serve.add_argument("--label", default=None, help="system name in the report (default: the URL)")
    serve.add_argument("--api", choices=("completions", "chat"), default="completions")
    serve.add_argument("--prompt-format", choices=("ids", "text"), default="ids",
                       help="token-id prompts (exact lengths) or text prompts")
    serve.add_argument("--no-priority", action="store_true", help="do not send the `priority` field")
    serve.add_argument("--max-concurrency", type=int, default=None)
    serve.add_argument("--deadline", type=float, default=None, help="cancel whatever is unfinished after this many s")
    add_workload_args(serve)
    serve.set_defaults(func=cmd_serve)

    from paceline.bench import compare
    compare.add_compare_args(sub.add_parser("compare", help="start each system, run the same workload, one report"))
    compare.add_capacity_args(sub.add_parser("capacity", help="capacity under a TBT SLO of one running server"))
    return bench


def cmd_serve(args: argparse.Namespace) -> int:
    from paceline.bench import html_report
    from paceline.bench.client import Endpoint, run
    from paceline.bench.prompts import PromptSource, build_prompts, load_tokenizer
    from paceline.bench.report import environment, output_dir, run_dict, run_markdown, write_json
    from paceline.bench.workload import generate, load_workload

    spec = load_workload(args.workload, max_model_len=args.max_model_len)
    if args.duration is None and args.num_requests is None and spec.arrival.kind != "trace":
        args.duration = 60.0
    rate = args.rate if args.rate is not None or spec.arrival.kind in ("all-at-once", "trace") else 1.0
    requests = generate(spec, rate=rate, num_requests=args.num_requests, duration_s=args.duration, seed=args.seed)
    ep = Endpoint(args.url, model=args.model, api=args.api, prompt_format=args.prompt_format,
                  send_priority=not args.no_priority)
    prompts = build_prompts(PromptSource(load_tokenizer(args.tokenizer)), requests, args.seed,
                            as_text=ep.prompt_format == "text")
    label = args.label or ep.url
    steps_before = html_report.server_steps(ep.url) if args.html else None
    result = run(ep, requests, prompts, progress=not args.no_progress, deadline_s=args.deadline,
                 max_concurrency=args.max_concurrency, label=label)
    r = run_dict(label, spec.name, rate, result, ttft_slo=_ms(args.ttft_slo), tbt_slo=_ms(args.tbt_slo),
                 stall_threshold_s=_ms(args.stall_threshold),
                 extra={"command": "bench serve", "url": ep.url, "seed": args.seed})
    out = output_dir(args.output_dir, spec.name)
    write_json(out / "results.json", {"environment": environment(), "runs": [r]})
    md = run_markdown(r)
    (out / "results.md").write_text(md + "\n")
    print(md)
    if not args.no_plots:
        from paceline.bench import plots  # matplotlib: the [bench] extra
        plots.all_plots([r], out, _ms(args.tbt_slo))
    if args.html:
        steps, info = html_report.run_steps(steps_before, html_report.server_steps(ep.url))
        # one server model: its latency row is the step log's row; a peer without a step log gets its own
        name = next(iter(info)) if len(info) == 1 else label
        html_report.write(out / "report.html", f"paceline bench: {spec.name} against {label}", md, steps,
                          {name: html_report.latency_of(result.records, name)}, info,
                          note=f"rate {rate} req/s, seed {args.seed}")
    print(f"\nwrote {out}/results.json, results.md" + ("" if args.no_plots else " and plots")
          + (", report.html" if args.html else ""))
    return 0 if r["summary"]["completed"] else 1


def main(argv: list[str] | None = None) -> int:
    """`python -m paceline.bench.cli serve ...`: the same commands without the paceline entry point."""
    parser = argparse.ArgumentParser(prog="paceline")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser(sub)
    args = parser.parse_args(["bench", *(argv if argv is not None else __import__("sys").argv[1:])])
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
