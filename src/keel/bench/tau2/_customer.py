"""The scripted customer of ``keel bench tau2``: it says why it calls and what it knows, in
its own words (the task's user scenario turned to the first person), confirms each action the
agent asks it to confirm, and asks the agent to go on when it is left waiting."""

from __future__ import annotations

import re

from keel.bench.tau2._data import Task
from keel.bench.tau2._oracle import CONFIRM, FINAL

__all__ = ["GO_ON", "YES", "first_message", "next_message"]

YES = "yes"
GO_ON = "Could you check where that stands and carry on, please?"

_FIRST_PERSON = (
    (r"\bYou name is\b", "My name is"),
    (r"\b(asks|ask|tell|tells|give|gives|to|for|with|help|sends|send) you\b", r"\1 me"),
    (r"\bYou are\b", "I am"),
    (r"\byou are\b", "I am"),
    (r"\bYou're\b", "I'm"),
    (r"\byou're\b", "I'm"),
    (r"\bYou'd\b", "I'd"),
    (r"\byou'd\b", "I'd"),
    (r"\byourself\b", "myself"),
    (r"\bYour\b", "My"),
    (r"\byour\b", "my"),
    (r"\bYou\b", "I"),
    (r"\byou\b", "I"),
)


def _own_words(text: str) -> str:
    for pattern, replacement in _FIRST_PERSON:
        text = re.sub(pattern, replacement, text)
    return text


def first_message(task: Task) -> str:
    """What the customer opens with: who it is, then why it calls (values kept verbatim)."""
    parts = [_own_words(task.known_info.strip()), _own_words(task.reason_for_call.strip())]
    return "Hi. " + " ".join(part for part in parts if part)


def next_message(reply: str) -> str | None:
    """The customer's answer to the agent's reply; None when the conversation is over."""
    if reply.strip() == FINAL:
        return None
    if reply.rstrip().endswith(CONFIRM):
        return YES
    return GO_ON
