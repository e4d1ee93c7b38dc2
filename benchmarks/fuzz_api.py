"""schemathesis against a real server: every operation of paceline's /openapi.json, cases generated from the
document (positive: what it says is valid; negative: what it says is not), sent one after another; then the
tally: statuses, server errors (5xx, an error event inside a 200 stream, a hang), 4xx bodies that are not
OpenAI-style, and whether the server still answers a plain request afterwards.

The same document and the same generated cases (hypothesis derandomized) go to every system, so a peer is
judged on the very requests paceline got; where a peer lacks an operation it answers 404, counted like any 4xx.
The cases are changed in two ways only, for time on a 2-core CPU: max_tokens / max_completion_tokens / min_tokens
are capped at 8 (and set to 8 where absent or null, else a valid request could generate up to the context length), n and
best_of at 4, a batch of prompts at its first 4; `model`, where a positive case carries one, is the server's own name (else every positive case is a 404).

    python benchmarks/fuzz_api.py --system paceline --examples 300 --output /tmp/fuzz-paceline.json
    python benchmarks/fuzz_api.py --system vllm-cpu-fp32 --schema /tmp/fuzz-paceline.schema.json --examples 300
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Callable

import httpx
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, seed, settings
from schemathesis.generation import GenerationMode

from paceline.bench.peers import Server, System, vllm_cpu_system
from paceline.model.loader import default_model_path

CAPS = {"max_tokens": 8, "max_completion_tokens": 8, "min_tokens": 8, "n": 4, "best_of": 4}
MAX_PROMPTS = 4  # a batch of prompts keeps its first 4: 64 prompts x n would be minutes of CPU for one case


def system_for(name: str) -> System:
    if name == "paceline":
        return System("paceline", [sys.executable, "-m", "paceline.entrypoints.cli", "--log-level", "WARNING",
                                   "serve", "--host", "127.0.0.1", "--port", "{port}"], is_paceline=True)
    if name == "vllm-cpu-fp32":
        return vllm_cpu_system(default_model_path(), dtype="float32")
    raise SystemExit(f"unknown system {name!r}: paceline or vllm-cpu-fp32")


def adjust(case, model: str, mode: GenerationMode) -> None:
    body = case.body
    if not isinstance(body, dict):
        return
    for key, cap in CAPS.items():
        value = body.get(key)  # 2255.0 too: JSON Schema's integer includes it, and vLLM takes it as 2255
        whole = (isinstance(value, int) and not isinstance(value, bool)) or (isinstance(value, float) and value.is_integer())
        if whole and value > cap:  # a fraction stays: it is a negative case's invalid value
            body[key] = cap
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        body["prompt"] = prompt[:MAX_PROMPTS]
    # absent or null (a null asks for as many as the context allows: thousands of tokens, minutes on a CPU)
    if case.path.startswith("/v1/") and body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = 8
    if mode == GenerationMode.POSITIVE and isinstance(body.get("model"), str):
        body["model"] = model


def classify(r: requests.Response) -> tuple[str, str | None]:
    """(status class, why it is a problem or None)."""
    if r.status_code >= 500:
        return f"{r.status_code}", f"{r.status_code}: {r.text[:200]}"
    if r.status_code >= 400:
        try:
            err = r.json().get("error")
            ok = isinstance(err, dict) and isinstance(err.get("message"), str) and err["message"]
        except (ValueError, AttributeError):
            ok = False
        return f"{r.status_code}", None if ok else f"4xx without an OpenAI error body: {r.text[:200]}"
    if "text/event-stream" in r.headers.get("content-type", "") and '"error"' in r.text:
        return "200 stream with an error event", f"stream error: {r.text[-300:]}"
    return f"{r.status_code}", None


class BudgetSpent(Exception):
    """Raised inside a hypothesis run once the time budget is spent: generating the rest would take minutes too."""


def run(url: str, doc: dict, model: str, examples: int, timeout_s: float, headers: dict | None = None,
        budget_s: float | None = None, progress: Callable[[dict], None] | None = None,
        case_seed: int | None = None) -> dict:
    """case_seed: None draws hypothesis's derandomized cases (the same every run, so two systems get the same
    requests); a number draws another fixed set, so a rerun tries cases the earlier runs never sent.
    budget_s: the time every operation and mode share (evenly, what one leaves going to the next); a run that
    spends its share stops generating and is listed as cut short. progress(tally so far) after each operation and
    mode, so a run cut short from outside still leaves its figures."""
    stop_at = time.monotonic() + budget_s if budget_s else float("inf")
    not_reached: list[str] = []
    schema = schemathesis.openapi.from_dict(doc)
    statuses: Counter = Counter()
    by_op: dict[str, Counter] = {}
    server_errors: list[str] = []
    bad_4xx: list[str] = []
    by_mode: dict[str, Counter] = {"positive": Counter(), "negative": Counter()}
    positive_4xx: Counter = Counter()  # why a case the document calls valid was refused (drift, or a cross-field rule)

    def tally() -> dict:
        return {"requests": sum(statuses.values()), "statuses": dict(sorted(statuses.items())),
                "server_errors": len(server_errors), "server_error_examples": server_errors[:20],
                "4xx_without_openai_error_body": len(bad_4xx), "bad_4xx_examples": bad_4xx[:10],
                "by_operation": {k: dict(v) for k, v in by_op.items()},
                "by_mode": {k: dict(v) for k, v in by_mode.items()},
                "positive_4xx_top": positive_4xx.most_common(15), "cut_short_by_budget": list(not_reached)}
    session = requests.Session()
    session.headers.update(headers or {})
    operations = [result.ok() for result in schema.get_all_operations()]
    runs_left = 2 * len(operations)  # each operation's positive and negative cases share the budget evenly;
    for op in operations:  # what a quick one (GET /health) leaves goes to the ones after it
        label = f"{op.method.upper()} {op.path}"
        by_op[label] = Counter()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            now = time.monotonic()
            run_stop = now + (stop_at - now) / runs_left if budget_s else float("inf")
            runs_left -= 1
            try:
                strategy = op.as_strategy(generation_mode=mode)
            except Exception as e:  # an operation with nothing to make invalid has no negative cases
                by_op[label][f"no {mode.value} cases: {type(e).__name__}"] += 1
                continue

            def sender(strategy, label: str, mode: GenerationMode, run_stop: float):  # binds this run's source and end
                @given(case=strategy)
                @settings(max_examples=examples, derandomize=case_seed is None, database=None, deadline=None,
                          phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
                def send(case) -> None:
                    if time.monotonic() > run_stop:
                        raise BudgetSpent
                    adjust(case, model, mode)
                    try:
                        r = case.call(base_url=url, session=session, timeout=timeout_s)
                        kind, problem = classify(r)
                    except requests.Timeout:
                        kind, problem = "timeout", f"no answer within {timeout_s} s: {label} {str(case.body)[:200]}"
                    except requests.ConnectionError as e:
                        kind, problem = "connection error", f"{type(e).__name__}: {label} {str(case.body)[:200]}"
                    statuses[kind] += 1
                    by_mode[mode.value][kind[0] + "xx" if kind[0].isdigit() else kind] += 1
                    if mode == GenerationMode.POSITIVE and kind.startswith("4") and problem is None:
                        positive_4xx[f"{label} {kind}: {str(r.json()['error'].get('message'))[:90]}"] += 1
                    by_op[label][kind] += 1
                    if problem and problem.startswith("4xx"):
                        bad_4xx.append(f"{label}: {problem}")
                    elif problem:
                        server_errors.append(f"{label} [{mode.value}] {problem} | body: {str(case.body)[:300]}")

                return send if case_seed is None else seed(case_seed)(send)

            fuzz = sender(strategy, label, mode, run_stop)
            try:
                fuzz()
            except BudgetSpent:
                not_reached.append(f"{label} {mode.value}")
            except Exception as e:  # hypothesis gave up generating (an unsatisfiable filter): say so, go on
                if isinstance(getattr(e, "__cause__", None), BudgetSpent) or "BudgetSpent" in repr(e):
                    not_reached.append(f"{label} {mode.value}")
                else:
                    by_op[label][f"generation stopped: {type(e).__name__}"] += 1
            if progress is not None:
                progress(tally())

    after = httpx.post(url + "/v1/completions", headers=headers, timeout=120,
                       json={"model": model, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0})
    return {**tally(), "still_serves": after.status_code == 200 and bool(after.json()["choices"][0]["text"])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--system", default="paceline", help="paceline | vllm-cpu-fp32 (started here)")
    p.add_argument("--url", default=None, help="a running server instead of starting one")
    p.add_argument("--schema", default=None, help="OpenAPI JSON file (default: the server's own /openapi.json)")
    p.add_argument("--examples", type=int, default=300, help="cases per operation and mode (positive, negative)")
    p.add_argument("--timeout-s", type=float, default=120.0, help="a request with no answer by then is a hang")
    p.add_argument("--budget-s", type=float, default=None,
                   help="stop generating and sending after this many seconds (the rest is listed as not reached)")
    p.add_argument("--seed", type=int, default=None,
                   help="draw a different fixed set of cases (default: hypothesis's derandomized set)")
    p.add_argument("--output", default=None, help="write the tally here (and the schema beside it)")
    args = p.parse_args()
    system = system_for(args.system)
    if system.skip:
        raise SystemExit(system.skip)
    t0 = time.monotonic()
    server = None
    url = args.url
    if url is None:
        server = Server(system, Path(f"/tmp/paceline-fuzz-{args.system}.log")).__enter__()
        url = server.url
    try:
        model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        doc = json.loads(Path(args.schema).read_text()) if args.schema else httpx.get(url + "/openapi.json").json()
        if args.output and not args.schema:  # now, so a peer's run has the document even if this one is cut short
            Path(args.output).with_suffix(".schema.json").write_text(json.dumps(doc))
        head = {"system": args.system, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "argv": sys.argv[1:], "schema": args.schema or f"{args.system}'s own /openapi.json",
                "schemathesis": schemathesis.__version__, "model": model}

        def progress(tally: dict) -> None:
            print(f"{time.monotonic() - t0:6.0f} s: {tally['requests']} requests, {tally['server_errors']} server "
                  f"errors, statuses {tally['statuses']}", file=sys.stderr, flush=True)
            if args.output:
                Path(args.output).write_text(json.dumps({**head, "partial": True, **tally}, indent=1))

        report = {**head, **run(url, doc, model, args.examples, args.timeout_s, budget_s=args.budget_s,
                                progress=progress, case_seed=args.seed)}
    finally:
        if server is not None:
            server.stop()
    report["elapsed_s"] = round(time.monotonic() - t0, 1)
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
