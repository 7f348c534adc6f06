"""Documented limits of the NPU kernels that depend only on the configuration are
start-up errors (one line), not first-step failures: npu_attention_update's number of
partial results (PCP x DCP <= 16) and head size, and npu_fused_infer_attention_score's
head counts and head size."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm.ascend.platform.checks import check_context_parallel, check_npu_attention_shapes, check_npu_partials


@pytest.fixture
def npu_kernels(monkeypatch):
    monkeypatch.setenv("VLLM_ASCEND_KERNELS", "npu")


def _config(tp=1, pcp=1, dcp=1, heads=8, kv_heads=2, head_size=128, mla=False):
    pc = SimpleNamespace(
        tensor_parallel_size=tp,
        prefill_context_parallel_size=pcp,
        decode_context_parallel_size=dcp,
        data_parallel_size=1,
        cp_kv_cache_interleave_size=1,
        pipeline_parallel_size=1,
        enable_expert_parallel=False,
    )
    model = SimpleNamespace(
        use_mla=mla,
        is_moe=False,
        is_hybrid=False,
        is_attention_free=False,
        hf_text_config=SimpleNamespace(kv_lora_rank=512, qk_rope_head_dim=64),
        get_total_num_kv_heads=lambda: kv_heads,
        get_num_attention_heads=lambda p: heads // p.tensor_parallel_size,
        get_num_kv_heads=lambda p: max(1, kv_heads // p.tensor_parallel_size),
        get_head_size=lambda: head_size,
        get_sliding_window=lambda: None,
    )
    return SimpleNamespace(
        parallel_config=pc,
        model_config=model,
        cache_config=SimpleNamespace(block_size=128),
        speculative_config=None,
        kv_transfer_config=None,
    )


def test_partial_results_limit():
    check_npu_partials(2, 8, 128)  # 16: the documented maximum
    with pytest.raises(ValueError, match=r"2 x 16 = 32 is more than the 16 partial results"):
        check_npu_partials(2, 16, 128)
    for head_dim in (4, 12, 520):
        with pytest.raises(ValueError, match=f"head size {head_dim}"):
            check_npu_partials(2, 1, head_dim)
    check_npu_partials(1, 2, 8)


def test_context_parallel_config_applies_the_limit_with_the_npu_kernels_only(npu_kernels, monkeypatch):
    too_many = _config(tp=16, pcp=2, dcp=16, mla=True)
    with pytest.raises(ValueError, match="npu_attention_update"):
        check_context_parallel(too_many)
    check_context_parallel(_config(tp=8, pcp=2, dcp=8, mla=True))  # 16 partials
    with pytest.raises(ValueError, match="head size 4"):  # GQA merges head_size-wide outputs
        check_context_parallel(_config(tp=2, pcp=2, kv_heads=2, head_size=4))
    monkeypatch.setenv("VLLM_ASCEND_KERNELS", "reference")  # the reference merge has no such limit
    check_context_parallel(too_many)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"heads": 512, "kv_heads": 8}, "at most 256 query heads"),
        ({"tp": 2, "heads": 256, "kv_heads": 4, "dcp": 4}, "lower --decode-context-parallel-size"),
        ({"head_size": 576}, "head size 512"),
        ({"head_size": 72}, "multiple of 16"),
        ({"heads": 130, "kv_heads": 2}, "at most 64 per KV head"),
        ({"heads": 12, "kv_heads": 8}, "multiple of the KV heads"),
        ({"mla": True, "heads": 256}, "at most 128 query heads per rank"),
    ],
)
def test_attention_head_limits_are_start_up_errors(kwargs, message, npu_kernels):
    with pytest.raises(ValueError, match=message):
        check_npu_attention_shapes(_config(**kwargs))


def test_attention_head_limits_accept_what_the_kernels_take(npu_kernels, monkeypatch):
    check_npu_attention_shapes(_config(heads=128, kv_heads=2, head_size=128))  # 64 per KV head
    check_npu_attention_shapes(_config(tp=2, heads=512, kv_heads=8))  # 256 per rank
    check_npu_attention_shapes(_config(mla=True, heads=128))
    check_npu_attention_shapes(_config(tp=2, dcp=2, mla=True, heads=128))  # DCP gathers 128
    monkeypatch.setenv("VLLM_ASCEND_KERNELS", "reference")
    check_npu_attention_shapes(_config(heads=512, kv_heads=8, head_size=72))
