"""``KeelStore``, LangGraph's ``BaseStore`` on keel memory, on real SQLite and PostgreSQL:
items round-trip and replace, namespaces match label by label whatever characters they hold,
hybrid search ranks, TTL expires on a fake clock, PII never reaches the database, tenants never
see each other, and a compiled LangGraph graph uses the store."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypedDict

import psycopg
import pytest
from langgraph.graph import END, START, StateGraph
from langgraph.store.base import (
    BaseStore,
    GetOp,
    InvalidNamespaceError,
    ListNamespacesOp,
    MatchCondition,
    PutOp,
    SearchOp,
)

from keel.integrations.langgraph._store import KeelStore
from keel.memory import HashingEmbedder, Memory, MemoryStore, OnnxEmbedder
from keel.stores import (
    PostgresDatabase,
    PostgresMemoryStore,
    SQLiteDatabase,
    SQLiteMemoryStore,
)

EMAIL = "ada.lovelace@example.com"
PHONE = "+44 20 7946 0958"


class FakeClock:
    """The store's clock, moved by the test instead of sleeping."""

    def __init__(self) -> None:
        self.now = datetime.now(UTC)

    def __call__(self) -> datetime:
        return self.now

    def advance(self, minutes: float) -> None:
        self.now += timedelta(minutes=minutes)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Where the records go: a SQLite file path or a fresh PostgreSQL database URL."""
    if request.param == "sqlite":
        return str(tmp_path / "keel.db")
    url: str = request.getfixturevalue("postgres_url")
    return url


def _memory_store(backend: str) -> MemoryStore:
    if backend.startswith("postgresql://"):
        return PostgresMemoryStore(PostgresDatabase(backend))
    return SQLiteMemoryStore(SQLiteDatabase(backend))


@pytest.fixture
def memory(backend: str) -> Iterator[Memory]:
    memory = Memory(_memory_store(backend), embedder=HashingEmbedder(64))
    yield memory
    memory.close()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def store(memory: Memory, clock: FakeClock) -> KeelStore:
    return KeelStore(memory, tenant="acme", clock=clock)


def _keys(items: list[Any]) -> list[str]:
    return [item.key for item in items]


# --- items ----------------------------------------------------------------------------------


def test_put_get_delete_round_trip(store: KeelStore) -> None:
    store.put(("docs",), "report", {"title": "quarterly report", "pages": 12, "draft": False})
    store.put(("docs",), "memo", {"title": "memo"})
    item = store.get(("docs",), "report")
    assert item is not None
    assert (item.namespace, item.key) == (("docs",), "report")
    assert item.value == {"title": "quarterly report", "pages": 12, "draft": False}
    assert item.created_at.tzinfo is not None and item.updated_at >= item.created_at
    assert store.get(("docs",), "missing") is None
    assert store.get(("other",), "report") is None

    store.delete(("docs",), "report")
    assert store.get(("docs",), "report") is None
    assert store.get(("docs",), "memo") is not None
    assert _keys(store.search(("docs",))) == ["memo"]


def test_a_put_replaces_the_previous_value(store: KeelStore, memory: Memory) -> None:
    store.put(("prefs",), "food", {"text": "likes pizza with olives"})
    first = store.get(("prefs",), "food")
    store.put(("prefs",), "food", {"text": "now prefers sushi"})
    second = store.get(("prefs",), "food")
    assert first is not None and second is not None
    assert second.value == {"text": "now prefers sushi"}
    assert second.created_at == first.created_at and second.updated_at > first.updated_at
    assert memory.store.count(store.scope) == 1  # the old record is gone, not superseded
    memory.flush()
    assert [item.value for item in store.search(("prefs",))] == [second.value]
    assert store.search(("prefs",), query="pizza olives") == []
    assert _keys(store.search(("prefs",), query="sushi")) == ["food"]
    # Back to the first value: a value a key held before is stored again, not ignored.
    store.put(("prefs",), "food", {"text": "likes pizza with olives"})
    again = store.get(("prefs",), "food")
    assert again is not None and again.value == {"text": "likes pizza with olives"}


def test_two_keys_may_hold_the_same_value(store: KeelStore, memory: Memory) -> None:
    value = {"text": "allergic to peanuts"}
    store.put(("users", "u1"), "allergy", value)
    store.put(("users", "u1"), "allergy-copy", value)
    store.put(("users", "u2"), "allergy", value)
    assert store.get(("users", "u1"), "allergy-copy") is not None
    assert store.get(("users", "u2"), "allergy") is not None
    memory.flush()
    # Near-duplicates are still separate items: search returns every one of them.
    found = store.search(("users",), query="peanuts")
    assert sorted((item.namespace, item.key) for item in found) == [
        (("users", "u1"), "allergy"),
        (("users", "u1"), "allergy-copy"),
        (("users", "u2"), "allergy"),
    ]


def test_concurrent_puts_of_one_key_leave_one_item(store: KeelStore, memory: Memory) -> None:
    def write(writer: int) -> None:
        for number in range(10):
            store.put(("race",), "k", {"writer": writer, "n": number})

    with ThreadPoolExecutor(max_workers=6) as pool:
        list(pool.map(write, range(6)))
    item = store.get(("race",), "k")
    assert item is not None and item.value["n"] == 9
    assert memory.store.count(store.scope) == 1


# --- namespaces -----------------------------------------------------------------------------

# Labels that a LIKE pattern, a glob, SQL quoting or a joined path would get wrong, next to
# labels they could be mistaken for. "/" is the store's separator.
NAMESPACES = [
    ("users", "a%"),
    ("users", "ab"),
    ("users", "a_"),
    ("users", "a*"),
    ("users", "a'"),
    ("users", 'a"'),
    ("users", "a"),
    ("users", "a", "b"),
    ("users", "a/b"),
    ("users", "a%2Fb"),
    ("users", "a%25"),
    ("users", "a%", "deeper"),
    ("users", "' OR 1=1 --"),
    ("users2", "a"),
    ("user",),
]


@pytest.mark.parametrize("prefix", [*NAMESPACES, ("users",), ("users", "a", "b", "c")])
def test_a_namespace_prefix_matches_label_by_label(
    store: KeelStore, prefix: tuple[str, ...]
) -> None:
    for number, namespace in enumerate(NAMESPACES):
        store.put(namespace, "item", {"n": number})
    # A key with the separator in it, in a namespace one label short of ("users", "a").
    store.put(("users",), "a/b", {"n": -1})
    stored = [*NAMESPACES, ("users",)]
    expected = {ns for ns in stored if ns[: len(prefix)] == prefix}

    found = store.search(prefix, limit=100)
    assert {item.namespace for item in found} == expected
    assert set(store.list_namespaces(prefix=prefix)) == expected
    for namespace in stored:
        item = store.get(namespace, "item" if namespace != ("users",) else "a/b")
        assert item is not None and item.namespace == namespace


def test_a_key_with_the_separator_stays_a_key(store: KeelStore) -> None:
    store.put(("users",), "a//b", {"n": 1})
    store.put(("users", "a"), "/b", {"n": 2})
    first = store.get(("users",), "a//b")
    second = store.get(("users", "a"), "/b")
    assert first is not None and first.value == {"n": 1}
    assert second is not None and second.value == {"n": 2}
    assert store.list_namespaces() == [("users",), ("users", "a")]


def test_labels_langgraph_forbids_are_refused_even_in_direct_ops(store: KeelStore) -> None:
    with pytest.raises(InvalidNamespaceError):
        store.put(("users", "a.b"), "k", {"n": 1})
    # "a.b" would be ("a", "b") in a store that joins labels with dots; batch checks it too.
    for op in (
        PutOp(("users", "a.b"), "k", {"n": 1}),
        GetOp(("users", "a.b"), "k"),
        SearchOp(("users", "a.b")),
        ListNamespacesOp((MatchCondition("prefix", ("a.b",)),)),
        PutOp((), "k", {"n": 1}),
    ):
        with pytest.raises(InvalidNamespaceError):
            store.batch([op])
    assert store.list_namespaces() == []


def test_list_namespaces_with_prefix_suffix_wildcards_depth_and_pages(store: KeelStore) -> None:
    for namespace in [
        ("a", "b", "c"),
        ("a", "b", "d", "e"),
        ("a", "b", "d", "i"),
        ("a", "b", "f"),
        ("a", "c", "f"),
        ("x", "f"),
    ]:
        store.put(namespace, "k", {"v": 1})
    assert store.list_namespaces(prefix=("a", "b"), max_depth=3) == [
        ("a", "b", "c"),
        ("a", "b", "d"),
        ("a", "b", "f"),
    ]
    assert store.list_namespaces(prefix=("a", "b")) == [
        ("a", "b", "c"),
        ("a", "b", "d", "e"),
        ("a", "b", "d", "i"),
        ("a", "b", "f"),
    ]
    assert store.list_namespaces(suffix=("f",)) == [("a", "b", "f"), ("a", "c", "f"), ("x", "f")]
    assert store.list_namespaces(prefix=("a",), suffix=("f",)) == [
        ("a", "b", "f"),
        ("a", "c", "f"),
    ]
    assert store.list_namespaces(prefix=("a", "*", "f")) == [("a", "b", "f"), ("a", "c", "f")]
    assert store.list_namespaces(suffix=("d", "*")) == [("a", "b", "d", "e"), ("a", "b", "d", "i")]
    assert store.list_namespaces(prefix=("*",), max_depth=1) == [("a",), ("x",)]
    assert store.list_namespaces(prefix=("a",), limit=2, offset=1) == [
        ("a", "b", "d", "e"),
        ("a", "b", "d", "i"),
    ]
    assert store.list_namespaces(prefix=("*", "b", "*", "*", "*")) == []


# --- search ---------------------------------------------------------------------------------

RECIPES = {
    "risotto": {"text": "mushroom risotto needs arborio rice and stock", "course": "main"},
    "salad": {"text": "a green salad with lemon dressing", "course": "starter", "minutes": 5},
    "soup": {"text": "mushroom soup with cream", "course": "starter", "minutes": 30},
    "cake": {"text": "chocolate cake with dark chocolate", "course": "dessert", "minutes": 60},
}


def _put_recipes(store: KeelStore) -> None:
    for key, value in RECIPES.items():
        store.put(("recipes",), key, value)
    store.put(("other",), "mushrooms", {"text": "mushroom mushroom mushroom"})


def test_a_query_ranks_the_relevant_item_first_before_and_after_vectors(
    store: KeelStore, memory: Memory
) -> None:
    _put_recipes(store)
    # Keyword search works at once; the vectors come from the outbox.
    assert _keys(store.search(("recipes",), query="chocolate dessert")) == ["cake"]
    memory.flush()
    found = store.search(("recipes",), query="mushroom risotto rice")
    assert found[0].key == "risotto"
    assert found[1].key == "soup"  # shares "mushroom"
    scores = [item.score for item in found]
    assert all(score is not None for score in scores)
    assert scores == sorted(scores, reverse=True)  # type: ignore[type-var]
    # The namespace prefix applies to a query too ("other" holds the best keyword match).
    assert "mushrooms" not in _keys(store.search(("recipes",), query="mushroom"))
    assert _keys(store.search(("other",), query="mushroom")) == ["mushrooms"]


def test_a_query_respects_filter_limit_and_offset(store: KeelStore, memory: Memory) -> None:
    _put_recipes(store)
    memory.flush()
    ranked = _keys(store.search(("recipes",), query="mushroom salad lemon cream"))
    assert set(ranked) == {"salad", "soup", "risotto"}
    assert _keys(store.search(("recipes",), query="mushroom salad lemon cream", limit=1)) == [
        ranked[0]
    ]
    assert _keys(
        store.search(("recipes",), query="mushroom salad lemon cream", limit=1, offset=1)
    ) == [ranked[1]]
    starters = store.search(("recipes",), query="mushroom", filter={"course": "starter"})
    assert _keys(starters) == ["soup"]
    assert _keys(
        store.search(("recipes",), query="cream lemon", filter={"minutes": {"$gte": 30, "$lt": 60}})
    ) == ["soup"]


def test_without_a_query_items_come_newest_first_filtered_and_paged(store: KeelStore) -> None:
    _put_recipes(store)
    assert _keys(store.search(("recipes",))) == ["cake", "soup", "salad", "risotto"]
    assert _keys(store.search(("recipes",), limit=2, offset=1)) == ["soup", "salad"]
    assert _keys(store.search(("recipes",), filter={"course": "starter"})) == ["soup", "salad"]
    assert _keys(store.search(("recipes",), filter={"minutes": {"$gt": 5}})) == ["cake", "soup"]
    assert _keys(store.search(("recipes",), filter={"minutes": {"$ne": 5}})) == [
        "cake",
        "soup",
        "risotto",
    ]
    assert _keys(store.search(("recipes",), filter={"course": "starter"}, offset=1)) == ["salad"]
    assert all(item.score is None for item in store.search(("recipes",)))
    store.put(("recipes",), "salad", {**RECIPES["salad"], "minutes": 6})  # updated: newest now
    assert _keys(store.search(("recipes",), limit=1)) == ["salad"]


def test_index_false_and_index_fields_decide_what_a_query_finds(
    memory: Memory, clock: FakeClock
) -> None:
    store = KeelStore(memory, tenant="acme", fields=["title"], clock=clock)
    store.put(("docs",), "titled", {"title": "volcano survey", "body": "glacier notes"})
    store.put(("docs",), "hidden", {"title": "volcano secrets"}, index=False)
    store.put(("docs",), "body", {"title": "untitled", "body": "volcano diary"}, index=["body"])
    store.put(("docs",), "nothing", {"body": "volcano"})  # no title: nothing to search
    memory.flush()
    assert sorted(_keys(store.search(("docs",), query="volcano"))) == ["body", "titled"]
    assert _keys(store.search(("docs",), query="glacier")) == []
    # What a query cannot find is still there by key and in listings.
    assert store.get(("docs",), "hidden") is not None
    assert sorted(_keys(store.search(("docs",)))) == ["body", "hidden", "nothing", "titled"]


# --- TTL ------------------------------------------------------------------------------------


def test_ttl_expires_items_and_reads_refresh_it(
    store: KeelStore, memory: Memory, clock: FakeClock
) -> None:
    store.put(("cache",), "short", {"text": "short lived answer"}, ttl=1)
    store.put(("cache",), "kept", {"text": "kept answer"})
    clock.advance(0.8)
    assert store.get(("cache",), "short") is not None  # and its TTL restarts
    clock.advance(0.8)
    assert store.get(("cache",), "short", refresh_ttl=False) is not None
    clock.advance(0.3)  # 1.1 minutes after the last refreshing read
    assert store.get(("cache",), "short") is None
    assert _keys(store.search(("cache",))) == ["kept"]
    assert _keys(store.search(("cache",), query="answer")) == ["kept"]
    assert store.list_namespaces() == [("cache",)]
    store.put(("gone",), "k", {"text": "x"}, ttl=1)
    clock.advance(2)
    assert store.list_namespaces() == [("cache",)]
    clock.advance(60 * 24 * 365)
    assert store.get(("cache",), "kept") is not None  # no TTL: never expires

    assert store.sweep_ttl() == 2
    assert memory.store.count(store.scope) == 1


def test_a_search_refreshes_only_what_it_returns_and_only_when_asked(
    store: KeelStore, clock: FakeClock
) -> None:
    store.put(("cache",), "a", {"text": "alpha"}, ttl=1)
    store.put(("cache",), "b", {"text": "beta"}, ttl=1)
    clock.advance(0.8)
    # One hit (the vectors, made by the search, would add "b" behind it).
    assert _keys(store.search(("cache",), query="alpha", limit=1)) == ["a"]
    assert _keys(store.search(("cache",), filter={"text": "beta"}, refresh_ttl=False)) == ["b"]
    clock.advance(0.8)
    assert store.get(("cache",), "a", refresh_ttl=False) is not None
    assert store.get(("cache",), "b", refresh_ttl=False) is None


def test_ttl_config_gives_a_default_ttl_and_can_turn_refresh_off(
    memory: Memory, clock: FakeClock
) -> None:
    store = KeelStore(
        memory, tenant="acme", ttl={"default_ttl": 1, "refresh_on_read": False}, clock=clock
    )
    store.put(("cache",), "k", {"text": "x"})
    store.put(("cache",), "forever", {"text": "y"}, ttl=None)
    clock.advance(0.8)
    assert store.get(("cache",), "k") is not None  # no refresh by default
    clock.advance(0.4)
    assert store.get(("cache",), "k") is None
    assert store.get(("cache",), "forever") is not None


def test_deleting_an_expired_item_removes_its_record_at_once(
    store: KeelStore, memory: Memory, clock: FakeClock
) -> None:
    store.put(("cache",), "k", {"text": "expired but not swept"}, ttl=1)
    clock.advance(2)
    store.delete(("cache",), "k")
    assert memory.store.count(store.scope) == 0
    assert store.sweep_ttl() == 0


def test_a_put_over_an_expired_item_starts_a_new_one(store: KeelStore, clock: FakeClock) -> None:
    store.put(("cache",), "k", {"text": "old"}, ttl=1)
    first = store.get(("cache",), "k")
    clock.advance(5)
    store.put(("cache",), "k", {"text": "new"})
    item = store.get(("cache",), "k")
    assert first is not None and item is not None and item.value == {"text": "new"}
    assert item.created_at > first.created_at


# --- privacy and isolation ------------------------------------------------------------------


def _stored_bytes(backend: str) -> bytes:
    """Everything the database holds, as it lies on disk (SQLite) or in the rows (PostgreSQL)."""
    if backend.startswith("postgresql://"):
        with psycopg.connect(backend) as conn:
            rows = conn.execute(
                "SELECT text, metadata::text, coalesce(key, '') FROM memory_records"
            ).fetchall()
        return repr(rows).encode()
    files = [Path(backend), Path(backend + "-wal")]
    return b"".join(path.read_bytes() for path in files if path.exists())


def test_pii_is_masked_before_it_reaches_the_database(
    store: KeelStore, memory: Memory, backend: str
) -> None:
    store.put(
        ("contacts",),
        "ada",
        {"text": f"write to {EMAIL} or call {PHONE}", "details": {"phones": [PHONE]}},
    )
    memory.flush()
    item = store.get(("contacts",), "ada")
    assert item is not None
    assert item.value == {
        "text": "write to <EMAIL_1> or call <PHONE_1>",
        "details": {"phones": ["<PHONE_1>"]},
    }
    raw = _stored_bytes(backend)
    assert b"<EMAIL_1>" in raw
    for secret in (EMAIL, PHONE, PHONE.replace(" ", "")):
        assert secret.encode() not in raw
    # A filter naming the value is masked the same way, so it still finds the item.
    assert _keys(store.search(("contacts",), filter={"details": {"phones": [PHONE]}})) == ["ada"]
    assert _keys(store.search(("contacts",), query=f"call {PHONE}")) == ["ada"]


def test_namespaces_and_keys_are_identifiers_never_masked_into_one(store: KeelStore) -> None:
    # Masked, both phone numbers would be "<PHONE_1>" and both emails "<EMAIL_1>".
    store.put(("users", PHONE), "contact", {"n": 1})
    store.put(("users", "+1 415 555 0100"), "contact", {"n": 2})
    store.put(("keys",), EMAIL, {"n": 3})
    store.put(("keys",), "bob@example.com", {"n": 4})
    for namespace, key, n in ((("users", PHONE), "contact", 1), (("keys",), EMAIL, 3)):
        item = store.get(namespace, key)
        assert item is not None
        assert (item.namespace, item.key, item.value) == (namespace, key, {"n": n})
    assert store.list_namespaces(prefix=("users",)) == [
        ("users", "+1 415 555 0100"),
        ("users", PHONE),
    ]
    assert sorted(_keys(store.search(("keys",)))) == ["ada.lovelace@example.com", "bob@example.com"]


def test_tenants_and_users_never_see_each_other(memory: Memory, clock: FakeClock) -> None:
    acme = KeelStore(memory, tenant="acme", clock=clock)
    globex = KeelStore(memory, tenant="globex", clock=clock)
    acme_bob = KeelStore(memory, tenant="acme", user="bob", clock=clock)
    for store, owner in ((acme, "acme"), (globex, "globex"), (acme_bob, "bob")):
        store.put(("notes",), "plan", {"text": f"secret launch plan of {owner}"})
    memory.flush()
    for store, owner in ((acme, "acme"), (globex, "globex"), (acme_bob, "bob")):
        item = store.get(("notes",), "plan")
        assert item is not None and item.value["text"].endswith(owner)
        assert [i.value["text"] for i in store.search(("notes",))] == [item.value["text"]]
        hits = store.search(("notes",), query="secret launch plan")
        assert [i.value["text"] for i in hits] == [item.value["text"]]
        assert store.list_namespaces() == [("notes",)]
    globex.delete(("notes",), "plan")
    assert globex.get(("notes",), "plan") is None
    assert acme.get(("notes",), "plan") is not None
    assert acme_bob.get(("notes",), "plan") is not None


# --- async and batches ----------------------------------------------------------------------


async def test_async_twins(store: KeelStore, memory: Memory, clock: FakeClock) -> None:
    await store.aput(("notes", "ada"), "k1", {"text": "prefers window seats"})
    await store.aput(("notes", "ada"), "k2", {"text": "flies to Lisbon"}, ttl=1)
    item = await store.aget(("notes", "ada"), "k1")
    assert item is not None and item.value == {"text": "prefers window seats"}
    await memory.aflush()
    assert _keys(await store.asearch(("notes",), query="window seats")) == ["k1"]
    assert _keys(await store.asearch(("notes",))) == ["k2", "k1"]
    assert await store.alist_namespaces(prefix=("notes",)) == [("notes", "ada")]
    await store.adelete(("notes", "ada"), "k1")
    clock.advance(2)
    assert await store.aget(("notes", "ada"), "k1") is None
    assert await store.aget(("notes", "ada"), "k2") is None
    assert await store.asweep_ttl() == 1
    results = await store.abatch(
        [
            PutOp(("b",), "k", {"text": "batched"}),
            GetOp(("b",), "k"),
            SearchOp(("b",)),
            ListNamespacesOp(),
        ]
    )
    assert results[0] is None
    assert results[1] is not None and results[1].value == {"text": "batched"}  # type: ignore[union-attr]
    assert _keys(results[2]) == ["k"]  # type: ignore[arg-type]
    assert results[3] == [("b",)]


def test_a_batch_runs_its_ops_in_order(store: KeelStore) -> None:
    results = store.batch(
        [
            PutOp(("b",), "k", {"v": 1}),
            PutOp(("b",), "k", {"v": 2}),
            GetOp(("b",), "k"),
            PutOp(("b",), "k", None),
            GetOp(("b",), "k"),
        ]
    )
    assert results[2] is not None and results[2].value == {"v": 2}  # type: ignore[union-attr]
    assert results[4] is None


# --- in a LangGraph graph -------------------------------------------------------------------


class _State(TypedDict, total=False):
    user: str
    note: str
    recalled: list[str]


def _remember(state: _State, *, store: BaseStore) -> _State:
    store.put(("memories", state["user"]), "latest", {"text": state["note"]})
    return {}


def _recall(state: _State, *, store: BaseStore) -> _State:
    items = store.search(("memories", state["user"]), query=state["note"])
    return {"recalled": [item.value["text"] for item in items]}


async def _arecall(state: _State, *, store: BaseStore) -> _State:
    items = await store.asearch(("memories", state["user"]), query=state["note"])
    return {"recalled": [item.value["text"] for item in items]}


def _graph(store: KeelStore, recall: Any, remember: Any = _remember, state: Any = _State) -> Any:
    """A graph of two nodes on ``store``: ``remember``, then ``recall``."""
    builder = StateGraph(state)
    builder.add_node("remember", remember)
    builder.add_node("recall", recall)
    builder.add_edge(START, "remember")
    builder.add_edge("remember", "recall")
    builder.add_edge("recall", END)
    return builder.compile(store=store)


def test_a_compiled_graph_writes_and_reads_through_the_store(store: KeelStore) -> None:
    result = _graph(store, _recall).invoke({"user": "ada", "note": f"likes jazz, mail {EMAIL}"})
    assert result["recalled"] == ["likes jazz, mail <EMAIL_1>"]
    item = store.get(("memories", "ada"), "latest")
    assert item is not None and item.value == {"text": "likes jazz, mail <EMAIL_1>"}
    assert store.list_namespaces(prefix=("memories",)) == [("memories", "ada")]


async def test_a_compiled_graph_runs_on_the_async_api(store: KeelStore) -> None:
    graph = _graph(store, _arecall)
    await graph.ainvoke({"user": "ada", "note": "likes jazz"})
    result = await graph.ainvoke({"user": "bob", "note": "likes opera"})
    assert result["recalled"] == ["likes opera"]
    assert await store.alist_namespaces(prefix=("memories",)) == [
        ("memories", "ada"),
        ("memories", "bob"),
    ]


class _Notes(TypedDict, total=False):
    notes: dict[str, str]
    question: str
    found: list[str]


def _put_notes(state: _Notes, *, store: BaseStore) -> _Notes:
    for key, text in state["notes"].items():
        store.put(("notes", "ada"), key, {"text": text})
    return {}


def _ask(state: _Notes, *, store: BaseStore) -> _Notes:
    return {"found": [item.key for item in store.search(("notes",), query=state["question"])]}


@pytest.mark.parametrize("worker", [False, True], ids=["no-worker", "background-worker"])
def test_a_search_right_after_a_put_finds_it_by_meaning(
    backend: str, minilm: OnnxEmbedder, worker: bool
) -> None:
    """Read-your-writes: a node searches for what the node before it put, by meaning alone
    (no word in common), whether or not the outbox has embedded it yet; a put still returns
    before its vector is made."""
    memory = Memory(_memory_store(backend), embedder=minilm, background=worker)
    store = KeelStore(memory, tenant="acme")
    graph = _graph(store, _ask, remember=_put_notes, state=_Notes)
    notes = {"pay": "Ada's salary went up to 90k this year", "pet": "Ada has a cat, Turing"}
    try:
        result = graph.invoke({"notes": notes, "question": "money earnings"})
        assert result["found"][:1] == ["pay"]
        if not worker:  # nothing else embeds: the put left its record waiting
            store.put(("notes", "ada"), "trip", {"text": "Ada flies to Lisbon on Friday"})
            assert memory.pending() == 1, "a put waited for its embedding"
            result = graph.invoke({"notes": {}, "question": "travel plans"})
            assert result["found"][:1] == ["trip"] and memory.pending() == 0
    finally:
        memory.close()
