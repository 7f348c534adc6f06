"""Gated DeltaNet (Qwen3-Next, Qwen3.5): the linear-attention layer's causal convolution,
gating and delta-rule recurrence, per sequence, over a state that lives in the layer's
state cache between steps.

Contract (one sequence of ``L`` tokens; ``H`` key heads, ``HV`` value heads, ``HV % H == 0``,
consecutive value heads sharing a key head):

- ``conv(x [L, D], weight [D, W], state [W-1, D] | None)``: the depthwise causal
  convolution over the state's ``W - 1`` earlier inputs (zeros when ``None``) and ``x``,
  then SiLU; returns ``(y [L, D], new_state [W-1, D])``, the last ``W - 1`` inputs.
- ``gating(a, b [L, HV], A_log, dt_bias [HV])``: the log decay
  ``g = -exp(A_log) * softplus(a + dt_bias)`` and the write strength ``beta = sigmoid(b)``,
  float32.
- ``delta_rule(q, k [L, H, Dk], v [L, HV, Dv], g, beta [L, HV], state [HV, Dv, Dk] | None)``:
  ``q`` and ``k`` L2-normalised per head, ``q`` scaled by ``Dk ** -0.5``; per token, per
  value head: ``S = exp(g) S``, ``S += beta (v - S k) k^T``, ``o = S q``. Returns
  ``(o [L, HV, Dv] float32, S [HV, Dv, Dk] float32)``. The state layout is vLLM's and
  torch_npu's (``(Nv, Dv, Dk)``), the transpose of transformers'.

Two forms of the recurrence, equal up to float32 rounding: ``recurrent_delta_rule`` one
token at a time (decode), ``chunked_delta_rule`` in chunks of 64 tokens (prefill): inside
a chunk the updates are solved together (a triangular solve: the WY form of the product of
the chunk's updates), across chunks the state carries them.

Batch forms over the layer's state cache (no read back to the host, the state rows named by
a device tensor of slots):

- ``conv_batch``: the convolution for every sequence of a ragged batch at once, each
  sequence's conv state read (zeros where it has none) and written back in place.
- ``recurrent_step_batch``: one token per sequence, in plain torch; what a decode graph
  captures (torch_npu documents its recurrent op for single-op and static-graph modes only).
- ``npu_decode`` and ``npu_prefill``: ``torch_npu.npu_recurrent_gated_delta_rule`` (the
  state rows updated in place) and ``torch_npu.npu_chunk_gated_delta_rule`` (one initial
  state per sequence, final states written back). Both want q and k L2-normalised by the
  caller (``normalise_qk``), bfloat16 inputs and state, ``Nv % Nk == 0``; the chunked op
  ``Nk, Nv <= 64`` and ``Dk = Dv = 128`` (``NPU_CHUNK_*``), the recurrent one at most 256 heads
  and 256-wide heads. The platform checks the model against these at start-up.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm.ascend.kernels import request_of_token, torch_npu

CHUNK = 64  # tokens solved together by the chunked form (fla's and transformers' chunk)
L2_EPS = 1e-6  # transformers' l2norm and fla's use_qk_l2norm_in_kernel
# torch_npu's limits (its docs, quoted in the contract double's rules GDR.*, CGDR.*, RGDR.*)
NPU_CHUNK_MAX_HEADS = 64
NPU_CHUNK_HEAD_DIM = 128
NPU_RECURRENT_MAX_HEADS = 256
NPU_RECURRENT_MAX_HEAD_DIM = 256
NPU_RECURRENT_MAX_TOKENS = 8  # a sequence's tokens per call (L_i <= 8): the last sampled one and its drafts


def conv(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    width = weight.shape[1]
    if state is None:
        state = x.new_zeros(width - 1, x.shape[1])
    full = torch.cat([state.to(x.dtype), x], dim=0).to(torch.float32)  # [W-1+L, D]
    w = weight.to(torch.float32)
    y = sum(full[j : j + x.shape[0]] * w[:, j] for j in range(width))
    return F.silu(y).to(x.dtype), full[x.shape[0] :].to(x.dtype)


def gating(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    g = -A_log.to(torch.float32).exp() * F.softplus(a.to(torch.float32) + dt_bias.to(torch.float32))
    return g, torch.sigmoid(b.to(torch.float32))


def _prepare(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_v_heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float32, q and k L2-normalised, q scaled, both repeated to the value heads."""
    q, k, v = (t.to(torch.float32) for t in (q, k, v))
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + L2_EPS) * q.shape[-1] ** -0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + L2_EPS)
    group = num_v_heads // q.shape[1]
    return q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1), v


def _initial(state: torch.Tensor | None, v: torch.Tensor, dk: int) -> torch.Tensor:
    if state is None:
        return v.new_zeros(v.shape[1], v.shape[2], dk)
    return state.to(torch.float32)


def recurrent_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    q, k, v = _prepare(q, k, v, v.shape[1])
    s = _initial(state, v, k.shape[-1])  # [HV, Dv, Dk]
    out = []
    for t in range(v.shape[0]):
        s = s * g[t].exp()[:, None, None]
        remembered = torch.einsum("hvk,hk->hv", s, k[t])
        s = s + torch.einsum("hv,hk->hvk", (v[t] - remembered) * beta[t][:, None], k[t])
        out.append(torch.einsum("hvk,hk->hv", s, q[t]))
    return torch.stack(out) if out else v.new_zeros(v.shape), s


def chunked_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    q, k, v = _prepare(q, k, v, v.shape[1])
    s = _initial(state, v, k.shape[-1]).transpose(1, 2)  # [HV, Dk, Dv]: rows are keys
    length = v.shape[0]
    pad = (-length) % CHUNK

    # heads first, chunks of CHUNK tokens: [HV, N, C, .]; padded tokens write nothing (beta 0)
    def chunks(t: torch.Tensor) -> torch.Tensor:
        t = F.pad(t, (0, 0) * (t.dim() - 1) + (0, pad))  # tokens are dim 0 of every input
        return t.transpose(0, 1).unflatten(1, (-1, CHUNK))

    qc, kc, vc = (chunks(t) for t in (q, k, v))
    gc = chunks(g).cumsum(-1)  # [HV, N, C]: log decay from the chunk's start to each token
    bc = chunks(beta)
    causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=v.device).tril()
    decay = (gc[..., :, None] - gc[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    # The chunk's updates solved together: (I + strictly-lower(beta k k^T decay)) u = beta v
    # and the same for the decayed keys w that read the incoming state.
    inner = (bc[..., :, None] * (kc @ kc.transpose(-1, -2)) * decay).tril(-1)
    eye = torch.eye(CHUNK, device=v.device)
    solve = torch.linalg.solve_triangular(eye + inner, eye.expand_as(inner), upper=False, unitriangular=True)
    u = solve @ (bc[..., None] * vc)
    w = solve @ (bc[..., None] * kc * gc.exp()[..., None])
    attend = (qc @ kc.transpose(-1, -2)) * decay
    out = torch.empty_like(vc)
    for n in range(qc.shape[1]):
        fresh = u[:, n] - w[:, n] @ s  # [HV, C, Dv]: each token's write, after the state's answer
        out[:, n] = (qc[:, n] * gc[:, n].exp()[..., None]) @ s + attend[:, n] @ fresh
        last = gc[:, n, -1]
        s = (
            s * last.exp()[:, None, None]
            + (kc[:, n] * (last[:, None] - gc[:, n]).exp()[..., None]).transpose(-1, -2) @ fresh
        )
    o = out.flatten(1, 2).transpose(0, 1)[:length]
    return o, s.transpose(1, 2)


def _conv_rows(
    x: torch.Tensor, weight: torch.Tensor, windows: torch.Tensor, query_start_loc: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The convolution of a ragged batch whose sequence i starts from ``windows[i]`` (its
    W - 1 earlier inputs). Returns ``(y [T, D] before SiLU, source, row)``: ``source`` holds
    every window's rows, then x's, and ``row(seq, at, token)`` says where the input ``at``
    positions into sequence ``seq`` lives (negative ``at``: its window)."""
    width, seqs = weight.shape[1], windows.shape[0]
    history = width - 1
    source = torch.cat([windows.flatten(0, 1), x.to(windows.dtype)]).to(torch.float32)
    req, pos, _ = request_of_token(query_start_loc[1 : seqs + 1], x.shape[0])

    def row(seq: torch.Tensor, at: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        return torch.where(at >= 0, seqs * history + token, seq * history + history + at)

    token = torch.arange(x.shape[0], device=x.device)
    w = weight.to(torch.float32)
    y = sum(source[row(req, pos + j - history, token + j - history)] * w[:, j] for j in range(width))
    return y, source, row


def conv_batch(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor | None,
) -> torch.Tensor:
    """``conv`` for a ragged batch: x [T, D] whose sequence i is ``x[qsl[i]:qsl[i+1]]`` with
    its state in ``conv_state[state_indices[i]]`` ([slots, W-1, D]), updated in place. Rows of
    x past the last sequence (a graph's padding) get values nobody reads."""
    seqs, history = state_indices.numel(), weight.shape[1] - 1
    states = conv_state[state_indices.long()]  # [B, W-1, D]
    if has_initial_state is not None:
        states = states * has_initial_state.to(states.dtype)[:, None, None]
    y, source, row = _conv_rows(x, weight, states, query_start_loc)
    lengths = (query_start_loc[1 : seqs + 1] - query_start_loc[:seqs]).long()
    seq = torch.arange(seqs, device=x.device)[:, None]
    tail = lengths[:, None] - history + torch.arange(history, device=x.device)  # [B, W-1]
    start = query_start_loc[:seqs].long()[:, None]
    conv_state.index_copy_(0, state_indices.long(), source[row(seq, tail, start + tail)].to(conv_state.dtype))
    return F.silu(y).to(x.dtype)


def conv_verify_batch(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    num_accepted_tokens: torch.Tensor,
) -> torch.Tensor:
    """``conv`` for verification rows (a last sampled token and its drafts per sequence):
    sequence i's buffer ``conv_state[state_indices[i]]`` holds ``W - 1 + k`` inputs, its
    window starts ``num_accepted_tokens[i] - 1`` in (where the previous step's last accepted
    token left it); afterwards the buffer holds the window without its first input, then
    the sequence's inputs (what is left past them keeps its values). Upstream's layout."""
    seqs, history, buffer = state_indices.numel(), weight.shape[1] - 1, conv_state.shape[1]
    rows = state_indices.long()
    buffers = conv_state[rows]  # [B, W-1+k, D]
    first = (num_accepted_tokens[:seqs].long() - 1)[:, None] + torch.arange(history, device=x.device)
    windows = buffers.gather(1, first[..., None].expand(-1, -1, buffers.shape[2]))
    y, source, row = _conv_rows(x, weight, windows, query_start_loc)
    lengths = (query_start_loc[1 : seqs + 1] - query_start_loc[:seqs]).long()[:, None]
    seq = torch.arange(seqs, device=x.device)[:, None]
    at = torch.arange(buffer, device=x.device)[None, :] + 1 - history  # position in the sequence
    kept = (at < lengths)[..., None]  # past the sequence's inputs the buffer keeps its values
    at = torch.minimum(at, lengths - 1)
    start = query_start_loc[:seqs].long()[:, None]
    written = source[row(seq, at, start + at)]
    conv_state.index_copy_(0, rows, torch.where(kept, written.to(conv_state.dtype), buffers))
    return F.silu(y).to(x.dtype)


def normalise_qk(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k L2-normalised per head (the NPU ops take them so; the scale is the op's)."""

    def unit(t: torch.Tensor) -> torch.Tensor:
        f = t.to(torch.float32)
        return (f * torch.rsqrt((f * f).sum(-1, keepdim=True) + L2_EPS)).to(t.dtype)

    return unit(q), unit(k)


def _scaled_heads(q: torch.Tensor, k: torch.Tensor, num_v_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalised q (then scaled) and k in float32, repeated to the value heads."""
    group = num_v_heads // q.shape[1]
    qf = q.to(torch.float32).repeat_interleave(group, dim=1) * q.shape[-1] ** -0.5
    return qf, k.to(torch.float32).repeat_interleave(group, dim=1)


def _delta_step(
    s: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for a batch of states s [B, HV, Dv, Dk] (q, k from ``_scaled_heads``):
    the new states and the outputs [B, HV, Dv]."""
    s = s * g.exp()[..., None, None]
    remembered = torch.einsum("bhvk,bhk->bhv", s, k)
    s = s + torch.einsum("bhv,bhk->bhvk", (v.to(torch.float32) - remembered) * beta[..., None], k)
    return s, torch.einsum("bhvk,bhk->bhv", s, q)


def recurrent_step_batch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_state: torch.Tensor,
    state_indices: torch.Tensor,
) -> torch.Tensor:
    """One token of each of ``state_indices.numel()`` sequences (row i is sequence i's token,
    q and k normalised): the state rows read, updated and written back in place. Returns
    o [B, HV, Dv] float32."""
    rows = state_indices.long()
    qf, kf = _scaled_heads(q, k, v.shape[1])
    s, o = _delta_step(ssm_state[rows].to(torch.float32), qf, kf, v, g, beta)
    ssm_state.index_copy_(0, rows, s.to(ssm_state.dtype))
    return o


def recurrent_verify_batch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_state: torch.Tensor,
    state_indices: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_accepted_tokens: torch.Tensor,
) -> torch.Tensor:
    """Verification rows (q and k normalised): sequence i's tokens
    ``qsl[i]:qsl[i+1]`` (at most ``state_indices.shape[1]``) start from the state in
    ``state_indices[i, num_accepted_tokens[i] - 1]`` and the state after its t-th token
    goes to ``state_indices[i, t]`` (what torch_npu's recurrent op does with
    ``num_accepted_tokens``), in plain torch for a decode graph. Returns o [T, HV, Dv]
    float32 (rows past the last sequence zero)."""
    seqs, positions = state_indices.shape
    slots = state_indices.long()
    qf, kf = _scaled_heads(q, k, v.shape[1])
    tokens = q.shape[0]
    starts = query_start_loc[:seqs].long()
    lengths = query_start_loc[1 : seqs + 1].long() - starts
    first = slots.gather(1, num_accepted_tokens[:seqs].long()[:, None] - 1)[:, 0]
    s = ssm_state[first].to(torch.float32)
    out = qf.new_zeros(tokens + 1, v.shape[1], v.shape[2])  # the last row takes what no token owns
    for t in range(positions):
        live = t < lengths
        token = torch.where(live, starts + t, tokens)
        at = token.clamp(max=tokens - 1)
        new, o = _delta_step(s, qf[at], kf[at], v[at], g[at], beta[at])
        s = torch.where(live[:, None, None, None], new, s)
        slot = slots[:, t]
        ssm_state.index_copy_(
            0, slot, torch.where(live[:, None, None, None], s.to(ssm_state.dtype), ssm_state[slot])
        )
        out.index_copy_(0, token, o)
    return out[:tokens]


def npu_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_state: torch.Tensor,
    state_indices: torch.Tensor,
) -> torch.Tensor:
    """``recurrent_step_batch`` through torch_npu's recurrent op (bfloat16, eager only)."""
    count = state_indices.numel()
    return torch_npu().npu_recurrent_gated_delta_rule(
        q.to(torch.bfloat16),
        k.to(torch.bfloat16),
        v.to(torch.bfloat16),
        ssm_state,
        beta=beta.to(torch.bfloat16),
        scale=q.shape[-1] ** -0.5,
        actual_seq_lengths=torch.ones(count, dtype=torch.int32, device=q.device),
        ssm_state_indices=state_indices.to(torch.int32),
        g=g.to(torch.float32),
    )


def npu_verify(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_state: torch.Tensor,
    state_indices: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_accepted_tokens: torch.Tensor,
) -> torch.Tensor:
    """``recurrent_verify_batch`` through torch_npu's recurrent op (eager only): every
    token names its state row, and ``num_accepted_tokens`` makes a sequence start from its
    ``num_accepted_tokens - 1``-th token's row (the kernel source reads
    ``ssm_state_indices[start + accepted - 1]``). Sequences hold 1 to 8 tokens."""
    seqs = state_indices.shape[0]
    lengths = query_start_loc[1 : seqs + 1] - query_start_loc[:seqs]
    req, position, _ = request_of_token(query_start_loc[1 : seqs + 1], q.shape[0])
    per_token = state_indices[req, position]
    return torch_npu().npu_recurrent_gated_delta_rule(
        q.to(torch.bfloat16),
        k.to(torch.bfloat16),
        v.to(torch.bfloat16),
        ssm_state,
        beta=beta.to(torch.bfloat16),
        scale=q.shape[-1] ** -0.5,
        actual_seq_lengths=lengths.to(torch.int32),
        ssm_state_indices=per_token.to(torch.int32),
        num_accepted_tokens=num_accepted_tokens[:seqs].to(torch.int32),
        g=g.to(torch.float32),
    )


def npu_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_state: torch.Tensor,
    state_indices: torch.Tensor,
    query_start_loc: torch.Tensor,
    has_initial_state: torch.Tensor | None,
) -> torch.Tensor:
    """Every sequence of a ragged prefill batch (q and k normalised; ``query_start_loc``
    from 0) through torch_npu's chunked op, each from its state row (zeros where it has
    none); the final states written back to their rows."""
    rows = state_indices.long()
    initial = ssm_state[rows]
    if has_initial_state is not None:
        initial = initial * has_initial_state.to(initial.dtype)[:, None, None, None]
    out, final = torch_npu().npu_chunk_gated_delta_rule(
        q.to(torch.bfloat16),
        k.to(torch.bfloat16),
        v.to(torch.bfloat16),
        beta=beta.to(torch.bfloat16),
        initial_state=initial.contiguous(),
        actual_seq_lengths=(query_start_loc[1:] - query_start_loc[:-1]).to(torch.int32),
        scale=q.shape[-1] ** -0.5,
        g=g.to(torch.float32),
    )
    ssm_state.index_copy_(0, rows, final.to(ssm_state.dtype))
    return out
