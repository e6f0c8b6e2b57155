"""Benchmark harnesses behind ``keel bench ...``: each returns its figures as a dict."""
