"""When decode graphs run: the graph mode and capture sizes the platform settles at
start-up (``choose_graph_mode``, called from the platform's ``check_and_update_config``),
and what keeps them off (``graph_refusal``), logged with the reason. docs/model_runner.md,
"Decode graphs"."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.logger import init_logger

from vllm.ascend.spec_decode.config import GRAPH_METHODS

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.compilation import CompilationConfig

logger = init_logger(__name__)


def graph_refusal(vllm_config: VllmConfig) -> str | None:
    """Why decode graphs stay off for this configuration (None: they may run)."""
    pc, spec = vllm_config.parallel_config, vllm_config.speculative_config
    model = vllm_config.model_config
    if pc.prefill_context_parallel_size > 1 or pc.decode_context_parallel_size > 1:
        return "context parallelism is not captured in graphs yet"
    if pc.pipeline_parallel_size > 1:
        return "pipeline parallelism is not captured in graphs yet"
    if vllm_config.lora_config is not None:
        return "LoRA adapters are not captured in graphs yet"
    if model is not None and model.enable_sleep_mode:
        return "sleep mode releases and re-creates the tensors a captured graph points at"
    from vllm.platforms import current_platform

    if current_platform.opaque_attention_op():
        # torch_npu's capture only sees ops dispatched outside a Python custom op: the fused
        # attention inside one would keep its capture-time lengths at every replay
        return "attention runs inside one opaque custom op, where the graph update cannot reach it"
    from vllm.ascend.moe.selector import MoEComm
    from vllm.ascend.moe.step import forced_strategy

    if forced_strategy(vllm_config) is MoEComm.ALLTOALL:
        return "a forced AllToAll takes its split sizes from the device counts on the host (use mc2 or allgather)"
    if spec is not None and spec.method not in GRAPH_METHODS:
        only = ", ".join(GRAPH_METHODS)
        return f"the speculative method '{spec.method}' is not captured in graphs (only {only})"
    return None


def choose_graph_mode(vllm_config: VllmConfig) -> None:
    """Decode graphs (FULL_DECODE_ONLY) where the NPU kernels run, as upstream resolved the
    mode (``--enforce-eager`` gives NONE); steps with a prefill run eagerly, and without
    torch.compile there are no piecewise graphs. Refused combinations run eagerly, logged
    with the reason."""
    from vllm.config.compilation import CUDAGraphMode

    compilation_config = vllm_config.compilation_config
    if compilation_config.cudagraph_mode == CUDAGraphMode.NONE:
        _no_graph_sizes(compilation_config)
        return
    reason = graph_refusal(vllm_config)
    if reason is not None:
        compilation_config.cudagraph_mode = CUDAGraphMode.NONE
        _no_graph_sizes(compilation_config)
        logger.info_once("Ascend platform: decode graphs off (%s)", reason)
        return
    if compilation_config.cudagraph_mode != CUDAGraphMode.FULL_DECODE_ONLY:
        compilation_config.cudagraph_mode = CUDAGraphMode.FULL_DECODE_ONLY
    # upstream sizes decode graphs by request count (n requests x 1 + k tokens each)
    sizes = compilation_config.decode_cudagraph_capture_request_sizes or []
    logger.info_once(
        "Ascend platform: decode graphs (FULL_DECODE_ONLY) for %d batch sizes up to %s requests "
        "(ACL graphs through torch_npu; steps with a prefill run eagerly; --enforce-eager turns them off)",
        len(sizes),
        compilation_config.max_decode_cudagraph_capture_requests,
    )


def _no_graph_sizes(compilation_config: CompilationConfig) -> None:
    """No graphs: none to size (the sizes upstream resolved say what would be captured)."""
    compilation_config.cudagraph_capture_sizes = []
    compilation_config.max_cudagraph_capture_size = 0
    compilation_config.prefill_cudagraph_capture_token_sizes = []
    compilation_config.max_prefill_cudagraph_capture_tokens = 0
    compilation_config.decode_cudagraph_capture_request_sizes = []
    compilation_config.max_decode_cudagraph_capture_requests = 0
