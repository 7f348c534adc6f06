"""The unquantized MoE method on Ascend: upstream's fused-MoE layer with an upstream
modular kernel made of the Ascend communication strategies (``prepare_finalize.py``)
and the Ascend local experts (``experts.py``).

Registered as the out-of-tree replacement of upstream's ``UnquantizedFusedMoEMethod``
(upstream's builds no kernel on an out-of-tree platform). Routing (grouped top-k,
sigmoid scoring, correction bias) stays upstream's pure-torch router; shared experts
are run by upstream's MoE runner, which also does the TP all-reduce when the kernel's
output is not already reduced. Because the method owns a kernel, the runner skips its
own naive DP dispatch/combine: the strategies do that work.
"""

from __future__ import annotations

import torch

import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from vllm.config import get_current_vllm_config
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

from vllm.ascend.moe.experts import AscendExperts
from vllm.ascend.moe.prepare_finalize import AscendMoEPrepareAndFinalize


def apply_kernel(kernel, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input):
    """Run a MoE method's modular kernel on the layer's expert weights (float or int8)."""
    return kernel.apply(
        hidden_states=x,
        w1=layer.w13_weight,
        w2=layer.w2_weight,
        topk_weights=topk_weights,
        topk_ids=topk_ids,
        activation=layer.activation,
        apply_router_weight_on_input=layer.apply_router_weight_on_input,
        global_num_experts=layer.global_num_experts,
        expert_map=layer.expert_map,
        shared_experts=shared_experts,
        shared_experts_input=shared_experts_input,
    )


@UnquantizedFusedMoEMethod.register_oot
class AscendUnquantizedFusedMoEMethod(UnquantizedFusedMoEMethod):
    @property
    def is_monolithic(self) -> bool:
        return False

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        # Weights stay as loaded: w13 [E, 2I, H], w2 [E, H, I].
        activation = getattr(layer, "activation", "silu")
        name = getattr(activation, "value", activation)
        if "silu" not in str(name).lower():
            raise NotImplementedError(f"Ascend MoE supports SiLU experts only, not {activation}")
        self.moe_quant_config = self.get_fused_moe_quant_config(layer)
        self.moe_kernel = mk.FusedMoEKernel(
            AscendMoEPrepareAndFinalize(self.moe, get_current_vllm_config()),
            AscendExperts(self.moe, self.moe_quant_config),
        )

    def _apply_kernel(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input):
        return apply_kernel(
            self.moe_kernel, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input
        )

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input):
        return self._apply_kernel(layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input)

    forward_native = _apply_kernel
    forward_oot = _apply_kernel
