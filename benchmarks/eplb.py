"""Expert-parallel load balancing (EPLB): per-rank expert load before and after a
rearrangement on a skewed routing trace, beside no EPLB, and what one rearrangement costs
(time, bytes moved) on gloo processes.

    nox -s bench -- eplb [--ep 4] [--experts 64] [--redundant 8] [--top-k 8] [--layers 4]
                         [--tokens 8192] [--skew 1.0] [--hidden 1024] [--inter 512]
                         [--repeats 3]

Load: each MoE layer routes ``--tokens`` tokens to top-k distinct experts drawn from a
Zipf-like popularity (expert of popularity rank r weighs 1/r^skew, a different order per
layer). Per EP rank the routes its experts receive; the table gives max/mean over ranks
(1.00 is perfect balance), averaged over layers, for: no EPLB (linear placement of the
logical experts), EPLB at start-up (upstream's initial map: the redundant slots replicate
the first experts), and EPLB after one rearrangement by upstream's default policy from
this trace's load, replayed on the same trace and on a fresh trace of the same
distribution. Routes go to replicas through ``vllm/ascend/moe/eplb.py`` (what the layers
run).

Cost: ``--ep`` gloo processes, each holding its physical experts' weights (bf16 gate/up and
down projections; and W8A8: int8 weights with float32 per-channel scales) for every layer,
run upstream's ``rearrange_expert_weights_inplace`` with the gloo communicator from the
start-up map to the rearranged one; the slowest rank's median time, the bytes that crossed
ranks, and a check that every slot then holds its new expert's weights. No EPLB moves
nothing (0 s, 0 bytes). Host time over gloo says nothing about HCCL on an NPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def routing_trace(layers: int, experts: int, top_k: int, tokens: int, skew: float, draws: int):
    """[layers, tokens, top_k] logical expert ids, Zipf-skewed per layer: the popularity
    order of each layer is fixed, ``draws`` seeds the tokens' routes."""
    import torch

    order = torch.Generator().manual_seed(0)
    g = torch.Generator().manual_seed(1 + draws)
    out = []
    for _ in range(layers):
        weight = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64) ** skew
        weight = weight[torch.randperm(experts, generator=order)]
        out.append(torch.multinomial(weight.expand(tokens, -1), top_k, replacement=False, generator=g))
    return torch.stack(out).to(torch.int32)


def initial_placement(experts: int, redundant: int):
    """Upstream's start-up map (the redundant slots replicate the first experts)."""
    import torch

    from vllm.distributed.eplb.eplb_state import EplbState

    return torch.tensor(EplbState.build_initial_global_physical_to_logical_map(experts, redundant))


def rank_balance(trace, placements, ep: int) -> float:
    """max/mean of the routes per EP rank, averaged over layers; ``placements``: each
    layer's physical-to-logical map (routes mapped to replicas by moe/eplb.py)."""
    from harness.moe_ranks import eplb_layer_state
    from vllm.ascend.moe.eplb import map_to_physical

    ratios = []
    for layer, placement in zip(trace, placements):
        state = eplb_layer_state(placement, layer.shape[0])
        map_to_physical(layer, state)
        per_rank = state.expert_load_view.view(ep, -1).sum(dim=1).double()
        ratios.append(float(per_rank.max() / per_rank.mean()))
    return statistics.mean(ratios)


def rearranged(trace, experts: int, redundant: int, ep: int, groups: int = 1):
    """Upstream's default policy's new placement for every layer from the trace's load."""
    import torch

    from vllm.distributed.eplb.policy.default import DefaultEplbPolicy

    load = torch.stack([torch.bincount(layer.flatten().long(), minlength=experts) for layer in trace])
    old = initial_placement(experts, redundant).expand(len(trace), -1).contiguous()
    return DefaultEplbPolicy.rebalance_experts(load, experts + redundant, groups, 1, ep, old)


def _weights(layer: int, logical: int, shapes, dtype, quantized: bool):
    """An expert's tensors, from its (layer, logical) id: the same on every rank."""
    import torch

    g = torch.Generator().manual_seed(layer * 100_003 + logical)
    out = []
    for rows, cols in shapes:
        if quantized:
            out.append(torch.randint(-128, 128, (rows * cols,), generator=g, dtype=torch.int8))
            out.append(torch.rand(rows, generator=g, dtype=torch.float32))
        else:
            out.append(torch.randn(rows * cols, generator=g).to(dtype))
    return out


def _move(rank: int, ep: int, port: int, job: dict) -> dict:
    """Runs in rank ``rank`` of ``ep``: one layer set's rearrangement, timed and checked."""
    import os

    os.environ.setdefault("VLLM_ASCEND_EMULATE", "1")
    import torch
    import torch.distributed as dist

    import vllm  # noqa: F401  (the Ascend platform: EPLB's events and stream come from it)
    from vllm.distributed.eplb.eplb_communicator import TorchDistGlooStagedEplbCommunicator
    from vllm.distributed.eplb.rebalance_execute import rearrange_expert_weights_inplace

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ep)
    old, new = torch.tensor(job["old"]), torch.tensor(job["new"])
    layers, physical = old.shape
    local = physical // ep
    mine = range(rank * local, (rank + 1) * local)
    dtype, quantized, shapes = getattr(torch, job["dtype"]), job["quantized"], job["shapes"]

    def fill(placement):
        per_layer = []
        for layer in range(layers):
            experts = [
                _weights(layer, int(placement[layer, slot]), shapes, dtype, quantized) for slot in mine
            ]
            per_layer.append([torch.stack([e[i] for e in experts]) for i in range(len(experts[0]))])
        return per_layer

    times, ok = [], True
    for _ in range(job["repeats"]):
        weights = fill(old)
        buffer = [torch.empty_like(w) for w in weights[0]]
        communicator = TorchDistGlooStagedEplbCommunicator(dist.group.WORLD)
        dist.barrier()
        t0 = time.perf_counter()
        rearrange_expert_weights_inplace(old, new, weights, buffer, dist.group.WORLD, communicator)
        dist.barrier()
        times.append(time.perf_counter() - t0)
        want = fill(new)
        ok = ok and all(torch.equal(a, b) for got, exp in zip(weights, want) for a, b in zip(got, exp))
    expert_bytes = sum(t[0].numel() * t.element_size() for t in weights[0])
    # slots this rank fills from another rank: their new expert is held nowhere on it before
    received = 0
    for layer in range(layers):
        held = {int(old[layer, s]) for s in mine}
        received += sum(1 for s in mine if int(new[layer, s]) not in held)
    dist.destroy_process_group()
    return {
        "rank": rank,
        "median_s": statistics.median(times),
        "ok": ok,
        "received_bytes": received * expert_bytes,
    }


def move_cost(old, new, ep: int, shapes, dtype: str, quantized: bool, repeats: int) -> dict:
    from harness.ranks import spawn_ranks

    job = {
        "old": old.tolist(),
        "new": new.tolist(),
        "shapes": shapes,
        "dtype": dtype,
        "quantized": quantized,
        "repeats": repeats,
    }
    results = spawn_ranks(_move, ep, job, timeout=900)
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        raise RuntimeError(errors[0])
    return {
        "seconds": max(r["median_s"] for r in results),
        "bytes": sum(r["received_bytes"] for r in results),
        "ok": all(r["ok"] for r in results),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ep", type=int, default=4)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--redundant", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--skew", type=float, default=1.0)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--inter", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if (args.experts + args.redundant) % args.ep or args.experts % args.ep:
        parser.error("--experts and --experts + --redundant must split evenly over --ep")

    e, r, ep = args.experts, args.redundant, args.ep
    print(
        f"EPLB: EP {ep}, {e} experts + {r} redundant, top-{args.top_k}, {args.layers} layers, "
        f"{args.tokens} tokens per layer, Zipf skew {args.skew}",
        flush=True,
    )
    trace = routing_trace(args.layers, e, args.top_k, args.tokens, args.skew, draws=0)
    fresh = routing_trace(args.layers, e, args.top_k, args.tokens, args.skew, draws=1)
    start = initial_placement(e, r).expand(args.layers, -1)
    new = rearranged(trace, e, r, ep)
    rows = [
        (
            "no EPLB (linear placement)",
            rank_balance(trace, initial_placement(e, 0).expand(args.layers, -1), ep),
        ),
        ("EPLB at start-up", rank_balance(trace, start, ep)),
        ("EPLB rearranged, same trace", rank_balance(trace, new, ep)),
        ("EPLB rearranged, fresh trace", rank_balance(fresh, new, ep)),
    ]
    print(f"\n{'placement':<32} {'max/mean load per rank':>24}")
    for name, value in rows:
        print(f"{name:<32} {value:>24.3f}")
    print(f"(ratio no EPLB / rearranged: {rows[0][1] / rows[2][1]:.2f}x)", flush=True)

    shapes = [[2 * args.inter, args.hidden], [args.hidden, args.inter]]
    print(f"\none rearrangement over gloo (hidden {args.hidden}, expert intermediate {args.inter}):")
    print(f"{'experts':<12} {'seconds':>9} {'MB moved':>10} {'contents':>9}")
    print(f"{'no EPLB':<12} {0.0:>9.3f} {0.0:>10.1f} {'-':>9}")
    for label, dtype, quantized in (("bf16", "bfloat16", False), ("W8A8", "bfloat16", True)):
        cost = move_cost(start, new, ep, shapes, dtype, quantized, args.repeats)
        print(
            f"{label:<12} {cost['seconds']:>9.3f} {cost['bytes'] / 2**20:>10.1f} "
            f"{'ok' if cost['ok'] else 'WRONG':>9}",
            flush=True,
        )
        if not cost["ok"]:
            sys.exit(f"EPLB bench: a {label} rearrangement left a slot with the wrong expert's weights")


if __name__ == "__main__":
    main()
