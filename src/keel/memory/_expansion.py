"""Multi-hop expansion: the names a first hit mentions, searched for in a second hop.

"Where did Caroline move from?" finds "I moved here from my home country", and the turn that
says which country may share no word with the question but does share a name with the first
hit's session ("Sweden", "the LGBTQ centre"). The retriever runs one more keyword search for
the names its best hits mention and the query does not, and fuses that ranking in with
``expansion_weight`` (see [`RetrievalConfig`][keel.memory.RetrievalConfig]).

A name is a capitalised word that does not open a sentence or a turn (so "Yesterday I went"
gives nothing, "we went to Sweden" gives ``sweden``), lower-cased as keyword terms are.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from keel.memory._text import STOPWORDS

__all__ = ["entity_terms"]

_TOKEN = re.compile(r"[A-Za-z][A-Za-z0-9'\u2019-]*|[.!?:;\n]")
_SENTENCE_END = frozenset(".!?:;\n")


def _names(text: str) -> list[str]:
    names: list[str] = []
    opening = True
    for token in _TOKEN.findall(text):
        if token in _SENTENCE_END:
            opening = True
            continue
        if not opening and token[0].isupper():
            word = re.sub(r"['\u2019].*$", "", token).lower()
            if len(word) > 1 and word not in STOPWORDS:
                names.append(word)
        opening = False
    return names


def entity_terms(
    texts: Iterable[str], query_terms: Sequence[str], *, max_terms: int = 8
) -> list[str]:
    """Names mentioned in ``texts`` (in order of first mention) that are not already among
    ``query_terms``; at most ``max_terms``. Only ``[a-z0-9]`` words, like keyword terms."""
    known = set(query_terms)
    found: list[str] = []
    for text in texts:
        for name in _names(text):
            clean = re.sub(r"[^a-z0-9]", "", name)
            if clean and clean not in known and clean not in found and clean not in STOPWORDS:
                found.append(clean)
    return found[:max_terms]
