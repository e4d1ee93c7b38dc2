"""Structured outputs on the bundled model: every constraint kind yields text that matches it, greedy output under
preemption (recompute and swap) equals the uninterrupted run, and bad constraints are ValueErrors."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import jsonschema_rs
import pytest

from paceline import LLM, SamplingParams
from paceline.model.structured import GrammarCompiler
from paceline.sampling import StructuredOutputs

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "entrypoints"))
from json_schemas import SCHEMAS  # noqa: E402

PROMPTS = ["Describe the weather in Paris as JSON.", "Give me a product record.", "Sentiment of 'great stuff'?",
           "An address in Paris, please.", "Tags for a blog post on LLM serving."]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", kv_cache_memory_gb=0.1)  # the figures below were set in float32, the exact mode


@pytest.fixture(scope="module")
def compiler(llm: LLM) -> GrammarCompiler:
    return GrammarCompiler(llm.engine.tokenizer, llm.engine.arch.vocab_size)


def constrained(compiler: GrammarCompiler, n: int = 48, temperature: float = 0.0, seed: int | None = None,
                **so) -> SamplingParams:
    s = StructuredOutputs(**so)
    s.compiled = compiler.compile(s)
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=n, structured=s)


def test_bad_constraints_are_value_errors(compiler: GrammarCompiler) -> None:
    for so in (dict(regex="(unclosed"), dict(grammar="start: (("), dict(json='{"type": "nonsense"}')):
        with pytest.raises(ValueError, match="invalid"):
            compiler.compile(StructuredOutputs(**so))
    a = compiler.compile(StructuredOutputs(regex="[ab]+"))
    assert compiler.compile(StructuredOutputs(regex="[ab]+")) is a  # cached by constraint


# temperature 1 only where the schema bounds every string: unbounded ones let this 135M model ramble past max_tokens
@pytest.mark.parametrize("name,temperatures", [("weather_call", [0.0, 1.0]), ("sentiment", [0.0, 1.0, 1.0]),
                                               ("address", [0.0]), ("tags", [0.0, 1.0, 1.0])])
def test_json_schema_outputs_validate(llm: LLM, compiler: GrammarCompiler, name: str, temperatures) -> None:
    schema = SCHEMAS[name][0]
    params = [constrained(compiler, 80, temperature=t, seed=i, json=json.dumps(schema))
              for i, t in enumerate(temperatures)]
    for out in llm.generate([PROMPTS[0]] * len(params), params):
        text = out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop", text
        jsonschema_rs.validate(schema, json.loads(text))


def test_regex_choice_grammar_and_json_object(llm: LLM, compiler: GrammarCompiler) -> None:
    cases = [(dict(regex=r"[0-9]{3}-[a-z]{2}"), lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2}", t)),
             (dict(choice=("yes", "no", "maybe")), lambda t: t in ("yes", "no", "maybe")),
             (dict(grammar='start: "A" ("B" | "C")+ "."'), lambda t: re.fullmatch(r"A[BC]+\.", t)),
             (dict(grammar='root ::= "x" [0-9] [0-9]'), lambda t: re.fullmatch(r"x[0-9]{2}", t)),
             (dict(json_object=True), lambda t: isinstance(json.loads(t), dict))]
    # json_object greedy: free-form keys at temperature 1 can run past max_tokens on this small model
    params = [constrained(compiler, 120 if "json_object" in so else 40, temperature=0.0 if "json_object" in so else 1.0,
                          seed=1, **so)
              for so, _ in cases]
    outs = llm.generate(["Reply in the required format:"] * len(cases), params)
    for (so, ok), out in zip(cases, outs):
        text = out.outputs[0].text
        if "grammar" in so and "(" in so["grammar"] and out.outputs[0].finish_reason == "length":
            # the only unbounded language here: a sample may still be in its (B|C)+ loop at max_tokens, and must then
            # be a prefix of a sentence of it
            assert re.fullmatch(r"A[BC]*", text), (so, text)
            continue
        assert ok(text), (so, text)


def test_strict_schema_closes_objects(compiler: GrammarCompiler) -> None:
    open_schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    strict = compiler.compile(StructuredOutputs(json=open_schema, strict=True))
    loose = compiler.compile(StructuredOutputs(json=open_schema))
    assert strict.grammar != loose.grammar


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_mid_constrained_output_changes_nothing(llm: LLM, compiler: GrammarCompiler, mode: str) -> None:
    schema = json.dumps(SCHEMAS["product"][0])
    reference = [o.outputs[0].token_ids for o in
                 llm.generate(PROMPTS, [constrained(compiler, 40, json=schema) for _ in PROMPTS])]
    small = LLM(dtype="float32", num_blocks=12, block_size=16, preemption_mode=mode, swap_space_gb=0.05)
    small_compiler = GrammarCompiler(small.engine.tokenizer, small.engine.arch.vocab_size)
    outs = small.generate(PROMPTS, [constrained(small_compiler, 40, json=schema) for _ in PROMPTS])
    assert small.engine.stats().num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == reference


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_budget_close_finishes_valid_json(compiler: GrammarCompiler, name: str) -> None:
    """Half of a valid instance, then a rambling string or number: forcing budget_token's tokens (as the sampler
    does when max_tokens is near) ends in JSON that parses and validates, within the tokens left."""
    from paceline.model.structured import GrammarState

    schema, instance = SCHEMAS[name]
    so = StructuredOutputs(json=json.dumps(schema))
    so.compiled = compiler.compile(so)
    tok = compiler.lltokenizer
    text = json.dumps(instance, separators=(", ", ": "))
    state = GrammarState(so.compiled)
    out = tok.tokenize_str(text[:len(text) // 2])
    state = state.advance(out)
    assert not state.failed
    eos = 0
    for left in range(24, 0, -1):
        plan = state.closing_plan(left)
        forced = (plan[0] if plan else eos) if plan is not None and state.must_close(plan, left) else None
        if forced is None:  # the model would go on: it picks a token the grammar allows (a digit or a letter)...
            order = so.compiled.byte_tokens[3:] + so.compiled.byte_tokens[:3]  # closers last
            forced = next((t for t in order if state.matcher.deep_copy().try_consume_tokens([t])), eos)
            if plan is not None and not state.keeps_budget(forced, left):  # ...kept only if it leaves room
                forced = plan[0] if plan else eos
        if forced == eos:
            break
        out.append(forced)
        state = state.advance(out)
    else:
        pytest.fail("the budget ran out before the grammar closed")
    jsonschema_rs.validate(schema, json.loads(tok.decode_str(out)))
