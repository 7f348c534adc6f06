"""Free TCP ports on 127.0.0.1 for the processes a test starts."""

from __future__ import annotations

import contextlib
import random
import socket
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_HANDED_OUT: set[int] = set()


def free_ports(count: int) -> int:
    """The first of ``count`` consecutive free ports on 127.0.0.1, below the kernel's
    ephemeral range (P/D control planes use ``kv_port + rank`` and bind them only after
    the model has loaded: a port from the ephemeral range may be taken by then by any
    outgoing connection or by a library asking the kernel for a free port)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    low = min(low, 32768)
    for _ in range(200):
        first = random.randrange(20000, low - count)
        if _HANDED_OUT.intersection(range(first, first + count)):
            continue  # given to an instance of this session that may not have bound it yet
        try:
            with contextlib.ExitStack() as stack:
                for port in range(first, first + count):
                    s = stack.enter_context(socket.socket())
                    s.bind(("127.0.0.1", port))
            _HANDED_OUT.update(range(first, first + count))
            return first
        except OSError:
            continue
    raise RuntimeError(f"no {count} consecutive free ports between 20000 and {low}")
