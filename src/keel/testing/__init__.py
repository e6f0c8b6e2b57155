"""Test doubles and conformance suites that ship with keel, for keel's tests and users' own."""

from __future__ import annotations

from keel.models._scripted import ScriptedCall, ScriptedModel, ScriptedReply
from keel.testing._faults import FAULT_SCENARIOS, FaultRequest, FaultServer

__all__ = [
    "FAULT_SCENARIOS",
    "FaultRequest",
    "FaultServer",
    "ScriptedCall",
    "ScriptedModel",
    "ScriptedReply",
]
