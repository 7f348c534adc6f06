"""Data parallelism: one metadata collective per engine step.

With DP every rank must agree each step on what every rank runs, or the MoE layers'
collectives mismatch and the server hangs. Upstream's V1 runner all-reduces an
``int32[4, dp]`` tensor (tokens, padded tokens, micro-batching, graph mode) in
``coordinate_batch_across_dp``, and the MTP drafter calls it again in the same step (once
more for k=1, twice for k>=2). Everything the drafter will need is known when the
runner's call is made, so ``StepSync`` (installed through patch 0009's hook) packs the
whole step into that call's all-reduce and answers the drafter's calls from it:

* rows 0-3: upstream's (tokens, padded tokens, micro-batching, graph mode);
* ``has_prefill``: a request of this rank computes more than a decode step's tokens;
* ``drafter_passes``: the drafter's forwards this step (k with MTP; must agree);
* ``drafter_first`` / ``drafter_rest``: the tokens of its first pass and of the others.

The runner arms a step with a ``StepPlan`` (``NPUModelRunner.execute_model`` and
``_dummy_run``) and disarms it when the step's last forward is done. Outside an armed
step the coordinator falls back to upstream's all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from vllm.logger import init_logger

logger = init_logger(__name__)

UPSTREAM_ROWS = 4
HAS_PREFILL, DRAFTER_PASSES, DRAFTER_FIRST, DRAFTER_REST = range(UPSTREAM_ROWS, UPSTREAM_ROWS + 4)
ROWS = UPSTREAM_ROWS + 4


class DPStepError(RuntimeError):
    """The DP ranks cannot run this step in lock step (the message says why)."""


@dataclass(frozen=True)
class StepPlan:
    """What this rank will run in one engine step, beyond the target forward's tokens."""

    has_prefill: bool
    drafter_passes: int = 0  # forwards of the drafter (0: no drafter this step)
    drafter_first: int = 0   # tokens of the drafter's first forward
    drafter_rest: int = 0    # tokens of each later forward


@dataclass(frozen=True)
class StepAgreement:
    """Every rank's plan for the current step (CPU int32 ``[ROWS, dp]``)."""

    table: torch.Tensor

    def across(self, row: int) -> torch.Tensor:
        return self.table[row].clone()  # callers write their own entry in place

    @property
    def has_prefill(self) -> bool:
        return bool(self.table[HAS_PREFILL].any())


class StepSync:
    """The coordinator patch 0009 calls instead of ``_synchronize_dp_ranks``."""

    def __init__(self, reduce=None) -> None:
        # reduce(tensor, parallel_config) -> the SUM over the DP ranks (CPU tensor)
        self._reduce = reduce or _sum_over_dp_group
        self._plan: StepPlan | None = None
        self._agreement: StepAgreement | None = None
        self._calls = 0
        self.collectives = 0  # metadata all-reduces issued (for tests and the benchmark)

    # -- the runner's side -------------------------------------------------------------
    def arm(self, plan: StepPlan) -> bool:
        """Start a step; False (and nothing changes) if one is already armed. The runner's
        thread is the only caller of arm, disarm and the hook."""
        if self._plan is not None:
            return False
        self._plan, self._agreement, self._calls = plan, None, 0
        return True

    def disarm(self) -> None:
        self._plan, self._agreement, self._calls = None, None, 0

    @property
    def agreement(self) -> StepAgreement | None:
        """This step's agreement once the first call has been made (None before/outside)."""
        return self._agreement

    # -- the hook ------------------------------------------------------------------------
    def __call__(self, num_tokens_unpadded: int, num_tokens_padded: int, should_attempt_ubatching: bool,
                 cudagraph_mode: int, parallel_config):
        from vllm.v1.worker import dp_utils

        plan = self._plan
        if plan is None:  # not inside a step the runner armed (e.g. a profile run of upstream's)
            self.collectives += 1
            return dp_utils._synchronize_dp_ranks(num_tokens_unpadded, num_tokens_padded,
                                                 should_attempt_ubatching, cudagraph_mode, parallel_config)
        call, self._calls = self._calls, self._calls + 1
        if call == 0:
            self._agreement = self._all_reduce(plan, num_tokens_unpadded, num_tokens_padded,
                                               should_attempt_ubatching, cudagraph_mode, parallel_config)
            table = self._agreement.table
            synced_mode = dp_utils._post_process_cudagraph_mode(table)
            should_ubatch = dp_utils._post_process_ubatch(table[:UPSTREAM_ROWS], parallel_config.num_ubatches)
            should_pad = synced_mode != 0 or should_ubatch
            return should_ubatch, dp_utils._post_process_dp_padding(table[:UPSTREAM_ROWS], should_pad), synced_mode
        # the drafter's forwards: answered from the agreement, no collective
        row = DRAFTER_FIRST if call == 1 else DRAFTER_REST
        table = self._agreement.table
        mine = int(table[row, parallel_config.data_parallel_rank])
        if num_tokens_padded > mine:
            raise DPStepError(f"the drafter's forward {call} needs {num_tokens_padded} tokens on DP rank "
                              f"{parallel_config.data_parallel_rank}, the step agreed on {mine}")
        return False, self._agreement.across(row), dp_utils._post_process_cudagraph_mode(table)

    def _all_reduce(self, plan: StepPlan, unpadded: int, padded: int, ubatch: bool, mode: int,
                    parallel_config) -> StepAgreement:
        assert padded >= unpadded
        dp, rank = parallel_config.data_parallel_size, parallel_config.data_parallel_rank
        column = torch.zeros(ROWS, dp, dtype=torch.int32)
        column[:, rank] = torch.tensor([unpadded, padded, int(ubatch), mode, int(plan.has_prefill),
                                        plan.drafter_passes, plan.drafter_first, plan.drafter_rest],
                                       dtype=torch.int32)
        table = self._reduce(column, parallel_config)
        self.collectives += 1
        passes = table[DRAFTER_PASSES]
        if bool((passes != passes[0]).any()):
            raise DPStepError(f"DP ranks would run different numbers of drafter forwards this step "
                              f"({passes.tolist()}); speculative decoding with data parallelism needs the "
                              "same number of speculative tokens on every rank (no dynamic speculation)")
        return StepAgreement(table)


def _sum_over_dp_group(tensor: torch.Tensor, parallel_config) -> torch.Tensor:
    """The all-reduce upstream would issue: on the DP group's device group, or its CPU
    group when ``disable_nccl_for_dp_synchronization``."""
    from vllm.v1.worker import dp_utils

    device, group = dp_utils._get_device_and_group(parallel_config)
    tensor = tensor.to(device)
    dist.all_reduce(tensor, group=group)
    return tensor.cpu()


_sync: StepSync | None = None


def install() -> StepSync:
    """Route upstream's DP coordination through this process's StepSync (idempotent)."""
    global _sync
    if _sync is None:
        from vllm.v1.worker import dp_utils

        _sync = StepSync()
        dp_utils.set_dp_step_coordinator(_sync)
    return _sync
