"""The unquantized MoE method on Ascend: upstream's fused-MoE layer with an upstream
modular kernel made of the Ascend communication strategies (``prepare_finalize.py``)
and the Ascend local experts (``experts.py``).

Registered as the out-of-tree replacement of upstream's ``UnquantizedFusedMoEMethod``
(upstream's builds no kernel on an out-of-tree platform). Routing is the method's
own (``AscendMoEMethod``): the method is *monolithic* in upstream's terms, so the runner
hands it the router logits instead of calling upstream's router, whose plain softmax
top-k is a CUDA kernel (``_moe_C.topk_softmax``); the kernels facade's ``routing.route``
computes every scoring option upstream's layer offers (softmax or sigmoid, with or
without renormalisation, grouped or not, with a correction bias, scaled); with EPLB
the method then sends each route to a physical replica (``eplb.py``), as upstream's
router would. Shared experts are run by upstream's MoE runner, which also does the TP
all-reduce when the kernel's output is not already reduced. Because the method owns a kernel, the runner
skips its own naive DP dispatch/combine: the strategies do that work.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from vllm.config import get_current_vllm_config
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

from vllm.ascend.kernels.moe import ACTIVATIONS, activation_name
from vllm.ascend.kernels.routing import Routing, route, split_zero_experts
from vllm.ascend.moe.eplb import layer_eplb_state, map_to_physical
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


def logical_experts(layer) -> int:
    """The experts the router scores: the model's, without EPLB's redundant replicas
    (``global_num_experts`` counts the physical ones)."""
    return int(layer.moe_config.num_logical_experts)


def zero_experts(layer) -> int:
    """Zero-computation experts the router scores after the layer's real ones (LongCat):
    upstream's zero-expert router needs a correction bias, which covers them too."""
    bias = layer.e_score_correction_bias
    return 0 if bias is None else max(0, int(bias.shape[0]) - logical_experts(layer))


def layer_routing(layer) -> Routing:
    """The routing a fused-MoE layer asks for, as upstream's router factory resolves it,
    or an error naming the option the Ascend routing does not support."""
    name = getattr(layer, "layer_name", "a MoE layer")
    config = layer.moe_config
    if getattr(config, "has_hash_routing", False):
        raise NotImplementedError(f"{name}: hash routing (DeepSeek-V4) is not supported by the Ascend MoE")
    if getattr(config, "require_decomposed_backend", False):
        # upstream 0.33 sets it when the routes are changed between routing and the experts
        raise NotImplementedError(
            f"{name}: routes adjusted between routing and experts (expert substitution, MoE "
            "routing simulation) are not supported by the Ascend MoE"
        )
    grouped = bool(layer.use_grouped_topk)
    groups = (layer.num_expert_group or 1) if grouped else 1
    topk_group = (layer.topk_group or 1) if grouped else 1
    if grouped and (layer.num_expert_group is None or layer.topk_group is None):
        raise ValueError(f"{name}: grouped top-k needs num_expert_group and topk_group")
    # Upstream scales the weights in its grouped and biased routers only; its plain
    # top-k router ignores routed_scaling_factor (the model applies it, if at all).
    scaled = grouped or layer.e_score_correction_bias is not None
    routing = Routing(
        top_k=layer.top_k,
        scoring_func=layer.scoring_func,
        renormalize=bool(layer.renormalize),
        num_expert_group=groups,
        topk_group=topk_group,
        routed_scaling_factor=float(layer.routed_scaling_factor) if scaled else 1.0,
    )
    try:
        routing.check(logical_experts(layer) + zero_experts(layer))
    except ValueError as e:
        raise NotImplementedError(f"{name}: {e}") from None
    return routing


def check_activation(layer, moe_config, supported: tuple[str, ...]) -> None:
    """Refuse, when weights are loaded, an activation the layer's experts do not run."""
    name = activation_name(getattr(layer, "activation", "silu"))
    where = getattr(layer, "layer_name", "a MoE layer")
    if name not in supported:
        raise NotImplementedError(
            f"{where}: these Ascend MoE experts run {' and '.join(supported)} activations, not {name}"
        )
    limit = getattr(moe_config, "swiglu_limit", None)
    alpha = getattr(moe_config, "swiglu_alpha", None)
    if name == "silu" and (limit is not None or alpha is not None):
        raise NotImplementedError(
            f"{where}: SiLU experts with a clamp limit or alpha (swiglu_limit={limit}, "
            f"swiglu_alpha={alpha}) are not supported by the Ascend MoE"
        )


class AscendMoEMethod:
    """What every Ascend MoE method shares, float or quantized experts. Routing inside the
    method: upstream calls ``apply_monolithic`` with the router logits; the method routes
    (``routing.route``, or the model's own routing function) and runs its modular kernel,
    built once weights are loaded (``set_up_kernel``)."""

    zero_expert_output: torch.Tensor | None = None  # identity experts' output, until taken
    eplb: Any = None  # the layer's EplbLayerState with --enable-eplb (moe/eplb.py)

    # what the upstream method class it is mixed into has (annotations only)
    moe: Any
    get_fused_moe_quant_config: Callable[[Any], Any]

    def set_up_kernel(self, layer, experts_for) -> None:
        """The layer's routing (refused at load, not at the first step) and the modular
        kernel: the Ascend strategies as prepare/finalize, ``experts_for(quant_config)``
        as the local experts."""
        if layer.custom_routing_function is None:
            layer._ascend_routing = layer_routing(layer)
        vllm_config = get_current_vllm_config()
        self.eplb = layer_eplb_state(vllm_config, getattr(layer, "layer_name", ""))
        self.moe_quant_config = self.get_fused_moe_quant_config(layer)
        self.moe_kernel = mk.FusedMoEKernel(
            AscendMoEPrepareAndFinalize(self.moe, vllm_config),
            experts_for(self.moe_quant_config),
        )

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input):
        return apply_kernel(
            self.moe_kernel, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input
        )

    @property
    def is_monolithic(self) -> bool:
        return True

    @property
    def supports_eplb(self) -> bool:
        # Routing maps to physical experts (moe/eplb.py); every per-expert parameter has
        # the local experts first, which is what EPLB's in-place moves need.
        return True

    def select_experts(self, layer, x, router_logits):
        custom = layer.custom_routing_function
        if custom is not None:  # the model's own torch function (Llama 4, Cohere MoE, ...)
            weights, ids = custom(
                hidden_states=x, gating_output=router_logits, topk=layer.top_k, renormalize=layer.renormalize
            )
            return weights.to(torch.float32), ids.to(torch.int32)
        routing = getattr(layer, "_ascend_routing", None)
        if routing is None:
            routing = layer._ascend_routing = layer_routing(layer)
        bias = layer.e_score_correction_bias
        return route(router_logits, routing, None if bias is None else bias.data)

    def apply_monolithic(self, layer, x, router_logits, input_ids=None):
        topk_weights, topk_ids = self.select_experts(layer, x, router_logits)
        if zero_experts(layer):
            topk_weights, topk_ids, zero_weight = split_zero_experts(
                topk_weights, topk_ids, logical_experts(layer)
            )
            # identity experts: the runner adds this after the routed output's reduction
            self.zero_expert_output = (x.to(torch.float32) * zero_weight).to(x.dtype)
        if self.eplb is not None:
            topk_ids = map_to_physical(topk_ids, self.eplb)
        # Shared experts: the runner ran them before this call (the kernel cannot overlap them).
        return self.apply(layer, x, topk_weights, topk_ids, None, None)

    def take_zero_expert_output(self) -> torch.Tensor | None:
        """The identity experts' output of the last ``apply_monolithic`` (upstream's runner
        asks for it once per forward, through the zero-expert hook patch)."""
        output, self.zero_expert_output = self.zero_expert_output, None
        return output


@UnquantizedFusedMoEMethod.register_oot
class AscendUnquantizedFusedMoEMethod(AscendMoEMethod, UnquantizedFusedMoEMethod):
    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        # Weights stay as loaded: w13 [E, 2I, H], w2 [E, H, I] (and w13_bias, w2_bias).
        check_activation(layer, self.moe, ACTIVATIONS)
        self.set_up_kernel(layer, lambda quant_config: AscendExperts(self.moe, quant_config))

    forward_native = AscendMoEMethod.apply
    forward_oot = AscendMoEMethod.apply
