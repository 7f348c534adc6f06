"""The contract double refuses each documented violation of a torch_npu op, naming its rule
(and refuses arguments it does not model instead of guessing)."""

from __future__ import annotations

import pytest
import torch

from tests.npu_contract.contract_cases import (
    BF16,
    MASK,
    a8w4,
    dense,
    fia,
    fia_v2,
    gmm,
    gqa_args,
    init_routing,
    irope,
    krrc,
    mla,
    qgmm,
    qmm,
    rac,
    sink,
)

torch_npu = pytest.importorskip("torch_npu")
if not getattr(torch_npu, "IS_CONTRACT_DOUBLE", False):
    pytest.skip("the real torch_npu is active on this host", allow_module_level=True)

from torch_npu._rules import ContractViolation  # noqa: E402

VIOLATIONS = {
    "sink in float32": ("FIA2.sink", lambda: fia_v2(**gqa_args(learnable_sink=sink(dtype=torch.float32)))),
    "a sink per KV head": ("FIA2.sink", lambda: fia_v2(**gqa_args(learnable_sink=sink(2)))),
    "sink with head size 256": (
        "FIA2.sink_d",
        lambda: fia_v2(
            **gqa_args(
                query=torch.randn(5, 4, 256, dtype=BF16),
                key=torch.randn(4, 2, 128, 256, dtype=BF16),
                value=torch.randn(4, 2, 128, 256, dtype=BF16),
                learnable_sink=sink(),
            )
        ),
    ),
    "clipped swiglu over an odd dim": (
        "CSWIGLU.x",
        lambda: torch_npu.npu_clipped_swiglu(torch.randn(3, 7, dtype=BF16)),
    ),
    "clipped swiglu over a strided x": (
        "CSWIGLU.x",
        lambda: torch_npu.npu_clipped_swiglu(torch.randn(8, 3, dtype=BF16).t()),
    ),
    "latent prolog: float32 kv": ("KRRC.kv", lambda: krrc(kv=torch.randn(2, 1, 1, 576))),
    "latent prolog: latent 256": (
        "KRRC.sizes",
        lambda: krrc(kv=torch.randn(2, 1, 1, 320, dtype=BF16), gamma=torch.ones(256, dtype=BF16)),
    ),
    "latent prolog: cos for one token": (
        "KRRC.cos_sin",
        lambda: krrc(cos=torch.ones(1, 1, 1, 64, dtype=BF16)),
    ),
    "latent prolog: int32 index": (
        "KRRC.index",
        lambda: krrc(index=torch.tensor([16, 17], dtype=torch.int32)),
    ),
    "latent prolog: a repeated slot": ("KRRC.index_unique", lambda: krrc(index=torch.tensor([16, 16]))),
    "latent prolog: a padding slot": ("PROJECT.valid_slots", lambda: krrc(index=torch.tensor([16, -1]))),
    "latent prolog: two heads in the rope cache": (
        "KRRC.cache",
        lambda: krrc(k_cache=torch.zeros(2, 16, 2, 64, dtype=BF16)),
    ),
    "latent prolog: strided latent cache": (
        "PROJECT.no_hidden_cache_copy",
        lambda: krrc(ckv_cache=torch.zeros(2, 16, 1, 1024, dtype=BF16)[..., :512]),
    ),
    "interleave rope: strided x": (
        "IROPE.x",
        lambda: irope(x=torch.randn(3, 4, 1, 128, dtype=BF16)[..., :64]),
    ),
    "interleave rope: float32 tables": ("IROPE.cos_sin", lambda: irope(cos=torch.ones(3, 1, 1, 64))),
    "interleave rope: head size 128": (
        "IROPE.dims",
        lambda: irope(x=torch.randn(3, 4, 1, 128, dtype=BF16), cos=torch.ones(3, 1, 1, 128, dtype=BF16)),
    ),
    "float32 query": ("FIA.query", lambda: fia(**gqa_args(query=torch.randn(5, 4, 16)))),
    "strided key cache": (
        "FIA.key",
        lambda: fia(**gqa_args(key=torch.randn(4, 128, 2, 16, dtype=BF16).transpose(1, 2))),
    ),
    "causal mode without the mask": ("FIA.mask_2048", lambda: fia(**gqa_args(atten_mask=None))),
    "a 1024 mask": ("FIA.mask_2048", lambda: fia(**gqa_args(atten_mask=MASK[:1024, :1024].contiguous()))),
    "a lower-triangle mask": ("FIA.sparse_3", lambda: fia(**gqa_args(atten_mask=MASK.T.contiguous()))),
    "band with a lower-triangle mask": (
        "FIA.sparse_4",
        lambda: fia(**gqa_args(sparse_mode=4, pre_tokens=7, next_tokens=0, atten_mask=MASK.T.contiguous())),
    ),
    "band with negative pre_tokens": (
        "FIA.band_rows",
        lambda: fia(**gqa_args(sparse_mode=4, pre_tokens=-1, next_tokens=0)),
    ),
    "band leaving a query row without keys": (  # batch 1: 1 query over 130 keys, next_tokens -130
        "FIA.band_rows",
        lambda: fia(**gqa_args(sparse_mode=4, pre_tokens=200, next_tokens=-130)),
    ),
    "a defaultMask in TND": (  # vllm-ascend #15503: ignored past KV position 512 in paged decode
        "FIA.tnd_sparse",
        lambda: fia(**gqa_args(sparse_mode=0, atten_mask=torch.zeros(2, 1, 4, 256, dtype=torch.bool))),
    ),
    "the causal mode without a mask in TND": ("FIA.tnd_sparse", lambda: fia(**gqa_args(sparse_mode=1))),
    "block size 16 in prefill": (
        "FIA.pa_block_size",
        lambda: fia(
            **gqa_args(
                key=torch.randn(40, 2, 16, 16, dtype=BF16),
                value=torch.randn(40, 2, 16, 16, dtype=BF16),
                block_size=16,
                block_table=torch.arange(40, dtype=torch.int32).view(2, 20),
            )
        ),
    ),
    "per-sequence query lengths in TND": (
        "FIA.tnd_seq_lengths",
        lambda: fia(**gqa_args(actual_seq_lengths=[4, 1])),
    ),
    "int64 block table": (
        "FIA.block_table_dtype",
        lambda: fia(**gqa_args(block_table=torch.tensor([[0, 1], [2, 3]]))),
    ),
    "block table too narrow": (
        "FIA.block_table_shape",
        lambda: fia(**gqa_args(actual_seq_lengths_kv=[300, 130])),
    ),
    "too few cache blocks": (
        "FIA.blocknum",
        lambda: fia(
            **gqa_args(
                key=torch.randn(2, 2, 128, 16, dtype=BF16),
                value=torch.randn(2, 2, 128, 16, dtype=BF16),
                block_table=torch.tensor([[0, 1], [0, 1]], dtype=torch.int32),
            )
        ),
    ),
    "head dim not 16-aligned": (
        "FIA.d_align",
        lambda: fia(
            **gqa_args(
                query=torch.randn(5, 4, 12, dtype=BF16),
                key=torch.randn(4, 2, 128, 12, dtype=BF16),
                value=torch.randn(4, 2, 128, 12, dtype=BF16),
            )
        ),
    ),
    "5 query heads over 2 KV heads": (
        "FIA.heads",
        lambda: fia(**gqa_args(query=torch.randn(5, 5, 16, dtype=BF16), num_heads=5)),
    ),
    "dense TND over 65536 rows": (
        "FIA.tnd_dense_t",
        lambda: dense(n=8, d=192, dv=128, t=65537, kv_t=7, actual_seq_lengths=[2, 65537]),
    ),
    "dense TND with 4 heads": ("FIA.tnd_dense_heads", lambda: dense(n=4)),
    "dense TND with grouped KV heads": ("FIA.tnd_dense_heads", lambda: dense(n=16, kv_heads=8)),
    "dense TND with head size 128": ("FIA.tnd_dense_d", lambda: dense(d=128, dv=128)),
    "dense TND with V head size 64": ("FIA.tnd_dense_d", lambda: dense(dv=64)),
    "dense TND in float16": ("FIA.tnd_dense_dtype", lambda: dense(dtype=torch.float16)),
    "dense TND sparse mode 2": ("FIA.tnd_dense_sparse", lambda: dense(sparse_mode=2)),
    "dense TND no mask mode with a mask": (
        "FIA.tnd_dense_sparse",
        lambda: dense(causal=False, atten_mask=MASK),
    ),
    "paged KV of different shapes": (
        "FIA.kv_same_shape",
        lambda: fia(**gqa_args(value=torch.randn(4, 2, 128, 32, dtype=BF16))),
    ),
    "MLA with 16 query heads": ("FIA.rope_query", lambda: mla(heads=16)),
    "MLA latent 256": ("FIA.rope_query", lambda: mla(latent=256)),
    "MLA key in (blocks, block_size, 1, D) read as KV_N = block_size": (
        "FIA.rope_key",
        lambda: mla(token_major=True),
    ),
    "strided MLA query_rope": (
        "FIA.rope_contiguous",
        lambda: mla(query_rope=torch.randn(1, 32, 1, 128, dtype=BF16)[..., :64]),
    ),
    "strided cache for ReshapeAndCache": (
        "RAC.cache_contiguous",
        lambda: rac(
            key_cache=torch.zeros(2, 16, 2, 8, dtype=BF16)[:, :, :1],
            value_cache=torch.zeros(2, 16, 1, 4, dtype=BF16),
        ),
    ),
    "int64 slots for ReshapeAndCache": ("RAC.shapes", lambda: rac(slot_indices=torch.tensor([0, 1, 2]))),
    "padding slot -1 for ReshapeAndCache": (
        "PROJECT.valid_slots",
        lambda: rac(slot_indices=torch.tensor([0, -1, 2], dtype=torch.int32)),
    ),
    "mixed dtypes for ReshapeAndCache": ("RAC.dtypes", lambda: rac(key=torch.randn(3, 1, 8))),
    "scatter into a strided cache": (
        "PROJECT.no_hidden_cache_copy",
        lambda: torch_npu.npu_scatter_nd_update_(
            torch.zeros(4, 3, 2)[:, :2], torch.zeros(2, 2, dtype=torch.int64), torch.zeros(2, 2)
        ),
    ),
    "scatter updates of the wrong shape": (
        "SNU.updates_shape",
        lambda: torch_npu.npu_scatter_nd_update_(
            torch.zeros(4, 3, 2), torch.zeros(2, 2, dtype=torch.int64), torch.zeros(2, 3)
        ),
    ),
    "grouped matmul groups past x's rows": ("GMM.single_tensor", lambda: gmm(x_rows=5)),
    "grouped matmul decreasing group list": (
        "GMM.group_list",
        lambda: gmm(group_list=(5, 6), x_rows=6) and gmm(group_list=(6, 2)),
    ),
    "grouped matmul int32 group list": (
        "GMM.group_list_dtype",
        lambda: torch_npu.npu_grouped_matmul(
            [torch.randn(6, 8, dtype=BF16)],
            [torch.randn(2, 8, 4, dtype=BF16)],
            group_list=torch.tensor([2, 6], dtype=torch.int32),
            split_item=2,
            group_type=0,
        ),
    ),
    "grouped matmul with a permuted weight": (
        "GMM.weight_transpose",
        lambda: gmm(weight=torch.randn(8, 2, 4, dtype=BF16).transpose(0, 1)),
    ),
    "per-token grouped matmul with a float32 scale for bfloat16 output": (
        "GMM.pertoken_dtypes",
        lambda: qgmm(scale_dtype=torch.float32),
    ),
    "per-token grouped matmul with a scale per group row": (
        "GMM.pertoken_formula",
        lambda: qgmm(scale_cols=1),
    ),
    "A8W4 grouped matmul with an input size not a multiple of 256": ("GMM.a8w4_k", lambda: a8w4(k=128)),
    "A8W4 grouped matmul with one scale per expert and channel": (
        "GMM.a8w4_scale_shape",
        lambda: a8w4(scale=torch.ones(2, 8, dtype=torch.int64)),
    ),
    "A8W4 grouped matmul with a float32 scale": (
        "GMM.a8w4_dtypes",
        lambda: a8w4(scale=torch.ones(2, 1, 8)),
    ),
    "A8W4 grouped matmul without its offset term": ("GMM.a8w4_dtypes", lambda: a8w4(bias=None)),
    "A8W4 grouped matmul with a bias per row": ("GMM.a8w4_bias", lambda: a8w4(bias=[torch.zeros(2, 1, 8)])),
    "A8W4 grouped matmul with cumulative group ends past its rows": (
        "GMM.a8w4_counts",
        lambda: a8w4(counts=(2, 5), group_list_type=0),
    ),
    "int4 packing of values outside [-8, 7]": (
        "I4P.weight",
        lambda: torch_npu.npu_convert_weight_to_int4pack(torch.full((2, 8), 8, dtype=torch.int32)),
    ),
    "int4 packing of a last dim not a multiple of 8": (
        "I4P.weight",
        lambda: torch_npu.npu_convert_weight_to_int4pack(torch.zeros(2, 12, dtype=torch.int32)),
    ),
    "quant matmul of float inputs": (
        "QMM.x1",
        lambda: torch_npu.npu_quant_matmul(
            torch.randn(2, 8, dtype=BF16), torch.randn(8, 4, dtype=BF16), torch.ones(4), output_dtype=BF16
        ),
    ),
    "quant matmul with a scale of the wrong length": ("QMM.scale", lambda: qmm(scale=torch.ones(3))),
    "quant matmul with a per-token scale per column": (
        "QMM.pertoken",
        lambda: qmm(pertoken_scale=torch.ones(4)),
    ),
    "quant matmul with a float bias for float16 output without per-token scale": (
        "QMM.combinations",
        lambda: qmm(bias=torch.ones(4, dtype=torch.float16), output_dtype=torch.float16),
    ),
    "dynamic quant of float32": ("DQ.x", lambda: torch_npu.npu_dynamic_quant(torch.randn(2, 8))),
    "quantize with zero points unlike the scales": (
        "QZ.zero_points",
        lambda: torch_npu.npu_quantize(
            torch.randn(2, 8), torch.ones(8), torch.zeros(8, dtype=BF16), torch.qint8, -1, False
        ),
    ),
    "quantize with scales of the wrong length": (
        "QZ.scales_shape",
        lambda: torch_npu.npu_quantize(torch.randn(2, 8), torch.ones(3), None, torch.qint8, -1, False),
    ),
    "rms_norm gamma in another dtype": (
        "RMS.gamma",
        lambda: torch_npu.npu_rms_norm(torch.randn(3, 8, dtype=BF16), torch.ones(8)),
    ),
    "rms_norm on a vector": ("RMS.self", lambda: torch_npu.npu_rms_norm(torch.randn(8), torch.ones(8))),
    "add_rms_norm of different shapes": (
        "ADDRMS.formula",
        lambda: torch_npu.npu_add_rms_norm(torch.randn(3, 8), torch.randn(1, 8), torch.ones(8)),
    ),
    "add_rms_norm gamma of the wrong size": (
        "ADDRMS.gamma",
        lambda: torch_npu.npu_add_rms_norm(torch.randn(3, 8), torch.randn(3, 8), torch.ones(4)),
    ),
    "rotary_mul on a 3-D input": (
        "ROPE.input",
        lambda: torch_npu.npu_rotary_mul(
            torch.randn(3, 2, 8), torch.ones(1, 3, 1, 8), torch.zeros(1, 3, 1, 8)
        ),
    ),
    "rotary_mul interleave with per-batch tables": (
        "ROPE.interleave_tables",
        lambda: torch_npu.npu_rotary_mul(
            torch.randn(2, 3, 2, 8), torch.ones(2, 3, 1, 8), torch.zeros(2, 3, 1, 8), "interleave"
        ),
    ),
    "rotary_mul with an odd head size": (
        "ROPE.half",
        lambda: torch_npu.npu_rotary_mul(
            torch.randn(1, 3, 2, 7), torch.ones(1, 3, 1, 7), torch.zeros(1, 3, 1, 7)
        ),
    ),
    "rotary_mul tables outside [-1, 1]": (
        "ROPE.range",
        lambda: torch_npu.npu_rotary_mul(
            torch.randn(1, 3, 2, 8), torch.full((1, 3, 1, 8), 2.0), torch.zeros(1, 3, 1, 8)
        ),
    ),
    "init_routing with int64 expert ids": (
        "IR2.expert_idx",
        lambda: init_routing(ids=torch.tensor([[0, 1], [2, 3]])),
    ),
    "init_routing with an expert id past expert_num": (
        "IR2.expert_idx",
        lambda: init_routing(ids=torch.tensor([[0, 4], [2, 3]], dtype=torch.int32)),
    ),
    "init_routing without the counts": (
        "IR2.tokens_num_flag",
        lambda: init_routing(expert_tokens_num_flag=False),
    ),
    "init_routing past the experts": ("IR2.active_range", lambda: init_routing(active_expert_range=[0, 5])),
    "finalize_routing with float32 scales for bf16 rows": (
        "FR.scales",
        lambda: torch_npu.npu_moe_finalize_routing(
            torch.randn(4, 8, dtype=BF16),
            None,
            None,
            None,
            torch.rand(2, 2),
            torch.arange(4, dtype=torch.int32),
            None,
        ),
    ),
    "finalize_routing with a -1 row index": (
        "FR.index",
        lambda: torch_npu.npu_moe_finalize_routing(
            torch.randn(4, 8),
            None,
            None,
            None,
            torch.rand(2, 2),
            torch.tensor([0, 1, 2, -1], dtype=torch.int32),
            None,
        ),
    ),
}


@pytest.mark.parametrize("case", VIOLATIONS)
def test_documented_violation_is_refused(case):
    rule, call = VIOLATIONS[case]
    with pytest.raises(ContractViolation) as info:
        call()
    assert f"[{rule};" in str(info.value)


def test_unmodelled_arguments_are_refused_not_guessed():
    with pytest.raises(NotImplementedError, match="pse_shift"):
        fia(**gqa_args(pse_shift=torch.zeros(1, 4, 5, 256, dtype=BF16)))
