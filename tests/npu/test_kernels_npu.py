"""NPU kernels against their reference implementations on random inputs.

Marked ``npu``: they need an Ascend NPU with CANN and torch_npu and are skipped
everywhere else, including this repository's CI. Nothing here has run on an NPU yet.
"""

from __future__ import annotations

import math

import pytest

try:
    import vllm  # noqa: F401  (bootstrap: loads torch_npu if it can)
    from vllm.ascend.device import npu_device_count
    from vllm.ascend.device.npu_runtime import failure_reason
    HAVE_NPU = npu_device_count() > 0
    WHY = failure_reason() or "torch_npu sees no NPU"
except ImportError:
    HAVE_NPU, WHY = False, "vllm (the built wheel) is not installed"

pytestmark = [pytest.mark.npu, pytest.mark.skipif(not HAVE_NPU, reason=f"needs an Ascend NPU: {WHY}")]


@pytest.fixture
def dev():
    import torch

    torch.manual_seed(0)
    return torch.device("npu:0")


def test_write_kv_cache(dev):
    import torch

    from vllm.ascend.kernels import attention as k

    kc, vc = torch.zeros(8, 128, 2, 64, device=dev), torch.zeros(8, 128, 2, 64, device=dev)
    key, value = torch.randn(5, 2, 64, device=dev), torch.randn(5, 2, 64, device=dev)
    slots = torch.tensor([0, 130, 257, 5, 1000], device=dev)
    rk, rv = kc.clone(), vc.clone()
    k.npu_write_kv_cache(key, value, kc, vc, slots)
    k.reference_write_kv_cache(key, value, rk, rv, slots)
    torch.testing.assert_close(kc, rk)
    torch.testing.assert_close(vc, rv)


def test_paged_attention(dev):
    import torch

    from vllm.ascend.kernels import attention as k

    kc, vc = torch.randn(16, 128, 2, 64, device=dev), torch.randn(16, 128, 2, 64, device=dev)
    table = torch.randperm(16, device=dev).reshape(2, 8).to(torch.int32)
    query = torch.randn(7, 8, 64, device=dev)
    qsl, seq_lens = torch.tensor([0, 6, 7]), torch.tensor([300, 129])
    out, ref = torch.zeros_like(query), torch.zeros_like(query)
    k.npu_paged_attention(query, kc, vc, table, qsl, seq_lens, 1 / math.sqrt(64), out)
    k.reference_paged_attention(query, kc, vc, table, qsl, seq_lens, 1 / math.sqrt(64), ref)
    torch.testing.assert_close(out, ref, rtol=2e-3, atol=2e-3)


def test_mla_decode(dev):
    import torch

    from vllm.ascend.kernels import mla

    cache = torch.randn(8, 128, 576, device=dev)
    table = torch.randperm(8, device=dev).reshape(2, 4).to(torch.int32)
    q_nope, q_pe = torch.randn(2, 16, 512, device=dev), torch.randn(2, 16, 64, device=dev)
    seq_lens = torch.tensor([300, 17])
    out = mla.npu_mla_decode(q_nope, q_pe, cache, table, seq_lens, 0.1)
    ref = mla.reference_mla_decode(q_nope, q_pe, cache, table, seq_lens, 0.1)
    torch.testing.assert_close(out, ref, rtol=2e-3, atol=2e-3)


def test_moe_experts(dev):
    import torch

    from vllm.ascend.kernels import moe

    x = torch.randn(10, 64, device=dev)
    w13, w2 = torch.randn(4, 96, 64, device=dev) * 0.1, torch.randn(4, 64, 48, device=dev) * 0.1
    ids = torch.stack([torch.randperm(4)[:2] for _ in range(10)]).to(dev)
    weights = torch.rand(10, 2, device=dev)
    out = moe.npu_moe_experts(x, w13, w2, weights, ids)
    ref = moe.reference_moe_experts(x, w13, w2, weights, ids)
    torch.testing.assert_close(out, ref, rtol=2e-3, atol=2e-3)
