"""The contract double's CPU kernels for Gated DeltaNet: npu_chunk_gated_delta_rule (a
batch of sequences from one initial state each, the final states returned) and
npu_recurrent_gated_delta_rule (tokens read and write their state rows in place).

Both compute, per value head, in float32 (op-plugin's own test references do):
``S = exp(g) S``, ``S += beta (v - S k) k^T``, ``o = S (scale q)``; the state is ``(Dv, Dk)``
per head and value head ``h`` reads key head ``h // (Nv / Nk)`` (op-plugin's
test_npu_recurrent_gated_delta_rule.py golden). Neither normalises q or k: the caller does.
"""

from __future__ import annotations

import torch

from .._rules import require, unmodelled

CGDR = "npu_chunk_gated_delta_rule"
RGDR = "npu_recurrent_gated_delta_rule"
BF16 = torch.bfloat16
NORM_SLACK = 1.02  # bf16 rounding of an L2-normalised row


def _step(s, q, k, v, g, beta, scale):
    """One token for every value head: s [Nv, Dv, Dk] float32, q/k [Nv, Dk], v [Nv, Dv]."""
    s = s * g.exp()[:, None, None]
    remembered = torch.einsum("hvk,hk->hv", s, k)
    s = s + torch.einsum("hv,hk->hvk", (v - remembered) * beta[:, None], k)
    return s, torch.einsum("hvk,hk->hv", s, q * scale)


def _heads(query, key, value, op, limits):
    (t, nk, dk), (tv, nv, dv) = query.shape, value.shape
    max_heads, dk_ok, dv_ok = limits
    require(
        query.dtype == key.dtype == value.dtype == BF16
        and query.dim() == key.dim() == value.dim() == 3
        and key.shape == query.shape
        and tv == t
        and t > 0,
        op,
        "GDR.inputs",
        f"query {query.dtype} {tuple(query.shape)}, key {key.dtype} {tuple(key.shape)}, "
        f"value {value.dtype} {tuple(value.shape)}",
    )
    require(
        0 < nk <= max_heads and 0 < nv <= max_heads and nv % nk == 0 and dk_ok(dk) and dv_ok(dv),
        op,
        "CGDR.dims" if op == CGDR else "RGDR.dims",
        f"Nk {nk}, Nv {nv}, Dk {dk}, Dv {dv}",
    )
    group = nv // nk
    return t, nv, dk, dv, group


def _per_token(t, nv, name, tensor, dtype, op, rule):
    require(
        tensor is not None and tensor.dtype == dtype and tuple(tensor.shape) == (t, nv),
        op,
        rule,
        f"{name} {None if tensor is None else (tensor.dtype, tuple(tensor.shape))}; wants {dtype} ({t}, {nv})",
    )


def _lengths(lengths, op, rule, most: int | None):
    require(
        lengths is not None and lengths.dtype == torch.int32 and lengths.dim() == 1 and lengths.numel() > 0,
        op,
        rule,
        f"actual_seq_lengths {None if lengths is None else (lengths.dtype, tuple(lengths.shape))}",
    )
    values = lengths.tolist()
    require(
        all(n > 0 and (most is None or n <= most) for n in values),
        op,
        "RGDR.dims" if most else rule,
        f"sequence lengths {values}",
    )
    return values


def npu_chunk_gated_delta_rule(query, key, value, beta, initial_state, actual_seq_lengths, scale, g):
    op = CGDR
    t, nv, dk, dv, group = _heads(query, key, value, op, (64, lambda d: d == 128, lambda d: d == 128))
    _per_token(t, nv, "beta", beta, BF16, op, "GDR.inputs")
    _per_token(t, nv, "g", g, torch.float32, op, "GDR.g")
    lengths = _lengths(actual_seq_lengths, op, "GDR.lengths", None)
    require(sum(lengths) == t, op, "GDR.lengths", f"lengths {lengths} sum to {sum(lengths)}, T is {t}")
    require(
        initial_state is not None
        and initial_state.dtype == BF16
        and tuple(initial_state.shape) == (len(lengths), nv, dv, dk),
        op,
        "CGDR.state",
        f"initial_state {None if initial_state is None else (initial_state.dtype, tuple(initial_state.shape))}; "
        f"wants bfloat16 ({len(lengths)}, {nv}, {dv}, {dk}) (Atlas A2/A3)",
    )
    if scale is None:
        raise unmodelled(op, "scale unset")
    _ranges(query, key, g, beta, op)
    q = query.float().repeat_interleave(group, dim=1)
    k = key.float().repeat_interleave(group, dim=1)
    v, gf, bf = value.float(), g.float(), beta.float()
    out = torch.empty(t, nv, dv)
    final = torch.empty(initial_state.shape)
    start = 0
    for i, n in enumerate(lengths):
        s = initial_state[i].float()
        for j in range(start, start + n):
            s, out[j] = _step(s, q[j], k[j], v[j], gf[j], bf[j], scale)
        final[i] = s
        start += n
    return out.to(BF16), final.to(initial_state.dtype)


def _ranges(query, key, g, beta, op):
    """The page's numeric preconditions, as far as the double enforces them (_rules: CGDR.ranges)."""
    norms = torch.cat([query.float().norm(dim=-1).flatten(), key.float().norm(dim=-1).flatten()])
    require(
        bool(norms.le(NORM_SLACK).all()), op, "CGDR.ranges", f"a q/k row norm of {norms.max().item():.3f}"
    )
    require(bool(g.le(0).all()), op, "CGDR.ranges", f"a gate g of {g.max().item():.3f} above 0")
    require(
        bool(beta.float().ge(0).all() and beta.float().le(1).all()),
        op,
        "CGDR.ranges",
        "a beta outside [0, 1]",
    )


def npu_recurrent_gated_delta_rule(
    query, key, value, state, beta, scale, actual_seq_lengths, ssm_state_indices, num_accepted_tokens, g, gk
):
    op = RGDR
    t, nv, dk, dv, group = _heads(query, key, value, op, (256, lambda d: d <= 256, lambda d: d <= 256))
    require(gk is None, op, "RGDR.gk", "gk passed")
    if scale is None:
        raise unmodelled(op, "scale unset")
    _per_token(t, nv, "beta", beta, BF16, op, "GDR.inputs")
    _per_token(t, nv, "g", g, torch.float32, op, "GDR.g")
    lengths = _lengths(actual_seq_lengths, op, "GDR.lengths", 8)
    require(sum(lengths) == t, op, "GDR.lengths", f"lengths {lengths} sum to {sum(lengths)}, T is {t}")
    require(
        state.dtype == BF16
        and state.dim() == 4
        and tuple(state.shape[1:]) == (nv, dv, dk)
        and state.shape[0] >= t,
        op,
        "RGDR.state",
        f"state {state.dtype} {tuple(state.shape)}; wants bfloat16 (>= {t}, {nv}, {dv}, {dk})",
    )
    require(
        ssm_state_indices is not None
        and ssm_state_indices.dtype == torch.int32
        and tuple(ssm_state_indices.shape) == (t,)
        and bool(ssm_state_indices.ge(0).all() and ssm_state_indices.lt(state.shape[0]).all()),
        op,
        "RGDR.indices",
        f"ssm_state_indices {None if ssm_state_indices is None else ssm_state_indices.tolist()} "
        f"for {state.shape[0]} state rows",
    )
    accepted = [1] * len(lengths)  # the page: None means one accepted token per sequence
    if num_accepted_tokens is not None:
        require(
            num_accepted_tokens.dtype == torch.int32 and tuple(num_accepted_tokens.shape) == (len(lengths),),
            op,
            "RGDR.accepted",
            f"num_accepted_tokens {num_accepted_tokens.dtype} {tuple(num_accepted_tokens.shape)}; "
            f"wants int32 ({len(lengths)},)",
        )
        accepted = num_accepted_tokens.tolist()
        require(
            all(1 <= n <= length for n, length in zip(accepted, lengths)),
            op,
            "RGDR.accepted",
            f"num_accepted_tokens {accepted} for sequence lengths {lengths}",
        )
    q = query.float().repeat_interleave(group, dim=1)
    k = key.float().repeat_interleave(group, dim=1)
    v, gf, bf = value.float(), g.float(), beta.float()
    rows = ssm_state_indices.tolist()
    out = torch.empty(t, nv, dv)
    start = 0
    for n, took in zip(lengths, accepted):
        # a sequence starts from its last accepted token's row (the kernel reads
        # ssm_state_indices[start + num_accepted_tokens - 1]; the first token's without drafts)
        s = state[rows[start + took - 1]].float()
        for j in range(start, start + n):
            s, out[j] = _step(s, q[j], k[j], v[j], gf[j], bf[j], scale)
            state[rows[j]] = s.to(state.dtype)
        start += n
    return out.to(BF16)
