"""Kernels facade: one module per op family, each op with an NPU and a reference form.

Every op exposes the same contract twice: ``npu_*`` (torch_npu; written against the
torch_npu documentation and checked in CI against the torch_npu contract double; none
has run on an NPU here) and ``reference_*`` (plain torch: the oracle, and what host
emulation runs). Where one torch formula serves both (no torch_npu op, nothing read
back to the host), it is one function bound under both names. Callers use the
unprefixed name, bound once at import by ``pick`` from ``VLLM_ASCEND_KERNELS`` (the
choice of a process never changes).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch

from vllm.ascend import envs


def npu_kernels() -> bool:
    """True when this process runs the torch_npu kernels (on an NPU, or through the double)."""
    return envs.kernels() == "npu"


def pick(reference: Callable, npu: Callable) -> Callable:
    return npu if npu_kernels() else reference


def request_of_token(ends: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The tokens 0..num_tokens-1 of a ragged batch whose requests end at ``ends``
    (inclusive cumulative counts, one per request, at least one request): each token's
    request (clamped to the last), its position in that request, and whether it belongs
    to a request at all (tokens past the last end do not). No read back to the host;
    eight device ops (every runner step calls this a few times)."""
    end = ends.to(torch.int64).contiguous()
    token = torch.arange(num_tokens, device=ends.device)
    req = torch.searchsorted(end, token, right=True)
    # request r starts where r - 1 ends; a token past the last end gets that end, harmlessly
    start = torch.nn.functional.pad(end, (1, 0))[req]
    return req.clamp(max=end.numel() - 1), token - start, token < end[-1]


def kernel_dtypes() -> list[torch.dtype]:
    """Activation dtypes the selected kernels take: the torch_npu attention kernels take
    float16/bfloat16 only (npu_fused_infer_attention_score: query float16, bfloat16, int8)."""
    if npu_kernels():
        return [torch.bfloat16, torch.float16]
    return [torch.bfloat16, torch.float16, torch.float32]


# torch_npu ops the kernels call whose docs in the pinned wheel list fewer SoC generations
# than the kernels run them on, with the evidence for the others (logged once at start-up).
SOC_NOTES = {
    "npu_swiglu": (
        ("A2",),
        "the wheel's docs list Atlas A2 training parts only; vllm-ascend's SiluAndMul and MoE MLP "
        "call it on A3 as well",
    ),
}


def soc_notes(soc: str) -> list[str]:
    """What the start-up log says about the ops whose documented SoCs leave ``soc`` out."""
    return [f"{op}: {why}" for op, (listed, why) in SOC_NOTES.items() if soc not in listed]


def torch_npu() -> ModuleType:
    """The torch_npu module (loaded once by the device layer), or a clear error."""
    from vllm.ascend.device.npu_runtime import failure_reason, load_torch_npu

    module = load_torch_npu()
    if module is None:
        raise RuntimeError(f"the NPU kernels need torch_npu, but {failure_reason()}")
    return module
