"""Contract double of CANN's ``llm_datadist`` (the subset the llmdatadist transport uses).

Test code, never shipped. Built from LLM-DataDist's public Python documentation
(hicann/hixl docs/zh/api/python): the same names, signatures and documented rules, so
code that passes here calls the library the documented way. What it checks:

* ``LLMDataDist(role, cluster_id)`` with an ``LLMRole`` and a uint64 id (TypeError/ValueError
  otherwise); one initialised instance per process (LLMException LLM_FAILED);
  ``init(options)`` needs ``ge.exec.deviceId`` and the cache manager enabled;
* ``LLMConfig`` properties and ``generate_options()``; ``listen_ip_info`` is ``"ip:port"``;
* ``cache_manager`` only after ``init``; ``register_blocks_cache(CacheDesc, addrs,
  BlocksCacheKey)`` needs non-empty addresses, one per tensor, before any link;
* ``link_clusters([LLMClusterInfo], timeout)`` returns ``(status, [per cluster])`` and does
  not raise; a cluster that is not listening gives ``LLM_LINK_FAILED``;
* ``pull_blocks(BlocksCacheKey, Cache, src_blocks, dst_blocks)``: a blocks cache, non-empty
  and equally long block lists (LLM_PARAM_INVALID), not from its own cluster, only from
  a linked cluster (LLM_NOT_YET_LINK), block indices inside both caches; it copies every
  tensor's blocks.

Clusters find each other through a directory (``LLM_DATADIST_DOUBLE_DIR``); a pull reads
the peer process's memory with ``process_vm_readv`` (Linux; the reader must be allowed to
trace the peer, e.g. its parent), so the two ends can be separate processes as on NPUs.
"""

from __future__ import annotations

import ctypes
import enum
import json
import os
import socket
from pathlib import Path

_libc = ctypes.CDLL(None, use_errno=True)


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


class LLMRole(enum.Enum):
    PROMPT = 1
    DECODER = 2
    MIX = 3


class Placement(enum.Enum):
    HOST = 0
    DEVICE = 1


class DataType(enum.Enum):  # the library takes the values from its native module: never hard-code them
    DT_FLOAT = enum.auto()
    DT_FLOAT16 = enum.auto()
    DT_BF16 = enum.auto()
    DT_INT8 = enum.auto()
    DT_UINT8 = enum.auto()
    DT_INT32 = enum.auto()

    @property
    def size(self) -> int:
        return {"DT_FLOAT": 4, "DT_FLOAT16": 2, "DT_BF16": 2, "DT_INT8": 1, "DT_UINT8": 1, "DT_INT32": 4}[
            self.name
        ]


class LLMStatusCode(enum.Enum):
    LLM_SUCCESS = 0
    LLM_FAILED = 1
    LLM_PARAM_INVALID = 5
    LLM_NOT_YET_LINK = 7
    LLM_ALREADY_LINK = 8
    LLM_LINK_FAILED = 9
    LLM_TIMEOUT = 26


class LLMException(RuntimeError):
    def __init__(self, *args, status_code: LLMStatusCode = LLMStatusCode.LLM_SUCCESS):
        super().__init__(*args)
        self._status_code = status_code

    @property
    def status_code(self) -> LLMStatusCode:
        return self._status_code


def _uint(value, bits: int, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be int, got {type(value).__name__}")
    if not 0 <= value < 1 << bits:
        raise ValueError(f"{name} must be uint{bits}, got {value}")
    return value


def _registry() -> Path:
    path = Path(os.environ.get("LLM_DATADIST_DOUBLE_DIR", "/tmp/llm_datadist_double"))
    path.mkdir(parents=True, exist_ok=True)
    return path


class LLMConfig:
    def __init__(self):
        self.device_id = 0
        self.sync_kv_timeout = 1000
        self.listen_ip_info = None
        self.enable_cache_manager = False
        self.enable_remote_cache_accessible = False

    def __setattr__(self, name, value):
        if name == "listen_ip_info" and value is not None:
            ip, sep, port = str(value).rpartition(":")
            if not sep or not port.isdigit():
                raise ValueError(f"listen_ip_info must be 'ip:port', got {value!r}")
        if name == "sync_kv_timeout" and (not isinstance(value, int) or value <= 0):
            raise ValueError(f"sync_kv_timeout must be a positive int (ms), got {value!r}")
        if name in ("enable_cache_manager", "enable_remote_cache_accessible") and not isinstance(value, bool):
            raise TypeError(f"{name} must be bool")
        object.__setattr__(self, name, value)

    def generate_options(self) -> dict:
        options = {
            "ge.exec.deviceId": str(self.device_id),
            "llm.SyncKvCacheWaitTime": str(self.sync_kv_timeout),
            "llm.EnableCacheManager": "1" if self.enable_cache_manager else "0",
            "llm.EnableRemoteCacheAccessible": "1" if self.enable_remote_cache_accessible else "0",
        }
        if self.listen_ip_info:
            options["llm.listenIpInfo"] = self.listen_ip_info
        return options


class CacheDesc:
    def __init__(self, num_tensors: int, shape, data_type: DataType, placement: Placement = Placement.DEVICE):
        self.num_tensors = _uint(num_tensors, 32, "num_tensors")
        if not isinstance(shape, (list, tuple)) or not shape:
            raise TypeError("shape must be a non-empty list or tuple of int")
        if not isinstance(data_type, DataType) or not isinstance(placement, Placement):
            raise TypeError("data_type must be a DataType and placement a Placement")
        self.shape, self.data_type, self.placement = list(shape), data_type, placement

    @property
    def block_bytes(self) -> int:
        n = self.data_type.size
        for dim in self.shape[1:]:
            n *= dim
        return n


class BlocksCacheKey:
    def __init__(self, cluster_id: int, model_id: int = 0):
        self.cluster_id = _uint(cluster_id, 64, "cluster_id")
        self.model_id = _uint(model_id, 64, "model_id")


class Cache:
    def __init__(self, cache_id: int, desc: CacheDesc, addrs: list[int]):
        self.cache_id, self.cache_desc, self.tensor_addrs, self.is_blocks_cache = cache_id, desc, addrs, True


class LLMClusterInfo:
    def __init__(self):
        self.remote_cluster_id = None
        self.local_ip_info_list: list = []
        self.remote_ip_info_list: list = []

    def append_local_ip_info(self, ip, port: int) -> None:
        self.local_ip_info_list.append((str(ip), _uint(port, 16, "port")))

    def append_remote_ip_info(self, ip, port: int) -> None:
        self.remote_ip_info_list.append((str(ip), _uint(port, 16, "port")))


_initialised: list = []


class _CacheManager:
    def __init__(self, owner: LLMDataDist):
        self._owner = owner

    def register_blocks_cache(self, cache_desc: CacheDesc, addrs, blocks_cache_key: BlocksCacheKey = None):
        owner = self._owner
        if not isinstance(cache_desc, CacheDesc) or not isinstance(addrs, (list, tuple)):
            raise TypeError(
                "register_blocks_cache(cache_desc: CacheDesc, addrs: list[int], blocks_cache_key)"
            )
        if not addrs:
            raise LLMException("addrs must not be empty", status_code=LLMStatusCode.LLM_PARAM_INVALID)
        if len(addrs) != cache_desc.num_tensors or not all(isinstance(a, int) and a > 0 for a in addrs):
            raise LLMException("one non-zero address per tensor", status_code=LLMStatusCode.LLM_PARAM_INVALID)
        if owner._linked:
            raise LLMException(
                "you can not register remote accessible cache after link",
                status_code=LLMStatusCode.LLM_FAILED,
            )
        key = blocks_cache_key or BlocksCacheKey(owner.cluster_id)
        cache = Cache(len(owner._caches), cache_desc, list(addrs))
        owner._caches[key.model_id] = cache
        owner._publish()
        return cache

    def pull_blocks(
        self, src_cache_key: BlocksCacheKey, dst_cache: Cache, src_blocks=(), dst_blocks=(), **kwargs
    ):
        owner = self._owner
        if not isinstance(src_cache_key, BlocksCacheKey) or not isinstance(dst_cache, Cache):
            raise TypeError(
                "pull_blocks(src_cache_key: BlocksCacheKey, dst_cache: Cache, src_blocks, dst_blocks)"
            )
        if not dst_cache.is_blocks_cache or not dst_blocks or not src_blocks:
            raise LLMException(
                "dst_cache must be a blocks cache and the block lists non-empty",
                status_code=LLMStatusCode.LLM_PARAM_INVALID,
            )
        if len(src_blocks) != len(dst_blocks):
            raise LLMException(
                "src_blocks and dst_blocks differ in length", status_code=LLMStatusCode.LLM_PARAM_INVALID
            )
        if src_cache_key.cluster_id == owner.cluster_id:
            raise LLMException(
                "cannot pull from its own cluster", status_code=LLMStatusCode.LLM_PARAM_INVALID
            )
        if src_cache_key.cluster_id not in owner._linked:
            raise LLMException("not linked", status_code=LLMStatusCode.LLM_NOT_YET_LINK)
        peer = _read_peer(src_cache_key.cluster_id)
        remote = peer["caches"].get(str(src_cache_key.model_id)) if peer else None
        if remote is None:
            raise LLMException("the peer has no such cache", status_code=LLMStatusCode.LLM_FAILED)
        desc = dst_cache.cache_desc
        block, blocks = desc.block_bytes, desc.shape[0]
        if remote["block_bytes"] != block or len(remote["addrs"]) != len(dst_cache.tensor_addrs):
            raise LLMException("caches differ in shape", status_code=LLMStatusCode.LLM_PARAM_INVALID)
        for s, d in zip(src_blocks, dst_blocks):
            if not (0 <= s < remote["blocks"] and 0 <= d < blocks):
                raise LLMException(
                    f"block {s}->{d} out of range", status_code=LLMStatusCode.LLM_PARAM_INVALID
                )
        for src_base, dst_base in zip(remote["addrs"], dst_cache.tensor_addrs):
            for s, d in zip(src_blocks, dst_blocks):
                _copy_from(peer["pid"], src_base + s * block, dst_base + d * block, block)


def _copy_from(pid: int, remote: int, local: int, length: int) -> None:
    if pid == os.getpid():
        ctypes.memmove(local, remote, length)
        return
    here, there = _IoVec(local, length), _IoVec(remote, length)
    got = _libc.process_vm_readv(pid, ctypes.byref(here), 1, ctypes.byref(there), 1, 0)
    if got != length:
        raise LLMException(
            f"transfer failed (errno {ctypes.get_errno()})", status_code=LLMStatusCode.LLM_TIMEOUT
        )


def _read_peer(cluster_id: int):
    path = _registry() / f"{cluster_id}.json"
    try:
        peer = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    try:
        os.kill(peer["pid"], 0)
    except ProcessLookupError:
        return None
    return peer


class LLMDataDist:
    def __init__(self, role: LLMRole, cluster_id: int):
        if not isinstance(role, LLMRole):
            raise TypeError("role must be an LLMRole")
        self.role, self._cluster_id = role, _uint(cluster_id, 64, "cluster_id")
        self._options = None
        self._caches: dict[int, Cache] = {}
        self._linked: set[int] = set()
        self._listener = None

    @property
    def cluster_id(self) -> int:
        return self._cluster_id

    def init(self, options: dict) -> None:
        if self._options is not None:
            return
        if not isinstance(options, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in options.items()
        ):
            raise TypeError("options must be Dict[str, str]")
        if "ge.exec.deviceId" not in options or options.get("llm.EnableCacheManager") != "1":
            raise LLMException(
                "device_id and enable_cache_manager are required", status_code=LLMStatusCode.LLM_PARAM_INVALID
            )
        if _initialised:
            raise LLMException("Cannot init multiple LLMDataDists", status_code=LLMStatusCode.LLM_FAILED)
        self._options = dict(options)
        if "llm.listenIpInfo" in options:  # a real listening socket, as the library's link server
            ip, _, port = options["llm.listenIpInfo"].rpartition(":")
            self._listener = socket.create_server((ip, int(port)))
        _initialised.append(self)
        self._publish()

    def _publish(self) -> None:
        data = {
            "pid": os.getpid(),
            "listen": self._options.get("llm.listenIpInfo") if self._options else None,
            "caches": {
                str(m): {
                    "addrs": c.tensor_addrs,
                    "block_bytes": c.cache_desc.block_bytes,
                    "blocks": c.cache_desc.shape[0],
                }
                for m, c in self._caches.items()
            },
        }
        (_registry() / f"{self._cluster_id}.json").write_text(json.dumps(data))

    @property
    def cache_manager(self) -> _CacheManager:
        if self._options is None:
            raise RuntimeError("llm datadist is not initialized")
        return _CacheManager(self)

    def link_clusters(self, clusters, timeout: int = 3000):
        if self._options is None:
            raise RuntimeError("llm datadist is not initialized")
        if not isinstance(clusters, (list, tuple)) or not isinstance(timeout, int) or timeout <= 0:
            raise TypeError("link_clusters(clusters: list[LLMClusterInfo], timeout: int > 0)")
        results = []
        for info in clusters:
            peer = _read_peer(info.remote_cluster_id)
            want = (
                f"{info.remote_ip_info_list[0][0]}:{info.remote_ip_info_list[0][1]}"
                if info.remote_ip_info_list
                else None
            )
            if peer is None or peer["listen"] != want:
                results.append(LLMStatusCode.LLM_LINK_FAILED)
            else:
                self._linked.add(info.remote_cluster_id)
                results.append(LLMStatusCode.LLM_SUCCESS)
        ok = all(r == LLMStatusCode.LLM_SUCCESS for r in results)
        return (LLMStatusCode.LLM_SUCCESS if ok else LLMStatusCode.LLM_LINK_FAILED), results

    def finalize(self) -> None:
        if self in _initialised:
            _initialised.remove(self)
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        (_registry() / f"{self._cluster_id}.json").unlink(missing_ok=True)
        self._options = None
