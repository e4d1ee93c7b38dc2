"""schemathesis against a real server: every operation of paceline's /openapi.json, cases generated from the
document (positive: what it says is valid; negative: what it says is not), sent one after another; then the
tally: statuses, server errors (5xx, an error event inside a 200 stream, a hang), 4xx bodies that are not
OpenAI-style, and whether the server still answers a plain request afterwards.

The same document and the same generated cases (hypothesis derandomized) go to every system, so a peer is
judged on the very requests paceline got; where a peer lacks an operation it answers 404, counted like any 4xx.
The cases are changed in two ways only, for time on a 2-core CPU: max_tokens / max_completion_tokens / min_tokens
are capped at 8 (and set to 8 where absent, else a valid request could generate up to the context length), n and
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

import httpx
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
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
        if isinstance(body.get(key), int) and not isinstance(body[key], bool) and body[key] > cap:
            body[key] = cap
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        body["prompt"] = prompt[:MAX_PROMPTS]
    if case.path.startswith("/v1/") and "max_tokens" not in body and "max_completion_tokens" not in body:
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


def run(url: str, doc: dict, model: str, examples: int, timeout_s: float, headers: dict | None = None,
        budget_s: float | None = None) -> dict:
    """budget_s: after this long, the remaining cases are generated but not sent (counted as unsent)."""
    stop_at = time.monotonic() + budget_s if budget_s else float("inf")
    unsent = Counter()
    schema = schemathesis.openapi.from_dict(doc)
    statuses: Counter = Counter()
    by_op: dict[str, Counter] = {}
    server_errors: list[str] = []
    bad_4xx: list[str] = []
    by_mode: dict[str, Counter] = {"positive": Counter(), "negative": Counter()}
    positive_4xx: Counter = Counter()  # why a case the document calls valid was refused (drift, or a cross-field rule)
    session = requests.Session()
    session.headers.update(headers or {})
    for result in schema.get_all_operations():
        op = result.ok()
        label = f"{op.method.upper()} {op.path}"
        by_op[label] = Counter()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            try:
                strategy = op.as_strategy(generation_mode=mode)
            except Exception as e:  # an operation with nothing to make invalid has no negative cases
                by_op[label][f"no {mode.value} cases: {type(e).__name__}"] += 1
                continue

            def sender(strategy, label: str, mode: GenerationMode):  # binds this operation's case source
                @given(case=strategy)
                @settings(max_examples=examples, derandomize=True, database=None, deadline=None,
                          phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
                def send(case) -> None:
                    if time.monotonic() > stop_at:
                        unsent[label] += 1
                        return
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

                return send

            fuzz = sender(strategy, label, mode)
            try:
                fuzz()
            except Exception as e:  # hypothesis gave up generating (an unsatisfiable filter): say so, go on
                by_op[label][f"generation stopped: {type(e).__name__}"] += 1
    after = httpx.post(url + "/v1/completions", headers=headers, timeout=120,
                       json={"model": model, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0})
    return {"requests": sum(statuses.values()), "statuses": dict(sorted(statuses.items())),
            "server_errors": len(server_errors), "server_error_examples": server_errors[:20],
            "4xx_without_openai_error_body": len(bad_4xx), "bad_4xx_examples": bad_4xx[:10],
            "by_operation": {k: dict(v) for k, v in by_op.items()},
            "by_mode": {k: dict(v) for k, v in by_mode.items()},
            "positive_4xx_top": positive_4xx.most_common(15),
            "unsent_after_budget": dict(unsent),
            "still_serves": after.status_code == 200 and bool(after.json()["choices"][0]["text"])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--system", default="paceline", help="paceline | vllm-cpu-fp32 (started here)")
    p.add_argument("--url", default=None, help="a running server instead of starting one")
    p.add_argument("--schema", default=None, help="OpenAPI JSON file (default: the server's own /openapi.json)")
    p.add_argument("--examples", type=int, default=300, help="cases per operation and mode (positive, negative)")
    p.add_argument("--timeout-s", type=float, default=120.0, help="a request with no answer by then is a hang")
    p.add_argument("--budget-s", type=float, default=None, help="stop sending after this many seconds")
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
        report = {"system": args.system, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                  "argv": sys.argv[1:], "schema": args.schema or f"{args.system}'s own /openapi.json",
                  "schemathesis": schemathesis.__version__, "model": model,
                  **run(url, doc, model, args.examples, args.timeout_s, budget_s=args.budget_s)}
    finally:
        if server is not None:
            server.stop()
    report["elapsed_s"] = round(time.monotonic() - t0, 1)
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=1))
        if not args.schema:
            Path(args.output).with_suffix(".schema.json").write_text(json.dumps(doc))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
