"""Helpers the test tiers import (plain modules, no fixtures): ports, prompts, tiny
models, the transformers oracle, engine runners; and the multi-process programs the
tests and benchmarks start (``vllm_runner``, ``moe_ranks``)."""
