"""P/D KV transfer benchmark (``nox -s bench -- kv-transfer``), in one run:

1. Pull throughput. A peer process owns a KV cache in the Ascend layout (K and V planes
   per layer) registered with the Mooncake TransferEngine over TCP. For the same blocks
   (shuffled block ids on both sides, as a running server has them) this process reads
   them twice: raw, one ``batch_transfer_sync_read`` of one range per block and plane;
   and the connector's way, what a decode rank runs per request: ``build_plan``, byte
   addressing (``addressing.read_ranges``) and ``MooncakeTransport.read``. Blocks of
   1 MiB and 64 KiB. Goal: connector >= 90 % of raw.
2. Control-plane overhead per request, p50/p99: planning, addressing and the done
   message's round trip to a real ``ControlServer`` (a request's KV reads excluded).
   Goal: p50 <= 2 ms.
3. Serving: TTFT and output tokens/s of 1P1D (tiny Qwen2, prefill and decode instances
   with AscendP2PConnector behind the proxy) vs. one colocated instance, the same
   concurrent streamed requests (recorded; host emulation, so these numbers track the
   connector's cost, not NPU performance).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
BLOCK_TOKENS = 128
LAYERS = 4
TOTAL_MIB = 128  # bytes per pulled request, both block sizes


def _layout(block_bytes: int, num_blocks: int):
    from vllm.ascend.attention.kv_layout import LayerLayout

    head_size = block_bytes // (BLOCK_TOKENS * 2)  # one KV head, fp16: one plane block = block_bytes
    return LayerLayout.gqa(num_blocks, 1, BLOCK_TOKENS, head_size, head_size, 2)


def _cache(block_bytes: int, num_blocks: int, fill: bool):
    layout = _layout(block_bytes, num_blocks)
    buffers = [
        np.full(layout.total_bytes, layer + 1 if fill else 0, dtype=np.uint8) for layer in range(LAYERS)
    ]
    layers = {f"layer.{i}": (buf.ctypes.data, layout) for i, buf in enumerate(buffers)}
    return buffers, layers


def prefill_peer(block_bytes: int, num_blocks: int, control_port: int, out, stop) -> None:
    """The prefill side: a registered cache and a control server that counts done reads."""
    os.environ.setdefault("VLLM_ASCEND_EMULATE", "1")
    from vllm.ascend.kv_transfer import wire
    from vllm.ascend.kv_transfer.addressing import layer_regions, plane_regions
    from vllm.ascend.kv_transfer.control import ControlServer
    from vllm.ascend.kv_transfer.holds import Holds
    from vllm.ascend.kv_transfer.transport import open_transport

    buffers, layers = _cache(block_bytes, num_blocks, fill=True)
    transport = open_transport("mooncake", "127.0.0.1", {})
    transport.register(plane_regions(layer_regions(layers)))
    holds = Holds(30.0)

    def handle(message):
        if isinstance(message, wire.DoneReading):
            holds.hold(message.request_id, 30.0)
            holds.done(message.request_id, message.read_ids, message.reads_total)
            holds.take_finished()
        return wire.Reply(wire.WIRE_VERSION, True)

    server = ControlServer("127.0.0.1", control_port, handle)
    out.put(
        (
            transport.address,
            [
                (r.name, r.base, r.num_blocks, [(p.heads, p.head_bytes) for p in r.planes])
                for r in layer_regions(layers)
            ],
        )
    )
    stop.wait(600)
    server.close()
    transport.close()
    del buffers


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pct(values, q):
    return float(np.percentile(np.asarray(values), q))


def transfer_rows(block_sizes: list[int], repeats: int) -> tuple[list[dict], dict]:
    from vllm.ascend.context_parallel.placement import CPLayout
    from vllm.ascend.kv_transfer import wire
    from vllm.ascend.kv_transfer.addressing import layer_regions, plane_regions, plane_table, read_ranges
    from vllm.ascend.kv_transfer.control import ControlClient
    from vllm.ascend.kv_transfer.plan import build_plan
    from vllm.ascend.kv_transfer.transport import open_transport

    rows, overhead = [], {}
    rng = np.random.default_rng(0)
    ctx = mp.get_context("spawn")
    for block_bytes in block_sizes:
        blocks = TOTAL_MIB * 2**20 // (block_bytes * 2 * LAYERS)  # K and V planes per layer
        num_blocks = 2 * blocks + 8
        port = _free_port()
        out, stop = ctx.Queue(), ctx.Event()
        peer = ctx.Process(target=prefill_peer, args=(block_bytes, num_blocks, port, out, stop), daemon=True)
        peer.start()
        try:
            address, raw_layers = out.get(timeout=120)
            theirs = [
                wire.LayerRegion(n, b, nb, [wire.PlaneSpec(h, hb) for h, hb in planes])
                for n, b, nb, planes in raw_layers
            ]
            buffers, mine = _cache(block_bytes, num_blocks, fill=False)
            transport = open_transport("mooncake", "127.0.0.1", {})
            transport.register(plane_regions(layer_regions(mine)))
            transport.connect(address, plane_regions(theirs))
            src, dst = plane_table(mine, theirs)
            layout = CPLayout(tp=1, kv_heads=1, block_size=BLOCK_TOKENS)
            client = ControlClient(5.0)
            raw_s, conn_s, plan_ms, addr_ms, done_ms = [], [], [], [], []
            for rep in range(repeats + 1):  # the first round warms the connection up
                src_ids = rng.permutation(num_blocks)[:blocks].tolist()
                dst_ids = rng.permutation(num_blocks)[:blocks].tolist()
                # raw: one range per (layer, plane, block), straight from the block ids
                local, remote, lengths = [], [], []
                for (s_base, s_block, _), (d_base, d_block, _) in zip(src, dst):
                    for s, d in zip(src_ids, dst_ids):
                        remote.append(s_base + s * s_block)
                        local.append(d_base + d * d_block)
                        lengths.append(s_block)
                engine = transport._engine  # the TransferEngine itself, as a raw caller uses it
                t0 = time.perf_counter()
                rc = engine.batch_transfer_sync_read(address, local, remote, lengths)
                t_raw = time.perf_counter() - t0
                assert rc == 0, rc
                for buf in buffers:
                    buf[:] = 0
                # the connector's pull of the same blocks
                t0 = time.perf_counter()
                plan = build_plan(layout, layout, blocks * BLOCK_TOKENS, src_ids, dst_ids)
                t1 = time.perf_counter()
                ids = plan.read_ids_of(0)
                loc, rem, lens = read_ranges(plan, ids, src, dst, 0, 0, (BLOCK_TOKENS, BLOCK_TOKENS))
                t2 = time.perf_counter()
                transport.read(address, loc, rem, lens)
                t3 = time.perf_counter()
                [done] = wire.done_messages(plan, f"req-{block_bytes}-{rep}", frozenset())
                reply = client.request(f"127.0.0.1:{port}", done)
                t4 = time.perf_counter()
                assert isinstance(reply, wire.Reply) and reply.ok, reply
                for layer, buf in enumerate(buffers):  # the blocks arrived
                    assert int(buf.sum()) == (layer + 1) * 2 * blocks * block_bytes, "pull incomplete"
                    buf[:] = 0
                if rep == 0:
                    continue
                raw_s.append(t_raw)
                conn_s.append(t3 - t0)
                plan_ms.append((t1 - t0) * 1e3)
                addr_ms.append((t2 - t1) * 1e3)
                done_ms.append((t4 - t3) * 1e3)
            mib = TOTAL_MIB
            raw_tp, conn_tp = mib / statistics.median(raw_s), mib / statistics.median(conn_s)
            rows.append(
                {
                    "block": f"{block_bytes // 1024} KiB",
                    "ranges": len(lengths),
                    "mib": mib,
                    "raw_mib_s": raw_tp,
                    "connector_mib_s": conn_tp,
                    "ratio": conn_tp / raw_tp,
                }
            )
            total = [p + a + d for p, a, d in zip(plan_ms, addr_ms, done_ms)]
            overhead[f"{block_bytes // 1024} KiB"] = {
                "plan": (_pct(plan_ms, 50), _pct(plan_ms, 99)),
                "addressing": (_pct(addr_ms, 50), _pct(addr_ms, 99)),
                "done round trip": (_pct(done_ms, 50), _pct(done_ms, 99)),
                "total": (_pct(total, 50), _pct(total, 99)),
            }
            transport.close()
            del buffers
        finally:
            stop.set()
            peer.join(30)
            if peer.is_alive():
                peer.kill()
    return rows, overhead


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
        "512",
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
    url: str, model: Path, prompts: list[str], max_tokens: int
) -> tuple[list[float], int, float]:
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


def serving_rows(num_prompts: int, max_tokens: int) -> list[dict]:
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
            ],
            check=True,
            capture_output=True,
        )
        ports = {name: _free_port() for name in ("colocated", "prefill", "decode", "proxy")}
        kv = {name: _free_port() for name in ("prefill", "decode")}
        procs = {"colocated": _server(model, ports["colocated"], None, tmp / "colocated.log")}
        for name, role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
            config = {"kv_connector": "AscendP2PConnector", "kv_role": role, "kv_port": kv[name]}
            procs[name] = _server(model, ports[name], config, tmp / f"{name}.log")
        procs["proxy"] = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "vllm.ascend.kv_transfer.proxy",
                "--prefill",
                f"http://127.0.0.1:{ports['prefill']}",
                "--decode",
                f"http://127.0.0.1:{ports['decode']}",
                "--port",
                str(ports["proxy"]),
            ],
            stdout=open(tmp / "proxy.log", "w"),  # noqa: SIM115  (the proxy writes it until it stops)
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            print("serving: starting a colocated instance, a 1P1D pair and the proxy ...", flush=True)
            for name in ("colocated", "prefill", "decode", "proxy"):
                _wait(f"http://127.0.0.1:{ports[name]}", procs[name], tmp / f"{name}.log")
            prompts = [
                f"Request {i}: " + "paged attention keeps keys and values in blocks " * (2 + i % 6)
                for i in range(num_prompts)
            ]
            rows = []
            for label, name in (("colocated", "colocated"), ("1P1D via proxy", "proxy")):
                url = f"http://127.0.0.1:{ports[name]}"
                asyncio.run(_stream_all(url, model, prompts[:2], 4))  # warm-up
                ttfts, tokens, elapsed = asyncio.run(_stream_all(url, model, prompts, max_tokens))
                rows.append(
                    {
                        "setup": label,
                        "requests": num_prompts,
                        "ttft_p50_ms": _pct(ttfts, 50) * 1e3,
                        "ttft_p99_ms": _pct(ttfts, 99) * 1e3,
                        "tokens": tokens,
                        "tokens_s": tokens / elapsed,
                    }
                )
            return rows
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
    p.add_argument("--repeats", type=int, default=10, help="pulls per block size (after one warm-up)")
    p.add_argument("--prompts", type=int, default=16, help="concurrent requests in the serving part")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--skip-serving", action="store_true")
    args = p.parse_args()
    print(
        f"pull throughput: {TOTAL_MIB} MiB per request over Mooncake TCP on 127.0.0.1, {args.repeats} pulls "
        "per block size (median) ...",
        flush=True,
    )
    rows, overhead = transfer_rows([1 << 20, 64 << 10], args.repeats)
    print("\n| block | ranges | MiB | raw MiB/s | connector MiB/s | connector / raw |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['block']} | {r['ranges']} | {r['mib']} | {r['raw_mib_s']:.0f} | {r['connector_mib_s']:.0f} "
            f"| {r['ratio']:.2f} |"
        )
    print("goal: connector >= 0.90 of raw:", "met" if all(r["ratio"] >= 0.9 for r in rows) else "NOT met")
    print("\ncontrol-plane overhead per request, ms (p50 / p99)")
    print("| block | plan | addressing | done round trip | total |")
    print("|---|---:|---:|---:|---:|")
    for block, parts in overhead.items():
        print(
            f"| {block} | "
            + " | ".join(
                f"{parts[k][0]:.2f} / {parts[k][1]:.2f}"
                for k in ("plan", "addressing", "done round trip", "total")
            )
            + " |"
        )
    print(
        "goal: total p50 <= 2 ms:", "met" if all(p["total"][0] <= 2 for p in overhead.values()) else "NOT met"
    )
    if args.skip_serving:
        return
    srows = serving_rows(args.prompts, args.max_tokens)
    print("\n| setup | requests | TTFT p50 ms | TTFT p99 ms | output tokens | tokens/s |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in srows:
        print(
            f"| {r['setup']} | {r['requests']} | {r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | {r['tokens']} "
            f"| {r['tokens_s']:.1f} |"
        )
    print(
        f"1P1D / colocated tokens/s: {srows[1]['tokens_s'] / srows[0]['tokens_s']:.2f}; "
        f"TTFT p50 ratio: {srows[1]['ttft_p50_ms'] / srows[0]['ttft_p50_ms']:.2f}"
    )


if __name__ == "__main__":
    main()
