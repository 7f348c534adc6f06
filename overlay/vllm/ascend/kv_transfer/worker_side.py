"""Worker side of ``AscendP2PConnector`` (runs in every worker process).

Every rank registers its KV cache with the transport, then hands each step to its two
sides: the prefill side (``prefill_side.py``: holds a computed request for its readers
and serves the control plane, when the instance produces KV) and the decode side
(``decode_side.py``: pulls the requests it is given). This class owns what both share:
the rank's place in the layout, the transport, the pacing of empty steps and the
interval's statistics.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.logger import init_logger

from vllm.ascend import device as ascend_device
from vllm.ascend.attention.kv_layout import LayerLayout
from vllm.ascend.kv_transfer import wire
from vllm.ascend.kv_transfer.addressing import layer_regions, plane_regions
from vllm.ascend.kv_transfer.control import ControlServer
from vllm.ascend.kv_transfer.decode_side import DecodeSide
from vllm.ascend.kv_transfer.groups import TransferGroups
from vllm.ascend.kv_transfer.holds import Holds
from vllm.ascend.kv_transfer.layerwise import Publications
from vllm.ascend.kv_transfer.metadata import P2PConnectorMetadata
from vllm.ascend.kv_transfer.pacer import IdlePacer
from vllm.ascend.kv_transfer.prefill_side import PrefillSide
from vllm.ascend.kv_transfer.settings import P2PSettings
from vllm.ascend.kv_transfer.stats import P2PConnectorStats, StatsInterval
from vllm.ascend.kv_transfer.transport import Transport, open_transport

if TYPE_CHECKING:  # upstream's types, for the annotations only
    import torch

    from vllm.config import VllmConfig

logger = init_logger(__name__)


class P2PWorker:
    def __init__(self, settings: P2PSettings, vllm_config: VllmConfig, groups: TransferGroups) -> None:
        from vllm.distributed.parallel_state import get_pcp_group, get_tensor_model_parallel_rank

        self.settings = settings
        self.groups = groups
        self.layout = settings.layout
        model = vllm_config.model_config
        self._head_size = model.get_head_size()
        self._kv_lora_rank = model.hf_text_config.kv_lora_rank if model.use_mla else None
        self.tp_rank = get_tensor_model_parallel_rank()
        self.pcp_rank = get_pcp_group().rank_in_group if self.layout.pcp > 1 else 0
        self.rank = self.layout.rank(self.pcp_rank, self.tp_rank)
        self.global_rank = settings.dp_rank * self.layout.ranks_per_replica + self.rank
        self._transport: Transport | None = None
        self._server: ControlServer | None = None
        self._pacer = IdlePacer()
        self._idle = False
        self._stats = StatsInterval()  # this interval's; every side and thread records into it
        self._reported_holds: int | None = None
        # both made when the KV caches are registered (vLLM does that before any step)
        self.prefill: PrefillSide | None = None
        self.decode: DecodeSide | None = None

    # -- set-up -------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        layers: dict[str, tuple[int, LayerLayout]] = {}
        for name, tensor in kv_caches.items():
            if name not in self.groups.layer_group:
                continue  # a layer of a group that takes no part in transfers
            layers[name] = (
                tensor.data_ptr(),
                LayerLayout.of_cache(
                    tensor, self._head_size, self._kv_lora_rank, indexer=name in self.groups.indexer_layers
                ),
            )
        options = dict(self.settings.options, role="prefill" if self.settings.producer else "decode")
        port = self.settings.control_port(self.settings.dp_rank, self.rank)
        options.setdefault("llmdatadist_port", port + int(options.get("llmdatadist_port_offset", 1000)))
        device = next(iter(kv_caches.values())).device  # LLM-DataDist: the NPU holding this rank's cache
        options.setdefault("device_id", device.index if device.index is not None else 0)
        self._transport = transport = open_transport(self.settings.transport, self.settings.host, options)
        regions = layer_regions(layers, self.groups.layer_group)
        transport.register(plane_regions(regions))
        info = wire.RankInfo(
            wire.WIRE_VERSION,
            self.settings.engine_id,
            self.settings.dp_rank,
            self.rank,
            wire.Layout.of(self.layout),
            transport.name,
            transport.address,
            regions,
        )
        self.prefill = PrefillSide(
            Holds(self.settings.lease_seconds),
            Publications(len(regions), expiry=self.settings.lease_seconds),
            info,
            {region.name: i for i, region in enumerate(regions)},
            self._pacer,
            self._stats,
            record_event=_record_event,
        )
        self.decode = DecodeSide(
            self.settings,
            self.global_rank,
            self.tp_rank,
            transport,
            layers,
            self.groups,
            self._pacer,
            self._stats,
        )
        if self.settings.producer:
            self._server = ControlServer(
                self.settings.host,
                port,
                self.prefill.handle,
                name=f"prefill rank {self.rank}",
                # progress answers query the layers' device events on this thread
                on_start=ascend_device.current().bind_thread,
                trust=self.settings.trust,
                on_refused=self.prefill.refused,
            )
        logger.info(
            "AscendP2PConnector rank %d: %d KV layers registered with %s at %s",
            self.global_rank,
            len(layers),
            self.settings.transport,
            transport.address,
        )

    # -- per step -----------------------------------------------------------------------
    def bind_step(self, meta: P2PConnectorMetadata) -> None:
        """Before the step's forward: its layer-wise publications (``start_step`` may come
        after the forward: upstream starts asynchronous loads there)."""
        if self.prefill is not None:
            self.prefill.bind_step(meta)

    def start_step(self, meta: P2PConnectorMetadata | None) -> None:
        self._idle = meta is not None and meta.idle and not meta.sends and not meta.recvs
        if meta is None:
            return
        if meta.refusals and self.rank == 0:  # the replica's scheduler refused parameters: counted once
            refusals = meta.refusals
            self._stats.record(lambda stats: stats.record_refusals(refusals))
        if self.prefill is None or self.decode is None:
            raise RuntimeError("AscendP2PConnector: a step started before the KV caches were registered")
        self.prefill.hold(meta)
        self.decode.pull(meta.recvs)

    def layer_saved(self, layer_name: str) -> None:
        """Prefill: ``layer_name``'s forward has queued its KV writes."""
        if self.prefill is not None:
            self.prefill.layer_saved(layer_name)

    def step_saved(self) -> None:
        if self.prefill is not None:
            self.prefill.step_saved(self.global_rank)

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        self._pacer.pace(self._idle)
        if self.prefill is None or self.decode is None:
            return None, None
        return self.prefill.take_finished() or None, self.decode.take_finished() or None

    def take_stats(self) -> P2PConnectorStats | None:
        """This interval's statistics (None when there is nothing new)."""
        holds = None
        if self.prefill is not None:
            expired = self.prefill.holds.take_expired_count()
            self._stats.record(lambda stats: stats.record_expired_leases(expired))
            holds = len(self.prefill.holds) if self.settings.producer else None
        stats = self._stats.take()
        if holds is not None and holds != self._reported_holds:
            stats.record_holds(self.global_rank, holds)
            self._reported_holds = holds
        return None if stats.is_empty() else stats

    def take_failed_blocks(self) -> set[int]:
        return self.decode.take_failed_blocks() if self.decode is not None else set()

    def take_failed_requests(self) -> set[str]:
        return self.decode.take_failed_requests() if self.decode is not None else set()

    def close(self) -> None:
        if self.decode is not None:
            self.decode.close()
        if self._server is not None:
            self._server.close()
        if self._transport is not None:
            self._transport.close()


def _record_event():
    event = ascend_device.current().event()
    event.record()
    return event
