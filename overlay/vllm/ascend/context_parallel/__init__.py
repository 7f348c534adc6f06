"""Context parallelism (PCP and DCP): the KV placement rule (``placement.py``), pure, which
the runner, the attention backends (their per-step split: ``attention/cp_step.py``) and
the P/D planner share; its start-up checks are the platform's (``platform/checks.py``)."""
