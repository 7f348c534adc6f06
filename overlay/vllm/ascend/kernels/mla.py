"""Multi-head latent attention (DeepSeek-V2/V3) on paged latent and rope planes.

Cache (``attention/kv_layout.py``): ``latent [num_blocks, block_size, 1, kv_lora_rank]``
holds each token's compressed KV ``c``; ``rope [num_blocks, block_size, 1, rope_dim]``
its rotary key ``k_pe``.

* ``write_latent_cache``: store ``c`` and ``k_pe`` at the tokens' slots.
* ``latent_prolog``: ``kv_lora [T, L + R]`` (the ``kv_a`` projection) -> ``c`` RMS-normed
  ``[T, L]`` and ``k_pe`` rotated ``[T, 1, R]``, both written at the tokens' slots, in one
  call; ``rope_query`` rotates the query's rope part ``[T, N, R]`` to match. GPT-J
  (interleaved) rotary only. ``rows``: the step's (cos, sin) ``[1, T, 1, R]`` of the
  rotary module's ``step_tables``, laid out as ``prolog_neox_tables()`` says. The NPU
  forms (``npu_kv_rmsnorm_rope_cache``,
  ``npu_interleave_rope``) return the rotated part de-interleaved (the even elements,
  then the odd: their docs' reshape-transpose before a rotate-half rotation), so the rope
  plane and the query's rope part are both in that order; their dot product, the only
  place the two meet, is unchanged. The reference forms keep the GPT-J order.
* ``rope_order``: a rope part rotated elsewhere (upstream's rotary, GPT-J order) put in the
  order the prolog forms write, so the rope plane has one layout whichever path wrote a
  token (the backend applies it to every key and query that did not pass the prolog; the
  identity with the reference kernels).
* ``mla_decode``: absorbed decode. ``q_nope [B, H, L]`` is already multiplied by
  ``W_UK``; scores are ``q_nope . c + q_pe . k_pe``, output ``[B, H, L]`` is
  ``softmax . c`` (the caller applies ``W_UV``). ``seq_lens`` is a host list. With
  ``return_lse`` it also gives the log-sum-exp (context parallelism combines ranks by it).
* ``dense_attention``: attention of the prefill queries over each request's expanded
  keys/values (``q [T, H, Dqk]``, ``k [S, H, Dqk]``, ``v [S, H, Dv]``, requests
  concatenated; ``k``/``v`` may have fewer heads than ``q``: grouped-query attention),
  ``causal`` (query ``i`` of an entry sees its first ``kv_len - q_len + i + 1`` keys,
  which covers chunked prefill and prefix-cache hits) or not (every query sees every key
  of its entry), with the softmax log-sum-exp ``[T, H]`` (float32). The
  long-prefill path (``attention/prefill_chunks.py``) runs it once per history chunk and
  merges the partial results by their log-sum-exp.
"""

from __future__ import annotations

from itertools import accumulate

import torch

from vllm.ascend.kernels import norm, npu_kernels, pick, rotary, torch_npu
from vllm.ascend.kernels.attention import (
    causal_mask,
    empty_rows_to_identity,
    npu_slots,
    valid_slots,
)

# torch_npu's FIA in its MLA form (query_rope/key_rope): latent 512, rope 64, and
# 32, 64 or 128 query heads (fewer heads are padded).
NPU_MLA_LATENT, NPU_MLA_ROPE, NPU_MLA_HEADS = 512, 64, (32, 64, 128)
# the MLA form of npu_fused_infer_attention_score pages its cache in blocks of 128 or 16
NPU_MLA_BLOCK_SIZES: tuple[int, ...] = (128, 16)


def head_major(plane: torch.Tensor) -> torch.Tensor:
    """``[blocks, block_size, 1, D]`` as ``[blocks, 1, block_size, D]`` (same memory: one head)."""
    return plane.view(plane.shape[0], 1, plane.shape[1], plane.shape[3])


# -- reference --------------------------------------------------------------------------
def reference_write_latent_cache(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    latent: torch.Tensor,
    rope: torch.Tensor,
    slot_mapping: torch.Tensor,
    step_slots: torch.Tensor | None = None,
) -> None:
    # step_slots (the NPU form's once-per-step int32 slots) is None here: reference_write_slots
    slots, valid = valid_slots(slot_mapping, kv_c.shape[0])
    k_pe = k_pe.reshape(k_pe.shape[0], -1)
    if valid is not None:
        kv_c, k_pe = kv_c[valid], k_pe[valid]
    latent.view(-1, latent.shape[-1])[slots] = kv_c.to(latent.dtype)
    rope.view(-1, rope.shape[-1])[slots] = k_pe.to(rope.dtype)


def prolog_neox_tables() -> bool:
    """The table layout the prolog forms rotate with: the NPU ops rotate the de-interleaved
    part (rotate-half, neox tables); the reference rotates GPT-J pairs."""
    return npu_kernels()


def reference_rope_query(x: torch.Tensor, rows: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    cos, sin = rows
    return rotary.reference_rotate(x, cos, sin, neox=False)


def reference_rope_order(x: torch.Tensor) -> torch.Tensor:
    return x


def reference_latent_prolog(
    kv_lora: torch.Tensor,
    gamma: torch.Tensor,
    eps: float,
    rows: tuple[torch.Tensor, torch.Tensor],
    latent: torch.Tensor,
    rope: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    rank = latent.shape[-1]
    c, k = kv_lora.split([rank, kv_lora.shape[-1] - rank], dim=-1)
    c = norm.reference_rms_norm(c, gamma, eps)
    k_pe = reference_rope_query(k.unsqueeze(1), rows)
    reference_write_latent_cache(c, k_pe, latent, rope, slot_mapping)
    return c, k_pe


def _gather(plane, block_row, seq_len):
    from vllm.ascend.kernels.attention import gather_tokens

    return gather_tokens(head_major(plane), block_row, seq_len)[:, 0]  # [seq, D]


def verification_row_lens(seq_lens: list[int], q_len: int) -> list[int]:
    """Keys each of a request's ``q_len`` query rows sees (row i: ``seq_len - q_len + i + 1``;
    0 for a request with no keys on this rank)."""
    return [n - q_len + i + 1 if n else 0 for n in seq_lens for i in range(q_len)]


def reference_mla_decode(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latent: torch.Tensor,
    rope: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: list[int],
    scale: float,
    return_lse: bool = False,
    q_rope: torch.Tensor | None = None,
    q_len: int = 1,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``q_len`` query rows per request (1 + k when verifying k drafts; the rows of request
    ``b`` are ``b * q_len ..``): row i of a request attends to its first
    ``seq_len - q_len + i + 1`` keys. With ``return_lse`` also the softmax log-sum-exp
    ``[rows, H]`` (float32; -inf and a zero output for a row with no keys on this rank).
    ``q_rope``: the rotary rows to rotate ``q_pe`` with first (the latent prolog left it
    unrotated)."""
    if q_rope is not None:
        q_pe = reference_rope_query(q_pe, q_rope)
    out = q_nope.new_zeros(q_nope.shape)
    lse = torch.full(q_nope.shape[:2], float("-inf"), dtype=torch.float32, device=q_nope.device)
    for row, seq_len in enumerate(verification_row_lens(seq_lens, q_len)):
        if seq_len <= 0:
            continue
        b = row // q_len
        c = _gather(latent, block_table[b], seq_len).float()
        pe = _gather(rope, block_table[b], seq_len).float()
        scores = (q_nope[row].float() @ c.t() + q_pe[row].float() @ pe.t()) * scale  # [H, seq]
        lse[row] = torch.logsumexp(scores, dim=-1)
        out[row] = (torch.softmax(scores, dim=-1) @ c).to(out.dtype)
    return (out, lse) if return_lse else out


def reference_dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_lens: list[int],
    kv_lens: list[int],
    scale: float,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (``out [T, H, Dv]`` in q's dtype, ``lse [T, H]`` float32), computed in float32."""
    if k.shape[1] != q.shape[1]:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
    q_start = kv_start = 0
    for q_len, kv_len in zip(q_lens, kv_lens):
        if q_len and kv_len:
            rows = slice(q_start, q_start + q_len)
            keys = slice(kv_start, kv_start + kv_len)
            scores = torch.einsum("qhd,khd->hqk", q[rows].float(), k[keys].float()) * scale
            if causal:
                visible = torch.arange(kv_len, device=q.device).unsqueeze(0) <= (
                    torch.arange(q_len, device=q.device).unsqueeze(1) + kv_len - q_len
                )
                scores = scores.masked_fill(~visible, float("-inf"))
            lse[rows] = torch.logsumexp(scores, dim=-1).transpose(0, 1)
            weights = torch.softmax(scores, dim=-1)
            out[rows] = torch.einsum("hqk,khd->qhd", weights, v[keys].float()).to(q.dtype)
        q_start, kv_start = q_start + q_len, kv_start + kv_len
    return out, lse


# -- NPU (torch_npu; passes the contract double in CI, not verified on an NPU) ----------
def npu_write_slots(slot_mapping: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The int32 slot indices ATB's ReshapeAndCache takes (padding to the null block's slot
    0): the same for every layer, so the backend builds them once per step."""
    return npu_slots(slot_mapping, num_tokens).to(torch.int32)


def reference_write_slots(slot_mapping: torch.Tensor, num_tokens: int) -> None:
    return None  # the reference write reads the slot mapping itself


def graph_padding_slots(slot_mapping: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The latent prolog's slots for a graph batch, whose padding rows (slot -1) differ from
    replay to replay: each padding row takes the null block's slot of its own row number, so
    the indices stay distinct (the fused op leaves repeated indices undefined) and real
    blocks are never written. Needs ``num_tokens`` <= the block size; plain torch, no read
    back to the host."""
    slots = slot_mapping[:num_tokens].to(torch.int64)
    rows = torch.arange(num_tokens, device=slots.device)
    return torch.where(slots >= 0, slots, rows)


def _rows_bnsd(rows, batch: int, q_len: int = 1):
    """``[1, T, 1, R]`` rows as the ``[B, 1, S, R]`` tables of the BNSD ops (T = B x S; a view)."""
    return tuple(r.view(batch, 1, q_len, r.shape[-1]) for r in rows)


def npu_rope_query(x: torch.Tensor, rows: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """``npu_interleave_rope`` on ``[T, N, 1, R]`` (it takes contiguous input only)."""
    cos, sin = _rows_bnsd(rows, x.shape[0])
    return torch_npu().npu_interleave_rope(x.unsqueeze(2).contiguous(), cos, sin)[:, :, 0]


def npu_rope_order(x: torch.Tensor) -> torch.Tensor:
    """``x [..., R]`` in GPT-J order -> its even elements, then its odd ones: the order
    ``npu_kv_rmsnorm_rope_cache`` writes the rope plane in and ``npu_interleave_rope`` rotates
    the query into (one copy)."""
    return x.unflatten(-1, (x.shape[-1] // 2, 2)).transpose(-1, -2).flatten(-2)


def npu_latent_prolog(
    kv_lora: torch.Tensor,
    gamma: torch.Tensor,
    eps: float,
    rows: tuple[torch.Tensor, torch.Tensor],
    latent: torch.Tensor,
    rope: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``npu_kv_rmsnorm_rope_cache`` in PA_BNSD mode: one launch for the norm, the rotary
    and both plane writes; ``kv_lora`` as ``[T, 1, 1, L + R]``, the slots as int64 indices
    (the caller passes no padding: the op leaves repeated indices undefined)."""
    tokens, width = kv_lora.shape
    cos, sin = _rows_bnsd(rows, tokens)
    _, _, k_pe, c = torch_npu().npu_kv_rmsnorm_rope_cache(
        kv_lora.reshape(tokens, 1, 1, width),
        gamma,
        cos,
        sin,
        slot_mapping[:tokens],
        rope,
        latent,
        epsilon=eps,
        cache_mode="PA_BNSD",
        is_output_kv=True,
    )
    return c.view(tokens, -1), k_pe.view(tokens, 1, -1)


def npu_write_latent_cache(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    latent: torch.Tensor,
    rope: torch.Tensor,
    slot_mapping: torch.Tensor,
    slots: torch.Tensor | None = None,
) -> None:
    """ATB ReshapeAndCache with key = ``c`` and value = ``k_pe`` (their last dims may
    differ), one head each. ``slots``: this step's ``write_slots`` when the caller has them."""
    num_tokens = kv_c.shape[0]
    if num_tokens == 0:
        return
    torch_npu()._npu_reshape_and_cache(
        key=kv_c.reshape(num_tokens, 1, -1).to(latent.dtype),
        value=k_pe.reshape(num_tokens, 1, -1).to(rope.dtype),
        key_cache=latent,
        value_cache=rope,
        slot_indices=npu_write_slots(slot_mapping, num_tokens) if slots is None else slots,
    )


def npu_padded_heads(num_heads: int) -> int:
    for n in NPU_MLA_HEADS:
        if num_heads <= n:
            return n
    raise ValueError(
        f"the NPU MLA decode kernel takes at most {NPU_MLA_HEADS[-1]} query heads per rank, "
        f"got {num_heads}; raise the tensor-parallel size"
    )


def npu_mla_decode(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latent: torch.Tensor,
    rope: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: list[int],
    scale: float,
    return_lse: bool = False,
    q_rope: torch.Tensor | None = None,
    q_len: int = 1,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``npu_fused_infer_attention_score`` in its MLA form: BNSD query ``c``-space parts
    (heads padded to 32/64/128), ``query_rope``/``key_rope`` the rotary parts, value = ``c``;
    ``softmax_lse_flag`` gives the log-sum-exp as ``[B, N, S, 1]``. ``q_len`` > 1 (draft
    verification) is the query's S with the rightDownCausal mask (sparse_mode 3): one batch
    per request, so its blocks count once against the cache. With ``q_rope`` the BNSD rope
    part is rotated by ``npu_interleave_rope`` (it is contiguous by then)."""
    rows, heads, rank = q_nope.shape
    batch = rows // q_len
    padded = npu_padded_heads(heads)

    def bnsd(x: torch.Tensor) -> torch.Tensor:  # [B*S, N, D] -> contiguous [B, padded, S, D]
        x = x.view(batch, q_len, heads, x.shape[-1]).transpose(1, 2)
        if padded > heads:
            return torch.nn.functional.pad(x, (0, 0, 0, 0, 0, padded - heads))
        return x.contiguous()

    query, query_rope = bnsd(q_nope), bnsd(q_pe)
    if q_rope is not None:
        cos, sin = _rows_bnsd(q_rope, batch, q_len)
        query_rope = torch_npu().npu_interleave_rope(query_rope, cos, sin)
    latent_bnsd = head_major(latent)
    mask = {"atten_mask": causal_mask(query.device), "sparse_mode": 3} if q_len > 1 else {}
    out, lse = torch_npu().npu_fused_infer_attention_score(
        query,
        latent_bnsd,
        latent_bnsd,
        query_rope=query_rope,
        key_rope=head_major(rope),
        num_heads=padded,
        num_key_value_heads=1,
        input_layout="BNSD",
        scale=scale,
        block_table=block_table,
        block_size=latent.shape[1],
        actual_seq_lengths_kv=seq_lens,
        softmax_lse_flag=return_lse,
        **mask,
    )
    out = out[:, :heads].transpose(1, 2).reshape(rows, heads, -1)
    if not return_lse:
        return out
    lse = lse[:, :heads, :, 0].transpose(1, 2).reshape(rows, heads)
    return empty_rows_to_identity(out, lse, verification_row_lens(seq_lens, q_len))


# npu_fused_infer_attention_score in TND without page attention (the dense form):
# "TND场景下query、key、value输入的综合限制: T小于等于65536; N等于8/16/32/64/128, 且Q_N、K_N、V_N相等;
# Q_D、K_D等于192, V_D等于128/192; 数据类型仅支持BFLOAT16; sparse模式仅支持sparse=0且不传mask,
# 或sparse=3且传入mask" (torch_npu 2.14.0 _op_plugin_docs.py).
NPU_DENSE_MAX_T = 65536
NPU_DENSE_HEADS = (8, 16, 32, 64, 128)
NPU_DENSE_QK_DIM = 192
NPU_DENSE_V_DIMS = (128, 192)


def _pad_last(x: torch.Tensor, size: int) -> torch.Tensor:
    return x if x.shape[-1] == size else torch.nn.functional.pad(x, (0, size - x.shape[-1]))


def pad_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``x [T, H, D]`` with zero heads appended up to ``heads`` (the NPU ops' head counts)."""
    return x if x.shape[1] == heads else torch.nn.functional.pad(x, (0, 0, 0, heads - x.shape[1]))


def _dense_subcalls(q_lens: list[int], kv_lens: list[int]):
    """Entries grouped into calls of at most NPU_DENSE_MAX_T query and key rows each:
    (first query row, first key row, q lens, kv lens); entries without queries are left out."""
    calls: list[tuple[int, int, list[int], list[int]]] = []
    q_at = kv_at = 0
    cur: tuple[int, int, list[int], list[int]] | None = None
    for q_len, kv_len in zip(q_lens, kv_lens):
        if q_len > NPU_DENSE_MAX_T or kv_len > NPU_DENSE_MAX_T:
            raise ValueError(
                f"a dense attention entry of {q_len} queries over {kv_len} keys exceeds the NPU "
                f"kernel's T <= {NPU_DENSE_MAX_T}; split it (attention/prefill_chunks.py does)"
            )
        if q_len == 0 or (
            cur is not None
            and (sum(cur[2]) + q_len > NPU_DENSE_MAX_T or sum(cur[3]) + kv_len > NPU_DENSE_MAX_T)
        ):
            cur = None
        if q_len:
            if cur is None:
                cur = (q_at, kv_at, [], [])
                calls.append(cur)
            cur[2].append(q_len)
            cur[3].append(kv_len)
        q_at, kv_at = q_at + q_len, kv_at + kv_len
    return calls


def npu_dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_lens: list[int],
    kv_lens: list[int],
    scale: float,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``npu_fused_infer_attention_score`` in TND without page attention, made to fit the
    form's limits: bfloat16 in (other dtypes cast there and back), K/V heads repeated to
    the query's (Q_N = K_N = V_N) and zero heads padded up to 8/16/32/64/128 (more than 128
    heads: groups of 128), Q/K head size zero-padded to 192 (scores unchanged; the scale is
    explicit), V to 128 or 192 (DeepSeek's 192/128 passes as is), and at most 65536 query
    and key rows per call. sparse_mode 3 with the causal mask, or 0 without a mask."""
    tokens, heads, dv = q.shape[0], q.shape[1], v.shape[-1]
    if q.shape[-1] > NPU_DENSE_QK_DIM or dv > NPU_DENSE_V_DIMS[-1]:  # zero-padding cannot make it fit
        raise ValueError(
            f"the NPU dense attention kernel takes Q/K head size <= {NPU_DENSE_QK_DIM} and V head size "
            f"<= {NPU_DENSE_V_DIMS[-1]}; got {q.shape[-1]} and {dv}"
        )
    out = q.new_zeros(tokens, heads, dv)
    lse = torch.full((tokens, heads), float("-inf"), dtype=torch.float32, device=q.device)
    if tokens == 0:
        return out, lse
    if k.shape[1] != heads:
        group = heads // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    v_dim = next(d for d in NPU_DENSE_V_DIMS if dv <= d)
    q = _pad_last(q.to(torch.bfloat16), NPU_DENSE_QK_DIM)
    k = _pad_last(k.to(torch.bfloat16), NPU_DENSE_QK_DIM)
    v = _pad_last(v.to(torch.bfloat16), v_dim)
    npu = torch_npu()
    for h0 in range(0, heads, NPU_DENSE_HEADS[-1]):
        h1 = min(h0 + NPU_DENSE_HEADS[-1], heads)
        n = next(m for m in NPU_DENSE_HEADS if h1 - h0 <= m)
        for q_at, kv_at, q_part, kv_part in _dense_subcalls(q_lens, kv_lens):
            rows, keys = slice(q_at, q_at + sum(q_part)), slice(kv_at, kv_at + sum(kv_part))
            o, row_lse = npu.npu_fused_infer_attention_score(
                pad_heads(q[rows, h0:h1], n).contiguous(),
                pad_heads(k[keys, h0:h1], n).contiguous(),
                pad_heads(v[keys, h0:h1], n).contiguous(),
                num_heads=n,
                num_key_value_heads=n,
                scale=scale,
                input_layout="TND",
                actual_seq_lengths=list(accumulate(q_part)),
                actual_seq_lengths_kv=list(accumulate(kv_part)),
                atten_mask=causal_mask(q.device) if causal else None,
                sparse_mode=3 if causal else 0,
                softmax_lse_flag=True,
            )
            out[rows, h0:h1] = o[:, : h1 - h0, :dv].to(out.dtype)
            lse[rows, h0:h1] = row_lse[:, : h1 - h0, 0]
    return out, lse


def check_npu_dims(kv_lora_rank: int, rope_dim: int) -> None:
    if (kv_lora_rank, rope_dim) != (NPU_MLA_LATENT, NPU_MLA_ROPE):
        raise ValueError(
            f"the NPU MLA decode kernel (torch_npu npu_fused_infer_attention_score, MLA form) needs "
            f"kv_lora_rank {NPU_MLA_LATENT} and qk_rope_head_dim {NPU_MLA_ROPE}; this model has "
            f"{kv_lora_rank} and {rope_dim}"
        )


latent_prolog = pick(reference_latent_prolog, npu_latent_prolog)
rope_query = pick(reference_rope_query, npu_rope_query)
rope_order = pick(reference_rope_order, npu_rope_order)
write_slots = pick(reference_write_slots, npu_write_slots)
write_latent_cache = pick(reference_write_latent_cache, npu_write_latent_cache)
mla_decode = pick(reference_mla_decode, npu_mla_decode)
dense_attention = pick(reference_dense_attention, npu_dense_attention)
