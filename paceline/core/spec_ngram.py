"""N-gram prompt lookup: propose the tokens that followed the last time the request's latest n tokens occurred.

Pure Python over the request's own prompt + output. The search runs in C: the token list is packed as 4-byte
ints and bytes.rfind finds the suffix, keeping only matches on a token boundary.
"""
from __future__ import annotations

from array import array


def propose_ngram(tokens: list[int], k: int, max_n: int, min_n: int = 1) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the longest suffix of `tokens` of length
    max_n..min_n. [] when no suffix of at least min_n tokens occurred before, or k < 1."""
    total = len(tokens)
    if k < 1 or total < 2:
        return []
    try:
        packed = array("i", tokens).tobytes()
    except OverflowError:  # ids beyond 32 bits: no real vocabulary has them
        return []
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        needle = packed[(total - n) * 4:]
        # an occurrence must end before the last token, so that at least one token follows it
        end = (total - 1) * 4
        while True:
            at = packed.rfind(needle, 0, end)
            if at < 0:
                break
            if at % 4 == 0:
                first = at // 4 + n
                return list(tokens[first:first + k])
            end = at + len(needle) - 1  # misaligned hit: look strictly left of it
    return []
