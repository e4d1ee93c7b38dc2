"""Two models in one server (one step loop) against one `paceline serve` process per model on the same cores, same
traffic; each model alone at its own rate; and switching to a model that is not loaded.

    flock -x /tmp/paceline-cpu.lock python benchmarks/multi_model.py --rate 0.5 --seconds 60

Models: the bundled SmolLM2-135M as smol-fp32 (float32) and smol-int4 (int4), both with the default KV memory and
step-time target, so the step-time profiles that `paceline serve` caches for those setups serve every run here.
Traffic: the chat workload's lengths (outputs capped), Poisson arrivals, each request a model (50/50).
Every server gets the same requests at the same times; prompts are token ids, a fresh epoch per server.
Results as JSON under --out (not committed) and a table on stdout.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import httpx
import numpy as np

from paceline.bench.client import Endpoint, run
from paceline.bench.metrics import summarize
from paceline.bench.peers import free_port
from paceline.bench.prompts import PromptSource, build_prompts, load_tokenizer
from paceline.bench.workload import LengthDist, ModelShare, RequestSpec, generate, load_workload

MODELS = {"smol-fp32": ["--dtype", "float32"], "smol-int4": ["--quantization", "int4"]}


class Served:
    def __init__(self, args: list[str], threads: int, log_dir: Path, label: str, env: dict | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_dir / f"{label}.log", "w")
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), **(env or {})}
        self.proc = subprocess.Popen([sys.executable, "-m", "paceline.entrypoints.server", "--port", str(self.port),
                                      "--no-dashboard", *args], stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 900
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server {label} did not start; see {self.log.name}")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


def per_model(records: list, duration: float) -> dict:
    out = {}
    for name in MODELS:
        recs = [r for r in records if r.model == name]
        if recs:
            s = summarize(recs, duration=duration, by_priority=False)
            out[name] = {"p99_tbt_ms": 1e3 * s["tbt"]["p99"], "p50_tbt_ms": 1e3 * s["tbt"]["p50"],
                         "p50_ttft_s": s["ttft"]["p50"], "tok_s": s["output_throughput"],
                         "completed": s["completed"], "failed": s["failed"]}
    s = summarize(records, duration=duration, by_priority=False)
    out["total"] = {"p99_tbt_ms": 1e3 * s["tbt"]["p99"], "tok_s": s["output_throughput"], "completed": s["completed"],
                    "failed": s["failed"]}
    return out


def drive(ep: Endpoint, requests: list[RequestSpec], prompts: list, duration: float) -> dict:
    res = run(ep, requests, prompts, progress=False, scrape_interval=None, deadline_s=duration + 240)
    return per_model(res.records, res.duration_s)


def models_yaml(path: Path, lazy: set[str] = frozenset()) -> Path:
    lines = ["models:"]
    for name in MODELS:
        mode = "dtype: float32" if name == "smol-fp32" else "quantization: int4"
        lines.append(f"  - {{name: {name}, {mode}{', load: lazy' if name in lazy else ''}}}")
    path.write_text("\n".join(lines) + "\n")
    return path


def switch_run(args: argparse.Namespace, log_dir: Path, source: PromptSource, variant: str = "") -> dict:
    """Streams of one model run; a request for the other, unloaded, model arrives mid-run. Its TTFT (the load
    included) and the streams' largest gap while it loads, against their p99 over the rest of the run.
    variant "" : smol-fp32 is loaded while smol-int4 streams run; "int4": the other way round; "nice19": as "",
    with the loader at nice 19 (PACELINE_LOADER_NICE=19, as before 2026-11-23 21:30 UTC); "pack-first": as "",
    packing the weights before the model serves (PACELINE_DEFER_PACKING=0); "warm-up": as "", with the loader's
    two warm-up forwards before the model joins (PACELINE_LOAD_WARM_UP=1, as before 2026-11-24); "whole" and
    "int4-whole": as "" and "int4", the first prompt in one uncapped step (PACELINE_DEBUT_STEP=whole).
    The server's own split of the switch (seconds from the request to each mark; residency.LoadTimeline) comes
    back from /v1/models; the streams' gaps are split at its `joined` mark into the load and the first prompt
    (the client's send time stands for the server's request mark: both on this machine, a few ms apart)."""
    env = {"pack-first": {"PACELINE_DEFER_PACKING": "0"}, "nice19": {"PACELINE_LOADER_NICE": "19"},
           "warm-up": {"PACELINE_LOAD_WARM_UP": "1"}, "whole": {"PACELINE_DEBUT_STEP": "whole"},
           "int4-whole": {"PACELINE_DEBUT_STEP": "whole"}}.get(variant, {})
    target = "smol-int4" if variant.startswith("int4") else "smol-fp32"
    other = next(name for name in MODELS if name != target)
    label = f"switch{'-' + variant if variant else ''}"
    server = Served(["--models-config", str(models_yaml(log_dir / f"{label}.yaml", {target}))], args.threads,
                    log_dir, label, env)
    try:
        steady = generate(replace(load_workload("chat"), output_tokens=LengthDist("fixed", value=args.output_tokens),
                                  prompt_tokens=LengthDist("lognormal", median=300, sigma=0.8, min=16, max=1000)),
                          rate=args.rate / 2, duration_s=args.switch_seconds, seed=args.seed + 7)
        steady = [replace(r, model=other) for r in steady]
        # 1 s after the first of the other model's arrivals past mid-run, so that its streams run while the
        # target loads (at a fixed mid-run time the loop was idle on 2026-11-24: nothing to measure a gap of)
        at = 1.0 + min((r.arrival_s for r in steady if r.arrival_s >= args.switch_seconds / 2),
                       default=args.switch_seconds / 2)
        # model= by name: before 2026-11-24 this was the sixth positional field (client), so the request went to
        # the first model served, and "switch-int4" loaded nothing
        one = RequestSpec(len(steady), at, 64, 16, 0, model=target)
        requests = steady + [one]
        prompts = build_prompts(source, requests, args.seed, as_text=False, epoch=9)
        res = run(Endpoint(server.url), requests, prompts, progress=False, scrape_interval=None,
                  deadline_s=args.switch_seconds + 240)
        models = httpx.get(server.url + "/v1/models").json()["data"]
    finally:
        server.stop()
    rec = res.records[-1]
    first = rec.token_times[0] if rec.token_times else None
    window = (rec.sent_s, first if first is not None else rec.sent_s)
    split = next((m.get("last_load") for m in models if m["id"] == target), None) or {}
    joined = rec.sent_s + split["joined"] if "joined" in split else window[1]
    inside, outside, loading, prompting = [], [], [], []
    for r in res.records[:-1]:
        for a, b in zip(r.token_times, r.token_times[1:]):
            if b > window[0] and a < window[1]:
                inside.append(b - a)
                (loading if a < joined else prompting).append(b - a)
            else:
                outside.append(b - a)
    log_lines = [line.strip() for line in (log_dir / f"{label}.log").read_text().splitlines()
                 if target in line and ("loaded in" in line or "packed" in line)]
    return {"target": target, "switch_ttft_s": (first - rec.sent_s) if first is not None else None,
            "error": rec.error,
            "log": log_lines,
            "others_max_gap_during_load_ms": 1e3 * max(inside, default=0.0),
            "others_p99_gap_elsewhere_ms": 1e3 * float(np.percentile(outside, 99)) if outside else None,
            "gaps_during_load": len(inside),
            "split_s": split,
            "others_max_gap_loading_ms": 1e3 * max(loading, default=0.0),
            "others_max_gap_first_prompt_ms": 1e3 * max(prompting, default=0.0),
            "models": models}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", type=float, default=0.5, help="total requests per second, split 50/50")
    p.add_argument("--seconds", type=float, default=60.0, help="arrivals span this long")
    p.add_argument("--switch-seconds", type=float, default=30.0)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="folder for logs and results.json (default: a temp folder)")
    p.add_argument("--only", default="alone,one-loop,two-processes,switch",
                   help="comma-separated parts (prepare: load both once, so that a switch finds their runtime "
                        "snapshots and step-time profiles cached); switch variants (see switch_run): switch, switch-int4, "
                        "switch-nice19, switch-pack-first, switch-warm-up, switch-whole, switch-int4-whole")
    args = p.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="multi-model-"))
    out.mkdir(parents=True, exist_ok=True)
    only = set(args.only.split(","))

    spec = replace(load_workload("chat"), output_tokens=LengthDist("fixed", value=args.output_tokens),
                   prompt_tokens=LengthDist("lognormal", median=300, sigma=0.8, min=16, max=1000),
                   models=[ModelShare("smol-fp32", 0.5), ModelShare("smol-int4", 0.5)])
    requests = generate(spec, rate=args.rate, duration_s=args.seconds, seed=args.seed)
    source = PromptSource(load_tokenizer())
    results: dict = {"rate": args.rate, "seconds": args.seconds, "num_requests": len(requests),
                     "output_tokens": args.output_tokens, "threads": args.threads,
                     "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    epoch = 0

    def prompts_for(reqs: list[RequestSpec]) -> list:
        nonlocal epoch
        epoch += 1
        return build_prompts(source, reqs, args.seed, as_text=False, epoch=epoch)

    if "prepare" in only:  # both models loaded at start-up once: their snapshots and step-time profiles cached
        Served(["--models-config", str(models_yaml(out / "prepare.yaml"))], args.threads, out, "prepare").stop()
    if "alone" in only:  # each model alone, its own share of the traffic at the same times
        results["alone"] = {}
        for name, flags in MODELS.items():
            server = Served(flags + ["--served-model-name", name], args.threads, out, f"alone-{name}")
            try:
                mine = [r for r in requests if r.model == name]
                results["alone"][name] = drive(Endpoint(server.url), mine, prompts_for(mine), args.seconds)[name]
            finally:
                server.stop()
            print(name, "alone", results["alone"][name], flush=True)
    if "one-loop" in only:
        server = Served(["--models-config", str(models_yaml(out / "models.yaml"))], args.threads, out, "one-loop")
        try:
            results["one_loop"] = drive(Endpoint(server.url), requests, prompts_for(requests), args.seconds)
        finally:
            server.stop()
        print("one loop", results["one_loop"], flush=True)
    if "two-processes" in only:  # the anchor: one `paceline serve` per model, both on the same cores
        servers = {}
        try:
            for name, flags in MODELS.items():
                servers[name] = Served(flags + ["--served-model-name", name], args.threads, out, f"proc-{name}")
            urls = {name: s.url for name, s in servers.items()}
            results["two_processes"] = drive(Endpoint(urls["smol-fp32"], model_urls=urls), requests,
                                             prompts_for(requests), args.seconds)
        finally:
            for s in servers.values():
                s.stop()
        print("two processes", results["two_processes"], flush=True)
    for variant in ("pack-first", "nice19", "warm-up", "", "whole", "int4", "int4-whole"):
        key = f"switch{'-' + variant if variant else ''}"
        if key in only:
            results[key] = switch_run(args, out, source, variant)
            print(key, {k: v for k, v in results[key].items() if k != "models"}, flush=True)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    print(f"results: {out / 'results.json'}")


if __name__ == "__main__":
    main()
