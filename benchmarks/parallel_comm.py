"""Per-step communication cost of TP=2 and PP=2 on this host, measured within one process tree.

    PYTHONPATH=. flock -x /tmp/paceline-cpu.lock python benchmarks/parallel_comm.py --pairs 30

Two ranks (spawned processes, gloo on the loopback, 1 thread each) hold their shard of the bundled model (float32)
and run the same two steps over and over: a 64-token prefill chunk of a prompt with 192 tokens before it, and a
decode step of 8 sequences at ~200 tokens of context. Each step runs twice in turn:

- `real`: as the parallel runners do it. TP: rank 0 broadcasts the step, then every layer's two all-reduces.
  PP (one step in flight, as under the Engine): stage 0, the step and the hidden states to stage 1, stage 1, the
  logits rows back, rank 0's logits.
- `no-op`: the same compute with the communication taken out. TP: the all-reduces return their input and nothing
  is broadcast (the numbers drift from the real model's; the cost of a matmul does not depend on them). PP: stage 1
  reads a tensor of the hidden states' shape that is already there, rank 0 one of the rows' shape; the stages still
  take turns (a barrier outside the timed parts), so that each computes alone on the host, as in `real`.

So the difference between the two, pair by pair, is what communication adds to a step. Both ranks stamp every
collective with time.perf_counter (CLOCK_MONOTONIC on Linux, one clock for every process on the host), which splits
it further: for an all-reduce, from the later rank's arrival to the first rank's exit is the transfer itself, and the
earlier rank's lead is time spent waiting for the slower shard (rank 0 holds 6 of the 9 query heads); for PP, from
stage 0's send to stage 1 holding the hidden states, and from stage 1's send to rank 0 holding the rows.

Only ratios and differences within this run mean anything (the host is shared and drifts); the benchmark reports
how much CPU other processes took meanwhile.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from paceline.bench import host_cpu
from paceline.model.attention import SeqSlice

BLOCK_SIZE = 16
NUM_BLOCKS = 160
CONTEXT = 256  # tokens per sequence laid down before timing
SEQS = 8


def _steps(vocab: int) -> tuple[dict, list[list[int]], list[list[int]]]:
    """The two timed steps by name, each (ids, positions, seqs, rows); every sequence's tokens and block table
    (sequence s owns blocks s*16 .. s*16+15)."""
    table = [[s * (CONTEXT // BLOCK_SIZE) + b for b in range(CONTEXT // BLOCK_SIZE)] for s in range(SEQS)]
    ids = [[(97 * s + 31 * j) % (vocab - 300) + 200 for j in range(CONTEXT)] for s in range(SEQS)]
    prefill = (ids[0][192:256], list(range(192, 256)), [SeqSlice(192, 64, table[0])], [63])
    decode = ([ids[s][200] for s in range(SEQS)], [200] * SEQS, [SeqSlice(200, 1, table[s]) for s in range(SEQS)],
              list(range(SEQS)))
    return {"prefill chunk (64 tokens)": prefill, "decode (8 sequences)": decode}, ids, table


class Stamped:
    """A row-parallel linear whose all-reduce can be switched off; stamps (entry, exit) of each one it runs."""

    def __init__(self, linear, group, stamps: list):
        self.linear, self.group, self.stamps, self.on = linear, group, stamps, True

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        if self.on:
            t0 = time.perf_counter()
            self.group.allreduce([y]).wait()
            self.stamps.append((t0, time.perf_counter()))
        return y


def _rank_main(rank: int, layout: str, port: int, pairs: int, results) -> None:
    from paceline.engine.runner import ModelRunner
    from paceline.model.loader import load_checkpoint
    from paceline.parallel.comm import (FORWARD, broadcast_message, decode_forward, encode_forward, Forward,
                                        init_groups, isend, receive_broadcast, recv)
    from paceline.parallel.rank import ParallelSpec, build_rank_model, stage_forward, stage_metadata

    torch.set_num_threads(1)
    ckpt = load_checkpoint(None, "float32")
    spec = ParallelSpec(None, "float32", tensor_parallel_size=2 if layout == "tp" else 1,
                        pipeline_parallel_size=2 if layout == "pp" else 1, num_blocks=NUM_BLOCKS,
                        block_size=BLOCK_SIZE, threads_per_rank=1)
    model, arch = build_rank_model(spec, rank, ckpt.arch, ckpt.weights)
    hidden_size, vocab = ckpt.arch.hidden_size, ckpt.arch.vocab_size
    del ckpt
    runner = ModelRunner(model, arch, NUM_BLOCKS, BLOCK_SIZE, device=torch.device("cpu"), dtype=torch.float32)
    groups = init_groups(rank, 2, port, torch.device("cpu"), 600.0)
    steps, ids, table = _steps(vocab)
    stamps: list = []  # this step's collectives: (entry, exit)
    record: dict = {name: {"real": [], "no-op": []} for name in steps}

    if layout == "tp":
        linears = []
        for layer in model.layers:
            layer.o, layer.down = Stamped(layer.o, groups.cpu, stamps), Stamped(layer.down, groups.cpu, stamps)
            linears += [layer.o, layer.down]

        def run(step, real: bool) -> dict:
            s_ids, positions, seqs, rows = step
            for lin in linears:
                lin.on = real
            stamps.clear()
            t0 = time.perf_counter()
            if real:  # as TensorParallelRunner: rank 0 sends the flat batch, rank 1 decodes it
                if rank == 0:
                    broadcast_message(groups, FORWARD, encode_forward(Forward(s_ids, positions, seqs, rows)))
                else:
                    f = decode_forward(receive_broadcast(groups)[1])
                    s_ids, positions, seqs = f.ids, f.positions, f.seqs
                stamps.append((t0, time.perf_counter()))
            runner.forward_tokens(s_ids, positions, seqs, rows if rank == 0 else [])
            return {"step": time.perf_counter() - t0, "stamps": list(stamps)}

        # lay down every sequence's KV (the real model's, all-reduces on), untimed
        for s in range(SEQS):
            runner.forward_tokens(ids[s], list(range(CONTEXT)), [SeqSlice(0, CONTEXT, table[s])], [])
    else:
        first = rank == 0

        def stage(step, hidden):
            s_ids, positions, seqs, rows = step
            f = Forward(s_ids, positions, seqs, rows)
            with torch.inference_mode():
                return stage_forward(model, runner.kv_cache, stage_metadata(runner, f), f, hidden, last=not first)

        def run(step, real: bool) -> dict:
            s_ids, positions, seqs, rows = step
            out: dict = {}
            if real:
                groups.cpu.barrier().wait()
                t0 = time.perf_counter()
                if first:
                    hidden = stage(step, None)
                    t1 = time.perf_counter()
                    payload = torch.tensor(encode_forward(Forward(s_ids, positions, seqs, rows)), dtype=torch.int64)
                    pending = [isend(groups.cpu, torch.tensor([FORWARD, len(payload)]), 1),
                               isend(groups.cpu, payload, 1), isend(groups.cpu, hidden, 1)]
                    got = recv(groups.cpu, torch.empty(len(rows), hidden_size), 1)
                    t2 = time.perf_counter()
                    with torch.inference_mode():
                        model.compute_logits(got)
                    t3 = time.perf_counter()
                    for h, _ in pending:
                        h.wait()
                    out = {"step": t3 - t0, "stage0": t1 - t0, "sent_hidden": t1, "got_rows": t2, "logits": t3 - t2}
                else:
                    header = recv(groups.cpu, torch.empty(2, dtype=torch.int64), 0)
                    f = decode_forward(recv(groups.cpu, torch.empty(int(header[1]), dtype=torch.int64), 0).tolist())
                    hidden = recv(groups.cpu, torch.empty(len(f.ids), hidden_size), 0)
                    t1 = time.perf_counter()
                    last = stage((f.ids, f.positions, f.seqs, f.rows), hidden)
                    t2 = time.perf_counter()
                    isend(groups.cpu, last[torch.tensor(f.rows)].contiguous(), 0)[0].wait()
                    out = {"got_hidden": t1, "stage1": t2 - t1, "sent_rows": t2}
            else:  # the same compute, stage by stage, each alone on the host; the barriers are not timed
                groups.cpu.barrier().wait()
                if first:
                    t0 = time.perf_counter()
                    stage(step, None)
                    out["stage0"] = time.perf_counter() - t0
                groups.cpu.barrier().wait()
                if not first:
                    t0 = time.perf_counter()
                    stage(step, torch.zeros(len(s_ids), hidden_size))
                    out["stage1"] = time.perf_counter() - t0
                groups.cpu.barrier().wait()
                if first:
                    t0 = time.perf_counter()
                    with torch.inference_mode():
                        model.compute_logits(torch.zeros(len(rows), hidden_size))
                    out["logits"] = time.perf_counter() - t0
            return out

        for s in range(SEQS):  # lay down the KV of every sequence, untimed
            full = (ids[s], list(range(CONTEXT)), [SeqSlice(0, CONTEXT, table[s])], [CONTEXT - 1])
            run(full, True)

    for name, step in steps.items():
        for _ in range(2):  # warm-up
            run(step, True)
            run(step, False)
        for i in range(pairs):
            for real in ((True, False) if i % 2 == 0 else (False, True)):  # alternate which goes first
                if layout == "tp":
                    groups.cpu.barrier().wait()  # both start together; not timed
                record[name]["real" if real else "no-op"].append(run(step, real))
    results.put((rank, record))


def _median_ms(xs) -> float:
    return round(1e3 * statistics.median(xs), 3)


def summarise_tp(r0: dict, r1: dict) -> dict:
    out = {}
    for name in r0:
        real0, real1, noop0 = r0[name]["real"], r1[name]["real"], r0[name]["no-op"]
        noop1 = r1[name]["no-op"]
        transfer, wait0, wait1, per_call = [], [], [], []
        for a, b in zip(real0, real1):
            t = w0 = w1 = 0.0
            for (e0, x0), (e1, x1) in zip(a["stamps"], b["stamps"]):
                t += max(0.0, min(x0, x1) - max(e0, e1))
                per_call.append(max(0.0, min(x0, x1) - max(e0, e1)))
                w0 += max(0.0, e1 - e0)
                w1 += max(0.0, e0 - e1)
            transfer.append(t), wait0.append(w0), wait1.append(w1)
        diffs = [a["step"] - b["step"] for a, b in zip(real0, noop0)]
        real_ms = _median_ms(a["step"] for a in real0)
        out[name] = {
            "pairs": len(diffs), "collectives_per_step": len(real0[0]["stamps"]),
            "rank0_step_ms": {"real": real_ms, "no-op": _median_ms(a["step"] for a in noop0)},
            "rank1_step_ms": {"real": _median_ms(a["step"] for a in real1), "no-op": _median_ms(a["step"] for a in noop1)},
            "real minus no-op, rank 0, ms (median of pairs)": _median_ms(diffs),
            "... min-max over pairs": [round(1e3 * min(diffs), 3), round(1e3 * max(diffs), 3)],
            "share of the real step": round(statistics.median(diffs) / statistics.median(a["step"] for a in real0), 4),
            "transfer ms per step (later arrival to first exit, summed)": _median_ms(transfer),
            "transfer us per collective (median)": round(1e6 * statistics.median(per_call), 1),
            "rank 0 waiting for rank 1, ms per step": _median_ms(wait0),
            "rank 1 waiting for rank 0, ms per step": _median_ms(wait1)}
    return out


def summarise_pp(r0: dict, r1: dict) -> dict:
    out = {}
    for name in r0:
        real0, real1, noop0, noop1 = r0[name]["real"], r1[name]["real"], r0[name]["no-op"], r1[name]["no-op"]
        hidden = [b["got_hidden"] - a["sent_hidden"] for a, b in zip(real0, real1)]
        rows = [a["got_rows"] - b["sent_rows"] for a, b in zip(real0, real1)]
        noop = [a["stage0"] + b["stage1"] + a["logits"] for a, b in zip(noop0, noop1)]
        diffs = [a["step"] - n for a, n in zip(real0, noop)]
        out[name] = {
            "pairs": len(diffs),
            "real step ms (rank 0, stage 0 to logits)": _median_ms(a["step"] for a in real0),
            "no-op step ms (stage 0 + stage 1 + logits)": _median_ms(noop),
            "compute ms, real: stage 0 / stage 1 / logits": [_median_ms(a["stage0"] for a in real0),
                                                             _median_ms(b["stage1"] for b in real1),
                                                             _median_ms(a["logits"] for a in real0)],
            "compute ms, no-op: stage 0 / stage 1 / logits": [_median_ms(a["stage0"] for a in noop0),
                                                              _median_ms(b["stage1"] for b in noop1),
                                                              _median_ms(a["logits"] for a in noop0)],
            "real minus no-op, ms (median of pairs)": _median_ms(diffs),
            "... min-max over pairs": [round(1e3 * min(diffs), 3), round(1e3 * max(diffs), 3)],
            "share of the real step": round(statistics.median(diffs) / statistics.median(a["step"] for a in real0), 4),
            "stage 0 sends to stage 1 holds the step and hidden states, ms": _median_ms(hidden),
            "stage 1 sends to rank 0 holds the rows, ms": _median_ms(rows),
            "both hand-offs, ms per step": _median_ms(h + r for h, r in zip(hidden, rows))}
    return out


def measure(layout: str, pairs: int) -> dict:
    from paceline.parallel.comm import free_port

    ctx = torch.multiprocessing.get_context("spawn")
    results, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, layout, port, pairs, results)) for r in (0, 1)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=900) for _ in procs)
    for p in procs:
        p.join()
    return (summarise_tp if layout == "tp" else summarise_pp)(got[0], got[1])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=30, help="real / no-op pairs per step kind")
    p.add_argument("--layouts", default="tp,pp")
    args = p.parse_args(argv)
    before = host_cpu.snapshot()
    out: dict = {"started_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "pairs": args.pairs}
    for layout in args.layouts.split(","):
        out[{"tp": "TP=2", "pp": "PP=2"}[layout]] = measure(layout, args.pairs)
        print(json.dumps(out, indent=1), file=sys.stderr, flush=True)
    used = host_cpu.between(before, host_cpu.snapshot())  # the ranks count as ours once joined
    out["wall_s"] = round(used.wall_s, 1)
    out["other_processes_share_of_the_cores"] = round(used.other_cores / (os.cpu_count() or 1), 4)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
