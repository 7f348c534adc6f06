"""CPU kernels of the contract double: documented preconditions, then documented semantics.

Each function receives every schema argument by name (defaults filled in). The
checks come first and each names the rule it enforces (``_rules.RULES``); then the
op's documented result is computed in plain torch, in float32 and cast to the output
dtype as the NPU kernels accumulate. Argument combinations the project does not use
are refused as unmodelled rather than guessed.
"""

from __future__ import annotations

from ._common import FIA
from .activation import npu_clipped_swiglu, npu_swiglu
from .attention import (
    ATTENTION_UPDATE,
    FIA_V2,
    fia_infer_output,
    fia_max_workspace,
    fia_v2_infer_output,
    npu_attention_update,
    npu_fused_infer_attention_score,
    npu_fused_infer_attention_score_out,
    npu_fused_infer_attention_score_v2,
    npu_fused_infer_attention_score_v2_out,
)
from .cache import _npu_reshape_and_cache, npu_scatter_nd_update_
from .dsa import LI, SFA, npu_lightning_indexer, npu_sparse_flash_attention
from .gdn import CGDR, RGDR, npu_chunk_gated_delta_rule, npu_recurrent_gated_delta_rule
from .mc2 import MC2_COMBINE, MC2_DISPATCH, npu_moe_distribute_combine_v2, npu_moe_distribute_dispatch_v2
from .mla_prolog import IROPE, KRRC, npu_interleave_rope, npu_kv_rmsnorm_rope_cache
from .moe import (
    FINALIZE_ROUTING,
    GTK,
    GTKS,
    GTKS2,
    INIT_ROUTING,
    INT4PACK,
    npu_convert_weight_to_int4pack,
    npu_grouped_matmul,
    npu_moe_finalize_routing,
    npu_moe_gating_top_k,
    npu_moe_gating_top_k_softmax,
    npu_moe_gating_top_k_softmax_v2,
    npu_moe_init_routing_v2,
)
from .norm import npu_add_rms_norm, npu_rms_norm
from .quant import QMM, npu_dynamic_quant, npu_quant_matmul, npu_quantize
from .rotary import APPLY_ROPE, npu_apply_rotary_pos_emb, npu_rotary_mul

KERNELS = {
    "npu": {
        GTKS: npu_moe_gating_top_k_softmax,
        GTKS2: npu_moe_gating_top_k_softmax_v2,
        GTK: npu_moe_gating_top_k,
        FIA: npu_fused_infer_attention_score,
        FIA + ".out": npu_fused_infer_attention_score_out,
        FIA_V2: npu_fused_infer_attention_score_v2,
        FIA_V2 + ".out": npu_fused_infer_attention_score_v2_out,
        "_" + FIA_V2 + "_infer_output": fia_v2_infer_output,
        "_" + FIA_V2 + "_get_max_workspace": fia_max_workspace,
        "_" + FIA + "_infer_output": fia_infer_output,
        "_" + FIA + "_get_max_workspace": fia_max_workspace,
        "npu_scatter_nd_update_": npu_scatter_nd_update_,
        "npu_grouped_matmul": npu_grouped_matmul,
        INT4PACK: npu_convert_weight_to_int4pack,
        "npu_swiglu": npu_swiglu,
        "npu_clipped_swiglu": npu_clipped_swiglu,
        "npu_rms_norm": npu_rms_norm,
        "npu_add_rms_norm": npu_add_rms_norm,
        "npu_rotary_mul": npu_rotary_mul,
        APPLY_ROPE: npu_apply_rotary_pos_emb,
        KRRC: npu_kv_rmsnorm_rope_cache,
        IROPE: npu_interleave_rope,
        INIT_ROUTING: npu_moe_init_routing_v2,
        FINALIZE_ROUTING: npu_moe_finalize_routing,
        MC2_DISPATCH: npu_moe_distribute_dispatch_v2,
        MC2_COMBINE: npu_moe_distribute_combine_v2,
        ATTENTION_UPDATE: npu_attention_update,
        QMM: npu_quant_matmul,
        "npu_dynamic_quant": npu_dynamic_quant,
        "npu_quantize": npu_quantize,
        CGDR: npu_chunk_gated_delta_rule,
        RGDR: npu_recurrent_gated_delta_rule,
        LI: npu_lightning_indexer,
        SFA: npu_sparse_flash_attention,
    },
    "atb": {
        "_npu_reshape_and_cache": _npu_reshape_and_cache,
    },
}
