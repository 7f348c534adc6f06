"""P/D KV transfer: raw Mooncake batch reads vs. the connector's pull of the same bytes,
control-plane time per request, pull threads, and TTFT and tokens/s of colocated, 1P1D
pull-after-prefill and 1P1D layer-wise serving. In one run (``nox -s bench -- kv-transfer``):

1. Pulls at real KV shapes. A peer process holds the prefill ranks' KV caches, laid out as
   the Ascend backends store them (per layer, planes of blocks; head-major blocks),
   registered with the Mooncake TransferEngine over TCP, each rank with a real
   ``ControlServer``. This process is one decode rank: per request it runs what the
   connector's worker runs (its ``planner.ReplicaPlanner``: ``plan`` and ``ranges``,
   ``MooncakeTransport.read``, the done messages through ``ControlClient.request_all``)
   and, in the same run, the raw transport on the same bytes: ``batch_transfer_sync_read``
   of one range per (layer, plane, block, head run) computed straight from the block ids,
   in batches of as many slices as the engine's TCP lanes take (``batch_slices``).
   Shapes: DeepSeek-V3 (MLA, 61 layers; latent 128 KiB and
   rope 16 KiB per 128-token block), a Qwen3-MoE-style GQA model (48 layers, 4 KV heads
   of 128: 32 KiB per head and block), a GQA model with 8 KV heads of 128 (80 layers,
   256 KiB planes) and the two synthetic cases of earlier runs (4 layers, 1 MiB and
   64 KiB blocks); prompts of 4k and 32k tokens; block ids fragmented (a shuffled pool:
   nothing merges) or contiguous (what a fresh allocator hands out: a layer's blocks
   merge into one range); heterogeneous layouts from the plan benchmark's table.
   Goal: connector >= 0.95 x raw for real ranges (16 KiB to 256 KiB).
2. Control-plane time per request on the pull's critical path, p50/p99: planning,
   addressing, the renewals sent just before the read (``lease_check.LeaseCheck``) and
   waiting for their answers after the read: the time to the pull's report, to which the done
   messages' round trip adds only for a read not inside the granted leases; that round
   trip (after the report) beside it. Goal: p50 <= 1 ms for DeepSeek-V3 at 4k
   tokens; the table shows how it grows with the prompt. Every control frame is sealed with
   the run's secret (``trust.py``), and a table beside it gives what the secret costs per
   request, sealed and unsealed side by side. Goal: off the pull or under 0.1 ms.
3. Serving (tiny Qwen2; prefill and decode instances with AscendP2PConnector behind the
   proxy, once as pull after prefill and once ``--layerwise``, and one colocated
   instance): TTFT of one request at a time on 512- to 4k-token prompts, with each P/D
   mode's overhead over colocated, then TTFT and output tokens/s of concurrent streamed
   requests (host emulation: these numbers track the connector's cost, not NPU speed).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import multiprocessing as mp
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
BLOCK_TOKENS = 128


@dataclass(frozen=True)
class Shape:
    """A model's KV cache per layer: ``plane_bytes[i]``, one head's bytes per token in
    plane ``i`` (head dim x dtype size); ``kv_heads`` None: MLA (one latent head)."""

    name: str
    layers: int
    plane_bytes: tuple[int, ...]
    kv_heads: int | None


MIN_MIB = 2048  # per case and side, where --repeats pulls move less

SHAPES = {
    "deepseek-v3": Shape("DeepSeek-V3 MLA", 61, (512 * 2, 64 * 2), None),
    "qwen3-moe": Shape("Qwen3-MoE GQA 4x128", 48, (128 * 2, 128 * 2), 4),
    "gqa8": Shape("GQA 8x128", 80, (128 * 2, 128 * 2), 8),
    "1mib": Shape("synthetic 1 MiB blocks", 4, (8192,), None),  # one plane per layer x 2 below
    "64kib": Shape("synthetic 64 KiB blocks", 4, (512,), None),
}


@dataclass(frozen=True)
class Case:
    shape: str
    tokens: int
    prefill: tuple  # CPLayout fields
    decode: tuple
    contiguous: bool = False
    label: str = "TP1 -> TP1"

    def layouts(self):
        from vllm.ascend.context_parallel.placement import CPLayout

        kv = SHAPES[self.shape].kv_heads
        return (
            CPLayout(**dict(self.prefill), kv_heads=kv, block_size=BLOCK_TOKENS),
            CPLayout(**dict(self.decode), kv_heads=kv, block_size=BLOCK_TOKENS),
        )


def default_cases(long: bool) -> list[Case]:
    tp1 = (("tp", 1),)
    cases = [
        Case("1mib", 16 * 128, tp1, tp1),  # 128 MiB in both
        Case("64kib", 256 * 128, tp1, tp1),
        Case("deepseek-v3", 4096, tp1, tp1),
        Case("deepseek-v3", 4096, tp1, tp1, contiguous=True),
        Case(
            "deepseek-v3", 4000, tp1, tp1
        ),  # ends inside a block: its last, partial period is built per request
        Case("qwen3-moe", 4096, tp1, tp1),
        Case("qwen3-moe", 4096, tp1, tp1, contiguous=True),
        Case("gqa8", 4096, tp1, tp1),
        Case(
            "deepseek-v3",
            4096,
            # CP with interleave = block size on both sides, as P/D deployments run it
            # (token interleave makes every token a range: see nox -s bench -- plan)
            (("tp", 8), ("pcp", 2), ("dcp", 8), ("interleave", BLOCK_TOKENS)),
            (("tp", 8), ("dcp", 4), ("dp", 2), ("interleave", BLOCK_TOKENS)),
            label="TP8/PCP2/DCP8 -> TP8/DCP4/DP2, interleave 128",
        ),
        Case(
            "deepseek-v3",
            4096,
            (("tp", 8), ("pcp", 2), ("interleave", BLOCK_TOKENS)),
            (("tp", 4), ("dcp", 2), ("interleave", BLOCK_TOKENS)),
            label="TP8/PCP2 -> TP4/DCP2, interleave 128",
        ),
        Case("qwen3-moe", 4096, (("tp", 8),), (("tp", 2),), label="TP8 -> TP2"),
        Case("qwen3-moe", 4096, (("tp", 2),), (("tp", 8),), label="TP2 -> TP8"),
    ]
    if long:
        cases += [Case("deepseek-v3", 32768, tp1, tp1), Case("qwen3-moe", 32768, tp1, tp1)]
    return cases


def _rank_layers(shape: Shape, layout, tp_rank: int, num_blocks: int) -> tuple[list, dict]:
    """One rank's KV cache: a buffer per layer and ``name -> (base, LayerLayout)``."""
    from vllm.ascend.attention.kv_layout import LayerLayout, Plane

    heads = len(layout.heads(tp_rank))
    planes = [Plane(f"p{i}", heads, BLOCK_TOKENS * b) for i, b in enumerate(shape.plane_bytes)]
    if len(planes) == 1:  # the synthetic shapes: K and V planes alike
        planes = planes * 2
    layer = LayerLayout(num_blocks, tuple(planes))
    buffers = [np.zeros(layer.total_bytes, dtype=np.uint8) for _ in range(shape.layers)]
    return buffers, {f"layer.{i}": (buf.ctypes.data, layer) for i, buf in enumerate(buffers)}


def prefill_peer(case: Case, ranks: list[int], num_blocks: int, control_port: int, out, stop) -> None:
    """The prefill side: the caches of the ranks the decode rank reads from (filled with
    each rank's number + 1), registered with one transport, and a control server for every
    rank of the replica that frees by the done messages as a prefill rank does (``Holds``)."""
    os.environ.setdefault("VLLM_ASCEND_EMULATE", "1")
    from vllm.ascend.kv_transfer import wire
    from vllm.ascend.kv_transfer.addressing import layer_regions, plane_regions
    from vllm.ascend.kv_transfer.control import ControlServer
    from vllm.ascend.kv_transfer.holds import Holds
    from vllm.ascend.kv_transfer.transport import open_transport

    trust = _trust()
    shape, (prefill, _) = SHAPES[case.shape], case.layouts()
    transport = open_transport("mooncake", "127.0.0.1", {})
    kept, regions, servers = [], {}, []
    for rank in range(prefill.ranks_per_replica):  # every rank answers done messages (unread ones too)
        if rank in ranks:
            buffers, layers = _rank_layers(shape, prefill, rank % prefill.tp, num_blocks)
            for buf in buffers:
                buf[:] = rank + 1
            kept += buffers
            regions[rank] = layer_regions(layers)
            transport.register(plane_regions(regions[rank]))
        holds, handed = Holds(30.0), set()

        def handle(message, holds=holds, handed=handed):
            # a rank is handed each request at its first message (the scheduler would have
            # done it at the end of the prefill), then answers as a prefill rank does
            request_ids = message.request_ids if isinstance(message, wire.Renew) else [message.request_id]
            for request_id in set(request_ids) - handed:
                holds.hold(request_id, 30.0)
                handed.add(request_id)
            if isinstance(message, wire.Renew):
                return wire.Reply(wire.WIRE_VERSION, True, lease_seconds=holds.renew(message.request_ids))
            holds.done(message.request_id, message.reader, message.read_ids, message.reads_total)
            holds.take_finished()
            return wire.Reply(wire.WIRE_VERSION, True)

        servers.append(ControlServer("127.0.0.1", control_port + rank, handle, trust=trust))
    out.put((transport.address, {rank: [_region_tuple(r) for r in regions[rank]] for rank in ranks}))
    stop.wait(1800)
    for server in servers:
        server.close()
    transport.close()
    del kept


def _trust():
    """The run's deployment secret (``main`` makes one): frames sealed as in a deployment."""
    from vllm.ascend.kv_transfer.trust import Trust, load_secret

    return Trust(load_secret(None, insecure=False))


def trust_costs(repeats: int = 2000) -> tuple[list[dict], dict]:
    """What the secret costs per request, side by side with no secret: signing the
    parameters (prefill scheduler), checking them and the prompt digest (decode scheduler,
    before blocks are allocated: off the pull), and a control round trip (Renew, the
    done messages) sealed and unsealed on 127.0.0.1; DeepSeek-V3-sized block tables."""
    from vllm.ascend.kv_transfer import wire
    from vllm.ascend.kv_transfer.control import ControlClient, ControlServer
    from vllm.ascend.kv_transfer.trust import PULL_FIELDS, Trust, prompt_digest

    secure, plain = _trust(), Trust(None)

    def p50_us(fn, *args, n=repeats) -> float:
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn(*args)
            times.append(time.perf_counter() - t0)
        return _pct(times, 50) * 1e6

    rows = []
    for tokens in (4096, 32768):
        blocks = list(range(1, -(-tokens // BLOCK_TOKENS) + 1))
        prompt = list(range(tokens))
        params = {
            "do_remote_prefill": True,
            "remote_engine_id": "engine",
            "remote_request_id": "cmpl-0123456789abcdef",
            "remote_host": "10.0.0.1",
            "remote_port": 21100,
            "remote_ranks": 16,
            "remote_block_ids": [blocks],
            "remote_num_tokens": tokens,
            "remote_readers": 1,
            "remote_prompt_digest": prompt_digest(prompt),
        }
        signed = secure.sign_params(params, PULL_FIELDS, 90)
        done = wire.DoneReading(
            wire.WIRE_VERSION, "cmpl-0123456789abcdef", "decode-0", 0, 0, list(range(61 * 2))
        )
        rows.append(
            {
                "what": f"{tokens}-token request",
                "sign params": p50_us(secure.sign_params, params, PULL_FIELDS, 90),
                "check params": p50_us(secure.check_params, signed, PULL_FIELDS),
                "prompt digest": p50_us(prompt_digest, prompt, n=repeats // 4),
                "seal + open a done message": p50_us(_sealed_round, secure, wire.encode_message(done)),
            }
        )
    trips = {}
    for label, trust in (("unsealed", plain), ("sealed", secure)):
        port = _free_port()
        server = ControlServer(
            "127.0.0.1", port, lambda m: wire.Reply(wire.WIRE_VERSION, True, lease_seconds=30.0), trust=trust
        )
        client = ControlClient(10.0, trust)
        renew = wire.Renew(wire.WIRE_VERSION, "engine", ["cmpl-0123456789abcdef"])
        address = f"127.0.0.1:{port}"
        for _ in range(50):  # connect and warm up
            client.request(address, renew)
        trips[label] = p50_us(client.request, address, renew, n=repeats // 2)
        client.close()
        server.close()
    return rows, trips


def _sealed_round(trust, payload: bytes) -> bytes:
    return trust.open_frame(trust.seal(payload))


def _region_tuple(region) -> tuple:
    return (region.name, region.base, region.num_blocks, [(p.heads, p.head_bytes) for p in region.planes])


def _free_port(span: int = 1) -> int:
    """A port whose ``span`` successors are free as well (one control server per rank)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + span < 65536 and all(_port_free(port + i) for i in range(span)):
            return port
    raise SystemExit("no free range of ports for the control servers")


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _pct(values, q):
    return float(np.percentile(np.asarray(values), q))


def _block_ids(rng, need: int, pool: int, contiguous: bool) -> np.ndarray:
    """A request's block ids; block 0 is vLLM's null block."""
    if contiguous:
        return np.arange(1, need + 1)
    return rng.permutation(pool - 1)[:need] + 1


@contextlib.contextmanager
def _prefill_peer(case: Case, ranks: list[int], num_blocks: int, control_port: int):
    """The prefill ranks' caches in a peer process: yields (transport address, regions)."""
    ctx = mp.get_context("spawn")
    out, stop = ctx.Queue(), ctx.Event()
    peer = ctx.Process(
        target=prefill_peer, args=(case, ranks, num_blocks, control_port, out, stop), daemon=True
    )
    peer.start()
    try:
        yield out.get(timeout=600)
    finally:
        stop.set()
        peer.join(30)
        if peer.is_alive():
            peer.kill()


def run_case(case: Case, repeats: int) -> dict:
    from vllm.ascend.kv_transfer import wire
    from vllm.ascend.kv_transfer.addressing import RankTables, layer_regions, plane_regions, plane_table
    from vllm.ascend.kv_transfer.control import ControlClient
    from vllm.ascend.kv_transfer.decode_side import LEASE_ANSWER_WAIT
    from vllm.ascend.kv_transfer.lease_check import LeaseCheck
    from vllm.ascend.kv_transfer.plan import build_group_plan
    from vllm.ascend.kv_transfer.planner import ReplicaPlanner
    from vllm.ascend.kv_transfer.transport import open_transport

    shape, (prefill, decode) = SHAPES[case.shape], case.layouts()
    rng = np.random.default_rng(0)
    need_p = -(-case.tokens // prefill.virtual_block_size)
    need_d = -(-case.tokens // decode.virtual_block_size)
    pool = max(need_p, need_d) + max(8, max(need_p, need_d) // 4)
    me = 0  # decode rank 0 of DP replica 0 (TP rank 0)
    probe = build_group_plan(
        prefill, decode, case.tokens, [list(range(1, need_p + 1))], [list(range(1, need_d + 1))]
    )
    ranks = sorted(set(probe.prefill_rank[probe.read_ids_of(me)].tolist()))
    port = _free_port(prefill.ranks_per_replica)
    with _prefill_peer(case, ranks, pool, port) as (address, raw_regions):
        theirs = {
            rank: [
                wire.LayerRegion(n, b, nb, [wire.PlaneSpec(h, hb) for h, hb in planes])
                for n, b, nb, planes in regions
            ]
            for rank, regions in raw_regions.items()
        }
        buffers, mine = _rank_layers(shape, decode, 0, pool)
        transport = open_transport("mooncake", "127.0.0.1", {})
        transport.register(plane_regions(layer_regions(mine)))
        transport.connect(address, [r for regions in theirs.values() for r in plane_regions(regions)])
        tables = {rank: plane_table(mine, theirs[rank]) for rank in ranks}
        # the worker's planner of this prefill replica, as it is built at the handshake
        planner = ReplicaPlanner(
            prefill, decode, me, 0, lambda rank: RankTables.build({0: mine}, theirs[rank])
        )
        client, lease_client = ControlClient(10.0, _trust()), ControlClient(10.0, _trust())
        engine = transport._engine  # the TransferEngine itself, as a raw caller uses it
        raw_s, conn_s = [], []
        ms = {key: [] for key in ("plan", "addressing", "renew", "lease", "done")}
        raw_ranges = conn_ranges = moved = 0
        inside_of = []  # per pull: did its read end inside the granted leases

        def raw_pull(raw) -> float:
            t0 = time.perf_counter()
            for local, remote, lengths in raw.values():
                # in batches the engine's TCP lanes take (the transport's chunking)
                for part in transport.chunks(np.asarray(lengths)):
                    args = (local[part], remote[part], lengths[part])
                    assert engine.batch_transfer_sync_read(address, *args) == 0
            return time.perf_counter() - t0

        def connector_pull(src_ids, dst_ids, request_id: str):
            """The connector's pull, as the worker runs it: its time stamps, whether the read
            ended inside the leases, and the batches read."""
            t0 = time.perf_counter()
            plan = planner.plan(case.tokens, [src_ids], [dst_ids])
            t1 = time.perf_counter()
            batches = planner.ranges(plan)
            t2 = time.perf_counter()
            sources = [p for p, *_ in batches]
            check = LeaseCheck(lease_client, [f"127.0.0.1:{port + p}" for p in sources], "bench", request_id)
            t3 = time.perf_counter()
            for _, local, remote, lengths in batches:
                transport.read(address, local, remote, lengths)
            read_end, t4 = time.monotonic(), time.perf_counter()
            inside = check.covers(read_end, LEASE_ANSWER_WAIT)
            # a read inside the leases is reported here, the rest after the done messages
            t5 = time.perf_counter()
            done = [
                m
                for m in wire.done_messages(plan, request_id, request_id, frozenset())
                if m.decode_rank == me
            ]
            replies = client.request_all([(f"127.0.0.1:{port + m.prefill_rank}", m) for m in done])
            t6 = time.perf_counter()
            assert all(isinstance(r, wire.Reply) and r.ok for r in replies), replies
            return (t0, t1, t2, t3, t4, t5, t6), inside, batches

        rep, last = 0, repeats
        while rep <= last:  # the first round warms the connection and the plan cache up
            src_ids = _block_ids(rng, need_p, pool, case.contiguous)
            dst_ids = _block_ids(rng, need_d, pool, case.contiguous)
            # raw: the same tokens, one range per (layer, plane, block, head run), no plan
            raw = _raw_ranges(
                build_group_plan(prefill, decode, case.tokens, [src_ids], [dst_ids]),
                me,
                tables,
                src_ids,
                dst_ids,
            )
            filled = {}
            # both sides in turns, each after the buffers are zeroed (caches cold), so neither
            # gains from going first or second
            for side in ("raw", "connector") if rep % 2 else ("connector", "raw"):
                for buf in buffers:
                    buf[:] = 0
                if side == "raw":
                    t_raw = raw_pull(raw)
                else:
                    (t0, t1, t2, t3, t4, t5, t6), inside, batches = connector_pull(
                        src_ids, dst_ids, f"req-{rep}"
                    )
                filled[side] = _filled(buffers)
            assert filled["connector"] == filled["raw"], "the connector's pull differs from the raw one"
            rep += 1
            if rep == 1:
                # small pulls: more of them, so that each side moves MIN_MIB in all (a few
                # ms of loopback TCP jitter is a large part of a 70 ms read)
                warm_mib = sum(int(b[3].sum()) for b in batches) / 2**20
                last = max(repeats, min(4 * repeats, math.ceil(MIN_MIB / max(warm_mib, 1e-9))))
                continue
            raw_s.append(t_raw)
            conn_s.append(t4 - t0)
            for key, (a, b) in {
                "plan": (t0, t1),
                "addressing": (t1, t2),
                "renew": (t2, t3),
                "lease": (t4, t5),
                "done": (t5, t6),
            }.items():
                ms[key].append((b - a) * 1e3)
            inside_of.append(inside)
            raw_ranges = sum(len(v[2]) for v in raw.values())
            conn_ranges = sum(len(b[3]) for b in batches)
            moved = sum(int(b[3].sum()) for b in batches)
        transport.close()
        del buffers
    mib = moved / 2**20
    # to the report: the done messages' round trip counts only for reads not inside the leases
    covered_done = [0.0 if inside else d for inside, d in zip(inside_of, ms["done"])]
    total = [
        sum(parts) for parts in zip(*(ms[k] for k in ("plan", "addressing", "renew", "lease")), covered_done)
    ]
    return {
        "case": case,
        "mib": mib,
        "raw_ranges": raw_ranges,
        "ranges": conn_ranges,
        "range_kib": moved / max(raw_ranges, 1) / 1024,
        "raw_mib_s": mib / statistics.median(raw_s),
        "connector_mib_s": mib / statistics.median(conn_s),
        # per pull, both sides of it side by side: drift on the machine cancels
        "ratio": statistics.median(r / c for r, c in zip(raw_s, conn_s)),
        "pulls": len(conn_s),
        "prefill_ranks": len(ranks),
        **{key: (_pct(values, 50), _pct(values, 99)) for key, values in ms.items()},
        "total": (_pct(total, 50), _pct(total, 99)),
        "covered": (sum(inside_of), len(inside_of)),
    }


def run_concurrency(shape_name: str, tokens: int, requests: int, pool_sizes: list[int]) -> list[dict]:
    """``requests`` pulls at once (disjoint fragmented blocks, plan + addressing + read +
    done messages each, as the worker's pull threads run them) through thread pools of
    each size: the aggregate rate and the per-request p50, to size the worker's pool."""

    from vllm.ascend.kv_transfer import wire
    from vllm.ascend.kv_transfer.addressing import RankTables, layer_regions, plane_regions
    from vllm.ascend.kv_transfer.control import ControlClient
    from vllm.ascend.kv_transfer.planner import ReplicaPlanner
    from vllm.ascend.kv_transfer.transport import open_transport

    case = Case(shape_name, tokens, (("tp", 1),), (("tp", 1),))
    shape, (prefill, decode) = SHAPES[shape_name], case.layouts()
    need = -(-tokens // BLOCK_TOKENS)
    pool = requests * need + 1
    port = _free_port(1)
    rows = []
    with _prefill_peer(case, [0], pool, port) as (address, raw_regions):
        theirs = [
            wire.LayerRegion(n, b, nb, [wire.PlaneSpec(h, hb) for h, hb in planes])
            for n, b, nb, planes in raw_regions[0]
        ]
        buffers, mine = _rank_layers(shape, decode, 0, pool)
        transport = open_transport("mooncake", "127.0.0.1", {})
        transport.register(plane_regions(layer_regions(mine)))
        transport.connect(address, plane_regions(theirs))
        planner = ReplicaPlanner(prefill, decode, 0, 0, lambda _: RankTables.build({0: mine}, theirs))
        client = ControlClient(10.0, _trust())
        rng = np.random.default_rng(1)

        def pull(ids):
            t0 = time.perf_counter()
            plan = planner.plan(tokens, [ids[0]], [ids[1]])
            for _, local, remote, lengths in planner.ranges(plan):
                transport.read(address, local, remote, lengths)
            done = [m for m in wire.done_messages(plan, "c", "c", frozenset()) if m.decode_rank == 0]
            client.request_all([(f"127.0.0.1:{port + m.prefill_rank}", m) for m in done])
            return time.perf_counter() - t0

        for size in [pool_sizes[0], *pool_sizes]:  # the first round warms up
            src_ids = (rng.permutation(pool - 1) + 1).reshape(requests, need)
            dst_ids = (rng.permutation(pool - 1) + 1).reshape(requests, need)
            with ThreadPoolExecutor(size) as executor:
                t0 = time.perf_counter()
                latencies = list(executor.map(pull, zip(src_ids, dst_ids)))
                elapsed = time.perf_counter() - t0
            rows.append(
                {
                    "threads": size,
                    "mib_s": requests * _request_mib(shape, tokens) / elapsed,
                    "p50_ms": _pct(latencies, 50) * 1e3,
                }
            )
        transport.close()
        del buffers
    return rows[1:]


def _request_mib(shape: Shape, tokens: int) -> float:
    heads = shape.kv_heads or 1
    return shape.layers * sum(shape.plane_bytes) * heads * tokens / 2**20


def _filled(buffers) -> int:
    return sum(int(np.count_nonzero(buf)) for buf in buffers)


def _raw_ranges(plan, me: int, tables: dict, src_ids, dst_ids) -> dict:
    """Per prefill rank: one range per (layer, plane, read, head run) from the block ids and
    the plan's slots, unmerged, as lists (what a caller hands the engine)."""
    out = {}
    ids = plan.read_ids_of(me)
    for rank in sorted(set(plan.prefill_rank[ids].tolist())):
        src, dst = tables[rank]
        p_heads = plan.prefill.heads(rank % plan.prefill.tp).start
        d_heads = plan.decode.heads(0).start
        local, remote, lengths = [], [], []
        for i in ids[plan.prefill_rank[ids] == rank].tolist():
            h0, h1 = int(plan.head0[i]), int(plan.head1[i])
            for _, s_slot, d_slot, n in plan.runs(i).tolist():
                for (s_base, s_block, s_head), (d_base, d_block, d_head) in zip(src.tolist(), dst.tolist()):
                    slot = s_head // BLOCK_TOKENS
                    # a block's heads are contiguous: one range for the read's heads
                    if n == BLOCK_TOKENS:
                        remote.append(s_base + int(plan.src_block[i]) * s_block + (h0 - p_heads) * s_head)
                        local.append(d_base + int(plan.dst_block[i]) * d_block + (h0 - d_heads) * d_head)
                        lengths.append((h1 - h0) * s_head)
                        continue
                    for h in range(h0, h1):
                        remote.append(
                            s_base + int(plan.src_block[i]) * s_block + (h - p_heads) * s_head + s_slot * slot
                        )
                        local.append(
                            d_base + int(plan.dst_block[i]) * d_block + (h - d_heads) * d_head + d_slot * slot
                        )
                        lengths.append(n * slot)
        out[rank] = (local, remote, lengths)
    return out


SERVING_MODEL_LEN = 4608  # the 4k-token prompts and their output


def _server(model: Path, port: int, config: dict | None, log: Path):
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.cli.main",
        "serve",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        str(SERVING_MODEL_LEN),
        "--seed",
        "0",
    ]
    if config:
        cmd += ["--kv-transfer-config", json.dumps(config)]
    return subprocess.Popen(
        cmd,
        env=dict(os.environ, VLLM_ASCEND_EMULATE="1"),
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _wait(url: str, proc, log: Path, timeout: float = 600) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{url} exited:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit(f"{url} not healthy in {timeout}s:\n{log.read_text()[-3000:]}")


async def _stream_all(
    url: str, model: Path, prompts: list, max_tokens: int
) -> tuple[list[float], int, float]:
    """The prompts (text or token ids) sent at once, streamed: their TTFTs, the output
    tokens and the seconds it all took."""
    import httpx

    async with httpx.AsyncClient(timeout=600) as client:

        async def one(prompt):
            body = {
                "model": str(model),
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
            t0, ttft, tokens = time.perf_counter(), None, 0
            async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        if ttft is None:
                            ttft = time.perf_counter() - t0
                        tokens += 1
            return ttft, tokens

        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(p) for p in prompts))
        return [r[0] for r in results], sum(r[1] for r in results), time.perf_counter() - t0


SETUPS = (("colocated", "colocated"), ("1P1D, pull after prefill", "proxy"), ("1P1D, layer-wise", "proxy_lw"))


def serving_rows(num_prompts: int, max_tokens: int, lengths: list[int], repeats: int) -> tuple[list, list]:
    """TTFT per prompt length (one request at a time, fresh random token ids each, so no
    prefix-cache hits) and the concurrent streamed run, for each setup in ``SETUPS``."""
    import random

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = tmp / "qwen2"
        subprocess.run(
            [
                sys.executable,
                str(ROOT / "examples" / "make_tiny_model.py"),
                "--arch",
                "qwen2",
                "--out",
                str(model),
                # deeper and wider than the test models, so a 4k-token prefill takes a while
                # and there are layers to overlap; positions for the 4k prompts
                *("--layers", "12", "--hidden-size", "256", "--intermediate-size", "512"),
                *("--max-len", str(SERVING_MODEL_LEN)),
            ],
            check=True,
            capture_output=True,
        )
        ports = {name: _free_port() for name in ("colocated", "prefill", "decode", "proxy", "proxy_lw")}
        kv = {name: _free_port() for name in ("prefill", "decode")}
        procs = {"colocated": _server(model, ports["colocated"], None, tmp / "colocated.log")}
        for name, role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
            config = {"kv_connector": "AscendP2PConnector", "kv_role": role, "kv_port": kv[name]}
            procs[name] = _server(model, ports[name], config, tmp / f"{name}.log")
        for name, extra in (
            ("proxy", []),
            ("proxy_lw", ["--layerwise", "--prefill-kv", f"127.0.0.1:{kv['prefill']}"]),
        ):
            procs[name] = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "vllm.ascend.kv_transfer.proxy",
                    "--prefill",
                    f"http://127.0.0.1:{ports['prefill']}",
                    "--decode",
                    f"http://127.0.0.1:{ports['decode']}",
                    "--port",
                    str(ports[name]),
                    *extra,
                ],
                stdout=open(tmp / f"{name}.log", "w"),  # noqa: SIM115  (the proxy writes it until it stops)
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            print("serving: starting a colocated instance, a 1P1D pair and both proxies ...", flush=True)
            for name in procs:
                _wait(f"http://127.0.0.1:{ports[name]}", procs[name], tmp / f"{name}.log")
            rng = random.Random(0)

            def token_prompt(n):  # ids from 10 up: clear of the special tokens
                return [rng.randrange(10, 500) for _ in range(n)]  # the tiny vocabulary has 512

            ttft_rows, concurrent_rows = [], []
            for _, name in SETUPS:
                url = f"http://127.0.0.1:{ports[name]}"
                asyncio.run(_stream_all(url, model, [token_prompt(64), token_prompt(512)], 4))  # warm-up
            for n in lengths:
                row = {"tokens": n}
                for _ in range(repeats):  # setups interleaved: drift on the machine hits all alike
                    for label, name in SETUPS:
                        url = f"http://127.0.0.1:{ports[name]}"
                        (ttft,), _, _ = asyncio.run(_stream_all(url, model, [token_prompt(n)], 2))
                        row.setdefault(label, []).append(ttft * 1e3)
                ttft_rows.append(
                    {k: (statistics.median(v) if isinstance(v, list) else v) for k, v in row.items()}
                )
                print(f"  TTFT at {n} tokens: done", flush=True)
            prompts = [
                f"Request {i}: " + "paged attention keeps keys and values in blocks " * (2 + i % 6)
                for i in range(num_prompts)
            ]
            for label, name in SETUPS:
                url = f"http://127.0.0.1:{ports[name]}"
                ttfts, tokens, elapsed = asyncio.run(_stream_all(url, model, prompts, max_tokens))
                concurrent_rows.append(
                    {
                        "setup": label,
                        "requests": num_prompts,
                        "ttft_p50_ms": _pct(ttfts, 50) * 1e3,
                        "ttft_p99_ms": _pct(ttfts, 99) * 1e3,
                        "tokens": tokens,
                        "tokens_s": tokens / elapsed,
                    }
                )
            return ttft_rows, concurrent_rows
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGTERM)
            for proc in procs.values():
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--repeats",
        type=int,
        default=20,
        help="pulls per case after one warm-up (more where they move under 2 GiB, a third at 32k)",
    )
    p.add_argument("--no-long", action="store_true", help="leave out the 32k-token cases (about 5 GB of RAM)")
    p.add_argument("--prompts", type=int, default=16, help="concurrent requests in the serving part")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--skip-serving", action="store_true")
    p.add_argument("--skip-pulls", action="store_true", help="only the serving part")
    p.add_argument(
        "--concurrent",
        type=int,
        default=8,
        help="requests pulled at once in the pool-size table (DeepSeek-V3, 4k tokens; 0 leaves it out)",
    )
    p.add_argument(
        "--ttft-lengths",
        type=lambda text: [int(n) for n in text.split(",")],
        default=[512, 1024, 2048, 4096],
        help="prompt lengths of the TTFT table (comma-separated, at most 4096)",
    )
    p.add_argument("--ttft-repeats", type=int, default=5, help="requests per setup and length (median)")
    args = p.parse_args()
    # one deployment's secret for every process of the run (the peers and the instances
    # inherit it): control frames are sealed and parameters signed, as in a deployment
    from vllm.ascend.kv_transfer.trust import SECRET_ENV, new_secret

    os.environ.setdefault(SECRET_ENV, new_secret())
    if not args.skip_pulls:
        pulls(args)
    if args.skip_serving:
        return
    serving(args)


def pulls(args) -> None:
    cases = default_cases(long=not args.no_long)
    print(
        f"pulls over Mooncake TCP on 127.0.0.1: {len(cases)} cases, {args.repeats} pulls each (median; "
        f"more, up to {4 * args.repeats}, where {args.repeats} move less than {MIN_MIB} MiB) ...",
        flush=True,
    )
    rows = []
    for case in cases:
        repeats = (
            args.repeats
            if case.tokens <= 8192 or SHAPES[case.shape].layers <= 4
            else max(3, args.repeats // 3)
        )
        rows.append(run_case(case, repeats))
        print(f"  {_name(rows[-1])}: done", flush=True)
    print(
        "\n| model | layout | tokens | block ids | prefill ranks | MiB | raw ranges (KiB each) "
        "| connector ranges | pulls | raw MiB/s | connector MiB/s | connector / raw (median per pull) |"
    )
    print("|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        c = r["case"]
        print(
            f"| {SHAPES[c.shape].name} | {c.label} | {c.tokens} | {'contiguous' if c.contiguous else 'fragmented'} "
            f"| {r['prefill_ranks']} | {r['mib']:.0f} | {r['raw_ranges']} ({r['range_kib']:.0f}) | {r['ranges']} "
            f"| {r['pulls']} | {r['raw_mib_s']:.0f} | {r['connector_mib_s']:.0f} | {r['ratio']:.2f} |"
        )
    real = [r for r in rows if SHAPES[r["case"].shape].layers > 4 and not r["case"].contiguous]
    worst = min(r["ratio"] for r in real)
    print(
        f"goal: connector >= 0.95 x raw at real shapes, fragmented block ids: worst {worst:.2f},",
        "met" if worst >= 0.95 else "NOT met",
    )
    print(
        "\ncontrol-plane time per request on the pull's critical path, ms (p50 / p99); the done "
        "messages' round trip runs after the pull is reported when the read ended inside the "
        "granted leases (pulls so reported: covered)"
    )
    print(
        "| model | layout | tokens | block ids | plan | addressing | renewals sent | lease answers "
        "| total to the report | covered | done round trip (after the report) |"
    )
    print("|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        c = r["case"]
        keys = ("plan", "addressing", "renew", "lease", "total")
        print(
            f"| {SHAPES[c.shape].name} | {c.label} | {c.tokens} | {'contiguous' if c.contiguous else 'fragmented'} | "
            + " | ".join(f"{r[k][0]:.2f} / {r[k][1]:.2f}" for k in keys)
            + f" | {r['covered'][0]}/{r['covered'][1]} | {r['done'][0]:.2f} / {r['done'][1]:.2f} |"
        )
    goal = [r for r in rows if r["case"].shape == "deepseek-v3" and r["case"].tokens in (4000, 4096)]
    worst = max(r["total"][0] for r in goal)
    print(
        f"goal: total p50 <= 1 ms for DeepSeek-V3 at 4k tokens (4096 and 4000): worst {worst:.2f} ms,",
        "met" if worst <= 1 else "NOT met",
    )
    rows, trips = trust_costs()
    print(
        "\nwhat the deployment's secret costs, us (p50): parameters signed on the prefill, checked "
        "with the prompt's digest on the decode scheduler (before blocks are allocated, off the "
        "pull); frames sealed and opened on every control message"
    )
    keys = [k for k in rows[0] if k != "what"]
    print("| request | " + " | ".join(keys) + " |")
    print("|---|" + "---:|" * len(keys))
    for r in rows:
        print(f"| {r['what']} | " + " | ".join(f"{r[k]:.1f}" for k in keys) + " |")
    extra = trips["sealed"] - trips["unsealed"]
    print(
        f"a Renew round trip on 127.0.0.1: unsealed {trips['unsealed']:.0f} us, sealed {trips['sealed']:.0f} us "
        f"({trips['sealed'] / trips['unsealed']:.2f}x, {extra:+.0f} us)"
    )
    worst = max(max(r["seal + open a done message"], r["check params"]) for r in rows)
    print(
        f"goal: signing off the pull's critical path or under 0.1 ms: the most on it {worst:.1f} us per "
        "message or check,",
        "met" if worst < 100 else "NOT met",
    )
    if args.concurrent:
        print(f"\n{args.concurrent} DeepSeek-V3 4k-token pulls at once, by pull threads (the worker has 4)")
        print("| threads | aggregate MiB/s | per-request p50 ms |")
        print("|---:|---:|---:|")
        for r in run_concurrency("deepseek-v3", 4096, args.concurrent, [1, 2, 4, 8]):
            print(f"| {r['threads']} | {r['mib_s']:.0f} | {r['p50_ms']:.0f} |")


def serving(args) -> None:
    ttft_rows, srows = serving_rows(args.prompts, args.max_tokens, args.ttft_lengths, args.ttft_repeats)
    base = SETUPS[0][0]
    print(f"\nTTFT, one request at a time, ms (median of {args.ttft_repeats}); overhead over {base}")
    print(
        "| prompt tokens | "
        + " | ".join(label for label, _ in SETUPS)
        + " | "
        + " | ".join(f"{label} overhead" for label, _ in SETUPS[1:])
        + " |"
    )
    print("|---:|" + "---:|" * (2 * len(SETUPS) - 1))
    for r in ttft_rows:
        cells = [f"{r[label]:.0f}" for label, _ in SETUPS]
        cells += [f"+{r[label] - r[base]:.0f} ({r[label] / r[base]:.2f}x)" for label, _ in SETUPS[1:]]
        print(f"| {r['tokens']} | " + " | ".join(cells) + " |")
    print(f"\n{args.prompts} concurrent streamed requests")
    print("| setup | requests | TTFT p50 ms | TTFT p99 ms | output tokens | tokens/s |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in srows:
        print(
            f"| {r['setup']} | {r['requests']} | {r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | {r['tokens']} "
            f"| {r['tokens_s']:.1f} |"
        )


def _name(row) -> str:
    c = row["case"]
    return f"{SHAPES[c.shape].name} {c.label} {c.tokens} tokens{' contiguous' if c.contiguous else ''}"


if __name__ == "__main__":
    main()
