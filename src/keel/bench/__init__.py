"""Benchmark harnesses behind ``keel bench ...``; each prints its figures."""
