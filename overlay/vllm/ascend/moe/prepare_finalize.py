"""The Ascend MoE communication strategies as one upstream modular-kernel
prepare/finalize: prepare moves tokens to the ranks holding their experts, the local
experts run (``experts.py``), finalize brings the results back.

- AllGather: upstream's naive gather/reduce-scatter over the DP group (through this
  distribution's communicator), or nothing without DP. Every rank computes its experts
  for every gathered token; the output is a partial sum the runner all-reduces over TP.
- AllToAll: each TP rank takes a slice of its tokens; per-expert counts are exchanged
  first, then ``all_to_all_single`` carries exactly the routed (token, expert) rows to
  the experts' owners and back; the routing weights are applied at the source.
  The output is the full sum (``output_is_reduced``).
- MC2: the TP slices are padded to one batch size on every EP rank (an active mask
  marks the real rows) and go through the MC2 dispatch/combine kernels
  (``kernels/mc2.py``: torch_npu's ops, or the reference on ordinary collectives);
  combine applies the routing weights. The output is the full sum.

The strategy is chosen per forward (``step.py``) from values every rank shares, so all
EP ranks run the same collectives; a rank with no requests runs a one-token dummy
batch through the same path. What prepare leaves for finalize is kept on the instance
(prepare and finalize run back to back: no async prepare, no dual-batch overlap).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from vllm.distributed.parallel_state import get_ep_group, get_tp_group
from vllm.forward_context import get_forward_context, is_forward_context_available
from vllm.logger import init_logger
from vllm.model_executor.layers.fused_moe.prepare_finalize.naive_dp_ep import (
    MoEPrepareAndFinalizeNaiveDPEPModular,
)
from vllm.model_executor.layers.fused_moe.prepare_finalize.no_dp_ep import MoEPrepareAndFinalizeNoDPEPModular

from vllm.ascend.kernels.mc2 import Mc2Comm, mc2_combine, mc2_dispatch
from vllm.ascend.moe.selector import MoEComm
from vllm.ascend.moe.step import MoEPlan, MoEStep, installed_plan

logger = init_logger(__name__)
_ANNOUNCED: set[MoEComm] = set()


class MoECommStrategy(Protocol):
    """One communication strategy: ``prepare`` moves a layer's routed tokens to the ranks
    holding their experts and returns upstream's prepare result; ``finalize`` brings the
    expert outputs back into ``output``. A new strategy is one class with these two
    methods, registered in ``AscendMoEPrepareAndFinalize``."""

    reduced: bool  # finalize leaves the full sum (no TP all-reduce after the layer)

    def prepare(
        self,
        a1,
        topk_weights,
        topk_ids,
        num_experts,
        expert_map,
        on_input,
        step: MoEStep,
        quant_config=None,
        defer_input_quant=False,
    ) -> mk.PrepareResultType: ...

    def finalize(
        self, output, fused_expert_output, topk_weights, topk_ids, on_input, weight_and_reduce_impl
    ) -> None: ...


def _tp_slice(num_tokens: int, tp_size: int, tp_rank: int) -> tuple[int, int, int]:
    """(start, end, slice length) of this TP rank's equal share of the tokens."""
    share = max(1, math.ceil(num_tokens / tp_size))
    start = min(tp_rank * share, num_tokens)
    return start, min(start + share, num_tokens), share


def _tp_all_gather(part: torch.Tensor, share: int, num_tokens: int) -> torch.Tensor:
    """The TP ranks' slices (each padded to ``share`` rows) back into ``[num_tokens, H]``."""
    tp = get_tp_group()
    if tp.world_size == 1:
        return part[:num_tokens]
    padded = part.new_zeros((share, part.shape[1]))
    padded[: part.shape[0]] = part
    gathered = part.new_empty((share * tp.world_size, part.shape[1]))
    dist.all_gather_into_tensor(gathered, padded, group=tp.device_group)
    return gathered[:num_tokens]


class _Placement:
    """Which EP rank holds each global expert, learnt once per layer from every rank's
    expert map (so any placement works), and what follows from it for this rank."""

    def __init__(self, expert_map: torch.Tensor, num_experts: int) -> None:
        ep = get_ep_group()
        maps = expert_map.new_empty(ep.world_size * num_experts)
        dist.all_gather_into_tensor(maps, expert_map.contiguous(), group=ep.device_group)
        held = maps.view(ep.world_size, num_experts) >= 0
        if not bool(held.any(dim=0).all()):
            raise RuntimeError("AllToAll MoE: some expert is held by no EP rank")
        self.owner = held.to(torch.int8).argmax(dim=0).to(torch.int64)  # first holder
        self.by_owner = torch.argsort(self.owner, stable=True)  # experts grouped by rank
        self.experts_per_rank = torch.bincount(self.owner, minlength=ep.world_size).tolist()
        self.mine = self.by_owner[self.owner[self.by_owner] == ep.rank_in_group]  # ascending ids


@dataclass
class _AllToAllCall:
    """What AllToAll's prepare leaves for its finalize."""

    start: int  # this TP rank's slice of the tokens: [start, end), padded to share rows
    end: int
    share: int
    num_tokens: int
    k: int
    order: torch.Tensor  # this rank's (token, expert) rows, grouped by owning rank
    weights: torch.Tensor  # their routing weights (float32), in that order
    send_split: list[int]
    recv_split: list[int]
    on_input: bool  # routing weights already applied to the input rows


class AllToAllStrategy:
    reduced = True

    def __init__(self) -> None:
        self._placement: _Placement | None = None

    def prepare(
        self,
        a1,
        topk_weights,
        topk_ids,
        num_experts,
        expert_map,
        on_input,
        step,
        quant_config=None,
        defer_input_quant=False,
    ):
        ep = get_ep_group()
        num_tokens, k = topk_ids.shape
        tp = get_tp_group()
        start, end, share = _tp_slice(num_tokens, tp.world_size, tp.rank_in_group)
        if self._placement is None:
            self._placement = _Placement(expert_map, num_experts)
        place = self._placement
        ids = topk_ids[start:end].reshape(-1).to(torch.int64)
        order = torch.argsort(place.owner[ids] * num_experts + ids, stable=True)
        # Per-expert counts first: rank r gets the counts of the experts it owns. (scatter_add_,
        # not bincount, which sizes its output from the data and so reads it back.)
        counts = torch.zeros(num_experts, dtype=torch.int64, device=a1.device)
        counts.scatter_add_(0, ids, torch.ones_like(ids))
        mine_count = len(place.mine)
        recv_expert_counts = counts.new_empty(mine_count * ep.world_size)
        dist.all_to_all_single(
            recv_expert_counts,
            counts[place.by_owner].contiguous(),
            [mine_count] * ep.world_size,
            place.experts_per_rank,
            group=ep.device_group,
        )
        send_counts = torch.zeros(ep.world_size, dtype=torch.int64, device=a1.device)
        send_counts.scatter_add_(0, place.owner[ids], torch.ones_like(ids))
        recv_by_source = recv_expert_counts.view(ep.world_size, -1)
        # The one host read of this strategy, once per layer: all_to_all_single takes its
        # split sizes as host lists (so does HCCL's all-to-all-v). MC2 and AllGather read
        # nothing back; the selector gives AllToAll only steps above MC2's capacity.
        send_split, recv_split = torch.stack([send_counts, recv_by_source.sum(1)]).tolist()
        rows = a1[start:end][order // k]
        weights = topk_weights[start:end].reshape(-1)[order].to(torch.float32)
        if on_input:
            rows = (rows.float() * weights.unsqueeze(1)).to(a1.dtype)
        received = a1.new_empty((sum(recv_split), a1.shape[1]))
        dist.all_to_all_single(received, rows.contiguous(), recv_split, send_split, group=ep.device_group)
        row_ids = place.mine.repeat(ep.world_size).repeat_interleave(
            recv_by_source.reshape(-1), output_size=received.shape[0]
        )
        self._call = _AllToAllCall(
            start, end, share, num_tokens, k, order, weights, send_split, recv_split, on_input
        )
        ones = torch.ones((received.shape[0], 1), dtype=torch.float32, device=a1.device)
        return received, None, None, row_ids.to(torch.int32).unsqueeze(1), ones

    def finalize(self, output, fused_expert_output, *_):
        call, self._call = self._call, None
        ep = get_ep_group()
        back = fused_expert_output.new_empty((sum(call.send_split), fused_expert_output.shape[1]))
        dist.all_to_all_single(
            back, fused_expert_output.contiguous(), call.send_split, call.recv_split, group=ep.device_group
        )
        part = torch.zeros(
            (call.end - call.start, output.shape[1]), dtype=torch.float32, device=output.device
        )
        contrib = back.float() if call.on_input else back.float() * call.weights.unsqueeze(1)
        part.index_add_(0, call.order // call.k, contrib)
        output.copy_(_tp_all_gather(part.to(output.dtype), call.share, call.num_tokens))


@dataclass
class _MC2Call:
    """What MC2's prepare leaves for its finalize."""

    ids: torch.Tensor  # [share, k] expert ids of this rank's padded rows
    scales: torch.Tensor  # [share, k] routing weights (ones when applied on the input)
    mask: torch.Tensor  # [share] real rows
    dispatched: object  # the dispatch kernel's result (kernels/mc2.py)
    num_tokens: int
    share: int
    num_experts: int


class MC2Strategy:
    reduced = True

    def __init__(self) -> None:
        self._comm: Mc2Comm | None = None

    def comm(self) -> Mc2Comm:
        if self._comm is None:
            from vllm.ascend import device as ascend_device
            from vllm.ascend.distributed.groups import get_mc2_group

            group = get_mc2_group()
            dev = ascend_device.current()
            self._comm = Mc2Comm(
                group.device_group,
                dev.comm_name(group.device_group),
                group.world_size,
                group.rank_in_group,
                dev.soc_generation(),
            )
        return self._comm

    def prepare(
        self,
        a1,
        topk_weights,
        topk_ids,
        num_experts,
        expert_map,
        on_input,
        step,
        quant_config=None,
        defer_input_quant=False,
    ):
        comm = self.comm()
        num_tokens, k = topk_ids.shape
        if on_input and k != 1:
            raise NotImplementedError("MC2 applies router weights on the input only with top-k 1")
        # Every EP rank dispatches padded / TP rows: its slice of its DP rank's tokens.
        tp = get_tp_group()
        share = step.mc2_padded_tokens // tp.world_size
        if share * tp.world_size < num_tokens:
            raise RuntimeError(
                f"MC2 step carries {share * tp.world_size} rows but this rank has {num_tokens} tokens"
            )
        start = tp.rank_in_group * share
        x = a1.new_zeros((share, a1.shape[1]))
        # Padding rows name k distinct, valid experts (the op checks every row).
        ids = torch.arange(k, dtype=torch.int32, device=a1.device).repeat(share, 1)
        scales = torch.zeros((share, k), dtype=torch.float32, device=a1.device)
        end = min(start + share, num_tokens)
        n = max(end - start, 0)
        if n:
            x[:n] = a1[start:end]
            ids[:n] = topk_ids[start:end].to(torch.int32)
            scales[:n] = topk_weights[start:end].to(torch.float32)
        mask = torch.arange(share, device=a1.device) < n
        if on_input:
            x = (x.float() * scales).to(a1.dtype)
            scales = torch.ones_like(scales)
        dispatched = mc2_dispatch(x, ids, mask, comm, num_experts)
        local = num_experts // comm.ep_size
        rows = dispatched.expand_x.shape[0]
        # Each row's local expert from the per-expert counts, on the device (no host sync);
        # rows past the valid count name an expert held elsewhere, so the experts skip them.
        ends = dispatched.expert_token_nums.to(torch.int64).cumsum(0)
        local_of_row = torch.searchsorted(ends, torch.arange(rows, device=a1.device), right=True)
        elsewhere = num_experts - 1 if comm.ep_rank == 0 else 0
        row_ids = torch.where(local_of_row < local, local_of_row + comm.ep_rank * local, elsewhere)
        self._call = _MC2Call(ids, scales, mask, dispatched, num_tokens, share, num_experts)
        ones = torch.ones((rows, 1), dtype=torch.float32, device=a1.device)
        return dispatched.expand_x, None, None, row_ids.to(torch.int32).unsqueeze(1), ones

    def finalize(self, output, fused_expert_output, *_):
        call, self._call = self._call, None
        part = mc2_combine(
            fused_expert_output.contiguous(),
            call.ids,
            call.dispatched,
            call.scales,
            call.mask,
            self.comm(),
            call.num_experts,
        )
        output.copy_(_tp_all_gather(part, call.share, call.num_tokens))


class AllGatherStrategy:
    """Upstream's naive gather / reduce-scatter over the DP group (nothing without DP); the
    output is a partial sum the runner all-reduces over TP."""

    reduced = False

    def __init__(self, moe) -> None:
        pc = moe.moe_parallel_config
        sp = pc.is_sequence_parallel  # off on Ascend (platform/npu.py); upstream's semantics kept
        self._upstream = (
            MoEPrepareAndFinalizeNaiveDPEPModular(sp, num_dispatchers=pc.dp_size * pc.sp_size)
            if pc.dp_size > 1 or sp
            else MoEPrepareAndFinalizeNoDPEPModular()
        )

    def prepare(
        self,
        a1,
        topk_weights,
        topk_ids,
        num_experts,
        expert_map,
        on_input,
        step,
        quant_config=None,
        defer_input_quant=False,
    ):
        # The experts apply on-input router weights themselves (they get the flag too).
        return self._upstream.prepare(
            a1, topk_weights, topk_ids, num_experts, expert_map, False, quant_config, defer_input_quant
        )

    def finalize(
        self, output, fused_expert_output, topk_weights, topk_ids, on_input, weight_and_reduce_impl
    ) -> None:
        self._upstream.finalize(
            output, fused_expert_output, topk_weights, topk_ids, on_input, weight_and_reduce_impl
        )


class AscendMoEPrepareAndFinalize(mk.FusedMoEPrepareAndFinalizeModular):
    """One prepare/finalize for every strategy; the forward's step picks which runs."""

    def __init__(self, moe, vllm_config) -> None:
        super().__init__()
        self.moe = moe
        self.vllm_config = vllm_config
        self._plan = installed_plan()
        pc = moe.moe_parallel_config
        # Layers whose model reduces the output itself, sequence-parallel MoE and prefill
        # context parallelism keep upstream's semantics: gather/reduce-scatter only.
        self.gather_only = bool(moe.skip_final_all_reduce or pc.is_sequence_parallel or pc.pcp_size > 1)
        self._strategies: dict[MoEComm, MoECommStrategy] = {
            MoEComm.ALLGATHER: AllGatherStrategy(moe),
            MoEComm.ALLTOALL: AllToAllStrategy(),
            MoEComm.MC2: MC2Strategy(),
        }
        self._active: MoECommStrategy | None = None

    @property
    def plan(self) -> MoEPlan:
        if self._plan is None:  # built outside a worker (layer tests): worked out when first needed
            from vllm.ascend import device as ascend_device

            self._plan = MoEPlan.from_config(self.vllm_config, ascend_device.current().soc_generation())
        return self._plan

    def current_step(self, num_local_tokens: int) -> MoEStep:
        """This forward's step: the platform hook's, else from the DP metadata or, without
        any, the local token count, which every EP rank sees (they are the TP ranks of one
        DP rank)."""
        if is_forward_context_available():
            ctx = get_forward_context()
            step = ctx.additional_kwargs.get("ascend_moe")
            if step is not None:
                return step
            if ctx.dp_metadata is not None:
                return self.plan.step(int(ctx.dp_metadata.num_tokens_across_dp_cpu.max()))
        return self.plan.step(num_local_tokens)

    @property
    def activation_format(self) -> mk.FusedMoEActivationFormat:
        return mk.FusedMoEActivationFormat.Standard

    def topk_indices_dtype(self) -> torch.dtype | None:
        return torch.int32  # what MC2 takes; the other paths accept it

    def max_num_tokens_per_rank(self) -> int | None:
        return None

    def num_dispatchers(self) -> int:
        return self.moe.moe_parallel_config.ep_size

    def output_is_reduced(self) -> bool:
        return self._active is not None and self._active.reduced

    def supports_async(self) -> bool:
        return False

    def prepare(
        self,
        a1,
        topk_weights,
        topk_ids,
        num_experts,
        expert_map,
        apply_router_weight_on_input,
        quant_config,
        defer_input_quant=False,
    ) -> mk.PrepareResultType:
        step = self.current_step(a1.shape[0])
        comm = MoEComm.ALLGATHER if self.gather_only or expert_map is None else step.comm
        if comm not in _ANNOUNCED:
            _ANNOUNCED.add(comm)
            logger.info(
                "Ascend MoE: first step with the %s strategy (%d tokens at most per DP rank)",
                comm.value,
                step.max_tokens,
            )
        self._active = self._strategies[comm]
        return self._active.prepare(
            a1,
            topk_weights,
            topk_ids,
            num_experts,
            expert_map,
            apply_router_weight_on_input,
            step,
            quant_config,
            defer_input_quant,
        )

    def finalize(
        self,
        output,
        fused_expert_output,
        topk_weights,
        topk_ids,
        apply_router_weight_on_input,
        weight_and_reduce_impl,
    ) -> None:
        if self._active is None:
            raise RuntimeError("finalize before prepare: the modular kernel calls prepare first")
        self._active.finalize(
            output,
            fused_expert_output,
            topk_weights,
            topk_ids,
            apply_router_weight_on_input,
            weight_and_reduce_impl,
        )
