"""Scheduler side of ``AscendP2PConnector`` (runs in the engine core).

Prefill (kv_producer): a request that arrived with ``kv_transfer_params.do_remote_decode``
keeps its blocks when it finishes; the response's ``kv_transfer_params`` tell the decode
instance where they are. The workers free them when every read is reported done, or when
the lease runs out.

Decode (kv_consumer): a request with ``do_remote_prefill`` waits for its KV: the workers
pull it (``worker_side.py``) after the scheduler has allocated the blocks. While it waits,
a background thread renews its lease on the prefill ranks. A request that never gets
its blocks (aborted, or fully cached here) releases the prefill blocks at once.

Block tables travel per KV-cache group (``groups.py``); with a sliding-window group the
prefill side computes the prompt but its last token, which the decode side computes.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import msgspec

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from vllm.ascend.kv_transfer import wire
from vllm.ascend.kv_transfer.control import ControlClient
from vllm.ascend.kv_transfer.groups import TransferGroups
from vllm.ascend.kv_transfer.settings import P2PSettings

logger = logging.getLogger(__name__)


class RemotePrefill(msgspec.Struct, forbid_unknown_fields=False):
    """``kv_transfer_params`` of a decode request, as the prefill instance returned them."""

    remote_engine_id: str
    remote_request_id: str  # the prefill instance's id: its holds are keyed by it
    remote_host: str
    remote_port: int
    remote_ranks: int
    remote_dp_rank: int
    remote_block_ids: list[list[int]]  # per transferred KV-cache group
    remote_num_tokens: int  # tokens computed there: the prompt minus ``remote_backoff``
    remote_backoff: int = 0
    do_remote_prefill: bool = False


@dataclass
class RecvSpec:
    request_id: str
    remote: RemotePrefill
    first_token: int  # tokens before it are cached here and are not pulled
    local_block_ids: list[list[int]]  # per transferred KV-cache group


@dataclass
class P2PConnectorMetadata(KVConnectorMetadata):
    sends: dict[str, float] = field(default_factory=dict)  # request id -> lease seconds
    recvs: list[RecvSpec] = field(default_factory=list)
    # the step schedules no tokens: upstream keeps stepping while blocks wait for a
    # delayed free or a pull, and the workers pace such steps (worker_side.IdlePacer)
    idle: bool = False


def parse_remote(params: dict | None) -> RemotePrefill | None:
    if not params or not params.get("do_remote_prefill"):
        return None
    try:
        return msgspec.convert(params, RemotePrefill)
    except msgspec.ValidationError as e:
        logger.warning(
            "kv_transfer_params with do_remote_prefill are malformed (%s); computing the prompt "
            "locally instead",
            e,
        )
        return None


class P2PScheduler:
    def __init__(self, settings: P2PSettings, groups: TransferGroups):
        self.settings = settings
        self.groups = groups
        self._sends: dict[str, float] = {}
        self._recvs: list[RecvSpec] = []
        self._local_hits: dict[str, int] = {}
        self._waiting: dict[str, RemotePrefill] = {}  # decode: requests whose KV is not here yet
        self._lock = threading.Lock()
        self._outbox: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._thread = None
        if settings.consumer:
            self._client = ControlClient(settings.control_timeout)
            self._thread = threading.Thread(target=self._messenger, name="kv-p2p-renew", daemon=True)
            self._thread.start()

    # -- prefill ------------------------------------------------------------------------
    def on_new_request(self, request) -> None:
        """Prefill: leave the prompt's last ``backoff`` tokens to the decode side (groups.py).
        Once per request (a preempted request comes back already shortened)."""
        params = request.kv_transfer_params
        backoff = self.groups.backoff
        if not (
            self.settings.producer
            and backoff
            and params
            and params.get("do_remote_decode")
            and not params.get("_ascend_backoff")
            and request.prompt_token_ids is not None
            and request.num_prompt_tokens > backoff
        ):
            return
        del request.prompt_token_ids[-backoff:]
        del request._all_token_ids[-backoff:]
        request.num_prompt_tokens -= backoff
        request.max_tokens = 1
        params["_ascend_backoff"] = backoff

    def request_finished(self, request, block_ids: tuple[list[int], ...]):
        params = request.kv_transfer_params or {}
        remote = parse_remote(params) if self.settings.consumer else None
        if remote is not None:  # decode: finished before its KV was pulled
            self._release(request.request_id, remote)
            return False, None
        if not (self.settings.producer and params.get("do_remote_decode")):
            return False, None
        from vllm.v1.request import RequestStatus

        if (
            request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
            or not block_ids
        ):
            return False, None
        self._sends[request.request_id] = self.settings.lease_seconds
        layout = self.settings.layout
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.settings.engine_id,
            "remote_request_id": request.request_id,
            "remote_host": self.settings.host,
            "remote_port": self.settings.control_port(self.settings.dp_rank, 0),
            "remote_ranks": layout.ranks_per_replica,
            "remote_dp_rank": self.settings.dp_rank,
            "remote_block_ids": [list(block_ids[g]) for g in self.groups.ids],
            "remote_num_tokens": len(request.prompt_token_ids),
            "remote_backoff": int(params.get("_ascend_backoff", 0)),
        }

    # -- decode -------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        remote = parse_remote(request.kv_transfer_params) if self.settings.consumer else None
        if remote is None:
            return 0, False
        mismatch = None
        if remote.remote_num_tokens + remote.remote_backoff != len(request.prompt_token_ids):
            mismatch = (
                f"the prefill instance computed {remote.remote_num_tokens} tokens of a "
                f"{remote.remote_num_tokens + remote.remote_backoff}-token prompt, this one has "
                f"{len(request.prompt_token_ids)}"
            )
        elif len(remote.remote_block_ids) != len(self.groups.ids):
            mismatch = (
                f"the prefill instance sent block tables for {len(remote.remote_block_ids)} KV-cache "
                f"groups, this one has {len(self.groups.ids)} (run both with the same hybrid "
                "KV-cache manager setting)"
            )
        if mismatch is not None:
            logger.warning("request %s: %s; computing it locally", request.request_id, mismatch)
            request.kv_transfer_params["do_remote_prefill"] = False
            self._release(request.request_id, remote)
            return 0, False
        with self._lock:
            self._waiting.setdefault(request.request_id, remote)
        self._local_hits[request.request_id] = num_computed_tokens
        missing = remote.remote_num_tokens - num_computed_tokens
        return (missing, True) if missing > 0 else (0, False)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        remote = parse_remote(request.kv_transfer_params) if self.settings.consumer else None
        if remote is None:
            return
        request.kv_transfer_params["do_remote_prefill"] = False  # pull once
        first = self._local_hits.pop(request.request_id, 0)
        if num_external_tokens == 0:
            self._release(request.request_id, remote)
            return
        tables = blocks.get_block_ids()
        self._recvs.append(
            RecvSpec(request.request_id, remote, first, [list(tables[g]) for g in self.groups.ids])
        )

    def build_connector_meta(self, idle: bool = False) -> P2PConnectorMetadata:
        meta = P2PConnectorMetadata(self._sends, self._recvs, idle)
        self._sends, self._recvs = {}, []
        return meta

    def update_connector_output(self, output) -> None:
        done = output.finished_recving or ()
        if done:
            with self._lock:
                for request_id in done:
                    self._waiting.pop(request_id, None)

    # -- messages to prefill ranks ------------------------------------------------------
    def _release(self, request_id: str, remote: RemotePrefill) -> None:
        """Tell every prefill rank holding the request to free it: nothing will be read."""
        self._local_hits.pop(request_id, None)
        with self._lock:
            self._waiting.pop(request_id, None)
        for rank in range(remote.remote_ranks):
            message = wire.DoneReading(
                wire.WIRE_VERSION, remote.remote_request_id, 0, rank, [], reads_total=0, ok=False
            )
            self._outbox.put((f"{remote.remote_host}:{remote.remote_port + rank}", message))

    def _messenger(self) -> None:
        period = max(self.settings.lease_seconds / 3, 0.5)
        next_renew = time.monotonic() + period
        while not self._stop.is_set():
            try:
                address, message = self._outbox.get(timeout=max(0.0, min(0.2, next_renew - time.monotonic())))
                self._send(address, message)
            except queue.Empty:
                pass
            if time.monotonic() >= next_renew:
                next_renew = time.monotonic() + period
                self._renew()

    def _renew(self) -> None:
        with self._lock:
            by_peer: dict[tuple[str, int, int], list[str]] = {}
            for remote in self._waiting.values():
                key = (remote.remote_host, remote.remote_port, remote.remote_ranks)
                by_peer.setdefault(key, []).append(remote.remote_request_id)
        for (host, port, ranks), ids in by_peer.items():
            for rank in range(ranks):
                for start in range(0, len(ids), wire.MAX_RENEW):
                    self._send(
                        f"{host}:{port + rank}",
                        wire.Renew(
                            wire.WIRE_VERSION, self.settings.engine_id, ids[start : start + wire.MAX_RENEW]
                        ),
                    )

    def _send(self, address: str, message) -> None:
        try:
            reply = self._client.request(address, message)
            if isinstance(reply, wire.Reply) and not reply.ok:
                logger.warning("KV control %s refused %s: %s", address, type(message).__name__, reply.error)
        except Exception as e:  # a dead prefill instance: its lease frees the blocks anyway
            logger.warning("KV control: %s to %s failed: %s", type(message).__name__, address, e)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
