"""Decode graphs without an engine: how the platform chooses the graph mode (and refuses
it), how a padded graph step's host lists are completed, the selector inside a graph, and
the one-line capture errors."""

from __future__ import annotations

import functools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DeepseekV3Config, Qwen2Config

from tests.support.models import engine_config
from vllm.ascend.errors import AscendStartupError
from vllm.ascend.graph import capture, host_params
from vllm.ascend.moe import selector
from vllm.ascend.moe.selector import MoEComm, MoELayout

EP2 = {"enable_expert_parallel": True, "tensor_parallel_size": 2}
TINY = dict(
    hidden_size=64, num_hidden_layers=2, vocab_size=256, num_attention_heads=4, max_position_embeddings=512
)


_engine_config = functools.partial(engine_config, dtype="bfloat16")  # the NPU path's dtype


def _qwen2():
    return Qwen2Config(
        architectures=["Qwen2ForCausalLM"], intermediate_size=128, num_key_value_heads=2, **TINY
    )


def _deepseek():
    return DeepseekV3Config(
        architectures=["DeepseekV3ForCausalLM"],
        intermediate_size=128,
        moe_intermediate_size=32,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=0,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_rope_head_dim=64,
        qk_nope_head_dim=32,
        v_head_dim=32,
        n_group=1,
        topk_group=1,
        num_key_value_heads=4,
        **TINY,
    )


def test_the_npu_kernels_capture_decode_graphs_by_default(tmp_path, monkeypatch):
    from vllm.config.compilation import CUDAGraphMode

    monkeypatch.setenv("VLLM_ASCEND_KERNELS", "npu")
    config = _engine_config(tmp_path, _qwen2(), max_num_seqs=8)
    assert config.compilation_config.cudagraph_mode == CUDAGraphMode.FULL_DECODE_ONLY
    assert config.compilation_config.decode_cudagraph_capture_request_sizes  # upstream's sizes
    eager = _engine_config(tmp_path, _qwen2(), max_num_seqs=8, enforce_eager=True)
    assert eager.compilation_config.cudagraph_mode == CUDAGraphMode.NONE


def test_the_reference_kernels_never_capture(tmp_path, monkeypatch):
    from vllm.config.compilation import CUDAGraphMode

    monkeypatch.setenv("VLLM_ASCEND_KERNELS", "reference")
    config = _engine_config(tmp_path, _qwen2(), dtype="float32")
    assert config.compilation_config.cudagraph_mode == CUDAGraphMode.NONE
    assert not config.compilation_config.decode_cudagraph_capture_request_sizes


@pytest.mark.parametrize(
    "make, engine_args, reason",
    [
        (_deepseek, {**EP2, "additional_config": {"moe_comm_method": "alltoall"}}, "forced AllToAll"),
        (_qwen2, {"tensor_parallel_size": 2, "prefill_context_parallel_size": 2}, "context parallelism"),
        (_qwen2, {"enable_sleep_mode": True}, "sleep mode"),
        (_qwen2, {"enable_lora": True}, "LoRA"),
    ],
    ids=["forced-alltoall", "context-parallel", "sleep-mode", "lora"],
)
def test_refused_combinations_keep_graphs_off_and_say_why(tmp_path, monkeypatch, make, engine_args, reason):
    from vllm.config.compilation import CUDAGraphMode

    from vllm.ascend.graph.policy import graph_refusal

    monkeypatch.setenv("VLLM_ASCEND_KERNELS", "npu")
    config = _engine_config(tmp_path, make(), **engine_args)
    assert config.compilation_config.cudagraph_mode == CUDAGraphMode.NONE
    assert reason in (graph_refusal(config) or "")


def test_graphs_stay_off_where_attention_would_be_one_opaque_custom_op(tmp_path, monkeypatch):
    """torch_npu's capture sees no op inside a Python custom op (torch stashes the dispatch
    mode while the op runs), so an attention call there would never be updated."""
    from vllm.platforms import current_platform

    from vllm.ascend.graph.policy import graph_refusal

    monkeypatch.setenv("VLLM_ASCEND_KERNELS", "npu")
    config = _engine_config(tmp_path, _qwen2(), max_num_seqs=8)
    assert graph_refusal(config) is None
    monkeypatch.setattr(type(current_platform), "opaque_attention_op", classmethod(lambda cls: True))
    assert "opaque custom op" in graph_refusal(config)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=0, max_size=6), st.integers(1, 6), st.integers(1, 4), st.data())
def test_a_padded_step_gets_the_captured_shape(real_lens, pads, q_len, data):
    """Upstream's padding (requests of no tokens and length 0 after the real ones) becomes
    padding requests of q_len rows each attending to their own keys; the real requests keep
    their lists and the last cumulative length is the padded token count."""
    real = [0]
    for n in real_lens:
        real.append(real[-1] + n)
    seq_lens = [data.draw(st.integers(n, 100)) for n in real_lens]
    num_tokens = real[-1] + pads * q_len
    starts, lens = host_params.pad_to_graph(real + [real[-1]] * pads, seq_lens + [0] * pads, num_tokens)
    assert starts[: len(real)] == real and lens[: len(seq_lens)] == seq_lens
    assert starts[-1] == num_tokens and len(starts) == len(real) + pads
    assert [b - a for a, b in zip(starts[len(real) - 1 :], starts[len(real) :])] == [q_len] * pads
    assert lens[len(seq_lens) :] == [q_len] * pads
    # an unpadded step is left as it is
    assert host_params.pad_to_graph(real, seq_lens, real[-1]) == (real, seq_lens)


def test_a_padded_step_without_padding_requests_is_refused():
    with pytest.raises(ValueError, match="no padding request"):
        host_params.pad_to_graph([0, 1, 2], [5, 6], 4)


def test_inside_a_graph_alltoall_becomes_allgather():
    layout = MoELayout(
        expert_parallel=True,
        ep_size=2,
        tp_size=2,
        num_experts=8,
        top_k=2,
        hidden_size=64,
        soc="A3",
        mc2_capacity=16,
        linear_placement=True,
        quantized=False,
    )
    assert selector.choose(8, layout) is MoEComm.ALLTOALL  # hidden 64: outside MC2's A3 range
    assert selector.choose(8, layout, in_graph=True) is MoEComm.ALLGATHER
    assert selector.choose(8, layout, MoEComm.MC2, in_graph=True) is MoEComm.MC2
    assert selector.choose(8, layout, MoEComm.ALLGATHER, in_graph=True) is MoEComm.ALLGATHER


@pytest.mark.parametrize("code", ["207005", "207007", "207008"])
def test_capture_resource_errors_become_one_line(code):
    with pytest.raises(AscendStartupError) as raised, capture.capture_errors():
        raise RuntimeError(f"AclmdlRICaptureBegin: error code is {code}\n[ERROR] details")
    message = str(raised.value)
    assert "\n" not in message and code in message and "--enforce-eager" in message


def test_other_capture_errors_are_not_reworded():
    with pytest.raises(RuntimeError, match="something else") as raised, capture.capture_errors():
        raise RuntimeError("something else")
    assert not isinstance(raised.value, AscendStartupError)


@settings(max_examples=200, deadline=None)
@given(
    q_lens=st.lists(st.integers(1, 4), min_size=1, max_size=40),
    width=st.integers(1, 64),
    block_size=st.sampled_from([16, 128]),
    spare=st.integers(0, 600),
)
def test_capture_lengths_are_the_longest_the_blocknum_rule_allows(q_lens, width, block_size, spare):
    """Each request's capture length is whole blocks, at least its query rows and at most the
    block table's width; together they need at most the cache's blocks; the first takes the
    longest a replay can bring when the cache has room for it."""
    from vllm.ascend.graph.host_params import capture_lengths

    least = sum(-(-q // block_size) for q in q_lens)
    num_blocks = least + spare
    lens = capture_lengths(q_lens, width, block_size, num_blocks)
    assert len(lens) == len(q_lens)
    assert all(n % block_size == 0 and q <= n <= width * block_size for n, q in zip(lens, q_lens))
    assert sum(n // block_size for n in lens) <= num_blocks
    if spare >= width - 1:  # the first request holds one block of its own already
        assert lens[0] == width * block_size


def test_capture_lengths_refuse_a_cache_too_small_for_the_graph():
    from vllm.ascend.graph.host_params import capture_lengths

    with pytest.raises(ValueError, match="more blocks than"):
        capture_lengths([1] * 8, 4, 128, 7)


@pytest.mark.parametrize("kernels", ["reference", "npu"])
def test_the_graph_choice_is_said_for_every_config_even_without_a_model(kernels, monkeypatch):
    """The start-up line formats whatever upstream resolved (an engine config without a
    model has no decode graph sizes): a logging error here fails a bare ``VllmConfig()``
    wherever log records are formatted eagerly (pytest's capture, for one)."""
    from vllm.config import VllmConfig

    from vllm.ascend.graph import policy

    said = []
    monkeypatch.setattr(policy.logger, "info_once", lambda fmt, *args: said.append(fmt % args))
    monkeypatch.setenv("VLLM_ASCEND_KERNELS", kernels)
    VllmConfig()
    assert len(said) <= 1 and all(line.startswith("Ascend platform: decode graphs") for line in said)
