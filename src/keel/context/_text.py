"""Cutting text to an exact token size, keeping its head and tail around a marker.

The cost is proportional to the tokens kept, not to the text's length: only a prefix and a
suffix of the text are encoded, so cutting a 50k-token tool output to 400 tokens is cheap.
"""

from __future__ import annotations

from keel.tokens import Tokenizer

__all__ = ["cut_middle", "elision_marker", "head_tokens", "pruning_marker", "tail_tokens"]

_CHARS_PER_TOKEN_GUESS = 6


def head_tokens(tokenizer: Tokenizer, text: str, count: int) -> str:
    """The text of (at most) the first ``count`` tokens of ``text``."""
    if count <= 0 or not text:
        return ""
    chars = count * _CHARS_PER_TOKEN_GUESS
    while True:
        ids = tokenizer.encode(text[:chars])
        if len(ids) > count or chars >= len(text):
            break
        chars *= 2
    return tokenizer.decode(ids[:count]).rstrip("\ufffd")


def tail_tokens(tokenizer: Tokenizer, text: str, count: int) -> str:
    """The text of (at most) the last ``count`` tokens of ``text``."""
    if count <= 0 or not text:
        return ""
    chars = count * _CHARS_PER_TOKEN_GUESS
    while True:
        ids = tokenizer.encode(text[-chars:])
        if len(ids) > count or chars >= len(text):
            break
        chars *= 2
    # The first kept token may start inside a word; that is fine for a tail.
    return tokenizer.decode(ids[-count:]).lstrip("\ufffd")


def pruning_marker(original_tokens: int, kept_tokens: int) -> str:
    """The marker left in a pruned tool result."""
    return (
        f"\n[... {original_tokens - kept_tokens} of {original_tokens} tokens of tool output "
        "pruned; the full output is in the trace ...]\n"
    )


def elision_marker(original_tokens: int, kept_tokens: int) -> str:
    """The marker left in a message whose middle was elided to fit the window."""
    return (
        f"\n[... {original_tokens - kept_tokens} of {original_tokens} tokens elided to fit "
        "the context window ...]\n"
    )


def cut_middle(
    tokenizer: Tokenizer,
    text: str,
    target_tokens: int,
    *,
    original_tokens: int,
    kind: str = "prune",
) -> str:
    """``text`` cut to at most ``target_tokens`` tokens: head, marker, tail.

    The marker states ``original_tokens``. The result is verified by an exact count (token
    merges across the cut points can shift a count by one), so the bound always holds; when
    the target cannot even hold the marker, the result is the marker's head, cut to size.
    """
    if original_tokens <= target_tokens:
        return text
    make_marker = pruning_marker if kind == "prune" else elision_marker
    keep = target_tokens
    for _ in range(8):
        marker_tokens = tokenizer.count(make_marker(original_tokens, keep))
        budget = max(0, keep - marker_tokens - 2)
        head = head_tokens(tokenizer, text, budget - budget // 3)
        tail = tail_tokens(tokenizer, text, budget // 3)
        kept = tokenizer.count(head) + tokenizer.count(tail)
        result = head + make_marker(original_tokens, kept) + tail
        size = tokenizer.count(result)
        if size <= target_tokens:
            return result
        keep -= size - target_tokens + 1
        if keep <= 0:
            break
    return head_tokens(tokenizer, make_marker(original_tokens, 0).strip(), target_tokens)
