"""Run the Ascend MoE kernel (strategies + local experts) on N real processes over gloo.

    python -m harness.moe_ranks '<json case>'

Every rank joins vLLM's own distributed set-up (world, TP, DP, EP groups; the MC2
group as the Ascend worker creates it), builds the kernel exactly as the Ascend MoE
method does, and runs it on its own random tokens and routing inside a forward
context carrying the DP token counts. Each rank then does what upstream's MoE runner
does after the kernel (the TP all-reduce when the kernel's output is not already
reduced) and compares its rows with a dense single-process computation of the whole
batch by ``reference_moe_experts`` on all experts. It prints one ``RESULT`` JSON line
per rank: max error, strategies run, bytes it sent per forward.

Case: {"tp": T, "dp": D, "ep": bool, "strategy": "allgather"|"alltoall"|"mc2",
"tokens": [per DP rank, ...] (or "tokens_grid"), "experts": E, "top_k": K, "hidden": H,
"inter": I, "seed": S, "dtype": "float32", "skew": bool, "env": {...}, "bench": {"repeats": n},
"quant": "w8a8_dynamic" | "w4a8_dynamic" (int8 / int4 experts with per-channel scales; EP
layouts only), "redundant": R (EPLB: E + R physical experts, a seeded placement of the
logical ones with R replicas; routes mapped by ``moe/eplb.py``, which also records the load
each rank checks against its routes; EP layouts only)}
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

from harness.ranks import spawn_ranks


def problem(case: dict, num_tokens: int, dp_rank: int, seed_offset: int = 0):
    """This DP rank's tokens and routing (identical on its TP ranks), and the weights."""
    import torch

    e, k, h, inter = case["experts"], case["top_k"], case["hidden"], case["inter"]
    dtype = getattr(torch, case.get("dtype", "float32"))
    g = torch.Generator().manual_seed(case.get("seed", 0))
    w13 = (torch.randn(e, 2 * inter, h, generator=g) / h**0.5).to(dtype)
    w2 = (torch.randn(e, h, inter, generator=g) / inter**0.5).to(dtype)
    g = torch.Generator().manual_seed(1000 * (dp_rank + 1) + case.get("seed", 0) + seed_offset)
    x = torch.randn(num_tokens, h, generator=g).to(dtype)
    # Routing: top-k distinct experts per token, skewed so that some experts get no
    # tokens (only the first half of the experts is used when "skew" is set).
    pool = e // 2 if case.get("skew") and e // 2 >= k else e
    scores = torch.rand(num_tokens, pool, generator=g)
    ids = scores.topk(k, dim=1).indices.to(torch.int32)
    weights = torch.rand(num_tokens, k, generator=g).softmax(dim=1)
    return x, weights, ids, w13, w2


def quantize_experts(w, bits: int = 8):
    """Per expert and output channel symmetric int8 (msModelSlim's W8A8_DYNAMIC weights) or,
    with ``bits`` 4, int4 values held as int8 (W4A8_DYNAMIC's)."""
    import torch

    top = 2 ** (bits - 1) - 1
    scale = (w.float().abs().amax(dim=-1) / top).clamp(min=1e-12)
    return torch.round(w.float() / scale.unsqueeze(-1)).clamp(-top - 1, top).to(torch.int8), scale


def w4a8_experts(values, scale):
    """int4 expert values in the form the selected kernels take (``kernels/moe.py``), with
    the offset term msModelSlim writes (``8 * sum_k w * scale``)."""
    from vllm.ascend.kernels.moe import w4a8_weights

    offset = 8 * (values.double() * scale.double().unsqueeze(-1)).sum(-1)
    return w4a8_weights(values, scale, offset.float())


BITS = {"w8a8_dynamic": 8, "w4a8_dynamic": 4}


def eplb_placement(case: dict):
    """The logical expert of each physical one for a case with ``redundant`` replicas (None
    without): every logical expert once and R of them again, shuffled by the case's seed
    (the same on every rank), so replicas land on other ranks than their originals."""
    import torch

    redundant = case.get("redundant", 0)
    if not redundant:
        return None
    e = case["experts"]
    g = torch.Generator().manual_seed(7 + case.get("seed", 0))
    slots = torch.cat([torch.arange(e), torch.randperm(e, generator=g)[:redundant]])
    return slots[torch.randperm(e + redundant, generator=g)]


def eplb_layer_state(physical_to_logical, num_tokens: int):
    """Upstream's per-layer EPLB state for that placement, recording on."""
    import torch

    from vllm.distributed.eplb.eplb_state import EplbLayerState

    e = int(physical_to_logical.max()) + 1
    replicas = torch.bincount(physical_to_logical, minlength=e)
    to_physical = torch.full((e, int(replicas.max())), -1, dtype=torch.int64)
    filled = [0] * e
    for slot, logical in enumerate(physical_to_logical.tolist()):
        to_physical[logical, filled[logical]] = slot
        filled[logical] += 1
    state = EplbLayerState()
    state.expert_load_view = torch.zeros(len(physical_to_logical), dtype=torch.int32)
    state.logical_to_physical_map = to_physical
    state.logical_replica_count = replicas
    state.should_record_tensor = torch.tensor(True)
    state.num_unpadded_tokens_tensors = [torch.tensor(num_tokens, dtype=torch.int32)]
    return state


def _rank(rank: int, world: int, port: int, case: dict) -> dict:
    os.environ.setdefault("VLLM_ASCEND_EMULATE", "1")
    os.environ.update(case.get("env", {}))  # before vllm is imported: kernels are bound at import
    for entry in reversed(case.get("env", {}).get("PYTHONPATH", "").split(os.pathsep)):
        if entry:
            sys.path.insert(0, entry)  # the spawned interpreter read PYTHONPATH before this
    return run_rank(rank, world, port, case)


def run_rank(rank: int, world: int, port: int, case: dict) -> dict:
    import torch

    import vllm  # noqa: F401  (the Ascend platform is picked up by the import)
    import vllm.model_executor.layers.fused_moe.modular_kernel as mk
    from vllm.config import ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import (
        FUSED_MOE_UNQUANTIZED_CONFIG,
        FusedMoEConfig,
        FusedMoEParallelConfig,
        RoutingMethodType,
    )
    from vllm.model_executor.layers.fused_moe.expert_map_manager import determine_expert_map
    from vllm.v1.worker.workspace import init_workspace_manager

    from vllm.ascend.distributed.groups import init_mc2_group
    from vllm.ascend.kernels.mc2 import MAX_BATCH
    from vllm.ascend.moe import selector
    from vllm.ascend.moe.experts import AscendExperts
    from vllm.ascend.moe.prepare_finalize import AscendMoEPrepareAndFinalize

    tp, dp, use_ep = case["tp"], case["dp"], case.get("ep", True)
    e, k, h, inter = case["experts"], case["top_k"], case["hidden"], case["inter"]
    physical = e + case.get("redundant", 0)
    dp_rank, tp_rank = divmod(rank, tp)
    # What torchrun would set; the external-launcher config derives the DP rank from it.
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    pc = ParallelConfig(
        tensor_parallel_size=tp,
        data_parallel_size=dp,
        data_parallel_rank=dp_rank,
        enable_expert_parallel=use_ep,
        distributed_executor_backend="external_launcher",
    )
    cfg = VllmConfig(parallel_config=pc)
    with set_current_vllm_config(cfg):
        ps.init_distributed_environment(world, rank, f"tcp://127.0.0.1:{port}", rank, "gloo")
        ps.initialize_model_parallel(tp, 1)
        init_workspace_manager(torch.device("cpu"))
        if use_ep and world > 1:
            init_mc2_group("gloo")
        moe_pc = FusedMoEParallelConfig.make(
            tp_size_=tp, pcp_size_=1, dp_size_=dp, sp_size_=1, vllm_parallel_config=pc
        )
        ep_size, ep_rank = moe_pc.ep_size, moe_pc.ep_rank
        local_e, expert_map = physical, None
        if moe_pc.use_ep:
            local_e, expert_map, _ = determine_expert_map(ep_size, ep_rank, physical)
        elif physical != e:
            raise ValueError("redundant experts (EPLB) need EP")
        moe = FusedMoEConfig(
            num_experts=physical,
            experts_per_token=k,
            hidden_dim=h,
            intermediate_size=inter,
            num_local_experts=local_e,
            num_logical_experts=e,
            activation=MoEActivation.SILU,
            device="cpu",
            routing_method=RoutingMethodType.Renormalize,
            moe_parallel_config=moe_pc,
            in_dtype=getattr(torch, case.get("dtype", "float32")),
        )
        if case.get("quant") in BITS:  # int8 / int4 experts (vllm/ascend/quantization/moe.py)
            from types import SimpleNamespace

            from vllm.ascend.quantization.moe import AscendW4A8DynamicExperts, AscendW8A8DynamicExperts

            if not moe_pc.use_ep:
                raise ValueError("quantized cases need EP: per-token scales of a sharded intermediate differ")
            *_, w13, w2 = problem(case, 0, 0)
            ids = _local_experts(case, expert_map)
            bits = BITS[case["quant"]]
            q13, s13 = quantize_experts(w13[ids], bits)
            q2, s2 = quantize_experts(w2[ids], bits)
            if bits == 8:
                holder = SimpleNamespace(w13_weight_scale=s13, w2_weight_scale=s2)
                experts = AscendW8A8DynamicExperts(moe, FUSED_MOE_UNQUANTIZED_CONFIG, holder)
            else:
                p13, p2 = w4a8_experts(q13, s13), w4a8_experts(q2, s2)
                holder = SimpleNamespace(
                    w13_weight_scale=p13.scale,
                    w2_weight_scale=p2.scale,
                    w13_scale_bias=p13.bias,
                    w2_scale_bias=p2.bias,
                )
                experts = AscendW4A8DynamicExperts(moe, FUSED_MOE_UNQUANTIZED_CONFIG, holder)
        else:
            experts = AscendExperts(moe, FUSED_MOE_UNQUANTIZED_CONFIG)
        kernel = mk.FusedMoEKernel(AscendMoEPrepareAndFinalize(moe, cfg), experts)
        rounds = case.get("tokens_grid") or [case["tokens"]]
        repeats = case.get("bench", {}).get("repeats", 1)
        results = []
        comms = [selector.MoEComm(name) for name in case.get("strategies") or [case["strategy"]]]
        for tokens in rounds:
            # MC2 carries at most MAX_BATCH tokens per rank: larger rounds skip it.
            usable = [c for c in comms if c is not selector.MoEComm.MC2 or max(tokens) <= MAX_BATCH * tp]
            results += _one_round(
                case, cfg, kernel, usable, tokens, dp_rank, tp, physical, expert_map, moe_pc, repeats
            )
        calls = {}
        try:
            import torch_npu  # the contract double when the case runs the NPU kernels

            calls = dict(torch_npu._contract.calls)
        except ImportError:
            pass
        ps.destroy_model_parallel()
        ps.destroy_distributed_environment()
    from vllm.ascend import device as ascend_device
    from vllm.ascend.kernels import mc2, moe

    bound = [moe.moe_experts.__name__, mc2.mc2_dispatch.__name__, mc2.mc2_combine.__name__]
    dev = ascend_device.current()  # the device class the MC2 strategy took its SoC and names from
    return {
        "rank": rank,
        "results": results,
        "npu_calls": calls,
        "kernels": bound,
        "device": [type(dev).__name__, dev.soc_generation()],
    }


def _one_round(case, cfg, kernel, comms, tokens, dp_rank, tp, e, expert_map, moe_pc, repeats) -> list[dict]:
    """Every strategy on the same tokens; with repeats, one warm-up call each, then the
    strategies take turns so that all see the same machine conditions."""
    import torch
    import torch.distributed as dist

    from vllm.distributed import parallel_state as ps
    from vllm.distributed import tensor_model_parallel_all_reduce
    from vllm.forward_context import get_forward_context, set_forward_context
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    from vllm.ascend.kernels.moe import reference_moe_experts
    from vllm.ascend.moe import selector
    from vllm.ascend.moe.step import MoEStep

    inter = case["inter"]
    x, w, ids, w13, w2 = problem(case, tokens[dp_rank], dp_rank)
    logical_ids, load_ok = ids, None
    placement = eplb_placement(case)
    if placement is not None:  # routes to physical replicas, load recorded (moe/eplb.py)
        from vllm.ascend.moe.eplb import map_to_physical

        state = eplb_layer_state(placement, tokens[dp_rank])
        ids = map_to_physical(logical_ids, state)
        per_logical = torch.zeros(int(placement.max()) + 1, dtype=torch.int64)
        per_logical.index_add_(0, placement, state.expert_load_view.to(torch.int64))
        expected_load = torch.bincount(logical_ids.flatten().long(), minlength=len(per_logical))
        load_ok = bool((placement[ids.long()] == logical_ids).all()) and per_logical.equal(expected_load)
    quantized = case.get("quant") in BITS
    if quantized:
        w13, s13 = quantize_experts(w13, BITS[case["quant"]])
        w2, s2 = quantize_experts(w2, BITS[case["quant"]])
    if moe_pc.use_ep:
        held = _local_experts(case, expert_map)
        lw13, lw2 = w13[held], w2[held]
        if case.get("quant") == "w4a8_dynamic":  # the kernels' form of the int4 weights
            lw13 = w4a8_experts(lw13, s13[held]).weight
            lw2 = w4a8_experts(lw2, s2[held]).weight
    else:  # no EP: experts' intermediate dimension is sharded over every rank
        shard = inter // moe_pc.tp_size
        rows = slice(moe_pc.tp_rank * shard, (moe_pc.tp_rank + 1) * shard)
        lw13 = torch.cat([w13[:, :inter][:, rows], w13[:, inter:][:, rows]], dim=1)
        lw2 = w2[:, :, rows]
    max_tokens = max(tokens)
    across = torch.tensor(tokens, dtype=torch.int32)
    times = {c: [] for c in comms}
    outs, sent, reduced = {}, {}, {}
    for repeat in range(repeats + (1 if repeats > 1 else 0)):
        for comm in comms:
            step = MoEStep(comm, max_tokens, selector.mc2_padded_tokens(max_tokens, tp))
            with set_forward_context(None, cfg, num_tokens=tokens[dp_rank], num_tokens_across_dp=across):
                ctx = get_forward_context()
                ctx.additional_kwargs["ascend_moe"] = step
                sizes = ctx.dp_metadata.sp_local_sizes(1, 1, moe_pc.use_ep) if ctx.dp_metadata else None
                dist.barrier(group=ps.get_world_group().cpu_group)
                with _count_bytes() as counter:
                    t0 = time.perf_counter()
                    with sizes if sizes is not None else _nothing():
                        out = kernel.apply(x, lw13, lw2, w, ids, MoEActivation.SILU, e, expert_map, False)
                    reduced[comm] = kernel.output_is_reduced()
                    if not reduced[comm] and (moe_pc.tp_size > 1 or moe_pc.ep_size > 1):
                        out = tensor_model_parallel_all_reduce(out)
                    elapsed = time.perf_counter() - t0
                if repeats == 1 or repeat > 0:
                    times[comm].append(elapsed)
                outs[comm], sent[comm] = out, counter.bytes
    if quantized:  # all experts in one process, same int8 math (int4 values: the same, narrower)
        from vllm.ascend.kernels.moe import reference_moe_experts_w8a8_dynamic

        expected = reference_moe_experts_w8a8_dynamic(x.float(), w13, w2, s13, s2, w, logical_ids).float()
    else:
        expected = reference_moe_experts(x.float(), w13.float(), w2.float(), w, logical_ids)
    return [
        {
            "strategy": comm.value,
            "tokens": tokens,
            "reduced": reduced[comm],
            "error": float((outs[comm].float() - expected).abs().max()) if tokens[dp_rank] else 0.0,
            "scale": float(expected.abs().max()) if tokens[dp_rank] else 0.0,
            "median_s": statistics.median(times[comm]),
            "bytes_sent": sent[comm],
            "eplb_load_ok": load_ok,
        }
        for comm in comms
    ]


def _local_experts(case: dict, expert_map):
    """The logical expert of each of this rank's physical ones, in local order."""
    import torch

    placement = eplb_placement(case)
    if expert_map is None:
        return torch.arange(case["experts"]) if placement is None else placement
    slots = torch.nonzero(expert_map >= 0).flatten()
    return slots if placement is None else placement[slots]


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _count_bytes:
    """Bytes this rank hands to collectives (what leaves it: an all-gather sends its
    input to every peer, an all-to-all sends the parts addressed to others)."""

    def __enter__(self):
        import torch.distributed as dist

        self.bytes = 0
        self._saved = {}

        def wrap(name, cost):
            original = getattr(dist, name)
            self._saved[name] = original

            def counted(*args, **kwargs):
                group = kwargs.get("group")
                peers = dist.get_world_size(group) - 1 if group is not None else 0
                self.bytes += cost(peers, *args, **kwargs)
                return original(*args, **kwargs)

            setattr(dist, name, counted)

        def nbytes(t):
            return t.numel() * t.element_size()

        wrap("all_gather_into_tensor", lambda peers, out, inp, **kw: nbytes(inp) * peers)
        wrap("reduce_scatter_tensor", lambda peers, out, inp, **kw: nbytes(inp) * peers // (peers + 1))
        wrap("all_reduce", lambda peers, t, **kw: 2 * nbytes(t) * peers // (peers + 1))

        def a2a(peers, out, inp, out_splits=None, in_splits=None, **kw):
            if peers == 0 or inp.numel() == 0:
                return 0
            row = nbytes(inp) // inp.shape[0]
            if in_splits is None:
                return nbytes(inp) * peers // (peers + 1)
            group = kw.get("group")
            me = dist.get_rank(group)
            return row * (sum(in_splits) - in_splits[me])

        wrap("all_to_all_single", a2a)
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist

        for name, original in self._saved.items():
            setattr(dist, name, original)


def run(case: dict, timeout: float = 600) -> list[dict]:
    return spawn_ranks(_rank, case["tp"] * case["dp"], case, timeout)


def main() -> None:
    print("RESULT " + json.dumps(run(json.loads(sys.argv[1]))), flush=True)


if __name__ == "__main__":
    main()
