"""Tokenizer, chat template, incremental detokenization and stop strings.

Built on the `tokenizers` library and jinja2 only; transformers is never needed at runtime.

Streaming one request's text, as the engine does it:

    detok = IncrementalDetokenizer(tokenizer, prompt_token_ids=prompt_ids)
    stops = StopStringMatcher(params.stop, include_stop_str_in_output=params.include_stop_str_in_output)
    for each sampled token:
        delta = detok.add(token_id)              # new complete text ("" while a character is unfinished)
        out, stopped, stop_str = stops.feed(delta)
        stream(out)                              # safe to show: never a piece of a possible stop string
        if stopped: finish with reason "stop" (stop_str says which); feed nothing more
    on any other finish (eos, length, abort):
        stream(stops.feed(detok.flush())[0] + stops.flush())   # what was held back, so no text is lost

`stops.text` is the request's final text (what was streamed, in order). Stop strings are matched on
the text, so one may span any number of tokens; a match ends at the earliest possible character.
The matcher holds back the longest tail of the text that is still the start of some stop string,
and only that.
"""
from __future__ import annotations

import json
import os
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer as BackendTokenizer, decoders, models, normalizers, pre_tokenizers, processors

# GGUF token types (llama.cpp's llama_token_type)
_CONTROL, _USER_DEFINED = 3, 4

# How each llama.cpp `tokenizer.ggml.pre` value splits text before BPE: a list of regexes applied in turn.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_SPLITS = {
    "default": [_GPT2_SPLIT], "gpt2": [_GPT2_SPLIT], "gpt-2": [_GPT2_SPLIT],
    # SmolLM/StarCoder: every digit on its own first, then GPT-2 (llama.cpp LLAMA_VOCAB_PRE_TYPE_SMOLLM)
    "smollm": [r"\p{N}", _GPT2_SPLIT], "starcoder": [r"\p{N}", _GPT2_SPLIT], "refact": [r"\p{N}", _GPT2_SPLIT],
    "llama3": [_LLAMA3_SPLIT], "llama-v3": [_LLAMA3_SPLIT], "llama-bpe": [_LLAMA3_SPLIT], "smaug-bpe": [_LLAMA3_SPLIT],
    "qwen2": [_QWEN2_SPLIT], "deepseek-r1-qwen": [_QWEN2_SPLIT],
}
_IGNORE_MERGES = {"llama3", "llama-v3", "llama-bpe", "smaug-bpe"}  # whole-word vocab hits skip BPE, as their tokenizer.json says
_ADD_BOS_DEFAULT = {"llama3", "llama-v3", "llama-bpe", "smaug-bpe"}


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's printable spelling of each byte, the alphabet byte-level BPE vocabularies are written in."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    spelled, extra = {}, 0
    for b in range(256):
        if b in keep:
            spelled[b] = chr(b)
        else:
            spelled[b] = chr(256 + extra)
            extra += 1
    return spelled


def _token_text(tok: str | dict | None) -> str | None:
    return tok.get("content") if isinstance(tok, dict) else tok


class Tokenizer:
    """A `tokenizers.Tokenizer` plus what tokenizer_config.json adds: special tokens, BOS rule, chat template."""

    def __init__(self, backend: BackendTokenizer, *, bos_token: str | None = None, eos_token: str | None = None,
                 add_bos_token: bool = False, chat_template: str | None = None):
        self.backend = backend
        self.bos_token, self.eos_token = bos_token, eos_token
        self.add_bos_token = add_bos_token
        self.chat_template = chat_template
        self.bos_token_id = backend.token_to_id(bos_token) if bos_token else None
        self.eos_token_id = backend.token_to_id(eos_token) if eos_token else None
        if add_bos_token and self.bos_token_id is None:
            raise ValueError(f"tokenizer adds a BOS token but {bos_token!r} is not in its vocabulary")
        self.all_special_ids = sorted(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
        self._template = None  # compiled on first use

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    # ---- loading and saving

    @classmethod
    def from_hf_folder(cls, path: str | os.PathLike) -> "Tokenizer":
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise ValueError(f"{path} has no tokenizer.json")
        backend = BackendTokenizer.from_file(str(path / "tokenizer.json"))
        cfg = json.loads((path / "tokenizer_config.json").read_text()) if (path / "tokenizer_config.json").is_file() else {}
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        for name in ("chat_template.jinja",):  # newer checkpoints keep it in its own file
            if template is None and (path / name).is_file():
                template = (path / name).read_text()
        if template is None and (path / "chat_template.json").is_file():
            template = json.loads((path / "chat_template.json").read_text()).get("chat_template")
        bos, eos = _token_text(cfg.get("bos_token")), _token_text(cfg.get("eos_token"))
        add_bos = cfg.get("add_bos_token")
        if add_bos is None:  # no explicit rule: whatever the tokenizer.json post-processor does
            bos_id = backend.token_to_id(bos) if bos else None
            add_bos = bos_id is not None and backend.encode("a", add_special_tokens=True).ids[:1] == [bos_id]
        return cls(backend, bos_token=bos, eos_token=eos, add_bos_token=bool(add_bos), chat_template=template)

    @classmethod
    def from_gguf(cls, metadata: dict[str, Any]) -> "Tokenizer":
        """Build a byte-level BPE tokenizer from GGUF metadata (tokenizer.ggml.* keys, as loader.read_gguf returns)."""
        def field(key: str, default: Any = None) -> Any:
            return metadata.get(key, default)

        kind = field("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(
                f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE, 'gpt2'); "
                "use the model's Hugging Face folder instead"
            )
        pre = field("tokenizer.ggml.pre", "default")
        if pre not in _PRE_SPLITS:
            raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported; known: {', '.join(sorted(_PRE_SPLITS))}")
        tokens: list[str] = field("tokenizer.ggml.tokens")
        types: list[int] = field("tokenizer.ggml.token_type") or [1] * len(tokens)
        merges = [tuple(m.split(" ", 1)) for m in field("tokenizer.ggml.merges", [])]

        spelling = _byte_alphabet()
        alphabet = set(spelling.values())
        # Normal tokens are stored in the byte alphabet; the odd one stored as raw UTF-8 is respelled.
        vocab = {}
        for i, (tok, typ) in enumerate(zip(tokens, types)):
            if typ not in (_CONTROL, _USER_DEFINED) and not set(tok) <= alphabet:
                tok = "".join(spelling[b] for b in tok.encode("utf-8"))
            vocab.setdefault(tok, i)
        backend = BackendTokenizer(models.BPE(vocab, merges, ignore_merges=pre in _IGNORE_MERGES))
        if pre in ("qwen2", "deepseek-r1-qwen"):
            backend.normalizer = normalizers.NFC()
        splits = [pre_tokenizers.Split(Regex(rx), behavior="isolated") for rx in _PRE_SPLITS[pre]]
        backend.pre_tokenizer = pre_tokenizers.Sequence(splits + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        backend.decoder = decoders.ByteLevel()
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, typ in zip(tokens, types) if typ == _CONTROL])
        backend.add_tokens([AddedToken(t, special=False, normalized=False) for t, typ in zip(tokens, types) if typ == _USER_DEFINED])

        def token(key: str) -> str | None:
            i = field(key)
            return tokens[i] if i is not None and 0 <= i < len(tokens) else None

        bos, eos = token("tokenizer.ggml.bos_token_id"), token("tokenizer.ggml.eos_token_id")
        add_bos = field("tokenizer.ggml.add_bos_token", pre in _ADD_BOS_DEFAULT)
        if add_bos and bos is not None:  # so the saved tokenizer.json adds it too, for transformers and friends
            backend.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokens.index(bos))])
        return cls(backend, bos_token=bos, eos_token=eos, add_bos_token=bool(add_bos),
                   chat_template=field("tokenizer.chat_template"))

    def save(self, folder: str | os.PathLike) -> None:
        """Write tokenizer.json and tokenizer_config.json (loadable by from_hf_folder and by transformers)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(folder / "tokenizer.json"))
        cfg = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "add_bos_token": self.add_bos_token,
            "clean_up_tokenization_spaces": False,
        }
        if self.chat_template is not None:
            cfg["chat_template"] = self.chat_template
        (folder / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False))

    # ---- text <-> ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. Special tokens written in the text (like <|im_start|>) are matched whole.

        add_special_tokens adds BOS when the model's tokenizer does. Encode a rendered chat template with
        add_special_tokens=False: templates write their own BOS.
        """
        if not isinstance(text, str):
            raise ValueError(f"text to encode must be a str, got {type(text).__name__}")
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # ---- chat

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render `messages` ([{"role": ..., "content": ...}, ...]) with the model's chat template, as transformers does."""
        if not self.chat_template:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ValueError(f"message {i} must be a dict with a string 'role', got {m!r}")
            if not isinstance(m.get("content"), (str, list, type(None))):
                raise ValueError(f"message {i} content must be a string or a list of parts, got {type(m.get('content')).__name__}")
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)
        except _TemplateError as e:
            raise ValueError(f"chat template rejected the messages: {e}") from None


class _TemplateError(Exception):
    pass


def _compile_template(source: str):
    from jinja2 import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise _TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False) -> str:
        # transformers' own tojson: keeps non-ASCII text as is, unlike jinja's HTML-safe default
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except TemplateError as e:
        raise ValueError(f"chat template does not compile: {e}") from None


class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of text, one token at a time.

    Each add() decodes only a short window of recent tokens: the text of tokens [prefix, read) was already
    emitted, so the new text is decode([prefix, end)) minus decode([prefix, read)). Starting the window a
    few tokens back keeps tokenizers whose decoders look at neighbours (leading-space rules) consistent.
    Text ending in U+FFFD is an unfinished multi-byte character: it is held back until a later token
    completes it.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int] | None = None, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_token_ids[-6:]) if prompt_token_ids else []  # context only
        self.read = len(self.ids)
        self.prefix = max(self.read - 5, 0)
        self.text = ""

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completes (possibly "")."""
        self.ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """Text still held back (bytes that never formed a character come out as U+FFFD). Call when the request ends."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        decode = self.tokenizer.backend.decode
        skip = self.skip_special_tokens
        done = decode(self.ids[self.prefix:self.read], skip_special_tokens=skip) if self.read > self.prefix else ""
        full = decode(self.ids[self.prefix:], skip_special_tokens=skip) if len(self.ids) > self.prefix else ""
        if len(full) <= len(done) or (full.endswith("\ufffd") and not final):
            return ""
        new = full[len(done):]
        self.prefix, self.read = self.read, len(self.ids)
        # keep the list short: only the window is ever decoded again
        if self.prefix > 64:
            del self.ids[: self.prefix]
            self.read -= self.prefix
            self.prefix = 0
        self.text += new
        return new


class StopStringMatcher:
    """Finds stop strings in streamed text and says what is safe to emit.

    feed(delta) -> (text_to_emit, stopped, stop_str):
      - a stop string found (it may span earlier deltas): text up to it (and including it when
        include_stop_str_in_output), stopped=True, stop_str = the one that ended first;
      - else: the new text minus a held-back tail that could still grow into a stop string.
    After a stop, feed returns ("", True, stop_str). flush() returns the held-back tail (call it when the
    request finishes for any other reason). `text` is everything emitted so far.
    """

    def __init__(self, stops: list[str] | None, include_stop_str_in_output: bool = False):
        stops = list(stops or [])
        if any(not isinstance(s, str) or not s for s in stops):
            raise ValueError("stop strings must be non-empty strings")
        self.stops = stops
        self.include_stop_str_in_output = include_stop_str_in_output
        self._prefixes = {s[:k] for s in stops for k in range(1, len(s))}
        self._longest_prefix = max((len(s) - 1 for s in stops), default=0)
        self.held = ""
        self.text = ""
        self.stop_str: str | None = None

    @property
    def stopped(self) -> bool:
        return self.stop_str is not None

    def feed(self, delta: str) -> tuple[str, bool, str | None]:
        if self.stopped:
            return "", True, self.stop_str
        if not self.stops:
            self.text += delta
            return delta, False, None
        buf = self.held + delta
        # Only the held tail and the new text can contain a match; the earliest end wins, as if read char by char.
        best: tuple[int, int, str] | None = None
        for s in self.stops:
            i = buf.find(s)
            if i >= 0 and (best is None or (i + len(s), i) < best[:2]):
                best = (i + len(s), i, s)
        if best is not None:
            end, start, s = best
            out = buf[:end] if self.include_stop_str_in_output else buf[:start]
            self.held, self.stop_str = "", s
            self.text += out
            return out, True, s
        keep = 0
        for k in range(min(len(buf), self._longest_prefix), 0, -1):
            if buf[-k:] in self._prefixes:
                keep = k
                break
        out, self.held = buf[: len(buf) - keep], buf[len(buf) - keep:]
        self.text += out
        return out, False, None

    def flush(self) -> str:
        out, self.held = ("" if self.stopped else self.held), ""
        self.text += out
        return out
