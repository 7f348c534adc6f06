"""Cross-rank correction of context-parallel attention (upstream: Triton CorrectAttnCPOutKernel).

Each rank of a context-parallel group attends over the KV tokens it holds and returns a
partial output with its softmax log-sum-exp. The exact attention over all tokens is

    lse = log(sum_c exp(lse_c)),   out = sum_c exp(lse_c - lse) * out_c

``combine_partials(outs [CP, T, H, D], lses [CP, T, H] float32) -> [T, H, D]``. A rank
with no tokens for a row contributes ``lse_c = -inf`` (weight 0); every real query sees
at least its own token, so some rank has a finite ``lse``.

``merge_partials(out_a, lse_a, out_b, lse_b) -> (out, lse)`` is the same correction for
two partial results of the same rows (``out [R, H, D]``, ``lse [R, H]`` float32), with the
merged log-sum-exp kept for the next merge: the long-prefill path folds one history chunk
at a time into a running result (``attention/prefill_chunks.py``).
"""

from __future__ import annotations

import torch

from vllm.ascend.kernels import pick, torch_npu

# npu_attention_update, the NPU form of combine_partials (Ascend/op-plugin
# docs/zh/custom_APIs/torch_npu/torch_npu-npu_attention_update.md):
# "序列并行的并行度SP取值范围[1, 16]。" and "head_dim取值范围[8, 512]且是8的倍数。"
NPU_MAX_PARTIALS = 16
NPU_PARTIAL_HEAD_DIM = (8, 512, 8)  # min, max, multiple of


def reference_combine_partials(outs: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
    lse = torch.logsumexp(lses, dim=0)  # [T, H]
    weights = torch.exp(lses - lse.unsqueeze(0)).nan_to_num_(0.0)  # [CP, T, H]
    return (outs.float() * weights.unsqueeze(-1)).sum(dim=0).to(outs.dtype)


def npu_combine_partials(outs: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
    """``npu_attention_update``: per rank, lse as ``(B x S x N)`` and the output as
    ``(B x S x N, D)`` (update_type 0: the merged output only)."""
    cp, tokens, heads, dim = outs.shape
    merged, _ = torch_npu().npu_attention_update(
        [lses[c].reshape(-1).float() for c in range(cp)], [outs[c].reshape(-1, dim) for c in range(cp)], 0
    )
    return merged.view(tokens, heads, dim)


def reference_merge_partials(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    lses = torch.stack([lse_a.float(), lse_b.float()])
    lse = torch.logsumexp(lses, dim=0)
    weights = torch.exp(lses - lse.unsqueeze(0)).nan_to_num_(0.0)
    out = out_a.float() * weights[0].unsqueeze(-1) + out_b.float() * weights[1].unsqueeze(-1)
    return out.to(out_a.dtype), lse


def npu_merge_partials(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``npu_attention_update`` with update_type 1 (its ``lse_out`` is only valid then)."""
    rows, heads, dim = out_a.shape
    merged, lse = torch_npu().npu_attention_update(
        [lse_a.reshape(-1).float(), lse_b.reshape(-1).float()],
        [out_a.reshape(-1, dim), out_b.reshape(-1, dim).to(out_a.dtype)],
        1,
    )
    return merged.view(rows, heads, dim), lse.view(rows, heads)


combine_partials = pick(reference_combine_partials, npu_combine_partials)
merge_partials = pick(reference_merge_partials, npu_merge_partials)
