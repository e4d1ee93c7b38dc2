"""The driver side: runners with ModelRunner's interface (execute(SchedulerOutput) -> StepResult) whose model is
spread over worker processes. The driver process is rank 0: it holds a shard like every worker, sends each step's
flat batch before running its own part, and samples, with ModelRunner's own sampler, from the logits it ends up with.

Engine wiring (config fields, flags) is listed in docs/scaling.md; `build_runner` is the one call it needs.
"""
from __future__ import annotations

import atexit
import contextlib
import queue
import time
from dataclasses import dataclass

import torch

from paceline.core.outputs import ScheduledRequest, SchedulerOutput, StepResult
from paceline.engine.runner import ModelRunner
from paceline.model.arch import ModelArch
from paceline.model.llama import LlamaModel
from paceline.model.loader import DTYPES
from paceline.model.sampler import SampleRow
from paceline.parallel.comm import (FORWARD, STATS, STOP, SWAP, Forward, Groups, Swap, Timers, broadcast_message,
                                    encode_forward, encode_swap, free_port, init_groups, isend, recv, send_message,
                                    settle, wrap_row_parallel)
from paceline.parallel.rank import ParallelSpec, build_rank_model, stage_forward, stage_metadata, validate
from paceline.parallel.shard import pp_stages, tp_shards

STARTUP_TIMEOUT_S = 300.0


class _Workers:
    """Spawned worker processes and the process group they share with this one (rank 0)."""

    def __init__(self, spec: ParallelSpec):
        from paceline.parallel.worker import worker_main

        self.spec = spec
        ctx = torch.multiprocessing.get_context("spawn")
        self.port = free_port()
        self.ready = ctx.Queue()
        # daemonic: they die with the driver even if close() is never called
        self.procs = [ctx.Process(target=worker_main, args=(spec, r, self.port, self.ready), daemon=True,
                                  name=f"paceline-rank{r}") for r in range(1, spec.world_size)]
        for p in self.procs:
            p.start()
        self.groups: Groups | None = None

    def wait_ready(self) -> Groups:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        pending = set(range(1, self.spec.world_size))
        while pending:
            try:
                rank, error = self.ready.get(timeout=0.5)
            except queue.Empty:
                dead = [p.name for p in self.procs if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    self.kill()
                    why = f"{', '.join(dead)} exited" if dead else f"not ready after {STARTUP_TIMEOUT_S:.0f} s"
                    raise RuntimeError(f"parallel workers failed to start: {why}") from None
                continue
            if error is not None:
                self.kill()
                raise ValueError(f"rank {rank} could not build its part of the model: {error}")
            pending.discard(rank)
        self.groups = init_groups(0, self.spec.world_size, self.port, self.spec.rank_device(0), self.spec.timeout_s)
        return self.groups

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(5)

    def join(self) -> None:
        for p in self.procs:
            p.join(30)
        self.kill()  # any that did not stop in time
        self.groups = None  # dropping the backends closes their sockets


def _flat_batch(order: list[ScheduledRequest], block_offset: int = 0) -> tuple[Forward, list[ScheduledRequest]]:
    """ModelRunner._forward's flat batch; `block_offset` shifts every block table (a pipeline slot's own blocks)."""
    from paceline.model.attention import SeqSlice

    ids: list[int] = []
    positions: list[int] = []
    rows: list[int] = []
    sampled: list[ScheduledRequest] = []
    seqs = []
    for s in order:
        end = s.start + s.num_tokens
        if s.num_tokens < 1 or end > s.request.num_tokens:
            raise ValueError(f"request {s.request.request_id}: cannot run tokens {s.start}..{end} "
                             f"of {s.request.num_tokens}")
        ids.extend(s.request.token_ids[s.start:end])
        positions.extend(range(s.start, end))
        seqs.append(SeqSlice(s.start, s.num_tokens, [b + block_offset for b in s.block_table]))
        if s.needs_sample:
            rows.append(len(ids) - 1)
            sampled.append(s)
    return Forward(ids, positions, seqs, rows), sampled


def _execution_order(out: SchedulerOutput) -> list[ScheduledRequest]:
    # as ModelRunner.execute: multi-token chunks first, then single tokens by context length
    return sorted(out.scheduled, key=lambda s: (s.num_tokens == 1, s.start if s.num_tokens == 1 else 0))


class _ParallelRunner(ModelRunner):
    """What both layouts share: worker lifecycle, stats, the position check before anything is sent."""

    def __init__(self, spec: ParallelSpec, arch: ModelArch, weights: dict[str, torch.Tensor]):
        validate(spec, arch)  # a bad split is a ValueError before any process starts
        self.spec, self.full_arch = spec, arch
        self.workers = _Workers(spec)
        try:
            model, rank_arch = build_rank_model(spec, 0, arch, weights)
            super().__init__(model, rank_arch, spec.num_blocks, spec.block_size, spec.num_host_blocks,
                             device=spec.rank_device(0), dtype=model.dtype, seed=spec.seed)
            self.groups = self.workers.wait_ready()
        except BaseException:
            self.workers.kill()
            raise
        self.timers = Timers()
        self.closed = False
        atexit.register(self.close)

    def swap(self, blocks_to_swap_out: list[tuple[int, int]], blocks_to_swap_in: list[tuple[int, int]]) -> None:
        if (blocks_to_swap_out or blocks_to_swap_in) and self.host_cache is None:
            raise ValueError("swap requested but the runner has no host blocks (num_host_blocks=0)")
        if blocks_to_swap_out or blocks_to_swap_in:  # the workers swap their shards of the same blocks
            self._send(SWAP, encode_swap(Swap(blocks_to_swap_out, blocks_to_swap_in)))
        super().swap(blocks_to_swap_out, blocks_to_swap_in)

    def _send(self, command: int, payload: list[int]) -> None:
        raise NotImplementedError

    def collect_stats(self) -> list[Timers]:
        """Every rank's timers since the last call (rank 0 first), then reset."""
        self._send(STATS, [])
        out = [Timers(self.timers.forward_s, self.timers.comm_s, self.timers.steps)]
        for r in range(1, self.spec.world_size):
            out.append(Timers.from_tensor(recv(self.groups.cpu, torch.empty(3, dtype=torch.float64), r)))
        self.timers.reset()
        return out

    def close(self) -> None:
        """Stop the workers and leave the process group; the runner is unusable afterwards."""
        if self.closed:
            return
        self.closed = True
        atexit.unregister(self.close)
        with contextlib.suppress(Exception):  # a worker already gone: join() kills the rest
            self._send(STOP, [])
        self.workers.join()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class TensorParallelRunner(_ParallelRunner):
    """Every rank runs every step on its heads and MLP columns; rank 0's logits come after the last all-reduce,
    so they are the whole model's. The KV cache of each rank holds only its KV heads."""

    def __init__(self, spec: ParallelSpec, arch: ModelArch, weights: dict[str, torch.Tensor]):
        super().__init__(spec, arch, weights)
        wrap_row_parallel(self.model, self.groups, self.timers)

    def _send(self, command: int, payload: list[int]) -> None:
        broadcast_message(self.groups, command, payload)

    def forward_tokens(self, ids, positions, seqs, rows) -> torch.Tensor:
        self._check_positions(positions)
        t0 = time.perf_counter()
        self._send(FORWARD, encode_forward(Forward(ids, positions, seqs, rows)))
        t1 = time.perf_counter()
        logits = super().forward_tokens(ids, positions, seqs, rows)
        self.timers.comm_s += t1 - t0
        self.timers.forward_s += time.perf_counter() - t1
        self.timers.steps += 1
        return logits


@dataclass
class InFlight:
    """A step stage 0 has run and sent on; the last stage's rows come back to `collect`."""
    sampled: list[ScheduledRequest]
    num_rows: int
    started: float


class PipelineParallelRunner(_ParallelRunner):
    """Rank 0 is the first stage (and embeds, computes logits, samples); the others take layer ranges in order.

    execute() runs one step through every stage and waits for it, so at PP=2 each stage idles while the other
    works. submit()/collect() keep several steps in flight, which needs a caller that schedules the next step
    before the last one's tokens are known: one scheduler per slot, each with its own blocks, as vLLM's virtual
    engines (engine/pipelined.py, the serving engine under PP; pipeline.run_pipelined, token ids only)."""

    def __init__(self, spec: ParallelSpec, arch: ModelArch, weights: dict[str, torch.Tensor]):
        super().__init__(spec, arch, weights)
        self.last_rank = spec.world_size - 1
        self.in_flight_sends: list = []

    def _send(self, command: int, payload: list[int]) -> None:
        self.in_flight_sends += send_message(self.groups, 1, command, payload)
        self.in_flight_sends = settle(self.in_flight_sends)

    def _run_first_stage(self, f: Forward) -> None:
        self._check_positions(f.positions)
        t0 = time.perf_counter()
        with torch.inference_mode():
            hidden = stage_forward(self.model, self.kv_cache, stage_metadata(self, f), f, None, last=False)
        self.timers.forward_s += time.perf_counter() - t0
        self.timers.steps += 1
        self._send(FORWARD, encode_forward(f))
        self.in_flight_sends.append(isend(self.groups.device, hidden, 1))

    def _receive_logits(self, num_rows: int) -> torch.Tensor:
        if not num_rows:
            return torch.empty(0, self.arch.vocab_size, dtype=torch.float32, device=self.device)
        rows = torch.empty(num_rows, self.full_arch.hidden_size, dtype=self.model.dtype, device=self.device)
        t0 = time.perf_counter()
        recv(self.groups.device, rows, self.last_rank)
        t1 = time.perf_counter()
        with torch.inference_mode():
            logits = self.model.compute_logits(rows)
        self.timers.comm_s += t1 - t0
        self.timers.forward_s += time.perf_counter() - t1
        return logits

    def forward_tokens(self, ids, positions, seqs, rows) -> torch.Tensor:
        self._run_first_stage(Forward(ids, positions, seqs, rows))
        return self._receive_logits(len(rows))

    # --- several steps in flight --------------------------------------------------------------------------------
    def submit(self, out: SchedulerOutput, block_offset: int = 0) -> InFlight:
        """Swap, then run stage 0 of the step and pass it on; returns at once after that."""
        started = time.perf_counter()
        self.swap([(d + block_offset, h) for d, h in out.blocks_to_swap_out],
                  [(h, d + block_offset) for h, d in out.blocks_to_swap_in])
        if not out.scheduled:
            return InFlight([], 0, started)
        f, sampled = _flat_batch(_execution_order(out), block_offset)
        self._run_first_stage(f)
        return InFlight(sampled, len(f.rows), started)

    @torch.inference_mode()
    def collect(self, step: InFlight) -> StepResult:
        """Wait for the step's last stage, then sample as ModelRunner.execute does."""
        result = StepResult()
        if step.sampled or step.num_rows:
            logits = self._receive_logits(step.num_rows)
            t0 = time.perf_counter()
            rows = [SampleRow(s.request.sampling_params, s.request.prompt_token_ids, s.request.output_token_ids,
                              s.request.eos_token_id) for s in step.sampled]
            tokens, logprobs = self.sampler(logits, rows)
            for s, tok, lp in zip(step.sampled, tokens, logprobs):
                result.token_ids[s.request.request_id] = tok
                if lp is not None:
                    result.logprobs[s.request.request_id] = lp
            self.timers.forward_s += time.perf_counter() - t0
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        result.duration = time.perf_counter() - step.started
        return result

    def close(self) -> None:
        if not self.closed:
            with contextlib.suppress(Exception):  # a dead worker: close() still stops the rest
                settle(self.in_flight_sends, wait=True)
            self.in_flight_sends = []
        super().close()


def parallel_bytes_per_block(arch: ModelArch, block_size: int, dtype: torch.dtype, tensor_parallel_size: int = 1,
                             pipeline_parallel_size: int = 1) -> int:
    """KV bytes one block takes on the rank that holds the most of it: with kv_cache_memory_gb read as per rank
    (as vLLM reads its memory settings), num_blocks = kv_cache_memory_gb / this."""
    elem = torch.empty((), dtype=dtype).element_size()
    kv_heads = max(s.kv_heads[1] for s in tp_shards(arch, tensor_parallel_size))
    layers = max(c for _, c in pp_stages(arch, pipeline_parallel_size))
    return layers * 2 * block_size * kv_heads * arch.head_dim * elem


def build_runner(arch: ModelArch, weights: dict[str, torch.Tensor], *, model: str | None, dtype: str = "float32",
                 quantization: str = "none", device: torch.device | str = "cpu", num_blocks: int, block_size: int,
                 num_host_blocks: int = 0, seed: int = 0, tensor_parallel_size: int = 1,
                 pipeline_parallel_size: int = 1, threads_per_rank: int | None = None) -> ModelRunner:
    """The runner an Engine should use: a plain ModelRunner at 1 x 1, else a parallel one. `weights` build rank 0's
    part (and the plain model); `model` is what each worker passes to load_checkpoint. On CPU every rank, this
    process included, runs threads_per_rank threads (default: the host's cores shared evenly)."""
    device = torch.device(device)
    if tensor_parallel_size == 1 and pipeline_parallel_size == 1:
        lm = LlamaModel.from_weights(arch, weights, device=device, dtype=DTYPES[dtype], quantization=quantization)
        return ModelRunner(lm, arch, num_blocks, block_size, num_host_blocks=num_host_blocks, device=device,
                           dtype=DTYPES[dtype], seed=seed)
    spec = ParallelSpec(model, dtype, quantization, device.type, tensor_parallel_size, pipeline_parallel_size,
                        num_blocks, block_size, num_host_blocks, seed, threads_per_rank)
    if device.type == "cpu":
        # rank 0 is a rank like the others: N ranks on one host share its cores, so this thread count changes
        torch.set_num_threads(spec.worker_threads())
    cls = TensorParallelRunner if tensor_parallel_size > 1 else PipelineParallelRunner
    return cls(spec, arch, weights)
