"""The P/D transfer plan: planning time per request, and bytes moved vs. bytes needed.

    nox -s bench -- plan [--tokens 4096,131072] [--repeats 50] [--block-size 128]

Planning time is the median of ``--repeats`` plans of one request by a planner that
keeps its shapes, as the decode worker's ``ReplicaPlanner`` does (pure host work on one
CPU core; it scales with the CPU the connector runs on).
Bytes: ``needed`` is what the decode ranks must hold, summed over ranks; ``whole-block``
is what moves if each decode rank copies every source block it reads from whole, once,
and picks its tokens out locally. The ratio is the over-read. ``runs`` counts the
contiguous token runs an exact copy needs (each run is one copy per head, KV plane and
layer). Bytes use DeepSeek-V3's MLA cache (latent 512 + rope 64, bf16, 61 layers) and a
GQA model with head size 128 (K and V, bf16, 64 layers) as examples; the ratio does not
depend on them.
"""

from __future__ import annotations

import argparse
import statistics
import time

from vllm.ascend.context_parallel.placement import CPLayout
from vllm.ascend.kv_transfer.plan import PlanShapes
from vllm.ascend.kv_transfer.planner import KEPT_BYTES, Kept

MLA_BYTES_PER_HEAD_SLOT = (512 + 64) * 2 * 61
GQA_BYTES_PER_HEAD_SLOT = 128 * 2 * 2 * 64


def layouts(block: int) -> dict[str, tuple[CPLayout, CPLayout]]:
    mla = {"kv_heads": None, "block_size": block}
    gqa = {"kv_heads": 4, "block_size": block}
    return {
        "MLA TP8/DP2 -> TP8/DP2": (CPLayout(tp=8, dp=2, **mla), CPLayout(tp=8, dp=2, **mla)),
        "MLA TP8/PCP2/DCP8 -> TP8/DCP4/DP2": (
            CPLayout(tp=8, pcp=2, dcp=8, **mla),
            CPLayout(tp=8, dcp=4, dp=2, **mla),
        ),
        "MLA same, interleave = block": (
            CPLayout(tp=8, pcp=2, dcp=8, interleave=block, **mla),
            CPLayout(tp=8, dcp=4, dp=2, interleave=block, **mla),
        ),
        "MLA TP8/PCP2/DCP4 -> TP4/DCP2/DP4": (
            CPLayout(tp=8, pcp=2, dcp=4, **mla),
            CPLayout(tp=4, dcp=2, dp=4, **mla),
        ),
        "MLA TP8/PCP2 -> TP4/DCP2": (CPLayout(tp=8, pcp=2, **mla), CPLayout(tp=4, dcp=2, **mla)),
        "MLA TP8 -> TP8/DCP4 (over-read)": (CPLayout(tp=8, **mla), CPLayout(tp=8, dcp=4, **mla)),
        "GQA4 TP8 -> TP8/DCP2 (over-read)": (CPLayout(tp=8, **gqa), CPLayout(tp=8, dcp=2, **gqa)),
        "GQA4 TP8/PCP2/DCP2 -> TP8/DCP2/DP2": (
            CPLayout(tp=8, pcp=2, dcp=2, **gqa),
            CPLayout(tp=8, dcp=2, dp=2, **gqa),
        ),
        "GQA4 TP16/DCP2 -> TP8/DCP2/DP2": (CPLayout(tp=16, dcp=2, **gqa), CPLayout(tp=8, dcp=2, dp=2, **gqa)),
        "GQA4 TP8 -> TP2": (CPLayout(tp=8, **gqa), CPLayout(tp=2, **gqa)),
        "GQA4 TP2 -> TP8": (CPLayout(tp=2, **gqa), CPLayout(tp=8, **gqa)),
        f"GQA4 TP4 block {block} -> TP4 block {block // 2}": (
            CPLayout(tp=4, **gqa),
            CPLayout(tp=4, kv_heads=4, block_size=block // 2),
        ),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="4096,131072", help="request lengths, comma-separated")
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--block-size", type=int, default=128)
    args = p.parse_args()
    lengths = [int(x) for x in args.tokens.split(",")]
    print(
        f"{'layout (prefill -> decode)':40} {'tokens':>7} {'reads':>6} {'runs':>7} {'plan ms':>8} "
        f"{'needed MiB':>10} {'whole-block MiB':>15} {'over-read':>9}"
    )
    for name, (prefill, decode) in layouts(args.block_size).items():
        per_slot = MLA_BYTES_PER_HEAD_SLOT if prefill.mla else GQA_BYTES_PER_HEAD_SLOT
        for n in lengths:
            src = list(range(-(-n // prefill.virtual_block_size)))
            dst = list(range(-(-n // decode.virtual_block_size)))
            shapes = PlanShapes(prefill, decode, keep=Kept(KEPT_BYTES).get)
            shapes.plan(n, src, dst)  # the first plan of a shape makes it
            times = []
            repeats = max(3, args.repeats if n <= 8192 else args.repeats // 10)
            for _ in range(repeats):
                start = time.perf_counter()
                plan = shapes.plan(n, src, dst)
                times.append(time.perf_counter() - start)
            needed, whole = plan.head_slots_needed(), plan.head_slots_whole_blocks()
            print(
                f"{name:40} {n:>7} {len(plan):>6} {plan.run_count():>7} "
                f"{statistics.median(times) * 1e3:>8.3f} {needed * per_slot / 2**20:>10.1f} "
                f"{whole * per_slot / 2**20:>15.1f} {whole / needed:>8.2f}x"
            )


if __name__ == "__main__":
    main()
