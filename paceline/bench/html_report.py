"""A benchmark's or simulator's run as one self-contained HTML page, drawn by the live dashboard's own charts.

The page embeds static/charts.js (read from the installed package as a file, not imported: it is the same
script the server's /dashboard inlines), the run's step records and its latency histograms as JSON, and the
report's markdown table. It needs no server and no network: open it from disk or attach it to an issue.

Step records have the dashboard feed's shape (paceline.engine.step_log.STEP_FIELDS plus "model"). A benchmark
gets them from a paceline server's GET /dashboard/steps (its ring buffer: the last 8,192 steps, so a long run
shows its end); the simulator records them itself, one row per replica. A peer server that has no step log gets a
page with the latency histograms only."""
from __future__ import annotations

import html
import json
from bisect import bisect_right
from pathlib import Path

from paceline.bench.metrics import RequestRecord
from paceline.engine.step_log import STEP_FIELDS, TBT_EDGES, TTFT_EDGES

CHARTS_JS = Path(__file__).resolve().parents[1] / "entrypoints" / "static" / "charts.js"


def histogram(values: list[float], edges: tuple[float, ...]) -> dict:
    """The dashboard's histogram shape: counts per bucket, upper edges, the last bucket takes the rest."""
    counts = [0] * (len(edges) + 1)
    for v in values:
        counts[bisect_right(edges, v)] += 1
    return {"edges": list(edges), "counts": counts}


def latency_of(records: list[RequestRecord], model: str) -> dict:
    """The whole run's TTFT and TBT histograms from the client's own records (any server, peers included)."""
    ok = [r for r in records if r.ok]
    gaps = [b - a for r in ok for a, b in zip(r.token_times, r.token_times[1:])]
    return {"model": model, "window_s": None, "ttft": histogram([r.ttft for r in ok], TTFT_EDGES),
            "tbt": histogram(gaps, TBT_EDGES)}


def step_dict(model: str, seq: int, **fields: float) -> dict:
    """One step record in the feed's shape; fields a source does not know are 0."""
    return {"model": model, **{k: fields.get(k, 0) for k in STEP_FIELDS}, "seq": seq}


def server_steps(url: str, headers: dict | None = None) -> dict[str, dict] | None:
    """A paceline server's step log, per model: {"info", "num_steps", "steps"}; None from a server without one."""
    import httpx

    try:
        r = httpx.get(url.rstrip("/") + "/dashboard/steps", headers=headers, timeout=30.0)
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    return {m["model"]: m for m in r.json().get("models", [])}


def run_steps(before: dict[str, dict] | None, after: dict[str, dict] | None) -> tuple[list[dict], dict[str, dict]]:
    """The steps a run added (numbered after `before`'s count), and each model's info."""
    if not after:
        return [], {}
    steps = [s for name, m in after.items() for s in m["steps"]
             if s["seq"] > ((before or {}).get(name) or {}).get("num_steps", 0)]
    return steps, {name: m["info"] for name, m in after.items()}


def page(title: str, summary_md: str, steps: list[dict], latency: dict[str, dict],
         info: dict[str, dict] | None = None, note: str = "") -> str:
    """The HTML text. `latency` and `info` are keyed by the model names the steps carry."""
    models = sorted({s["model"] for s in steps} | set(latency))
    data = {"steps": steps, "latency": latency, "info": info or {}, "models": models}
    # "</" inside JSON would end the <script> element early; "<\/" is the same string to JSON.parse
    payload = json.dumps(data, separators=(",", ":")).replace("</", "<\\/")
    return _TEMPLATE.format(title=html.escape(title), summary=html.escape(summary_md), note=html.escape(note),
                            charts_js=CHARTS_JS.read_text(), data=payload)


def write(path: Path, *args, **kwargs) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page(*args, **kwargs))
    return path


_TEMPLATE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title>
<style>
  body {{ font: 13px/1.4 system-ui, sans-serif; margin: 0; color: #222; background: #f7f8fa; }}
  header {{ padding: 10px 16px; background: #fff; border-bottom: 1px solid #ddd; }}
  header h1 {{ font-size: 16px; margin: 0 0 4px; }}
  main {{ padding: 8px 16px 24px; }}
  pre.summary {{ background: #fff; border: 1px solid #ddd; border-radius: 6px; padding: 8px 12px; overflow-x: auto; }}
  section.model {{ background: #fff; border: 1px solid #ddd; border-radius: 6px; margin: 12px 0; padding: 8px 12px; }}
  section.model h2 {{ font-size: 14px; margin: 4px 0 8px; }}
  section.model h2 small {{ font-weight: normal; color: #666; margin-left: 8px; }}
  .grid {{ display: grid; grid-template-columns: repeat(auto-fill, minmax(420px, 1fr)); gap: 8px; }}
  canvas.chart {{ width: 100%; height: 210px; background: #fff; }}
  table.requests {{ display: none; }}
  .muted {{ color: #999; }}
</style>
</head>
<body>
<header><h1>{title}</h1><span id="steps-drawn">0 steps drawn</span> <span class="muted">{note}</span></header>
<main>
<pre class="summary">{summary}</pre>
<div id="models"></div>
</main>
<script>{charts_js}</script>
<script id="run-data" type="application/json">{data}</script>
<script>
  const run = JSON.parse(document.getElementById("run-data").textContent);
  const draw = () => {{
    const n = PacelineCharts.drawSteps(document.getElementById("models"), run.steps,
      {{ info: run.info, latency: run.latency, models: run.models }});
    document.getElementById("steps-drawn").textContent = n + " steps drawn";
    document.body.dataset.stepsDrawn = n;
  }};
  draw();
  window.addEventListener("resize", () => requestAnimationFrame(draw));
</script>
</body>
</html>
"""
