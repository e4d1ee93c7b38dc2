"""The n-gram proposer and the speculative config."""
from __future__ import annotations

import pytest

from paceline.core.spec_ngram import propose_ngram
from paceline.spec_config import SpeculativeConfig


def test_proposes_what_followed_the_latest_match_of_the_longest_suffix() -> None:
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3]
    # suffix [1, 2, 3] occurred at 0 (followed by 4, 5); [2, 3] more recently at 6 (followed by 7) but longer wins
    assert propose_ngram(tokens, 3, max_n=3) == [4, 5, 9]
    assert propose_ngram(tokens, 3, max_n=2) == [7, 8, 1]
    assert propose_ngram(tokens, 1, max_n=3) == [4]


def test_proposal_is_cut_at_the_end_of_the_tokens() -> None:
    assert propose_ngram([5, 6, 5, 6], 4, max_n=2) == [5, 6]  # [5, 6] at 0 is followed by 5, 6, then the end
    assert propose_ngram([5, 5, 5], 4, max_n=1) == [5]  # the latest earlier 5 (at 1) has one token after it


def test_nothing_when_no_suffix_of_min_length_occurred() -> None:
    assert propose_ngram([1, 2, 3, 4], 3, max_n=3, min_n=1) == []
    assert propose_ngram([1, 2, 9, 2], 3, max_n=3, min_n=2) == []
    assert propose_ngram([1, 2, 9, 2], 3, max_n=3, min_n=1) == [9, 2]
    assert propose_ngram([7], 3, max_n=3) == []
    assert propose_ngram([7, 7], 0, max_n=3) == []


def test_byte_level_matches_off_a_token_boundary_are_skipped() -> None:
    # 256 packs as bytes 00 01 00 00; [1, 0] as 01 00 00 00 00 00 00 00: a byte search finds misaligned hits
    tokens = [256, 0, 0, 0, 5, 1]
    assert propose_ngram(tokens, 2, max_n=1) == []
    tokens = [1, 6, 256, 0, 1]
    assert propose_ngram(tokens, 2, max_n=1) == [6, 256]


def test_matches_a_brute_force_search() -> None:
    import random
    rng = random.Random(0)
    for _ in range(300):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 30))]
        k, hi = rng.randrange(1, 5), rng.randrange(1, 5)
        lo = rng.randrange(1, hi + 1)
        want: list[int] = []
        for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
            suffix = tokens[-n:]
            hits = [i for i in range(len(tokens) - n) if tokens[i:i + n] == suffix]
            if hits:
                want = tokens[hits[-1] + n:hits[-1] + n + k]
                break
        assert propose_ngram(tokens, k, hi, lo) == want, (tokens, k, hi, lo)


def test_config_parses_vllm_spelling_and_refuses_bad_input() -> None:
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3, '
                                '"prompt_lookup_min": 2}')
    assert (c.num_speculative_tokens, c.prompt_lookup_max, c.prompt_lookup_min) == (5, 3, 2)
    assert SpeculativeConfig.parse(None) is None and SpeculativeConfig.parse("") is None
    for bad in ['{"method": "eagle"}', '{"num_speculative_tokens": 0}', '{"prompt_lookup_min": 5, "prompt_lookup_max": 2}',
                '{"method": "ngram", "model": "x"}', '{"adaptive": 1}',
                '{"method": "draft_model", "quantization": "int8"}', "[1]", "{nope", '{"k": 1}']:
        with pytest.raises(ValueError):
            SpeculativeConfig.parse(bad)
    d = SpeculativeConfig.parse('{"method": "draft_model", "quantization": "int4", "num_speculative_tokens": 3}')
    assert (d.method, d.model, d.quantization, d.adaptive) == ("draft_model", None, "int4", True)
    assert SpeculativeConfig.parse('{"model": "/m.gguf"}').method == "draft_model"  # vLLM infers it
    assert SpeculativeConfig.parse('{"adaptive": false}').adaptive is False
