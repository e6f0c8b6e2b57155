from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest

from keel.errors import ConfigError, ModelError
from keel.memory import (
    Memory,
    OpenAIEmbedder,
    Scope,
    SentenceTransformerEmbedder,
    embedder_from_spec,
)
from keel.stores import SQLiteMemoryStore


def _vector(text: str, dimension: int) -> list[float]:
    rng = np.random.default_rng(sum(text.encode()))
    return [float(x) for x in rng.normal(size=dimension)]


class _Handler(BaseHTTPRequestHandler):
    requests: ClassVar[list[dict[str, object]]] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append(
            {"path": self.path, "body": body, "auth": self.headers.get("Authorization")}
        )
        if body["model"] == "broken":
            self.send_response(400)
            payload = {"error": {"message": "bad model", "type": "invalid_request_error"}}
        else:
            self.send_response(200)
            inputs = body["input"]
            payload = {
                "object": "list",
                "model": body["model"],
                "data": [
                    {"object": "embedding", "index": i, "embedding": _vector(t, 8)}
                    for i, t in reversed(list(enumerate(inputs)))
                ],
                "usage": {"prompt_tokens": 1, "total_tokens": 1},
            }
        data = json.dumps(payload).encode()
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        return


@pytest.fixture
def embeddings_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _Handler.requests = []
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def test_openai_compatible_endpoint_over_real_http(embeddings_url: str, tmp_path: Path) -> None:
    embedder = OpenAIEmbedder(
        "toy-embed", dimension=8, base_url=embeddings_url, api_key="k1", batch_size=2
    )
    vectors = embedder.embed(["alpha", "beta", "gamma"])
    assert vectors.shape == (3, 8)
    expected = np.asarray(_vector("beta", 8), dtype=np.float32)
    assert np.allclose(vectors[1], expected / np.linalg.norm(expected), atol=1e-6)
    assert [r["path"] for r in _Handler.requests] == ["/v1/embeddings", "/v1/embeddings"]
    assert _Handler.requests[0]["auth"] == "Bearer k1"
    mem = Memory(SQLiteMemoryStore(tmp_path / "o.db"), embedder=embedder)
    scope = Scope(tenant_id="t", user_id="u")
    record = mem.add("gamma", scope=scope)
    mem.flush()
    assert mem.get(scope, record.id).embedding_model == "toy-embed"  # type: ignore[union-attr]
    mem.close()


def test_openai_endpoint_errors_are_translated(embeddings_url: str) -> None:
    embedder = OpenAIEmbedder("broken", dimension=8, base_url=embeddings_url, max_retries=0)
    with pytest.raises(ModelError, match="embeddings request failed"):
        embedder.embed(["x"])
    wrong = OpenAIEmbedder("toy", dimension=16, base_url=embeddings_url)
    with pytest.raises(ModelError, match="dimension"):
        wrong.embed(["x"])


def test_embedder_specs(embeddings_url: str) -> None:
    assert embedder_from_spec("hashing:64").dimension == 64
    spec = embedder_from_spec(f"openai-compatible:toy/8@{embeddings_url}")
    assert spec.name == "toy" and spec.embed(["a"]).shape == (1, 8)
    with pytest.raises(ConfigError):
        embedder_from_spec("openai:no-dimension")
    with pytest.raises(ConfigError):
        embedder_from_spec("nope:thing")


@pytest.mark.slow
def test_minilm_finds_meaning_not_just_words(
    minilm: SentenceTransformerEmbedder, tmp_path: Path
) -> None:
    assert minilm.name == "all-MiniLM-L6-v2" and minilm.dimension == 384
    mem = Memory(SQLiteMemoryStore(tmp_path / "s.db"), embedder=minilm)
    scope = Scope(tenant_id="t", user_id="u")
    dog = mem.add("I adopted a puppy from the shelter last week", scope=scope)
    mem.add("The quarterly tax filing is due in April", scope=scope)
    mem.add("My favourite colour is teal", scope=scope)
    mem.flush()
    hits = mem.search("Do I have any pets?", scope=scope, k=1)
    assert hits[0].record.id == dog.id and hits[0].keyword_rank is None
    mem.close()
