"""The decode side of ``AscendP2PConnector``'s worker: pulling each request's KV.

A decode rank pulls each request it is given on a background thread: learn the prefill
ranks (one ``planner.ReplicaPlanner`` per prefill replica, built at its handshake), plan
the pull and execute this rank's reads, then send each prefill rank it read from the
done message, also after a failure; the first decode rank also tells the unread prefill
ranks. Just before reading it renews the request on the ranks it reads from; if their
answers show the read ended inside their leases (``lease_check.py``), the pull is
reported at once and the done messages follow, else it waits for their answers (a lease
that ran out means what was read is discarded). Each layer is read by its own KV-cache
group's block table (``groups.py``); both sides name every layer's group in the
handshake, and a mismatch fails the pull.

Layer-wise (``layerwise.py``): find the replica that has the request, plan from the
published block tables and read each prefill rank's layers as they are written, then send
the same done messages.
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

from vllm.ascend.attention.kv_layout import LayerLayout
from vllm.ascend.context_parallel.placement import CPLayout, LayoutError
from vllm.ascend.kv_transfer import wire
from vllm.ascend.kv_transfer.addressing import RankTables, plane_regions
from vllm.ascend.kv_transfer.control import ControlClient, ControlTimeout, hello
from vllm.ascend.kv_transfer.groups import TransferGroups
from vllm.ascend.kv_transfer.layerwise import release
from vllm.ascend.kv_transfer.lease_check import LeaseCheck
from vllm.ascend.kv_transfer.metadata import RecvSpec
from vllm.ascend.kv_transfer.pacer import IdlePacer
from vllm.ascend.kv_transfer.planner import ReplicaPlanner
from vllm.ascend.kv_transfer.progress_poller import ProgressPoller
from vllm.ascend.kv_transfer.settings import P2PSettings
from vllm.ascend.kv_transfer.stats import StatsInterval
from vllm.ascend.kv_transfer.transport import Transport
from vllm.ascend.kv_transfer.trust import TrustError

logger = init_logger(__name__)

# seconds from the renewals for their answers (then the done messages' answers decide)
LEASE_ANSWER_WAIT = 1.0


@dataclass
class _Attempt:
    """One pull as far as it got (the done messages depend on it)."""

    spec: RecvSpec
    plan: object = None
    layout: CPLayout | None = None  # layer-wise: the prefill instance's, once asked
    unreachable: bool = False  # layer-wise: no prefill replica answered (nothing to release)
    lease: LeaseCheck | None = None  # whole pulls: the renewals sent before the read
    read_end: float = 0.0


class _Waiter:
    """Paces a layer-wise poll: short sleeps while news comes, longer ones up to 20 ms
    without; gives up after ``patience`` seconds with no news."""

    def __init__(self, patience: float, what: str, setting: str = "layerwise_wait_seconds"):
        self.patience, self.what, self.setting = patience, what, setting
        self._sleep = 0.0005
        self._last_news = time.monotonic()

    def wait(self, news: bool) -> None:
        now = time.monotonic()
        if news:
            self._sleep, self._last_news = 0.0005, now
            return
        if now - self._last_news > self.patience:
            raise TimeoutError(f"waited {self.patience:.0f} s for {self.what} ({self.setting})")
        time.sleep(self._sleep)
        self._sleep = min(self._sleep * 2, 0.02)


@dataclass(frozen=True)
class _Peer:
    """One prefill DP replica as a decode rank sees it."""

    layout: CPLayout
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


class DecodeSide:
    """Pulls the requests this rank is given (``pull``) and says which are done
    (``take_finished``) or failed (``take_failed_blocks``, ``take_failed_requests``)."""

    def __init__(
        self,
        settings: P2PSettings,
        global_rank: int,
        tp_rank: int,
        transport: Transport,
        layers: dict[str, tuple[int, LayerLayout]],
        groups: TransferGroups,
        pacer: IdlePacer,
        stats: StatsInterval,
    ):
        self.settings = settings
        self.layout: CPLayout = settings.layout
        self.global_rank, self.tp_rank = global_rank, tp_rank
        self.groups = groups
        self._transport = transport
        self._layers = layers  # this rank's KV layers: name -> (base, LayerLayout)
        self._pacer, self._stats = pacer, stats
        self._client = ControlClient(settings.control_timeout, settings.trust)
        # the renewals before a read, on sockets of their own: their answers are read after
        # the read, and a Hello on the same thread must not take one for its own
        self._lease_client = ControlClient(settings.control_timeout, settings.trust)
        # a few pulls at once, so one unreachable prefill instance does not hold up the others
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kv-p2p-pull")
        # a layer-wise pull waits for the prefill forward: more of them at once
        self._layerwise_pool = ThreadPoolExecutor(max_workers=32, thread_name_prefix="kv-p2p-layerwise")
        self._bases: dict[tuple[str, int], wire.RankInfo] = {}  # a prefill instance's first rank
        self._pollers: dict[tuple[str, int], ProgressPoller] = {}  # per prefill instance, as above
        self._peer_lock = threading.Lock()
        self._peers: dict[tuple, _Peer] = {}
        self._lock = threading.Lock()  # the three sets below, written by the pull threads
        self._finished_recving: set[str] = set()
        self._failed_blocks: set[int] = set()
        self._failed_requests: set[str] = set()  # several groups: block ids are per group

    def pull(self, specs: list[RecvSpec]) -> None:
        """Start pulling these requests, each on a pull thread."""
        for spec in specs:
            pool = self._pool if spec.remote.layerwise_id is None else self._layerwise_pool
            pool.submit(self._pull, spec)

    def take_finished(self) -> set[str]:
        with self._lock:
            recving, self._finished_recving = self._finished_recving, set()
        return recving

    def take_failed_blocks(self) -> set[int]:
        with self._lock:
            failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def take_failed_requests(self) -> set[str]:
        with self._lock:
            failed, self._failed_requests = self._failed_requests, set()
        return failed

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
        reply = hello(self._client, host, port, self.settings.engine_id)
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
                        release,
                        self._client,
                        remote.remote_host,
                        remote.remote_port,
                        attempt.layout,
                        remote.layerwise_id,
                        spec.request_id,
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
            if failed:
                self._stats.record(lambda stats: stats.record_failed_pull())
            else:
                seconds = time.perf_counter() - started
                self._stats.record(lambda stats: stats.record_pull(seconds, pulled))
            with self._lock:
                if failed and len(spec.local_block_ids) > 1:
                    self._failed_requests.add(spec.request_id)  # block ids are per group
                elif failed:
                    first_block = spec.first_token // self.layout.virtual_block_size
                    self._failed_blocks.update(spec.local_block_ids[0][first_block:])
                self._finished_recving.add(spec.request_id)
            self._pacer.news()
            granted = attempt.lease.granted if attempt.lease is not None else None
            if covered and granted is not None:
                self._send_done_after(spec, attempt.plan, granted)

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
        if transfer_id is None:
            raise RuntimeError(f"request {spec.request_id}: a layer-wise pull without a transfer id")
        base = self._base_info(remote.remote_host, remote.remote_port)
        poller = self._poller(remote.remote_host, remote.remote_port)
        attempt.layout = layout = base.layout.to_layout()
        ranks = layout.ranks_per_replica
        ports = [remote.remote_port + d * ranks for d in range(layout.dp)]
        # a transfer the prefill instance has not heard of is given up on after a lease in
        # which it published no other request (it is not working through a queue), or after
        # layerwise_wait_seconds in all
        lease_first = self.settings.lease_seconds < self.settings.layerwise_wait
        waiter = _Waiter(
            min(self.settings.layerwise_wait, self.settings.lease_seconds),
            f"request {spec.request_id} to be published while the prefill instance published nothing",
            "lease_seconds" if lease_first else "layerwise_wait_seconds",
        )
        give_up = time.monotonic() + self.settings.layerwise_wait
        addresses = [f"{remote.remote_host}:{port}" for port in ports]
        queue = poller.published(addresses)
        while True:
            try:
                replies = self._progress(poller, remote.remote_host, ports, transfer_id, tolerate=True)
            except ControlTimeout:
                attempt.unreachable = True
                raise
            found = [(d, t) for d, t in enumerate(replies) if t is not None and t.state != wire.UNKNOWN]
            if found:
                break
            if time.monotonic() > give_up:
                raise TimeoutError(
                    f"waited {self.settings.layerwise_wait:.0f} s for request {spec.request_id} to be "
                    "published (layerwise_wait_seconds)"
                )
            now = poller.published(addresses)
            waiter.wait(news=now != queue)
            queue = now
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
        read: dict[int, set[int]] = {p: set() for p in sources}
        pulled = 0
        waiter = _Waiter(self.settings.layerwise_wait, f"the layers of request {spec.request_id}")
        while True:
            todo = {p: peer.planner.tables(p).layers - read[p] for p in sources}
            todo = {p: layers for p, layers in todo.items() if layers}
            if not todo:
                return pulled
            news = False
            for p, progress in zip(
                todo,
                self._progress(
                    poller, remote.remote_host, [remote.remote_port + p for p in todo], transfer_id
                ),
            ):
                if progress is None or progress.state == wire.FAILED:
                    raise RuntimeError("the prefill instance failed the request while it was read")
                ready = todo[p].intersection(progress.layers)
                if ready:
                    pulled += self._execute(plan, peer, spec, only={p: ready})
                    read[p] |= ready
                    news = True
            waiter.wait(news)

    def _progress(
        self, poller: ProgressPoller, host: str, ports: list[int], transfer_id: str, tolerate: bool = False
    ) -> list[wire.TransferProgress | None]:
        """Each prefill rank's progress of one transfer (``tolerate``: None for a rank that
        did not answer, unless none did)."""
        replies = poller.ask([f"{host}:{port}" for port in ports], transfer_id)
        out: list[wire.TransferProgress | None] = []
        for reply in replies:
            if isinstance(reply, wire.TransferProgress):
                out.append(reply)
            elif tolerate and len(ports) > 1:
                out.append(None)
            else:
                raise reply
        if all(entry is None for entry in out):
            raise next(r for r in replies if isinstance(r, Exception))
        return out

    def _poller(self, host: str, port: int) -> ProgressPoller:
        """The poller of the prefill instance whose first control port is ``port``."""
        with self._peer_lock:
            poller = self._pollers.get((host, port))
            if poller is None:
                poller = self._pollers[(host, port)] = ProgressPoller(self._client, name=f"-{host}:{port}")
        return poller

    def _base_info(self, host: str, port: int) -> wire.RankInfo:
        """The first rank of a prefill instance (its layout tells where the replicas are)."""
        info = self._bases.get((host, port))
        if info is None:
            info = self._bases[(host, port)] = self._hello(host, port)
        return info

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
        self._layerwise_pool.shutdown(wait=False, cancel_futures=True)
        with self._peer_lock:
            for poller in self._pollers.values():
                poller.close()
