"""The Ascend model runner: upstream's GPU model runner with device calls routed to
vllm.ascend.device. Upstream's Triton slot-mapping kernel is replaced by
vllm.ascend.kernels.slot_mapping (registered by the platform)."""

from __future__ import annotations

from contextlib import contextmanager

import torch

from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from vllm.ascend import device as ascend_device


@contextmanager
def _device_streams_and_events():
    """While upstream's runner builds itself, ``torch.cuda.Stream``/``Event`` (which it
    names directly) make the device layer's streams and events instead."""
    dev = ascend_device.current()
    saved = torch.cuda.Stream, torch.cuda.Event
    torch.cuda.Stream = lambda *a, **kw: dev.stream()  # type: ignore[assignment]
    torch.cuda.Event = lambda *a, **kw: dev.event(**kw)  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.cuda.Stream, torch.cuda.Event = saved


class NPUModelRunner(GPUModelRunner):
    def __init__(self, vllm_config, device: torch.device) -> None:
        with _device_streams_and_events():
            super().__init__(vllm_config, device)
        self.device_layer = ascend_device.current()

    def _sync_device(self) -> None:
        self.device_layer.synchronize()

    def _to_list(self, sampled_token_ids: torch.Tensor) -> list[list[int]]:
        if self.device.type == "cpu":
            return sampled_token_ids.tolist()
        return super()._to_list(sampled_token_ids)
