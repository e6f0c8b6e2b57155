"""Test doubles and conformance suites that ship with keel, for keel's tests and users' own."""

from __future__ import annotations

__all__: list[str] = []
