"""One metadata all-reduce per DP step (vllm/ascend/worker/dp_step.py), on real gloo
across processes: the step's first call (the runner's) all-reduces the packed table,
the drafter's calls are answered from it, and mismatched drafter passes are refused.
Upstream's fallback outside an armed step needs vLLM's DP group; the serving tests cover
it (no upstream-style all-reduce may be recorded there)."""

from __future__ import annotations

import multiprocessing as mp
import traceback
from types import SimpleNamespace

from .conftest import free_port


def _rank_main(rank: int, world: int, port: int, scenario: str, out) -> None:
    try:
        import torch
        import torch.distributed as dist

        from vllm.ascend.worker.dp_step import DPStepError, StepPlan, StepSync

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        issued = []

        def reduce(tensor, _config):
            issued.append(tuple(tensor.shape))
            tensor = tensor.clone()
            dist.all_reduce(tensor)
            return tensor

        config = SimpleNamespace(data_parallel_size=world, data_parallel_rank=rank, num_ubatches=2)
        sync = StepSync(reduce)
        result = {}
        if scenario == "mtp_step":
            tokens = [7, 3][rank]  # rank 1 is smaller; rank 0 has a prefill
            sync.arm(StepPlan(has_prefill=rank == 0, drafter_passes=2, drafter_first=tokens,
                              drafter_rest=[2, 1][rank]))
            ubatch, across, mode = sync(tokens, tokens, False, 0, config)
            result["target"] = (ubatch, across.tolist(), mode)
            first = sync(tokens, tokens, False, 0, config)[1].tolist()
            rest = sync([2, 1][rank], [2, 1][rank], False, 0, config)[1]
            result["rest"] = rest.tolist()
            rest[rank] = 99  # the drafter writes its own entry in place
            again = sync(1, 1, False, 0, config)[1].tolist()
            result.update(first=first, again=again,
                          has_prefill=sync.agreement.has_prefill, max_tokens=int(sync.agreement.table[1].max()))
            try:
                sync(50, 50, False, 0, config)  # more than agreed
            except DPStepError as e:
                result["too_many"] = str(e)
            sync.disarm()
        elif scenario == "passes_differ":
            sync.arm(StepPlan(has_prefill=False, drafter_passes=[2, 1][rank], drafter_first=2, drafter_rest=2))
            try:
                sync(2, 2, False, 0, config)
            except DPStepError as e:
                result["error"] = str(e)
        result["issued"] = issued
        result["collectives"] = sync.collectives
        out.put((rank, result))
        dist.destroy_process_group()
        del torch
    except BaseException:
        out.put((rank, {"crash": traceback.format_exc()}))


def _run(scenario: str) -> dict[int, dict]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, 2, port, scenario, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(60)
    for rank, result in results.items():
        assert "crash" not in result, result["crash"]
    return results


def test_an_mtp_step_costs_one_all_reduce_and_the_drafter_reads_the_agreement():
    results = _run("mtp_step")
    for rank, r in results.items():
        assert r["collectives"] == 1 and r["issued"] == [(8, 2)], r
        assert r["target"] == (False, [7, 3], 0)
        assert r["first"] == [7, 3] and r["rest"] == [2, 1]
        assert r["again"] == [2, 1]  # an in-place write by one caller does not reach the next
        assert r["has_prefill"] is True and r["max_tokens"] == 7
        assert "needs 50 tokens" in r["too_many"]


def test_ranks_that_would_run_different_drafter_passes_are_refused_on_every_rank():
    for r in _run("passes_differ").values():
        assert "different numbers of drafter forwards" in r["error"] and "[2, 1]" in r["error"]
        assert r["collectives"] == 1
