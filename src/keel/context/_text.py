"""Cutting text to an exact token size, keeping its head and tail around a marker.

The cost is proportional to the tokens kept, not to the text's length: only a prefix and a
suffix of the text are encoded, so cutting a 50k-token tool output to 400 tokens is cheap.
"""

from __future__ import annotations

from keel.tokens import Tokenizer

__all__ = ["cut_middle", "elision_marker", "head_tokens", "pruning_marker"]

_CHARS_PER_TOKEN_GUESS = 6


def _head_ids(tokenizer: Tokenizer, text: str, count: int) -> list[int]:
    chars = count * _CHARS_PER_TOKEN_GUESS
    while True:
        ids = tokenizer.encode(text[:chars])
        if len(ids) > count or chars >= len(text):
            return ids[:count]
        chars *= 2


def head_tokens(tokenizer: Tokenizer, text: str, count: int) -> str:
    """The text of (at most) the first ``count`` tokens of ``text``."""
    if count <= 0 or not text:
        return ""
    return tokenizer.decode(_head_ids(tokenizer, text, count)).rstrip("\ufffd")


def pruning_marker(original_tokens: int) -> str:
    """The marker left in a pruned tool result; it states the original size."""
    return (
        f"\n[... tool output pruned: the original had {original_tokens} tokens; its head and "
        "tail are kept, the full output is in the trace ...]\n"
    )


def elision_marker(original_tokens: int) -> str:
    """The marker left in a message whose middle was elided to fit the window."""
    return (
        f"\n[... middle elided to fit the context window: the original had {original_tokens} "
        "tokens ...]\n"
    )


def _snap_head(text: str, end: int) -> int:
    cut = text.rfind(" ", max(0, end - 40), end)
    return cut if cut > 0 else end


def _snap_tail(text: str, start: int) -> int:
    cut = text.find(" ", start, start + 40)
    return cut if cut > 0 else start


def cut_middle(
    tokenizer: Tokenizer,
    text: str,
    target_tokens: int,
    *,
    original_tokens: int,
    kind: str = "prune",
) -> tuple[str, int]:
    """``text`` cut to at most ``target_tokens`` tokens (head, marker, tail) and its size.

    Two thirds of what is kept comes from the head, one third from the tail; the marker
    states ``original_tokens``. Cut points are placed by characters (from the text's own
    characters-per-token ratio, snapped to a space) and the result is verified by one exact
    count, shrinking and retrying if it came out too large, so the bound always holds and
    the cost is one count of the kept part, never of the whole text or a decode. When the
    target cannot even hold the marker, the result is the marker's beginning, cut to size.
    """
    if original_tokens <= target_tokens:
        return text, original_tokens
    marker = (pruning_marker if kind == "prune" else elision_marker)(original_tokens)
    marker_tokens = tokenizer.count(marker)
    budget = target_tokens - marker_tokens - 2
    chars_per_token = len(text) / max(1, original_tokens)
    for _ in range(8):
        if budget <= 0:
            break
        head_chars = int(budget * 2 / 3 * chars_per_token)
        tail_chars = int(budget / 3 * chars_per_token)
        head_end = _snap_head(text, head_chars)
        tail_start = _snap_tail(text, max(head_end, len(text) - tail_chars))
        result = text[:head_end].rstrip() + marker + text[tail_start:].lstrip()
        size = tokenizer.count(result)
        if size <= target_tokens:
            return result, size
        # Shrink in proportion to the overshoot, and a little more to converge fast.
        budget = int(budget * (target_tokens - marker_tokens) / (size - marker_tokens)) - 4
    short = head_tokens(tokenizer, marker.strip(), target_tokens)
    return short, tokenizer.count(short)
