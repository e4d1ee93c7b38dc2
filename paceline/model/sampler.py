"""Batched sampling with per-request parameters.

Order of processing for each row (as vLLM does): min_tokens masking of EOS/stop ids, repetition penalty
(over prompt + output tokens), frequency and presence penalties (over output tokens), then greedy argmax, or
temperature -> top-k -> top-p -> min-p -> draw.

Draws invert the row's cumulative distribution: with u ~ U[0, 1), the first token whose cumulative probability
exceeds u times the row's total is a sample from p (a zero-probability token is never chosen). One uniform a row:
the exponential race this replaced (argmax(p / q), q ~ Exp(1) per vocabulary entry) drew 49,152 variates a row,
32 of a 32-row sampled step's 67 ms on 2 cores (2026-11-25; docs/performance.md). Rows with only a temperature
draw in one C++ pass (fused_kernel.sample_rows), the others through torch's softmax, cumsum and search. A seeded
request's u for output position i comes from a generator seeded with hash(seed, i), so the token depends only on
(logits, params, seed, i): not on what else is in the batch, and not on whether the request was preempted and
recomputed. Unseeded requests share one engine-wide generator.

Logprobs are the model's raw log-softmax (before penalties, temperature and filtering), which is what vLLM
returns by default.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from paceline.core.outputs import TokenLogprobs
from paceline.model import fused_kernel
from paceline.sampling import SamplingParams

_NEG_INF = float("-inf")
_ARGMAX: list = []  # the C++ argmax (fused_kernel.py) or None, found once per process
_SAMPLE: list = []  # the C++ draw (fused_kernel.py) or None, found once per process


def _temperature_only(p: SamplingParams) -> bool:
    return p.top_k <= 0 and p.top_p >= 1.0 and p.min_p <= 0


def _sample_op(logits: torch.Tensor):
    """The fused draw (fused_kernel.sample_rows) for float32 CPU logits, or None (torch's ops draw)."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.dim() != 2 or logits.shape[1] % 8 \
            or logits.stride(1) != 1:
        return None
    if not _SAMPLE:
        ops = fused_kernel.load()
        _SAMPLE.append(ops.sample_rows if ops is not None else None)
    return _SAMPLE[0]


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax(logits, -1), by the fused op for float32 CPU rows (torch's took ~0.65 ms over 32 x 49152
    logits, most of the sampler's time in a 32-decode step; the op's result is the same index)."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.dim() != 2 or logits.shape[1] == 0 \
            or logits.stride(1) != 1:
        return logits.argmax(dim=-1)
    if not _ARGMAX:  # looked up on the first CPU call only: a CUDA server never builds the CPU op for this
        ops = fused_kernel.load()
        _ARGMAX.append(ops.argmax_rows if ops is not None else None)
    return logits.argmax(dim=-1) if _ARGMAX[0] is None else _ARGMAX[0](logits)


@dataclass
class SampleRow:
    """What the sampler needs of one request at this step."""
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_id: int | None = None


def seeded_generator(seed: int, position: int, device: torch.device | str = "cpu") -> torch.Generator:
    # a fixed 64-bit mix (not Python's salted hash) so the stream is the same in every process
    x = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & ((1 << 64) - 1)
    x ^= x >> 31
    x = (x * 0xD6E8FEB86659FD93) & ((1 << 63) - 1)
    return torch.Generator(device=device).manual_seed(x)


class Sampler:
    def __init__(self, seed: int = 0, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        # grammar matcher of each constrained request, keyed by its StructuredOutputs (dropped with the request)
        self._grammars: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __call__(self, logits: torch.Tensor, rows: list[SampleRow]) -> tuple[list[int], list[TokenLogprobs | None]]:
        """logits [N, vocab] float32, one row per request -> sampled token ids, and logprobs where asked."""
        if logits.shape[0] != len(rows):
            raise ValueError(f"got {logits.shape[0]} logit rows for {len(rows)} requests")
        raw = logits
        sps = [r.params for r in rows]
        fast = all(sp.greedy and _no_penalties(sp) and _no_min_tokens_mask(r) and not sp.logit_bias
                   and sp.structured is None for sp, r in zip(sps, rows))
        if fast:
            tokens = greedy_tokens(raw)
        else:
            logits = self._apply_penalties(_apply_logit_bias(logits.clone(), rows), rows)
            constrained = [i for i, sp in enumerate(sps) if sp.structured is not None]
            watch = self._apply_grammar(logits, rows, constrained) if constrained else []
            tokens = self._choose(logits, rows)
            for i, state, first, left in watch:
                if not state.keeps_budget(int(tokens[i]), left):  # it would leave too little room to finish
                    plan = state.fresh_plan()  # the shortest way, as a forced close takes (first may be a longer one's)
                    tokens[i] = plan[0] if plan else first
                    rows[i].params.structured.cut_by_budget = True
        token_list = tokens.tolist()
        return token_list, self._logprobs(raw, tokens, rows)

    def _apply_grammar(self, logits: torch.Tensor, rows: list[SampleRow], constrained: list[int]) -> list:
        """Structured outputs: -inf every token the request's grammar does not allow next (one parallel mask fill
        for the batch). Matchers are kept per StructuredOutputs object and fed the output tokens lazily. Returns the
        rows near the end of their budget whose sampled token must be checked (GrammarState.keeps_budget)."""
        from paceline.model.structured import GrammarState, fill_masks

        states = []
        for i in constrained:
            so = rows[i].params.structured
            if so.compiled is None:
                raise ValueError("structured outputs need a compiled grammar (GrammarCompiler.compile)")
            state = self._grammars.get(so) or GrammarState(so.compiled)
            state = state.advance(rows[i].output_token_ids)
            self._grammars[so] = state
            states.append(state)
        banned = fill_masks(states, logits.shape[1])
        watch = []
        for j, (i, state) in enumerate(zip(constrained, states)):
            r = rows[i]
            if r.params.max_tokens is None:
                continue
            # near the end of max_tokens: force the grammar's shortest way to finish (see structured.py)
            left = r.params.max_tokens - len(r.output_token_ids)
            plan = state.closing_plan(left)
            first = (plan[0] if plan else r.eos_token_id) if plan is not None else None
            if first is None or banned[j, first]:
                continue
            if state.must_close(plan, left):
                banned[j] = True
                banned[j, first] = False
                r.params.structured.cut_by_budget = True
            else:
                watch.append((i, state, first, left))  # the model's pick is checked once sampled
        banned = banned.to(logits.device)
        whole = len(constrained) == logits.shape[0]  # every row constrained: mask in place, no gather/scatter
        sub = logits if whole else logits[constrained]
        sub.masked_fill_(banned, _NEG_INF)
        # nothing allowed (the grammar is done but min_tokens bans EOS): let EOS through rather than draw garbage
        dead = (sub.amax(dim=-1) == _NEG_INF).nonzero().flatten().tolist()
        for j in dead:
            eos = rows[constrained[j]].eos_token_id
            if eos is not None:
                sub[j, eos] = 0.0
        if not whole:
            logits[constrained] = sub
        return watch

    def _apply_penalties(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        n, vocab = logits.shape
        for i, r in enumerate(rows):
            if not _no_min_tokens_mask(r):
                banned = list(r.params.stop_token_ids) + ([r.eos_token_id] if r.eos_token_id is not None else [])
                logits[i, [t for t in banned if 0 <= t < vocab]] = _NEG_INF
        need = [i for i, r in enumerate(rows) if not _no_penalties(r.params)]
        if not need:
            return logits
        dev = logits.device
        sub = logits[need]
        rep = torch.tensor([rows[i].params.repetition_penalty for i in need], device=dev)[:, None]
        freq = torch.tensor([rows[i].params.frequency_penalty for i in need], device=dev)[:, None]
        pres = torch.tensor([rows[i].params.presence_penalty for i in need], device=dev)[:, None]
        counts = torch.zeros(len(need), vocab, device=dev)
        seen = torch.zeros(len(need), vocab, dtype=torch.bool, device=dev)
        for j, i in enumerate(need):
            out = torch.tensor(rows[i].output_token_ids, dtype=torch.long, device=dev)
            counts[j].scatter_add_(0, out, torch.ones_like(out, dtype=counts.dtype))
            seen[j, torch.tensor(rows[i].prompt_token_ids, dtype=torch.long, device=dev)] = True
        seen |= counts > 0
        # repetition: shrink the logit of any seen token towards "less likely" whatever its sign
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
        sub = sub - freq * counts - pres * (counts > 0).to(sub.dtype)
        logits[need] = sub
        return logits

    def _choose(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        rand = [i for i, r in enumerate(rows) if not r.params.greedy]
        if not rand:
            return greedy_tokens(logits)
        dev = logits.device
        u = torch.empty(len(rand), device=dev)
        unseeded = [j for j, i in enumerate(rand) if rows[i].params.seed is None]
        if unseeded:
            u[unseeded] = torch.rand(len(unseeded), device=dev, generator=self.generator)
        for j, i in enumerate(rand):
            r = rows[i]
            if r.params.seed is not None:
                u[j] = torch.rand(1, device=dev, generator=seeded_generator(r.params.seed, len(r.output_token_ids), dev))
        plain = [j for j, i in enumerate(rand) if _temperature_only(rows[i].params)]
        op = _sample_op(logits)
        if op is not None and len(plain) == len(rows):  # every row a plain draw (the common case): no copies
            inv_temp = torch.tensor([1.0 / r.params.temperature for r in rows], dtype=torch.float32)
            drawn = op(logits, inv_temp, u)
            return drawn if bool((drawn >= 0).all()) else torch.where(drawn >= 0, drawn, greedy_tokens(logits))
        tokens = greedy_tokens(logits)
        if op is not None and plain:  # a request's rows take the same path at every step: its params decide
            picked = [rand[j] for j in plain]
            inv_temp = torch.tensor([1.0 / rows[i].params.temperature for i in picked], dtype=torch.float32)
            drawn = op(logits[picked], inv_temp, u[plain].contiguous())
            tokens[picked] = torch.where(drawn >= 0, drawn, tokens[picked])
            drop = set(plain)
            keep = [j for j in range(len(rand)) if j not in drop]
            rand, u = [rand[j] for j in keep], u[keep]
            if not rand:
                return tokens
        x = logits[rand]
        temp = torch.tensor([rows[i].params.temperature for i in rand], device=dev)[:, None]
        x = x / temp
        top_k = [rows[i].params.top_k for i in rand]
        top_p = [rows[i].params.top_p for i in rand]
        if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
            x = _top_k_top_p(x, top_k, top_p)
        probs = torch.softmax(x, dim=-1)
        min_p = [rows[i].params.min_p for i in rand]
        if any(m > 0 for m in min_p):
            mp = torch.tensor(min_p, device=dev)[:, None]
            probs = probs.masked_fill(probs < mp * probs.max(dim=-1, keepdim=True).values, 0.0)
        cdf = probs.cumsum(dim=-1)
        total = cdf[:, -1:]
        drawn = torch.searchsorted(cdf, u[:, None] * total, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)
        # a row with no finite positive mass (NaN logits) keeps its argmax rather than an arbitrary index
        ok = torch.isfinite(total.squeeze(1)) & (total.squeeze(1) > 0)
        tokens[rand] = torch.where(ok, drawn, tokens[rand])
        return tokens

    def _logprobs(self, raw: torch.Tensor, tokens: torch.Tensor, rows: list[SampleRow]) -> list[TokenLogprobs | None]:
        want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        result: list[TokenLogprobs | None] = [None] * len(rows)
        if not want:
            return result
        lp = torch.log_softmax(raw[want], dim=-1)
        chosen = lp.gather(1, tokens[want][:, None]).squeeze(1).tolist()
        kmax = max(rows[i].params.logprobs for i in want)
        top_v, top_i = lp.topk(kmax, dim=-1) if kmax else (lp[:, :0], lp[:, :0].long())
        top_v, top_i = top_v.tolist(), top_i.tolist()
        for j, i in enumerate(want):
            k = rows[i].params.logprobs
            result[i] = TokenLogprobs(logprob=chosen[j], top=list(zip(top_i[j][:k], top_v[j][:k])))
        return result


def token_logprobs(logits: torch.Tensor, token_ids: list[int], k: int) -> list[TokenLogprobs]:
    """Raw log-softmax of each row: the given token's logprob and rank, and the top k (prompt logprobs)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(token_ids, dtype=torch.long, device=lp.device)[:, None]
    chosen = lp.gather(1, ids)
    ranks = ((lp > chosen).sum(dim=-1) + 1).tolist()
    top_v, top_i = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    top_v, top_i = top_v.tolist(), top_i.tolist()
    return [TokenLogprobs(logprob=c, top=list(zip(ti, tv)), rank=rk)
            for c, ti, tv, rk in zip(chosen.squeeze(1).tolist(), top_i, top_v, ranks)]


def _apply_logit_bias(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """OpenAI's logit_bias: added to the logits before anything else (so -100 all but bans a token)."""
    vocab = logits.shape[1]
    for i, r in enumerate(rows):
        bias = r.params.logit_bias
        if bias:
            ids = [t for t in bias if t < vocab]  # the server checks ids against the vocabulary; here, stay in range
            logits[i, ids] += torch.tensor([bias[t] for t in ids], dtype=logits.dtype, device=logits.device)
    return logits


def _no_penalties(sp: SamplingParams) -> bool:
    return sp.repetition_penalty == 1.0 and sp.presence_penalty == 0.0 and sp.frequency_penalty == 0.0


def _no_min_tokens_mask(r: SampleRow) -> bool:
    return len(r.output_token_ids) >= r.params.min_tokens


def _top_k_top_p(x: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Keep each row's top_k highest and the smallest set whose probability reaches top_p; -inf the rest."""
    vocab = x.shape[1]
    dev = x.device
    sorted_x, idx = x.sort(dim=-1, descending=True)
    k = torch.tensor([kk if kk > 0 else vocab for kk in top_k], device=dev)[:, None]
    drop = torch.arange(vocab, device=dev)[None, :] >= k
    sorted_x = sorted_x.masked_fill(drop, _NEG_INF)
    p = torch.tensor(top_p, device=dev)[:, None]
    cum = torch.softmax(sorted_x, dim=-1).cumsum(dim=-1)
    # drop a token when the tokens before it already reach top_p; the first token always stays
    drop = (cum - torch.softmax(sorted_x, dim=-1)) >= p
    sorted_x = sorted_x.masked_fill(drop, _NEG_INF)
    return torch.full_like(x, _NEG_INF).scatter(1, idx, sorted_x)
