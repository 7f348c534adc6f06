"""Start-up checks for ``--speculative-config`` on the Ascend platform.

Upstream's speculators, rejection sampler and MTP model run unchanged on Model Runner V2;
the platform supplies their kernels (``worker/v2/rejection_sampler_utils.py``,
``worker/v2/speculator.py``) and multi-token decode rows in MLA (``attention/mla.py``).
What this platform has not been built or tested for is refused here, in one line.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.logger import init_logger

logger = init_logger(__name__)


@dataclass(frozen=True)
class Method:
    tested: bool  # served in tests/engine/test_model_runner_v2.py
    in_graphs: bool  # its drafter runs in decode graphs (the speculator's own graph managers)


# The speculative methods the Ascend runner runs (the start-up check refuses the others;
# "deepseek_mtp" is rewritten to "mtp" by upstream's config). The torch forms of
# worker/v2's forms cover these drafters' kernels only; `ngram_gpu` runs the same
# drafter as `ngram` with no test of its own.
METHODS = {
    "mtp": Method(tested=True, in_graphs=True),
    "ngram": Method(tested=True, in_graphs=False),
    "ngram_gpu": Method(tested=False, in_graphs=False),
    "draft_model": Method(tested=True, in_graphs=False),
    "eagle": Method(tested=True, in_graphs=True),
}
TESTED_METHODS = tuple(name for name, method in METHODS.items() if method.tested)
GRAPH_METHODS = tuple(name for name, method in METHODS.items() if method.in_graphs)


def validate_speculative_config(vllm_config) -> None:
    """Raise ValueError naming the setting to change, or return."""
    spec = vllm_config.speculative_config
    if spec is None:
        return
    tp = vllm_config.parallel_config.tensor_parallel_size
    if spec.method not in TESTED_METHODS:
        logger.warning_once(
            "Ascend platform: speculative method %r is not tested on this platform (tested: %s)",
            spec.method,
            ", ".join(TESTED_METHODS),
        )
    draft_tp = spec.draft_tensor_parallel_size
    if draft_tp is not None and draft_tp != tp:
        # Upstream would build a second tensor-parallel group for the drafter; the
        # Ascend groups (MC2, the MoE strategies) are made once per worker.
        raise ValueError(
            f"speculative draft_tensor_parallel_size {draft_tp} differs from "
            f"--tensor-parallel-size {tp}; the Ascend drafter runs on the target's ranks: "
            f"drop draft_tensor_parallel_size or set it to {tp}"
        )
    if spec.rejection_sample_method == "block":
        raise ValueError(
            "speculative rejection_sample_method 'block' runs upstream Triton kernels with "
            "no Ascend implementation: use 'standard'"
        )
    if spec.rejection_sample_method == "fly":
        raise ValueError(
            "speculative rejection_sample_method 'fly' runs upstream Triton kernels with no "
            "Ascend implementation: use 'standard'"
        )
    if spec.parallel_drafting:
        raise ValueError(
            "speculative parallel_drafting is not supported on Ascend (its input copy is an "
            "upstream Triton kernel with no Ascend implementation): drop parallel_drafting"
        )
    quantization = vllm_config.model_config.quantization
    if spec.method == "mtp" and quantization not in (None, "ascend"):
        # the MTP module follows the checkpoint's description only with the Ascend method
        raise ValueError(
            f"speculative decoding with a {quantization}-quantized model is not supported on "
            "Ascend: serve an msModelSlim checkpoint (--quantization ascend) or a float one"
        )
