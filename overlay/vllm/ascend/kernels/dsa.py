"""DeepSeek sparse attention (DeepSeek-V3.2, GLM-5): the lightning indexer's top-k selection
and MLA restricted to the selected keys, over paged caches, in plain torch.

The indexer module (``ops/dsa_indexer.py``) calls the first two, the sparse MLA backend
(``attention/sparse_mla.py``) the third. The NPU forms: ``npu_scatter_nd_update_`` for the
key write, ``npu_lightning_indexer`` and ``npu_sparse_flash_attention`` (MLA-absorb, both
over the paged caches, TND rows); their documented limits are start-up checks
(``platform/model_features.py``).

Contract (transformers' ``DeepseekV32Indexer`` without its fp8 and Hadamard steps, which
preserve dot products; upstream's ``sparse_attn_indexer`` semantics for positions):

- ``indexer_write(k [T, D], cache [blocks, block_size, D], slot_mapping)``: each token's
  indexer key at its slot (negative slots are padding, skipped).
- ``indexer_topk(q [T, H, D], weights [T, H], cache, block_table, query_start, seq_lens,
  topk)``: for query row t of request r at position p (``seq_len - q_len + i``), the score
  of key position s <= p is ``sum_h weights[t, h] * relu(q[t, h] . k[s])`` (``weights``
  already carry ``D ** -0.5 * H ** -0.5``); returns ``[T, topk]`` int32 request-local key
  positions of the ``min(topk, p + 1)`` highest scores, ``-1`` after them. ``query_start``
  and ``seq_lens`` are host lists. The NPU form may put positions the row does not see
  (``> p``) after its visible ones (op-plugin's test golden ranks them at -inf); the NPU
  sparse attention masks them (``sparse_mode`` 3), so the two forms pair up and a caller
  must not count entries other than -1 as visible.
- ``sparse_mla(q_nope [T, H, L], q_pe [T, H, R], latent, rope, block_table, query_start,
  positions [T, K], scale)``: absorbed MLA (``kernels/mla.py``'s planes and scores) over
  each row's selected positions only (``-1`` skipped); ``[T, H, L]``.
"""

from __future__ import annotations

import torch

from vllm.ascend.kernels import pick, torch_npu
from vllm.ascend.kernels.attention import gather_tokens, npu_slots
from vllm.ascend.kernels.mla import pad_heads

# npu_lightning_indexer's documented limits (op-plugin's page; the contract double's LI.*)
NPU_INDEXER_HEAD_DIM = 128
NPU_INDEXER_MAX_HEADS = 64
NPU_INDEXER_TOPK = frozenset(range(1, 2049)) | {3072, 4096, 5120, 6144, 7168, 8192}
NPU_SPARSE_MAX_HEADS = 128  # npu_sparse_flash_attention: 1, 2, 4, ... 128 query heads


def reference_indexer_write(k: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    slots = slot_mapping[: k.shape[0]].long()
    keep = slots >= 0
    cache.view(-1, cache.shape[-1])[slots[keep]] = k[keep].to(cache.dtype)


def _rows_of_requests(query_start: list[int], seq_lens: list[int]):
    """(request, first row, row count, context before the first row) per request with rows."""
    for r, (lo, hi) in enumerate(zip(query_start, query_start[1:])):
        if hi > lo:
            yield r, lo, hi - lo, seq_lens[r] - (hi - lo)


def reference_indexer_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start: list[int],
    seq_lens: list[int],
    topk: int,
    device_lengths: tuple[torch.Tensor, torch.Tensor] | None = None,  # the NPU form's
) -> torch.Tensor:
    out = torch.full((q.shape[0], topk), -1, dtype=torch.int32, device=q.device)
    for r, lo, rows, context in _rows_of_requests(query_start, seq_lens):
        keys = gather_tokens(cache.unsqueeze(1), block_table[r], context + rows)[:, 0].float()  # [S, D]
        dots = torch.relu(torch.einsum("thd,sd->ths", q[lo : lo + rows].float(), keys))
        scores = (dots * weights[lo : lo + rows].float()[..., None]).sum(1)  # [rows, S]
        position = context + torch.arange(rows, device=q.device)
        visible = torch.arange(keys.shape[0], device=q.device)[None, :] <= position[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        count = min(topk, keys.shape[0])
        best = scores.topk(count, dim=-1)
        picked = best.indices.to(torch.int32).masked_fill(best.values == float("-inf"), -1)
        out[lo : lo + rows, :count] = picked
    return out


def reference_sparse_mla(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latent: torch.Tensor,
    rope: torch.Tensor,
    block_table: torch.Tensor,
    query_start: list[int],
    positions: torch.Tensor,
    scale: float,
    seq_lens: list[int] | None = None,  # the NPU form's; the positions name the keys here
    device_lengths: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    out = q_nope.new_zeros(q_nope.shape)
    block_size = latent.shape[1]
    flat_latent = latent.view(-1, latent.shape[-1])
    flat_rope = rope.view(-1, rope.shape[-1])
    for r, (lo, hi) in enumerate(zip(query_start, query_start[1:])):
        for t in range(lo, hi):
            chosen = positions[t][positions[t] >= 0].long()
            if chosen.numel() == 0:
                continue
            slots = block_table[r][chosen // block_size].long() * block_size + chosen % block_size
            c, pe = flat_latent[slots].float(), flat_rope[slots].float()
            scores = (q_nope[t].float() @ c.t() + q_pe[t].float() @ pe.t()) * scale  # [H, K]
            out[t] = (torch.softmax(scores, dim=-1) @ c).to(out.dtype)
    return out


# -- NPU (torch_npu; passes the contract double in CI, not verified on an NPU) ----------
def npu_indexer_write(k: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Each token's key at its slot (padding to the null block's slot 0, never read)."""
    if k.shape[0] == 0:
        return
    index = npu_slots(slot_mapping, k.shape[0]).unsqueeze(1)
    torch_npu().npu_scatter_nd_update_(cache.view(-1, cache.shape[-1]), index, k.to(cache.dtype))


def _device_lengths(query_start: list[int], seq_lens: list[int], given, device):
    """The ops' int32 cumulative query rows and KV lengths per request: the step's buffers
    when the caller has them (built once per step; a decode graph reads them at every
    replay), else made from the host lists here."""
    if given is not None:
        return given
    requests = len(query_start) - 1
    return (
        torch.tensor(query_start[1:], dtype=torch.int32, device=device),
        torch.tensor(seq_lens[:requests], dtype=torch.int32, device=device),
    )


def npu_indexer_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start: list[int],
    seq_lens: list[int],
    topk: int,
    device_lengths: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``npu_lightning_indexer`` (TND rows, PA_BSND keys, causal from the right: row i of a
    request's q_len rows sees the first ``seq_len - q_len + i + 1`` keys); the head weights
    in the query's dtype, as the wheel's docs ask."""
    rows = query_start[-1]
    out = torch.full((q.shape[0], topk), -1, dtype=torch.int32, device=q.device)
    if rows == 0:
        return out
    query_ends, kv_lens = _device_lengths(query_start, seq_lens, device_lengths, q.device)
    picked, _ = torch_npu().npu_lightning_indexer(
        q[:rows].contiguous(),
        cache.unsqueeze(2),
        weights[:rows].to(q.dtype).contiguous(),
        actual_seq_lengths_query=query_ends,
        actual_seq_lengths_key=kv_lens,
        block_table=block_table.to(torch.int32),
        layout_query="TND",
        layout_key="PA_BSND",
        sparse_count=topk,
        sparse_mode=3,
    )
    out[:rows] = picked[:, 0]
    return out


def npu_sparse_mla(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latent: torch.Tensor,
    rope: torch.Tensor,
    block_table: torch.Tensor,
    query_start: list[int],
    positions: torch.Tensor,
    scale: float,
    seq_lens: list[int] | None = None,
    device_lengths: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``npu_sparse_flash_attention`` in its MLA-absorb form (the latent is key and value);
    heads padded with zero rows to the next power of two the op takes; rows past the last
    request (padding) are zeros."""
    if seq_lens is None and device_lengths is None:
        raise ValueError("the NPU sparse attention needs each request's KV length")
    heads = q_nope.shape[1]
    out = q_nope.new_zeros(q_nope.shape)
    rows = query_start[-1]
    if rows == 0:
        return out
    padded = 1 << (heads - 1).bit_length()
    query_ends, kv_lens = _device_lengths(query_start, seq_lens or [], device_lengths, q_nope.device)
    result = torch_npu().npu_sparse_flash_attention(
        pad_heads(q_nope[:rows], padded).contiguous(),
        latent,
        latent,
        positions[:rows].to(torch.int32).unsqueeze(1).contiguous(),
        scale,
        block_table=block_table.to(torch.int32),
        actual_seq_lengths_query=query_ends,
        actual_seq_lengths_kv=kv_lens,
        query_rope=pad_heads(q_pe[:rows].to(q_nope.dtype), padded).contiguous(),
        key_rope=rope,
        sparse_block_size=1,
        layout_query="TND",
        layout_kv="PA_BSND",
        sparse_mode=3,
        attention_mode=2,
    )[0]
    out[:rows] = result[:, :heads]
    return out


indexer_write = pick(reference_indexer_write, npu_indexer_write)
indexer_topk = pick(reference_indexer_topk, npu_indexer_topk)
sparse_mla = pick(reference_sparse_mla, npu_sparse_mla)
