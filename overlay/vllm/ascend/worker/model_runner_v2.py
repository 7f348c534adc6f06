"""The Ascend model runner on upstream's Model Runner V2 (``vllm/v1/worker/gpu``): the
default runner (``worker/model_runner.py``, on upstream's V1 runner, serves what this one
does not run yet: ``platform/npu.py``, ``v2_unsupported_features``).

A thin subclass: V2 asks the platform for its streams and events (hook patch
``v2-runner-make-its-streams-and-events-through-the-platform``), its Triton kernels
are replaced by the torch forms of ``vllm.ascend.kernels.v2_runner`` (registered by the
platform), and its block tables by :class:`~vllm.ascend.worker.block_tables.NPUBlockTables`
(hook: ``block_tables_cls``), and its prompt-embeddings state, which reads a table of
device pointers, by :class:`~vllm.ascend.worker.prompt_embeds.NPUPromptEmbedsState`
after the model is loaded. Prefill context parallel splits a step's tokens around
the model call (hook: ``model_forward``), as on V1. V2 needs no DP step sync of ours (it
agrees on a step's padding in one all-reduce) and no generator bookkeeping (its sampling
noise is a hash of seed, position and token, not a generator's state). With the NPU
kernels its memory profile runs attention, as the V1 runner's does
(``worker/profiling.py``).
"""

from __future__ import annotations

import functools

import torch

from vllm.logger import init_logger
from vllm.v1.worker.gpu.model_runner import GPUModelRunner

from vllm.ascend import device as ascend_device
from vllm.ascend.context_parallel import forward as pcp_forward
from vllm.ascend.kernels import npu_kernels
from vllm.ascend.worker import profiling
from vllm.ascend.worker.block_tables import NPUBlockTables
from vllm.ascend.worker.model_runner import refuse_plane_blind_connector
from vllm.ascend.worker.prompt_embeds import NPUPromptEmbedsState

logger = init_logger(__name__)


class NPUModelRunnerV2(GPUModelRunner):
    def __init__(self, vllm_config, device: torch.device) -> None:
        self.device_layer = ascend_device.current()
        self._profiling_with_attention = False
        super().__init__(vllm_config, device)

    @property
    def block_tables_cls(self):
        pc = self.parallel_config
        if pc.prefill_context_parallel_size == 1:
            return NPUBlockTables
        from vllm.ascend.attention.context_parallel import rank_layout

        rank = rank_layout(pc)  # slots over PCP x DCP, not DCP alone
        return functools.partial(NPUBlockTables, layout=(rank.cp, rank.cp_rank))

    # -- prefill context parallel: the attention backends plan it from the whole step and
    # shard the KV over PCP x DCP; the model call runs this rank's share (hook patch
    # ``v2-runner-let-a-hardware-runner-split-prefill-context-parallel``) --------------
    def build_pcp_manager(self):
        return None  # upstream's manager rewrites the batch first and keeps KV replicas

    def model_forward(self, model_inputs: dict):
        plain = super().model_forward
        return pcp_forward.run_model(lambda **inputs: plain(inputs), model_inputs, self.device)

    def load_model(self, *args, **kwargs) -> None:
        super().load_model(*args, **kwargs)
        # upstream's prompt-embeddings state copies rows through a table of device
        # pointers (a Triton kernel); ours indexes one tensor of the live requests' rows
        state = getattr(self.model_state, "prompt_embeds_state", None)
        if state is not None:
            self.model_state.prompt_embeds_state = NPUPromptEmbedsState(
                self.max_num_reqs, state.hidden_size, state.dtype, self.device
            )

    def initialize_kv_cache(self, kv_cache_config, is_profiling: bool = False, **kwargs) -> None:
        refuse_plane_blind_connector(self.vllm_config, is_profiling)
        super().initialize_kv_cache(kv_cache_config, is_profiling=is_profiling, **kwargs)

    # -- memory profiling with attention (worker/profiling.py) ---------------------------
    def profile_run(self, randomize_inputs: bool = False) -> None:
        if not npu_kernels():
            return super().profile_run(randomize_inputs)
        profiling.init_profiling_kv_cache(self, profiling.even_split(self.max_num_tokens, self.max_num_reqs))
        self._profiling_with_attention = True
        try:
            super().profile_run(randomize_inputs)
        finally:
            self._profiling_with_attention = False
            self._release_profiling_kv_cache()

    def _dummy_run(self, num_tokens: int, *args, skip_attn: bool = False, is_profile: bool = False, **kwargs):
        if is_profile and self._profiling_with_attention:
            skip_attn = False
        return super()._dummy_run(num_tokens, *args, skip_attn=skip_attn, is_profile=is_profile, **kwargs)

    def _release_profiling_kv_cache(self) -> None:
        """Drop the profiling cache before the worker sizes the real one (V2 has no
        clean-up of its own for this: upstream never profiles with a KV cache)."""
        self.device_layer.synchronize()
        self.kv_caches.clear()
        for layer in self.compilation_config.static_forward_context.values():
            if hasattr(layer, "kv_cache"):
                layer.kv_cache = torch.tensor([])
        del self.kv_cache_config
        self.cache_config.num_gpu_blocks = None
