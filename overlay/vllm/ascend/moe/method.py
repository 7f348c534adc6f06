"""The unquantized MoE method on Ascend: upstream's fused-MoE layer, our expert kernel.

Registered as the out-of-tree replacement of upstream's ``UnquantizedFusedMoEMethod``
(upstream's has no kernel on an out-of-tree platform). Routing (grouped top-k,
sigmoid scoring, correction bias) stays upstream's pure-torch router; shared experts
are run by upstream's MoE runner. This is the seam where the AllGather / AllToAll /
MC2 communication strategies attach in a later step.
"""

from __future__ import annotations

import torch

from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

from vllm.ascend.kernels.moe import moe_experts


@UnquantizedFusedMoEMethod.register_oot
class AscendUnquantizedFusedMoEMethod(UnquantizedFusedMoEMethod):
    @property
    def is_monolithic(self) -> bool:
        return False

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        # Weights stay as loaded: w13 [E, 2I, H], w2 [E, H, I].
        pass

    def _experts(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input):
        activation = getattr(layer, "activation", "silu")
        name = getattr(activation, "value", activation)
        if "silu" not in str(name).lower():
            raise NotImplementedError(f"Ascend MoE supports SiLU experts only, not {activation}")
        return moe_experts(x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids,
                           expert_map=layer.expert_map,
                           apply_router_weight_on_input=layer.apply_router_weight_on_input)

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input):
        return self._experts(layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input)

    forward_native = _experts
    forward_oot = _experts
