"""The local-expert step of the Ascend MoE kernel: the kernels facade's grouped
matmul + SwiGLU (torch_npu on an NPU, plain torch in the reference), on whatever rows
the prepare step delivered. It returns the weighted sum over each row's experts; the
strategies that weight elsewhere pass weights of one. Expert biases (gpt-oss) come
from the method's quant config, as upstream's kernels take them."""

from __future__ import annotations

import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import TopKWeightAndReduceNoOP

from vllm.ascend.kernels.moe import ACTIVATIONS, moe_experts


class AscendExperts(mk.FusedMoEExpertsModular):
    @staticmethod
    def activation_format() -> mk.FusedMoEActivationFormat:
        return mk.FusedMoEActivationFormat.Standard

    @staticmethod
    def _supports_current_device() -> bool:
        return True

    @staticmethod
    def _supports_no_act_and_mul() -> bool:
        return False

    @staticmethod
    def _supports_quant_scheme(weight_key, activation_key) -> bool:
        return weight_key is None and activation_key is None

    @staticmethod
    def _supports_activation(activation: MoEActivation) -> bool:
        return activation.value in ACTIVATIONS

    @staticmethod
    def _supports_parallel_config(moe_parallel_config) -> bool:
        return True

    def workspace_shapes(
        self, M, N, K, topk, global_num_experts, local_num_experts, expert_tokens_meta, activation
    ):
        # The facade allocates what it needs; the output is one row per input row.
        return (0,), (0,), (M, K)

    def finalize_weight_and_reduce_impl(self) -> mk.TopKWeightAndReduce:
        # Rows come back already weighted and summed (upstream's other reducers call
        # vLLM's CUDA moe_sum, which this wheel does not have).
        return TopKWeightAndReduceNoOP()

    def apply(
        self,
        output,
        hidden_states,
        w1,
        w2,
        topk_weights,
        topk_ids,
        activation,
        global_num_experts,
        expert_map,
        a1q_scale,
        a2_scale,
        workspace13,
        workspace2,
        expert_tokens_meta,
        apply_router_weight_on_input,
    ):
        output.copy_(
            self.run(
                hidden_states,
                w1,
                w2,
                topk_weights,
                topk_ids,
                expert_map,
                apply_router_weight_on_input,
                activation,
            )
        )

    def run(self, x, w1, w2, topk_weights, topk_ids, expert_map, apply_router_weight_on_input, activation):
        """The experts' weighted output for ``x``: the kernel call a quantized subclass replaces."""
        return moe_experts(
            x,
            w1,
            w2,
            topk_weights,
            topk_ids,
            expert_map=expert_map,
            apply_router_weight_on_input=apply_router_weight_on_input,
            activation=activation,
            w13_bias=self.quant_config.w1_bias,
            w2_bias=self.quant_config.w2_bias,
        )
