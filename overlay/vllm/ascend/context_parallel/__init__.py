"""Context parallelism (PCP and DCP): the KV placement rule, the per-step token split."""
