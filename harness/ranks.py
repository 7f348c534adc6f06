"""Run one function on N spawned processes that meet on a gloo rendezvous port, and
collect what each returns."""

from __future__ import annotations

import time
import traceback

import torch.multiprocessing as mp

from harness.ports import free_ports


def _report(target, rank: int, world: int, port: int, payload, queue) -> None:
    try:
        queue.put(target(rank, world, port, payload))
    except BaseException as exc:  # reported to the parent, which fails on it
        queue.put({"rank": rank, "error": f"{exc!r}\n{traceback.format_exc()}"})


def spawn_ranks(target, world: int, payload, timeout: float = 600) -> list[dict]:
    """``target(rank, world, port, payload)`` (a module-level function returning a dict with
    "rank") on ``world`` spawned processes; their results by rank. A rank that raised gives
    {"rank", "error"} and the collection stops there: the others may wait for it forever."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    # below the ephemeral range: a kernel-chosen port may be taken by an outgoing connection
    # of a concurrent test before rank 0 binds it (seen: the other ranks then retry for 30 min)
    port = free_ports(1)
    procs = [ctx.Process(target=_report, args=(target, r, world, port, payload, queue)) for r in range(world)]
    for p in procs:
        p.start()
    out = []
    deadline = time.monotonic() + timeout
    try:
        for _ in procs:
            out.append(queue.get(timeout=max(1.0, deadline - time.monotonic())))
            if "error" in out[-1]:
                break
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return sorted(out, key=lambda r: r["rank"])
