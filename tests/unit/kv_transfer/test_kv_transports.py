"""One conformance suite for every KV transport that can run here: Mooncake's
TransferEngine over TCP (real), and LLM-DataDist through its contract double
(harness/doubles/llm_datadist_site). The far end is a separate process, as on a cluster."""

from __future__ import annotations

import multiprocessing as mp
import socket
import sys
import time

import numpy as np
import pytest

from harness.doubles import LLM_DATADIST_SITE
from tests.unit.kv_transfer import kv_transport_peer as peer
from vllm.ascend.kv_transfer.transport import Region, TransferError, open_transport

DOUBLE = str(LLM_DATADIST_SITE)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _options(name: str, role: str, tmp_path) -> dict:
    if name == "mooncake":
        return {"transfer_timeout": 5}
    return {"llmdatadist_port": _port(), "role": role, "device_id": 0}


@pytest.fixture(params=["mooncake", "llmdatadist"])
def transport_name(request, monkeypatch, tmp_path):
    if request.param == "llmdatadist":
        monkeypatch.syspath_prepend(DOUBLE)
        monkeypatch.setenv("LLM_DATADIST_DOUBLE_DIR", str(tmp_path / "clusters"))
        sys.modules.pop("llm_datadist", None)
    return request.param


def _start_peer(name: str, kind: str, tmp_path):
    ctx = mp.get_context("spawn")
    out, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=peer.serve, args=(name, kind, _options(name, "prefill", tmp_path), out, stop))
    proc.start()
    address, regions = out.get(timeout=120)
    return proc, stop, address, [Region(*r) for r in regions]


def _block_ranges(mine: list[Region], theirs: list[Region], pairs: list[tuple[int, int]]):
    local, remote, lengths = [], [], []
    for m, t in zip(mine, theirs):
        for s, d in pairs:
            local.append(m.base + d * m.block_bytes)
            remote.append(t.base + s * t.block_bytes)
            lengths.append(m.block_bytes)
    return np.array(local, np.int64), np.array(remote, np.int64), np.array(lengths, np.int64)


@pytest.mark.parametrize("kind", ["equal", "unequal"])
def test_whole_blocks_arrive_intact_and_nothing_else_is_written(transport_name, kind, tmp_path):
    proc, stop, address, theirs = _start_peer(transport_name, kind, tmp_path)
    transport = open_transport(transport_name, "127.0.0.1", _options(transport_name, "decode", tmp_path))
    try:
        buffers, regions = peer.make_layers(kind, fill=False)
        mine = [Region(*r) for r in regions]
        transport.register(mine)
        transport.connect(address, theirs)
        pairs = [(3, 0), (5, 7), (0, 2)]
        transport.read(address, *_block_ranges(mine, theirs, pairs))
        sizes = peer.plane_sizes(kind)
        for layer, buf in enumerate(buffers):
            offset = 0
            for plane, block_bytes in enumerate(sizes):
                got = buf[offset : offset + peer.BLOCKS * block_bytes].reshape(peer.BLOCKS, block_bytes)
                want = peer.pattern(layer, plane, block_bytes).reshape(peer.BLOCKS, block_bytes)
                for s, d in pairs:
                    assert np.array_equal(got[d], want[s]), (layer, plane, s, d)
                untouched = [b for b in range(peer.BLOCKS) if b not in {d for _, d in pairs}]
                assert not got[untouched].any()
                offset += peer.BLOCKS * block_bytes
    finally:
        stop.set()
        proc.join(60)
        transport.close()


def test_byte_ranges_and_failures(transport_name, tmp_path):
    proc, stop, address, theirs = _start_peer(transport_name, "equal", tmp_path)
    transport = open_transport(transport_name, "127.0.0.1", _options(transport_name, "decode", tmp_path))
    try:
        buffers, regions = peer.make_layers("equal", fill=False)
        mine = [Region(*r) for r in regions]
        transport.register(mine)
        transport.connect(address, theirs)
        # a token run inside a block: 10 bytes from block 4 offset 17 to block 1 offset 40
        ranges = (
            np.array([mine[0].base + 256 + 40], np.int64),
            np.array([theirs[0].base + 4 * 256 + 17], np.int64),
            np.array([10], np.int64),
        )
        if transport.whole_blocks:
            with pytest.raises(TransferError, match="whole blocks"):
                transport.read(address, *ranges)
        else:
            transport.read(address, *ranges)
            want = peer.pattern(0, 0, 256)[4 * 256 + 17 : 4 * 256 + 27]
            assert np.array_equal(buffers[0][256 + 40 : 256 + 50], want)
        # the peer dies: the read fails with a TransferError instead of hanging
        stop.set()
        proc.join(60)
        start = time.monotonic()
        with pytest.raises(TransferError):
            transport.read(address, *_block_ranges(mine, theirs, [(1, 1)]))
        assert time.monotonic() - start < 30
    finally:
        stop.set()
        proc.join(60)
        transport.close()


def test_a_mooncake_read_of_more_slices_than_the_engine_queues_arrives_whole(tmp_path):
    """Mooncake's TCP lanes queue about 2,048 slices per peer and fail a batch beyond that;
    the transport submits a read in chunks of at most ``batch_slices`` slices."""
    proc, stop, address, theirs = _start_peer("mooncake", "equal", tmp_path)
    transport = open_transport("mooncake", "127.0.0.1", {"transfer_timeout": 5, "batch_slices": 512})
    try:
        buffers, regions = peer.make_layers("equal", fill=False)
        mine = [Region(*r) for r in regions]
        transport.register(mine)
        transport.connect(address, theirs)
        # 2 bytes each (a slice each): every 2 bytes of this rank's planes from the peer's
        # plane at a rotating offset
        local, remote = [], []
        for m, t in zip(mine, theirs):
            for i in range(m.length // 2):
                local.append(m.base + 2 * i)
                remote.append(t.base + (2 * i * 7) % (t.length - 2))
        lengths = np.full(len(local), 2, np.int64)
        assert len(lengths) > 3000
        parts = transport.chunks(lengths)
        assert [p.stop - p.start for p in parts[:-1]] == [512] * (len(parts) - 1)
        assert parts[-1].stop == len(lengths) and len(parts) == -(-len(lengths) // 512)
        args = (address, np.array(local, np.int64), np.array(remote, np.int64), lengths)
        transport.read(*args)
        sources = [peer.pattern(layer, plane, 256) for layer in range(peer.LAYERS) for plane in range(2)]
        flat = [b for buf in buffers for b in [buf[: buf.size // 2], buf[buf.size // 2 :]]]
        for got, want in zip(flat, sources):
            for i in range(0, got.size, 2):
                j = (i * 7) % (want.size - 2)
                assert np.array_equal(got[i : i + 2], want[j : j + 2]), i
        # the premise, last (an overflow leaves the engine's lane to the peer unusable for a
        # while): as one submission, the engine refuses the same read
        transport._batch_slices = 1 << 20
        with pytest.raises(TransferError):
            transport.read(*args)
    finally:
        stop.set()
        proc.join(60)
        transport.close()


def test_chunks_count_a_large_range_as_its_slices():
    from vllm.ascend.kv_transfer.transport.mooncake import MooncakeTransport

    transport = MooncakeTransport.__new__(MooncakeTransport)  # the cutting only: no engine
    transport._slice_bytes, transport._batch_slices = 65536, 1024
    lengths = np.array([1 << 20] * 100 + [16 << 10] * 10 + [300 << 20])  # 16 slices each, 1 each, 4800
    parts = transport.chunks(lengths)
    assert [(p.start, p.stop) for p in parts] == [(0, 64), (64, 110), (110, 111)]
