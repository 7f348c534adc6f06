"""The documented preconditions the contract double enforces, each with its source.

A rule cites the text it enforces: a quote from a file inside the pinned torch_npu
wheel (``torch_npu/_op_plugin_docs.py`` or ``torch_npu/op_plugin/atb/...``), checked
verbatim against the wheel by ``tests/npu_contract/test_double_provenance.py``, or a quote from
public Ascend documentation / Ascend op-plugin sources (recorded with its address;
those are not part of the wheel, so CI cannot re-read them).

Rules marked ``project`` are not torch_npu's: they are this distribution's own
requirement on how it calls an op (for example, caches must be passed as
contiguous tensors so no hidden full-cache copy happens), and say why.
"""

from __future__ import annotations

from dataclasses import dataclass

DOCS = "torch_npu/_op_plugin_docs.py"
ATB_DOC_RESHAPE = (
    "https://www.hiascend.com/document/detail/zh/canncommercial/800/apiref/ascendtbapi/"
    "ascendtb_01_0073.html (CANN ATB ReshapeAndCacheOperation)"
)
MC2_DISPATCH_DOC = (
    "Ascend/op-plugin docs/zh/custom_APIs/torch_npu/torch_npu-npu_moe_distribute_dispatch_v2.md "
    "(commit 517f2e7d)"
)
MC2_COMBINE_DOC = (
    "Ascend/op-plugin docs/zh/custom_APIs/torch_npu/torch_npu-npu_moe_distribute_combine_v2.md "
    "(commit 517f2e7d)"
)
ATTENTION_UPDATE_DOC = (
    "Ascend/op-plugin docs/zh/custom_APIs/torch_npu/torch_npu-npu_attention_update.md (commit 517f2e7d)"
)
OP_PLUGIN_ATB_COMMON = "Ascend/op-plugin op_plugin/utils/custom_functions/atb/AtbCommon.cpp"
ADD_RMS_NORM_DOC = (
    "Ascend/op-plugin docs/zh/custom_APIs/torch_npu/torch_npu-npu_add_rms_norm.md (commit 7416cfc3)"
)
KV_RMSNORM_ROPE_CACHE_DOC = (
    "Ascend/op-plugin docs/zh/custom_APIs/torch_npu/torch_npu-npu_kv_rmsnorm_rope_cache.md (commit 09fca6f6)"
)
GDN_CHUNK_DOC = (
    "Ascend/op-plugin docs/zh/custom_APIs/torch_npu/torch_npu-npu_chunk_gated_delta_rule.md (commit 517f2e7d)"
)
GDN_RECURRENT_DOC = (
    "Ascend/op-plugin docs/zh/custom_APIs/torch_npu/torch_npu-npu_recurrent_gated_delta_rule.md "
    "(commit 517f2e7d)"
)
LIGHTNING_INDEXER_DOC = (
    "Ascend/op-plugin docs/zh/custom_APIs/torch_npu/torch_npu-npu_lightning_indexer.md (commit 517f2e7d)"
)
SPARSE_FA_DOC = (
    "Ascend/op-plugin docs/zh/custom_APIs/torch_npu/torch_npu-npu_sparse_flash_attention.md (commit 517f2e7d)"
)
GMM_V5_DOC = "hicann/ops-transformer gmm/grouped_matmul/docs/aclnnGroupedMatmulV5_en.md (commit 827a6040)"
INTERLEAVE_ROPE_DOC = (
    "Ascend/op-plugin docs/zh/custom_APIs/torch_npu/torch_npu-npu_interleave_rope.md (commit 09fca6f6)"
)


@dataclass(frozen=True)
class Rule:
    id: str
    source: str
    quote: str
    in_wheel: bool = True


RULES: dict[str, Rule] = {
    r.id: r
    for r in [
        # -- npu_fused_infer_attention_score ---------------------------------------------------
        Rule(
            "FIA.query",
            DOCS,
            "query: Tensor类型, attention结构的Query输入, 数据类型支持float16、bfloat16、int8, "
            "不支持非连续的Tensor, 数据格式支持ND.",
        ),
        Rule(
            "FIA.key", DOCS, "key: Tensor类型, attention结构的Key输入, 不支持非连续的Tensor, 数据格式支持ND."
        ),
        Rule(
            "FIA.value",
            DOCS,
            "value: Tensor类型, attention结构的Value输入, 不支持非连续的Tensor, 数据格式支持ND.",
        ),
        Rule(
            "FIA.kv_dtype",
            DOCS,
            "Atlas A2 训练系列产品/Atlas 800I A2 推理产品: 数据类型支持float16、bfloat16、int8、int4(int32).",
        ),
        Rule("FIA.kv_same_shape", DOCS, "参数key、value中对应tensor的shape需要完全一致"),
        Rule(
            "FIA.out_pair",
            "torch_npu/npu/_npugraph_handlers/ifa_handler.py",
            'kwargs["out"] = [output, softmax_lse]',
        ),
        # TND without page attention ("TND场景下query、key、value输入的综合限制"): K and V may
        # differ in D there (FIA.tnd_dense_d), so kv_same_shape is not applied to that form.
        Rule("FIA.tnd_dense_t", DOCS, "T小于等于65536;"),
        Rule("FIA.tnd_dense_heads", DOCS, "N等于8/16/32/64/128, 且Q_N、K_N、V_N相等;"),
        Rule("FIA.tnd_dense_d", DOCS, "Q_D、K_D等于192, V_D等于128/192;"),
        Rule("FIA.tnd_dense_dtype", DOCS, "数据类型仅支持BFLOAT16;"),
        Rule("FIA.tnd_dense_sparse", DOCS, "sparse模式仅支持sparse=0且不传mask, 或sparse=3且传入mask;"),
        Rule(
            "FIA.mask_dtype",
            DOCS,
            "atten_mask: Tensor类型, 对QK的结果进行mask, 用于指示是否计算Token间的相关性, "
            "数据类型支持bool、int8和uint8. 不支持非连续的Tensor",
        ),
        Rule(
            "FIA.mask_2048",
            DOCS,
            "sparse_mode=2、3、4时, atten_mask的shape需要为(S, S)或(1, S, S)或(1, 1, S, S), "
            "其中S的值需要固定为2048, 且需要用户保证传入的atten_mask为下三角, "
            "不传入atten_mask或者传入的shape不正确报错.",
        ),
        Rule(
            "FIA.sparse_3",
            DOCS,
            "sparse_mode为3时, 代表rightDownCausal模式的mask, 对应以右顶点为划分的下三角场景, "
            "需要传入优化后的atten_mask矩阵(2048*2048).",
        ),
        Rule(
            "FIA.sparse_4",
            DOCS,
            "sparse_mode为4时, 代表band模式的mask, 需要传入优化后的atten_mask矩阵(2048*2048).",
        ),
        # band's alignment: the rows it leaves without keys (rightDown: row i is key KV_S - Q_S + i)
        Rule(
            "FIA.band_rows",
            DOCS,
            "sparse_mode=4, pre_tokens<0或每个batch next_tokens+actual_seq_lengths_kv-actual_seq_lengths<0时, "
            "满足拦截条件.",
        ),
        # One query row per batch. Read as "sparse_mode does nothing", which the double applied to
        # the band until hardware evidence contradicted it (vllm-ascend #8508, #8387: windowed TND
        # decode fixed by sparse_mode 4 with pre_tokens); the double keeps the reading only where it
        # is moot (rightDownCausal over one row) and applies the band (_ops/attention.py).
        Rule("FIA.incremental_sparse", DOCS, "Q_S为1且不带rope输入时该参数无效."),
        # TND's masks (v2's combined TND limits; v1 lists the same for its dense TND): no mask with
        # sparse 0, the optimised mask with 3, or with the band ("sparse模式支持sparse\_mode=4且传入
        # mask"). A defaultMask with sparse 0 is refused: vllm-ascend #15503 found it silently
        # ignored past KV position 512 in paged decode on hardware.
        Rule("FIA.tnd_sparse", DOCS, "sparse模式仅支持sparse=0且不传mask，或sparse=3且传入mask；"),
        # -- npu_fused_infer_attention_score_v2 (the rest: v1's rules, renamed arguments) --------
        Rule(
            "FIA2.sink",
            DOCS,
            "learnable_sink: Tensor类型, 数据类型支持bfloat16, 数据格式支持ND, shape输入为(Q_N,),",
        ),
        Rule("FIA2.sink_layout", DOCS, "仅支持TND、NTD\\_TND；"),
        Rule("FIA2.sink_d", DOCS, "仅支持value的d小于等于128；"),
        Rule(
            "FIA.sparse_values", DOCS, "参数sparse_mode当前仅支持值为0、1、2、3、4的场景, 取其它值时会报错."
        ),
        Rule(
            "FIA.tnd_seq_lengths",
            DOCS,
            "当query的input_layout为TND时, 该入参必须传入, 且以该入参元素的数量作为Batch值. "
            "该入参中每个元素的值表示当前Batch与之前所有Batch的seqlen和, "
            "因此后一个元素的值必须大于等于前一个元素的值, 且不能出现负值.",
        ),
        Rule(
            "FIA.tnd_kv_lengths",
            DOCS,
            "当key/value的input_layout为TND时, 该入参必须传入, 且该入参元素的数量等于Batch值. "
            "该入参中每个元素的值表示当前Batch与之前所有Batch的seqlenKv和, "
            "因此后一个元素的值必须大于等于前一个元素的值, 且不能出现负值.",
        ),
        Rule(
            "FIA.heads",
            DOCS,
            "需要满足num_heads整除num_key_value_heads, num_heads与num_key_value_heads的比值不能大于64.",
        ),
        Rule("FIA.n_d_limits", DOCS, "支持N轴小于等于256, 支持D轴小于等于512"),
        Rule("FIA.d_align", DOCS, "输入类型全为float16、bfloat16时, D轴需16对齐."),
        Rule(
            "FIA.pa_block_size",
            DOCS,
            "在使能page attention场景下, block_size最小为128, 最大为512, 且要求是128的倍数.",
        ),
        Rule(
            "FIA.pa_kv_layout",
            DOCS,
            "当query的input_layout为BNSD、TND时, kv cache排布支持(blocknum, blocksize, H)和"
            "(blocknum, KV_N, blocksize, D)两种格式, 当query的input_layout为BSH、BSND时, "
            "kv cache排布只支持(blocknum, blocksize, H)一种格式.",
        ),
        Rule("FIA.pa_kv_lengths", DOCS, "page attention场景下, 必须传入actual_seq_lengths_kv."),
        Rule(
            "FIA.pa_kv_lengths_per_batch",
            DOCS,
            "在PA场景下, 其长度等于key/value的Batch值, 代表每个Batch的实际长度, 值不大于KV_S.",
        ),
        Rule("FIA.block_table_dtype", DOCS, "block_table: Tensor类型, 数据类型支持int32."),
        Rule(
            "FIA.block_table_shape",
            DOCS,
            "page attention场景下, block_table必须为二维, 第一维长度需等于B, "
            "第二维长度不能小于maxBlockNumPerSeq",
        ),
        Rule(
            "FIA.blocknum",
            DOCS,
            "blocknum不能小于根据actual_seq_lengths_kv和blockSize计算的每个batch的block数量之和.",
        ),
        Rule("FIA.pa_no_int8_query", DOCS, "ntion场景下, 不支持输入query为int8的场景."),
        Rule("FIA.rope_pair", DOCS, "query_rope和key_rope要求同时配置或同时不配置, 不支持只配置其中一个."),
        Rule(
            "FIA.rope_query",
            DOCS,
            "query_rope配置时要求query的S为1-16、N为32、64、128, D为512, shape中B、N、S与query一致, D为64.",
        ),
        Rule(
            "FIA.rope_key",
            DOCS,
            "key_rope配置时要求key的N为1, D为512, key_rope的shape中B、N、S与key一致, D为64.",
        ),
        Rule(
            "FIA.rope_sparse",
            DOCS,
            "sparse: Q_S等于1时支持sparse=0且不传mask或sparse=4且传入mask, "
            "Q_S大于1时支持sparse=3或sparse=4且传入mask;",
        ),
        Rule("FIA.rope_block_size", DOCS, "该场景下, 必须开启PageAttention, 此时block_size支持16、128"),
        Rule(
            "FIA.rope_contiguous",
            DOCS,
            "query_rope: Tensor类型, 表示MLA(Multi-head Latent Attention)结构中的query的"
            "rope信息, 数据类型支持float16、bfloat16, 不支持非连续的Tensor, 数据格式支持ND.",
        ),
        Rule(
            "FIA.key_rope_contiguous",
            DOCS,
            "key_rope: Tensor类型, 表示MLA(Multi-head Latent Attention)结构中的key的"
            "rope信息, 数据类型支持float16、bfloat16, 不支持非连续的Tensor, 数据格式支持ND.",
        ),
        Rule(
            "FIA.rope_layout",
            DOCS,
            "Atlas A2 训练系列产品/Atlas 800I A2 推理产品: input_layout形状支持BSH、BSND、BNSD, "
            "当数据格式为NZ时input_layout不支持BNSD.",
        ),
        # -- _npu_reshape_and_cache (ATB ReshapeAndCacheOperation) -----------------------------
        Rule(
            "RAC.shapes",
            ATB_DOC_RESHAPE,
            "keyCache [num_blocks, block_size, num_head, k_head_size] ND/NZ; "
            "key [num_tokens, num_head, k_head_size]; slotMapping [num_tokens] int32",
            in_wheel=False,
        ),
        Rule(
            "RAC.dtypes",
            ATB_DOC_RESHAPE,
            "key、value、keyCache、valueCache、keyCacheOut 、valueCacheOut的数据类型都必须完全一致。",
            in_wheel=False,
        ),
        Rule(
            "RAC.cache_contiguous",
            OP_PLUGIN_ATB_COMMON,
            "ParamSetter::Output passes the cache to AtTensor2AtbTensor, which does "
            'TORCH_CHECK(at_tensor.is_contiguous(), "at_tensor is not contiguous")',
            in_wheel=False,
        ),
        # -- npu_scatter_nd_update_ ------------------------------------------------------------------
        Rule("SNU.indices", DOCS, "indices至少是2维，其最后1维的大小不能超过input的维度大小。"),
        Rule(
            "SNU.updates_shape",
            DOCS,
            "假设indices最后1维的大小是a，则updates的shape等于indices除最后1维外的shape"
            "加上input除前a维外的shape。",
        ),
        Rule(
            "SNU.dtype",
            DOCS,
            "input：Tensor类型，必选输入，源数据张量，数据格式支持ND，支持非连续的Tensor，"
            "数据类型需要与updates一致，维度只能是1~8维。",
        ),
        Rule(
            "SNU.indices_dtype",
            DOCS,
            "indices：Tensor类型，必选输入，索引张量，数据类型支持int32、int64，数据格式支持ND，"
            "支持非连续的Tensor，indices中的索引数据不支持越界。",
        ),
        # -- npu_grouped_matmul -------------------------------------------------------------------
        Rule(
            "GMM.single_tensor",
            DOCS,
            "0: 仅支持split_item为2或3. weight中tensor需为3维, x、y中tensor需为2维. "
            "必须传group_list, 且当group_list_type为0时, 最后一个值与x中tensor的第一维相等, "
            "当group_list_type为1时, 数值的总和与x中tensor的第一维相等. "
            "group_list第1维最大支持1024, 即最多支持1024个group. 支持weight转置. x不支持转置.",
        ),
        Rule("GMM.group_list", DOCS, "当group_list_type为0时, group_list必须为非负单调非递减数列."),
        # Practice, not the docs: the docs ask for a last group_list value equal to x's rows;
        # NPU MoE code in production passes more rows and ignores the rows past the groups
        # (vllm-ascend's MC2 path: dispatch_v2's expand_x with group_list=expert_token_nums;
        # sglang's NPU W4A8 experts mask them explicitly, quoted). The double leaves those
        # rows NaN. Not verified on an NPU from this repository.
        Rule(
            "GMM.rows_past_groups",
            "sgl-project/sglang python/sglang/srt/layers/quantization (NPU W4A8 MXFP4 MoE)",
            "valid_mask = row_ids < expert_tokens[-1]",
            in_wheel=False,
        ),
        Rule(
            "GMM.group_list_dtype",
            DOCS,
            "group_list (List[int]/torch.Tensor): 用于指定分组的索引, "
            "表示x的第0维矩阵乘法的索引情况. 数据类型支持torch.int64.",
        ),
        Rule("GMM.group_type", DOCS, "Atlas A2 训练系列产品/Atlas 800I A2 推理产品: 当前支持取-1、0."),
        Rule(
            "GMM.weight_transpose",
            DOCS,
            "tensor转置: 指若tensor shape为[M,K]时, 则stride为[1,M],数据排布为[K,M]的场景, 即非连续tensor.",
        ),
        Rule("GMM.inner_limit", DOCS, "x和weight中每一组tensor的最后一维大小都应小于InnerLimit."),
        # the wheel's docstrings end lines with CRLF
        Rule(
            "GMM.pertoken_formula",
            DOCS,
            "per-token量化场景 (公式3):\r\ny_{i}=(x_{i}×weight_{i}+bias_{i})×scale_{i}+pertokenscale_{i}",
        ),
        Rule(
            "GMM.pertoken_dtypes",
            DOCS,
            "per-token量化\r\nx: torch.int8, torch.int8\r\nweight: torch.int8, torch.int8\r\n"
            "bias: torch.int32, torch.int32\r\nscale: torch.bfloat16, torch.float32\r\n"
            "antiquant_scale: 无需赋值, 无需赋值\r\nantiquant_offset: 无需赋值, 无需赋值\r\n"
            "per_token_scale: torch.float32, torch.float32\r\n"
            "output_dtype: torch.bfloat16, torch.float16",
        ),
        # A8W4 (int8 x, int4 weight): the wheel's docstring has no such row; CANN's operator
        # docs for the aclnn API npu_grouped_matmul calls do.
        Rule(
            "GMM.a8w4_formula",
            GMM_V5_DOC,
            "y_i=((x_i - 8) \\times weight_i * scale_i+bias_i ) * per\\_token\\_scale_i",
            in_wheel=False,
        ),
        Rule(
            "GMM.a8w4_dtypes",
            GMM_V5_DOC,
            "| INT8 | INT4 (ND/NZ) | FLOAT | UINT64 | null | null | null | FLOAT | INT64 | null | null | null "
            "| BFLOAT16|",
            in_wheel=False,
        ),
        Rule(
            "GMM.a8w4_single",
            GMM_V5_DOC,
            "Only `GroupType=0` (M-axis grouping) and `actType=0` are supported.",
            in_wheel=False,
        ),
        Rule("GMM.a8w4_layout", GMM_V5_DOC, "`x` and `weight` cannot be transposed.", in_wheel=False),
        Rule(
            "GMM.a8w4_k",
            GMM_V5_DOC,
            "`k` must be an integer multiple of `quantGroupSize` and `k` ≤ 18432. `quantGroupSize` is the "
            "per-group quantization length in the K-axis. Currently, `quantGroupSize=256` is supported.",
            in_wheel=False,
        ),
        Rule(
            "GMM.a8w4_scale_shape",
            GMM_V5_DOC,
            "The shape must be $[E, quantGroupNum, N]$, where $quantGroupNum=k \\div quantGroupSize$.",
            in_wheel=False,
        ),
        Rule(
            "GMM.a8w4_bias",
            GMM_V5_DOC,
            "Its value must be $8\\times weight \\times scale$ and is accumulated in the first dimension. "
            "The shape must be $[E, N]$.",
            in_wheel=False,
        ),
        Rule(
            "GMM.a8w4_counts",
            GMM_V5_DOC,
            "the operator does not validate `groupListType` and treats it as `1`",
            in_wheel=False,
        ),
        # the uint64 scale's encoding is not in the docs; vllm-ascend's W4A8 loader writes
        # each float32 scale's bits, zero-extended (the double reads the low 32 bits)
        Rule(
            "GMM.a8w4_scale_bits",
            "vllm-project/vllm-ascend vllm_ascend/quantization/methods/w4a8.py (commit 182b75ea) _process_scale",
            "scale_uint64_tensor = torch.from_numpy(scale_np.astype(np.int64)).npu()",
            in_wheel=False,
        ),
        # -- npu_convert_weight_to_int4pack -----------------------------------------------------------
        Rule(
            "I4P.weight",
            DOCS,
            "weight : Tensor类型, 输入的weight, 数据格式支持ND、FRACTAL_NZ, 数据类型支持int32,  "
            "不支持非连续的Tensor; 维度支持2维, shape支持(k, n)、 (n, k), 最后一维度需要8个元素对齐, "
            "元素的值需要在int4的表示范围内, 即[-8, 7].",
        ),
        # -- npu_quant_matmul ---------------------------------------------------------------------------
        Rule(
            "QMM.x1",
            DOCS,
            "Atlas A2 训练系列产品/Atlas 800I A2 推理产品: 数据类型支持int8和int32. "
            "其中int32表示int4类型矩阵乘计算, 每个int32数据存放8个int4数据.",
        ),
        Rule(
            "QMM.scale",
            DOCS,
            "Atlas A2 训练系列产品/Atlas 800I A2 推理产品: 数据类型支持float32、int64、bfloat16. "
            "shape需要是1维(t, ), t=1或n, 其中n与x2的n一致.",
        ),
        Rule(
            "QMM.pertoken",
            DOCS,
            "Atlas A2 训练系列产品/Atlas 800I A2 推理产品: 数据类型支持float32. "
            "shape需要是1维(m,), 其中m与x1的m一致.",
        ),
        Rule(
            "QMM.bias",
            DOCS,
            "bias: Tensor类型, 可选参数, 数据格式支持ND, shape支持1维(n,)、2维(1, n)或3维(batch, 1, n)",
        ),
        Rule(
            "QMM.combinations",
            DOCS,
            "scale:int64/float32, int64/float32, float32/bfloat16, float32, int64/float32, float32/bfloat16",
        ),
        Rule("QMM.last_dim", DOCS, "其他情况, x1与x2最后一维的shape大小不能超过65535."),
        # -- npu_dynamic_quant --------------------------------------------------------------------------
        Rule(
            "DQ.x",
            DOCS,
            "x: Tensor类型, 需要进行量化的源数据张量, 必选输入, 数据类型支持torch.float16、torch.bfloat16, "
            "数据格式支持ND, 支持非连续的Tensor. 输入x的维度必须大于1.",
        ),
        Rule("DQ.formula", DOCS, "scale=rowMax(abs(x))/DTYPE_MAX\r\ny=round(x/scale)"),
        # -- npu_quantize -------------------------------------------------------------------------------
        Rule("QZ.formula", DOCS, "如果div_mode为False: result=(input*scales)+zero_points"),
        Rule("QZ.scales_shape", DOCS, "支持1维或多维(1维时, 对应轴的大小需要与input中第axis维相等或等于1;"),
        Rule("QZ.zero_points", DOCS, "zero_points的shape和dtype需要和scales一致."),
        Rule("QZ.dtype", DOCS, "div_mode为False时, 类型支持torch.qint8、torch.quint4x2."),
        # -- npu_moe_distribute_dispatch_v2 / combine_v2 (MC2) --------------------------------------------
        Rule(
            "MC2.expert_ids",
            MC2_DISPATCH_DOC,
            "shape为\\(BS, K\\)，数据类型支持`int32`，数据格式为$ND$，支持非连续的Tensor。"
            "对应[torch\\_npu.npu\\_moe\\_distribute\\_combine\\_v2]"
            "(torch_npu-npu_moe_distribute_combine_v2.md)的`expert_ids`输入，"
            "张量里value取值范围为\\[0, moe\\_expert\\_num\\)，"
            "且同一行中的K个value不能重复。",
            in_wheel=False,
        ),
        Rule(
            "MC2.mask_order",
            MC2_DISPATCH_DOC,
            "当输入为1维时，参数为true表示对应的token参与通信，true必须排到false之前，"
            "例：{true, false, true} 为非法输入",
            in_wheel=False,
        ),
        Rule(
            "MC2.uniform_bs",
            MC2_DISPATCH_DOC,
            "当每张卡的BS数量不一致时，所有token必须全部有效。",
            in_wheel=False,
        ),
        Rule("MC2.top_k", MC2_DISPATCH_DOC, "K：表示选取topK个专家，取值范围为0<K≤16", in_wheel=False),
        Rule(
            "MC2.batch",
            MC2_DISPATCH_DOC,
            '`comm_alg`设置为""或"fullmesh_v1"时，`BS`的取值范围为0<BS≤512。',
            in_wheel=False,
        ),
        Rule(
            "MC2.dtype",
            MC2_DISPATCH_DOC,
            "表示有BS个token，数据类型支持`bfloat16`、`float16`。",
            in_wheel=False,
        ),
        Rule(
            "MC2.group",
            MC2_DISPATCH_DOC,
            "**group\\_ep** (`str`)：必选参数，EP通信域名称，专家并行的通信域。字符串长度范围为\\[1,128\\)。",
            in_wheel=False,
        ),
        Rule(
            "MC2.expert_scales",
            MC2_COMBINE_DOC,
            "表示每个token的topK个专家的权重，要求为2维张量，shape为\\(BS, K\\)，"
            "其中共享专家不需要乘权重系数，直接相加即可。数据类型支持`float32`",
            in_wheel=False,
        ),
        # MC2 environment: comm_alg as the doc resolves it, and the HCCL buffer (HCCL_BUFFSIZE).
        Rule(
            "MC2.comm_alg_a2",
            MC2_DISPATCH_DOC,
            '<term>Atlas A2 训练系列产品/Atlas A2 推理系列产品</term>：当前版本支持""，"fullmesh"，"hierarchy"三种输入'
            '方式。推荐配置"hierarchy"并搭配25.0.RC1.1及以上版本驱动使用。',
            in_wheel=False,
        ),
        Rule(
            "MC2.comm_alg_a3",
            MC2_DISPATCH_DOC,
            '<term>Atlas A3 训练系列产品/Atlas A3 推理系列产品</term>：当前版本支持""，"fullmesh_v1"，"fullmesh_v2'
            '"，"hierarchy"四种输入方式。',
            in_wheel=False,
        ),
        Rule(
            "MC2.combine_comm_alg_a3",
            MC2_COMBINE_DOC,
            '<term>Atlas A3 训练系列产品/Atlas A3 推理系列产品</term>：当前版本支持""，"hierarchy"两种输入方式。',
            in_wheel=False,
        ),
        Rule(
            "MC2.comm_alg_default_a2",
            MC2_DISPATCH_DOC,
            '"": 配置HCCL\\_INTRA\\_PCIE\\_ENABLE=1和HCCL\\_INTRA\\_ROCE\\_ENABLE=0时，调用"hierarchy"算法，否'
            '则调用"fullmesh"算法。不推荐使用该方式。',
            in_wheel=False,
        ),
        Rule(
            "MC2.hierarchy_mask",
            MC2_DISPATCH_DOC,
            '`comm_alg`设置为"hierarchy"时，当前版本不支持，使用默认值None即可。',
            in_wheel=False,
        ),
        Rule(
            "MC2.hierarchy_ep",
            MC2_DISPATCH_DOC,
            '`comm_alg`设置为"hierarchy"时，`ep_world_size`取值范围为16、32、64。',
            in_wheel=False,
        ),
        Rule(
            "MC2.hierarchy_expert_scales",
            MC2_COMBINE_DOC,
            '"hierarchy": token数据经过机内、跨机两次发送，'
            "先在server内将同一个token数据汇总求和，再跨机发送，以减少跨机数据量。",
            in_wheel=False,
        ),
        Rule(
            "MC2.buffsize_default",
            MC2_DISPATCH_DOC,
            "调用本接口前需检查通信域缓存区大小取值是否合理，单位MB，不配置时默认为200MB。",
            in_wheel=False,
        ),
        Rule(
            "MC2.buffsize_a2",
            MC2_DISPATCH_DOC,
            '`comm_alg`配置为"fullmesh"且`x`的数据类型不为`int32`：设置大小要求\\>=2\\*\\(BS\\*ep\\_world\\_size\\*min'
            "\\(local\\_expert\\_num, K\\)\\*H\\*sizeof\\(uint16\\)+2MB\\)。",
            in_wheel=False,
        ),
        Rule(
            "MC2.buffsize_a3",
            MC2_DISPATCH_DOC,
            'ep通信域内，comm\\_alg配置为"fullmesh_v1"或"": 设置大小要求 \\>= 2 \\* \\(local\\_expert\\_num \\* max'
            "\\_bs \\* ep\\_world\\_size \\* Align512\\(Align32\\(2 \\* H\\) + 64\\) + \\(K + shared\\_ex"
            "pert\\_num\\) \\* max\\_bs \\* Align512\\(2 \\* H\\)\\)。",
            in_wheel=False,
        ),
        # -- npu_attention_update ------------------------------------------------------------------------
        Rule(
            "AU.lse",
            ATTENTION_UPDATE_DOC,
            "每个Tensor的shape为$(batch \\times seqLen \\times headNum)$。数据类型支持`float32`",
            in_wheel=False,
        ),
        Rule(
            "AU.local_out",
            ATTENTION_UPDATE_DOC,
            "每个Tensor的shape为$(batch \\times seqLen \\times headNum, "
            "head\\_dim)$。数据类型支持`float32`、`float16`、`bfloat16`",
            in_wheel=False,
        ),
        Rule("AU.sp", ATTENTION_UPDATE_DOC, "序列并行的并行度SP取值范围[1, 16]。", in_wheel=False),
        Rule("AU.head_dim", ATTENTION_UPDATE_DOC, "head_dim取值范围[8, 512]且是8的倍数。", in_wheel=False),
        Rule(
            "AU.same_length",
            ATTENTION_UPDATE_DOC,
            "`lse`和`local_out`的tensorList长度必须一致。",
            in_wheel=False,
        ),
        Rule(
            "AU.lse_out_type1",
            DOCS,
            "lse_out: Device侧的Tensor，形状为 (batch * seqLen * headNum)，数据类型为 FLOAT格式为 ND。"
            "update_type=1时有效。",
        ),
        Rule(
            "AU.update_type",
            ATTENTION_UPDATE_DOC,
            "取值为`0`时，仅输出合并后的out；取值为`1`时，同时输出合并后的out和lse_out。",
            in_wheel=False,
        ),
        # -- npu_swiglu ---------------------------------------------------------------------------------
        Rule("SWIGLU.formula", DOCS, "outputs = swiglu\\(x, dim = -1) = swish(A) * B = A * sigmoid(A) * B"),
        Rule("SWIGLU.dtype", DOCS, "“x”：Tensor类型，shape支持1-8维，dtype支持FP32、FP16或BF16类型。"),
        Rule(
            "CSWIGLU.x",
            DOCS,
            "x：Tensor类型，必选参数，表示目标张量。数据类型支持float16、bfloat16、float32，不支持非连续的Tensor，"
            "数据格式为ND，x的维数必须大于1维，第dim轴为偶数。",
        ),
        # -- npu_rms_norm / npu_add_rms_norm ------------------------------------------------------------
        Rule("RMS.self", DOCS, "self：Tensor类型，支持float16、bfloat16、float32，输入shape支持2-8维。"),
        Rule(
            "RMS.gamma",
            DOCS,
            "gamma：Tensor类型，数据类型需要和self保持一致，输入shape支持2-8维，通常为self的最后一维。",
        ),
        Rule(
            "ADDRMS.x",
            ADD_RMS_NORM_DOC,
            "数据格式支持$ND$，不支持空Tensor，支持非连续Tensor。数据类型支持`float32`、`float16`、`bfloat16`。"
            "支持1-8维张量。",
            in_wheel=False,
        ),
        Rule("ADDRMS.formula", ADD_RMS_NORM_DOC, "x_i=x1_{i}+x2_{i}", in_wheel=False),
        Rule(
            "ADDRMS.gamma",
            ADD_RMS_NORM_DOC,
            "数据类型与`x1`的数据类型保持一致，shape需要与`x1`后几维保持一致，后几维为`x1`需要归一化处理的维度。",
            in_wheel=False,
        ),
        # -- npu_rotary_mul --------------------------------------------------------------------------
        Rule("ROPE.input", DOCS, "input：必选输入，4维Tensor，数据类型float16, bfloat16, float32"),
        Rule("ROPE.half", DOCS, "input: layout支持: BNSD、BSND、SBND; D < 896，且为2的倍数; B, N < 1000;"),
        Rule("ROPE.half_tables", DOCS, "input为BSND: 1S1D、BS1D、BSND;"),
        Rule(
            "ROPE.interleave",
            DOCS,
            "input: layout支持: BNSD、BSND、SBND; B * N < 1000; D < 896, 且D为2的倍数;",
        ),
        Rule("ROPE.interleave_tables", DOCS, "input为BSND: 1S1D;"),
        Rule("ROPE.range", DOCS, "r1: 数据范围：[-1, 1]"),
        # -- npu_apply_rotary_pos_emb (Atlas A2/A3) --------------------------------------------------
        Rule("ARPE.mode", DOCS, '支持"half"模式。'),
        Rule("ARPE.layout", DOCS, "支持BSND的4维Tensor、TND的3维Tensor。"),
        Rule("ARPE.d", DOCS, "不支持空Tensor，shape最后一维（D）必须等于128或者64。"),
        Rule("ARPE.dtype", DOCS, "输入张量query、key、cos、sin的数据类型必须相同。"),
        Rule(
            "ARPE.shapes",
            DOCS,
            'layout为"TND"时，输入query的shape用（q_t, q_n, q_d）表示，key的shape用（q_t, k_n, q_d）表示，'
            "cos和sin的shape用（q_t, 1, cos_d）表示。",
        ),
        # -- npu_moe_init_routing_v2 / npu_moe_finalize_routing ------------------------------------------
        Rule(
            "IR2.x",
            DOCS,
            "x：Tensor类型，必选参数，表示MoE的输入即token特征输入，要求为2D的Tensor，shape为(NUM_ROWS, H)，"
            "H代表每个Token的长度。数据类型支持float16、bfloat16、float32、int8，数据格式要求为ND。",
        ),
        Rule(
            "IR2.expert_idx",
            DOCS,
            "expert_idx：Tensor类型，必选参数，表示torch_npu.npu_moe_gating_top_k_softmax输出每一行特征对应的K个"
            "处理专家，要求是2D的Tensor，shape为(NUM_ROWS, K)，且专家id不能超过专家数。数据类型支持int32，"
            "数据格式要求为ND。",
        ),
        Rule("IR2.expert_num", DOCS, "其他模式取值范围为(0, 10240]。"),
        Rule("IR2.drop_pad_mode", DOCS, "1表示drop_pad场景。当前仅支持0。"),
        Rule(
            "IR2.tokens_num_type",
            DOCS,
            "1表示count模式，即输出的值为各个专家处理的token数量；2表示key_value模式，即输出的值为专家和对应专家"
            "处理token数量的键值对。当前仅支持1和2。",
        ),
        Rule(
            "IR2.tokens_num_flag",
            DOCS,
            "expert_tokens_num_flag：bool类型，可选参数，表示是否输出expert_token_cumsum_or_count，默认False表示"
            "不输出。当前仅支持True。",
        ),
        Rule("IR2.active_range", DOCS, "要求数组内的值大于等于0，并且expert_end不大于expert_num。"),
        Rule("IR2.row_idx", DOCS, "当row_idx_type为0时，有效元素与无效元素共存，其中无效元素由-1填充"),
        Rule(
            "FR.rows",
            DOCS,
            "expanded_permuted_rows: Tensor类型, 必选参数, 经过专家处理过的结果, 要求是一个2D的Tensor, "
            "数据类型支持float16、bfloat16、float32, 数据格式要求为ND. shape支持(NUM_ROWS * K, H)",
        ),
        Rule(
            "FR.scales",
            DOCS,
            "scales: Tensor类型, 可选参数, 专家的权重, 要求是一个2D的Tensor, 数据类型要求与expanded_permuted_rows"
            "一致, shape支持(NUM_ROWS, K).",
        ),
        Rule("FR.index", DOCS, "drop_pad_mode参数为0时, Tensor中的值取值范围是[0, NUM_ROWS * K-1]."),
        Rule(
            "FR.formula",
            DOCS,
            "\\sum_{k=0}^{K}(scales_{i,k}*(expandPermutedRows_{expandedSrcToDstRow_{i+k*num_rows},j}",
        ),
        # -- npu_moe_gating_top_k_softmax (MoE routing) -------------------------------------------------
        Rule(
            "GTKS.x",
            DOCS,
            "x: Tensor类型, 必选输入, 表示待计算的输入要求是一个2D/3D的Tensor, 数据类型支持float16、"
            "bfloat16、float32, 数据格式要求为ND.",
        ),
        Rule(
            "GTKS.finished",
            DOCS,
            "finished: Tensor类型, 可选输入, 表示输入中需要参与计算的行, 要求是一个1D/2D的Tensor, "
            "数据类型支持bool, shape为x[:-1], 数据格式要求为ND.",
        ),
        Rule("GTKS.k", DOCS, "k: Host侧的int类型, 表示topk的k值, 大小为0<k<=x的-1轴大小, k<=1024."),
        # -- npu_moe_gating_top_k_softmax_v2 (softmax top-k, or the top k's softmax: renorm 1) ---------
        Rule(
            "GTKS2.x",
            DOCS,
            "x: Tensor类型, 必选输入, 表示待计算的输入要求是一个2D/3D的Tensor, 数据类型支持float16、"
            "bfloat16、float32, 数据格式要求为ND.",
        ),
        Rule("GTKS2.k", DOCS, "k: Host侧的int类型, 表示topk的k值, 大小为0<k<=x的-1轴大小, k<=1024."),
        Rule(
            "GTKS2.renorm",
            DOCS,
            "当renorm参数设置为0时，对输入x做softmax操作，再做topk操作；当renorm参数设置为1时，对x做topk操作，"
            "后做softmax操作。",
        ),
        # -- npu_moe_gating_top_k (MoE routing: sigmoid/softmax, bias, groups) ---------------------------
        Rule(
            "GTK.x",
            DOCS,
            "要求是一个2D的Tensor，数据类型支持`float16`、`bfloat16`、`float32`，数据格式要求为ND。"
            "支持非连续Tensor。最后一维的大小（即专家数）要求不大于`2048`。",
        ),
        Rule("GTK.k", DOCS, "要求`1 <= k <= x_shape[-1] / group_count * k_group`。"),
        Rule(
            "GTK.bias",
            DOCS,
            "要求是1D的Tensor，要求shape值与`x`的最后一维相等。数据类型支持`float16`、`bfloat16`、"
            "`float32`，数据类型需要与`x`保持一致",
        ),
        Rule(
            "GTK.k_group",
            DOCS,
            "要求`1 <= k_group <= group_count`，并且`k_group * x_shape[-1] / group_count`的值要大于等于`k`。",
        ),
        Rule(
            "GTK.group_count",
            DOCS,
            "要求`group_count > 0，x_shape[-1]`能够被`group_count`整除且整除后的结果大于`2`，"
            "并且整除的结果按照`32`个数对齐后乘`group_count`的结果不大于`2048`。",
        ),
        Rule(
            "GTK.group_select_mode",
            DOCS,
            "默认值为`0`，`0`表示组内取最大值，作为专家组得分；`1`表示取组内Top2的专家进行得分累加，作为专家组得分。",
        ),
        Rule(
            "GTK.renorm", DOCS, "表示renorm标记，默认值为`0`，表示先进行norm再进行topk计算。当前仅支持`0`。"
        ),
        Rule("GTK.norm_type", DOCS, "表示norm函数类型，`1`表示使用Sigmoid函数，`0`表示Softmax函数。"),
        # -- npu_kv_rmsnorm_rope_cache (the MLA latent prolog) --------------------------------------
        Rule(
            "KRRC.kv",
            KV_RMSNORM_ROPE_CACHE_DOC,
            "数据类型支持torch.bfloat16、torch.float16，数据格式为BNSD，要求为4维张量，形状为"
            "[batch_size, 1, seq_len, hidden_size]，其中hidden_size=rms_size(RMS)+rope_size(RoPE)。",
            in_wheel=False,
        ),
        Rule(
            "KRRC.sizes",
            KV_RMSNORM_ROPE_CACHE_DOC,
            "Atlas A2系列产品、Atlas A3系列产品：hidden_size取值仅支持576，rms_size取值仅支持512，"
            "rope_size取值仅支持64。",
            in_wheel=False,
        ),
        Rule(
            "KRRC.gamma",
            KV_RMSNORM_ROPE_CACHE_DOC,
            "gamma：数据类型支持torch.bfloat16、torch.float16，数据格式为ND，要求为1维张量，形状为[rms_size]。",
            in_wheel=False,
        ),
        Rule(
            "KRRC.cos_sin",
            KV_RMSNORM_ROPE_CACHE_DOC,
            "cos/sin：数据类型支持torch.bfloat16、torch.float16，数据格式为ND，要求为4维张量，形状为"
            "[batch_size, 1, seq_len, rope_size]。",
            in_wheel=False,
        ),
        Rule(
            "KRRC.index",
            KV_RMSNORM_ROPE_CACHE_DOC,
            "index：数据类型支持torch.int64 ... PA/PA_BNSD ... index形状为[batch_size*seq_len]，"
            "index里的值表示每个token的偏移。",
            in_wheel=False,
        ),
        Rule(
            "KRRC.index_unique",
            KV_RMSNORM_ROPE_CACHE_DOC,
            "所有cache_mode缓存模式下，index的值不可以重复，如果传入的index值存在重复，算子的行为是未定义的且不可预知的。",
            in_wheel=False,
        ),
        Rule(
            "KRRC.cache",
            KV_RMSNORM_ROPE_CACHE_DOC,
            "PA/PA_BNSD：k_cache形状为[block_num, block_size, 1, rope_size]，ckv_cache形状为"
            "[block_num, block_size, 1, rms_size]。... 非量化模式：当k_rope_scale和c_kv_scale为空时，"
            "k_cache和ckv_cache的dtype为torch.bfloat16或torch.float16。",
            in_wheel=False,
        ),
        Rule(
            "KRRC.is_output_kv",
            KV_RMSNORM_ROPE_CACHE_DOC,
            "is_output_kv：表示是否输出处理后的k_embed_out和y_out（未量化的原始值），默认值False不输出，"
            "仅cache_mode在(PA/PA_BNSD/PA_NZ/PA_BLK_BNSD/PA_BLK_NZ)模式下有效。",
            in_wheel=False,
        ),
        # -- npu_interleave_rope (the MLA query's rope part) -----------------------------------------
        Rule(
            "IROPE.x",
            INTERLEAVE_ROPE_DOC,
            "x：要求为4维张量，shape为(B, N, S, D) ... Atlas A2系列产品、Atlas A3系列产品：数据类型支持"
            "torch.bfloat16、torch.float16，不支持非连续的Tensor。",
            in_wheel=False,
        ),
        Rule(
            "IROPE.cos_sin",
            INTERLEAVE_ROPE_DOC,
            "cos：要求为4维张量，shape为(B, N, S, D)，S可以为1或与x的S相同，数据类型、数据格式与x一致。"
            "... sin：shape、数据类型、数据格式需要与cos保持一致。",
            in_wheel=False,
        ),
        Rule(
            "IROPE.dims",
            INTERLEAVE_ROPE_DOC,
            "Atlas A2系列产品、Atlas A3系列产品：输入x、cos、sin的D维度均必须等于64，且cos、sin的N维度必须等于1。",
            in_wheel=False,
        ),
        # -- npu_chunk_gated_delta_rule (Gated DeltaNet prefill) --------------------------------------
        # The wheel's docstring and op-plugin's page disagree: the wheel says L_i <= 8 (its
        # recurrent sibling's limit, copied: a chunked prefill op), D_k = D_v = 128 and a state
        # "(BlockNum, Nv, Dv, Dk)"; op-plugin's page (and its test, a 2048-token sequence)
        # says no L_i limit, D <= 128 and a state of one row per sequence (B, Nv, Dv, Dk). The
        # double takes the stricter of the two where they can both hold (D = 128) and the page
        # where the wheel's text cannot be meant (L_i, B rows). First NPU run: check both.
        Rule(
            "GDR.inputs",
            DOCS,
            "- query (Tensor)：必选输入，对应公式中的q，数据类型支持bfloat16，数据格式支持ND，shape为（T, Nk, Dk）。",
        ),
        Rule(
            "CGDR.dims",
            DOCS,
            "$N_k \\le 64$，$N_v \\le 64$，$D_k = 128$，$D_v = 128$，$N_v$是$N_k$整数倍",
        ),
        Rule(
            "GDR.lengths",
            DOCS,
            "- actual_seq_lengths (Tensor)：必选输入，各batch的输入序列长度。数据类型支持int32，数据格式支持ND，"
            "shape为（B,）。",
        ),
        Rule(
            "CGDR.state",
            GDN_CHUNK_DOC,
            "initial_state (`Tensor`)：可选参数，对应公式中的状态矩阵$S_0$，数据类型支持`bfloat16`、`float32`，"
            "数据格式支持ND，shape为（$B$, $N_v$, $D_v$, $D_k$）... initial_state、final_state float32数据类型"
            "仅在Ascend 950PR/Ascend 950DT支持。... 当前TND场景，beta、initial_state、actual_seq_lengths必传。",
            in_wheel=False,
        ),
        Rule(
            "GDR.g",
            DOCS,
            "- g (Tensor)：必选输入，衰减系数，对应公式中的α=e^g。默认为None，表示全0。数据类型支持float32，"
            "数据格式支持ND，shape为（T, Nv）。",
        ),
        # The page also asks for -1 <= g: Qwen's gates (-exp(A_log) softplus(a + dt_bias)) go
        # below -1 and upstream passes them as they are, so the double does not enforce that
        # bound (the page says only that results may overflow). First NPU run: check strong gates.
        Rule(
            "CGDR.ranges",
            GDN_CHUNK_DOC,
            "由于算法特性，用户需保障以下数值约束，否则计算结果可能出现溢出：... query需要归一化处理 ... "
            "key需要归一化处理 ... $-1 \\le g[i][j] \\le 0$ ... $0 < beta[i][j] < 1$",
            in_wheel=False,
        ),
        # -- npu_recurrent_gated_delta_rule (Gated DeltaNet decode; GDR.* rules hold for both) -----
        Rule(
            "RGDR.state",
            DOCS,
            "- state (Tensor)：必选输入&输出，对应公式中的状态矩阵S，数据类型支持bfloat16，数据格式支持ND，"
            "shape为（BlockNum, Nv, Dv, Dk）。",
        ),
        Rule(
            "RGDR.indices",
            DOCS,
            "- ssm_state_indices (Tensor)：必选输入，输入序列到状态矩阵的映射索引。state[ssm_state_indices[i]]"
            "表示第i个token的状态矩阵。数据类型支持int32，数据格式支持ND，shape为（T,）。",
        ),
        # Which row a sequence starts from is not on the page: the kernel reads
        # ssm_state_indices[seq0 + num_accepted_tokens[b] - 1] (Ascend ops-transformer,
        # attention/recurrent_gated_delta_rule/op_kernel, RGDR::Process); the double does too.
        Rule(
            "RGDR.accepted",
            GDN_RECURRENT_DOC,
            "num_accepted_tokens (Tensor)：可选输入，num_accepted_tokens[i]表示投机推理第i个batch接受的token数量，"
            "要求取值大于等于1且不大于$L_i$。默认为None，表示每个batch接受的token数为1。数据类型支持int32，"
            "数据格式支持ND，shape为（$B$,）。",
            in_wheel=False,
        ),
        Rule(
            "RGDR.dims", DOCS, "$L_i \\le 8$，$N_k \\le 256$，$N_v \\le 256$，$D_k \\le 256$，$D_v \\le 256$"
        ),
        Rule("RGDR.gk", DOCS, "- gk (Tensor)：可选输入，衰减系数，当前版本暂不支持，传None即可。"),
        # The wheel says "该接口支持静态图模式。" (static graphs); op-plugin's page says only single
        # ops and static graphs: no ACL graph capture documented, so the double refuses it.
        Rule("RGDR.modes", GDN_RECURRENT_DOC, "该接口仅支持单算子和静态图模式。", in_wheel=False),
        # -- npu_lightning_indexer (DeepSeek sparse attention's top-k) -------------------------------
        Rule(
            "LI.query",
            DOCS,
            "query（Tensor）：必选参数，不支持非连续，数据格式支持ND，数据类型支持bfloat16和float16。",
        ),
        Rule(
            "LI.key",
            DOCS,
            "key（Tensor）：必选参数，不支持非连续，数据格式支持ND，数据类型支持bfloat16和float16，layout_key为"
            "PA_BSND时shape为[block_count, block_size, N2, D]，其中block_count为PageAttention时block总数，"
            "block_size为一个block的token数。",
        ),
        # the page also allows float32 weights; the wheel's docstring does not: the stricter holds
        Rule(
            "LI.weights",
            DOCS,
            "weights（Tensor）：必选参数，不支持非连续，数据格式支持ND，数据类型支持bfloat16和float16，支持输入"
            "shape[B,S1,N1]、[T,N1]。",
        ),
        Rule(
            "LI.dims",
            LIGHTNING_INDEXER_DOC,
            "参数key中的N仅支持为1。 参数query中的D和参数key中的D值相等为128。 ... Atlas A2 推理系列产品、"
            "Atlas A3 推理系列产品： query中的N必须小于等于64。 ... block_size取值为16的整数倍，最大支持到1024。",
            in_wheel=False,
        ),
        Rule(
            "LI.lengths",
            DOCS,
            "当query的input_layout为TND时，该入参必须传入，且以该入参元素的数量作为B值，该入参中每个元素的值表示"
            "当前batch与之前所有batch的token数总和，即前缀和，因此后一个元素的值必须>=前一个元素的值。不能出现负值。",
        ),
        Rule(
            "LI.key_lengths",
            DOCS,
            "actual_seq_lengths_key（Tensor）：可选参数，表示不同Batch中key的有效token数，数据类型支持int32。",
        ),
        Rule(
            "LI.block_table",
            DOCS,
            "PageAttention场景下，block_table必须为二维，第一维长度需要等于B，第二维长度不能小于maxBlockNumPerSeq"
            "(maxBlockNumPerSeq为每个batch中最大actual_seq_lengths_key对应的block数量)",
        ),
        Rule(
            "LI.sparse_count",
            DOCS,
            "sparse_count（int）：可选参数，代表topK阶段需要保留的block数量，支持1-2048以及3072、4096、5120、6144、"
            "7168、8192，数据类型支持int32。",
        ),
        Rule(
            "LI.sparse_mode",
            DOCS,
            "sparse_mode（int）：可选参数，表示sparse的模式，支持0/3，数据类型支持int32。",
        ),
        # -- npu_sparse_flash_attention (MLA over the selected positions) ----------------------------
        Rule(
            "SFA.query",
            DOCS,
            "query（Tensor）：必选参数，不支持非连续，数据格式支持ND，数据类型支持bfloat16和float16。",
        ),
        Rule(
            "SFA.lengths",
            DOCS,
            "当query的input_layout为TND时，该入参必须传入，且以该入参元素的数量作为B值，该入参中每个元素的值表示"
            "当前batch与之前所有batch的token数总和，即前缀和，因此后一个元素的值必须>=前一个元素的值。不能出现负值。",
        ),
        Rule(
            "SFA.kv",
            DOCS,
            "key（Tensor）：必选参数，不支持非连续，数据格式支持ND，数据类型支持bfloat16和float16，layout_kv为PA_BSND"
            "时shape为[block_num, block_size, KV_N, D]，其中block_num为PageAttention时block总数，block_size为一个"
            "block的token数。",
        ),
        Rule(
            "SFA.indices",
            DOCS,
            "sparse_indices（Tensor）：必选参数，代表离散取kvCache的索引，不支持非连续，数据格式支持ND,数据类型支持"
            "int32。当query的layout为BSND时，shape需要传入[B, Q_S, KV_N, sparse_size]，当query的layout为TND时，"
            "shape需要传入[Q_T, KV_N, sparse_size]，其中sparse_size为一次离散选取的token数，需要保证每行有效值均在"
            "前半部分，无效值均在后半部分。",
        ),
        Rule(
            "SFA.block_table",
            DOCS,
            "block_table（Tensor）：可选参数，表示PageAttention中kvCache存储使用的block映射表。数据格式支持ND，"
            "数据类型支持int32，shape为2维，其中第一维长度为B，第二维长度不小于所有batch中最大的s2对应的block数量，"
            "即s2_max / block_size向上取整。",
        ),
        Rule(
            "SFA.kv_lengths",
            DOCS,
            "actual_seq_lengths_kv（Tensor）：可选参数，表示不同Batch中key和value的有效token数，数据类型支持int32。",
        ),
        Rule(
            "SFA.dims",
            SPARSE_FA_DOC,
            "参数query中的D和key、value的D值相等为512，参数query_rope中的D和key_rope的D值相等为64。 参数query、"
            "key、value的数据类型必须保持一致。 ... Atlas A3 推理系列产品/Atlas A2 推理系列产品： Q_N支持"
            "1/2/4/8/16/32/64/128。 ... 其中KV_N只支持1。",
            in_wheel=False,
        ),
        Rule(
            "SFA.blocks",
            SPARSE_FA_DOC,
            "sparse_block_size ... 取值范围为[1,128]，且为2的幂次方。 ... 在PageAttention场景下要求"
            "sparse_block_size整除block_size。 ... block_size取值为16的倍数，最大支持1024。",
            in_wheel=False,
        ),
        Rule(
            "SFA.modes",
            SPARSE_FA_DOC,
            "attention_mode ... 仅支持传入2，表示MLA-absorb模式 ... Atlas A3 推理系列产品/Atlas A2 推理系列产品："
            "... 不支持sinks。",
            in_wheel=False,
        ),
    ]
}

# The project's own calling rules (not torch_npu's).
PROJECT_RULES = {
    "HCCL.buffer_size": (
        "ProcessGroupHCCL.Options.hccl_config['hccl_buffer_size'] is a positive int (MB): the pinned "
        'wheel\'s libtorch_npu.so says "Value type of hccl_buffer_size should be int."; zero or negative '
        "sizes are not documented."
    ),
    "PROJECT.in_place_contiguous": (
        'Tensors an op updates in place (npu_apply_rotary_pos_emb\'s query and key, "原地更新") are '
        "passed contiguous: for a strided view the framework would compute on a contiguous copy, so "
        "either the update is lost to the caller's tensor or a copy is paid on every call."
    ),
    "PROJECT.no_hidden_cache_copy": (
        "KV caches are passed to in-place cache-write ops as contiguous tensors: a non-contiguous "
        "cache is copied to a contiguous temporary by the framework (and, for ATB, rejected on output), "
        "so either the write is lost or every step copies the whole cache."
    ),
    "PROJECT.valid_slots": (
        "Cache-write ops receive only real token slots (no -1 padding): negative slots are not "
        "documented for these ops."
    ),
}


class ContractViolation(RuntimeError):
    """A call that breaks a documented torch_npu precondition (it would fail or misbehave on an NPU)."""


def require(condition: bool, op: str, rule_id: str, detail: str) -> None:
    if condition:
        return
    if rule_id in RULES:
        rule = RULES[rule_id]
        cite = f"{rule.source}: {rule.quote!r}"
    else:
        cite = PROJECT_RULES[rule_id]
    raise ContractViolation(f"torch_npu contract: {op}: {detail} [{rule_id}; {cite}]")


def unmodelled(op: str, what: str) -> NotImplementedError:
    return NotImplementedError(
        f"torch_npu contract double: {op} with {what} is not modelled; add its documented semantics "
        "and preconditions to harness/doubles/torch_npu_site before calling it"
    )
