"""Independent commands run a few at a time (their results read later by the tests), and
the processes a test run left behind."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Hashable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def run_job(job: tuple[list[str], dict], timeout: float) -> subprocess.CompletedProcess:
    """One (argv, environment) job to completion, its output captured (its timeout raises)."""
    argv, env = job
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)


def run_concurrently(
    jobs: dict[Hashable, tuple[list[str], dict]], workers: int, timeout: float
) -> dict[Hashable, subprocess.CompletedProcess]:
    """Each job is (argv, environment); every command runs to completion (or its timeout,
    which raises) with at most ``workers`` at once."""
    with ThreadPoolExecutor(workers) as pool:
        return dict(zip(jobs, pool.map(lambda job: run_job(job, timeout), jobs.values())))


# -- processes a test run left behind ---------------------------------------------------
# Set once in the pytest controller; every process the tests start inherits it (engines,
# `vllm serve`, Ray, proxies), so what still carries it when the run ends was left behind.
RUN_MARK = "VLLM_ASCEND_TEST_RUN"


def mark_test_run() -> None:
    os.environ.setdefault(RUN_MARK, f"{os.getpid()}-{time.time_ns()}")


def leftover_processes() -> dict[int, str]:
    """pid -> command line of every process of this test run still alive, except this
    process and the pytest-xdist workers."""
    token = f"{RUN_MARK}={os.environ.get(RUN_MARK)}".encode()
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if token not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # exited meanwhile, or not ours to read
            continue
        if "pytest-xdist" in command or "execnet" in command or not command:
            continue
        found[int(entry.name)] = command
    return found


def kill_leftovers() -> dict[int, str]:
    """Kill (SIGKILL) what ``leftover_processes`` finds; returns what it found."""
    found = leftover_processes()
    for pid in found:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    return found
