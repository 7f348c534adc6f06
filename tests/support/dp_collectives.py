"""Reading back what the collective recorder (``harness/doubles/collective_recorder/sitecustomize.py``)
wrote for a DP deployment, and the checks every DP test makes on it.

A *step* of a rank starts at its metadata all-reduce: Model Runner V2's
``int32[ROWS, dp]`` on the DP group (upstream's ``vllm/v1/worker/gpu/dp_utils.py``). A rank's
collectives on groups that span DP replicas (DP, EP, world), from its first metadata
all-reduce on and split into steps, must be the same (op, dtype, group size) on every
member of its DP group, with exactly one metadata collective per step. Idle ranks' dummy
steps are steps like any other, so they are compared too.
"""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from pathlib import Path

from harness.doubles import COLLECTIVE_RECORDER

# Model Runner V2 agrees on a step in one all-reduce (tokens, graph mode, uniform length,
# query length, micro-batching, requests, draft skipping)
ROWS = 7
# upstream's V1 runner's int32[4, dp] exchange, which nothing may issue besides
V1_ROWS = 4
RECORDER_DIR = COLLECTIVE_RECORDER


def recorder_env(out: Path) -> dict:
    """Environment for ``vllm serve`` that records every process's collectives under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    path = os.pathsep.join(p for p in (str(RECORDER_DIR), os.environ.get("PYTHONPATH", "")) if p)
    return {"VLLM_ASCEND_TEST_COLLECTIVES": str(out), "PYTHONPATH": path}


def read(out: Path) -> dict[int, list[dict]]:
    """Global rank -> its collectives in order (processes outside a torch.distributed world,
    such as API servers, record nothing the checks use)."""
    by_rank: dict[int, list[dict]] = defaultdict(list)
    for file in sorted(out.glob("*.jsonl")):
        for line in file.read_text().splitlines():
            entry = json.loads(line)
            if entry["rank"] is not None and entry["ranks"] is not None:
                by_rank[entry["rank"]].append(entry)
    return dict(by_rank)


def _metadata(entry: dict, dp: int, rows: int) -> bool:
    return (
        entry["op"] == "all_reduce"
        and entry["dtype"] == "torch.int32"
        and entry["shape"] == [rows, dp]
        and len(entry["ranks"]) == dp
    )


def steps(entries: list[dict], dp: int, replica: int, rows: int = ROWS) -> list[list[tuple]]:
    """A rank's steps, each the (op, dtype, group size) of its collectives that span DP
    replicas (``replica`` global ranks each), metadata first. Collectives inside one
    replica (its TP group: e.g. gathering logits to sample, which a dummy step does not do)
    are that replica's own business."""
    out: list[list[tuple]] = []
    for entry in entries:
        if _metadata(entry, dp, rows):
            out.append([])
        if out and len({rank // replica for rank in entry["ranks"]}) > 1:
            out[-1].append((entry["op"], entry["dtype"], len(entry["ranks"])))
    return out


def check(out: Path, dp: int, rows: int = ROWS) -> dict[int, int]:
    """Assert the one-collective rule on a recorded run; return global rank -> steps."""
    by_rank = read(out)
    assert by_rank, f"the recorder wrote nothing under {out}"
    counts = {}
    groups: dict[tuple, list[int]] = defaultdict(list)
    for rank, entries in by_rank.items():
        extra = [e for e in entries if _metadata(e, dp, V1_ROWS)]
        assert not extra, f"rank {rank} issued {len(extra)} int32[{V1_ROWS}, dp] DP metadata all-reduces too"
        packed = [e for e in entries if _metadata(e, dp, rows)]
        assert packed, f"rank {rank} issued no DP metadata all-reduce"
        groups[tuple(packed[0]["ranks"])].append(rank)
        counts[rank] = len(packed)
    for members, ranks in groups.items():
        assert sorted(ranks) == sorted(members), f"DP group {members} recorded only ranks {sorted(ranks)}"
        replica = members[1] - members[0]  # global rank = DP rank x ranks per replica + local rank
        sequences = {rank: steps(by_rank[rank], dp, replica, rows) for rank in ranks}
        first, *others = ranks
        for rank in others:
            a, b = sequences[first], sequences[rank]
            assert len(a) == len(b), f"ranks {first} and {rank} ran {len(a)} and {len(b)} steps"
            for index, (x, y) in enumerate(zip(a, b)):
                assert x == y, (
                    f"step {index}: rank {first} issued {x}, rank {rank} issued {y} "
                    "(the DP ranks' collectives went out of step)"
                )
    return counts


def step_counts(out: Path, dp: int, rows: int = ROWS) -> dict[int, int]:
    """Global rank -> metadata all-reduces recorded so far (cheap; for windows of a run)."""
    return {rank: sum(_metadata(e, dp, rows) for e in entries) for rank, entries in read(out).items()}


def settle(out: Path, quiet: float = 1.0, timeout: float = 30.0) -> None:
    """Wait until no process has recorded anything for ``quiet`` seconds (the ranks' last
    steps are complete), so a check made while the instance is up sees whole steps."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        now = sum(f.stat().st_size for f in out.glob("*.jsonl"))
        if now == last:
            return
        last = now
        time.sleep(quiet)
    raise AssertionError(f"the ranks kept issuing collectives for {timeout} s after the requests finished")
