"""Argument builders for the contract double's tests (test_double_*.py): a valid call of
each torch_npu op the overlay uses, with ``**change`` to make it invalid one argument at a
time."""

from __future__ import annotations

import pytest
import torch

torch_npu = pytest.importorskip("torch_npu")  # the double (the test modules check it is)

BF16 = torch.bfloat16


BF16 = torch.bfloat16
MASK = torch.ones(2048, 2048, dtype=torch.bool).triu(1)


def gqa_args(**change):
    nb, kvn, bs, d, n = 4, 2, 128, 16, 4
    args = dict(
        query=torch.randn(5, n, d, dtype=BF16),
        key=torch.randn(nb, kvn, bs, d, dtype=BF16),
        value=torch.randn(nb, kvn, bs, d, dtype=BF16),
        num_heads=n,
        num_key_value_heads=kvn,
        input_layout="TND",
        block_table=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
        block_size=bs,
        actual_seq_lengths=[4, 5],
        actual_seq_lengths_kv=[200, 130],
        atten_mask=MASK,
        sparse_mode=3,
        scale=0.25,
    )
    args.update(change)
    return args


def fia(**kw):
    q, k, v = kw.pop("query"), kw.pop("key"), kw.pop("value")
    return torch_npu.npu_fused_infer_attention_score(q, k, v, **kw)


V2_NAMES = {
    "num_heads": "num_query_heads",
    "scale": "softmax_scale",
    "actual_seq_lengths": "actual_seq_qlen",
    "actual_seq_lengths_kv": "actual_seq_kvlen",
}


def fia_v2(**kw):
    """The same call through v2's names (v1's gqa_args), plus v2-only arguments."""
    q, k, v = kw.pop("query"), kw.pop("key"), kw.pop("value")
    kw = {V2_NAMES.get(name, name): value for name, value in kw.items()}
    return torch_npu.npu_fused_infer_attention_score_v2(q, k, v, **kw)


def sink(n=4, dtype=BF16):
    return torch.randn(n, dtype=dtype)


def mla(heads=32, latent=512, token_major=False, **change):
    """The MLA form of the fused attention op (one decode token, two cache blocks)."""
    cache_shape = (2, 128, 1) if token_major else (2, 1, 128)
    args = dict(
        query_rope=torch.randn(1, heads, 1, 64, dtype=BF16),
        key_rope=torch.randn(*cache_shape, 64, dtype=BF16),
        num_heads=heads,
        num_key_value_heads=1,
        input_layout="BNSD",
        block_table=torch.zeros(1, 1, dtype=torch.int32),
        block_size=128,
        actual_seq_lengths_kv=[5],
    )
    args.update(change)
    cache = torch.randn(*cache_shape, latent, dtype=BF16)
    query = torch.randn(1, heads, 1, latent, dtype=BF16)
    return torch_npu.npu_fused_infer_attention_score(query, cache, cache, **args)


def rac(**change):
    args = dict(
        key=torch.randn(3, 1, 8, dtype=BF16),
        value=torch.randn(3, 1, 4, dtype=BF16),
        key_cache=torch.zeros(2, 16, 1, 8, dtype=BF16),
        value_cache=torch.zeros(2, 16, 1, 4, dtype=BF16),
        slot_indices=torch.tensor([0, 17, 31], dtype=torch.int32),
    )
    args.update(change)
    return torch_npu._npu_reshape_and_cache(**args)


def gmm(x_rows=6, group_list=(2, 6), weight=None, **kw):
    weight = torch.randn(2, 8, 4, dtype=BF16) if weight is None else weight
    return torch_npu.npu_grouped_matmul(
        [torch.randn(x_rows, 8, dtype=BF16)],
        [weight],
        group_list=torch.tensor(group_list),
        split_item=2,
        group_type=0,
        **kw,
    )


def init_routing(ids=None, **change):
    args = dict(
        active_num=4,
        expert_num=4,
        expert_tokens_num_type=1,
        expert_tokens_num_flag=True,
        active_expert_range=[0, 4],
        quant_mode=-1,
    )
    args.update(change)
    ids = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32) if ids is None else ids
    return torch_npu.npu_moe_init_routing_v2(torch.randn(2, 8), ids, **args)


def krrc(tokens=2, blocks=2, **change):
    """A valid npu_kv_rmsnorm_rope_cache call (PA_BNSD), one argument changed."""
    args = dict(
        kv=torch.randn(tokens, 1, 1, 576, dtype=BF16),
        gamma=torch.ones(512, dtype=BF16),
        cos=torch.ones(tokens, 1, 1, 64, dtype=BF16),
        sin=torch.zeros(tokens, 1, 1, 64, dtype=BF16),
        index=torch.arange(tokens) + 16,
        k_cache=torch.zeros(blocks, 16, 1, 64, dtype=BF16),
        ckv_cache=torch.zeros(blocks, 16, 1, 512, dtype=BF16),
        cache_mode="PA_BNSD",
        is_output_kv=True,
    )
    args.update(change)
    positional = [args.pop(k) for k in ("kv", "gamma", "cos", "sin", "index", "k_cache", "ckv_cache")]
    return torch_npu.npu_kv_rmsnorm_rope_cache(*positional, **args)


def irope(x=None, cos=None):
    x = torch.randn(3, 4, 1, 64, dtype=BF16) if x is None else x
    cos = torch.ones(3, 1, 1, 64, dtype=BF16) if cos is None else cos
    return torch_npu.npu_interleave_rope(x, cos, cos.clone())


def qmm(**kw):
    args = dict(scale=torch.ones(4), pertoken_scale=None, bias=None, output_dtype=BF16)
    args.update(kw)
    return torch_npu.npu_quant_matmul(
        torch.ones(2, 8, dtype=torch.int8), torch.ones(8, 4, dtype=torch.int8), args.pop("scale"), **args
    )


def qgmm(scale_dtype=BF16, scale_cols=4):
    return torch_npu.npu_grouped_matmul(
        [torch.ones(6, 8, dtype=torch.int8)],
        [torch.ones(2, 8, 4, dtype=torch.int8)],
        scale=[torch.ones(2, scale_cols, dtype=scale_dtype)],
        per_token_scale=[torch.ones(6)],
        group_list=torch.tensor([2, 6]),
        split_item=2,
        group_type=0,
        output_dtype=BF16,
    )


def a8w4(k=256, n=8, experts=2, counts=(2, 3), rows=6, scale=None, **kw):
    """A valid A8W4 npu_grouped_matmul call (int8 x, int32-packed int4 weight), one thing
    changed: (its output, the int4 values, the float32 scales)."""
    values = torch.randint(-8, 8, (experts, k, n), dtype=torch.int32)
    packed = torch_npu.npu_convert_weight_to_int4pack(values.reshape(experts * k, n)).view(experts, k, n // 8)
    scales = torch.rand(experts, n) + 0.5
    bits = scales.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    scale = bits[:, None, :].expand(experts, k // 256, n).contiguous() if scale is None else scale
    offset_term = 8 * (values.double() * scales[:, None, :].double()).sum(1).float()
    args = dict(
        bias=[offset_term],
        scale=[scale],
        per_token_scale=[torch.rand(rows)],
        group_list=torch.tensor(counts),
        group_list_type=1,
        split_item=2,
        group_type=0,
        output_dtype=BF16,
    )
    args.update(kw)
    x = torch.randint(-128, 128, (rows, k), dtype=torch.int8)
    [y] = torch_npu.npu_grouped_matmul([x], [packed], **args)
    return y, x, values, scales, args


def dense(n=8, d=192, dv=128, t=5, kv_t=7, dtype=BF16, kv_heads=None, causal=True, **change):
    """The dense TND form (no page attention) with documented defaults, one field changed."""
    kv_heads = kv_heads or n
    args = dict(
        num_heads=n,
        num_key_value_heads=kv_heads,
        input_layout="TND",
        actual_seq_lengths=[2, t],
        actual_seq_lengths_kv=[4, kv_t],
        atten_mask=MASK if causal else None,
        sparse_mode=3 if causal else 0,
        scale=0.1,
    )
    args.update(change)
    q = torch.randn(t, n, d, dtype=dtype)
    k, v = torch.randn(kv_t, kv_heads, d, dtype=dtype), torch.randn(kv_t, kv_heads, dv, dtype=dtype)
    return torch_npu.npu_fused_infer_attention_score(q, k, v, **args)
