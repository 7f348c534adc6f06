"""Which MoE communication strategy a step uses: one pure function every rank evaluates
on the same inputs.

The only per-step input is the largest token count across the DP ranks, which every
rank learns from the step's DP metadata all-reduce (Model Runner V2's ``dp_utils``; an idle rank
running upstream's dummy batch of 1 + k tokens sees the same maximum as the busiest
rank), so all EP ranks always choose the same strategy and the same MC2 batch size. The table is in docs/moe.md.

NPU rules follow vllm-ascend (``vllm_ascend/ascend_forward_context.py``,
select_moe_comm_method at commit 182b75ea); the MC2 limits quote torch_npu's
``npu_moe_distribute_dispatch_v2`` documentation (Ascend/op-plugin
docs/zh/custom_APIs/torch_npu/torch_npu-npu_moe_distribute_dispatch_v2.md). Host
thresholds were measured with ``nox -s bench -- moe`` on the CI machine (2 cores, gloo).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass


class MoEComm(enum.Enum):
    ALLGATHER = "allgather"
    ALLTOALL = "alltoall"
    MC2 = "mc2"


CHOICES = tuple(c.value for c in MoEComm)

# A2 uses MC2 only for large EP with few experts per device (vllm-ascend _select_a2);
# the MC2 ops' own limits are kernels/mc2.py's.
A2_MC2_MIN_EP = 16
A2_MC2_MAX_EXPERTS_PER_DEVICE = 24
# Host emulation (gloo on CPU): AllToAll beats AllGather only with at least this many EP
# ranks and tokens (max across DP); below, AllGather's two collectives win. Measured with
# `nox -s bench -- moe` on the CI machine; see docs/moe.md.
HOST_ALLTOALL_MIN_EP = 4
HOST_ALLTOALL_MIN_TOKENS = 256

# The buffer formula below is that of the algorithm the MC2 kernels pass explicitly
# (kernels/mc2.py MC2_COMM_ALG): fullmesh on A2, fullmesh_v1 on A3.
_MB = 1 << 20


def _align(x: int, to: int) -> int:
    return (x + to - 1) // to * to


def mc2_buffer_bytes(
    soc: str, bs: int, ep: int, num_experts: int, top_k: int, hidden: int, shared_expert_num: int = 1
) -> int:
    """The HCCL buffer one rank of the MC2 group needs for a dispatch of ``bs`` tokens per
    rank (torch_npu-npu_moe_distribute_dispatch_v2.md, "HCCL通信域缓存区大小", 16-bit x):
    A2 fullmesh ``2*(BS*ep_world_size*min(local_expert_num, K)*H*sizeof(uint16)+2MB)``; A3
    fullmesh_v1 ``2*(local_expert_num*max_bs*ep_world_size*Align512(Align32(2*H)+64) +
    (K+shared_expert_num)*max_bs*Align512(2*H))``. 0 where no formula applies (host)."""
    local = num_experts // ep
    if soc == "A2":
        return 2 * (bs * ep * min(local, top_k) * hidden * 2 + 2 * _MB)
    if soc == "A3":
        per_expert_row = _align(_align(2 * hidden, 32) + 64, 512)
        return 2 * (
            local * bs * ep * per_expert_row + (top_k + shared_expert_num) * bs * _align(2 * hidden, 512)
        )
    return 0


def mc2_buffsize_mb(layout: MoELayout, bs: int) -> int:
    """The smallest HCCL_BUFFSIZE (MB) that holds an MC2 dispatch of ``bs`` tokens per rank."""
    need = mc2_buffer_bytes(
        layout.soc, bs, layout.ep_size, layout.num_experts, layout.top_k, layout.hidden_size
    )
    return -(-need // _MB)


def mc2_tokens_within(layout: MoELayout, buffsize_mb: int, most: int) -> int:
    """The largest per-rank batch (at most ``most``) whose MC2 buffer fits ``buffsize_mb``."""
    lo, hi = 0, most
    while lo < hi:  # the requirement grows with the batch: bisect
        mid = (lo + hi + 1) // 2
        if mc2_buffsize_mb(layout, mid) <= buffsize_mb:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass(frozen=True)
class MoELayout:
    """Everything static the choice depends on (identical on every rank)."""

    expert_parallel: bool  # --enable-expert-parallel and an EP group larger than one
    ep_size: int
    tp_size: int
    num_experts: int  # global routed experts, physical (EPLB's redundant replicas included)
    top_k: int
    hidden_size: int
    soc: str  # "A2" | "A3" | "other" | "host" (host: only the SoC-independent limits apply)
    mc2_capacity: int  # tokens per DP rank MC2 may carry (a multiple of tp_size)
    linear_placement: bool = True  # EP rank r holds physical experts r*E/ep ... (EPLB's too)
    quantized: bool = False  # does not change the choice (it changes MC2's quant_mode)


def mc2_capacity(max_num_seqs: int, num_speculative_tokens: int, tp_size: int, soc: str) -> int:
    """Tokens per DP rank (across its TP group) that MC2 may carry in one step: a decode
    batch (every request with its draft tokens), at most the per-rank BS limit per TP rank."""
    from vllm.ascend.kernels import mc2

    per_tp_rank = math.ceil(max_num_seqs * (1 + num_speculative_tokens) / tp_size)
    return min(per_tp_rank, mc2.TOKENS_PER_RANK[soc]) * tp_size


def mc2_padded_tokens(max_tokens: int, tp_size: int) -> int:
    """Rows every TP group pads to for MC2, so every EP rank dispatches the same BS."""
    return max(1, math.ceil(max_tokens / tp_size)) * tp_size


def unusable_reason(comm: MoEComm, layout: MoELayout) -> str | None:
    """Why ``comm`` cannot run with this layout (None: it can)."""
    if comm is MoEComm.ALLGATHER:
        return None
    if not layout.expert_parallel or layout.ep_size <= 1:
        return f"{comm.value} needs expert parallelism (--enable-expert-parallel with DP x TP > 1)"
    if comm is MoEComm.ALLTOALL:
        return None
    from vllm.ascend.kernels import mc2

    e, ep, k, h = layout.num_experts, layout.ep_size, layout.top_k, layout.hidden_size
    if not layout.linear_placement:
        return "mc2 needs linear expert placement (--expert-placement-strategy linear)"
    if e % ep:
        return f"mc2 needs the {e} routed experts to split evenly over the {ep} EP ranks"
    if k > mc2.MAX_TOP_K or e > mc2.MAX_EXPERTS:
        return f"mc2 takes top-k <= {mc2.MAX_TOP_K} and <= {mc2.MAX_EXPERTS} experts (model: top-k {k}, {e})"
    if layout.soc == "A2" and (ep not in mc2.A2_EP_SIZES or h > mc2.A2_MAX_HIDDEN or h % mc2.A2_HIDDEN_ALIGN):
        return (
            f"mc2 on Atlas A2 needs an EP size in {sorted(mc2.A2_EP_SIZES)} and hidden size <= "
            f"{mc2.A2_MAX_HIDDEN}, a multiple of {mc2.A2_HIDDEN_ALIGN} (EP {ep}, hidden {h})"
        )
    if layout.soc == "A3" and (ep > mc2.A3_MAX_EP or not mc2.A3_HIDDEN[0] <= h <= mc2.A3_HIDDEN[1]):
        return (
            f"mc2 on Atlas A3 needs EP <= {mc2.A3_MAX_EP} and hidden size in "
            f"[{mc2.A3_HIDDEN[0]}, {mc2.A3_HIDDEN[1]}] (EP {ep}, hidden {h})"
        )
    if layout.soc == "other":
        return "mc2 is only wired for Atlas A2 and A3"
    return None


def mc2_selectable(layout: MoELayout) -> bool:
    """Does ``select`` pick MC2 for some step with this layout (capacity aside)?"""
    if unusable_reason(MoEComm.MC2, layout) is not None:
        return False
    if layout.soc == "A2":
        return (
            layout.num_experts // layout.ep_size <= A2_MC2_MAX_EXPERTS_PER_DEVICE
            and layout.ep_size >= A2_MC2_MIN_EP
        )
    return layout.soc == "A3"


def select(max_tokens: int, layout: MoELayout) -> MoEComm:
    """The strategy for a step whose largest DP rank runs ``max_tokens`` tokens."""
    if not layout.expert_parallel or layout.ep_size <= 1:
        return MoEComm.ALLGATHER
    mc2_ok = mc2_selectable(layout) and max_tokens <= layout.mc2_capacity
    if layout.soc == "A2":
        return MoEComm.MC2 if mc2_ok else MoEComm.ALLGATHER
    if layout.soc == "A3":
        return MoEComm.MC2 if mc2_ok else MoEComm.ALLTOALL
    if layout.soc == "host":
        big = layout.ep_size >= HOST_ALLTOALL_MIN_EP and max_tokens >= HOST_ALLTOALL_MIN_TOKENS
        return MoEComm.ALLTOALL if big else MoEComm.ALLGATHER
    return MoEComm.ALLGATHER


def choose(
    max_tokens: int, layout: MoELayout, forced: MoEComm | None = None, in_graph: bool = False
) -> MoEComm:
    """``select`` unless the user forced a strategy. A forced MC2 still cannot carry a
    step above its capacity (the op's BS limit): such steps run AllToAll. In a decode
    graph (``in_graph``) AllToAll runs AllGather: its all-to-all takes split sizes counted
    on the device as host lists, which a captured graph cannot read (a forced AllToAll
    keeps graphs off: graph/policy.py)."""
    if forced is None:
        comm = select(max_tokens, layout)
    elif forced is MoEComm.MC2 and max_tokens > layout.mc2_capacity:
        comm = MoEComm.ALLTOALL
    else:
        comm = forced
    return MoEComm.ALLGATHER if in_graph and comm is MoEComm.ALLTOALL else comm


def parse_override(value) -> MoEComm | None:
    """``additional_config["moe_comm_method"]``: None/"auto" or one of CHOICES."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return None
    if isinstance(value, str) and value.strip().lower() in CHOICES:
        return MoEComm(value.strip().lower())
    raise ValueError(
        f"additional_config moe_comm_method must be one of auto, {', '.join(CHOICES)}; got {value!r}"
    )
