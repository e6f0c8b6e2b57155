"""Harnesses behind the ``keel bench ...`` commands."""
