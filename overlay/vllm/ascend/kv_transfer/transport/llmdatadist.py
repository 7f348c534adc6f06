"""The LLM-DataDist transport (``llm_datadist``, shipped with CANN; not on the package index).

Written against LLM-DataDist's public Python documentation and NPU-unverified: in CI it
runs against a contract double of the documented API (harness/doubles/llm_datadist_site). It
moves whole blocks only (``pull_blocks``), so it serves layouts whose reads are whole
blocks on both sides: the same block size, the same KV heads per rank and the same
context-parallel layout; other layouts are refused with the reason (use mooncake).

Each rank is one LLM-DataDist cluster. Its planes are registered as blocks caches, one
per plane size (``model_id`` = index of that size), with ``uint8`` blocks of
``block_bytes``; its address is ``ip:port#cluster_id``. A decode rank links to a
prefill rank on first use (``link_clusters``) and reads with ``pull_blocks``.
"""

from __future__ import annotations

import threading
import zlib

import numpy as np

from vllm.ascend.kv_transfer.transport.base import Region, TransferError, Transport


def _import():
    try:
        import llm_datadist
    except ImportError as e:
        raise RuntimeError(
            "the llmdatadist transport needs CANN's llm_datadist Python package (it ships with "
            f"CANN; source the CANN environment first), or use transport 'mooncake' ({e})"
        ) from None
    return llm_datadist


def _groups(regions: list[Region]) -> dict[int, list[Region]]:
    """Regions by block size, in first-seen order: one blocks cache (model_id) each."""
    groups: dict[int, list[Region]] = {}
    for region in regions:
        groups.setdefault(region.block_bytes, []).append(region)
    return groups


class LLMDataDistTransport(Transport):
    name = "llmdatadist"
    whole_blocks = True

    def __init__(self, host: str, options: dict):
        self._dd = _import()
        port = int(options["llmdatadist_port"])
        self._cluster_id = int(options.get("cluster_id", zlib.crc32(f"{host}:{port}".encode())))
        role = self._dd.LLMRole.PROMPT if options.get("role") == "prefill" else self._dd.LLMRole.DECODER
        config = self._dd.LLMConfig()
        config.device_id = int(options.get("device_id", 0))
        config.listen_ip_info = f"{host}:{port}"
        config.enable_cache_manager = True
        config.enable_remote_cache_accessible = True
        config.sync_kv_timeout = int(float(options.get("transfer_timeout", 30)) * 1000)
        self._datadist = self._dd.LLMDataDist(role, self._cluster_id)
        self._datadist.init(config.generate_options())
        self._host, self._port = host, port
        self._caches: dict[int, tuple] = {}  # block bytes -> (Cache, [Region])
        self._peers: dict[str, dict] = {}  # peer -> {"cluster": id, "groups": {block bytes: [Region]}}
        self._lock = threading.Lock()

    @property
    def address(self) -> str:
        return f"{self._host}:{self._port}#{self._cluster_id}"

    def register(self, regions: list[Region]) -> None:
        dd = self._dd
        for model_id, (block_bytes, group) in enumerate(_groups(regions).items()):
            blocks = {r.num_blocks for r in group}
            if len(blocks) != 1:
                raise RuntimeError(
                    f"llmdatadist needs every KV plane of one size to have the same block count, "
                    f"got {sorted(blocks)}"
                )
            desc = dd.CacheDesc(
                len(group), [blocks.pop(), block_bytes], dd.DataType.DT_UINT8, dd.Placement.DEVICE
            )
            cache = self._datadist.cache_manager.register_blocks_cache(
                desc, [r.base for r in group], dd.BlocksCacheKey(self._cluster_id, model_id)
            )
            self._caches[block_bytes] = (model_id, cache, group)

    def connect(self, peer: str, regions: list[Region]) -> None:
        with self._lock:
            if peer in self._peers:
                return
            location, _, cluster = peer.partition("#")
            ip, _, port = location.rpartition(":")
            info = self._dd.LLMClusterInfo()
            info.remote_cluster_id = int(cluster)
            info.append_local_ip_info(self._host, 0)
            info.append_remote_ip_info(ip, int(port))
            status, per_cluster = self._datadist.link_clusters([info], 10000)
            if status != self._dd.LLMStatusCode.LLM_SUCCESS:
                raise TransferError(f"llmdatadist link to {peer} failed: {status} {per_cluster}")
            self._peers[peer] = {"cluster": int(cluster), "groups": _groups(regions)}

    def read(self, peer: str, local: np.ndarray, remote: np.ndarray, lengths: np.ndarray) -> None:
        if len(lengths) == 0:
            return
        theirs = self._peers.get(peer)
        if theirs is None:
            raise TransferError(f"llmdatadist: read from {peer} before connect")
        if not np.isin(lengths, list(self._caches)).all():
            raise TransferError(
                "the llmdatadist transport moves whole blocks only: prefill and decode need the "
                "same block size, KV heads per rank and context-parallel layout (or use "
                "transport 'mooncake')"
            )
        for block_bytes, (model_id, cache, mine) in self._caches.items():
            pick = lengths == block_bytes
            pairs = self._block_pairs(local[pick], remote[pick], mine, theirs["groups"].get(block_bytes, []))
            if pairs is None:
                continue
            src, dst = pairs
            key = self._dd.BlocksCacheKey(theirs["cluster"], model_id)
            try:
                self._datadist.cache_manager.pull_blocks(key, cache, src, dst)
            except self._dd.LLMException as e:
                raise TransferError(
                    f"llmdatadist pull_blocks of {len(src)} blocks from {peer} failed: {e.status_code}"
                ) from None

    @staticmethod
    def _block_pairs(local, remote, mine: list[Region], theirs: list[Region]):
        """(source blocks, destination blocks) if the ranges are the same block pairs in every
        plane of the group, which is what one ``pull_blocks`` call moves."""
        if local.size == 0:
            return None
        if len(theirs) != len(mine):
            raise TransferError(
                f"the peer registered {len(theirs)} planes of this size, this rank {len(mine)}"
            )
        pairs: list[tuple[int, int]] | None = None
        for r_mine, r_theirs in zip(mine, theirs):
            here = (local >= r_mine.base) & (local < r_mine.base + r_mine.length)
            d, rd = divmod(local[here] - r_mine.base, r_mine.block_bytes)
            s, rs = divmod(remote[here] - r_theirs.base, r_theirs.block_bytes)
            if rd.any() or rs.any() or (s < 0).any() or (s >= r_theirs.num_blocks).any():
                raise TransferError("the llmdatadist transport moves whole, aligned blocks only")
            plane = sorted(zip(s.tolist(), d.tolist()))
            if pairs is None:
                pairs = plane
            elif plane != pairs:
                raise TransferError(
                    "llmdatadist pulls the same blocks of every layer; this read differs by layer"
                )
        if pairs is None:  # no plane (len(mine) == 0 with ranges to read)
            raise TransferError("the llmdatadist transport found no registered plane for this read")
        return [p[0] for p in pairs], [p[1] for p in pairs]

    def close(self) -> None:
        if self._datadist is not None:
            self._datadist.finalize()
            self._datadist = None
