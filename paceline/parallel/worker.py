"""A worker process: builds its rank from the checkpoint, then executes what rank 0 sends until told to stop.

Workers never schedule and never sample. Under TP every rank runs every step's whole flat batch on its heads;
under PP a stage receives (message, hidden states) from the previous stage and passes its own on; the last stage
sends the rows that need logits back to rank 0.
"""
from __future__ import annotations

import sys
import time
import traceback

import torch

from paceline.engine.runner import ModelRunner
from paceline.model.loader import load_checkpoint
from paceline.parallel.comm import (FORWARD, STATS, STOP, SWAP, Groups, Timers, decode_forward, decode_swap,
                                    init_groups, isend, receive_broadcast, receive_message, recv, send_message, settle,
                                    wrap_row_parallel)
from paceline.parallel.rank import ParallelSpec, build_rank_model, stage_forward, stage_metadata


def worker_main(spec: ParallelSpec, rank: int, port: int, ready) -> None:
    """Entry point of a spawned worker. `ready` (a multiprocessing queue) gets (rank, None) once the rank is
    built, or (rank, error message): a checkpoint that fails to load is the driver's ValueError, not a hang."""
    try:
        torch.set_num_threads(spec.worker_threads())
        quantized = spec.quantization != "none"
        ckpt = load_checkpoint(spec.model, "float32" if quantized else spec.dtype)
        model, arch = build_rank_model(spec, rank, ckpt.arch, ckpt.weights)
        hidden_size = ckpt.arch.hidden_size
        del ckpt
        runner = ModelRunner(model, arch, spec.num_blocks, spec.block_size, spec.num_host_blocks,
                             device=spec.rank_device(rank), dtype=model.dtype, seed=spec.seed)
    except Exception as e:  # noqa: BLE001 - whatever it is, the driver reports it
        ready.put((rank, f"{type(e).__name__}: {e}"))
        return
    ready.put((rank, None))
    groups = init_groups(rank, spec.world_size, port, spec.rank_device(rank), spec.timeout_s)
    try:
        with torch.inference_mode():
            if spec.tensor_parallel_size > 1:
                tp_loop(runner, groups)
            else:
                pp_loop(runner, groups, hidden_size)
    except Exception:  # noqa: BLE001
        # the driver's next collective fails when this process's sockets close; say why here
        traceback.print_exc(file=sys.stderr)
        sys.exit(1)


def tp_loop(runner: ModelRunner, groups: Groups) -> None:
    timers = Timers()
    wrap_row_parallel(runner.model, groups, timers)
    while True:
        command, payload = receive_broadcast(groups)
        if command == STOP:
            return
        if command == SWAP:
            s = decode_swap(payload)
            runner.swap(s.blocks_to_swap_out, s.blocks_to_swap_in)
        elif command == FORWARD:
            f = decode_forward(payload)
            t0 = time.perf_counter()
            runner.forward_tokens(f.ids, f.positions, f.seqs, [])  # no rows: rank 0 computes the logits
            timers.forward_s += time.perf_counter() - t0
            timers.steps += 1
        elif command == STATS:
            isend(groups.cpu, timers.as_tensor(), 0)[0].wait()
            timers.reset()


def pp_loop(runner: ModelRunner, groups: Groups, hidden_size: int) -> None:
    rank, last = groups.rank, groups.rank == groups.size - 1
    timers = Timers()
    in_flight: list = []  # (isend handle, buffer): a buffer must live until it is sent
    while True:
        t0 = time.perf_counter()
        command, payload = receive_message(groups, rank - 1)
        timers.comm_s += time.perf_counter() - t0
        if not last:  # pass the command on first, so the next stage can get ready while this one computes
            in_flight += send_message(groups, rank + 1, command, payload)
        if command == STOP:
            settle(in_flight, wait=True)
            return
        if command == SWAP:
            s = decode_swap(payload)
            runner.swap(s.blocks_to_swap_out, s.blocks_to_swap_in)
        elif command == FORWARD:
            f = decode_forward(payload)
            hidden = torch.empty(len(f.ids), hidden_size, dtype=runner.model.dtype, device=runner.device)
            t0 = time.perf_counter()
            recv(groups.device, hidden, rank - 1)
            t1 = time.perf_counter()
            out = stage_forward(runner.model, runner.kv_cache, stage_metadata(runner, f), f, hidden, last)
            t2 = time.perf_counter()
            timers.comm_s += t1 - t0
            timers.forward_s += t2 - t1
            timers.steps += 1
            if not last:
                in_flight.append(isend(groups.device, out, rank + 1))
            elif f.rows:
                rows = out[torch.tensor(f.rows, device=out.device)].contiguous()
                in_flight.append(isend(groups.device, rows, 0))
            in_flight = settle(in_flight)
        elif command == STATS:
            isend(groups.cpu, timers.as_tensor(), 0)[0].wait()
            timers.reset()
