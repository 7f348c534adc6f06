"""One metadata all-reduce per DP step (vllm/ascend/worker/dp_step.py), on real gloo
across processes and through upstream's own ``coordinate_batch_across_dp`` (the hook
patch routes its exchange to the StepSync): the model's call all-reduces the packed
table, the drafter's calls are answered from it, and mismatched drafter passes are
refused. Upstream's fallback outside an armed step needs vLLM's DP group; the serving
tests cover it (no upstream-style all-reduce may be recorded there)."""

from __future__ import annotations

import multiprocessing as mp
import traceback
from types import SimpleNamespace

from tests.support.ports import free_port


def _rank_main(rank: int, world: int, port: int, scenario: str, out) -> None:
    try:
        import torch
        import torch.distributed as dist

        from vllm.v1.worker import dp_utils

        from vllm.ascend.worker.dp_step import DPStepError, StepPlan, StepSync

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        issued = []

        def reduce(tensor, _config):
            issued.append(tuple(tensor.shape))
            tensor = tensor.clone()
            dist.all_reduce(tensor)
            return tensor

        config = SimpleNamespace(
            data_parallel_size=world,
            data_parallel_rank=rank,
            num_ubatches=2,
            disable_nccl_for_dp_synchronization=True,
        )
        sync = StepSync(reduce)
        dp_utils.set_dp_metadata_exchange(sync)

        def coordinate(tokens: int, purpose: str):
            return dp_utils.coordinate_batch_across_dp(
                num_tokens_unpadded=tokens, allow_microbatching=False, parallel_config=config, purpose=purpose
            )

        result = {}
        if scenario == "mtp_step":
            tokens = [7, 3][rank]  # rank 1 is smaller; rank 0 has a prefill
            sync.arm(
                StepPlan(
                    has_prefill=rank == 0, drafter_passes=2, drafter_first=tokens, drafter_rest=[2, 1][rank]
                )
            )
            ubatch, across, mode = coordinate(tokens, "model")
            result["target"] = (ubatch, across.tolist(), mode)
            first = coordinate(tokens, "drafter")[1].tolist()
            rest = coordinate([2, 1][rank], "drafter")[1]
            result["rest"] = rest.tolist()
            rest[rank] = 99  # the drafter writes its own entry in place
            again = coordinate(1, "drafter")[1].tolist()
            result.update(
                first=first,
                again=again,
                has_prefill=sync.agreement.has_prefill,
                max_tokens=int(sync.agreement.table[1].max()),
            )
            try:
                coordinate(50, "drafter")  # more than agreed
            except DPStepError as e:
                result["too_many"] = str(e)
            sync.disarm()
        elif scenario == "passes_differ":
            sync.arm(
                StepPlan(has_prefill=False, drafter_passes=[2, 1][rank], drafter_first=2, drafter_rest=2)
            )
            try:
                coordinate(2, "model")
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
    for result in results.values():
        assert "crash" not in result, result["crash"]
    return results


def test_an_mtp_step_costs_one_all_reduce_and_the_drafter_reads_the_agreement():
    results = _run("mtp_step")
    for r in results.values():
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
