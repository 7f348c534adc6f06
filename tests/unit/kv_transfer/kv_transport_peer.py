"""The far end of the transport conformance tests: a process that owns KV planes filled
with a known pattern and serves them through a transport (run by multiprocessing)."""

from __future__ import annotations

import numpy as np

LAYERS = 2
BLOCKS = 8


def plane_sizes(kind: str) -> list[int]:
    """Block bytes of each plane of a layer: GQA-like K and V, or MLA-like latent and rope."""
    return [256, 256] if kind == "equal" else [512, 64]


def pattern(layer: int, plane: int, block_bytes: int) -> np.ndarray:
    n = BLOCKS * block_bytes
    return ((np.arange(n) + layer * 31 + plane * 7) % 251).astype(np.uint8)


def make_layers(kind: str, fill: bool) -> tuple[list[np.ndarray], list[tuple[int, int, int]]]:
    """One contiguous buffer per layer, planes one after another (as the Ascend KV layout)."""
    buffers, regions = [], []
    for layer in range(LAYERS):
        sizes = plane_sizes(kind)
        buf = np.zeros(BLOCKS * sum(sizes), dtype=np.uint8)
        offset = 0
        for plane, block_bytes in enumerate(sizes):
            if fill:
                buf[offset : offset + BLOCKS * block_bytes] = pattern(layer, plane, block_bytes)
            regions.append((buf.ctypes.data + offset, BLOCKS, block_bytes))
            offset += BLOCKS * block_bytes
        buffers.append(buf)
    return buffers, regions


def serve(name: str, kind: str, options: dict, out, stop) -> None:
    from vllm.ascend.kv_transfer.transport import Region, open_transport

    buffers, regions = make_layers(kind, fill=True)
    transport = open_transport(name, "127.0.0.1", options)
    transport.register([Region(*r) for r in regions])
    out.put((transport.address, regions))
    stop.wait(120)
    transport.close()
    del buffers
