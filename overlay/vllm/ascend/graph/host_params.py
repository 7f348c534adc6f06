"""The fused attention's host arguments of the step being run, for the graph update.

The attention metadata builders publish them each time they build a step's metadata (V2
builds it every step, graph replays and dummy runs included, right before the forward);
a graph replay sends the latest to every fused-attention task of the graph. Keys are the
op's argument names, so each captured call takes the ones it has: ``actual_seq_lengths`` /
``actual_seq_lengths_kv`` (``npu_fused_infer_attention_score``), ``actual_seq_qlen`` /
``actual_seq_kvlen`` (its v2). A model's attention layers all take the same values (they
are per request, not per KV-cache group).
"""

from __future__ import annotations

_latest: dict[str, list[int]] | None = None


def publish(**host_args: list[int]) -> None:
    global _latest
    _latest = host_args


def latest() -> dict[str, list[int]] | None:
    return _latest


def capture_lengths(q_lens: list[int], width: int, block_size: int, num_blocks: int) -> list[int]:
    """KV lengths a graph's fused attention is captured with: as long as its replays can
    ask for, so the workspace torch_npu's capture handler sizes from them (once, for every
    replay) is not the one of the capture's few keys (vllm-ascend #15575 saw a paged
    attention workspace grow with the lengths). Within the ``blocknum`` rule (the blocks
    the lengths need, summed over the requests, at most ``num_blocks``): the first request
    takes the longest any replay can bring (``width`` blocks), the others share the rest
    evenly, each at least its query rows."""
    n = len(q_lens)
    least = [-(-max(q, 1) // block_size) for q in q_lens]
    spare = num_blocks - sum(least)
    if spare < 0:
        raise ValueError(f"{n} graph requests need more blocks than the {num_blocks} of the cache")
    first = min(width - least[0], spare) if n else 0
    each = (spare - first) // max(n - 1, 1)
    blocks = [least[0] + first] + [least[i] + min(width - least[i], each) for i in range(1, n)]
    return [b * block_size for b in blocks]


def pad_to_graph(query_start_loc: list[int], seq_lens: list[int], num_tokens: int):
    """A padded step's host lists as a captured graph needs them. Upstream pads a batch up to
    a captured size with requests of no query tokens and sequence length 0, so the last
    cumulative query length stays the real token count; the fused attention in TND takes it
    as the number of query rows, which the captured call has fixed at ``num_tokens``. Each
    padding request gets an equal share of the padding rows and attends to that many keys
    of its own (its block-table row is the null block's). Unpadded lists come back as they
    are."""
    real = query_start_loc[-1]
    if real == num_tokens:
        return query_start_loc, seq_lens
    first_pad = len(query_start_loc) - 1
    while first_pad > 0 and query_start_loc[first_pad - 1] == real:
        first_pad -= 1
    pads = len(seq_lens) - first_pad
    if pads == 0 or real > num_tokens:
        raise ValueError(
            f"a step of {real} query tokens padded to {num_tokens} has no padding request to "
            "take the padding rows"
        )
    share, extra = divmod(num_tokens - real, pads)
    lengths = [share + (i >= pads - extra) for i in range(pads)]
    if min(lengths) == 0:
        raise ValueError(f"{num_tokens - real} padding rows cannot fill {pads} padding requests")
    starts = list(query_start_loc[: first_pad + 1])
    for n in lengths:
        starts.append(starts[-1] + n)
    return starts, list(seq_lens[:first_pad]) + lengths
