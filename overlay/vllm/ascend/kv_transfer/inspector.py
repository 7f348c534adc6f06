"""``python -m vllm.ascend.kv_transfer.inspector``: print the P/D transfer plan of one request
before deploying (who reads whom, how often each prefill rank is read, which are unread).

    python -m vllm.ascend.kv_transfer.inspector --prefill tp=8,pcp=2,dcp=8 --decode tp=8,dcp=4,dp=2 \\
        --mla --block-size 128 --tokens 4096 [--decode-block-size N] [--json]

Block ids are block-table entries (0, 1, ...): the inspector has no running instance to
take real ids from. Documented in docs/pd_plan.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections import Counter

from vllm.ascend.context_parallel.placement import CPLayout, LayoutError, local_count
from vllm.ascend.kv_transfer.plan import TransferPlan, build_plan, check_pair

LAYOUT_KEYS = ("tp", "pcp", "dcp", "dp", "interleave")


def parse_layout(text: str) -> dict[str, int]:
    """``tp=8,pcp=2,dcp=8`` -> {"tp": 8, "pcp": 2, "dcp": 8}; a bad item is a one-line error."""
    values: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip().lower()
        if not sep or key not in LAYOUT_KEYS:
            raise argparse.ArgumentTypeError(
                f"{item!r}: expected key=value with a key from {', '.join(LAYOUT_KEYS)}"
            )
        if key in values:
            raise argparse.ArgumentTypeError(f"{key} given twice in {text!r}")
        try:
            values[key] = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r}: {key} must be an integer") from None
    return values


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m vllm.ascend.kv_transfer.inspector",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    spec = "tp=N,pcp=N,dcp=N,dp=N,interleave=N"
    p.add_argument(
        "--prefill",
        required=True,
        type=parse_layout,
        metavar=spec,
        help="the prefill instance's parallel layout (missing keys are 1)",
    )
    p.add_argument(
        "--decode",
        required=True,
        type=parse_layout,
        metavar=spec,
        help="the decode instance's parallel layout (missing keys are 1)",
    )
    kv = p.add_mutually_exclusive_group(required=True)
    kv.add_argument("--mla", action="store_true", help="the model uses MLA (DeepSeek-V2/V3): one latent head")
    kv.add_argument("--kv-heads", type=int, metavar="N", help="the model's number of KV heads (GQA/MHA)")
    p.add_argument(
        "--block-size",
        type=int,
        required=True,
        help="KV block size of the prefill instance (and of the decode instance unless --decode-block-size)",
    )
    p.add_argument("--decode-block-size", type=int, help="KV block size of the decode instance")
    p.add_argument("--tokens", type=int, required=True, help="the request's prompt length")
    p.add_argument("--prefill-dp-rank", type=int, default=0, help="prefill DP replica holding the request")
    p.add_argument("--decode-dp-rank", type=int, default=0, help="decode DP replica serving the request")
    p.add_argument(
        "--replica-offset",
        type=int,
        default=0,
        help="rotate the choice among prefill replicas "
        "(the connector may vary it per request to spread load)",
    )
    p.add_argument("--json", action="store_true", help="print the plan as JSON (schema: docs/pd_plan.md)")
    return p


def plan_from_args(args: argparse.Namespace) -> TransferPlan:
    kv_heads = None if args.mla else args.kv_heads
    prefill = CPLayout(**args.prefill, block_size=args.block_size, kv_heads=kv_heads)
    decode = CPLayout(**args.decode, block_size=args.decode_block_size or args.block_size, kv_heads=kv_heads)
    check_pair(prefill, decode)  # before block tables are sized from the layouts
    blocks_p = range(-(-args.tokens // prefill.virtual_block_size))
    blocks_d = range(-(-args.tokens // decode.virtual_block_size))
    return build_plan(
        prefill,
        decode,
        args.tokens,
        blocks_p,
        blocks_d,
        args.prefill_dp_rank,
        args.decode_dp_rank,
        args.replica_offset,
    )


def _rank_coords(layout: CPLayout, rank: int) -> tuple[int, int, int]:
    pcp_rank, tp_rank = divmod(rank % layout.ranks_per_replica, layout.tp)
    return pcp_rank, tp_rank, layout.cp_rank(pcp_rank, tp_rank)


def _heads(layout: CPLayout, tp_rank: int) -> list[int]:
    heads = layout.heads(tp_rank)
    return [heads.start, heads.stop]


def plan_to_dict(plan: TransferPlan) -> dict:
    """The plan as JSON-ready data (the schema of ``--json``)."""
    decode_ranks = []
    for rank in plan.decode_ranks:
        pcp_rank, tp_rank, cp_rank = _rank_coords(plan.decode, rank)
        ids = plan.read_ids_of(rank)
        sources = Counter(plan.prefill_rank[ids].tolist())
        decode_ranks.append(
            {
                "rank": rank,
                "pcp_rank": pcp_rank,
                "tp_rank": tp_rank,
                "cp_rank": cp_rank,
                "heads": _heads(plan.decode, tp_rank),
                "tokens": local_count(plan.num_tokens, cp_rank, plan.decode.cp, plan.decode.interleave),
                "read_ids": ids.tolist(),
                "sources": {str(k): v for k, v in sorted(sources.items())},
            }
        )
    prefill_ranks = []
    for rank in plan.prefill_ranks:
        pcp_rank, tp_rank, cp_rank = _rank_coords(plan.prefill, rank)
        readers = sorted(set(plan.decode_rank[plan.prefill_rank == rank].tolist()))
        prefill_ranks.append(
            {
                "rank": rank,
                "pcp_rank": pcp_rank,
                "tp_rank": tp_rank,
                "cp_rank": cp_rank,
                "heads": _heads(plan.prefill, tp_rank),
                "tokens": local_count(plan.num_tokens, cp_rank, plan.prefill.cp, plan.prefill.interleave),
                "reads_served": plan.reads_served.get(rank, 0),
                "read_by": readers,
            }
        )
    reads = [
        {
            "id": i,
            "decode_rank": int(plan.decode_rank[i]),
            "prefill_rank": int(plan.prefill_rank[i]),
            "src_block": int(plan.src_block[i]),
            "dst_block": int(plan.dst_block[i]),
            "heads": [int(plan.head0[i]), int(plan.head1[i])],
            "tokens": int(plan.token_count[i]),
            "runs": plan.runs(i).tolist(),
        }
        for i in range(len(plan))
    ]
    needed, whole = plan.head_slots_needed(), plan.head_slots_whole_blocks()
    return {
        "version": 1,
        "prefill": dataclasses.asdict(plan.prefill),
        "decode": dataclasses.asdict(plan.decode),
        "num_tokens": plan.num_tokens,
        "prefill_dp_rank": plan.prefill_dp_rank,
        "decode_dp_rank": plan.decode_dp_rank,
        "replica_offset": plan.replica_offset,
        "decode_ranks": decode_ranks,
        "prefill_ranks": prefill_ranks,
        "unread": plan.unread,
        "done_messages": [
            {"decode_rank": m.decode_rank, "prefill_rank": m.prefill_rank, "read_ids": list(m.read_ids)}
            for m in plan.done_messages()
        ],
        "reads": reads,
        "transfer": {
            "reads": len(plan),
            "runs": plan.run_count(),
            "head_slots_needed": needed,
            "head_slots_whole_blocks": whole,
            "over_read_whole_blocks": round(whole / needed, 4) if needed else None,
        },
    }


def _describe(layout: CPLayout) -> str:
    parts = [f"TP{layout.tp}"] + [
        f"{k.upper()}{getattr(layout, k)}" for k in ("pcp", "dcp", "dp") if getattr(layout, k) > 1
    ]
    if layout.interleave > 1:
        parts.append(f"interleave {layout.interleave}")
    return (
        f"{' '.join(parts)}, block {layout.block_size} ({layout.virtual_block_size} tokens per "
        f"block-table entry), {layout.ranks_per_replica} ranks per replica"
    )


def _heads_text(heads: list[int], mla: bool) -> str:
    if mla:
        return "latent"
    return str(heads[0]) if heads[1] - heads[0] == 1 else f"{heads[0]}-{heads[1] - 1}"


def format_table(data: dict) -> str:
    mla = data["prefill"]["kv_heads"] is None
    model = "MLA" if mla else f"{data['prefill']['kv_heads']} KV heads"
    lines = [f"P/D transfer plan for one request of {data['num_tokens']} tokens ({model})"]
    for side in ("prefill", "decode"):
        ranks = data[f"{side}_ranks"]
        lines.append(
            f"  {side + ':':8} {_describe(CPLayout(**data[side]))}; the request is on DP replica "
            f"{data[f'{side}_dp_rank']}, ranks {ranks[0]['rank']}-{ranks[-1]['rank']}"
        )
    lines += ["", "decode rank  pcp  tp  cp  heads   tokens  reads  sources (prefill rank x reads)"]
    for d in data["decode_ranks"]:
        sources = " ".join(f"{k}x{v}" for k, v in d["sources"].items()) or "-"
        where = f"{d['rank']:>11}  {d['pcp_rank']:>3} {d['tp_rank']:>3} {d['cp_rank']:>3}"
        lines.append(
            f"{where}  {_heads_text(d['heads'], mla):<6} {d['tokens']:>7} {len(d['read_ids']):>6}  {sources}"
        )
    lines += ["", "prefill rank  pcp  tp  cp  heads   tokens  reads served  read by (decode ranks)"]
    for p in data["prefill_ranks"]:
        readers = " ".join(map(str, p["read_by"])) or "- (unread)"
        where = f"{p['rank']:>12}  {p['pcp_rank']:>3} {p['tp_rank']:>3} {p['cp_rank']:>3}"
        lines.append(
            f"{where}  {_heads_text(p['heads'], mla):<6} {p['tokens']:>7} {p['reads_served']:>13}  {readers}"
        )
    t = data["transfer"]
    unread = " ".join(map(str, data["unread"])) or "none"
    if data["unread"]:
        unread += (
            f" (decode rank {data['decode_ranks'][0]['rank']} sends them done, so they free the "
            "request's blocks)"
        )
    over = "n/a" if t["over_read_whole_blocks"] is None else f"{t['over_read_whole_blocks']:.2f}x"
    lines += [
        "",
        f"unread prefill ranks: {unread}",
        f"reads: {t['reads']} ({t['runs']} contiguous runs); done messages: {len(data['done_messages'])}",
        f"head-slots needed {t['head_slots_needed']}, moved by whole-block reads "
        f"{t['head_slots_whole_blocks']} (over-read {over})",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        plan = plan_from_args(args)
    except LayoutError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    data = plan_to_dict(plan)
    print(json.dumps(data, indent=1) if args.json else format_table(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
