"""DeepSeek sparse attention (DeepSeek-V3.2, GLM-5): the lightning indexer's top-k selection
and MLA restricted to the selected keys, over paged caches, in plain torch.

The indexer module (``ops/dsa_indexer.py``) calls the first two, the sparse MLA backend
(``attention/sparse_mla.py``) the third. Reference forms only: no torch_npu form yet
(``npu_lightning_indexer``, ``npu_sparse_flash_attention``), so the platform refuses these
models with the NPU kernels (``platform/model_features.py``).

Contract (transformers' ``DeepseekV32Indexer`` without its fp8 and Hadamard steps, which
preserve dot products; upstream's ``sparse_attn_indexer`` semantics for positions):

- ``indexer_write(k [T, D], cache [blocks, block_size, D], slot_mapping)``: each token's
  indexer key at its slot (negative slots are padding, skipped).
- ``indexer_topk(q [T, H, D], weights [T, H], cache, block_table, query_start, seq_lens,
  topk)``: for query row t of request r at position p (``seq_len - q_len + i``), the score
  of key position s <= p is ``sum_h weights[t, h] * relu(q[t, h] . k[s])`` (``weights``
  already carry ``D ** -0.5 * H ** -0.5``); returns ``[T, topk]`` int32 request-local key
  positions of the ``min(topk, p + 1)`` highest scores, ``-1`` after them. ``query_start``
  and ``seq_lens`` are host lists.
- ``sparse_mla(q_nope [T, H, L], q_pe [T, H, R], latent, rope, block_table, query_start,
  positions [T, K], scale)``: absorbed MLA (``kernels/mla.py``'s planes and scores) over
  each row's selected positions only (``-1`` skipped); ``[T, H, L]``.
"""

from __future__ import annotations

import torch

from vllm.ascend.kernels.attention import gather_tokens


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
