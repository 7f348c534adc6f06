"""Scheduler side of ``AscendP2PConnector`` (runs in the engine core).

Prefill (kv_producer): a request that arrived with ``kv_transfer_params.do_remote_decode``
keeps its blocks when it finishes; the response's ``kv_transfer_params`` tell the decode
instance where they are. The workers free them when every read is reported done, or when
the lease runs out.

Decode (kv_consumer): a request with ``do_remote_prefill`` waits for its KV: the workers
pull it (``worker_side.py``) after the scheduler has allocated the blocks. While it waits,
a background thread renews its lease on the prefill ranks. A request that never gets
its blocks (aborted, or fully cached here) releases the prefill blocks at once.

Layer-wise (``kv_transfer_params.layerwise_id``, sent by the proxy's ``--layerwise`` to both
instances at once): the prefill side publishes the request's blocks in the step that
computes its last prompt tokens (``layerwise.py``) and the decode side, which allocated
its blocks meanwhile, reads each layer once it is written. A published request is held
however it ends, since a decode rank may be reading it; one that ends unpublished is
marked failed, so the decode side computes the prompt itself.

Block tables travel per KV-cache group (``groups.py``); with a sliding-window group the
prefill side computes the prompt but its last token, which the decode side computes.

Trust (``trust.py``): the prefill side signs the parameters it returns, binding the
prompt by its digest; the decode side takes parameters only when their signature, digest,
expiry and bounds hold, and otherwise computes the prompt itself (a counted, logged
refusal) without sending anything anywhere. The children of a parallel-sampling request
(``n`` > 1) share one remote request: the first to ask pulls it, the others wait for that
pull and compute what the prefix cache does not give them, and each reports itself a
reader done, so a prefill hold made for ``readers`` of them is freed by the last.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from vllm.logger import init_logger

from vllm.ascend.context_parallel.placement import CPLayout
from vllm.ascend.kv_transfer import wire
from vllm.ascend.kv_transfer.control import ControlClient, hello
from vllm.ascend.kv_transfer.groups import TransferGroups
from vllm.ascend.kv_transfer.layerwise import Publish, release
from vllm.ascend.kv_transfer.metadata import P2PConnectorMetadata, RecvSpec, RemotePrefill, parse_remote
from vllm.ascend.kv_transfer.settings import P2PSettings
from vllm.ascend.kv_transfer.trust import LAYERWISE_FIELDS, PULL_FIELDS, prompt_digest

if TYPE_CHECKING:  # upstream's types, for the annotations only
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)


@dataclass
class _Outgoing:
    """Prefill: a layer-wise request until it is published."""

    transfer_id: str
    num_tokens: int
    backoff: int
    tables: list | None = None  # per KV-cache group, as scheduled so far
    published: bool = False


def _readers(params: dict) -> int:
    """How many decode requests a prefill request is held for (the proxy sends a parallel-
    sampling request's ``n``)."""
    readers = params.get("readers", 1)
    return readers if isinstance(readers, int) and 1 <= readers <= wire.MAX_READERS else 1


class P2PScheduler:
    def __init__(
        self,
        settings: P2PSettings,
        groups: TransferGroups,
        hash_block_size: int | None = None,
        num_hash_lookahead_tokens: int = 0,
    ):
        self.settings = settings
        self.groups = groups
        # prefix-cache hashing (the engine core's): a shortened prompt drops the hashes of
        # the blocks it no longer fills
        self._hash_block_size = hash_block_size
        self._num_hash_lookahead_tokens = num_hash_lookahead_tokens
        self._sends: dict[str, float] = {}
        self._send_readers: dict[str, int] = {}
        self._recvs: list[RecvSpec] = []
        self._local_hits: dict[str, int] = {}
        self._waiting: dict[str, RemotePrefill] = {}  # decode: pulls not finished (renewed)
        # decode: each request's trusted parameters; who pulls each remote request (its
        # leader) and who waits for that pull; remote requests already pulled here
        self._remotes: dict[str, RemotePrefill] = {}
        self._leading: dict[str, RemotePrefill] = {}  # leaders until their blocks are allocated
        self._pulls: dict[tuple, str] = {}
        self._followers: dict[str, tuple] = {}
        self._pulled: dict[tuple, float] = {}
        self._over: set[str] = set()  # requests that pulled, were refused or read through a leader
        self._refusals: dict[str, int] = {}
        self._outgoing: dict[str, _Outgoing] = {}  # prefill: layer-wise requests
        self._send_keys: dict[str, str] = {}
        self._publishes: list[Publish] = []
        self._failed: list[str] = []
        self._layouts: dict[tuple[str, int], CPLayout] = {}  # decode: prefill kv_port -> layout
        self._lock = threading.Lock()
        self._outbox: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._thread = None
        if settings.consumer:
            self._client = ControlClient(settings.control_timeout, settings.trust)
            self._thread = threading.Thread(target=self._messenger, name="kv-p2p-renew", daemon=True)
            self._thread.start()

    # -- prefill ------------------------------------------------------------------------
    def on_new_request(self, request: Request) -> None:
        """Prefill: leave the prompt's last ``backoff`` tokens to the decode side (groups.py).
        Once per request (a preempted request comes back already shortened)."""
        params = request.kv_transfer_params
        if not (self.settings.producer and params and params.get("do_remote_decode")):
            return
        backoff = self.groups.backoff
        if (
            backoff
            and not params.get("_ascend_backoff")
            and request.prompt_token_ids is not None
            and request.num_prompt_tokens > backoff
        ):
            request.drop_prompt_tail(backoff)  # the request hook patch
            request.max_tokens = 1
            if self._hash_block_size:
                request.truncate_block_hashes(self._hash_block_size, self._num_hash_lookahead_tokens)
            params["_ascend_backoff"] = backoff
        transfer_id = params.get("layerwise_id")
        if isinstance(transfer_id, str) and 0 < len(transfer_id) <= 256:
            self._outgoing.setdefault(
                request.request_id,
                _Outgoing(transfer_id, request.num_prompt_tokens, int(params.get("_ascend_backoff", 0))),
            )
        elif transfer_id is not None:
            logger.warning(
                "request %s: layerwise_id must be a string of 1 to 256 characters; the decode "
                "side will not find it and computes the prompt itself",
                request.request_id,
            )

    def request_finished(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict | None]:
        params = request.kv_transfer_params or {}
        if self.settings.consumer:
            self._finished_here(request.request_id)
        if not (self.settings.producer and params.get("do_remote_decode")):
            return False, None
        from vllm.v1.request import RequestStatus

        finished = request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
        outgoing = self._outgoing.pop(request.request_id, None)
        if outgoing is not None:
            if not (finished and block_ids and outgoing.published):
                self._failed.append(outgoing.transfer_id)
            if not outgoing.published:
                return False, None
            # a decode rank may be reading it: held until every read is done, however it ended
            self._send_keys[request.request_id] = outgoing.transfer_id
            self._hold(request.request_id, params)
            return True, None
        if not finished or not block_ids:
            return False, None
        self._hold(request.request_id, params)
        layout = self.settings.layout
        out = {
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
            "remote_readers": _readers(params),
            # the prompt these blocks hold: a decode request of another prompt is refused
            "remote_prompt_digest": prompt_digest(request.prompt_token_ids),
        }
        # valid while the lease can still hold the blocks, with room for two hosts' clocks
        return True, self.settings.trust.sign_params(out, PULL_FIELDS, self.settings.lease_seconds + 60)

    def _hold(self, request_id: str, params: dict) -> None:
        self._sends[request_id] = self.settings.lease_seconds
        self._send_readers[request_id] = _readers(params)

    # -- decode -------------------------------------------------------------------------
    def remote_of(self, request: Request) -> RemotePrefill | None:
        """The request's pull parameters once they are trusted (checked once), or None: not
        a pull, refused, or pulled already."""
        request_id = request.request_id
        if request_id in self._over:
            return None
        remote = self._remotes.get(request_id)
        if remote is not None:
            return remote
        params = request.kv_transfer_params
        if not (self.settings.consumer and params and params.get("do_remote_prefill")):
            return None
        refused, remote = self._check(request, params)
        if refused is not None:
            label, detail = refused
            self._refusals[label] = self._refusals.get(label, 0) + 1
            self._over.add(request_id)
            logger.warning("request %s: %s; computing its prompt here", request_id, detail)
            if remote is not None:  # authentic, but of no use here: nothing will read it
                self._release(request_id, remote)
            return None
        self._remotes[request_id] = remote
        return remote

    def _check(self, request, params: dict):
        """((label, detail) or None, the parameters when they are authentic)."""
        layerwise = params.get("layerwise_id") is not None
        untrusted = self.settings.trust.check_params(params, LAYERWISE_FIELDS if layerwise else PULL_FIELDS)
        if untrusted is not None:
            return ("untrusted", f"{untrusted} (the deployment's secret does not vouch for them)"), None
        remote = parse_remote(params)
        if remote is None:
            return ("malformed", "malformed or out-of-bounds kv_transfer_params"), None
        prompt = request.prompt_token_ids or []
        if layerwise and not remote.remote_request_id:
            # the prefill side leaves the same backoff (same config); the published token
            # count is checked against this before anything is read
            backoff = self.groups.backoff if self.groups.backoff and len(prompt) > self.groups.backoff else 0
            remote = msgspec.structs.replace(
                remote,
                remote_num_tokens=len(prompt) - backoff,
                remote_backoff=backoff,
                remote_request_id=remote.layerwise_id,
                remote_engine_id=f"{remote.remote_host}:{remote.remote_port}",
                remote_block_ids=[[] for _ in self.groups.ids],
            )
        elif remote.remote_num_tokens + remote.remote_backoff != len(prompt) or (
            (remote.remote_prompt_digest or self.settings.trust.secure)
            and prompt_digest(prompt[: remote.remote_num_tokens]) != remote.remote_prompt_digest
        ):
            return (
                "another prompt",
                f"kv_transfer_params for another prompt ({remote.remote_num_tokens} + "
                f"{remote.remote_backoff} tokens computed there, {len(prompt)} here, or other tokens)",
            ), None
        if remote.remote_num_tokens > self.settings.max_model_len:
            return ("malformed", f"{remote.remote_num_tokens} tokens are over max_model_len"), None
        if len(remote.remote_block_ids) != len(self.groups.ids):
            detail = (
                f"the prefill instance sent block tables for {len(remote.remote_block_ids)} KV-cache "
                f"groups, this one has {len(self.groups.ids)} (run both with the same hybrid "
                "KV-cache manager setting)"
            )
            return ("mismatch", detail), remote
        return None, remote

    @staticmethod
    def _key(remote: RemotePrefill) -> tuple:
        return remote.remote_engine_id, remote.remote_request_id

    def may_load_async(self, request: Request) -> bool:
        """Whether the request may still pull (upstream's ``--max-num-inflight-kv-loads``
        starts such requests while the batch is full): not one refused or pulled already, nor
        one that reads no external KV. Cheap: the trust check is made when it is scheduled."""
        params = request.kv_transfer_params
        return bool(
            self.settings.consumer
            and params
            and params.get("do_remote_prefill")
            and request.request_id not in self._over
            and not getattr(request, "skip_reading_external_kv", False)
        )

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        remote = self.remote_of(request)
        if remote is None:
            return 0, False
        request_id, key = request.request_id, self._key(remote)
        leader = self._pulls.get(key)
        if leader is None and key in self._pulled:
            # another request here pulled it (a parallel-sampling sibling): the prefix cache
            # has what it wrote; this one computes the rest and is a reader done
            self._followers.pop(request_id, None)
            self._over.add(request_id)
            if remote.remote_readers > 1:
                self._release(request_id, remote)
            return 0, False
        if leader is not None and leader != request_id:
            self._followers[request_id] = key
            return None, False  # ask again once the leader's pull is over
        self._pulls[key] = request_id
        self._leading.setdefault(request_id, remote)
        with self._lock:
            self._waiting.setdefault(request_id, remote)
        self._local_hits[request_id] = num_computed_tokens
        missing = remote.remote_num_tokens - num_computed_tokens
        return (missing, True) if missing > 0 else (0, False)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        remote = self._leading.pop(request.request_id, None)
        if remote is None:
            return
        self._over.add(request.request_id)  # pull once
        first = self._local_hits.pop(request.request_id, 0)
        if num_external_tokens == 0:
            self._release(request.request_id, remote)
            self._pull_over(remote)
            return
        tables = blocks.get_block_ids()
        self._recvs.append(
            RecvSpec(request.request_id, remote, first, [list(tables[g]) for g in self.groups.ids])
        )

    def _pull_over(self, remote: RemotePrefill) -> None:
        """The leader's pull of ``remote`` ended (or will not happen): its followers go on."""
        key = self._key(remote)
        self._pulls.pop(key, None)
        now = time.monotonic()
        self._pulled[key] = now + self.settings.lease_seconds
        for old, until in list(self._pulled.items()):
            if until < now:
                del self._pulled[old]

    def _finished_here(self, request_id: str) -> None:
        """Decode: a request ended; whatever it was waiting for or leading is let go."""
        remote = self._leading.pop(request_id, None)
        if remote is not None:  # finished before its blocks were allocated: nothing will be read
            self._release(request_id, remote)
            self._pull_over(remote)
        elif request_id in self._followers and self._remotes[request_id].remote_readers > 1:
            self._release(request_id, self._remotes[request_id])
        self._followers.pop(request_id, None)
        self._remotes.pop(request_id, None)
        self._over.discard(request_id)
        self._local_hits.pop(request_id, None)

    def build_connector_meta(
        self, scheduler_output: SchedulerOutput | None = None, idle: bool = False
    ) -> P2PConnectorMetadata:
        if self._outgoing and scheduler_output is not None:
            self._track_outgoing(scheduler_output)
        meta = P2PConnectorMetadata(
            self._sends,
            self._recvs,
            send_keys=self._send_keys,
            publishes=self._publishes,
            failed=self._failed,
            idle=idle,
            send_readers=self._send_readers,
            refusals=self._refusals,
        )
        self._sends, self._recvs, self._send_keys, self._publishes, self._failed = {}, [], {}, [], []
        self._send_readers, self._refusals = {}, {}
        return meta

    def _track_outgoing(self, out) -> None:
        """Prefill: follow the layer-wise requests' block tables; publish each in the step
        that computes its last prompt tokens."""
        computed = {}
        for new in out.scheduled_new_reqs:
            outgoing = self._outgoing.get(new.req_id)
            if outgoing is not None:
                outgoing.tables = [list(b) for b in new.block_ids]
                computed[new.req_id] = new.num_computed_tokens
        cached = out.scheduled_cached_reqs  # (a resumed request comes as a new one)
        for i, req_id in enumerate(cached.req_ids):
            outgoing = self._outgoing.get(req_id)
            if outgoing is None:
                continue
            new_ids = cached.new_block_ids[i]
            if outgoing.tables is None:
                outgoing.tables = [list(b) for b in new_ids] if new_ids is not None else outgoing.tables
            elif new_ids is not None:
                for table, more in zip(outgoing.tables, new_ids):
                    table.extend(more)
            computed[req_id] = cached.num_computed_tokens[i]
        for req_id, before in computed.items():
            outgoing = self._outgoing[req_id]
            scheduled = out.num_scheduled_tokens.get(req_id, 0)
            if outgoing.published or not scheduled or before + scheduled < outgoing.num_tokens:
                continue
            if outgoing.tables is None:  # never seen with its blocks: cannot be published
                logger.warning("layer-wise request %s reached its prompt's end without block tables", req_id)
                continue
            outgoing.published = True
            self._publishes.append(
                Publish(
                    outgoing.transfer_id,
                    [list(outgoing.tables[g]) for g in self.groups.ids],
                    outgoing.num_tokens,
                    outgoing.backoff,
                )
            )

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        done = output.finished_recving or ()
        if done:
            with self._lock:
                pulled = [self._waiting.pop(request_id, None) for request_id in done]
            for remote in pulled:
                if remote is not None:
                    self._pull_over(remote)

    # -- messages to prefill ranks ------------------------------------------------------
    def _release(self, request_id: str, remote: RemotePrefill) -> None:
        """Tell every prefill rank holding the request that this reader is done without
        reading (the blocks are freed once every reader it is held for is)."""
        self._local_hits.pop(request_id, None)
        with self._lock:
            self._waiting.pop(request_id, None)
        if remote.layerwise_id is not None:
            self._outbox.put((None, (request_id, remote)))  # the messenger finds the prefill ranks first
            return
        for rank in range(remote.remote_ranks):
            message = wire.DoneReading(
                wire.WIRE_VERSION, remote.remote_request_id, request_id, 0, rank, [], reads_total=0, ok=False
            )
            self._outbox.put((f"{remote.remote_host}:{remote.remote_port + rank}", message))

    def _messenger(self) -> None:
        period = max(self.settings.lease_seconds / 3, 0.5)
        next_renew = time.monotonic() + period
        while not self._stop.is_set():
            try:
                address, message = self._outbox.get(timeout=max(0.0, min(0.2, next_renew - time.monotonic())))
                if address is None:
                    self._release_layerwise(*message)
                else:
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

    def _release_layerwise(self, reader: str, remote: RemotePrefill) -> None:
        """Every rank of every replica of the prefill instance is told: which replica has
        the request is not known here. Kept as an early message where it is not held yet."""
        if remote.layerwise_id is None:
            return  # not a layer-wise request: its done messages free it
        try:
            layout = self.prefill_layout(self._client, remote.remote_host, remote.remote_port)
        except Exception as e:
            logger.warning("KV control: releasing layer-wise request %s failed: %s", remote.layerwise_id, e)
            return
        release(self._client, remote.remote_host, remote.remote_port, layout, remote.layerwise_id, reader)

    def prefill_layout(self, client: ControlClient, host: str, port: int) -> CPLayout:
        """The layout of the prefill instance whose first control port is ``port``."""
        layout = self._layouts.get((host, port))
        if layout is None:
            info = hello(client, host, port, self.settings.engine_id)
            layout = self._layouts[(host, port)] = info.layout.to_layout()
        return layout

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
