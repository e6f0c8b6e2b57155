"""A writer process for the crash tests: ``python -m keel.testing._state_worker URL SESSION MODE``.

Each step commits a checkpoint holding the user message (``before_model_call``), "calls the
model", then commits the assistant reply (``after_transition``). It prints one line after each
commit so the parent knows what was committed when it sends SIGKILL. Modes: ``pause`` stops in
the first model call (the parent kills it there), ``run`` runs STEPS steps flat out, ``resume``
finishes an interrupted step and runs STEPS more; ``increment`` (``... increment N NAME``) is a
concurrent writer process for the lost-update test.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from keel.messages import Message
from keel.settings import load_settings
from keel.state import StateBackend, StateStore
from keel.stores import Backends
from keel.testing._state_models import ConversationState, CounterState


def expected_messages(step: int, pending_user: bool) -> list[str]:
    """The message contents a consistent state holds after ``step`` full exchanges."""
    contents: list[str] = []
    for k in range(1, step + 1):
        contents += [f"u{k}", f"a{k}"]
    if pending_user:
        contents.append(f"u{step + 1}")
    return contents


def state_backend_at(url: str, *, redis_prefix: str | None = None) -> StateBackend:
    """The state backend at ``url`` (SQLite, PostgreSQL or Redis), opened alone as keel opens
    it ([`Backends.open`][keel.stores.Backends.open] with ``only=("state",)``, whatever
    ``KEEL_REDIS_URL`` says; on Redis under ``redis_prefix``, default ``keel:state``): closing
    it closes its database."""
    opened = Backends.open(
        url, settings=load_settings(), only=("state",), redis_url="", state_prefix=redis_prefix
    )
    return opened.state.backend


def increment(url: str, session_id: str, count: int, name: str) -> int:
    """Add 1 to the counter and ``name:i`` to the items ``count`` times, with CAS and retry."""
    store = StateStore(state_backend_at(url), CounterState)
    print("ready", flush=True)
    sys.stdin.readline()  # wait for the parent's "go" so every process starts together
    for i in range(count):

        def bump(_state: CounterState, item: str = f"{name}:{i}") -> dict[str, Any]:
            return {"counter": 1, "items": [item]}

        store.transact(session_id, bump, max_attempts=10_000)
    store.close()
    print("done", flush=True)
    return 0


def main(argv: list[str]) -> int:
    url, session_id, mode = argv[0], argv[1], argv[2]
    steps = int(argv[3]) if len(argv) > 3 else 50
    if mode == "increment":
        return increment(url, session_id, steps, argv[4])
    store = StateStore(state_backend_at(url), ConversationState, snapshot_every=4)
    current = store.get(session_id)
    if current is None:
        current = store.create(session_id, ConversationState())
    version = current.version
    state = current.state
    print(f"ready {version}", flush=True)
    # A head taken before a model call resumes with that call, not by re-adding the message.
    pending = len(state.messages) % 2 == 1
    done = 0
    while done < steps:
        k = state.step + 1
        if not pending:
            state = state.model_copy(update={"messages": [*state.messages, Message.user(f"u{k}")]})
            version = store.checkpoint(
                session_id, state, expected_version=version, reason="before_model_call", step=k
            )
            print(f"checkpointed {version}", flush=True)
        pending = False
        if mode == "pause":
            time.sleep(60)  # the "model call": the parent kills the process here
        reply = Message.assistant(f"a{k}")
        result = store.update(
            session_id,
            {"messages": [reply], "step": k},
            expected_version=version,
            reason="after_transition",
            step=k,
        )
        version, state = result.version, result.state
        print(f"committed {version}", flush=True)
        done += 1
    store.close()
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
