"""Paged KV-cache write and paged attention (prefill, chunked prefill, decode).

Cache (``attention/kv_layout.py``): per layer a K plane and a V plane, each
``[num_blocks, kv_heads, block_size, head_size]``; token slot ``s`` lives at block
``s // block_size``, offset ``s % block_size``. Slot -1 marks a padding token.

Contract of ``paged_attention``: for request ``r`` with queries
``query[qsl[r]:qsl[r+1]]`` (the last ``q_len`` tokens of a sequence of ``seq_lens[r]``
tokens whose K/V are all in the cache), query ``i`` attends causally to cache
positions ``0 .. seq_lens[r] - q_len + i``. This one rule covers prefill, chunked
prefill, prefix-cache hits and decode. ``qsl`` and ``seq_lens`` are host lists.
"""

from __future__ import annotations

import torch

from vllm.ascend.kernels import pick, torch_npu

MASK_SIZE = 2048  # the optimised causal mask torch_npu's sparse modes 2-4 take
# npu_fused_infer_attention_score_v2's learnable_sink: value head size at most 128
NPU_SINK_MAX_HEAD_SIZE = 128
# npu_fused_infer_attention_score's page attention: block sizes 128..512 in steps of 128
# when a query has more than one token; 128 is the size its kernels are built for
NPU_BLOCK_SIZES: tuple[int, ...] = (128, 256, 384, 512)
NPU_DEFAULT_BLOCK_SIZE = 128
# its limits that depend only on the model and the parallel layout (torch_npu 2.14.0
# _op_plugin_docs.py): "支持N轴小于等于256, 支持D轴小于等于512"; "输入类型全为float16、bfloat16时,
# D轴需16对齐."; "需要满足num_heads整除num_key_value_heads, num_heads与num_key_value_heads的比值不能大于64."
NPU_MAX_HEADS = 256
NPU_MAX_HEAD_SIZE = 512
NPU_HEAD_SIZE_ALIGN = 16
NPU_MAX_GROUP = 64
_masks: dict[torch.device, torch.Tensor] = {}


# -- reference (plain torch; the oracle and host emulation) --------------------------
def valid_slots(slot_mapping: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The first ``num_tokens`` slots as int64, and a mask of the non-padding ones
    (None when every slot is real, the common case)."""
    slots = slot_mapping[:num_tokens].to(torch.int64)
    valid = slots >= 0
    return (slots, None) if bool(valid.all()) else (slots[valid], valid)


def gather_tokens(plane: torch.Tensor, block_row: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first ``seq_len`` tokens ``[seq_len, heads, dim]`` of one request from a
    head-major plane ``[blocks, heads, block_size, dim]``."""
    block_size = plane.shape[2]
    blocks = block_row[: -(-seq_len // block_size)].to(torch.int64)
    return plane[blocks].transpose(1, 2).flatten(0, 1)[:seq_len]


def gather_range(plane: torch.Tensor, block_row: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Tokens ``start .. end - 1`` ``[end - start, heads, dim]`` of one request from a
    head-major plane (only the blocks that hold them are read)."""
    block_size = plane.shape[2]
    first = start // block_size
    blocks = block_row[first : -(-end // block_size)].to(torch.int64)
    rows = plane[blocks].transpose(1, 2).flatten(0, 1)
    return rows[start - first * block_size : end - first * block_size]


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    context_len: int,
    scale: float,
    window: int | None = None,
    first_key: int = 0,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """``q [q_len, H, D]`` are positions ``context_len ..``, ``k/v [n, H, D]`` positions
    ``first_key ..``; query at position ``p`` sees keys ``<= p``, and with a sliding
    ``window`` only the last ``window`` of them (``> p - window``). ``soft_cap``: scaled
    scores become ``soft_cap * tanh(score / soft_cap)`` before the softmax (Gemma 2).
    ``sinks [H]``: one more logit per head in every softmax, attached to no value
    (gpt-oss's attention sinks). Computed in float32."""
    q_len, seq_len, dtype = q.shape[0], k.shape[0], q.dtype
    q_pos = torch.arange(q_len, device=q.device).unsqueeze(1) + context_len
    k_pos = torch.arange(seq_len, device=q.device).unsqueeze(0) + first_key
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    q, k, v = (t.transpose(0, 1).float() for t in (q, k, v))
    if soft_cap is None and sinks is None:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        return out.transpose(0, 1).to(dtype)
    if soft_cap is None:
        scores = q @ k.transpose(1, 2) * scale
    else:
        scores = soft_cap * torch.tanh(q @ k.transpose(1, 2) * (scale / soft_cap))
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        column = sinks.float().view(-1, 1, 1).expand(-1, q_len, 1)
        scores = torch.cat([scores, column], dim=-1)
    out = torch.softmax(scores, dim=-1)[..., :seq_len] @ v
    return out.transpose(0, 1).to(dtype)


def reference_write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_plane: torch.Tensor,
    v_plane: torch.Tensor,
    slot_mapping: torch.Tensor,
    index: torch.Tensor | None = None,
) -> None:
    slots, valid = valid_slots(slot_mapping, key.shape[0])
    if valid is not None:
        key, value = key[valid], value[valid]
    block_size = k_plane.shape[2]
    blocks, offsets = slots // block_size, slots % block_size
    k_plane.transpose(1, 2)[blocks, offsets] = key.to(k_plane.dtype)
    v_plane.transpose(1, 2)[blocks, offsets] = value.to(v_plane.dtype)


def reference_paged_attention(
    query: torch.Tensor,
    k_plane: torch.Tensor,
    v_plane: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: list[int],
    seq_lens: list[int],
    scale: float,
    out: torch.Tensor,
    window: int | None = None,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """With a sliding ``window``, only the blocks that hold keys inside some query's window
    are read: upstream's sliding-window KV manager hands the blocks before them back to
    the pool (the block table then names its null block there). ``soft_cap`` and
    ``sinks``: ``causal_attention``'s."""
    group = query.shape[1] // k_plane.shape[1]
    for r, seq_len in enumerate(seq_lens):
        start, end = query_start_loc[r], query_start_loc[r + 1]
        if end == start:
            continue
        context_len = seq_len - (end - start)
        first = 0 if window is None else max(0, context_len - window + 1)
        k = gather_range(k_plane, block_table[r], first, seq_len).repeat_interleave(group, dim=1)
        v = gather_range(v_plane, block_table[r], first, seq_len).repeat_interleave(group, dim=1)
        out[start:end] = causal_attention(
            query[start:end], k, v, context_len, scale, window, first, soft_cap, sinks
        )
    return out


def reference_paged_decode(
    query: torch.Tensor,
    k_plane: torch.Tensor,
    v_plane: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: list[int],
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One query per request over its first ``seq_lens[b]`` cached tokens, with the softmax
    log-sum-exp: ``query [B, H, D]`` -> (``out [B, H, Dv]``, ``lse [B, H]`` float32). A
    request with no cached tokens here gets ``out`` 0 and ``lse`` -inf (a context-parallel
    rank that holds none of its tokens)."""
    batch, heads = query.shape[:2]
    group = heads // k_plane.shape[1]
    out = query.new_zeros(batch, heads, v_plane.shape[-1])
    lse = torch.full((batch, heads), float("-inf"), dtype=torch.float32, device=query.device)
    for b, seq_len in enumerate(seq_lens):
        if seq_len == 0:
            continue
        k = gather_tokens(k_plane, block_table[b], seq_len).repeat_interleave(group, dim=1).float()
        v = gather_tokens(v_plane, block_table[b], seq_len).repeat_interleave(group, dim=1).float()
        scores = torch.einsum("hd,nhd->hn", query[b].float(), k) * scale
        lse[b] = torch.logsumexp(scores, dim=-1)
        out[b] = torch.einsum("hn,nhd->hd", torch.softmax(scores, dim=-1), v).to(out.dtype)
    return out, lse


# -- NPU (torch_npu; passes the contract double in CI, not verified on an NPU) --------
def causal_mask(device: torch.device) -> torch.Tensor:
    """torch_npu's optimised rightDownCausal mask (1 above the diagonal), built once per device."""
    if device not in _masks:
        _masks[device] = torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.bool, device=device).triu_(1)
    return _masks[device]


def npu_slots(slot_mapping: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Slots without a host sync: padding tokens (-1) go to slot 0, which belongs to
    vLLM's null block (block 0 is reserved by the block pool and never given to a
    request), so their writes land where nothing reads."""
    slots = slot_mapping[:num_tokens].to(torch.int64)
    return torch.where(slots >= 0, slots, torch.zeros_like(slots))


def npu_write_index(slot_mapping: torch.Tensor, num_tokens: int, heads: int, block_size: int) -> torch.Tensor:
    """The (block, head, offset) coordinates ``[T, heads, 3]`` of every token's rows in a
    head-major plane: the same for every layer of a KV-cache group, so the backend builds
    it once per step."""
    slots = npu_slots(slot_mapping, num_tokens)
    head_ids = torch.arange(heads, device=slots.device)
    return torch.stack(
        torch.broadcast_tensors(
            (slots // block_size).unsqueeze(1), head_ids.unsqueeze(0), (slots % block_size).unsqueeze(1)
        ),
        dim=-1,
    )


def reference_write_index(slot_mapping: torch.Tensor, num_tokens: int, heads: int, block_size: int) -> None:
    return None  # the reference write computes its positions itself


def npu_write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_plane: torch.Tensor,
    v_plane: torch.Tensor,
    slot_mapping: torch.Tensor,
    index: torch.Tensor | None = None,
) -> None:
    """``npu_scatter_nd_update_`` at (block, head, offset) coordinates: the head-major
    planes have no token-major rows for ATB's ReshapeAndCache to write. ``index``: this
    step's ``write_index`` when the caller has it."""
    num_tokens, heads = key.shape[0], key.shape[1]
    if num_tokens == 0:
        return
    if index is None:
        index = npu_write_index(slot_mapping, num_tokens, heads, k_plane.shape[2])
    npu = torch_npu()
    npu.npu_scatter_nd_update_(k_plane, index, key.to(k_plane.dtype))
    npu.npu_scatter_nd_update_(v_plane, index, value.to(v_plane.dtype))


def one_row_per_request(query_start_loc: list[int]) -> bool:
    """A step whose every request has at most one query row (a decode-only step)."""
    return all(b - a <= 1 for a, b in zip(query_start_loc, query_start_loc[1:]))


def block_groups(seq_lens: list[int], block_size: int, num_blocks: int) -> list[tuple[int, int]]:
    """Consecutive request ranges ``[a, b)`` whose blocks, summed over their requests, fit the
    cache's ``num_blocks`` (the fused attention's documented ``blocknum`` rule counts a block
    shared by several requests, a prefix-cache hit, once per request): one range for an
    ordinary step. A request alone never needs more blocks than the cache has."""
    groups, start, used = [], 0, 0
    for r, n in enumerate(seq_lens):
        need = -(-n // block_size)
        if used + need > num_blocks and r > start:
            groups.append((start, r))
            start, used = r, 0
        used += need
    groups.append((start, len(seq_lens)))
    return groups


# the fused attention's query heads, scale and cumulative query / KV lengths, by op version
_FIA_NAMES = ("num_heads", "scale", "actual_seq_lengths", "actual_seq_lengths_kv")
_FIA_V2_NAMES = ("num_query_heads", "softmax_scale", "actual_seq_qlen", "actual_seq_kvlen")


def npu_paged_attention(
    query: torch.Tensor,
    k_plane: torch.Tensor,
    v_plane: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: list[int],
    seq_lens: list[int],
    scale: float,
    out: torch.Tensor,
    window: int | None = None,
    soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """``npu_fused_infer_attention_score``: TND queries, the planes as
    ``(blocknum, KV_N, blocksize, D)`` page-attention caches. The mask, by step: a sliding
    ``window`` is the band (sparse_mode 4 with the 2048² mask: each query sees itself and the
    ``window - 1`` keys before it, as vLLM's CUDA backends set ``(window - 1, 0)``), in
    decode-only steps too; a step whose every request has one query row
    (``one_row_per_request``) takes no mask (sparse_mode 0: its one row sees every key);
    otherwise rightDownCausal (sparse_mode 3). In a decode graph the choice is the capture's.
    ``sinks``: the op's v2 with ``learnable_sink`` (bfloat16, one per query head; the same
    masks and page attention). The op takes no logit soft-cap (the platform refuses such
    models with these kernels at start-up)."""
    if soft_cap is not None:
        raise NotImplementedError("torch_npu's fused attention applies no logit soft-cap")
    num_tokens = query_start_loc[-1]
    if num_tokens == 0:
        return out
    if window is not None:
        # The band in decode too: the incumbent's hardware runs (vllm-ascend #8508, #8387) show
        # it applied with one query row, where the docs call sparse_mode "无效"; the other route,
        # a sparse-0 defaultMask, is ignored past KV position 512 (vllm-ascend #15503).
        mask_args = {"atten_mask": causal_mask(query.device), "sparse_mode": 4}
        mask_args.update(pre_tokens=window - 1, next_tokens=0)
    elif one_row_per_request(query_start_loc):
        # no mask to read (vllm-ascend #10302, #11266: about 10 % end to end in decode)
        mask_args = {"atten_mask": None, "sparse_mode": 0}
    else:
        mask_args = {"atten_mask": causal_mask(query.device), "sparse_mode": 3}
    common = dict(
        num_key_value_heads=k_plane.shape[1],
        input_layout="TND",
        block_size=k_plane.shape[2],
        **mask_args,
    )
    npu = torch_npu()
    if sinks is None:
        op, names = npu.npu_fused_infer_attention_score, _FIA_NAMES
    else:  # v2: the same call under its own argument names, plus the sink
        op, names = npu.npu_fused_infer_attention_score_v2, _FIA_V2_NAMES
        common["learnable_sink"] = sinks.to(torch.bfloat16)
    # requests sharing prefix blocks can need more blocks in sum than the cache holds: then
    # one call per range of requests that fits (a graph's capture lengths always fit)
    for a, b in block_groups(seq_lens, k_plane.shape[2], k_plane.shape[0]):
        rows = slice(query_start_loc[a], query_start_loc[b])
        if rows.start == rows.stop:
            continue
        ends = [e - rows.start for e in query_start_loc[a + 1 : b + 1]]
        values = (query.shape[1], scale, ends, seq_lens[a:b])
        table = block_table if (a, b) == (0, len(seq_lens)) else block_table[a:b]
        result, _ = op(
            query[rows].contiguous(),
            k_plane,
            v_plane,
            block_table=table,
            **dict(zip(names, values)),
            **common,
        )
        out[rows] = result
    return out


def empty_rows_to_identity(
    out: torch.Tensor, lse: torch.Tensor, seq_lens: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows with no keys: out 0, lse -inf, whatever the kernel left there (the combine
    then gives them no weight)."""
    empty = torch.tensor([n == 0 for n in seq_lens], device=lse.device)
    shape = (-1,) + (1,) * (lse.dim() - 1)
    lse = torch.where(empty.view(shape), torch.full_like(lse, float("-inf")), lse)
    out = torch.where(empty.view((-1,) + (1,) * (out.dim() - 1)), torch.zeros_like(out), out)
    return out, lse


def npu_paged_decode(
    query: torch.Tensor,
    k_plane: torch.Tensor,
    v_plane: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: list[int],
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``npu_fused_infer_attention_score`` in TND with one query row per request, page
    attention over the ``(blocknum, KV_N, blocksize, D)`` planes, ``softmax_lse_flag``."""
    batch, heads = query.shape[:2]
    out, lse = torch_npu().npu_fused_infer_attention_score(
        query.contiguous(),
        k_plane,
        v_plane,
        num_heads=heads,
        num_key_value_heads=k_plane.shape[1],
        scale=scale,
        input_layout="TND",
        block_table=block_table,
        block_size=k_plane.shape[2],
        actual_seq_lengths=list(range(1, batch + 1)),
        actual_seq_lengths_kv=seq_lens,
        softmax_lse_flag=True,
    )
    return empty_rows_to_identity(out, lse[..., 0], seq_lens)


write_index = pick(reference_write_index, npu_write_index)
write_kv_cache = pick(reference_write_kv_cache, npu_write_kv_cache)
paged_decode = pick(reference_paged_decode, npu_paged_decode)
paged_attention = pick(reference_paged_attention, npu_paged_attention)


def supported_block_sizes(npu_sizes: tuple[int, ...] = NPU_BLOCK_SIZES) -> list:
    """Kernel block sizes of the selected kernels (vLLM's ``MultipleOf`` or ints): the NPU
    kernels' sizes (``npu_sizes``: page attention's by default), or any size for the
    reference kernels."""
    from vllm.v1.attention.backend import MultipleOf

    from vllm.ascend.kernels import npu_kernels

    return list(npu_sizes) if npu_kernels() else [MultipleOf(1)]
