"""Draft-model proposer: a cheaper model that shares the target's tokenizer proposes greedily, inside the step.

Its paged KV cache has the target's block ids and block size, so the scheduler's block tables serve both models:
a slot the target holds a token's KV in holds the draft's KV of the same token. Each step, before the target runs:

1. one draft forward over the tokens of each request that drafts this step that the draft has no KV for yet (its
   known token; a fully accepted last proposal from the step before; all it generated while it did not speculate;
   its whole prompt the first time); the logits at its known token give its first proposal;
2. one more draft forward per further proposal, the batch of requests that still need one.

A step in which nobody drafts runs no draft forward at all: the draft catches up on a request, as one chunk, when it
next speculates. That keeps plain decoding (speculation switched off by load or low acceptance) at its own cost.

Proposals are the draft's argmax, a point mass, so the target's verification (model/spec_verify.py) keeps outputs
exactly the target's whatever the draft's quality. The scheduler puts DRAFT_SLOT placeholders where the proposals go
(it decides k); this fills them in place, so the scheduler's update sees the real tokens.
"""
from __future__ import annotations

import time

import torch

from paceline.core.outputs import ScheduledRequest, SchedulerOutput
from paceline.core.spec_adaptive import DRAFT_SLOT
from paceline.model.attention import SeqSlice


class Drafter:
    def __init__(self, runner) -> None:
        """runner: a ModelRunner of the draft model with the target's num_blocks and block_size (its KV cache)."""
        self.runner = runner
        self.valid: dict[str, int] = {}  # request id -> tokens at the front of its sequence the draft holds KV for

    @torch.inference_mode()
    def propose(self, out: SchedulerOutput) -> None:
        for rid in out.swapped_in_ids + out.preempted_ids:  # the draft's KV is neither swapped nor kept
            self.valid.pop(rid, None)
        if len(self.valid) > 4 * len(out.scheduled) + 64:  # finished requests; one that is not gone only re-syncs
            live = {s.request.request_id for s in out.scheduled}
            self.valid = {rid: n for rid, n in self.valid.items() if rid in live}
        ids: list[int] = []
        positions: list[int] = []
        seqs: list[SeqSlice] = []
        rows: list[int] = []
        drafting: list[ScheduledRequest] = []
        # the attention kernel wants multi-token slices before single tokens
        pending = []
        for s in out.scheduled:
            if not (s.spec_token_ids and s.spec_token_ids[0] == DRAFT_SLOT):
                continue
            rid, end = s.request.request_id, s.start + s.num_known_tokens
            begin = min(self.valid.get(rid, 0), s.start)
            pending.append((end - begin == 1, s, begin, end))
        for _, s, begin, end in sorted(pending, key=lambda p: p[0]):
            ids.extend(s.request.token_ids[begin:end])
            positions.extend(range(begin, end))
            seqs.append(SeqSlice(begin, end - begin, s.block_table))
            self.valid[s.request.request_id] = end
            rows.append(len(ids) - 1)
            drafting.append(s)
        if not ids:
            return
        logits = self.runner.forward_tokens(ids, positions, seqs, rows)
        tokens = logits.argmax(-1).tolist()
        for s, t in zip(drafting, tokens):
            s.spec_token_ids[0] = t
        # further proposals: one single-token forward per depth, over the requests that go that deep
        depth = 1
        while True:
            batch = [s for s in drafting if len(s.spec_token_ids) > depth]
            if not batch:
                break
            pos = [s.start + s.num_known_tokens + depth - 1 for s in batch]
            logits = self.runner.forward_tokens([s.spec_token_ids[depth - 1] for s in batch], pos,
                                                [SeqSlice(p, 1, s.block_table) for p, s in zip(pos, batch)],
                                                list(range(len(batch))))
            for s, t in zip(batch, logits.argmax(-1).tolist()):
                s.spec_token_ids[depth] = t
                self.valid[s.request.request_id] = s.start + s.num_known_tokens + depth
            depth += 1
        # KV the draft wrote for proposals the target rejects is past the request's known tokens: the next step's
        # min(valid, start) rewrites from where the target's KV ends

    def cost_ratio(self, target_runner, context: int = 256, repeats: int = 5) -> float:
        """One draft decode step's time over one target decode step's, measured on this machine: what the
        scheduler charges a draft step (as a fraction of a decode) when it weighs a proposal."""
        def decode_time(runner) -> float:
            n = min(context, runner.block_size * (runner.num_blocks - 1))
            table = list(range(-(-(n + 1) // runner.block_size)))
            runner.forward_tokens(list(range(1, n + 1)), list(range(n)), [SeqSlice(0, n, table)], [n - 1])
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                runner.forward_tokens([1], [n], [SeqSlice(n, 1, table)], [0])
                times.append(time.perf_counter() - t0)
            return sorted(times)[len(times) // 2]

        with torch.inference_mode():
            return decode_time(self.runner) / max(decode_time(target_runner), 1e-9)


def load_drafter(engine) -> Drafter:
    """Build the draft model of engine.speculative_config (its own checkpoint, else the target's; int4 when asked),
    give it a KV cache shaped like the target's blocks, attach it to the engine's runner, and tell the scheduler what
    a draft step costs."""
    from paceline.engine.runner import ModelRunner
    from paceline.model.llama import LlamaModel
    from paceline.model.loader import DTYPES, load_checkpoint

    spec, config = engine.speculative_config, engine.config
    quantization = spec.quantization or "none"
    dtype = "bfloat16" if quantization == "int4" else config.dtype
    ckpt = load_checkpoint(spec.model or config.model, "float32" if quantization != "none" else dtype)
    if ckpt.arch.vocab_size != engine.arch.vocab_size:
        raise ValueError(f"the draft model's vocabulary ({ckpt.arch.vocab_size}) differs from the target's "
                         f"({engine.arch.vocab_size}); a draft must share the tokenizer")
    model = LlamaModel.from_weights(ckpt.arch, ckpt.weights, device=engine.device, dtype=DTYPES[dtype],
                                    quantization=quantization, max_positions=engine.runner.model.max_positions)
    runner = ModelRunner(model, ckpt.arch, engine.num_blocks, engine.block_size, device=engine.device,
                         dtype=DTYPES[dtype])
    return attach_drafter(engine, runner)


def attach_drafter(engine, draft_runner, cost_ratio: float | None = None) -> Drafter:
    """Attach a draft ModelRunner (the target's num_blocks and block_size) to an engine. cost_ratio None: measured,
    which uses both KV caches' first blocks as scratch, so only before the engine's first request."""
    if draft_runner.num_blocks != engine.num_blocks or draft_runner.block_size != engine.block_size:
        raise ValueError("the draft's KV cache must have the target's blocks (it shares the block tables)")
    if cost_ratio is None and engine.scheduler.num_steps:
        raise ValueError("measuring the draft's cost would overwrite cached KV: give cost_ratio on a live engine")
    drafter = Drafter(draft_runner)
    engine.runner.drafter = drafter
    engine.scheduler.speculator.draft_cost = drafter.cost_ratio(engine.runner) if cost_ratio is None else cost_ratio
    return drafter
