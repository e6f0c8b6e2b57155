"""Query analysis for keyword search: lower-case word terms without stopwords.

Both backends stem on their side (SQLite FTS5 ``porter``, PostgreSQL ``english``); this module
only decides which words of a question are worth matching, so "What did Caroline do in May?"
searches for ``caroline`` and ``may`` rather than for every function word.
"""

from __future__ import annotations

import re

__all__ = ["STOPWORDS", "keyword_terms", "word_set"]

STOPWORDS = frozenset(
    [
        "a",
        "about",
        "above",
        "after",
        "again",
        "against",
        "all",
        "am",
        "an",
        "and",
        "any",
        "are",
        "aren't",
        "as",
        "at",
        "be",
        "because",
        "been",
        "before",
        "being",
        "below",
        "between",
        "both",
        "but",
        "by",
        "can",
        "could",
        "did",
        "do",
        "does",
        "doing",
        "don",
        "down",
        "during",
        "each",
        "ever",
        "few",
        "for",
        "from",
        "further",
        "had",
        "has",
        "have",
        "having",
        "he",
        "her",
        "here",
        "hers",
        "herself",
        "him",
        "himself",
        "his",
        "how",
        "i",
        "if",
        "in",
        "into",
        "is",
        "it",
        "its",
        "itself",
        "just",
        "kind",
        "let",
        "like",
        "me",
        "more",
        "most",
        "my",
        "myself",
        "no",
        "nor",
        "not",
        "now",
        "of",
        "off",
        "on",
        "once",
        "only",
        "or",
        "other",
        "our",
        "ours",
        "ourselves",
        "out",
        "over",
        "own",
        "same",
        "she",
        "should",
        "so",
        "some",
        "such",
        "than",
        "that",
        "the",
        "their",
        "theirs",
        "them",
        "themselves",
        "then",
        "there",
        "these",
        "they",
        "this",
        "those",
        "through",
        "to",
        "too",
        "type",
        "under",
        "until",
        "up",
        "very",
        "was",
        "we",
        "were",
        "what",
        "when",
        "where",
        "which",
        "while",
        "who",
        "whom",
        "why",
        "will",
        "with",
        "would",
        "you",
        "your",
        "yours",
        "yourself",
        "yourselves",
        "s",
        "t",
    ]
)

_WORD = re.compile(r"[a-z0-9]+")


def keyword_terms(text: str, *, max_terms: int = 32) -> list[str]:
    """Distinct search terms of ``text``: lower-case alphanumeric words, stopwords dropped.

    The output only ever contains ``[a-z0-9]`` words, so nothing in a query can change the
    structure of the backend's full-text query (no operators, quotes or column filters).
    """
    words = _WORD.findall(text.lower())
    terms = [w for w in words if w not in STOPWORDS and len(w) > 1]
    if not terms:
        terms = [w for w in words if len(w) > 1]
    return list(dict.fromkeys(terms))[:max_terms]


def word_set(text: str) -> frozenset[str]:
    """Content words of ``text`` (for cheap diversity checks)."""
    return frozenset(w for w in _WORD.findall(text.lower()) if w not in STOPWORDS)
