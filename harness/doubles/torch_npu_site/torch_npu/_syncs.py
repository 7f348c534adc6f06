"""Host synchronisations the double counts (``TORCH_NPU_DOUBLE_SYNC_LOG=<directory>``).

On an NPU, reading a device value on the host (``.item()``, ``.tolist()``, ``int(t)``,
``if t:``, ``.cpu()``) or running an op whose output size depends on device
data (``nonzero``, ``unique``, ``masked_select``, indexing with a boolean mask,
``repeat_interleave`` with tensor repeats and no ``output_size``) blocks the host until
every queued device op has finished: the launch queue drains, and inside a captured
graph such a call is not allowed at all. In NPU-path mode every tensor lives on the CPU,
so these calls cost nothing here; the double counts them instead.

A call counts while a device op is in flight: after the double ran one of torch_npu's
ops and before the host waited for the device (``torch_npu.npu.synchronize()``,
``Stream.synchronize()``, ``Event.synchronize()``). Calls made by the double's own
kernels (their CPU semantics) do not count. Each counted call is logged by its site
(the first frame outside torch and the double) and whether it ran inside one of the
functions named in ``TORCH_NPU_DOUBLE_SYNC_REGIONS`` (comma-separated function names,
default ``model_forward``: the model runner's forward). At exit each process writes
``<directory>/<pid>.json``: ``{site: {"calls": n, "in_region": m}}``.

``.numpy()`` is not counted: torch converts host tensors only (a device tensor raises),
so where it runs on an NPU host it waits for nothing. The copy to the host before it is
counted when it blocks; a non-blocking copy's data is valid once its event has completed,
an ordering that is the caller's on the device as here. Otherwise the double cannot tell a
host tensor (an upstream ``*_cpu`` mirror) from a device tensor, since both are CPU tensors
here (torch returns the same tensor for a copy to the "device" ``cpu``, so where a tensor
came from does not tell either); a test that allows a site says why. During an NPU
graph capture such a read is refused (``_graphs.py``) unless its site is one of
``TORCH_NPU_DOUBLE_HOST_TENSOR_SITES`` (comma-separated ``file.py:function``, or
``file.py`` for all of a file's functions, where the value read is a host tensor), which
a test sets with its reason; the ops such a site issues during a capture run at once
instead of being captured.
"""

from __future__ import annotations

import atexit
import collections
import json
import os
import sys
from pathlib import Path

import torch

SYNC_LOG_VARIABLE = "TORCH_NPU_DOUBLE_SYNC_LOG"
REGION_VARIABLE = "TORCH_NPU_DOUBLE_SYNC_REGIONS"
HOST_TENSOR_SITES_VARIABLE = "TORCH_NPU_DOUBLE_HOST_TENSOR_SITES"

in_flight = 0  # device ops launched since the host last waited for the device
_kernel_depth = 0  # > 0 while the double's own kernel code runs
_regions: frozenset[str] = frozenset()
records: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
_SKIP_PATHS = (os.path.dirname(torch.__file__), os.path.dirname(__file__))


def launched() -> None:
    global in_flight
    in_flight += 1


def drained() -> None:
    """The host waited for the device: nothing is in flight any more."""
    global in_flight
    in_flight = 0


class kernel_running:
    """Around a double kernel: its CPU semantics may read values freely."""

    def __enter__(self) -> None:
        global _kernel_depth
        _kernel_depth += 1

    def __exit__(self, *exc) -> None:
        global _kernel_depth
        _kernel_depth -= 1


def _is_torch_frame(frame) -> bool:
    # the real torch_npu runs from its wheel (a zip path), so its frames are told by module name
    module = frame.f_globals.get("__name__", "")
    return frame.f_code.co_filename.startswith(_SKIP_PATHS) or module.split(".")[0] == "torch_npu"


def _site_and_region() -> tuple[str, bool]:
    frame = sys._getframe(2)
    site = None
    in_region = False
    while frame is not None:
        code = frame.f_code
        if site is None and not _is_torch_frame(frame):
            site = f"{code.co_filename}:{frame.f_lineno} ({code.co_name})"
        if code.co_name in _regions:
            in_region = True
            break
        frame = frame.f_back
    return site or "<unknown>", in_region


def _host_tensor_site(site: str) -> bool:
    """``site`` ("path:line (function)") is one a test named as reading a host tensor (a
    named file without a function: any function of it)."""
    path, _, rest = site.partition(":")
    function = rest.partition("(")[2].rstrip(")")
    return any(path.endswith(file) and name in ("", function) for file, name in host_tensor_sites())


def host_tensor_sites() -> list[tuple[str, str]]:
    named = os.environ.get(HOST_TENSOR_SITES_VARIABLE, "")
    return [tuple(e.strip().partition(":")[::2]) for e in named.split(",") if e.strip()]


def at_host_tensor_site() -> bool:
    """Is the code that issued the current op a named host-tensor site? (Its ops on host
    tensors run at once during a graph capture, as they do on an NPU host.)"""
    return bool(host_tensor_sites()) and _host_tensor_site(_site_and_region()[0])


def _record(what: str) -> None:
    if in_flight == 0 or _kernel_depth:
        return
    site, in_region = _site_and_region()
    graphs = sys.modules.get("torch_npu._graphs")
    if graphs is not None and not _host_tensor_site(site):
        graphs.refuse_while_a_replay_waits(f"{what} at {site}")
    if graphs is not None and graphs.capturing is not None and not _host_tensor_site(site):
        raise graphs.GraphCaptureError(
            f"{what} reads a device value on the host during NPU graph capture "
            f"({site}); the device refuses this: the value does not exist until replay"
        )
    entry = records[f"{site}: {what}"]
    entry["calls"] += 1
    entry["in_region"] += int(in_region)


def _wrap_method(name: str, condition=None) -> None:
    original = getattr(torch.Tensor, name)

    def wrapper(self, *args, **kwargs):
        if in_flight and not _kernel_depth and (condition is None or condition(self, args, kwargs)):
            _record(f"Tensor.{name}")
        return original(self, *args, **kwargs)

    wrapper.__name__ = name
    setattr(torch.Tensor, name, wrapper)


def _wrap_function(name: str, condition=None) -> None:
    original = getattr(torch, name)

    def wrapper(*args, **kwargs):
        if in_flight and not _kernel_depth and (condition is None or condition(None, args, kwargs)):
            _record(f"torch.{name}")
        return original(*args, **kwargs)

    wrapper.__name__ = name
    setattr(torch, name, wrapper)


def _to_host(_self, args, kwargs) -> bool:
    # Every device is "cpu" here, so a host-to-device copy looks like a device-to-host one;
    # a non-blocking copy is queued without waiting either way.
    if kwargs.get("non_blocking") or (len(args) > 1 and args[1] is True):
        return False
    target = kwargs.get("device", args[0] if args else None)
    return isinstance(target, (str, torch.device)) and torch.device(target).type == "cpu"


def _boolean_index(_self, args, kwargs) -> bool:
    index = args[0] if args else None
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


def _data_sized_repeat(self, args, kwargs) -> bool:
    if kwargs.get("output_size") is not None:
        return False
    if self is not None:  # t.repeat_interleave(repeats, dim=None, *, output_size=None)
        repeats = args[0] if args else kwargs.get("repeats")
    elif len(args) == 1 and "repeats" not in kwargs:  # torch.repeat_interleave(repeats)
        repeats = args[0]
    else:  # torch.repeat_interleave(input, repeats, dim=None, *, output_size=None)
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
    return isinstance(repeats, torch.Tensor)


_wrapped = False


def install() -> None:
    """Count host synchronisations in this process (only with the log variable set)."""
    global _regions
    directory = os.environ.get(SYNC_LOG_VARIABLE)
    if not directory:
        return
    _regions = frozenset(
        n.strip() for n in os.environ.get(REGION_VARIABLE, "model_forward").split(",") if n.strip()
    )
    ensure_wrappers()
    atexit.register(_write, Path(directory))


def ensure_wrappers() -> None:
    """Watch host reads from now on (counting them, or refusing them in a graph capture)."""
    global _wrapped
    if _wrapped:
        return
    _wrapped = True
    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu"):
        _wrap_method(name)
    _wrap_method("to", _to_host)
    _wrap_method("__getitem__", _boolean_index)
    for name in ("nonzero", "argwhere", "unique", "unique_consecutive", "masked_select"):
        _wrap_method(name)
        _wrap_function(name)
    _wrap_method("repeat_interleave", _data_sized_repeat)
    _wrap_function("repeat_interleave", _data_sized_repeat)


def _write(directory: Path) -> None:
    # Written even when empty: a test can tell "counted, none found" from "not counting".
    directory.mkdir(parents=True, exist_ok=True)
    data = {site: dict(counts) for site, counts in sorted(records.items())}
    (directory / f"{os.getpid()}.json").write_text(json.dumps(data, indent=1))


def read_log(directory: Path) -> dict[str, dict[str, int]]:
    """Every process's records in ``directory``, summed by site."""
    total: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for path in Path(directory).glob("*.json"):
        for site, counts in json.loads(path.read_text()).items():
            total[site].update(counts)
    return {site: dict(c) for site, c in total.items()}
