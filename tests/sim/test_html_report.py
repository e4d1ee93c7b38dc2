"""`paceline simulate --html`: the simulated run as the dashboard's charts draw a server's, one row per replica."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def page_data(path: Path) -> dict:
    text = path.read_text()
    tag = '<script id="run-data" type="application/json">'
    start = text.index(tag) + len(tag)
    return json.loads(text[start:text.index("</script>", start)])


def test_simulated_page_carries_every_step_and_request(tmp_path):
    out_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "paceline.entrypoints.cli", "simulate", "--workload", "chat",
                           "--rate", "6", "--num-requests", "80", "--replicas", "2", "--num-kv-blocks", "64",
                           "--no-plots", "--output-dir", str(out_dir), "--html", "auto"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    data = page_data(out_dir / "report.html")
    run = json.loads((out_dir / "results.json").read_text())
    assert len(data["steps"]) == len(run["steps"])
    assert data["models"] == ["replica 0", "replica 1"]
    for name in data["models"]:
        mine = [s for s in data["steps"] if s["model"] == name]
        # the KV axis: used + free is the pool on every step, never above it
        assert mine and all(s["kv_used"] + s["kv_free"] == 64 for s in mine)
        assert max(s["running"] for s in mine) >= 1
    # every prompt token ran in some step (preempted and recomputed ones again), and each request's first token
    # is counted once in its replica's TTFT histogram
    prompt = sum(r["prompt_tokens"] for r in run["requests"] if r["error"] is None)
    assert sum(s["prefill"] for s in data["steps"]) >= prompt
    completed = run["summary"]["completed"]
    assert sum(sum(data["latency"][m]["ttft"]["counts"]) for m in data["models"]) == completed
    assert sum(s["preempted"] for s in data["steps"]) == run["simulation"]["num_preemptions"]
