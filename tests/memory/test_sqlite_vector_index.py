"""The SQLite store's in-process vector index: exact for small scopes, shortlisted for large."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from keel.stores import _sqlite_memory
from keel.stores._sqlite_memory import _ScopeIndex


def _clustered(count: int, dimension: int = 64, seed: int = 3) -> np.ndarray:
    """Unit vectors around 40 centres, like embeddings of related texts."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(40, dimension))
    vectors = centres[rng.integers(0, 40, size=count)] + 0.6 * rng.normal(size=(count, dimension))
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    return vectors.astype(np.float32)


def _index(vectors: np.ndarray) -> _ScopeIndex:
    index = _ScopeIndex()
    for number, vector in enumerate(vectors):
        index.add(f"r{number}", vector)
    return index


def test_small_scopes_are_searched_exactly() -> None:
    vectors = _clustered(1500)
    index = _index(vectors)
    query = vectors[7] + 0.1
    positions, scores = index.nearest(query, 25)
    exact = np.argsort(-(vectors @ query))[:25]
    assert positions.tolist() == exact.tolist()
    assert np.allclose(scores, (vectors @ query)[exact], atol=1e-5)


def test_large_scopes_shortlist_by_sign_bits_and_rescore_exactly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_sqlite_memory, "_EXACT_VECTORS", 500)
    vectors = _clustered(6000)
    index = _index(vectors)
    rng = np.random.default_rng(11)
    overlaps = []
    for query in vectors[rng.integers(0, 6000, size=50)] + 0.05:
        positions, scores = index.nearest(query, 10)
        exact = np.argsort(-(vectors @ query))[:10]
        overlaps.append(len(set(positions.tolist()) & set(exact.tolist())) / 10)
        # Whatever is returned is scored exactly and ordered best first.
        assert np.allclose(scores, vectors[positions] @ query, atol=1e-5)
        assert (np.diff(scores) <= 1e-6).all()
    assert float(np.mean(overlaps)) >= 0.9


def test_a_re_embedded_record_replaces_its_vector_and_bits() -> None:
    vectors = _clustered(2000)
    index = _index(vectors)
    assert index.size == 2000 and index.matrix.shape[0] >= 2000
    index.add("r5", -vectors[5])
    assert index.size == 2000
    assert np.allclose(index.matrix[5], -vectors[5])
    positions, _ = index.nearest(-vectors[5], 1)
    assert index.ids[int(positions[0])] == "r5"
    flipped = _sqlite_memory._sign_bits(-vectors[5].reshape(1, -1))[0]
    assert (index.bits[:, 5] == flipped).all()


@given(
    distance=st.lists(st.integers(0, 12), min_size=1, max_size=600),
    share=st.floats(0.0, 1.2),
)
# The 1/16 sample the cut-off is estimated from sees only 0s (too low a cut), or only 12s.
@example(distance=[0 if i % 16 == 0 else 1 + i % 3 for i in range(640)], share=0.5)
@example(distance=[12 if i % 16 == 0 else i % 3 for i in range(640)], share=0.2)
def test_the_shortlist_is_exactly_the_smallest_distances_lowest_positions_first(
    distance: list[int], share: float
) -> None:
    # Few distinct values, so most cut-offs fall inside a run of ties.
    values = np.array(distance, dtype=np.uint16)
    count = int(share * values.size)
    expected = np.sort(np.argsort(values, kind="stable")[:count])
    assert _sqlite_memory._smallest_positions(values, count).tolist() == expected.tolist()


def test_a_shortlist_of_a_million_is_chosen_without_partitioning_all_of_them() -> None:
    rng = np.random.default_rng(5)
    # Hamming distances of 256-bit codes: a narrow bell around 128.
    values = rng.binomial(256, 0.5, size=1_000_000).astype(np.uint16)
    chosen = _sqlite_memory._smallest_positions(values, 40_000)
    assert chosen.size == 40_000 and (np.diff(chosen) > 0).all()
    cut = int(values[chosen].max())
    assert (values[chosen] <= cut).all()
    # Every closer row is in, and the rest are at the cut-off itself.
    closer = int(np.count_nonzero(values < cut))
    assert int(np.count_nonzero(values[chosen] < cut)) == closer < 40_000
