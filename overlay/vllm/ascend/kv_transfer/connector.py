"""``AscendP2PConnector``: P2P disaggregated prefill where decode pulls the KV cache.

vLLM builds one connector per process and role; this class only hands each call to the
scheduler side (``scheduler_side.py``, in the engine core) or the worker side
(``worker_side.py``, in every worker: its prefill side ``prefill_side.py`` and decode side
``decode_side.py``), which share nothing but the metadata vLLM passes between them each step.

It declares upstream's ``SupportsHMA``: with the hybrid KV-cache manager on, every KV-cache
group moves by its own block table (``groups.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.config.kv_transfer import KVCacheAccess
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from vllm.ascend.attention.kv_layout import VLLM_LAYOUT
from vllm.ascend.kv_transfer.groups import TransferGroups
from vllm.ascend.kv_transfer.metadata import P2PConnectorMetadata
from vllm.ascend.kv_transfer.scheduler_side import P2PScheduler
from vllm.ascend.kv_transfer.settings import P2PSettings
from vllm.ascend.kv_transfer.stats import P2PConnectorStats, P2PPromMetrics

if TYPE_CHECKING:
    import torch

    from vllm.config import VllmConfig
    from vllm.config.kv_transfer import KVTransferConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    # imported by a worker's connector only (it brings the transports)
    from vllm.ascend.kv_transfer.worker_side import P2PWorker


class AscendP2PConnector(KVConnectorBase_V1, SupportsHMA):
    # It reads and writes the Ascend K/V (MLA: latent/rope) planes (attention/kv_layout.py).
    addresses_ascend_kv_planes = True

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        return VLLM_LAYOUT

    @classmethod
    def kv_cache_access(cls, kv_transfer_config: KVTransferConfig) -> KVCacheAccess:
        # the workers register the device KV cache with the transport (Mooncake's engine or
        # LLM-DataDist), as upstream's Mooncake connector does
        return KVCacheAccess.REGISTERS

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        settings = P2PSettings.from_config(vllm_config)
        self._groups = TransferGroups.of(kv_cache_config)
        self._scheduler: P2PScheduler | None = None
        self._worker: P2PWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = P2PScheduler(
                settings,
                self._groups,
                getattr(kv_cache_config, "hash_block_size", None),
                vllm_config.num_hash_lookahead_tokens,
            )
        if role == KVConnectorRole.WORKER:
            from vllm.ascend.kv_transfer.worker_side import P2PWorker

            self._worker = P2PWorker(settings, vllm_config, self._groups)

    @property
    def scheduler(self) -> P2PScheduler:
        """The scheduler side (the engine core's connector only)."""
        if self._scheduler is None:
            raise RuntimeError("AscendP2PConnector: a scheduler call on a worker's connector")
        return self._scheduler

    @property
    def worker(self) -> P2PWorker:
        """The worker side (a worker's connector only)."""
        if self._worker is None:
            raise RuntimeError("AscendP2PConnector: a worker call on the scheduler's connector")
        return self._worker

    # -- scheduler side ---------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def may_load_async(self, request: Request) -> bool:
        return self.scheduler.may_load_async(request)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> P2PConnectorMetadata:
        return self.scheduler.build_connector_meta(
            scheduler_output, idle=scheduler_output.total_num_scheduled_tokens == 0
        )

    def on_new_request(self, request: Request) -> None:
        self.scheduler.on_new_request(request)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        return self.scheduler.request_finished(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict | None]:
        return self.scheduler.request_finished(request, block_ids)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        return self._groups.ids  # a pull restores the request's blocks of every group

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.scheduler.update_connector_output(connector_output)

    # -- worker side ------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: P2PConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            self._worker.bind_step(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self.worker.start_step(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # whole requests are pulled before they are scheduled

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        self.worker.layer_saved(layer_name)  # layer-wise: decode may read this layer once written

    def wait_for_save(self) -> None:
        self.worker.step_saved()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self.worker.get_finished()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving = self.worker.get_finished()
        return KVConnectorTransferResults(
            finished_sending=set(sending or ()),
            finished_recving=set(recving or ()),
            failed_recving=self.worker.take_failed_requests(),
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_failed_blocks()

    # -- statistics (stats.py): vLLM's log line and /metrics ------------------------------
    def get_kv_connector_stats(self) -> P2PConnectorStats | None:
        return None if self._worker is None else self._worker.take_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict | None = None) -> P2PConnectorStats:
        return P2PConnectorStats(data=data) if data is not None else P2PConnectorStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> P2PPromMetrics:
        return P2PPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.close()
