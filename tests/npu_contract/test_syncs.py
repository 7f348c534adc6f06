"""The double's host-synchronisation count: what counts (a value read while a device op
is in flight, outside the double's own kernels, a blocking copy to the host), what does
not (before any device op, after the host waited for the device, a queued copy, the numpy
view of a host tensor), and the region flag the end-to-end tests assert on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from harness.doubles import torch_npu_wheel as npu_wheel

SCRIPT = textwrap.dedent(
    """
    import torch, torch_npu

    x = torch.randn(4, 8, dtype=torch.bfloat16)
    x.sum().item()  # nothing in flight yet: not counted

    def model_forward():
        y = torch_npu.npu_swiglu(x, -1)  # a device op: from here on something is in flight
        n = int((y > 0).sum())  # counted: Tensor.__int__
        rows = y[y[:, 0] > 0]  # counted: boolean-mask indexing
        torch.nonzero(y)  # counted: torch.nonzero
        torch.repeat_interleave(torch.tensor([1, 2]), output_size=3)  # sized by the host: not counted
        return n, rows

    def after_forward():
        (x > 0).tolist()  # still in flight, outside the region: counted, flagged out of region
        x.float().to("cpu", non_blocking=True, copy=True).numpy()  # queued copy, host view: not counted
        x.float().to("cpu").numpy()  # the blocking copy is counted, its numpy view is not

    model_forward()
    after_forward()
    torch_npu.npu.synchronize()  # the host waited: nothing in flight
    x.float().mean().item()  # not counted
    """
)


@pytest.fixture(scope="module")
def sync_log(tmp_path_factory):
    directory = tmp_path_factory.mktemp("syncs")
    env = {**os.environ, **npu_wheel.double_env(), "TORCH_NPU_DOUBLE_SYNC_LOG": str(directory)}
    env.pop("TORCH_NPU_DOUBLE_SYNC_REGIONS", None)
    subprocess.run([sys.executable, "-c", SCRIPT], env=env, check=True, timeout=300)
    (path,) = directory.glob("*.json")  # one process, one log
    return json.loads(path.read_text())


def _by_call(log: dict) -> dict[str, dict[str, int]]:
    return {site.rsplit(": ", 1)[1]: counts for site, counts in log.items()}


def test_reads_while_a_device_op_is_in_flight_are_counted_in_their_region(sync_log):
    calls = _by_call(sync_log)
    assert calls["Tensor.__int__"] == {"calls": 1, "in_region": 1}
    assert calls["Tensor.__getitem__"] == {"calls": 1, "in_region": 1}
    assert calls["torch.nonzero"] == {"calls": 1, "in_region": 1}
    assert calls["Tensor.tolist"] == {"calls": 1, "in_region": 0}
    assert calls["Tensor.to"] == {"calls": 1, "in_region": 0}


def test_reads_before_any_device_op_after_a_wait_or_inside_kernels_are_not(sync_log):
    calls = _by_call(sync_log)
    # .item() ran twice (before the first op, after synchronize), the swiglu kernel's own
    # CPU code reads nothing the caller asked for, and the host-sized repeat is free.
    assert "Tensor.item" not in calls
    assert "torch.repeat_interleave" not in calls
    # .numpy() converts host tensors only (torch refuses a device tensor): never a wait
    assert "Tensor.numpy" not in calls
    assert sum(c["calls"] for c in calls.values()) == 5
    sites = [site for site in sync_log if "torch_npu" in site.split(":")[0]]
    assert not sites, f"the double's own code was counted: {sites}"
