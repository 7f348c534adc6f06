"""Data parallelism: one metadata collective per engine step.

With DP every rank must agree each step on what every rank runs, or the MoE layers'
collectives mismatch and the server hangs. Upstream's V1 runner all-reduces an
``int32[4, dp]`` tensor (tokens, padded tokens, micro-batching, graph mode) in
``coordinate_batch_across_dp``, and the MTP drafter calls it again in the same step (once
more for k=1, twice for k>=2). Everything the drafter will need is known when the
runner's call is made, so ``StepSync`` (installed through the hook patch on upstream's
``dp_utils``: ``set_dp_metadata_exchange``) packs the whole step into that call's
all-reduce and answers the drafter's calls from it:

* rows 0-3: upstream's (tokens, padded tokens, micro-batching, graph mode);
* ``has_prefill``: a request of this rank computes more than a decode step's tokens;
* ``drafter_passes``: the drafter's forwards this step (k with MTP; must agree);
* ``drafter_first`` / ``drafter_rest``: the tokens of its first pass and of the others.

The runner arms a step with a ``StepPlan`` (``NPUModelRunner.execute_model`` and
``_dummy_run``) and disarms it when the step's last forward is done. Outside an armed
step the exchange leaves the all-reduce to upstream. The hook exchanges only the
table: upstream's own rules (padding, micro-batching, graph mode) run on the answer,
and each call says whether the model or a drafter asks.
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
    drafter_first: int = 0  # tokens of the drafter's first forward
    drafter_rest: int = 0  # tokens of each later forward


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
    """The DP metadata exchange upstream's ``dp_utils`` calls (``set_dp_metadata_exchange``)."""

    def __init__(self, reduce=None) -> None:
        # reduce(tensor, parallel_config) -> the SUM over the DP ranks (CPU tensor)
        self._reduce = reduce or _sum_over_dp_group
        self._plan: StepPlan | None = None
        self._agreement: StepAgreement | None = None
        self._drafter_passes = 0
        self.collectives = 0  # metadata all-reduces issued (for tests and the benchmark)

    # -- the runner's side -------------------------------------------------------------
    def arm(self, plan: StepPlan) -> bool:
        """Start a step; False (and nothing changes) if one is already armed. The runner's
        thread is the only caller of arm, disarm and the hook."""
        if self._plan is not None:
            return False
        self._plan, self._agreement, self._drafter_passes = plan, None, 0
        return True

    def disarm(self) -> None:
        self._plan, self._agreement, self._drafter_passes = None, None, 0

    @property
    def agreement(self) -> StepAgreement | None:
        """This step's agreement once the model's call has been made (None before/outside)."""
        return self._agreement

    # -- the hook ------------------------------------------------------------------------
    def __call__(
        self,
        num_tokens_unpadded: int,
        num_tokens_padded: int,
        should_attempt_ubatching: bool,
        cudagraph_mode: int,
        parallel_config,
        purpose: str,
    ) -> torch.Tensor | None:
        """Every DP rank's (tokens, padded tokens, micro-batching, graph mode) as upstream's
        int32 ``[4, dp]`` table; None: upstream all-reduces it itself."""
        plan = self._plan
        if plan is None:  # not inside a step the runner armed (e.g. a profile run of upstream's)
            self.collectives += 1
            return None
        if purpose != "drafter":
            if self._agreement is None:
                mine = [num_tokens_unpadded, num_tokens_padded, int(should_attempt_ubatching), cudagraph_mode]
                self._agreement = self._all_reduce(plan, mine, parallel_config)
            return self._agreement.table[:UPSTREAM_ROWS].clone()
        if self._agreement is None:
            raise DPStepError("a drafter asked for the step's DP metadata before the model's forward")
        # a drafter's forward: answered from the agreement, no collective
        row = DRAFTER_FIRST if self._drafter_passes == 0 else DRAFTER_REST
        self._drafter_passes += 1
        table, rank = self._agreement.table, parallel_config.data_parallel_rank
        agreed = int(table[row, rank])
        if num_tokens_padded > agreed:
            raise DPStepError(
                f"the drafter's forward {self._drafter_passes} needs {num_tokens_padded} tokens on "
                f"DP rank {rank}, the step agreed on {agreed}"
            )
        answer = torch.zeros_like(table[:UPSTREAM_ROWS])
        answer[0] = answer[1] = table[row]  # row 2 (micro-batching) stays 0: none for drafters
        answer[3] = table[3]
        return answer

    def _all_reduce(self, plan: StepPlan, upstream_values: list[int], parallel_config) -> StepAgreement:
        dp, rank = parallel_config.data_parallel_size, parallel_config.data_parallel_rank
        column = torch.zeros(ROWS, dp, dtype=torch.int32)
        column[:, rank] = torch.tensor(
            [
                *upstream_values,
                int(plan.has_prefill),
                plan.drafter_passes,
                plan.drafter_first,
                plan.drafter_rest,
            ],
            dtype=torch.int32,
        )
        table = self._reduce(column, parallel_config)
        self.collectives += 1
        passes = table[DRAFTER_PASSES]
        if bool((passes != passes[0]).any()):
            raise DPStepError(
                f"DP ranks would run different numbers of drafter forwards this step "
                f"({passes.tolist()}); speculative decoding with data parallelism needs the "
                "same number of speculative tokens on every rank (no dynamic speculation)"
            )
        return StepAgreement(table)


def _sum_over_dp_group(tensor: torch.Tensor, parallel_config) -> torch.Tensor:
    """The all-reduce upstream would issue: on the DP group's device group, or its CPU
    group when ``disable_nccl_for_dp_synchronization``."""
    from vllm.distributed.parallel_state import get_dp_group

    group = get_dp_group()
    if parallel_config.disable_nccl_for_dp_synchronization:
        device, process_group = "cpu", group.cpu_group
    else:
        device, process_group = group.device, group.device_group
    tensor = tensor.to(device)
    dist.all_reduce(tensor, group=process_group)
    return tensor.cpu()


_sync: StepSync | None = None


def install() -> StepSync:
    """Route upstream's DP metadata exchange through this process's StepSync (idempotent)."""
    global _sync
    if _sync is None:
        from vllm.v1.worker import dp_utils

        _sync = StepSync()
        dp_utils.set_dp_metadata_exchange(_sync)
    return _sync
