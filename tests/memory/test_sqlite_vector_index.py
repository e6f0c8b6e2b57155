"""The SQLite store's in-process vector index: exact for small scopes, shortlisted for large."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from keel.memory._records import ShownSession
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


def _session_index(vectors: np.ndarray, sessions: list[str]) -> _ScopeIndex:
    """Each vector a turn of its session (turns counted per session, in order)."""
    index = _ScopeIndex()
    turns: dict[str, int] = {}
    for number, (vector, session) in enumerate(zip(vectors, sessions, strict=True)):
        turn = turns[session] = turns.get(session, -1) + 1
        index.add(f"r{number}", vector, (session, turn, None), number + 1)
    return index


@pytest.mark.parametrize("layout", ["one session", "two sessions taking turns", "scattered"])
def test_a_shown_window_is_left_unscored_and_the_nearest_are_the_same(
    monkeypatch: pytest.MonkeyPatch, layout: str
) -> None:
    """Late in a long session most of its index is its own window, which a search never
    returns: only the other rows are scored, and what the search finds is what scoring every
    row and dropping the window's found (positions, and scores to the bit)."""
    vectors = _clustered(2000, dimension=256)
    rng = np.random.default_rng(5)
    if layout == "one session":
        sessions = ["s"] * 2000
    elif layout == "two sessions taking turns":
        sessions = [("s", "t")[(n // 50) % 2] for n in range(2000)]
    else:
        sessions = [("s", "t", "u")[int(choice)] for choice in rng.integers(0, 3, size=2000)]
    index = _session_index(vectors, sessions)
    shown = ShownSession(session_id="s", first_turn=300)
    hidden = index.hidden(shown, index.size)
    assert hidden is not None
    visible = np.flatnonzero(~hidden)
    scored: list[int] = []
    real = _sqlite_memory.row_dots

    def counted(matrix: np.ndarray, vector: np.ndarray) -> np.ndarray:
        scored.append(matrix.shape[0])
        return real(matrix, vector)

    monkeypatch.setattr(_sqlite_memory, "row_dots", counted)
    for seed in range(5):
        query = vectors[seed * 311] + 0.05 * np.random.default_rng(seed).normal(size=256)
        query = (query / np.linalg.norm(query)).astype(np.float32)
        scored.clear()
        positions, scores = index.nearest(query, 120, shown)
        # What the search did before: every row scored, the window's dropped after.
        every = real(index.matrix[: index.size], query)[visible]
        top = np.argpartition(-every, 119)[:120]
        top = top[np.argsort(-every[top])]
        assert positions.tolist() == visible[top].tolist()
        assert np.array_equal(scores.view(np.uint32), every[top].view(np.uint32))
        assert not hidden[positions].any()
        if layout == "scattered":  # too many runs: the whole span, as before
            assert sum(scored) <= index.size
        else:
            assert sum(scored) == visible.size < index.size


@given(
    st.lists(st.integers(0, 299), max_size=300, unique=True),
    st.sampled_from([7, 64, 256, 384]),
)
def test_scoring_by_runs_gives_the_whole_products_rows_to_the_bit(
    picked: list[int], dimension: int
) -> None:
    rng = np.random.default_rng(len(picked) + dimension)
    matrix = rng.normal(size=(300, dimension)).astype(np.float32)
    query = rng.normal(size=dimension).astype(np.float32)
    rows = np.array(sorted(picked), dtype=np.int64)
    runs = _sqlite_memory._dots_by_runs(matrix, rows, query)
    whole = _sqlite_memory.row_dots(matrix, query)[rows]
    assert runs.dtype == whole.dtype == np.float32
    assert np.array_equal(runs.view(np.uint32), whole.view(np.uint32))
