"""Build paceline/bench/data/corpus.txt (the benchmark's prompt text, package data): English prose paragraphs from the docstrings of CPython's standard library.

Why docstrings: they are real English written by people (so tokenization behaves like real prompts), they ship
with every Python install, and they are covered by the PSF License Agreement, which permits copying and
redistribution with the license notice kept (see paceline/bench/data/LICENSE-PSF.txt, next to the corpus). Only paragraphs that read
as prose are kept: no doctest lines, no indented code, few symbols. The output is deterministic for a given
Python version: `python benchmarks/make_corpus.py [target_kb]`.
"""
from __future__ import annotations

import ast
import re
import sys
import sysconfig
from pathlib import Path

HERE = Path(__file__).resolve().parents[1] / "paceline" / "bench" / "data"
SKIP_DIRS = {"test", "tests", "idlelib", "lib2to3", "turtledemo", "site-packages", "ensurepip", "pydoc_data", "tkinter"}


def docstrings(path: Path) -> list[str]:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    nodes = [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    return [d for n in nodes if (d := ast.get_docstring(n))]


def prose_paragraphs(doc: str) -> list[str]:
    out = []
    for para in re.split(r"\n\s*\n", doc):
        lines = para.splitlines()
        if any(line.startswith((" ", "\t", ">>>", "...")) for line in lines):
            continue  # code, tables, argument lists
        text = " ".join(line.strip() for line in lines)
        if len(text) < 200:
            continue
        plain = sum(c.isalpha() or c in " ,.;:'-()" for c in text)
        if plain / len(text) < 0.95 or text.count("_") > 3:
            continue
        out.append(text)
    return out


def main(target_kb: int = 300) -> None:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    seen: set[str] = set()
    paragraphs: list[str] = []
    size = 0
    for path in sorted(stdlib.rglob("*.py")):
        if SKIP_DIRS & set(path.relative_to(stdlib).parts):
            continue
        for doc in docstrings(path):
            for para in prose_paragraphs(doc):
                if para not in seen and size < target_kb * 1024:
                    seen.add(para)
                    paragraphs.append(para)
                    size += len(para) + 2
    (HERE / "corpus.txt").write_text("\n\n".join(paragraphs) + "\n", encoding="utf-8")
    print(f"{len(paragraphs)} paragraphs, {size // 1024} KB from Python {sys.version.split()[0]}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 300)
