"""Capacities of a finished compare run re-judged over every probe each system ran (`capacity_from_probes`, what
compare.py reports since the fifth session), from its results.json; runs made before that reported each SLO's
own search only.

    .venv/bin/python benchmarks/rescore.py benchmarks/results/chat-5
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from paceline.bench.capacity import capacity_from_probes
from paceline.bench.compare import capacity_table


def rescore(results: dict) -> list[dict]:
    probes: dict[str, dict[float, dict]] = {}
    for r in results["runs"]:
        if r.get("probe") and not r.get("skipped"):
            probes.setdefault(r["system"], {})[round(r["rate"], 6)] = r["summary"]
    out = []
    for c in results["capacities"]:
        if c.get("capacity") is None:  # skipped
            out.append(c)
            continue
        final = capacity_from_probes(probes.get(c["system"], {}), c["tbt_slo_s"], slo_name=c["slo"])
        out.append({**c, "capacity": final.capacity, "searched_capacity": c.get("searched_capacity", c["capacity"]),
                    "lower_bound": final.is_lower_bound,
                    "verdicts": [dataclasses.asdict(v) for v in final.verdicts]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", help="a compare.py output directory (holds results.json)")
    args = ap.parse_args()
    results = json.loads((Path(args.run_dir) / "results.json").read_text())
    print(capacity_table(rescore(results)))


if __name__ == "__main__":
    main()
