"""Tokenizer from GGUF metadata vs transformers, chat template, incremental detokenization, stop strings."""
from __future__ import annotations

import os

import pytest
from hypothesis import given, settings, strategies as st

from paceline.model.loader import default_model_path, read_gguf
from paceline.model.tokenizer import IncrementalDetokenizer, StopStringMatcher, Tokenizer, _byte_alphabet

from _tiny_checkpoints import tiny_tokenizer

TEXTS = [
    "Hello, world!",
    "émoji 😀👍🏽 and 中文字符 and Ελληνικά, ñandú, Ünïcödé",
    "def f(x):\n    return x ** 2  # square\n\n\nclass A:\n\tpass\n",
    "  leading and trailing spaces   ",
    "tabs\tand\r\nwindows newlines\n\n   \n",
    "it's I'm we'll they've I'D",
    "numbers 1 12 123 2024 3.14159 1,000,000 and  42   7",
    "€100 — “quotes” ‘single’ … ½ ² ①",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "\u00a0nbsp\u2009thin\u200bzero-width ＦＵＬＬ　ｗｉｄｔｈ",
    "URL: https://example.com/path?q=1&b=2#frag, email a.b@c.org",
    "日本語のテキストと한국어 텍스트, العربية, हिन्दी",
    "",
    " ",
    "x" * 300,
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf(read_gguf(default_model_path())[0])


@pytest.fixture(scope="module")
def hf_tok():
    from transformers import AutoTokenizer

    path = default_model_path()
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


@pytest.fixture(scope="module")
def smollm_reference(hf_tok):
    """transformers' converted vocabulary with SmolLM2's own pre-tokenizer (digits split first, then GPT-2 bytes).

    transformers' GGUF conversion does not know llama.cpp's "smollm" pre-tokenizer and falls back to plain GPT-2,
    which differs only where a run of spaces precedes a digit.
    """
    from tokenizers import Tokenizer as Backend, pre_tokenizers

    ref = Backend.from_str(hf_tok.backend_tokenizer.to_str())
    ref.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    return ref


def test_properties(tok, hf_tok):
    assert (tok.bos_token_id, tok.eos_token_id) == (hf_tok.bos_token_id, hf_tok.eos_token_id) == (1, 2)
    assert tok.vocab_size == len(hf_tok) == 49152
    # every special token (what decode skips), a superset of transformers' bos/eos/unk list
    assert tok.all_special_ids == list(range(17)) and set(hf_tok.all_special_ids) <= set(tok.all_special_ids)
    assert not tok.add_bos_token


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(tok, hf_tok, smollm_reference, text):
    ids = tok.encode(text)
    assert ids == smollm_reference.encode(text, add_special_tokens=False).ids
    if not any(c.isdigit() for c in text):
        assert ids == hf_tok(text)["input_ids"]
    assert tok.decode(ids, skip_special_tokens=False) == hf_tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)


def test_digits_split_like_llama_cpp_smollm(tok):
    # llama.cpp's smollm pre-tokenizer isolates every digit first, so the two spaces before 7 stay one token
    assert tok.encode("a  7") == [tok.backend.token_to_id("a"), tok.backend.token_to_id("ĠĠ"), tok.backend.token_to_id("7")]
    assert tok.encode("2024") == [tok.backend.token_to_id(d) for d in "2024"]


def test_bos_rule(tok):
    t = tiny_tokenizer()
    bos = Tokenizer(t.backend, bos_token="<|im_start|>", eos_token="<|im_end|>", add_bos_token=True)
    assert bos.encode("the") == [bos.bos_token_id] + t.encode("the")
    assert bos.encode("the", add_special_tokens=False) == t.encode("the")
    with pytest.raises(ValueError):
        tok.encode(["not", "text"])


CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
     {"role": "assistant", "content": "4."}, {"role": "user", "content": "And 3+3? 😀"}],
    [{"role": "user", "content": "line one\nline two"}, {"role": "assistant", "content": ""}],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tok, hf_tok, messages, add_generation_prompt):
    ours = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert ours == hf_tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    assert ours.startswith("<|im_start|>system\n")
    assert ours.endswith("<|im_start|>assistant\n") == add_generation_prompt


def test_chat_template_errors(tok):
    with pytest.raises(ValueError, match="non-empty list"):
        tok.apply_chat_template([])
    with pytest.raises(ValueError, match="role"):
        tok.apply_chat_template([{"content": "hi"}])
    with pytest.raises(ValueError, match="content"):
        tok.apply_chat_template([{"role": "user", "content": 3}])
    t = tiny_tokenizer()
    no_template = Tokenizer(t.backend, bos_token=t.bos_token, eos_token=t.eos_token)
    with pytest.raises(ValueError, match="no chat template"):
        no_template.apply_chat_template([{"role": "user", "content": "hi"}])
    strict = Tokenizer(t.backend, chat_template="{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}"
                                                "{% endif %}{{ messages[0]['content'] | tojson }} {{ strftime_now('%Y') }}")
    with pytest.raises(ValueError, match="user first"):
        strict.apply_chat_template([{"role": "system", "content": "x"}])
    out = strict.apply_chat_template([{"role": "user", "content": "héllo"}])
    assert out.startswith('"héllo" ') and out[-4:].isdigit()


def test_save_and_reload(tok, hf_tok, tmp_path):
    from transformers import AutoTokenizer

    tok.save(tmp_path)
    again = Tokenizer.from_hf_folder(tmp_path)
    assert (again.bos_token_id, again.eos_token_id, again.add_bos_token, again.chat_template) == (
        tok.bos_token_id, tok.eos_token_id, tok.add_bos_token, tok.chat_template)
    saved_by_transformers = AutoTokenizer.from_pretrained(tmp_path)
    for text in TEXTS:
        assert again.encode(text) == tok.encode(text) == saved_by_transformers(text)["input_ids"]
    assert again.apply_chat_template(CONVERSATIONS[1]) == hf_tok.apply_chat_template(CONVERSATIONS[1], add_generation_prompt=True, tokenize=False)


# ---------------------------------------------------------------- incremental detokenization

def _stream(tok, ids, prompt=None, skip=True):
    detok = IncrementalDetokenizer(tok, prompt_token_ids=prompt, skip_special_tokens=skip)
    deltas = [detok.add(i) for i in ids]
    return detok, deltas


MULTIBYTE = ["😀👍🏽 family: 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵", "中文字符和日本語のテキスト", "ñandú Ünïcödé Ελληνικά àéîõü", "mixed é😀中 end"]


@pytest.mark.parametrize("text", MULTIBYTE)
def test_detokenizer_matches_full_decode_at_every_prefix(tok, text):
    ids = tok.encode(text)
    detok, deltas = _stream(tok, ids)
    assert "" in deltas  # some character really was split across tokens
    for n in range(1, len(ids) + 1):
        full = tok.decode(ids[:n])
        streamed = "".join(deltas[:n])
        assert "\ufffd" not in streamed
        assert full.startswith(streamed)
        assert streamed == full or full.endswith("\ufffd")  # only an unfinished character is held back
    assert "".join(deltas) == detok.text == text


def test_detokenizer_one_byte_per_token(tok):
    """The worst split: every byte its own token (byte tokens exist in any byte-level vocabulary)."""
    alphabet = _byte_alphabet()
    text = "a😀b中ñ👨‍👩‍👧"
    ids = [tok.backend.token_to_id(alphabet[b]) for b in text.encode("utf-8")]
    detok, deltas = _stream(tok, ids)
    assert "".join(deltas) == text and all("\ufffd" not in d for d in deltas)
    assert deltas[1:5] == ["", "", "", "😀"]


def test_detokenizer_with_prompt_and_specials(tok):
    prompt = tok.encode("<|im_start|>user\nSay hi in French<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    out = tok.encode(" Bonjour à tous 🇫🇷 !<|im_end|>")
    detok, deltas = _stream(tok, out, prompt=prompt)
    assert detok.text == tok.decode(prompt + out)[len(tok.decode(prompt)):] == " Bonjour à tous 🇫🇷 !"
    assert deltas[-1] == ""  # <|im_end|> is skipped
    detok, _ = _stream(tok, out, skip=False)
    assert detok.text.endswith("!<|im_end|>")


def test_detokenizer_flush_emits_bytes_that_never_complete(tok):
    alphabet = _byte_alphabet()
    detok, deltas = _stream(tok, [tok.backend.token_to_id("a"), tok.backend.token_to_id(alphabet[0xE4])])
    assert deltas == ["a", ""]
    assert detok.flush() == "\ufffd" and detok.text == "a\ufffd"
    assert detok.flush() == ""


def test_detokenizer_window_stays_small(tok):
    ids = tok.encode("word " * 2000)
    detok, deltas = _stream(tok, ids)
    assert "".join(deltas) == "word " * 2000
    assert len(detok.ids) < 80  # it only keeps the recent window


# ---------------------------------------------------------------- stop strings

def test_stop_string_spanning_deltas():
    m = StopStringMatcher(["STOP"])
    assert m.feed("abc S") == ("abc ", False, None)
    assert m.feed("TO") == ("", False, None)
    assert m.feed("P tail") == ("", True, "STOP")
    assert m.text == "abc " and m.stopped
    assert m.feed("more") == ("", True, "STOP")
    assert m.flush() == ""


def test_stop_string_included_and_holdback_released():
    m = StopStringMatcher(["</s>", "\n\n"], include_stop_str_in_output=True)
    assert m.feed("x <") == ("x ", False, None)
    assert m.feed("b>") == ("<b>", False, None)  # "<b" can no longer become "</s>"
    assert m.feed(" ok\n") == (" ok", False, None)
    assert m.feed("\nnext") == ("\n\n", True, "\n\n")
    assert m.text == "x <b> ok\n\n"
    held = StopStringMatcher(["</s>"])
    held.feed("end </")
    assert held.flush() == "</" and held.text == "end </"  # a finish for another reason keeps the text


def test_earliest_ending_stop_wins():
    m = StopStringMatcher(["abcd", "bc"])
    assert m.feed("xabcd") == ("xa", True, "bc")
    assert StopStringMatcher([]).feed("anything") == ("anything", False, None)
    with pytest.raises(ValueError):
        StopStringMatcher([""])


def test_stop_string_over_real_tokens(tok):
    text = "The answer is 42.\nUser: next question"
    detok = IncrementalDetokenizer(tok)
    m = StopStringMatcher(["\nUser:"])
    emitted, stopped = [], False
    for i in tok.encode(text):
        out, stopped, s = m.feed(detok.add(i))
        emitted.append(out)
        if stopped:
            break
    assert stopped and s == "\nUser:"
    assert "".join(emitted) == m.text == "The answer is 42."


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet="ab\n<", max_size=40), cuts=st.lists(st.integers(0, 40), max_size=8),
       stops=st.lists(st.text(alphabet="ab\n<", min_size=1, max_size=4), min_size=1, max_size=3),
       include=st.booleans())
def test_stop_matcher_streaming_equals_offline(text, cuts, stops, include):
    # offline answer: scan the whole text for the first position where some stop string ends
    end = next((e for e in range(1, len(text) + 1) if any(text[:e].endswith(s) for s in stops)), None)
    if end is None:
        expect, expect_stop = text, None
    else:
        hit = max((s for s in stops if text[:end].endswith(s)), key=len)
        expect, expect_stop = (text[:end] if include else text[:end - len(hit)]), hit
    m = StopStringMatcher(stops, include_stop_str_in_output=include)
    bounds = sorted({0, len(text), *[min(c, len(text)) for c in cuts]})
    outs, stopped, stop = [], False, None
    for a, b in zip(bounds, bounds[1:]):
        out, stopped, stop = m.feed(text[a:b])
        outs.append(out)
        if stopped:
            break
        # nothing emitted may be part of a stop string that could still complete
        assert not any(s in "".join(outs) for s in stops)
    if not stopped:
        outs.append(m.flush())
    assert "".join(outs) == m.text == expect
    assert stop == expect_stop
