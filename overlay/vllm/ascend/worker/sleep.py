"""Sleep mode on Ascend: device memory released by shrinking tensor storages, not by a
custom allocator.

Upstream's CUDA and XPU backends keep every address fixed by remapping physical memory
under a pluggable allocator compiled for the device. This distribution ships no compiled
allocator, so it works one level up: the storages behind the model's tensors and the KV
cache are resized to zero bytes (the device allocator gets the memory back) and grown
again on wake-up. Every tensor that views a storage -- tied weights, the attention
layers' cache views, plane views -- sees the memory again; only addresses change, which
nothing here keeps across steps (eager execution; the P/D connector, which registers
addresses, is refused with sleep mode by upstream's connector check).

Tags follow upstream: ``weights`` (every tensor a model module holds: parameters,
buffers and tensors derived at load time) and ``kv_cache``. Level 1 copies the weights
to host memory and discards the KV cache; level 2 discards the parameters too and
copies only what a weight reload does not bring back (buffers, derived tensors, and
parameters named by ``sleep_preserve_parameter_names``). Discarded memory comes back
zero-filled.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from vllm.device_allocator.sleep_mode_backend import SleepModeBackend

TAGS = ("weights", "kv_cache")


@dataclass
class _Storage:
    storage: torch.UntypedStorage
    nbytes: int
    tag: str
    host_copy: torch.Tensor | None = None
    asleep: bool = False


@dataclass
class SleepReport:
    """What the last sleep released, for logs and tests (bytes)."""

    level: int = 0
    released: dict[str, int] = field(default_factory=dict)  # per tag
    copied_to_host: int = 0
    device_in_use_before: int = 0
    device_in_use_after: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


def module_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor, bool]]:
    """(name, tensor, is_parameter) for every tensor the modules hold as a parameter,
    a buffer or a plain attribute (weights derived after loading live there)."""
    for prefix, module in model.named_modules():
        dot = f"{prefix}." if prefix else ""
        for name, param in module._parameters.items():
            if param is not None:
                yield dot + name, param, True
        for name, buf in module._buffers.items():
            if buf is not None:
                yield dot + name, buf, False
        for name, value in vars(module).items():
            if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
                yield dot + name, value, False


class StorageSleepBackend(SleepModeBackend):
    """Upstream's sleep-mode backend interface over the storages of one worker."""

    def __init__(self, device: torch.device, device_layer, pin_memory: bool) -> None:
        super().__init__()
        self.device = device
        self.device_layer = device_layer
        self.pin_memory = pin_memory
        self._storages: dict[int, _Storage] = {}  # by StorageImpl identity
        self.report = SleepReport()

    # -- what is tracked ------------------------------------------------------------
    def collect(
        self,
        models: Iterable[tuple[str, nn.Module]],
        kv_caches: Iterable[torch.Tensor],
        preserve_patterns: Iterable[str] = (),
    ) -> dict[int, bool]:
        """Re-read the tensors of this worker (a weight reload may have replaced some)
        and return, per storage, whether level 2 must keep a host copy of it."""
        patterns = list(preserve_patterns)
        keep: dict[int, bool] = {}
        # storages released earlier (a discarded KV cache) read as empty: keep them
        fresh = {key: entry for key, entry in self._storages.items() if entry.asleep}
        for tensor in kv_caches:  # first: attention layers also hold their cache views
            self._add(fresh, tensor, "kv_cache")
        for prefix, model in models:
            for name, tensor, is_param in module_tensors(model):
                key = self._add(fresh, tensor, "weights")
                if key is None or fresh[key].tag == "kv_cache":
                    continue
                full = prefix + name
                wanted = (not is_param) or any(fnmatch.fnmatchcase(full, p) for p in patterns)
                keep[key] = keep.get(key, False) or wanted
        self._storages = fresh
        return keep

    def _add(self, into: dict[int, _Storage], tensor: torch.Tensor, tag: str) -> int | None:
        if tensor.device != self.device or tensor.is_meta:
            return None
        storage = tensor.untyped_storage()
        nbytes = storage.nbytes()
        if nbytes == 0:
            return None
        key = storage._cdata
        if key not in into:
            if not storage.resizable():
                raise RuntimeError(
                    f"sleep mode cannot release a {tag} tensor of {nbytes} bytes: its storage is "
                    "not resizable (memory it does not own, such as a memory-mapped checkpoint)"
                )
            into[key] = _Storage(storage, nbytes, tag)
        return key

    def asleep_tags(self) -> set[str]:
        return {s.tag for s in self._storages.values() if s.asleep}

    # -- upstream's interface ---------------------------------------------------------
    def suspend(self, level: int = 1, keep: dict[int, bool] | None = None) -> None:
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, not {level}")
        keep = keep or {}
        report = SleepReport(level=level, released=dict.fromkeys(TAGS, 0))
        self.device_layer.synchronize()
        report.device_in_use_before = self.device_layer.memory_allocated()
        # Every host copy is made before anything is released: a copy that fails
        # (host memory) leaves the worker as it was.
        copies: dict[int, torch.Tensor] = {}
        for key, entry in self._storages.items():
            if entry.asleep or entry.tag != "weights":
                continue
            if level == 1 or keep.get(key, False):
                copies[key] = self._host_copy(entry)
        self.device_layer.synchronize()
        for key, entry in self._storages.items():
            if entry.asleep:
                continue
            entry.host_copy = copies.get(key)
            entry.storage.resize_(0)
            entry.asleep = True
            report.released[entry.tag] += entry.nbytes
        report.copied_to_host = sum(c.numel() for c in copies.values())
        self.device_layer.empty_cache()
        report.device_in_use_after = self.device_layer.memory_allocated()
        self.report = report
        self._state = "SUSPENDED"

    def resume(self, tags: list[str] | None = None) -> None:
        self._state = "RESUMING"
        for entry in self._storages.values():
            if entry.asleep and (tags is None or entry.tag in tags):
                self._restore(entry)
        self.device_layer.synchronize()
        self._state = "SUSPENDED" if self.asleep_tags() else "RUNNING"

    def discard(self, tags: tuple[str, ...]) -> None:
        for entry in self._storages.values():
            if entry.tag in tags and not entry.asleep:
                entry.storage.resize_(0)
                entry.host_copy = None
                entry.asleep = True
        self.device_layer.empty_cache()
        self._state = "SUSPENDED"

    # -- one storage ------------------------------------------------------------------
    def _host_copy(self, entry: _Storage) -> torch.Tensor:
        copy = torch.empty(entry.nbytes, dtype=torch.uint8, device="cpu", pin_memory=self.pin_memory)
        copy.untyped_storage().copy_(entry.storage)
        return copy

    def _restore(self, entry: _Storage) -> None:
        entry.storage.resize_(entry.nbytes)
        as_bytes = torch.empty(0, dtype=torch.uint8, device=self.device).set_(entry.storage)
        if entry.host_copy is None:
            as_bytes.zero_()
        else:
            as_bytes.copy_(entry.host_copy, non_blocking=False)
            entry.host_copy = None
        entry.asleep = False
