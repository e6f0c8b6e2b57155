"""Test doubles and conformance suites that ship with keel, for keel's tests and users' own."""

from __future__ import annotations

from keel.models._scripted import ScriptedCall, ScriptedModel, ScriptedReply

__all__ = ["ScriptedCall", "ScriptedModel", "ScriptedReply"]
