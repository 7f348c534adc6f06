"""The storage-level sleep backend (worker/sleep.py) on a small module with what real
models have: tied weights, a buffer, a tensor derived after loading (a view of a
parameter and one of its own), and a KV cache that the attention layer also holds as a
view. The oracle is a deep copy of every tensor taken before the sleep."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vllm.ascend.device.host import HostDevice
from vllm.ascend.worker.sleep import StorageSleepBackend, module_tensors


class _Layer(nn.Module):
    def __init__(self, kv_cache: torch.Tensor) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8, bias=True)
        self.register_buffer("table", torch.arange(16, dtype=torch.float32))
        self.kv_cache = kv_cache[0]  # the attention layer's view of the cache
        self.weight_t = self.proj.weight.t()  # derived view (shares the parameter's storage)
        self.absorbed = self.proj.weight @ self.proj.weight  # derived tensor of its own


class _Model(nn.Module):
    def __init__(self, kv_cache: torch.Tensor) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.layer = _Layer(kv_cache)
        self.head = nn.Linear(8, 32, bias=False)
        self.head.weight = self.embed.weight  # tied


def _setup():
    torch.manual_seed(0)
    kv = torch.randn(2, 4, 16)
    model = _Model(kv)
    backend = StorageSleepBackend(torch.device("cpu"), HostDevice(), pin_memory=False)
    before = {name: t.clone() for name, t, _ in module_tensors(model)} | {"kv": kv.clone()}
    return model, kv, backend, before


def _now(model, kv):
    return {name: t for name, t, _ in module_tensors(model)} | {"kv": kv}


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors)


def test_level1_restores_every_tensor_and_releases_each_storage_once():
    model, kv, backend, before = _setup()
    weights = _nbytes(
        model.embed.weight,
        model.layer.proj.weight,
        model.layer.proj.bias,
        model.layer.table,
        model.layer.absorbed,
    )
    kv_bytes = _nbytes(kv)
    backend.suspend(1, backend.collect([("", model)], [kv]))
    assert backend.report.released == {"weights": weights, "kv_cache": kv_bytes}  # tied and views once
    assert backend.report.copied_to_host == weights
    assert kv.untyped_storage().nbytes() == 0 and model.embed.weight.untyped_storage().nbytes() == 0
    assert backend.asleep_tags() == {"weights", "kv_cache"}
    backend.resume(None)
    now = _now(model, kv)
    for name, value in before.items():
        if name in ("kv", "layer.kv_cache"):
            assert torch.count_nonzero(now[name]) == 0, name  # discarded: zero-filled
        else:
            assert torch.equal(now[name], value), name
    assert model.head.weight is model.embed.weight
    assert backend.state() == "RUNNING"


def test_level2_discards_parameters_and_keeps_buffers_and_derived_tensors():
    model, kv, backend, before = _setup()
    backend.suspend(2, backend.collect([("", model)], [kv]))
    backend.resume(["weights"])
    assert backend.asleep_tags() == {"kv_cache"} and backend.state() == "SUSPENDED"
    assert torch.count_nonzero(model.embed.weight) == 0
    assert torch.count_nonzero(model.layer.proj.bias) == 0
    assert torch.equal(model.layer.table, before["layer.table"])
    assert torch.equal(model.layer.absorbed, before["layer.absorbed"])
    # a derived view keeps its parameter's storage on the host
    assert torch.equal(model.layer.weight_t, before["layer.weight_t"])
    assert torch.equal(model.layer.proj.weight, before["layer.proj.weight"])
    backend.resume(["kv_cache"])
    assert backend.asleep_tags() == set() and kv.shape == (2, 4, 16)


def test_level2_keeps_parameters_named_to_be_preserved():
    model, kv, backend, before = _setup()
    backend.suspend(2, backend.collect([("", model)], [kv], preserve_patterns=["embed.*"]))
    backend.resume(None)
    assert torch.equal(model.embed.weight, before["embed.weight"])
    assert torch.count_nonzero(model.layer.proj.bias) == 0


def test_a_discarded_kv_cache_stays_tracked_through_a_later_sleep():
    model, kv, backend, _ = _setup()
    backend.collect([("", model)], [kv])
    backend.discard(("kv_cache",))
    assert kv.untyped_storage().nbytes() == 0
    backend.suspend(1, backend.collect([("", model)], [kv]))  # the cache reads as empty now
    assert backend.report.released["kv_cache"] == 0
    backend.resume(None)
    assert kv.untyped_storage().nbytes() == 2 * 4 * 16 * 4


def test_a_storage_it_cannot_release_is_refused_before_anything_is_released():
    model, kv, backend, before = _setup()
    fixed = torch.frombuffer(bytearray(64), dtype=torch.float32)  # memory the tensor does not own
    model.layer.fixed = fixed
    with pytest.raises(RuntimeError, match="not resizable"):
        backend.collect([("", model)], [kv])
    assert model.embed.weight.untyped_storage().nbytes() > 0


def test_only_levels_1_and_2_exist():
    model, kv, backend, _ = _setup()
    keep = backend.collect([("", model)], [kv])
    with pytest.raises(ValueError, match="level must be 1 or 2"):
        backend.suspend(3, keep)
    assert backend.asleep_tags() == set()
