"""``--quantization ascend``: msModelSlim checkpoints, each layer as its description says.

vLLM finds ``quant_model_description.json`` in the model directory (``get_config_filenames``)
and builds this config from it; patch
``model-config-let-the-platform-recognise-a-quantized-checkpoint`` also selects ``ascend``
by itself when that file is there and the user named no method. Per layer:

* linear layers: static W8A8, dynamic W8A8 or float (``FLOAT``);
* MoE routed experts: dynamic W8A8, dynamic W4A8 (int4 weights per channel, the
  description's version "1.0.0" format), or float (the Ascend unquantized MoE method);
* embeddings, the LM heads (also the MTP module's), attention and the MoE router stay float.

Everything the description cannot serve is refused at start-up with the layer's name.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase

from vllm.ascend.quantization.description import (
    FILENAME,
    FLOAT,
    W4A8_DYNAMIC,
    W8A8,
    W8A8_DYNAMIC,
    DescriptionError,
    QuantDescription,
)

NAME = "ascend"


@register_quantization_config(NAME)
class AscendQuantConfig(QuantizationConfig):
    def __init__(self, description: QuantDescription):
        super().__init__()
        self.description = description
        # vLLM's DeepSeek MTP module builds eh_proj as a plain float nn.Linear
        quantized_eh = description.quantized_tensors_matching(".eh_proj.")
        if quantized_eh:
            raise DescriptionError(
                f"{description.source}: {quantized_eh[0]} is quantized, but vLLM builds the MTP "
                'module\'s eh_proj unquantized; mark it "FLOAT" (and keep its float weight)'
            )
        # and DeepSeek-V3.2's indexer builds its key and weights projections (fused as
        # wk_weights_proj) float; its query projection wq_b follows the description
        quantized_indexer = description.quantized_tensors_matching(
            ".indexer.wk."
        ) + description.quantized_tensors_matching(".indexer.weights_proj.")
        if quantized_indexer:
            raise DescriptionError(
                f"{description.source}: {quantized_indexer[0]} is quantized, but vLLM builds the "
                "sparse-attention indexer's key and weights projections unquantized; mark them "
                '"FLOAT" (and keep their float weights)'
            )

    def __repr__(self) -> str:
        return f"AscendQuantConfig({self.description.source}, model_quant_type={self.description.model_quant_type})"

    @classmethod
    def get_name(cls) -> str:
        return NAME

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0  # NPUs report no CUDA capability

    @staticmethod
    def get_config_filenames() -> list[str]:
        return [FILENAME]

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> AscendQuantConfig:
        return cls(QuantDescription(config))

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        # imported here: registering the name (every process, early) needs none of the layers
        from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
        from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

        from vllm.ascend.quantization.linear import AscendW8A8DynamicLinearMethod, AscendW8A8LinearMethod

        if isinstance(layer, VocabParallelEmbedding):  # embeddings and LM heads
            scheme = self.description.tensor_scheme(f"{prefix}.weight")
            if scheme not in (None, FLOAT):
                raise DescriptionError(
                    f"{self.description.source}: {prefix} is {scheme}; embeddings and LM heads "
                    'are served unquantized (mark them "FLOAT")'
                )
            return None
        if isinstance(layer, LinearBase):
            scheme = self.description.layer_scheme(prefix, self.packed_modules_mapping)
            if scheme == FLOAT:
                return UnquantizedLinearMethod()
            if scheme == W4A8_DYNAMIC:
                raise DescriptionError(
                    f"{self.description.source}: {prefix} is W4A8_DYNAMIC; this build takes W4A8 for "
                    "MoE experts only (linear layers: W8A8, W8A8_DYNAMIC or FLOAT, as msModelSlim's "
                    "W4A8 recipes quantize them)"
                )
            if scheme == W8A8 and prefix.endswith(".kv_b_proj"):
                # MLA splits kv_b_proj into its up-projections by applying it to an identity
                # matrix, which a calibrated per-tensor activation scale cannot pass exactly
                raise DescriptionError(
                    f"{self.description.source}: {prefix} is static W8A8; MLA's kv_b_proj must "
                    "be W8A8_DYNAMIC or FLOAT"
                )
            return AscendW8A8LinearMethod() if scheme == W8A8 else AscendW8A8DynamicLinearMethod()
        if isinstance(layer, RoutedExperts):
            scheme = self.description.experts_scheme(prefix)
            if scheme == FLOAT:
                return None  # upstream builds its unquantized method: the Ascend one replaces it
            if scheme == W8A8:
                raise DescriptionError(
                    f"{self.description.source}: the experts of {prefix} are static W8A8; "
                    "MoE experts take W8A8_DYNAMIC (msModelSlim's MoE scheme) or FLOAT"
                )
            from vllm.ascend.quantization.moe import AscendW4A8DynamicMoEMethod, AscendW8A8DynamicMoEMethod

            if scheme == W4A8_DYNAMIC:
                return AscendW4A8DynamicMoEMethod(layer.moe_config)
            assert scheme == W8A8_DYNAMIC
            return AscendW8A8DynamicMoEMethod(layer.moe_config)
        return None
