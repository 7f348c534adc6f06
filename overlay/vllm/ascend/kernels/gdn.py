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
the chunk's updates), across chunks the state carries them. No torch_npu form yet: with the
NPU kernels the platform refuses these layers at start-up (``platform/model_features.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64  # tokens solved together by the chunked form (fla's and transformers' chunk)
L2_EPS = 1e-6  # transformers' l2norm and fla's use_qk_l2norm_in_kernel


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
