"""MoE communication strategies on gloo (host emulation): bytes each rank sends and
median latency of one MoE layer per strategy, over token counts per rank and EP sizes,
with the selector's choice beside the measured fastest.

    nox -s bench -- moe [--tokens 1,4,16,64,256,1024,4096] [--ep 2,4] [--repeats 21]

Each EP size is one set of gloo processes (harness/moe_ranks.py; EP = DP, TP 1);
for every token count the strategies take turns on the same tokens (after one warm-up
call each), so they see the same machine conditions. Latency: the slowest rank's median.
AllToAll's bytes are compared with the routed minimum: per rank, the (token, expert)
rows it must send to other ranks' experts plus the expert outputs it must send back.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

STRATEGIES = ["allgather", "alltoall", "mc2"]
# Latencies within this fraction of the fastest count as a tie (the timer noise on a
# shared 2-core machine; printed with the table).
TIE = 0.10


def routed_minimum(case: dict, tokens: list[int]) -> list[int]:
    """Per rank: bytes of its rows bound for other ranks plus the rows it returns."""
    import torch

    from harness.moe_ranks import problem

    ep = len(tokens)
    local = case["experts"] // ep
    elem = torch.tensor([], dtype=getattr(torch, case.get("dtype", "float32"))).element_size()
    owners = [problem(case, n, rank)[2].to(torch.int64) // local for rank, n in enumerate(tokens)]
    out = []
    for rank in range(ep):
        outbound = int((owners[rank] != rank).sum())
        inbound = sum(int((owners[src] == rank).sum()) for src in range(ep) if src != rank)
        out.append((outbound + inbound) * case["hidden"] * elem)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="1,4,16,64,256,1024,4096")
    parser.add_argument("--ep", default="2,4")
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=4)
    args = parser.parse_args()

    from harness.moe_ranks import run
    from vllm.ascend.kernels import mc2 as mc2_kernels
    from vllm.ascend.moe import selector

    grid = [int(t) for t in args.tokens.split(",")]
    rows, exact, close, total = [], 0, 0, 0
    for ep in (int(e) for e in args.ep.split(",")):
        base = {
            "tp": 1,
            "dp": ep,
            "ep": True,
            "experts": args.experts,
            "top_k": args.top_k,
            "hidden": args.hidden,
            "inter": args.hidden // 2,
            "seed": 7,
        }
        case = {
            **base,
            "strategies": STRATEGIES,
            "tokens_grid": [[n] * ep for n in grid],
            "bench": {"repeats": args.repeats},
        }
        print(
            f"EP={ep}: {len(grid)} token counts x {len(STRATEGIES)} strategies x {args.repeats} repeats ...",
            flush=True,
        )
        results = run(case, timeout=3600)
        for rank in results:
            if "error" in rank:
                raise SystemExit(f"rank {rank['rank']} failed:\n{rank['error']}")
        measured: dict[tuple[str, int], dict] = {}
        for i in range(len(results[0]["results"])):
            per_rank = [rank["results"][i] for rank in results]
            key = (per_rank[0]["strategy"], per_rank[0]["tokens"][0])
            measured[key] = {
                "median_s": max(r["median_s"] for r in per_rank),
                "bytes": max(r["bytes_sent"] for r in per_rank),
            }
        lay = selector.MoELayout(
            expert_parallel=True,
            ep_size=ep,
            tp_size=1,
            num_experts=args.experts,
            top_k=args.top_k,
            hidden_size=args.hidden,
            soc="host",
            mc2_capacity=selector.mc2_capacity(256, 0, 1, "host"),
        )
        for n in grid:
            chosen = selector.select(n, lay).value
            timed = {s: measured[(s, n)] for s in STRATEGIES if (s, n) in measured}
            fastest = min(timed, key=lambda s: timed[s]["median_s"])
            total += 1
            exact += chosen == fastest
            close += timed[chosen]["median_s"] <= (1 + TIE) * timed[fastest]["median_s"]
            minimum = max(routed_minimum(base, [n] * ep))
            rows.append((ep, n, timed, chosen, fastest, minimum))

    print("\nmedian ms (bytes sent by the busiest rank)")
    header = (
        f"{'EP':>3} {'tokens/rank':>11} | "
        + " | ".join(f"{s:>20}" for s in STRATEGIES)
        + f" | {'a2a/min bytes':>13} | {'selector':>9} | {'fastest':>9}"
    )
    print(header)
    print("-" * len(header))
    for ep, n, timed, chosen, fastest, minimum in rows:
        cells = []
        for s in STRATEGIES:
            m = timed.get(s)
            cells.append(f"{m['median_s'] * 1e3:8.2f} ({m['bytes']:>9})" if m else f"{'n/a':>20}")
        ratio = timed["alltoall"]["bytes"] / minimum if minimum else float("nan")
        mark = "" if chosen == fastest else " *"
        print(
            f"{ep:>3} {n:>11} | " + " | ".join(cells) + f" | {ratio:13.3f} | {chosen:>9} | {fastest:>9}{mark}"
        )
    print(
        f"\nselector's choice is the fastest in {exact}/{total} cells ({100 * exact / total:.0f} %), "
        f"within {TIE:.0%} of the fastest in {close}/{total} ({100 * close / total:.0f} %); "
        f"mc2 n/a above {mc2_kernels.TOKENS_PER_RANK['host']} tokens per rank; "
        f"host AllToAll from EP {selector.HOST_ALLTOALL_MIN_EP} and "
        f"{selector.HOST_ALLTOALL_MIN_TOKENS} tokens"
    )


if __name__ == "__main__":
    main()
