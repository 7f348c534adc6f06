"""Worker side of ``AscendP2PConnector`` (runs in every worker process).

Every rank registers its KV cache with the transport. A prefill rank also serves the
control plane: it answers ``Hello`` with its layout, transport address and KV regions,
counts ``DoneReading`` messages against the plan's read total, extends leases on
``Renew``, and reports a request as finished sending (its blocks may be freed) when all
its reads are done or its lease has run out.

A decode rank pulls each request it is given on a background thread: learn the prefill
ranks (cached per prefill replica), build the plan (``plan.py``) and execute its own
reads, then send each prefill rank it read from the done message, also after a failure;
the first decode rank also tells the unread prefill ranks. Just before reading it renews
the request on the ranks it reads from; if their answers show the read ended inside
their leases (``lease_check.py``), the pull is reported at once and the done messages
follow, else it waits for their answers (a lease that ran out means what was read is
discarded). Each layer is read by its own KV-cache group's block table (``groups.py``);
both sides name every layer's group in the handshake, and a mismatch fails the pull.

Layer-wise (``layerwise.py``): a prefill rank records when each layer of a published
request is written and answers ``Progress``; asking renews the request's lease. A decode
rank finds the replica that has the request, builds the plan from the published block
tables and reads each prefill rank's layers as they are written, then sends the same
done messages.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import msgspec

from vllm.logger import init_logger

from vllm.ascend import device as ascend_device
from vllm.ascend.attention.kv_layout import LayerLayout
from vllm.ascend.context_parallel.placement import LayoutError
from vllm.ascend.kv_transfer import wire
from vllm.ascend.kv_transfer.addressing import RankTables, layer_regions, plane_regions
from vllm.ascend.kv_transfer.control import ControlClient, ControlServer, ControlTimeout
from vllm.ascend.kv_transfer.groups import TransferGroups
from vllm.ascend.kv_transfer.holds import Done, Holds
from vllm.ascend.kv_transfer.layerwise import Publications, release_messages
from vllm.ascend.kv_transfer.lease_check import LeaseCheck
from vllm.ascend.kv_transfer.metadata import P2PConnectorMetadata, RecvSpec
from vllm.ascend.kv_transfer.planner import ReplicaPlanner
from vllm.ascend.kv_transfer.settings import P2PSettings
from vllm.ascend.kv_transfer.stats import P2PConnectorStats
from vllm.ascend.kv_transfer.transport import open_transport
from vllm.ascend.kv_transfer.trust import TrustError

logger = init_logger(__name__)

# seconds from the renewals for their answers (then the done messages' answers decide)
LEASE_ANSWER_WAIT = 1.0


class IdlePacer:
    """Paces the empty steps of an instance whose connector has work pending.

    Upstream's engine loop does not rest while a connector holds blocks for a delayed free
    or a request waits for its pull: it runs empty steps back to back, each a round trip
    through the engine core and every worker (measured here: a TP1 prefill instance
    holding one request took 0.37 cores doing nothing, a TP2 one 2.1). An empty step
    therefore waits up to ``wait`` seconds for news (a done message, a finished pull)
    before reporting; a step with work never waits, and a new request waits at most
    ``wait`` for the next step."""

    def __init__(self, wait: float = 0.02):
        self.wait = wait
        self._news = threading.Event()

    def news(self) -> None:
        self._news.set()

    def pace(self, idle: bool) -> None:
        if idle:
            self._news.wait(self.wait)
        self._news.clear()


@dataclass
class _Attempt:
    """One pull as far as it got (the done messages depend on it)."""

    spec: RecvSpec
    plan: object = None
    layout: object = None  # layer-wise: the prefill instance's, once asked
    unreachable: bool = False  # layer-wise: no prefill replica answered (nothing to release)
    lease: LeaseCheck | None = None  # whole pulls: the renewals sent before the read
    read_end: float = 0.0


class _Waiter:
    """Paces a layer-wise poll: short sleeps while news comes, longer ones up to 20 ms
    without; gives up after ``patience`` seconds with no news."""

    def __init__(self, patience: float, what: str):
        self.patience, self.what = patience, what
        self._sleep = 0.0005
        self._last_news = time.monotonic()

    def wait(self, news: bool) -> None:
        now = time.monotonic()
        if news:
            self._sleep, self._last_news = 0.0005, now
            return
        if now - self._last_news > self.patience:
            raise TimeoutError(f"waited {self.patience:.0f} s for {self.what} (layerwise_wait_seconds)")
        time.sleep(self._sleep)
        self._sleep = min(self._sleep * 2, 0.02)


@dataclass(frozen=True)
class _Peer:
    """One prefill DP replica as a decode rank sees it."""

    layout: object
    host: str
    port: int
    num_blocks: dict  # KV-cache group -> blocks of its cache (what block ids may name)
    addresses: dict  # rank in replica -> its transport address (filled as they connect)
    planner: ReplicaPlanner  # its plans, plane tables and address templates for this rank

    def check(self, remote) -> None:
        """The parameters name what this replica has: its ranks, a DP rank of the instance,
        block ids inside its caches (bounds at the boundary, signed or not)."""
        layout = self.layout
        if remote.remote_ranks != layout.ranks_per_replica or remote.remote_dp_rank >= layout.dp:
            raise RuntimeError(
                f"the parameters name {remote.remote_ranks} ranks of DP rank {remote.remote_dp_rank}; the "
                f"prefill instance has {layout.ranks_per_replica} per replica and {layout.dp} replicas"
            )
        for group, ids in enumerate(remote.remote_block_ids):
            if ids and max(ids) >= self.num_blocks.get(group, 0):
                raise RuntimeError(
                    f"block id {max(ids)} of KV-cache group {group} is outside the prefill cache's "
                    f"{self.num_blocks.get(group, 0)} blocks"
                )


class P2PWorker:
    def __init__(self, settings: P2PSettings, vllm_config, groups: TransferGroups):
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
        self._transport = None
        self._server = None
        self._info: wire.RankInfo | None = None  # what Hello answers (fixed once the caches are registered)
        self._layers: dict[str, tuple[int, LayerLayout]] = {}
        self._client = ControlClient(settings.control_timeout, settings.trust)
        # the renewals before a read, on sockets of their own: their answers are read after
        # the read, and a Hello on the same thread must not take one for its own
        self._lease_client = ControlClient(settings.control_timeout, settings.trust)
        self._lock = threading.Lock()
        self._holds = Holds(settings.lease_seconds)  # prefill
        # decode
        # a few pulls at once, so one unreachable prefill instance does not hold up the others
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kv-p2p-pull")
        # a layer-wise pull waits for the prefill forward: more of them at once
        self._layerwise_pool = ThreadPoolExecutor(max_workers=32, thread_name_prefix="kv-p2p-layerwise")
        self._publications: Publications | None = None  # prefill
        self._layer_index: dict[str, int] = {}
        self._told_layerwise = False
        self._request_of_key: dict[str, str] = {}  # prefill: hold key (layerwise_id) -> request id
        self._bases: dict[tuple[str, int], wire.RankInfo] = {}  # decode: a prefill instance's first rank
        self._peer_lock = threading.Lock()
        self._peers: dict[tuple, _Peer] = {}
        self._finished_recving: set[str] = set()
        self._failed_blocks: set[int] = set()
        self._failed_requests: set[str] = set()  # several groups: block ids are per group
        self._pacer = IdlePacer()
        self._idle = False
        self._stats = P2PConnectorStats()  # this interval's; pull threads record into it (under _lock)
        self._reported_holds: int | None = None

    # -- set-up -------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches) -> None:
        for name, tensor in kv_caches.items():
            if name not in self.groups.layer_group:
                continue  # a layer of a group that takes no part in transfers
            self._layers[name] = (
                tensor.data_ptr(),
                LayerLayout.of_cache(tensor, self._head_size, self._kv_lora_rank),
            )
        options = dict(self.settings.options, role="prefill" if self.settings.producer else "decode")
        port = self.settings.control_port(self.settings.dp_rank, self.rank)
        options.setdefault("llmdatadist_port", port + int(options.get("llmdatadist_port_offset", 1000)))
        device = next(iter(kv_caches.values())).device  # LLM-DataDist: the NPU holding this rank's cache
        options.setdefault("device_id", device.index if device.index is not None else 0)
        self._transport = open_transport(self.settings.transport, self.settings.host, options)
        regions = layer_regions(self._layers, self.groups.layer_group)
        self._layer_index = {region.name: i for i, region in enumerate(regions)}
        self._publications = Publications(len(regions), expiry=self.settings.lease_seconds)
        self._transport.register(plane_regions(regions))
        self._info = wire.RankInfo(
            wire.WIRE_VERSION,
            self.settings.engine_id,
            self.settings.dp_rank,
            self.rank,
            wire.Layout.of(self.layout),
            self._transport.name,
            self._transport.address,
            regions,
        )
        if self.settings.producer:
            self._server = ControlServer(
                self.settings.host,
                port,
                self._handle,
                name=f"prefill rank {self.rank}",
                # progress answers query the layers' device events on this thread
                on_start=ascend_device.current().bind_thread,
                trust=self.settings.trust,
                on_refused=self._refused_message,
            )
        logger.info(
            "AscendP2PConnector rank %d: %d KV layers registered with %s at %s",
            self.global_rank,
            len(self._layers),
            self.settings.transport,
            self._transport.address,
        )

    # -- prefill: the control plane -----------------------------------------------------
    def _handle(self, message):
        if isinstance(message, wire.Hello):
            return self._info
        if isinstance(message, wire.DoneReading):
            if not message.ok and message.reads_total:
                logger.warning(
                    "request %s: decode rank %d reports %d failed reads",
                    message.request_id,
                    message.decode_rank,
                    len(message.read_ids),
                )
            status = self._holds.done(
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
            return wire.Reply(wire.WIRE_VERSION, True, lease_seconds=self._holds.renew(message.request_ids))
        if isinstance(message, wire.Progress):
            self._holds.renew(message.transfer_ids)  # a decode rank is still reading them
            return wire.ProgressReply(wire.WIRE_VERSION, self._publications.progress(message.transfer_ids))
        return wire.Reply(wire.WIRE_VERSION, False, f"a prefill rank does not take {type(message).__name__}")

    # -- per step -----------------------------------------------------------------------
    def bind_step(self, meta: P2PConnectorMetadata) -> None:
        """Before the step's forward: its layer-wise publications (``start_step`` may come
        after the forward: upstream starts asynchronous loads there)."""
        if (meta.publishes or meta.failed) and self._publications is not None:
            self._publications.begin_step(meta.publishes, meta.failed)

    def start_step(self, meta: P2PConnectorMetadata | None) -> None:
        self._idle = meta is not None and meta.idle and not meta.sends and not meta.recvs
        if meta is None:
            return
        if meta.refusals and self.rank == 0:  # the replica's scheduler refused parameters: counted once
            with self._lock:
                self._stats.record_refusals(meta.refusals)
        for request_id, lease in meta.sends.items():
            key = meta.send_keys.get(request_id, request_id)
            if key != request_id:
                with self._lock:
                    self._request_of_key[key] = request_id
            self._holds.hold(key, lease, meta.send_readers.get(request_id, 1))
        for spec in meta.recvs:
            pool = self._pool if spec.remote.layerwise_id is None else self._layerwise_pool
            pool.submit(self._pull, spec)

    def layer_saved(self, layer_name: str) -> None:
        """Prefill: ``layer_name``'s forward has queued its KV writes."""
        index = self._layer_index.get(layer_name)
        if index is not None and self._publications is not None and self._publications.saving:
            self._publications.layer_saved(index, self._record_event())

    def step_saved(self) -> None:
        if self._publications is not None and self._publications.saving:
            by_hook = self._publications.end_step(self._record_event())
            if not self._told_layerwise:
                self._told_layerwise = True
                logger.info(
                    "AscendP2PConnector rank %d: layer-wise transfer publishes %d of %d layers as the "
                    "forward writes them, the rest at the forward's end",
                    self.global_rank,
                    by_hook,
                    self._publications.num_layers,
                )

    def _refused_message(self, kind: str) -> None:
        with self._lock:
            self._stats.record_refusals({f"control {kind}": 1})

    @staticmethod
    def _record_event():
        event = ascend_device.current().event()
        event.record()
        return event

    def get_finished(self):
        self._pacer.pace(self._idle)
        sending = self._holds.take_finished()
        with self._lock:
            recving, self._finished_recving = self._finished_recving, set()
            if sending and self._request_of_key:
                for key in [k for k in sending if k in self._request_of_key]:
                    sending.discard(key)
                    sending.add(self._request_of_key.pop(key))
                    self._publications.retire(key)
        return sending or None, recving or None

    def take_stats(self) -> P2PConnectorStats | None:
        """This interval's statistics (None when there is nothing new)."""
        expired = self._holds.take_expired_count()
        holds = len(self._holds) if self.settings.producer else None
        with self._lock:
            stats, self._stats = self._stats, P2PConnectorStats()
        stats.record_expired_leases(expired)
        if holds is not None and holds != self._reported_holds:
            stats.record_holds(self.global_rank, holds)
            self._reported_holds = holds
        return None if stats.is_empty() else stats

    def take_failed_blocks(self) -> set[int]:
        with self._lock:
            failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def take_failed_requests(self) -> set[str]:
        with self._lock:
            failed, self._failed_requests = self._failed_requests, set()
        return failed

    # -- decode: pulling ----------------------------------------------------------------
    def _peer(self, remote) -> _Peer:
        key = (remote.remote_engine_id, remote.remote_dp_rank, remote.remote_host, remote.remote_port)
        peer = self._peers.get(key)
        if peer is None:
            host, port = remote.remote_host, remote.remote_port
            info = self._hello(host, port)
            blocks: dict[int, int] = {}
            for region in info.layers:
                blocks[region.group] = min(blocks.get(region.group, region.num_blocks), region.num_blocks)
            addresses: dict[int, str] = {}
            known = {info.rank: info}

            def connect(rank_in_replica: int) -> RankTables:
                rank_info = known.pop(rank_in_replica, None) or self._hello(host, port + rank_in_replica)
                tables = self._connect(rank_info)
                addresses[rank_in_replica] = rank_info.address
                return tables

            layout = info.layout.to_layout()
            planner = ReplicaPlanner(layout, self.layout, self.global_rank, self.tp_rank, connect)
            planner.tables(info.rank)  # the rank that answered is connected at once
            peer = _Peer(layout, host, port, blocks, addresses, planner)
            with self._peer_lock:
                peer = self._peers.setdefault(key, peer)
        return peer

    def _connect(self, info: wire.RankInfo) -> RankTables:
        """Once per prefill rank: transport connection and the plane tables of both sides."""
        with self._peer_lock:
            self._transport.connect(info.address, plane_regions(info.layers))
        mine = {
            g: {name: v for name, v in self._layers.items() if self.groups.layer_group[name] == g}
            for g in range(len(self.groups.ids))
        }
        return RankTables.build(mine, info.layers)

    def _hello(self, host: str, port: int) -> wire.RankInfo:
        reply = self._client.request(f"{host}:{port}", wire.Hello(wire.WIRE_VERSION, self.settings.engine_id))
        if not isinstance(reply, wire.RankInfo):
            raise RuntimeError(f"the prefill rank at {host}:{port} answered Hello with {reply}")
        if reply.transport != self._transport.name:
            raise RuntimeError(
                f"the prefill instance uses the {reply.transport} transport, this one "
                f"{self._transport.name}: set the same kv_connector_extra_config.transport"
            )
        return reply

    def _pull(self, spec: RecvSpec) -> None:
        attempt, failed, pulled = _Attempt(spec), False, 0
        started = time.perf_counter()
        try:
            if spec.remote.layerwise_id is not None:
                pulled = self._pull_layerwise(attempt)
            else:
                pulled = self._pull_whole(attempt)
        except Exception as e:
            failed = True
            logger.warning(
                "request %s: pulling its KV from %s:%d failed: %s",
                spec.request_id,
                spec.remote.remote_host,
                attempt.spec.remote.remote_port,
                e,
                # what a peer, the network or a layout can cause is one line; anything else is a
                # bug here, and its traceback says where
                exc_info=not isinstance(
                    e, (RuntimeError, OSError, LayoutError, TrustError, msgspec.MsgspecError)
                ),
            )
        finally:
            spec, remote = attempt.spec, attempt.spec.remote
            covered = False
            if attempt.lease is not None and failed:
                attempt.lease.abandon()
            elif attempt.lease is not None:
                covered = attempt.lease.covers(
                    attempt.read_end, min(LEASE_ANSWER_WAIT, self.settings.control_timeout)
                )
            if remote.layerwise_id is not None and not remote.remote_ranks:
                if attempt.layout is not None and not attempt.unreachable:  # its replica was never found
                    self._layerwise_pool.submit(
                        self._release_layerwise, spec.request_id, remote, attempt.layout
                    )
            # a read inside the leases cannot be stale: its pull is reported first, the done messages after
            elif not covered and self._send_done(spec, attempt.plan, failed) and not failed:
                failed = True
                logger.warning(
                    "request %s: the prefill instance at %s:%d did not vouch that it held the blocks "
                    "while they were read (lease expired, released, or unknown); discarding what was read",
                    spec.request_id,
                    remote.remote_host,
                    remote.remote_port,
                )
            with self._lock:
                if failed and len(spec.local_block_ids) > 1:
                    self._failed_requests.add(spec.request_id)  # block ids are per group
                    self._stats.record_failed_pull()
                elif failed:
                    first_block = spec.first_token // self.layout.virtual_block_size
                    self._failed_blocks.update(spec.local_block_ids[0][first_block:])
                    self._stats.record_failed_pull()
                else:
                    self._stats.record_pull(time.perf_counter() - started, pulled)
                self._finished_recving.add(spec.request_id)
            self._pacer.news()
            if covered:
                self._send_done_after(spec, attempt.plan, attempt.lease.granted)

    def _plan(self, peer: _Peer, spec: RecvSpec):
        remote = spec.remote
        return peer.planner.plan(
            remote.remote_num_tokens,
            remote.remote_block_ids,
            spec.local_block_ids,
            remote.remote_dp_rank,
            self.settings.dp_rank,
            replica_offset=zlib.crc32(spec.request_id.encode()) % 64,
        )

    def _pull_whole(self, attempt: _Attempt) -> int:
        spec = attempt.spec
        remote = spec.remote
        peer = self._peer(remote)
        peer.check(remote)
        attempt.plan = self._plan(peer, spec)

        def renew(ranks: list[int]) -> None:  # the last thing before the read
            attempt.lease = LeaseCheck(
                self._lease_client,
                [f"{remote.remote_host}:{remote.remote_port + p}" for p in ranks],
                self.settings.engine_id,
                remote.remote_request_id,
            )

        pulled = self._execute(attempt.plan, peer, spec, before_read=renew)
        attempt.read_end = time.monotonic()
        return pulled

    def _pull_layerwise(self, attempt: _Attempt) -> int:
        """Find the replica that has the request, then read each prefill rank's layers as
        they are written."""
        spec = attempt.spec
        remote, transfer_id = spec.remote, spec.remote.layerwise_id
        base = self._base_info(remote.remote_host, remote.remote_port)
        attempt.layout = layout = base.layout.to_layout()
        ranks = layout.ranks_per_replica
        ports = [remote.remote_port + d * ranks for d in range(layout.dp)]
        # a transfer the prefill instance has not heard of within a lease is given up on
        waiter = _Waiter(
            min(self.settings.layerwise_wait, self.settings.lease_seconds),
            f"request {spec.request_id} to be published",
        )
        while True:
            try:
                replies = self._progress(remote.remote_host, ports, transfer_id, tolerate=True)
            except ControlTimeout:
                attempt.unreachable = True
                raise
            found = [(d, t) for d, t in enumerate(replies) if t is not None and t.state != wire.UNKNOWN]
            if found:
                break
            waiter.wait(news=False)
        replica, entry = found[0]
        if entry.state == wire.FAILED:
            raise RuntimeError("the prefill instance did not compute the request (aborted or refused)")
        if (entry.num_tokens, entry.backoff) != (remote.remote_num_tokens, remote.remote_backoff):
            raise RuntimeError(
                f"the prefill instance computed {entry.num_tokens} tokens (backoff {entry.backoff}), "
                f"this one expects {remote.remote_num_tokens} (backoff {remote.remote_backoff})"
            )
        remote = msgspec.structs.replace(
            remote,
            remote_port=ports[replica],
            remote_ranks=ranks,
            remote_dp_rank=replica,
            remote_block_ids=entry.block_ids,
            remote_engine_id=base.engine_id,
        )
        attempt.spec = spec = dataclasses.replace(spec, remote=remote)
        peer = self._peer(remote)
        peer.check(remote)
        attempt.plan = plan = self._plan(peer, spec)
        sources = peer.planner.sources(plan, spec.first_token)
        read = {p: set() for p in sources}
        pulled = 0
        waiter = _Waiter(self.settings.layerwise_wait, f"the layers of request {spec.request_id}")
        while True:
            todo = {p: peer.planner.tables(p).layers - read[p] for p in sources}
            todo = {p: layers for p, layers in todo.items() if layers}
            if not todo:
                return pulled
            news = False
            for p, entry in zip(
                todo, self._progress(remote.remote_host, [remote.remote_port + p for p in todo], transfer_id)
            ):
                if entry.state == wire.FAILED:
                    raise RuntimeError("the prefill instance failed the request while it was read")
                ready = todo[p].intersection(entry.layers)
                if ready:
                    pulled += self._execute(plan, peer, spec, only={p: ready})
                    read[p] |= ready
                    news = True
            waiter.wait(news)

    def _progress(self, host: str, ports: list[int], transfer_id: str, tolerate: bool = False):
        """Each prefill rank's progress of one transfer (``tolerate``: None for a rank that
        did not answer, unless none did)."""
        message = wire.Progress(wire.WIRE_VERSION, [transfer_id])
        replies = self._client.request_all([(f"{host}:{port}", message) for port in ports])
        out = []
        for port, reply in zip(ports, replies):
            if isinstance(reply, wire.ProgressReply) and len(reply.transfers) == 1:
                out.append(reply.transfers[0])
            elif tolerate and isinstance(reply, Exception) and len(ports) > 1:
                out.append(None)
            elif isinstance(reply, Exception):
                raise reply
            else:
                raise RuntimeError(f"the prefill rank at {host}:{port} answered Progress with {reply}")
        if all(entry is None for entry in out):
            raise next(r for r in replies if isinstance(r, Exception))
        return out

    def _base_info(self, host: str, port: int) -> wire.RankInfo:
        """The first rank of a prefill instance (its layout tells where the replicas are)."""
        info = self._bases.get((host, port))
        if info is None:
            info = self._bases[(host, port)] = self._hello(host, port)
        return info

    def _release_layerwise(self, reader: str, remote, layout) -> None:
        requests = release_messages(
            remote.remote_host, remote.remote_port, layout, remote.layerwise_id, reader
        )
        for (address, _), reply in zip(requests, self._client.request_all(requests)):
            if isinstance(reply, Exception):
                logger.warning("request %s: release to %s failed: %s", remote.layerwise_id, address, reply)

    def _execute(self, plan, peer: _Peer, spec: RecvSpec, only: dict | None = None, before_read=None) -> int:
        """This rank's reads of the plan (``only``: of these layers of these prefill ranks,
        by index in their ``RankInfo``); the bytes read. ``before_read`` is called with the
        prefill ranks (in their replica) to be read from, once the ranges are worked out."""

        batches = peer.planner.ranges(
            plan,
            spec.first_token,  # reads of tokens cached here are skipped
            layers=only,
            whole_blocks=self._transport.whole_blocks,
        )
        if before_read is not None:
            before_read([p for p, *_ in batches])
        pulled = 0
        for p, local, remote_addr, lengths in batches:
            self._transport.read(peer.addresses[p], local, remote_addr, lengths)
            pulled += int(lengths.sum())
        return pulled

    def _send_done(self, spec: RecvSpec, plan, failed: bool, inside_lease: bool = False) -> bool:
        """Send this rank's done messages; True if a prefill rank does not answer that it held
        the blocks while this reader read them (its lease ran out, they were released for
        other readers, it does not know the request), or (unless the read ended
        ``inside_lease``) does not answer: what was read may be stale, and is discarded."""
        remote = spec.remote
        if plan is None:  # no plan (prefill unreachable): every rank asks every prefill rank to free
            messages = [
                wire.DoneReading(
                    wire.WIRE_VERSION,
                    remote.remote_request_id,
                    spec.request_id,
                    self.global_rank,
                    rank,
                    [],
                    reads_total=0,
                    ok=False,
                )
                for rank in range(remote.remote_ranks)
            ]
            targets = [remote.remote_port + rank for rank in range(remote.remote_ranks)]
        else:
            failed_ids = frozenset(plan.read_ids_of(self.global_rank).tolist()) if failed else frozenset()
            # the prefill instance knows the request by its own id
            messages = [
                m
                for m in wire.done_messages(plan, remote.remote_request_id, spec.request_id, failed_ids)
                if m.decode_rank == self.global_rank
            ]
            targets = [remote.remote_port + m.prefill_rank - plan.prefill_ranks.start for m in messages]
        # done messages are idempotent: after good reads a busy prefill rank gets a second
        # chance (unanswered, they would be discarded); after failed ones the lease frees anyway
        requests = [(f"{remote.remote_host}:{port}", m) for m, port in zip(messages, targets)]
        expired = False
        for attempt in (1, 2):
            retry = []
            for (address, message), reply in zip(requests, self._client.request_all(requests)):
                if not isinstance(reply, Exception):
                    # fail closed: only an explicit "held while you read" keeps what was read
                    expired |= message.ok and not (isinstance(reply, wire.Reply) and reply.held)
                    continue
                logger.warning(
                    "request %s: done message to %s failed (attempt %d of %d): %s",
                    spec.request_id,
                    address,
                    attempt,
                    2 if message.ok else 1,
                    reply,
                )
                if message.ok and attempt == 1:
                    retry.append((address, message))
                else:  # unanswered: the blocks may have been freed under the read
                    expired |= message.ok and not inside_lease
            if not retry:
                break
            requests = retry
        return expired

    def _send_done_after(self, spec: RecvSpec, plan, granted: float) -> None:
        """The done messages of a pull already reported (its read ended inside the leases)."""
        try:
            if self._send_done(spec, plan, failed=False, inside_lease=True):
                logger.error(
                    "request %s: a prefill rank at %s reports its lease ran out although it granted "
                    "%.1f s that had not passed: are the two hosts' clocks sound?",
                    spec.request_id,
                    spec.remote.remote_host,
                    granted,
                )
        except Exception:
            logger.exception("request %s: sending its done messages failed", spec.request_id)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._server is not None:
            self._server.close()
        if self._transport is not None:
            self._transport.close()
