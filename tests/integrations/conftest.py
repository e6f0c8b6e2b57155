"""Shared set-up of the integration tests."""

# anyio imports its subprocess module lazily, on the first open_process (the MCP SDK's stdio
# client). Under pytest that import goes through assertion rewriting, and CPython 3.11's
# ast.parse fails with "AST constructor recursion depth mismatch" when called that deep in an
# event loop's stack: import it here, at collection, instead.
import anyio._core._subprocesses  # noqa: F401

# all-MiniLM-L6-v2, loaded once per session: a search by meaning needs a real embedder.
from tests.memory.conftest import minilm  # noqa: F401
