"""Helpers the test tiers import (plain modules, no fixtures): prompts, tiny models, the
transformers oracle, engine runners. What the benchmarks use too (the doubles, the
multi-process programs, free ports) is in ``harness/``."""
