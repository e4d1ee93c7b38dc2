"""paceline at its defaults (this checkout): vs_vllm.py's probe (a) 32 streams and (d) a lone 1,500-token prompt
(`tput`), or (e) the stall probe (`stall`, pass --max-num-batched-tokens 64), with the server's step log printed.
Run it from two checkouts back to back to compare a change (benchmarks/summaries/vs_vllm.md):

    flock -x /tmp/paceline-cpu.lock sh -c 'cd OLD && python NEW/benchmarks/step_target_ab.py tput; cd NEW && python benchmarks/step_target_ab.py tput'
"""
import json
import tempfile
import sys
from pathlib import Path
sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks")
import httpx
import vs_vllm as V
from paceline.bench.peers import paceline_system
from paceline.bench.prompts import PromptSource, bundled_gguf, load_tokenizer

what = sys.argv[1]
extra = sys.argv[2:]  # extra serve flags
model = bundled_gguf()
prompts = V.Prompts(PromptSource(load_tokenizer(model)), 0)
sysm = V.this_checkout(paceline_system("sarathi", 0, model, 2, extra=extra))
i = sysm.argv.index("--scheduler")
del sysm.argv[i:i + 4]
print(" ".join(sysm.argv), flush=True)
srv, st = V.start(sysm, Path(tempfile.gettempdir()) / f"paceline-step-ab-{what}.log")

def steps_since(n0):
    return [s for s in httpx.get(srv.url + "/dashboard/steps").json()["models"][0]["steps"] if s["seq"] > n0]

def show(steps):
    print("keys", list(steps[0].keys()))
    for s in steps[:: max(1, len(steps)//50)]:
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in s.items() if k not in ("t",)})
    busy = sum(s["dur"] for s in steps)
    span = steps[-1]["t"] - steps[0]["t"] + steps[0]["dur"]  # "t": when a step was recorded, after it ran
    rows = [s["decode"] + s["prefill"] for s in steps]
    print(f"nsteps {len(steps)}; model time {busy:.2f} s of {span:.2f} s from the first step's start to the last's end "
          f"({100 * (1 - busy / span):.1f} % outside execute); rows per step mean {sum(rows) / len(rows):.1f}; "
          f"measured / predicted {sum(s['dur'] for s in steps if s['pred']) / max(1e-9, sum(s['pred'] for s in steps if s['pred'])):.2f}",
          flush=True)

try:
    ep = sysm.endpoint(srv.url)
    n0 = httpx.get(srv.url + "/dashboard/steps").json()["models"][0]["num_steps"]
    if what == "tput":
        r = V.probe_throughput(ep, prompts)
        print("throughput", json.dumps(r), flush=True)
        show(steps_since(n0))
        p = V.probe_prefill(ep, prompts, repeats=2)
        print("prefill", json.dumps(p))
    else:
        r = V.probe_stall(ep, prompts)
        print("stall", json.dumps(r), flush=True)
        st = steps_since(n0)
        show(st)
        top = sorted(st, key=lambda s: -s.get("duration", s.get("dur", 0)))[:8]
        print("longest steps:")
        for s in top:
            print(s)
finally:
    srv.stop()
