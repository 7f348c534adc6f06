"""Python stacks of a process tree, printed when a shutdown takes too long.

A process stuck in a C call (a collective, a socket wait) never runs Python's SIGTERM
handler and logs nothing before it is force-killed; ``py-spy dump`` reads its stacks
from outside, without its cooperation.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import psutil

MARKER = "[shutdown-stacks]"


def _py_spy() -> str | None:
    beside = Path(sys.executable).with_name("py-spy")
    return str(beside) if beside.exists() else shutil.which("py-spy")


def dump_stacks(root_pid: int, include_root: bool = False) -> str:
    """The Python stacks of ``root_pid``'s descendants (and of itself if asked), each line
    prefixed with ``MARKER`` so a test can find them in a mixed log."""
    exe = _py_spy()
    if exe is None:
        return f"{MARKER} py-spy is not installed: no stacks"
    try:
        root = psutil.Process(root_pid)
        procs = ([root] if include_root else []) + root.children(recursive=True)
    except psutil.NoSuchProcess:
        return f"{MARKER} process {root_pid} is gone"
    out = []
    for proc in procs:
        try:
            dump = subprocess.run(
                [exe, "dump", "--pid", str(proc.pid)], capture_output=True, text=True, timeout=30
            )
            text = dump.stdout or dump.stderr
        except (subprocess.TimeoutExpired, OSError) as e:
            text = f"py-spy failed: {e}"
        out += [f"{MARKER} {line}" for line in text.splitlines()]
    return "\n".join(out)


@contextlib.contextmanager
def stacks_if_slow(root_pid: int, after: float, include_root: bool = False, out: Path | None = None):
    """Print the process tree's stacks (to stdout, or appended to ``out``) if the block has
    not finished ``after`` seconds in: before a shutdown's force-kill destroys the evidence."""

    def report() -> None:
        text = f"{MARKER} still shutting down after {after:.0f} s\n{dump_stacks(root_pid, include_root)}\n"
        if out is None:
            print(text, end="", flush=True)
        else:
            with open(out, "a") as f:
                f.write(text)

    timer = threading.Timer(after, report)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
