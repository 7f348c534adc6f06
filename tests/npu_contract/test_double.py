"""The torch_npu contract double itself: its schemas are the pinned wheel's, its rules
quote the wheel's docs, it rejects each documented violation, and its semantics
equal brute-force computations that share no code with it."""

from __future__ import annotations

import json
import math
import zipfile

import pytest
import torch

from tests.npu_contract import extract_schemas
from tests.npu_contract import wheel as npu_wheel

torch_npu = pytest.importorskip("torch_npu")
if not getattr(torch_npu, "IS_CONTRACT_DOUBLE", False):
    pytest.skip("the real torch_npu is active on this host", allow_module_level=True)

from torch_npu import _contract, _rules  # noqa: E402
from torch_npu._rules import ContractViolation  # noqa: E402

BF16 = torch.bfloat16
MASK = torch.ones(2048, 2048, dtype=torch.bool).triu(1)


@pytest.fixture(scope="module")
def wheel_zip():
    with zipfile.ZipFile(npu_wheel.fetch()) as zf:
        yield zf


# -- provenance ----------------------------------------------------------------------------
def test_schemas_are_the_pinned_wheels(wheel_zip):
    committed = json.loads((npu_wheel.HERE / "schemas.json").read_text())
    regenerated = extract_schemas.extract(npu_wheel.fetch(), None, None)
    assert regenerated["torch_npu"] == committed["torch_npu"]
    assert regenerated["schemas"]["npu"] == committed["schemas"]["npu"]
    header = wheel_zip.read(extract_schemas.ATB_HEADER).decode()
    decls = extract_schemas._atb_cpp_declarations(header)
    for key, text in committed["schemas"]["atb"].items():
        if committed["atb_sources"][key] == "libop_plugin_atb.so":
            assert regenerated["schemas"]["atb"][key] == text
        else:  # taken from op-plugin sources: must still agree with the wheel's C++ header
            assert extract_schemas._agrees_with_header(text, decls), key


def test_every_cited_quote_is_in_the_wheels_docs(wheel_zip):
    cited = [r for r in _rules.RULES.values() if r.in_wheel]
    assert len(cited) > 30
    missing = [r.id for r in cited if r.quote not in wheel_zip.read(r.source).decode()]
    assert not missing, f"rules quoting text the wheel's docs do not contain: {missing}"


def test_names_and_schemas_are_torch_npus():
    assert torch_npu.npu_fused_infer_attention_score is torch.ops.npu.npu_fused_infer_attention_score
    assert torch_npu._npu_reshape_and_cache is torch.ops.atb._npu_reshape_and_cache
    assert torch_npu.atb.npu_multi_head_latent_attention is torch.ops.atb.npu_multi_head_latent_attention
    q = torch.zeros(1, 2, 16, dtype=BF16)
    with pytest.raises(Exception, match="positional argument"):  # num_heads is keyword-only
        torch_npu.npu_fused_infer_attention_score(q, q, q, 2)
    with pytest.raises(Exception):  # noqa: B017  (the dispatcher's error type is torch's to choose)
        torch_npu.npu_fused_infer_attention_score(q, q, q, num_head=2)  # a misspelt keyword
    with pytest.raises(NotImplementedError):  # a registered op the project does not call has no kernel
        torch_npu.npu_gemma_rms_norm(torch.zeros(2, 4), torch.ones(4))


def test_meta_comparison_catches_a_wrong_output_shape():
    overload = torch.ops.npu.npu_swiglu.default
    full = {"input": torch.zeros(3, 8), "dim": -1}
    _contract._compare_with_meta("npu::npu_swiglu", overload, overload._schema, full, torch.zeros(3, 4))
    with pytest.raises(AssertionError, match="meta function"):
        _contract._compare_with_meta("npu::npu_swiglu", overload, overload._schema, full, torch.zeros(3, 8))


# -- rules: each documented violation is refused, naming its rule --------------------------
def _gqa_args(**change):
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


def _fia(**kw):
    q, k, v = kw.pop("query"), kw.pop("key"), kw.pop("value")
    return torch_npu.npu_fused_infer_attention_score(q, k, v, **kw)


_V2_NAMES = {
    "num_heads": "num_query_heads",
    "scale": "softmax_scale",
    "actual_seq_lengths": "actual_seq_qlen",
    "actual_seq_lengths_kv": "actual_seq_kvlen",
}


def _fia_v2(**kw):
    """The same call through v2's names (v1's _gqa_args), plus v2-only arguments."""
    q, k, v = kw.pop("query"), kw.pop("key"), kw.pop("value")
    kw = {_V2_NAMES.get(name, name): value for name, value in kw.items()}
    return torch_npu.npu_fused_infer_attention_score_v2(q, k, v, **kw)


def _sink(n=4, dtype=BF16):
    return torch.randn(n, dtype=dtype)


def _mla(heads=32, latent=512, token_major=False, **change):
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


def _rac(**change):
    args = dict(
        key=torch.randn(3, 1, 8, dtype=BF16),
        value=torch.randn(3, 1, 4, dtype=BF16),
        key_cache=torch.zeros(2, 16, 1, 8, dtype=BF16),
        value_cache=torch.zeros(2, 16, 1, 4, dtype=BF16),
        slot_indices=torch.tensor([0, 17, 31], dtype=torch.int32),
    )
    args.update(change)
    return torch_npu._npu_reshape_and_cache(**args)


def _gmm(x_rows=6, group_list=(2, 6), weight=None, **kw):
    weight = torch.randn(2, 8, 4, dtype=BF16) if weight is None else weight
    return torch_npu.npu_grouped_matmul(
        [torch.randn(x_rows, 8, dtype=BF16)],
        [weight],
        group_list=torch.tensor(group_list),
        split_item=2,
        group_type=0,
        **kw,
    )


def _init_routing(ids=None, **change):
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


def _krrc(tokens=2, blocks=2, **change):
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


def _irope(x=None, cos=None):
    x = torch.randn(3, 4, 1, 64, dtype=BF16) if x is None else x
    cos = torch.ones(3, 1, 1, 64, dtype=BF16) if cos is None else cos
    return torch_npu.npu_interleave_rope(x, cos, cos.clone())


VIOLATIONS = {
    "sink in float32": ("FIA2.sink", lambda: _fia_v2(**_gqa_args(learnable_sink=_sink(dtype=torch.float32)))),
    "a sink per KV head": ("FIA2.sink", lambda: _fia_v2(**_gqa_args(learnable_sink=_sink(2)))),
    "sink with head size 256": (
        "FIA2.sink_d",
        lambda: _fia_v2(
            **_gqa_args(
                query=torch.randn(5, 4, 256, dtype=BF16),
                key=torch.randn(4, 2, 128, 256, dtype=BF16),
                value=torch.randn(4, 2, 128, 256, dtype=BF16),
                learnable_sink=_sink(),
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
    "latent prolog: float32 kv": ("KRRC.kv", lambda: _krrc(kv=torch.randn(2, 1, 1, 576))),
    "latent prolog: latent 256": (
        "KRRC.sizes",
        lambda: _krrc(kv=torch.randn(2, 1, 1, 320, dtype=BF16), gamma=torch.ones(256, dtype=BF16)),
    ),
    "latent prolog: cos for one token": (
        "KRRC.cos_sin",
        lambda: _krrc(cos=torch.ones(1, 1, 1, 64, dtype=BF16)),
    ),
    "latent prolog: int32 index": (
        "KRRC.index",
        lambda: _krrc(index=torch.tensor([16, 17], dtype=torch.int32)),
    ),
    "latent prolog: a repeated slot": ("KRRC.index_unique", lambda: _krrc(index=torch.tensor([16, 16]))),
    "latent prolog: a padding slot": ("PROJECT.valid_slots", lambda: _krrc(index=torch.tensor([16, -1]))),
    "latent prolog: two heads in the rope cache": (
        "KRRC.cache",
        lambda: _krrc(k_cache=torch.zeros(2, 16, 2, 64, dtype=BF16)),
    ),
    "latent prolog: strided latent cache": (
        "PROJECT.no_hidden_cache_copy",
        lambda: _krrc(ckv_cache=torch.zeros(2, 16, 1, 1024, dtype=BF16)[..., :512]),
    ),
    "interleave rope: strided x": (
        "IROPE.x",
        lambda: _irope(x=torch.randn(3, 4, 1, 128, dtype=BF16)[..., :64]),
    ),
    "interleave rope: float32 tables": ("IROPE.cos_sin", lambda: _irope(cos=torch.ones(3, 1, 1, 64))),
    "interleave rope: head size 128": (
        "IROPE.dims",
        lambda: _irope(x=torch.randn(3, 4, 1, 128, dtype=BF16), cos=torch.ones(3, 1, 1, 128, dtype=BF16)),
    ),
    "float32 query": ("FIA.query", lambda: _fia(**_gqa_args(query=torch.randn(5, 4, 16)))),
    "strided key cache": (
        "FIA.key",
        lambda: _fia(**_gqa_args(key=torch.randn(4, 128, 2, 16, dtype=BF16).transpose(1, 2))),
    ),
    "causal mode without the mask": ("FIA.mask_2048", lambda: _fia(**_gqa_args(atten_mask=None))),
    "a 1024 mask": ("FIA.mask_2048", lambda: _fia(**_gqa_args(atten_mask=MASK[:1024, :1024].contiguous()))),
    "a lower-triangle mask": ("FIA.sparse_3", lambda: _fia(**_gqa_args(atten_mask=MASK.T.contiguous()))),
    "band with a lower-triangle mask": (
        "FIA.sparse_4",
        lambda: _fia(**_gqa_args(sparse_mode=4, pre_tokens=7, next_tokens=0, atten_mask=MASK.T.contiguous())),
    ),
    "band with negative pre_tokens": (
        "FIA.band_rows",
        lambda: _fia(**_gqa_args(sparse_mode=4, pre_tokens=-1, next_tokens=0)),
    ),
    "band leaving a query row without keys": (  # batch 1: 1 query over 130 keys, next_tokens -130
        "FIA.band_rows",
        lambda: _fia(**_gqa_args(sparse_mode=4, pre_tokens=200, next_tokens=-130)),
    ),
    "a defaultMask in TND": (  # vllm-ascend #15503: ignored past KV position 512 in paged decode
        "FIA.tnd_sparse",
        lambda: _fia(**_gqa_args(sparse_mode=0, atten_mask=torch.zeros(2, 1, 4, 256, dtype=torch.bool))),
    ),
    "the causal mode without a mask in TND": ("FIA.tnd_sparse", lambda: _fia(**_gqa_args(sparse_mode=1))),
    "block size 16 in prefill": (
        "FIA.pa_block_size",
        lambda: _fia(
            **_gqa_args(
                key=torch.randn(40, 2, 16, 16, dtype=BF16),
                value=torch.randn(40, 2, 16, 16, dtype=BF16),
                block_size=16,
                block_table=torch.arange(40, dtype=torch.int32).view(2, 20),
            )
        ),
    ),
    "per-sequence query lengths in TND": (
        "FIA.tnd_seq_lengths",
        lambda: _fia(**_gqa_args(actual_seq_lengths=[4, 1])),
    ),
    "int64 block table": (
        "FIA.block_table_dtype",
        lambda: _fia(**_gqa_args(block_table=torch.tensor([[0, 1], [2, 3]]))),
    ),
    "block table too narrow": (
        "FIA.block_table_shape",
        lambda: _fia(**_gqa_args(actual_seq_lengths_kv=[300, 130])),
    ),
    "too few cache blocks": (
        "FIA.blocknum",
        lambda: _fia(
            **_gqa_args(
                key=torch.randn(2, 2, 128, 16, dtype=BF16),
                value=torch.randn(2, 2, 128, 16, dtype=BF16),
                block_table=torch.tensor([[0, 1], [0, 1]], dtype=torch.int32),
            )
        ),
    ),
    "head dim not 16-aligned": (
        "FIA.d_align",
        lambda: _fia(
            **_gqa_args(
                query=torch.randn(5, 4, 12, dtype=BF16),
                key=torch.randn(4, 2, 128, 12, dtype=BF16),
                value=torch.randn(4, 2, 128, 12, dtype=BF16),
            )
        ),
    ),
    "5 query heads over 2 KV heads": (
        "FIA.heads",
        lambda: _fia(**_gqa_args(query=torch.randn(5, 5, 16, dtype=BF16), num_heads=5)),
    ),
    "dense TND over 65536 rows": (
        "FIA.tnd_dense_t",
        lambda: _dense(n=8, d=192, dv=128, t=65537, kv_t=7, actual_seq_lengths=[2, 65537]),
    ),
    "dense TND with 4 heads": ("FIA.tnd_dense_heads", lambda: _dense(n=4)),
    "dense TND with grouped KV heads": ("FIA.tnd_dense_heads", lambda: _dense(n=16, kv_heads=8)),
    "dense TND with head size 128": ("FIA.tnd_dense_d", lambda: _dense(d=128, dv=128)),
    "dense TND with V head size 64": ("FIA.tnd_dense_d", lambda: _dense(dv=64)),
    "dense TND in float16": ("FIA.tnd_dense_dtype", lambda: _dense(dtype=torch.float16)),
    "dense TND sparse mode 2": ("FIA.tnd_dense_sparse", lambda: _dense(sparse_mode=2)),
    "dense TND no mask mode with a mask": (
        "FIA.tnd_dense_sparse",
        lambda: _dense(causal=False, atten_mask=MASK),
    ),
    "paged KV of different shapes": (
        "FIA.kv_same_shape",
        lambda: _fia(**_gqa_args(value=torch.randn(4, 2, 128, 32, dtype=BF16))),
    ),
    "MLA with 16 query heads": ("FIA.rope_query", lambda: _mla(heads=16)),
    "MLA latent 256": ("FIA.rope_query", lambda: _mla(latent=256)),
    "MLA key in (blocks, block_size, 1, D) read as KV_N = block_size": (
        "FIA.rope_key",
        lambda: _mla(token_major=True),
    ),
    "strided MLA query_rope": (
        "FIA.rope_contiguous",
        lambda: _mla(query_rope=torch.randn(1, 32, 1, 128, dtype=BF16)[..., :64]),
    ),
    "strided cache for ReshapeAndCache": (
        "RAC.cache_contiguous",
        lambda: _rac(
            key_cache=torch.zeros(2, 16, 2, 8, dtype=BF16)[:, :, :1],
            value_cache=torch.zeros(2, 16, 1, 4, dtype=BF16),
        ),
    ),
    "int64 slots for ReshapeAndCache": ("RAC.shapes", lambda: _rac(slot_indices=torch.tensor([0, 1, 2]))),
    "padding slot -1 for ReshapeAndCache": (
        "PROJECT.valid_slots",
        lambda: _rac(slot_indices=torch.tensor([0, -1, 2], dtype=torch.int32)),
    ),
    "mixed dtypes for ReshapeAndCache": ("RAC.dtypes", lambda: _rac(key=torch.randn(3, 1, 8))),
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
    "grouped matmul groups past x's rows": ("GMM.single_tensor", lambda: _gmm(x_rows=5)),
    "grouped matmul decreasing group list": (
        "GMM.group_list",
        lambda: _gmm(group_list=(5, 6), x_rows=6) and _gmm(group_list=(6, 2)),
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
        lambda: _gmm(weight=torch.randn(8, 2, 4, dtype=BF16).transpose(0, 1)),
    ),
    "per-token grouped matmul with a float32 scale for bfloat16 output": (
        "GMM.pertoken_dtypes",
        lambda: _qgmm(scale_dtype=torch.float32),
    ),
    "per-token grouped matmul with a scale per group row": (
        "GMM.pertoken_formula",
        lambda: _qgmm(scale_cols=1),
    ),
    "quant matmul of float inputs": (
        "QMM.x1",
        lambda: torch_npu.npu_quant_matmul(
            torch.randn(2, 8, dtype=BF16), torch.randn(8, 4, dtype=BF16), torch.ones(4), output_dtype=BF16
        ),
    ),
    "quant matmul with a scale of the wrong length": ("QMM.scale", lambda: _qmm(scale=torch.ones(3))),
    "quant matmul with a per-token scale per column": (
        "QMM.pertoken",
        lambda: _qmm(pertoken_scale=torch.ones(4)),
    ),
    "quant matmul with a float bias for float16 output without per-token scale": (
        "QMM.combinations",
        lambda: _qmm(bias=torch.ones(4, dtype=torch.float16), output_dtype=torch.float16),
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
        lambda: _init_routing(ids=torch.tensor([[0, 1], [2, 3]])),
    ),
    "init_routing with an expert id past expert_num": (
        "IR2.expert_idx",
        lambda: _init_routing(ids=torch.tensor([[0, 4], [2, 3]], dtype=torch.int32)),
    ),
    "init_routing without the counts": (
        "IR2.tokens_num_flag",
        lambda: _init_routing(expert_tokens_num_flag=False),
    ),
    "init_routing past the experts": ("IR2.active_range", lambda: _init_routing(active_expert_range=[0, 5])),
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


def _qmm(**kw):
    args = dict(scale=torch.ones(4), pertoken_scale=None, bias=None, output_dtype=BF16)
    args.update(kw)
    return torch_npu.npu_quant_matmul(
        torch.ones(2, 8, dtype=torch.int8), torch.ones(8, 4, dtype=torch.int8), args.pop("scale"), **args
    )


def _qgmm(scale_dtype=BF16, scale_cols=4):
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


@pytest.mark.parametrize("case", VIOLATIONS)
def test_documented_violation_is_refused(case):
    rule, call = VIOLATIONS[case]
    with pytest.raises(ContractViolation) as info:
        call()
    assert f"[{rule};" in str(info.value)


def test_unmodelled_arguments_are_refused_not_guessed():
    with pytest.raises(NotImplementedError, match="pse_shift"):
        _fia(**_gqa_args(pse_shift=torch.zeros(1, 4, 5, 256, dtype=BF16)))


# -- semantics against brute force ----------------------------------------------------------
def _brute_attention(q, k, v, scale, visible):
    """q [S, N, D], k/v [L, KVN, D]: softmax over the ``visible(i)`` first keys, head by head."""
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float64)
    group = q.shape[1] // k.shape[1]
    for i in range(q.shape[0]):
        for h in range(q.shape[1]):
            n = visible(i)
            scores = k[:n, h // group].double() @ q[i, h].double() * scale
            out[i, h] = torch.softmax(scores, 0) @ v[:n, h // group].double()
    return out


@pytest.mark.parametrize("cache_format", ["blocknum,KV_N,blocksize,D", "blocknum,blocksize,H"])
def test_paged_gqa_attention_semantics(cache_format):
    torch.manual_seed(0)
    nb, kvn, bs, d, n = 6, 2, 128, 16, 4
    seqs = [(130, 3), (5, 1), (257, 2)]  # (kv_len, q_len): chunked prefill, decode, prefix hit
    table = torch.tensor([[4, 1, 0], [2, 0, 0], [3, 5, 0]], dtype=torch.int32)
    keys = [torch.randn(L, kvn, d, dtype=BF16) for L, _ in seqs]
    vals = [torch.randn(L, kvn, d, dtype=BF16) for L, _ in seqs]
    kc = torch.zeros(nb, kvn, bs, d, dtype=BF16)
    vc = torch.zeros_like(kc)
    for r, (L, _) in enumerate(seqs):
        for p in range(L):
            kc[table[r, p // bs], :, p % bs] = keys[r][p]
            vc[table[r, p // bs], :, p % bs] = vals[r][p]
    if cache_format == "blocknum,blocksize,H":
        kc, vc = kc.transpose(1, 2).reshape(nb, bs, kvn * d), vc.transpose(1, 2).reshape(nb, bs, kvn * d)
    qs = [torch.randn(q, n, d, dtype=BF16) for _, q in seqs]
    cum = torch.tensor([q for _, q in seqs]).cumsum(0).tolist()
    # two more blocks than the batch needs are in the cache, so table rows may be short
    out, _ = torch_npu.npu_fused_infer_attention_score(
        torch.cat(qs),
        kc,
        vc,
        num_heads=n,
        num_key_value_heads=kvn,
        input_layout="TND",
        block_table=table,
        block_size=bs,
        actual_seq_lengths=cum,
        actual_seq_lengths_kv=[L for L, _ in seqs],
        atten_mask=MASK,
        sparse_mode=3,
        scale=0.3,
    )
    start = 0
    for r, (L, q_len) in enumerate(seqs):
        expected = _brute_attention(
            qs[r], keys[r], vals[r], 0.3, lambda i, L=L, q_len=q_len: L - q_len + i + 1
        )
        torch.testing.assert_close(out[start : start + q_len].double(), expected, rtol=2e-2, atol=2e-2)
        start += q_len


def test_mla_form_semantics():
    torch.manual_seed(1)
    nb, bs, heads, seq = 3, 128, 32, 150
    latent = torch.randn(nb, 1, bs, 512, dtype=BF16)
    rope = torch.randn(nb, 1, bs, 64, dtype=BF16)
    table = torch.tensor([[2, 0]], dtype=torch.int32)
    q, q_rope = torch.randn(1, heads, 1, 512, dtype=BF16), torch.randn(1, heads, 1, 64, dtype=BF16)
    out, _ = torch_npu.npu_fused_infer_attention_score(
        q,
        latent,
        latent,
        query_rope=q_rope,
        key_rope=rope,
        num_heads=heads,
        num_key_value_heads=1,
        input_layout="BNSD",
        scale=0.05,
        block_table=table,
        block_size=bs,
        actual_seq_lengths_kv=[seq],
    )
    rows = torch.cat([latent[2, 0], latent[0, 0]])[:seq].double()
    rope_rows = torch.cat([rope[2, 0], rope[0, 0]])[:seq].double()
    for h in range(heads):
        scores = (rows @ q[0, h, 0].double() + rope_rows @ q_rope[0, h, 0].double()) * 0.05
        expected = torch.softmax(scores, 0) @ rows
        torch.testing.assert_close(out[0, h, 0].double(), expected, rtol=2e-2, atol=2e-2)


def _paged_batch(seqs, kvn=2, n=4, d=16, bs=128, seed=3):
    """(query, key cache, value cache, block table, per-request keys and values) for
    ``seqs`` of (kv_len, q_len), each request's blocks laid out from block 1 on."""
    torch.manual_seed(seed)
    per = max(-(-kv // bs) for kv, _ in seqs)
    table = torch.arange(1, 1 + per * len(seqs), dtype=torch.int32).view(len(seqs), per)
    kc = torch.zeros(1 + per * len(seqs), kvn, bs, d, dtype=BF16)
    vc = torch.zeros_like(kc)
    keys = [torch.randn(kv, kvn, d, dtype=BF16) for kv, _ in seqs]
    vals = [torch.randn(kv, kvn, d, dtype=BF16) for kv, _ in seqs]
    for r, (kv, _) in enumerate(seqs):
        for p in range(kv):
            kc[table[r, p // bs], :, p % bs], vc[table[r, p // bs], :, p % bs] = keys[r][p], vals[r][p]
    query = torch.randn(sum(q for _, q in seqs), n, d, dtype=BF16)
    return query, kc, vc, table, keys, vals


def _windowed_brute(q, k, v, scale, kv_len, window, sinks=None):
    """Each query row (the last rows of a kv_len sequence) over its last ``window`` keys;
    ``sinks``: one more logit per head in the softmax, with no value."""
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float64)
    group = q.shape[1] // k.shape[1]
    for i in range(q.shape[0]):
        p = kv_len - q.shape[0] + i
        lo = max(0, p - window + 1) if window else 0
        for h in range(q.shape[1]):
            scores = k[lo : p + 1, h // group].double() @ q[i, h].double() * scale
            if sinks is not None:
                scores = torch.cat([scores, sinks[h : h + 1].double()])
            out[i, h] = torch.softmax(scores, 0)[: p + 1 - lo] @ v[lo : p + 1, h // group].double()
    return out


def _check_rows(out, seqs, query, keys, vals, window, sinks=None):
    start = 0
    for r, (kv, q_len) in enumerate(seqs):
        expected = _windowed_brute(query[start : start + q_len], keys[r], vals[r], 0.3, kv, window, sinks)
        torch.testing.assert_close(out[start : start + q_len].double(), expected, rtol=2e-2, atol=2e-2)
        start += q_len


def test_sliding_window_forms_semantics():
    """Band (sparse_mode 4) aligns query row i with key KV_S - Q_S + i and keeps
    [that - pre_tokens, that + next_tokens], with one query row per request too (the
    incumbent's hardware fixes, vllm-ascend #8508: the doc's "Q_S为1...该参数无效" does not
    hold for the band in TND decode); a decode step's window as a defaultMask with sparse 0
    is refused (vllm-ascend #15503: ignored past KV position 512). One row per request without
    a mask (sparse 0) sees every key."""
    window = 7
    common = dict(num_heads=4, num_key_value_heads=2, input_layout="TND", block_size=128, scale=0.3)

    mixed = [(130, 3), (5, 1), (257, 2)]
    query, kc, vc, table, keys, vals = _paged_batch(mixed)
    cum = torch.tensor([q for _, q in mixed]).cumsum(0).tolist()
    out, _ = torch_npu.npu_fused_infer_attention_score(
        query,
        kc,
        vc,
        block_table=table,
        actual_seq_lengths=cum,
        actual_seq_lengths_kv=[kv for kv, _ in mixed],
        atten_mask=MASK,
        sparse_mode=4,
        pre_tokens=window - 1,
        next_tokens=0,
        **common,
    )
    _check_rows(out, mixed, query, keys, vals, window)

    decode = [(130, 1), (5, 1), (700, 1)]  # past window + 512 keys too
    query, kc, vc, table, keys, vals = _paged_batch(decode)
    lens = dict(
        block_table=table, actual_seq_lengths=[1, 2, 3], actual_seq_lengths_kv=[kv for kv, _ in decode]
    )
    banded, _ = torch_npu.npu_fused_infer_attention_score(
        query, kc, vc, atten_mask=MASK, sparse_mode=4, pre_tokens=window - 1, next_tokens=0, **lens, **common
    )
    _check_rows(banded, decode, query, keys, vals, window)
    plain, _ = torch_npu.npu_fused_infer_attention_score(query, kc, vc, sparse_mode=0, **lens, **common)
    _check_rows(plain, decode, query, keys, vals, None)
    width = table.shape[1] * 128
    before = torch.arange(width).unsqueeze(0) < torch.tensor([kv - window for kv, _ in decode]).unsqueeze(1)
    with pytest.raises(ContractViolation, match="FIA.tnd_sparse"):
        torch_npu.npu_fused_infer_attention_score(
            query, kc, vc, atten_mask=before.view(3, 1, 1, width), sparse_mode=0, **lens, **common
        )


def test_v2_learnable_sink_semantics():
    """v2 is v1 under new names; its learnable_sink adds one logit per query head to every
    row's softmax and attends to nothing (prompt rows with the band, and decode rows)."""
    window = 7
    common = dict(
        num_query_heads=4, num_key_value_heads=2, input_layout="TND", block_size=128, softmax_scale=0.3
    )
    sinks = torch.tensor([2.0, -1.0, 0.5, 4.0], dtype=BF16)
    for seqs, band in (([(130, 3), (5, 1), (257, 2)], True), ([(130, 1), (5, 1)], False)):
        query, kc, vc, table, keys, vals = _paged_batch(seqs)
        masks = dict(atten_mask=MASK, sparse_mode=3)
        if band:
            masks = dict(atten_mask=MASK, sparse_mode=4, pre_tokens=window - 1, next_tokens=0)
        out, _ = torch_npu.npu_fused_infer_attention_score_v2(
            query,
            kc,
            vc,
            block_table=table,
            actual_seq_qlen=torch.tensor([q for _, q in seqs]).cumsum(0).tolist(),
            actual_seq_kvlen=[kv for kv, _ in seqs],
            learnable_sink=sinks,
            **masks,
            **common,
        )
        _check_rows(out, seqs, query, keys, vals, window if band else None, sinks)
        with pytest.raises(AssertionError):  # the sinks took weight
            _check_rows(out, seqs, query, keys, vals, window if band else None)


def test_clipped_swiglu_semantics():
    """Interleaved (gate at even columns) and halved splits; the gate clamped above at
    ``limit``, the linear part to [-limit, limit], y = A * sigmoid(alpha * A) * (B + bias)."""
    x = (torch.randn(5, 12) * 6).to(BF16)
    for interleaved in (True, False):
        y = torch_npu.npu_clipped_swiglu(x, alpha=1.5, limit=4.0, bias=0.5, interleaved=interleaved)
        h = x.double()
        a, b = (h[:, 0::2], h[:, 1::2]) if interleaved else (h[:, :6], h[:, 6:])
        a, b = a.clamp(max=4.0), b.clamp(-4.0, 4.0)
        torch.testing.assert_close(y.double(), a * torch.sigmoid(1.5 * a) * (b + 0.5), rtol=2e-2, atol=2e-2)
    assert (x.abs() > 4).any()  # the clamps mattered


@pytest.mark.parametrize("causal", [True, False])
def test_tnd_without_page_attention_semantics(causal):
    """The dense TND form in its documented shape: 8 heads, Q/K head size 192, V 128."""
    torch.manual_seed(2)
    q_lens, kv_lens, n, d, dv = [2, 3], [4, 3], 8, 192, 128
    q = torch.randn(sum(q_lens), n, d, dtype=BF16)
    k, v = torch.randn(sum(kv_lens), n, d, dtype=BF16), torch.randn(sum(kv_lens), n, dv, dtype=BF16)
    out, lse = torch_npu.npu_fused_infer_attention_score(
        q,
        k,
        v,
        num_heads=n,
        num_key_value_heads=n,
        input_layout="TND",
        actual_seq_lengths=[2, 5],
        actual_seq_lengths_kv=[4, 7],
        atten_mask=MASK if causal else None,
        sparse_mode=3 if causal else 0,
        scale=1 / math.sqrt(d),
        softmax_lse_flag=True,
    )
    assert out.shape == (5, n, dv) and lse.shape == (5, n, 1)
    qs = ks = 0
    for q_len, kv_len in zip(q_lens, kv_lens):
        visible = (
            (lambda i, q_len=q_len, kv_len=kv_len: kv_len - q_len + i + 1)
            if causal
            else (lambda i, kv_len=kv_len: kv_len)
        )
        expected = _brute_attention(
            q[qs : qs + q_len], k[ks : ks + kv_len], v[ks : ks + kv_len], 1 / math.sqrt(d), visible
        )
        torch.testing.assert_close(out[qs : qs + q_len].double(), expected, rtol=2e-2, atol=2e-2)
        qs, ks = qs + q_len, ks + kv_len


def test_attention_update_lse_out_only_with_update_type_1():
    """AU.lse_out_type1: the merged lse is documented for update_type 1 only; the double
    poisons it for 0, so a caller that folds partials with update_type 0 fails its tests."""
    lses = [torch.randn(6), torch.randn(6)]
    outs = [torch.randn(6, 16), torch.randn(6, 16)]
    out0, lse0 = torch_npu.npu_attention_update(lses, outs, 0)
    out1, lse1 = torch_npu.npu_attention_update(lses, outs, 1)
    assert torch.isnan(lse0).all()
    torch.testing.assert_close(lse1, torch.logsumexp(torch.stack(lses), 0))
    torch.testing.assert_close(out0, out1)


def _dense(n=8, d=192, dv=128, t=5, kv_t=7, dtype=BF16, kv_heads=None, causal=True, **change):
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


def test_cache_write_semantics():
    key, value = torch.randn(3, 1, 8, dtype=BF16), torch.randn(3, 1, 4, dtype=BF16)
    kc, vc = torch.zeros(2, 16, 1, 8, dtype=BF16), torch.zeros(2, 16, 1, 4, dtype=BF16)
    torch_npu._npu_reshape_and_cache(
        key=key,
        value=value,
        key_cache=kc,
        value_cache=vc,
        slot_indices=torch.tensor([0, 17, 31], dtype=torch.int32),
    )
    for row, slot in enumerate([0, 17, 31]):
        assert torch.equal(kc[slot // 16, slot % 16], key[row])
        assert torch.equal(vc[slot // 16, slot % 16], value[row])
    assert int((kc != 0).any(-1).sum()) == 3
    cache = torch.zeros(3, 2, 4, 5)
    index = torch.tensor([[[1, 0, 2], [1, 1, 2]], [[0, 0, 3], [0, 1, 3]]])
    updates = torch.randn(2, 2, 5)
    assert torch_npu.npu_scatter_nd_update_(cache, index, updates) is cache
    assert torch.equal(cache[1, :, 2], updates[0]) and torch.equal(cache[0, :, 3], updates[1])
    assert int((cache != 0).any(-1).sum()) == 4


@pytest.mark.parametrize("group_list_type", [0, 1])
def test_grouped_matmul_and_swiglu_semantics(group_list_type):
    torch.manual_seed(3)
    x = torch.randn(7, 8, dtype=BF16)
    weight = torch.randn(3, 4, 8, dtype=BF16).transpose(1, 2)  # [E, K, N] as a transposed view
    counts = [2, 0, 5]
    groups = counts if group_list_type else torch.tensor(counts).cumsum(0).tolist()
    [y] = torch_npu.npu_grouped_matmul(
        [x],
        [weight],
        group_list=torch.tensor(groups),
        split_item=2,
        group_type=0,
        group_list_type=group_list_type,
    )
    rows = [e for e, c in enumerate(counts) for _ in range(c)]
    for i, e in enumerate(rows):
        torch.testing.assert_close(y[i].float(), x[i].float() @ weight[e].float(), rtol=2e-2, atol=2e-2)
    act = torch_npu.npu_swiglu(y)
    a, b = y.float()[:, :2], y.float()[:, 2:]
    torch.testing.assert_close(act.float(), a * torch.sigmoid(a) * b, rtol=2e-2, atol=2e-2)


def test_grouped_matmul_rows_past_the_groups_are_left_undefined():
    """Callers may pass more rows than the groups cover (GMM.rows_past_groups); the double
    leaves those rows NaN so a caller that uses them fails."""
    [y] = _gmm(x_rows=9, group_list=(2, 6))
    assert not y[:6].isnan().any()
    assert y[6:].isnan().all()


def test_w8a8_ops_semantics():
    """Quantize, dynamic quant and quant matmul (static and per-token) against brute force."""
    x = torch.tensor([[0.5, -1.5, 2.5, 100.0], [0.0, 0.0, 0.0, 0.0]])
    q = torch_npu.npu_quantize(x, torch.full((4,), 2.0), torch.full((4,), 1.0), torch.qint8, -1, False)
    # 0.5*2+1=2, -1.5*2+1=-2, 2.5*2+1=6, saturated to 127; zeros -> offset 1
    assert q.dtype == torch.int8 and q.tolist() == [[2, -2, 6, 127], [1, 1, 1, 1]]
    y, scale = torch_npu.npu_dynamic_quant(torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0]], dtype=BF16))
    assert scale.dtype == torch.float32 and torch.allclose(scale, torch.tensor([2.0 / 127, 0.0]))
    assert y.tolist() == [[64, -127, 32], [0, 0, 0]]  # 63.5 and 31.75 round to even / nearest
    x1 = torch.randint(-128, 128, (3, 5), dtype=torch.int8)
    x2 = torch.randint(-128, 128, (5, 2), dtype=torch.int8)
    brute = [[sum(int(x1[i, t]) * int(x2[t, j]) for t in range(5)) for j in range(2)] for i in range(3)]
    brute = torch.tensor(brute, dtype=torch.float64)
    scale, bias = torch.tensor([0.5, 0.25]), torch.tensor([10, -10], dtype=torch.int32)
    out = torch_npu.npu_quant_matmul(x1, x2, scale, bias=bias, output_dtype=BF16)
    torch.testing.assert_close(out.double(), ((brute + bias.double()) * scale.double()).to(BF16).double())
    per_token = torch.tensor([1.0, 2.0, 0.5])
    out = torch_npu.npu_quant_matmul(x1, x2, scale, pertoken_scale=per_token, output_dtype=torch.float16)
    torch.testing.assert_close(
        out.double(), (brute * scale.double() * per_token.double()[:, None]).to(torch.float16).double()
    )


# -- MC2 environment: comm_alg as the doc resolves it, HCCL_BUFFSIZE ------------------------
@pytest.fixture
def one_rank_group(tmp_path):
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    yield dist.group.WORLD.group_name
    dist.destroy_process_group()


def _mc2_dispatch(group, hidden=256, bs=4, ep=1, k=2, **change):
    args = dict(
        x=torch.randn(bs, hidden, dtype=BF16),
        expert_ids=torch.arange(k, dtype=torch.int32).repeat(bs, 1),
        group_ep=group,
        ep_world_size=ep,
        ep_rank_id=0,
        moe_expert_num=16,
        x_active_mask=torch.ones(bs, dtype=torch.bool),
        global_bs=0,
        comm_alg="fullmesh",
    )
    args.update(change)
    return torch_npu.npu_moe_distribute_dispatch_v2(**args)


@pytest.mark.parametrize(
    ("env", "change", "rule"),
    [
        # the buffer each rank needs, against HCCL_BUFFSIZE (MB; 200 unset)
        ({"HCCL_BUFFSIZE": "4"}, {}, "MC2.buffsize_a2"),
        # unset (200 MB): 2*(512*1*min(16, 16)*7168*2 + 2 MB) = 228 MB
        ({}, {"hidden": 7168, "bs": 512, "k": 16, "comm_alg": ""}, "MC2.buffsize_a2"),
        (
            {"TORCH_NPU_DOUBLE_SOC": "A3", "HCCL_BUFFSIZE": "8"},  # 16 tokens of H 7168 need 9 MB
            {"comm_alg": "", "hidden": 7168, "bs": 16},
            "MC2.buffsize_a3",
        ),
        # comm_alg per SoC; "" on A2 follows HCCL_INTRA_PCIE_ENABLE / HCCL_INTRA_ROCE_ENABLE
        ({"TORCH_NPU_DOUBLE_SOC": "A3"}, {}, "MC2.comm_alg_a3"),  # "fullmesh" is A2's name
        ({}, {"comm_alg": "fullmesh_v1"}, "MC2.comm_alg_a2"),
        (
            {"HCCL_INTRA_PCIE_ENABLE": "1", "HCCL_INTRA_ROCE_ENABLE": "0"},
            {"comm_alg": ""},
            "MC2.hierarchy_mask",
        ),
        ({}, {"comm_alg": "hierarchy", "x_active_mask": None}, "MC2.hierarchy_ep"),
        ({}, {"comm_alg": "hierarchy", "x_active_mask": None, "ep": 16}, "MC2.hierarchy_expert_scales"),
    ],
)
def test_mc2_environment_rules(one_rank_group, monkeypatch, env, change, rule):
    for name in ("HCCL_BUFFSIZE", "TORCH_NPU_DOUBLE_SOC", "HCCL_INTRA_PCIE_ENABLE", "HCCL_INTRA_ROCE_ENABLE"):
        monkeypatch.delenv(name, raising=False)
    _mc2_dispatch(one_rank_group, comm_alg="fullmesh")  # the baseline passes
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ContractViolation, match=rule.replace(".", r"\.")):
        _mc2_dispatch(one_rank_group, **change)


def test_mc2_algorithms_the_double_models(one_rank_group, monkeypatch):
    for name in ("HCCL_BUFFSIZE", "TORCH_NPU_DOUBLE_SOC", "HCCL_INTRA_PCIE_ENABLE", "HCCL_INTRA_ROCE_ENABLE"):
        monkeypatch.delenv(name, raising=False)
    _mc2_dispatch(one_rank_group, comm_alg="")  # A2 "" without the PCIe/RoCE pair: fullmesh
    monkeypatch.setenv("HCCL_INTRA_PCIE_ENABLE", "1")
    _mc2_dispatch(one_rank_group, comm_alg="fullmesh")  # explicit: the variables do not matter
    with pytest.raises(NotImplementedError, match="hierarchy"):  # allowed, but not modelled
        _mc2_dispatch(
            one_rank_group, comm_alg="hierarchy", x_active_mask=None, ep=16, expert_scales=torch.ones(4, 2)
        )
    monkeypatch.setenv("TORCH_NPU_DOUBLE_SOC", "A3")
    out = _mc2_dispatch(one_rank_group, comm_alg="", hidden=1024)
    expand_x, _, assist, _, ep_recv, _, _ = out
    with pytest.raises(ContractViolation, match=r"MC2\.combine_comm_alg_a3"):
        torch_npu.npu_moe_distribute_combine_v2(
            expand_x,
            torch.arange(2, dtype=torch.int32).repeat(4, 1),
            assist,
            ep_recv,
            torch.ones(4, 2),
            one_rank_group,
            1,
            0,
            16,
            comm_alg="fullmesh_v1",
        )


def test_hccl_group_options_are_checked(monkeypatch):
    from torch_npu._C._distributed_c10d import ProcessGroupHCCL

    from vllm.ascend.distributed import groups

    monkeypatch.setenv("VLLM_ASCEND_GROUP_HCCL_BUFFSIZE_MB", "64")
    assert groups.hccl_group_options("tp").hccl_config == {"hccl_buffer_size": 64}
    assert groups.device_group_options("mc2", "hccl") is None  # MC2 keeps HCCL_BUFFSIZE
    assert groups.device_group_options("mc2:0", "hccl") is None
    assert groups.device_group_options("tp", "gloo") is None  # host emulation
    assert groups.device_group_options("world", "hccl").hccl_config == {"hccl_buffer_size": 64}
    with pytest.raises(ContractViolation, match=r"HCCL\.buffer_size"):
        ProcessGroupHCCL.Options().hccl_config = {"hccl_buffer_size": 0}
    with pytest.raises(ContractViolation, match=r"HCCL\.buffer_size"):
        ProcessGroupHCCL.Options().hccl_config = {"hccl_buffer_size": "200"}


def test_rms_norm_semantics():
    torch.manual_seed(5)
    x, r, w = torch.randn(3, 2, 8), torch.randn(3, 2, 8), torch.randn(8)
    y, rstd = torch_npu.npu_rms_norm(x, w, 1e-5)
    want = [row / math.sqrt(sum(v * v for v in row.tolist()) / 8 + 1e-5) * w for row in x.view(-1, 8)]
    torch.testing.assert_close(y, torch.stack(want).view(3, 2, 8))
    assert rstd.shape == (3, 2, 1) and rstd.dtype == torch.float32
    y2, _, s2 = torch_npu.npu_add_rms_norm(x, r, w, 1e-5)
    torch.testing.assert_close(s2, x + r)
    torch.testing.assert_close(y2, torch_npu.npu_rms_norm(x + r, w, 1e-5)[0])


@pytest.mark.parametrize("mode", ["half", "interleave"])
def test_rotary_mul_semantics(mode):
    """Each pair of a head (the halves' i-th elements, or neighbours) turns by its angle:
    checked with complex multiplication."""
    torch.manual_seed(6)
    tokens, heads, dim = 3, 2, 8
    x = torch.randn(1, tokens, heads, dim)
    angle = torch.rand(tokens, dim // 2) * 6
    pair_angle = angle.repeat(1, 2) if mode == "half" else angle.repeat_interleave(2, dim=1)
    cos, sin = pair_angle.cos()[None, :, None], pair_angle.sin()[None, :, None]
    out = torch_npu.npu_rotary_mul(x, cos, sin, mode)
    if mode == "half":
        pairs = torch.complex(x[..., : dim // 2], x[..., dim // 2 :])
    else:
        pairs = torch.complex(x[..., 0::2], x[..., 1::2])
    turned = pairs * torch.polar(torch.ones_like(angle), angle)[None, :, None]
    if mode == "half":
        want = torch.cat((turned.real, turned.imag), dim=-1)
    else:
        want = torch.stack((turned.real, turned.imag), dim=-1).flatten(-2)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_apply_rotary_pos_emb_semantics():
    """Query and key turned in the half layout with one head of tables, both updated in place
    and returned; what the Atlas A2/A3 docs leave out is refused, naming the rule."""
    torch.manual_seed(7)
    tokens, dim = 3, 64
    q, k = torch.randn(tokens, 4, dim), torch.randn(tokens, 2, dim)
    angle = torch.rand(tokens, dim // 2) * 6
    cos, sin = angle.repeat(1, 2).cos()[:, None], angle.repeat(1, 2).sin()[:, None]
    want = [torch_npu.npu_rotary_mul(x.unsqueeze(0), cos[None], sin[None], "half")[0] for x in (q, k)]
    q_in, k_in = q.clone(), k.clone()
    q_out, k_out = torch_npu.npu_apply_rotary_pos_emb(q_in, k_in, cos, sin, layout="TND")
    for got, expected, updated in ((q_out, want[0], q_in), (k_out, want[1], k_in)):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(updated, expected, rtol=1e-5, atol=1e-5)  # in place
    cases = {
        "ARPE.mode": dict(rotary_mode="interleave"),
        "ARPE.layout": dict(layout="BNSD"),
        "ARPE.d": dict(q=torch.randn(tokens, 4, 32), k=torch.randn(tokens, 2, 32)),
        "ARPE.dtype": dict(q=q.to(BF16)),
        "ARPE.shapes": dict(
            cos=cos.expand(tokens, 2, dim).contiguous(), sin=sin.expand(tokens, 2, dim).contiguous()
        ),
        "PROJECT.in_place_contiguous": dict(q=torch.randn(tokens, 8, dim)[:, :4]),
    }
    for rule, change in cases.items():
        args = {
            "q": q.clone(),
            "k": k.clone(),
            "cos": cos,
            "sin": sin,
            "layout": "TND",
            "rotary_mode": "half",
        }
        args.update(change)
        with pytest.raises(ContractViolation, match=rf"\[{rule};"):
            torch_npu.npu_apply_rotary_pos_emb(
                args["q"],
                args["k"],
                args["cos"],
                args["sin"],
                layout=args["layout"],
                rotary_mode=args["rotary_mode"],
            )


@pytest.mark.parametrize("active", [[0, 4], [1, 3]])
def test_init_and_finalize_routing_semantics(active):
    """Init sorts each (token, slot) row by expert and counts the rows per active expert;
    the gather-type index says where each source row went. Finalize weighs and sums a
    token's rows from positions read slot-major. Checked against a per-token loop."""
    torch.manual_seed(7)
    tokens, top_k, hidden = 5, 2, 6
    x = torch.randn(tokens, hidden)
    ids = torch.stack([torch.randperm(4)[:top_k] for _ in range(tokens)]).to(torch.int32)
    rows, position, counts, _ = torch_npu.npu_moe_init_routing_v2(
        x,
        ids,
        active_num=tokens * top_k,
        expert_num=4,
        expert_tokens_num_type=1,
        expert_tokens_num_flag=True,
        active_expert_range=active,
        quant_mode=-1,
    )
    start, end = active
    flat = ids.flatten().tolist()
    assert counts.tolist() == [flat.count(e) for e in range(start, end)]
    for source, expert in enumerate(flat):
        if start <= expert < end:
            assert torch.equal(rows[int(position[source])], x[source // top_k])
        else:
            assert int(position[source]) == -1
    held = [position[s] for s, e in enumerate(flat) if start <= e < end]
    assert sorted(int(p) for p in held) == list(range(len(held)))  # the valid rows come first
    sorted_experts = [
        flat[s] for s in sorted(range(len(flat)), key=lambda s: int(position[s])) if int(position[s]) >= 0
    ]
    assert sorted_experts == sorted(sorted_experts)
    if active == [0, 4]:
        processed = rows * 2 + 1  # any per-row function of the expert input
        weights = torch.rand(tokens, top_k)
        slot_major = position.view(tokens, top_k).t().contiguous().view(-1)
        out = torch_npu.npu_moe_finalize_routing(
            processed, None, None, None, weights, slot_major, ids, 0, top_k
        )
        want = torch.stack([sum(weights[t, k] * (x[t] * 2 + 1) for k in range(top_k)) for t in range(tokens)])
        torch.testing.assert_close(out, want)


def test_latent_prolog_and_interleave_rope_semantics():
    """Both ops normalise/rotate as documented: the rope part's pairs (neighbours in the
    input) each turn by their angle (checked with complex multiplication) and come out
    de-interleaved (the pairs' first elements, then their second); the latent part is
    RMS-normed; both land at the index's slots and nowhere else."""
    torch.manual_seed(7)
    tokens = 3
    kv = torch.randn(tokens, 1, 1, 576)
    angle = torch.rand(tokens, 32) * 6
    cos, sin = angle.cos().repeat(1, 2), angle.sin().repeat(1, 2)  # the half layout's tables
    pairs = torch.complex(kv[:, 0, 0, 512::2], kv[:, 0, 0, 513::2]) * torch.polar(
        torch.ones_like(angle), angle
    )
    want_rope = torch.cat((pairs.real, pairs.imag), dim=-1)
    gamma = torch.rand(512) + 0.5
    latent = kv[:, 0, 0, :512]
    want_latent = latent / latent.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt() * gamma
    index = torch.tensor([20, 5, 17])
    k_cache, ckv_cache = torch.zeros(2, 16, 1, 64, dtype=BF16), torch.zeros(2, 16, 1, 512, dtype=BF16)
    _, _, k_embed, y = torch_npu.npu_kv_rmsnorm_rope_cache(
        kv.to(BF16),
        gamma.to(BF16),
        cos.view(tokens, 1, 1, 64).to(BF16),
        sin.view(tokens, 1, 1, 64).to(BF16),
        index,
        k_cache,
        ckv_cache,
        epsilon=1e-6,
        cache_mode="PA_BNSD",
        is_output_kv=True,
    )
    tol = dict(rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(k_embed.view(tokens, 64).float(), want_rope, **tol)
    torch.testing.assert_close(y.view(tokens, 512).float(), want_latent, **tol)
    torch.testing.assert_close(k_cache.view(-1, 64)[index].float(), want_rope, **tol)
    torch.testing.assert_close(ckv_cache.view(-1, 512)[index].float(), want_latent, **tol)
    untouched = torch.ones(32, dtype=torch.bool)
    untouched[index] = False
    assert not k_cache.view(-1, 64)[untouched].any() and not ckv_cache.view(-1, 512)[untouched].any()
    x = kv[:, :, :, 512:].expand(tokens, 2, 1, 64).contiguous()  # two heads, the same rope part
    rotated = torch_npu.npu_interleave_rope(
        x.to(BF16), cos.view(tokens, 1, 1, 64).to(BF16), sin.view(tokens, 1, 1, 64).to(BF16)
    )
    torch.testing.assert_close(rotated[:, 1, 0].float(), want_rope, **tol)


def test_events_need_a_device_on_their_thread_once_a_device_is_set():
    """CANN binds a device to the calling thread (aclrtSetDevice): a thread that never set
    one (a control-server thread of the P/D connector) must bind before it uses events."""
    import threading

    npu = torch_npu.npu
    saved = npu._current_device, npu._thread_device
    npu._current_device, npu._thread_device = None, threading.local()
    try:
        event = npu.Event()
        event.query()  # no device set anywhere yet: nothing to hold the thread to
        npu.set_device(0)
        errors = []

        def unbound():
            try:
                event.query()
            except RuntimeError as e:
                errors.append(str(e))

        def bound():
            npu.set_device(0)
            event.query()

        for target in (unbound, bound):
            thread = threading.Thread(target=target, name=target.__name__)
            thread.start()
            thread.join()
        assert len(errors) == 1 and "never set a device" in errors[0] and "'unbound'" in errors[0]
        event.query()  # the main thread set it
    finally:
        npu._current_device, npu._thread_device = saved
