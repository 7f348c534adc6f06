"""Upstream conformance: upstream vLLM's own test suite against this distribution's wheel."""
