"""The memory profile with attention.

Upstream profiles one forward of the largest batch without attention (a GPU backend's
workspace is small or pre-allocated). The NPU attention kernels' workspaces should count
in the peak (not measured on an NPU), so with the NPU kernels the profile forward runs
attention too, over a temporary KV cache
just large enough for the dummy batch (each dummy request attends over its own tokens,
as a prefill would), released before the real cache is sized."""

from __future__ import annotations

from vllm.logger import init_logger
from vllm.utils.math_utils import cdiv

logger = init_logger(__name__)


def even_split(num_tokens: int, max_num_reqs: int) -> list[int]:
    """Requests of near-equal length, split as Model Runner V2's dummy batch is."""
    num_reqs = min(num_tokens, max_num_reqs)
    base, extra = divmod(num_tokens, num_reqs)
    return [base + (i >= num_reqs - extra) for i in range(num_reqs)]


def dummy_split(max_num_tokens: int, max_num_reqs: int, speculator=None, draft_slots: int = 0) -> list[int]:
    """The request lengths of the profile's dummy batch as V2's ``_dummy_run`` makes them: with
    a speculator, no more requests than its queries per request allow, and room for the
    ``draft_slots`` each request's drafting adds (the speculative config's
    ``max_num_new_slots_for_drafting``)."""
    num_tokens, num_reqs = max_num_tokens, min(max_num_tokens, max_num_reqs)
    if speculator is not None:
        num_reqs = min(num_reqs, max_num_tokens // speculator.num_query_per_req)
        num_tokens = min(num_tokens, max_num_tokens - num_reqs * draft_slots)
    return even_split(num_tokens, num_reqs)


def init_profiling_kv_cache(runner, split: list[int], draft_tokens: int = 0) -> None:
    """Give ``runner`` a KV cache that holds every request of ``split``, plus vLLM's
    null block, through upstream's own KV-cache planning. ``draft_tokens``: the drafter's
    steps over the dummy batch (a speculator's propose after the forward) attend over up to
    that many tokens more per request, each counted against the cache's blocks."""
    from vllm.v1.core.kv_cache_config_builder import get_kv_cache_config_builder
    from vllm.v1.core.kv_cache_planning import get_kv_cache_groups_from_builder

    vllm_config = runner.vllm_config
    blocks = 1 + sum(cdiv(n + draft_tokens, vllm_config.cache_config.block_size) for n in split)
    builder = get_kv_cache_config_builder(vllm_config)
    groups = get_kv_cache_groups_from_builder(builder, vllm_config, runner.get_kv_cache_spec())
    config = builder.get_kv_cache_config_from_groups(vllm_config, groups, num_blocks=blocks)
    runner.initialize_kv_cache(config, is_profiling=True)
    vllm_config.cache_config.num_gpu_blocks = config.num_blocks
    logger.info(
        "Memory profile with attention: %d tokens in %d requests (%d draft tokens each), %d KV blocks",
        sum(split),
        len(split),
        draft_tokens,
        config.num_blocks,
    )
