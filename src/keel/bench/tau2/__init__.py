"""keel bench tau2."""
