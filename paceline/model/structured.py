"""Structured outputs: JSON schema, JSON object, regex, choice and grammar constraints as token masks (llguidance).

llguidance was picked over xgrammar by benchmarks/grammar_libraries.py (mask cost per token at batch 32 on this
CPU, compile time, and no triton/tvm dependency); outlines-core builds a full index per schema up front.

    compiler = GrammarCompiler(tokenizer)           # once per model: the vocabulary as llguidance sees it
    so.compiled = compiler.compile(so)              # per request: ValueError for a bad schema/regex/grammar
    state = GrammarState(so.compiled)               # per request, in the sampler
    state.advance(output_token_ids)                 # feed what was sampled since last time
    banned = fill_masks([state, ...], vocab_size)   # bool [rows, vocab], True where the grammar bans the token

A matcher's state is a function of the request's output tokens only, so a preempted request (recompute or swap)
keeps it, and one that is lost is rebuilt by replaying the output (GrammarState.advance does that when needed).

Closing before the budget runs out: at temperature 1 a small model can write one string or number until max_tokens
(measured: 10 of 200 schema requests at max_tokens 256 on the bundled model), which leaves invalid JSON. So once a
request's tokens left come within CLOSE_SLACK of the shortest way the grammar can finish from where it is
(`closing_bytes`: greedy, one byte at a time, closers first), the sampler forces that way, token by token, and the
request ends with EOS and finish_reason "length" (the model did not choose to stop). Within CLOSE_WINDOW of that
point, a token the model samples is kept only if the way to finish after it still fits (`keeps_budget`): opening
an optional property or a new array item can lengthen the way by ~10 tokens at once. Requests that finish on their
own far from max_tokens never pay for the search.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import llguidance as llg
import llguidance.torch as llt
import numpy as np
import torch

from paceline.sampling import StructuredOutputs

log = logging.getLogger("paceline.structured")

# compact, fixed separators: with flexible whitespace a small model at temperature 1 can emit spaces until
# max_tokens and never close the object
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHE_SIZE = 256  # compiled grammars kept, by constraint
CLOSE_SLACK = 2  # force the closing path when tokens left <= its length + EOS + this (retokenizing may differ)
CLOSE_WINDOW = 16  # search for the closing path (and check sampled tokens) when this near to having to force it
CLOSE_MAX_BYTES = 512  # a closing path longer than this is not searched for (the request may end cut, as before)
# bytes tried in this order when closing: end a string, an object, an array; short values; then anything
_CLOSE_ORDER = (b'"}]0,:1tnf' + bytes(range(0x61, 0x7B)) + bytes(range(0x41, 0x5B)) + bytes(range(0x20, 0x7F))
                + bytes(range(0x80, 0x100)))


@dataclass(frozen=True)
class CompiledGrammar:
    tokenizer: Any  # llg.LLTokenizer
    grammar: str  # llguidance's serialized grammar
    byte_tokens: tuple[int, ...] = ()  # single-byte tokens in _CLOSE_ORDER (what closing_bytes tries)
    initial_close: int = 0  # tokens of the closing path from the start: the shortest output, about


class GrammarCompiler:
    def __init__(self, tokenizer: Any, vocab_size: int | None = None) -> None:
        vocab = vocab_size or tokenizer.vocab_size
        # special tokens stay out of every mask (llguidance reads them from tokenizer.json); EOS ends a match
        try:
            self.lltokenizer = llg.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab,
                                               eos_token=tokenizer.eos_token_id)
        except Exception as e:  # a tokenizer llguidance cannot read: structured outputs are refused, not crashed
            raise ValueError(f"structured outputs are not available for this model's tokenizer: {e}") from None
        self._cache: OrderedDict[tuple, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        single: dict[int, int] = {}
        for t in range(vocab):
            b = self.lltokenizer.decode_bytes([t])
            if len(b) == 1 and not self.lltokenizer.is_special_token(t):
                single.setdefault(b[0], t)
        self.byte_tokens = tuple(dict.fromkeys(single[b] for b in _CLOSE_ORDER if b in single))

    def compile(self, so: StructuredOutputs) -> CompiledGrammar:
        """The constraint as a checked llguidance grammar, cached by what it says; ValueError when it is invalid."""
        with self._lock:
            hit = self._cache.get(so.key)
            if hit is not None:
                self._cache.move_to_end(so.key)
                return hit
        grammar = _grammar_text(so)
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, self.lltokenizer)
        if is_error:
            raise ValueError(f"invalid {_kind(so)}: {messages[0] if messages else 'rejected by the grammar compiler'}")
        compiled = CompiledGrammar(self.lltokenizer, grammar, self.byte_tokens)
        plan = closing_tokens(llg.LLMatcher(self.lltokenizer, grammar), compiled)
        compiled = CompiledGrammar(self.lltokenizer, grammar, self.byte_tokens,
                                   len(plan) if plan is not None else CLOSE_MAX_BYTES)
        with self._lock:
            self._cache[so.key] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled


def _kind(so: StructuredOutputs) -> str:
    return ("json schema" if so.json is not None else "json object" if so.json_object else
            "regex" if so.regex is not None else "choice" if so.choice is not None else "grammar")


def _grammar_text(so: StructuredOutputs) -> str:
    try:
        if so.json is not None:
            schema = json.loads(so.json)
            if so.strict:
                schema = _closed_objects(schema)
            return llg.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        if so.json_object:
            return llg.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if so.regex is not None:
            return llg.LLMatcher.grammar_from_regex(so.regex)
        if so.choice is not None:
            return llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in so.choice))
        text = so.grammar or ""
        # GBNF (llama.cpp's, what vLLM's xgrammar backend takes) is converted; anything else is read as Lark
        return llg.grammar_from("gbnf" if "::=" in text else "lark", text)
    except (ValueError, TypeError, RecursionError) as e:
        raise ValueError(f"invalid {_kind(so)}: {e}") from None


def _closed_objects(schema: Any) -> Any:
    """OpenAI's strict mode: an object schema that does not say otherwise allows no extra properties."""
    if isinstance(schema, list):
        return [_closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed_objects(v) for k, v in schema.items()}
    if out.get("type") == "object" or "properties" in out:
        out.setdefault("additionalProperties", False)
    return out


@dataclass
class GrammarState:
    """One request's matcher and the output tokens it has consumed."""
    compiled: CompiledGrammar
    consumed: list[int] = field(default_factory=list)
    matcher: Any = None
    last_close: int = 0  # length of the closing path when last searched
    # the last closing path found, reused while it still finishes the output: a search costs ~1 ms (hundreds of
    # matcher probes), a check one call, and most tokens (string contents, digits) leave the way to finish unchanged
    plan: list[int] | None = None
    walk: bytes | None = None  # closing_bytes from the state after consumed[:walk_at]
    walk_at: int = 0

    def __post_init__(self) -> None:
        self.matcher = llg.LLMatcher(self.compiled.tokenizer, self.compiled.grammar)

    def advance(self, output_token_ids: list[int]) -> "GrammarState":
        """Consume the tokens sampled since last time; a state that has not seen a prefix of them is replaced by
        a fresh one that replays them all (the request was rebuilt elsewhere, or its state object is shared)."""
        n = len(self.consumed)
        if output_token_ids[:n] != self.consumed:
            fresh = GrammarState(self.compiled)
            return fresh.advance(output_token_ids)
        new = output_token_ids[n:]
        if new:
            self.matcher.consume_tokens(new)
            self.consumed.extend(new)
        return self

    @property
    def failed(self) -> bool:
        return self.matcher.is_error()

    def closing_plan(self, tokens_left: int) -> list[int] | None:
        """A way to finish the output from here, when `tokens_left` is within reach of needing one; None further
        away (not searched) or when no short way was found. The last path found is returned while it still
        finishes; it may be longer than the shortest, so where it would force the close a fresh search decides."""
        if self.failed or tokens_left > max(self.compiled.initial_close, self.last_close) + 1 + CLOSE_SLACK + CLOSE_WINDOW:
            return None
        if self.plan is not None and _still_closes(self.matcher, self.plan) and not self.must_close(self.plan, tokens_left):
            return self.plan
        return self.fresh_plan()

    def fresh_plan(self) -> list[int] | None:
        """The shortest way to finish found by search (closing_tokens), remembered for later steps."""
        self.plan = self._shortest()
        if self.plan is not None:
            self.last_close = len(self.plan)
        return self.plan

    def _shortest(self) -> list[int] | None:
        """closing_tokens from here. The greedy walk is deterministic, so when what was consumed since the last
        walk is a prefix of it (a forced close, token by token), the rest of it is what a new walk finds."""
        if self.walk is not None:
            done = self.compiled.tokenizer.decode_bytes(self.consumed[self.walk_at:])
            if self.walk.startswith(done):
                self.walk, self.walk_at = self.walk[len(done):], len(self.consumed)
                return closing_tokens(self.matcher, self.compiled, self.walk)
        self.walk, self.walk_at = closing_bytes(self.matcher, self.compiled), len(self.consumed)
        return None if self.walk is None else closing_tokens(self.matcher, self.compiled, self.walk)

    @staticmethod
    def must_close(plan: list[int], tokens_left: int) -> bool:
        return tokens_left <= len(plan) + 1 + CLOSE_SLACK

    def keeps_budget(self, token: int, tokens_left: int) -> bool:
        """Whether the output can still finish in time after `token` (sampled now, with `tokens_left` before it)."""
        m = self.matcher.deep_copy()
        if m.try_consume_tokens([token]) != 1:
            return True  # EOS or a stop id: nothing left to close
        if self.plan is not None and _still_closes(m, self.plan) and not self.must_close(self.plan, tokens_left - 1):
            return True  # the known way still fits, so the shortest one does too
        path = None  # the walk from here, when the token is its first bytes (see _shortest)
        if self.walk is not None and self.walk_at == len(self.consumed):
            head = self.compiled.tokenizer.decode_bytes([token])
            path = self.walk[len(head):] if self.walk.startswith(head) else None
        plan = closing_tokens(m, self.compiled, path)
        return plan is not None and not self.must_close(plan, tokens_left - 1)


def _still_closes(matcher: Any, plan: list[int]) -> bool:
    """Whether `plan` takes `matcher` to a state that accepts EOS; the matcher is left as it was."""
    n = matcher.try_consume_tokens(plan)
    done = n == len(plan) and matcher.is_accepting()
    if n:
        matcher.rollback(n)
    return done


def closing_bytes(matcher: Any, compiled: CompiledGrammar) -> bytes | None:
    """A short byte string that takes `matcher` (not changed) to a state that accepts EOS: greedy, each byte the
    first of _CLOSE_ORDER the grammar allows. llguidance only allows bytes from which the grammar can still finish,
    so the walk never dead-ends; None when it runs past CLOSE_MAX_BYTES."""
    m = matcher.deep_copy()
    out = bytearray()
    while not m.is_accepting():
        if len(out) >= CLOSE_MAX_BYTES:
            return None
        for t in compiled.byte_tokens:
            if m.try_consume_tokens([t]) == 1:
                out += compiled.tokenizer.decode_bytes([t])
                break
        else:
            return None
    return bytes(out)


def closing_tokens(matcher: Any, compiled: CompiledGrammar, path: bytes | None = None) -> list[int] | None:
    """closing_bytes (or `path`, found by it) as few tokens as the tokenizer makes of them (one per byte if that
    tokenization is refused)."""
    path = closing_bytes(matcher, compiled) if path is None else path
    if path is None:
        return None
    tokens = compiled.tokenizer.tokenize_bytes(path)
    if matcher.deep_copy().try_consume_tokens(tokens) != len(tokens):
        single = {compiled.tokenizer.decode_bytes([t])[0]: t for t in compiled.byte_tokens}
        tokens = [single[b] for b in path]
    return tokens


_executor: Any = None


def fill_masks(states: list[GrammarState], vocab_size: int) -> torch.Tensor:
    """Tokens each state's grammar bans at its next position: bool [len(states), vocab_size] (True = banned),
    the batch filled in parallel by llguidance. The bitmask is unpacked by numpy in one pass: the torch shift-and
    version runs many multithreaded passes, which cost ~10x more on a loaded 2-core host."""
    global _executor
    if _executor is None:
        _executor = llg.LLExecutor()
    bitmask = llt.allocate_token_bitmask(len(states), vocab_size)
    live = [(s.matcher, i) for i, s in enumerate(states) if not s.failed]
    if live:
        llt.fill_next_token_bitmask_par(_executor, live, bitmask)
    for i, s in enumerate(states):
        if s.failed:  # a token the grammar refused got in (a stop id, ignore_eos): do not mask what is left
            log.debug("grammar matcher stopped or failed: %s", s.matcher.get_error())
            bitmask[i] = -1
    banned = np.unpackbits((~bitmask.numpy()).view(np.uint8), axis=-1, bitorder="little")[:, :vocab_size]
    return torch.from_numpy(banned).view(torch.bool)


# what the start-up profile times masks on: a small record, the kind of schema apps send
_PROFILE_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                                     "tags": {"type": "array", "items": {"type": "string"}}},
                   "required": ["name", "age", "tags"], "additionalProperties": False}
_PROFILE_INSTANCE = '{"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry", "engines"]}'


def mask_time_per_row(tokenizer: Any, vocab_size: int, rows: int = 32, repeats: int = 5) -> float:
    """Seconds one constrained row adds to a step on this machine: one batch mask fill plus its application to
    the logits, for `rows` matchers spread over the positions of a JSON record (inside strings, at keys, in an
    array), divided by rows. The step-time model's per-masked-row term (core/step_time.py)."""
    compiled = GrammarCompiler(tokenizer, vocab_size).compile(StructuredOutputs(json=json.dumps(_PROFILE_SCHEMA)))
    path = tokenizer.encode(_PROFILE_INSTANCE, add_special_tokens=False)
    states = [GrammarState(compiled).advance(path[:i * len(path) // rows]) for i in range(rows)]
    logits = torch.zeros(rows, vocab_size)
    best = float("inf")
    for _ in range(repeats + 1):  # the first fill warms llguidance's per-state caches
        t0 = time.perf_counter()
        logits.masked_fill_(fill_masks(states, vocab_size), float("-inf"))
        best = min(best, time.perf_counter() - t0)
    return best / rows
