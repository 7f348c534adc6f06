"""Independent commands run a few at a time (their results read later by the tests)."""

from __future__ import annotations

import subprocess
from collections.abc import Hashable
from concurrent.futures import ThreadPoolExecutor


def run_concurrently(
    jobs: dict[Hashable, tuple[list[str], dict]], workers: int, timeout: float
) -> dict[Hashable, subprocess.CompletedProcess]:
    """Each job is (argv, environment); every command runs to completion (or its timeout,
    which raises) with at most ``workers`` at once."""

    def run(job):
        argv, env = job
        return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)

    with ThreadPoolExecutor(workers) as pool:
        return dict(zip(jobs, pool.map(run, jobs.values())))
