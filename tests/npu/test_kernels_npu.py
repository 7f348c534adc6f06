"""NPU kernels against their reference implementations, on an Ascend NPU.

Marked ``npu``: they need an Ascend NPU with CANN and torch_npu and are skipped
everywhere else, including this repository's CI (where the same kernels run against
the torch_npu contract double instead: harness/doubles/torch_npu_site). Nothing here has run on
an NPU yet. The caches are the backends' real plane views of one contiguous layer
region (attention/kv_layout.py) and the dtype is bfloat16, as in serving.
"""

from __future__ import annotations

import pytest

try:
    import vllm  # noqa: F401  (bootstrap: loads torch_npu if it can)

    from vllm.ascend.device import npu_device_count
    from vllm.ascend.device.npu_runtime import failure_reason, load_torch_npu

    _npu = load_torch_npu()
    HAVE_NPU = npu_device_count() > 0 and not getattr(_npu, "IS_CONTRACT_DOUBLE", False)
    WHY = failure_reason() or "torch_npu sees no NPU (or it is the contract double)"
except ImportError:
    HAVE_NPU, WHY = False, "vllm (the built wheel) is not installed"

pytestmark = [pytest.mark.npu, pytest.mark.skipif(not HAVE_NPU, reason=f"needs an Ascend NPU: {WHY}")]


@pytest.fixture
def dev():
    import torch

    torch.manual_seed(0)
    return torch.device("npu:0")


def _gqa_planes(dev, blocks=16, heads=2, block_size=128, head_size=64):
    import torch

    from vllm.ascend.attention.kv_layout import gqa_planes

    region = torch.zeros(blocks, heads, block_size, 2 * head_size, dtype=torch.bfloat16, device=dev)
    return gqa_planes(region, head_size, head_size)


def test_write_kv_cache_and_paged_attention(dev):
    import torch

    from vllm.ascend.kernels import attention as k

    npu_planes, ref_planes = _gqa_planes(dev), _gqa_planes(dev)
    seq_lens, q_lens = [300, 129], [6, 1]
    table = torch.arange(1, 9, device=dev, dtype=torch.int32).reshape(2, 4)
    for r, (kv, _q) in enumerate(zip(seq_lens, q_lens)):
        key = torch.randn(kv, 2, 64, dtype=torch.bfloat16, device=dev)
        value = torch.randn(kv, 2, 64, dtype=torch.bfloat16, device=dev)
        slots = torch.tensor([int(table[r, p // 128]) * 128 + p % 128 for p in range(kv)], device=dev)
        k.npu_write_kv_cache(key, value, *npu_planes, slots)
        k.reference_write_kv_cache(key, value, *ref_planes, slots)
    for a, b in zip(npu_planes, ref_planes):
        torch.testing.assert_close(a, b)
    query = torch.randn(sum(q_lens), 8, 64, dtype=torch.bfloat16, device=dev)
    out, ref = torch.zeros_like(query), torch.zeros_like(query)
    k.npu_paged_attention(query, *npu_planes, table, [0, 6, 7], seq_lens, 0.125, out)
    k.reference_paged_attention(query, *ref_planes, table, [0, 6, 7], seq_lens, 0.125, ref)
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)


def test_mla_write_and_decode(dev):
    import torch

    from vllm.ascend.attention.kv_layout import mla_planes
    from vllm.ascend.kernels import mla

    planes = [mla_planes(torch.zeros(8, 128, 576, dtype=torch.bfloat16, device=dev), 512) for _ in range(2)]
    table = torch.tensor([[3, 1, 2], [5, 0, 0]], dtype=torch.int32, device=dev)
    seq_lens = [300, 17]
    for r, n in enumerate(seq_lens):
        c = torch.randn(n, 512, dtype=torch.bfloat16, device=dev)
        pe = torch.randn(n, 1, 64, dtype=torch.bfloat16, device=dev)
        slots = torch.tensor([int(table[r, p // 128]) * 128 + p % 128 for p in range(n)], device=dev)
        mla.npu_write_latent_cache(c, pe, *planes[0], slots)
        mla.reference_write_latent_cache(c, pe, *planes[1], slots)
    q_nope = torch.randn(2, 16, 512, dtype=torch.bfloat16, device=dev)
    q_pe = torch.randn(2, 16, 64, dtype=torch.bfloat16, device=dev)
    out = mla.npu_mla_decode(q_nope, q_pe, *planes[0], table, seq_lens, 0.04)
    ref = mla.reference_mla_decode(q_nope, q_pe, *planes[1], table, seq_lens, 0.04)
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)


def test_moe_experts(dev):
    import torch

    from vllm.ascend.kernels import moe

    x = torch.randn(10, 64, dtype=torch.bfloat16, device=dev)
    w13 = (torch.randn(4, 96, 64, device=dev) * 0.1).to(torch.bfloat16)
    w2 = (torch.randn(4, 64, 48, device=dev) * 0.1).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(4)[:2] for _ in range(10)]).to(dev)
    weights = torch.rand(10, 2, device=dev)
    out = moe.npu_moe_experts(x, w13, w2, weights, ids)
    ref = moe.reference_moe_experts(x, w13, w2, weights, ids)
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
