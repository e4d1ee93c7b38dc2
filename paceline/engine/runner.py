"""ModelRunner: SchedulerOutput -> tensors -> model -> sampled tokens. It runs exactly what it is told."""
from __future__ import annotations

import bisect
import contextlib
import mmap
import os
import time
from typing import Generator

import torch

from paceline.core.outputs import ScheduledRequest, SchedulerOutput, StepResult
from paceline.engine.heap import keep_freed_memory
from paceline.engine.prefault import populate_in_background
from paceline.model.arch import ModelArch
from paceline.model.attention import GatherWorkspace, SeqSlice, build_metadata
from paceline.model.llama import LlamaModel, drain
from paceline.model.loader import piece_tick
from paceline.model.sampler import Sampler, token_logprobs
from paceline.model.spec_verify import accept_prefix, verify_rows


# A step runs its last layer past the K/V for only the rows that feed logits (LlamaModel.forward_layers' keep) when
# those are at most half of it and it leaves out KEEP_FROM_ROWS rows or more. In one process, alternating
# (2026-11-25 14:22 UTC, int4, AMX CPU): a 1,500-token prompt 395.4 -> 383.8 ms, a 512-token one 166.5 -> 161.9,
# but a 128-prompt-token + 32-decode step 72.3 -> 73.0: there the kept rows' second metadata and the last layer
# run from Python cost what 127 rows' last layer saves. PACELINE_KEEP_ROWS=0 switches it off (A/B runs).
KEEP_FROM_ROWS = 256


class ModelRunner:
    def __init__(self, model: LlamaModel, arch: ModelArch, num_blocks: int, block_size: int, num_host_blocks: int = 0,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks} and {block_size}")
        self.model, self.arch = model, arch
        self.num_blocks, self.block_size = num_blocks, block_size
        self.device, self.dtype = torch.device(device), dtype
        if self.device.type == "cpu":  # a step's activations stay in the heap between steps (engine/heap.py)
            keep_freed_memory()
        if self.device.type == "cuda":
            # torch picks cuDNN's SDPA for bfloat16, which plans per new shape, and a decode's context grows every
            # step: a bf16 decode step of SmolLM2-135M's shapes at batch 1 took 61.5 ms on an H200 with it, 15.6 ms
            # without (benchmarks/summaries/cuda.md)
            torch.backends.cuda.enable_cudnn_sdp(False)
        shape = (arch.num_layers, 2, num_blocks, block_size, arch.num_kv_heads, arch.head_dim)
        # The caches must start as zeros: masked slots of a gathered block are multiplied by 0 in attention, and
        # uninitialised NaN bits would survive that. A large CPU cache is its own anonymous mapping: the kernel's
        # zero pages, committed on first touch, so it is zeros without faulting in every page at startup
        # (torch.zeros took 4.5 s for 3 GiB here). torch.empty is not enough: in a long-lived process (a test
        # run, a server that unloads one model and loads another) it has returned memory the allocator already
        # held, dirty. Smaller caches are zeroed.
        def nbytes(shape: tuple) -> int:
            return torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()

        def lazy(shape: tuple) -> bool:
            return self.device.type == "cpu" and nbytes(shape) > 64 * 2**20

        def alloc(shape: tuple, **kw) -> torch.Tensor:
            if lazy(shape):  # the tensor keeps the mapping alive; it is unmapped when the tensor is freed
                return torch.frombuffer(mmap.mmap(-1, nbytes(shape)), dtype=dtype).view(shape)
            return torch.zeros(shape, dtype=dtype, **kw)

        self.kv_cache = alloc(shape, device=self.device)
        piece_tick()  # in a load on demand, a point where the other models may step (loader.piece_breaks)
        # a lazy pool is made resident now, off the start-up path: memory is what was configured from the first
        # seconds rather than a growth over hours of traffic, and no step pays a first write's page faults
        self.prefault = populate_in_background(self.kv_cache) if lazy(shape) else None
        piece_tick()  # starting the prefault thread took 1-6 ms in /tmp timings (2026-11-29)
        host_shape = (arch.num_layers, 2, num_host_blocks, block_size, arch.num_kv_heads, arch.head_dim)
        pin = self.device.type == "cuda"
        self.host_cache = alloc(host_shape, pin_memory=pin) if num_host_blocks else None
        self.sampler = Sampler(seed, self.device)
        self.workspace = GatherWorkspace(block_size * arch.num_kv_heads * arch.head_dim, dtype, self.device)
        self.drafter = None  # speculative method draft_model: fills the step's proposals (engine/spec_draft.py)

    @staticmethod
    def bytes_per_block(arch: ModelArch, block_size: int, dtype: torch.dtype) -> int:
        """Memory one KV block takes across all layers (K and V)."""
        elem = torch.empty((), dtype=dtype).element_size()
        return arch.num_layers * 2 * block_size * arch.num_kv_heads * arch.head_dim * elem

    def swap(self, blocks_to_swap_out: list[tuple[int, int]], blocks_to_swap_in: list[tuple[int, int]]) -> None:
        """Copy device blocks to host blocks, then host blocks to device blocks."""
        if (blocks_to_swap_out or blocks_to_swap_in) and self.host_cache is None:
            raise ValueError("swap requested but the runner has no host blocks (num_host_blocks=0)")
        if blocks_to_swap_out:
            dev = torch.tensor([d for d, _ in blocks_to_swap_out], device=self.device)
            host = torch.tensor([h for _, h in blocks_to_swap_out])
            self.host_cache.index_copy_(2, host, self.kv_cache.index_select(2, dev).to("cpu"))
        if blocks_to_swap_in:
            host = torch.tensor([h for h, _ in blocks_to_swap_in])
            dev = torch.tensor([d for _, d in blocks_to_swap_in], device=self.device)
            self.kv_cache.index_copy_(2, dev, self.host_cache.index_select(2, host).to(self.device, non_blocking=True))

    def execute(self, out: SchedulerOutput) -> StepResult:
        with self._whole():
            return drain(self.execute_iter(out))

    @contextlib.contextmanager
    def _whole(self):
        """Steps run inside are never suspended (execute, forward_tokens): the model may run all its layers in one
        call (LlamaModel.forward_layers' span); a step driven through execute_iter alone yields after every layer."""
        before, self._layer_span = getattr(self, "_layer_span", 1), None
        try:
            yield
        finally:
            self._layer_span = before

    @torch.inference_mode()  # generator-aware: on while the step runs, off while it is suspended
    def execute_iter(self, out: SchedulerOutput) -> Generator[None, None, StepResult]:
        """execute, suspended between two layers of the model (a bare `yield`): the loop of several models
        (engine/multi.py) runs another model's step there. The result's duration counts this step's own work
        only, not the time it spent suspended (the step-time refit and the scale learn from it)."""
        t0 = time.perf_counter()
        paused = 0.0
        steps = self._execute_layers(out)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                result = done.value
                break
            suspended = time.perf_counter()
            yield
            paused += time.perf_counter() - suspended
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        result.duration = time.perf_counter() - t0 - paused
        return result

    def _execute_layers(self, out: SchedulerOutput) -> Generator[None, None, StepResult]:
        self.swap(out.blocks_to_swap_out, out.blocks_to_swap_in)
        result = StepResult()
        if out.scheduled:
            # multi-token chunks first, then single tokens (the layout attention expects), those by context length
            # so that attention's decode groups (runs of similar lengths) pad little
            order = sorted(out.scheduled, key=lambda s: (s.num_tokens == 1, s.start if s.num_tokens == 1 else 0))
            if self.drafter is not None:
                self.drafter.propose(out)
            logits, sampled = yield from self._forward(order, result)
            # a NaN or inf row (a broken weight, an overflow) would sample garbage silently: fail the step instead,
            # and the engine finds the row's request (engine/faults.py); one sum per row is cheap next to sampling
            if not bool(torch.isfinite(logits.sum(dim=-1)).all()):
                raise ValueError(f"the model produced non-finite logits (NaN or inf) for {_non_finite(logits, sampled)}")
            rows = [row for s in sampled for row in verify_rows(s)]  # one, or k + 1 for k proposals
            tokens, logprobs = self.sampler(logits, rows)
            i = 0
            for s in sampled:
                rid, k = s.request.request_id, len(s.spec_token_ids)
                if k:  # speculative decoding: keep the proposals the target agrees with, then its own next token
                    result.verified_token_ids[rid] = accept_prefix(s.spec_token_ids, tokens[i:i + k + 1])
                else:
                    result.token_ids[rid] = tokens[i]
                    if logprobs[i] is not None:
                        result.logprobs[rid] = logprobs[i]
                i += k + 1
        return result

    def _forward(self, order: list[ScheduledRequest],
                 result: StepResult) -> Generator[None, None, tuple[torch.Tensor, list[ScheduledRequest]]]:
        """Run the model over the flat batch; logits [N, vocab] for the requests that need a sample. Prompt
        logprobs, for requests that asked, go into `result`."""
        ids: list[int] = []
        positions: list[int] = []
        last_rows: list[int] = []
        sampled: list[ScheduledRequest] = []
        prompt_rows: list[tuple[ScheduledRequest, int, int]] = []  # (request, flat row of s.start, positions)
        for s in order:
            end = s.start + s.num_known_tokens
            if s.num_known_tokens < 1 or end > s.request.num_tokens:
                raise ValueError(f"request {s.request.request_id}: cannot run tokens {s.start}..{end} "
                                 f"of {s.request.num_tokens}")
            if s.request.sampling_params.prompt_logprobs is not None:
                # positions whose next token is a prompt token (the last prompt position's is the first output)
                n = min(end, s.request.num_prompt_tokens - 1) - s.start
                if n > 0:
                    prompt_rows.append((s, len(ids), n))
            ids.extend(s.request.token_ids[s.start:end])
            ids.extend(s.spec_token_ids)  # proposals run as further query tokens of the same request
            positions.extend(range(s.start, s.start + s.num_tokens))
            if s.needs_sample:
                # every proposal's position is sampled too: position i predicts the token after proposal i - 1
                last_rows.extend(range(len(ids) - 1 - len(s.spec_token_ids), len(ids)))
                sampled.append(s)
        seqs = [SeqSlice(s.start, s.num_tokens, s.block_table) for s in order]
        if not prompt_rows:
            return (yield from self._forward_tokens(ids, positions, seqs, last_rows)), sampled
        # only requests that ask pay: their prompt rows join the sampled ones, in flat order (disjoint from them)
        rows = sorted(last_rows + [first + j for _, first, n in prompt_rows for j in range(n)])
        at = {row: i for i, row in enumerate(rows)}
        logits = yield from self._forward_tokens(ids, positions, seqs, rows)
        for s, first, n in prompt_rows:
            r = s.request
            targets = r.token_ids[s.start + 1:s.start + 1 + n]
            result.prompt_logprobs[r.request_id] = (s.start, token_logprobs(
                logits[at[first]:at[first] + n], targets, r.sampling_params.prompt_logprobs))
        return logits[[at[row] for row in last_rows]], sampled

    def _forward_tokens(self, ids: list[int], positions: list[int], seqs: list[SeqSlice],
                        rows: list[int]) -> Generator[None, None, torch.Tensor]:
        if type(self).forward_tokens is not ModelRunner.forward_tokens:
            # a subclass that wraps forward_tokens (the tensor-parallel rank 0 sends the batch to its workers first)
            # runs it whole: its step is never suspended
            return self.forward_tokens(ids, positions, seqs, rows)
        return (yield from self.forward_tokens_iter(ids, positions, seqs, rows))

    def _check_positions(self, positions: list[int]) -> None:
        if positions and max(positions) >= self.model.max_positions:
            raise ValueError(f"position {max(positions)} exceeds the model's {self.model.max_positions} positions")

    def forward_tokens(self, ids: list[int], positions: list[int], seqs: list[SeqSlice], rows: list[int]) -> torch.Tensor:
        """Lowest level: one forward over a flat batch laid out as `seqs`; float32 logits of the flat `rows`."""
        with torch.inference_mode(), self._whole():
            return drain(self.forward_tokens_iter(ids, positions, seqs, rows))

    def forward_tokens_iter(self, ids: list[int], positions: list[int], seqs: list[SeqSlice],
                            rows: list[int]) -> Generator[None, None, torch.Tensor]:
        """forward_tokens, suspended between two layers (LlamaModel.forward_layers); the caller holds
        inference mode on while it runs."""
        self._check_positions(positions)
        meta = build_metadata(seqs, self.block_size, self.device, self.workspace)
        input_ids = torch.tensor(ids, dtype=torch.long).to(self.device, non_blocking=True)
        pos = torch.tensor(positions, dtype=torch.long).to(self.device, non_blocking=True)
        hidden = yield from self.model.forward_layers(input_ids, pos, meta, self.kv_cache,
                                                      getattr(self, "_layer_span", 1),
                                                      self.keep_rows(seqs, rows, len(ids)))
        if not rows:
            return hidden.new_empty(0, self.arch.vocab_size, dtype=torch.float32)
        sel = hidden if len(rows) == hidden.shape[0] else hidden[torch.tensor(rows, device=self.device)]
        return self.model.compute_logits(sel)

    def keep_rows(self, seqs: list[SeqSlice], rows: list[int], num_rows: int) -> tuple | None:
        """forward_layers' keep for a step of `num_rows` rows laid out as `seqs`: the flat `rows` that feed logits,
        each as a one-token slice at its position in its sequence (no metadata where there are none); None where
        the step runs every row throughout."""
        if (2 * len(rows) > num_rows or num_rows - len(rows) < KEEP_FROM_ROWS
                or os.environ.get("PACELINE_KEEP_ROWS", "1") == "0"):
            return None
        if not rows:  # a prompt chunk that samples nothing: the last layer writes its K/V and stops there
            return torch.empty(0, dtype=torch.long, device=self.device), None
        firsts = []  # each slice's first flat row
        row = 0
        for s in seqs:
            firsts.append(row)
            row += s.num_tokens
        kept = []
        for r in rows:
            i = bisect.bisect_right(firsts, r) - 1
            kept.append(SeqSlice(seqs[i].start + r - firsts[i], 1, seqs[i].block_table))
        return (torch.tensor(rows, dtype=torch.long).to(self.device, non_blocking=True),
                build_metadata(kept, self.block_size, self.device))

    # --- conveniences for tests and benchmarks: one request alone, blocks 0.. in order -------------------------
    def prefill_logits(self, token_ids: list[int], chunk: int | None = None, first_block: int = 0) -> torch.Tensor:
        """Prefill one request in chunks of `chunk` tokens (whole when None); logits [len, vocab] of every position."""
        n = len(token_ids)
        table = self._table(n, first_block)
        chunk = chunk or n
        out = []
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            out.append(self.forward_tokens(token_ids[start:end], list(range(start, end)),
                                           [SeqSlice(start, end - start, table)], list(range(end - start))))
        return torch.cat(out)

    @torch.inference_mode()
    def generate_greedy(self, prompt: list[int], max_new_tokens: int, first_block: int = 0) -> tuple[list[int], list[torch.Tensor]]:
        """Greedy-decode one request alone: prefill, then one token per step. Returns tokens and each step's logits."""
        table = self._table(len(prompt) + max_new_tokens, first_block)
        n = len(prompt)
        logits = self.forward_tokens(prompt, list(range(n)), [SeqSlice(0, n, table)], [n - 1])[0]
        tokens, all_logits = [], []
        for _ in range(max_new_tokens):
            all_logits.append(logits)
            tok = int(logits.argmax())
            tokens.append(tok)
            if len(tokens) == max_new_tokens:
                break
            pos = n + len(tokens) - 1
            logits = self.forward_tokens([tok], [pos], [SeqSlice(pos, 1, table)], [0])[0]
        return tokens, all_logits

    def _table(self, num_tokens: int, first_block: int) -> list[int]:
        need = (num_tokens + self.block_size - 1) // self.block_size
        if first_block + need > self.num_blocks:
            raise ValueError(f"{num_tokens} tokens need {need} blocks from block {first_block}; "
                             f"the cache has {self.num_blocks}")
        return list(range(first_block, first_block + need))


def _non_finite(logits: torch.Tensor, sampled: list[ScheduledRequest]) -> str:
    """The requests whose logit rows hold a NaN or inf, named in the step's error: a step whose only requests are two
    such rows then fails with a message that neither of them repeats alone, which engine/faults.py reads as two
    faulty requests rather than a broken engine (it would otherwise fail every request in flight)."""
    bad = (~torch.isfinite(logits).all(dim=-1)).tolist()
    names, row = [], 0
    for s in sampled:
        rows = len(s.spec_token_ids) + 1
        if any(bad[row:row + rows]):
            names.append(s.request.request_id)
        row += rows
    return "request " + ", ".join(names) if len(names) == 1 else "requests " + ", ".join(names)


def step_threads() -> int:
    """The OpenMP threads a step of this thread runs on (multi.py's lanes set their own)."""
    return torch.get_num_threads()


def set_step_threads(threads: int) -> None:
    """Steps run on this thread use `threads` OpenMP threads from now on (paceline's kernels and oneDNN read the
    calling thread's count; MKL's and torch's default for new threads follow too)."""
    torch.set_num_threads(threads)
