"""The prefill side of ``AscendP2PConnector``'s worker: serving a request's KV to its
decode readers.

A prefill rank holds each request it computed for its readers (``holds.py``) and serves
the control plane: it answers ``Hello`` with its layout, transport address and KV
regions, counts ``DoneReading`` messages against the plan's read total, extends leases on
``Renew``, and reports a request as finished sending (its blocks may be freed) when all
its reads are done or its lease has run out. Layer-wise (``layerwise.py``) it records
when each layer of a published request is written and answers ``Progress``; asking
renews the request's lease.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from vllm.logger import init_logger

from vllm.ascend.kv_transfer import wire
from vllm.ascend.kv_transfer.holds import Done, Holds
from vllm.ascend.kv_transfer.layerwise import Publications
from vllm.ascend.kv_transfer.metadata import P2PConnectorMetadata
from vllm.ascend.kv_transfer.pacer import IdlePacer
from vllm.ascend.kv_transfer.stats import StatsInterval

logger = init_logger(__name__)


class PrefillSide:
    """One prefill rank's holds and layer-wise publications, and its control-plane
    handler (``handle``). ``info``: what ``Hello`` answers; ``layer_index``: a KV layer's
    index in it (what layer-wise progress names); ``record_event()``: a device event
    recorded on the stream now (a layer's writes are done when it has completed)."""

    def __init__(
        self,
        holds: Holds,
        publications: Publications | None,
        info: wire.RankInfo | None,
        layer_index: dict[str, int],
        pacer: IdlePacer,
        stats: StatsInterval,
        record_event: Callable[[], object],
    ):
        self.holds = holds
        self.publications = publications
        self._info = info
        self._layer_index = layer_index
        self._pacer, self._stats = pacer, stats
        self._record_event = record_event
        self._lock = threading.Lock()
        self._request_of_key: dict[str, str] = {}  # hold key (layerwise_id) -> request id
        self._told_layerwise = False

    # -- the control plane -----------------------------------------------------------------
    def handle(self, message: wire.Message) -> wire.Message:
        if isinstance(message, wire.Hello):
            if self._info is None:
                return wire.Reply(wire.WIRE_VERSION, False, "this rank has not registered its KV cache yet")
            return self._info
        if isinstance(message, wire.DoneReading):
            if not message.ok and message.reads_total:
                logger.warning(
                    "request %s: decode rank %d reports %d failed reads",
                    message.request_id,
                    message.decode_rank,
                    len(message.read_ids),
                )
            status = self.holds.done(
                message.request_id, message.reader, message.read_ids, message.reads_total
            )
            self._pacer.news()
            if status.held:
                return wire.Reply(wire.WIRE_VERSION, True, held=True)
            if status is Done.EXPIRED:
                return wire.Reply(
                    wire.WIRE_VERSION,
                    False,
                    "the request's lease ran out before these reads were reported; its blocks were freed",
                    lease_expired=True,
                )
            if status is Done.DROPPED:
                return wire.Reply(wire.WIRE_VERSION, False, "too many done messages for unknown requests")
            # not held: released for other readers, or unknown here; nothing vouched for the blocks
            return wire.Reply(wire.WIRE_VERSION, True, "the request is not held for this reader", held=False)
        if isinstance(message, wire.Renew):
            return wire.Reply(wire.WIRE_VERSION, True, lease_seconds=self.holds.renew(message.request_ids))
        if isinstance(message, wire.Progress) and self.publications is not None:
            self.holds.renew(message.transfer_ids)  # a decode rank is still reading them
            progress = self.publications.progress(message.transfer_ids)
            return wire.ProgressReply(wire.WIRE_VERSION, progress, self.publications.published % (1 << 31))
        return wire.Reply(wire.WIRE_VERSION, False, f"a prefill rank does not take {type(message).__name__}")

    def refused(self, kind: str) -> None:
        """The control server refused a frame (unsealed, malformed): counted."""
        self._stats.record(lambda stats: stats.record_refusals({f"control {kind}": 1}))

    # -- per step -----------------------------------------------------------------------
    def bind_step(self, meta: P2PConnectorMetadata) -> None:
        """Before the step's forward: its layer-wise publications."""
        if (meta.publishes or meta.failed) and self.publications is not None:
            self.publications.begin_step(meta.publishes, meta.failed)

    def hold(self, meta: P2PConnectorMetadata) -> None:
        """Hold the step's finished prefills for their readers."""
        for request_id, lease in meta.sends.items():
            key = meta.send_keys.get(request_id, request_id)
            if key != request_id:
                with self._lock:
                    self._request_of_key[key] = request_id
            self.holds.hold(key, lease, meta.send_readers.get(request_id, 1))

    def layer_saved(self, layer_name: str) -> None:
        """``layer_name``'s forward has queued its KV writes."""
        index = self._layer_index.get(layer_name)
        if index is not None and self.publications is not None and self.publications.saving:
            self.publications.layer_saved(index, self._record_event())

    def step_saved(self, global_rank: int) -> None:
        if self.publications is None or not self.publications.saving:
            return
        by_hook = self.publications.end_step(self._record_event())
        if not self._told_layerwise:
            self._told_layerwise = True
            logger.info(
                "AscendP2PConnector rank %d: layer-wise transfer publishes %d of %d layers as the "
                "forward writes them, the rest at the forward's end",
                global_rank,
                by_hook,
                self.publications.num_layers,
            )

    def take_finished(self) -> set[str]:
        """Requests whose blocks may be freed: every read done, or the lease ran out."""
        sending = self.holds.take_finished()
        with self._lock:
            if sending and self._request_of_key:
                for key in [k for k in sending if k in self._request_of_key]:
                    sending.discard(key)
                    sending.add(self._request_of_key.pop(key))
                    if self.publications is not None:
                        self.publications.retire(key)
        return sending
