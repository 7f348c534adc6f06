"""DP step sync on gloo (``nox -s bench -- dp``): the per-step metadata collectives of
an MTP step, upstream's way (the runner's all-reduce of int32[4, dp] plus one per
drafter call: 1 for k=1, 2 for k>=2) vs. the platform's (one all-reduce of
int32[8, dp], the drafter answered from it: ``vllm/ascend/worker/dp_step.py``).

Each DP rank is a process; both ways run in the same processes, interleaved, through
upstream's own ``coordinate_batch_across_dp`` (its exchange hook set to an all-reduce of
upstream's table, then to the platform's StepSync). Printed: collectives
per step and the median / p99 time per step, and the ratio.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import time
from types import SimpleNamespace

import numpy as np


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(rank: int, world: int, port: int, k: int, steps: int, out) -> None:
    import torch
    import torch.distributed as dist

    from vllm.v1.worker import dp_utils

    from vllm.ascend.worker.dp_step import StepPlan, StepSync

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    config = SimpleNamespace(
        data_parallel_size=world,
        data_parallel_rank=rank,
        num_ubatches=2,
        disable_nccl_for_dp_synchronization=True,
    )
    counted = {"upstream": 0, "packed": 0}

    def upstream_exchange(unpadded, padded, ubatch, mode, _config, _purpose):
        # what upstream's _run_ar issues: this rank's column of int32[4, dp], all-reduced
        tensor = torch.zeros(4, world, dtype=torch.int32)
        tensor[:, rank] = torch.tensor([unpadded, padded, int(ubatch), mode], dtype=torch.int32)
        dist.all_reduce(tensor)
        counted["upstream"] += 1
        return tensor

    def coordinate(tokens: int, purpose: str):
        return dp_utils.coordinate_batch_across_dp(
            num_tokens_unpadded=tokens, allow_microbatching=False, parallel_config=config, purpose=purpose
        )

    def reduce(tensor, _config):
        dist.all_reduce(tensor)
        counted["packed"] += 1
        return tensor

    sync = StepSync(reduce)
    drafter_calls = 1 if k == 1 else 2
    timings = {"upstream": [], "packed": []}
    for step in range(steps + 10):  # 10 warm-up steps
        tokens = 16 + (step * 7 + rank * 3) % 48
        dist.barrier()
        dp_utils.set_dp_metadata_exchange(upstream_exchange)
        t0 = time.perf_counter()
        coordinate(tokens, "model")
        for _ in range(drafter_calls):
            coordinate(tokens, "drafter")
        t1 = time.perf_counter()
        dist.barrier()
        dp_utils.set_dp_metadata_exchange(sync)
        t2 = time.perf_counter()
        sync.arm(StepPlan(has_prefill=False, drafter_passes=k, drafter_first=tokens, drafter_rest=tokens))
        coordinate(tokens, "model")
        for _ in range(drafter_calls):
            coordinate(tokens, "drafter")
        sync.disarm()
        t3 = time.perf_counter()
        if step >= 10:
            timings["upstream"].append(t1 - t0)
            timings["packed"].append(t3 - t2)
    out.put((rank, {"timings": timings, "counted": counted, "steps": steps + 10}))
    dist.destroy_process_group()


def run(world: int, k: int, steps: int) -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _port()
    procs = [ctx.Process(target=rank_main, args=(r, world, port, k, steps, out)) for r in range(world)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(60)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dp", type=int, nargs="+", default=[2, 4])
    p.add_argument("--k", type=int, nargs="+", default=[1, 2])
    p.add_argument("--steps", type=int, default=500)
    args = p.parse_args()
    print(
        "| DP | MTP k | collectives per step, upstream | packed | upstream ms p50 / p99 | packed ms p50 / p99 "
        "| packed / upstream (p50) |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for world in args.dp:
        for k in args.k:
            results = run(world, k, args.steps)
            r0 = results[0]
            per_step = {name: r0["counted"][name] / r0["steps"] for name in ("upstream", "packed")}
            up = np.asarray(r0["timings"]["upstream"]) * 1e3
            pk = np.asarray(r0["timings"]["packed"]) * 1e3
            print(
                f"| {world} | {k} | {per_step['upstream']:.0f} | {per_step['packed']:.0f} "
                f"| {np.median(up):.3f} / {np.percentile(up, 99):.3f} "
                f"| {np.median(pk):.3f} / {np.percentile(pk, 99):.3f} | {np.median(pk) / np.median(up):.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
