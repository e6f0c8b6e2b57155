"""Benchmark harnesses behind ``keel bench ...``: each returns the figures it measured."""
