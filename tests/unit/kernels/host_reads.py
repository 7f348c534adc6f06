"""A guard for the device forms of kernels: they must never make the device wait for the
host to read a value back."""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def no_host_reads(active: bool):
    """Fail on the calls that make a device wait for the host to read a value back."""
    if not active:
        yield
        return
    names = ("item", "tolist", "nonzero", "__bool__", "__int__", "__index__", "__float__")
    saved = {n: getattr(torch.Tensor, n) for n in names}

    def refuse(*args, **kwargs):
        raise AssertionError("host read-back in an npu_* kernel")

    for n in names:
        setattr(torch.Tensor, n, refuse)
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)
