"""Which torch form stands in for which of upstream's Triton kernels: the one table the
platform registers with vLLM's kernel-override registry (``vllm.triton_utils.dispatcher``),
so ``kernel[grid](...)`` in upstream's runner calls the form instead."""

from __future__ import annotations

from vllm.ascend.worker.v2 import (
    buffer_utils,
    cp_utils,
    gumbel,
    input_batch,
    logits_processing,
    mamba_hybrid,
    rejection_sampler_utils,
    rope,
    speculator,
)

_V2 = "vllm.v1.worker.gpu."
_SAMPLE = _V2 + "sample."
_SD = _V2 + "spec_decode."
_RS, _RSU = _SD + "rejection_sampler.", _SD + "rejection_sampler_utils."
_TDAR = _SD + "target_dependent_ar.speculator."

KERNELS = {
    # input_batch.py
    _V2 + "input_batch._prepare_pos_seq_lens_kernel": input_batch.prepare_pos_seq_lens,
    _V2
    + "input_batch._combine_sampled_and_draft_tokens_kernel": input_batch.combine_sampled_and_draft_tokens,
    _V2 + "input_batch._prepare_prefill_inputs_kernel": input_batch.prepare_prefill_inputs,
    _V2 + "input_batch._get_num_sampled_and_rejected_kernel": input_batch.get_num_sampled_and_rejected,
    _V2 + "input_batch._post_update_kernel": input_batch.post_update,
    _V2 + "input_batch._post_update_num_computed_tokens_kernel": input_batch.post_update_num_computed_tokens,
    _V2 + "input_batch._expand_idx_mapping_kernel": input_batch.expand_idx_mapping,
    _V2 + "buffer_utils._apply_write_kernel": buffer_utils.apply_write,
    _V2 + "cp_utils._dcp_local_seq_lens_kernel": cp_utils.dcp_local_seq_lens,
    _V2 + "mm.rope._prepare_rope_positions_kernel": rope.prepare_rope_positions,
    _V2 + "model_states.mamba_hybrid._scatter_num_accepted_kernel": mamba_hybrid.scatter_num_accepted,
    _V2 + "model_states.mamba_hybrid._fill_num_accepted_kernel": mamba_hybrid.fill_num_accepted,
    # sampling
    _SAMPLE + "gumbel._temperature_kernel": gumbel.apply_temperature,
    _SAMPLE + "gumbel._gumbel_sample_kernel": gumbel.gumbel_sample,
    _SAMPLE + "gumbel._gumbel_combine_kernel": gumbel.gumbel_combine,
    _SAMPLE + "min_p._min_p_kernel": logits_processing.apply_min_p,
    _SAMPLE + "penalties._penalties_kernel": logits_processing.apply_penalties,
    _SAMPLE + "penalties._bincount_kernel": logits_processing.bincount,
    _SAMPLE + "logit_bias._bias_kernel": logits_processing.apply_bias,
    _SAMPLE + "bad_words._bad_words_kernel": logits_processing.apply_bad_words,
    _SAMPLE + "logprob._topk_log_softmax_kernel": logits_processing.topk_log_softmax,
    _SAMPLE + "logprob._ranks_kernel": logits_processing.token_ranks,
    _SAMPLE + "logprob._fill_logprob_token_ids_kernel": logits_processing.fill_logprob_token_ids,
    _SAMPLE + "prompt_logprob._prompt_logprobs_token_ids_kernel": logits_processing.prompt_logprobs_token_ids,
    _V2 + "structured_outputs._apply_grammar_bitmask_kernel": logits_processing.apply_grammar_bitmask,
    _SAMPLE
    + "thinking_budget._update_committed_marker_cache_kernel": logits_processing.update_committed_marker_cache,
    _SAMPLE + "thinking_budget._thinking_budget_kernel": logits_processing.apply_thinking_budget,
    # speculative decoding
    _RS + "_gather_draft_sampled_kernel": rejection_sampler_utils.gather_draft_sampled,
    _RS + "_flatten_sampled_kernel": rejection_sampler_utils.flatten_sampled,
    _RSU + "_compute_local_logits_stats_kernel": rejection_sampler_utils.compute_local_logits_stats,
    _RSU + "_rejection_kernel": rejection_sampler_utils.rejection,
    _RSU + "_resample_kernel": rejection_sampler_utils.resample,
    _RSU + "_insert_resampled_kernel": rejection_sampler_utils.insert_resampled,
    _TDAR + "_prepare_prefill_inputs_kernel": speculator.draft_prefill_inputs,
    _TDAR + "_prepare_decode_inputs_kernel": speculator.draft_decode_inputs,
    _TDAR + "_update_draft_inputs_kernel": speculator.update_draft_inputs,
    _SD + "standalone_ar.speculator._prepare_prefill_inputs_kernel": speculator.standalone_prefill_inputs,
    _SD + "ngram.speculator._ngram_scan_kernel": speculator.ngram_scan,
    _SD + "ngram.speculator._ngram_finalize_kernel": speculator.ngram_finalize,
}


def register_kernel_forms() -> None:
    from vllm.triton_utils.dispatcher import register_kernels

    register_kernels(KERNELS)
