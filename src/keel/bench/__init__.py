"""Benchmark harnesses behind ``keel bench ...``."""
