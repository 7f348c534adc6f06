"""Per-process registration of this distribution's components with vLLM's registries.

Called in every process that builds models (workers) and by the platform's config
step: attention backend names into vLLM's backend enum and the MoE method as the
out-of-tree replacement of upstream's unquantized MoE method, the ``ascend``
quantization config (msModelSlim checkpoints), and the Ascend forms of upstream's layer
ops (``vllm/ascend/ops``); for hybrid models also the Gated DeltaNet layer.
"""

from __future__ import annotations

from functools import cache


@cache
def register_runtime_components() -> None:
    from vllm.ascend.attention.registry import register_attention_backends

    register_attention_backends()
    import vllm.ascend.moe.method  # noqa: F401  (registers through its decorator)
    import vllm.ascend.quantization.config  # noqa: F401  (likewise: the "ascend" quantization name)
    from vllm.ascend.ops import register_layer_ops

    register_layer_ops()


@cache
def register_state_layer_components() -> None:
    """What hybrid models need besides: the Ascend Gated DeltaNet layer (``ops/gdn.py``)."""
    from vllm.ascend.ops import register_state_layer_ops

    register_state_layer_ops()
