"""The double's NPU graphs: torch_npu's own graph code (loaded from the pinned wheel) over a
capture that launches nothing and a replay that re-runs exactly what was captured, with
the Python values of capture time, and external events a replay must find recorded. Each
test compares with the same ops run eagerly."""

from __future__ import annotations

import gc

import pytest
import torch

torch_npu = pytest.importorskip("torch_npu")
if not getattr(torch_npu, "IS_CONTRACT_DOUBLE", False):
    pytest.skip("the real torch_npu is active on this host", allow_module_level=True)

from torch_npu import _graphs  # noqa: E402
from torch_npu._graphs import (  # noqa: E402
    GraphCaptureError,
    GraphReplayHang,
    GraphUpdateRace,
    StaleGraphInput,
)

BF16 = torch.bfloat16
MASK = torch.ones(2048, 2048, dtype=torch.bool).triu(1)


@pytest.fixture(autouse=True)
def no_replay_left_waiting():
    """Each test leaves no replay waiting for its update (one that fails may: it is dropped, so
    the next test does not inherit it)."""
    yield
    left, _graphs.waiting = _graphs.waiting, None
    assert left is None, "the test left a graph replay waiting for its update"


def _capture(fn, auto_dispatch=False):
    graph = torch_npu.npu.NPUGraph()
    with torch_npu.npu.graph(graph, auto_dispatch_capture=auto_dispatch):
        out = fn()
    return graph, out


def test_capture_launches_nothing_and_replay_computes_on_the_current_inputs():
    x, w, proj = torch.randn(3, 16), torch.rand(16) + 0.5, torch.randn(16, 8)

    def layer():
        normed = torch_npu.npu_rms_norm(x, w, epsilon=1e-6)[0]
        return torch.nn.functional.silu(normed @ proj) + 1.0

    graph, out = _capture(layer)
    assert out.isnan().all(), "capture computed a value; the device computes nothing before replay"
    assert graph.tasks() and graph.pool_bytes() >= out.numel() * out.element_size()
    for _ in range(2):  # new contents in the captured input each time, as a runner copies them in
        x.copy_(torch.randn(3, 16))
        graph.replay()
        torch.testing.assert_close(out, layer())


def test_capture_writes_nothing_to_memory_from_before_it():
    cache = torch.zeros(4, 8)
    index = torch.tensor([[1], [3]])
    rows = torch.ones(2, 8)
    graph, _ = _capture(lambda: torch_npu.npu_scatter_nd_update_(cache, index, rows))
    assert not cache.any(), "the capture wrote the cache"
    graph.replay()
    assert cache[1].eq(1).all() and cache[3].eq(1).all() and not cache[0].any()


def test_python_values_are_frozen_at_capture():
    x = torch.arange(6.0)
    scale = [2.0]
    graph, out = _capture(lambda: torch.mul(x, scale[0]))
    scale[0] = 3.0  # a host value changed after capture: the graph keeps its own
    graph.replay()
    torch.testing.assert_close(out, x * 2.0)


def _decode_attention_case():
    torch.manual_seed(0)
    n, kvn, d, bs = 4, 2, 16, 128
    query = torch.randn(2, n, d, dtype=BF16)
    key = torch.randn(2, kvn, bs, d, dtype=BF16)
    value = torch.randn(2, kvn, bs, d, dtype=BF16)
    fixed = dict(
        num_heads=n,
        num_key_value_heads=kvn,
        input_layout="TND",
        block_table=torch.tensor([[0], [1]], dtype=torch.int32),
        block_size=bs,
        actual_seq_lengths=[1, 2],
        atten_mask=MASK,
        sparse_mode=3,
        scale=0.25,
    )
    return query, key, value, fixed


def test_captured_attention_replays_old_host_lengths_until_updated():
    """The anchor's graph-mode accuracy bugs: the kernel's KV lengths are host values, so a
    replay keeps the capture's lengths unless torch_npu's update rewrites the task."""
    query, key, value, fixed = _decode_attention_case()
    lengths, new_lengths = [5, 7], [6, 8]

    def attend(kv_lengths=lengths):
        return torch_npu.npu_fused_infer_attention_score(
            query, key, value, actual_seq_lengths_kv=kv_lengths, **fixed
        )[0]

    # a plain capture: the task keeps the capture's lengths, whatever the inputs hold now
    graph, out = _capture(attend)
    query.copy_(torch.randn_like(query))  # the next step's query, and one more token each
    graph.replay()
    torch.testing.assert_close(out, attend(lengths), rtol=0, atol=0)
    assert not torch.equal(out, attend(new_lengths))

    # torch_npu's auto-dispatch capture makes the call an updatable task group behind an
    # external event: a replay runs up to that wait and on once the update records it
    graph, out = _capture(attend, auto_dispatch=True)
    assert any("npu_fused_infer_attention_score.out" in t for t in graph.tasks())
    assert "ExternalEvent.wait" in graph.tasks()
    update_stream = graph.graph_dispatch_mode.update_stream
    update_stream.wait_stream(torch_npu.npu.current_stream())
    graph.update(cpu_update_input=[{"actual_seq_lengths_kv": lengths}])  # update, then replay
    graph.replay()
    torch.testing.assert_close(out, attend(lengths), rtol=0, atol=0)
    update_stream.wait_stream(torch_npu.npu.current_stream())  # before the replay: the earlier one ran
    graph.replay()  # replay, then update
    assert _graphs.waiting is not None and _graphs.waiting.graph is graph  # stopped at its update's event
    graph.update(cpu_update_input=[{"actual_seq_lengths_kv": new_lengths}])
    torch.testing.assert_close(out, attend(new_lengths), rtol=0, atol=0)
    update_stream.wait_stream(torch_npu.npu.current_stream())
    graph.replay()  # one update is waited for by one replay
    with pytest.raises(GraphReplayHang, match="block for ever"):
        torch_npu.npu.synchronize()
    graph.update(cpu_update_input=[{"actual_seq_lengths_kv": new_lengths}])  # (leaves no replay waiting)


def _waiting_replay():
    """An updatable decode graph replayed once in order, then once more, now waiting for its update."""
    query, key, value, fixed = _decode_attention_case()
    graph, out = _capture(
        lambda: torch_npu.npu_fused_infer_attention_score(
            query, key, value, actual_seq_lengths_kv=[5, 7], **fixed
        ),
        auto_dispatch=True,
    )
    update_stream = graph.graph_dispatch_mode.update_stream
    update_stream.wait_stream(torch_npu.npu.current_stream())
    graph.replay()
    graph.update(cpu_update_input=[{"actual_seq_lengths_kv": [5, 7]}])
    update_stream.wait_stream(torch_npu.npu.current_stream())
    graph.replay()
    return graph, update_stream


@pytest.mark.parametrize(
    "then",
    [
        lambda graph, out: graph.replay(),
        lambda graph, out: torch_npu.npu.current_stream().synchronize(),
        lambda graph, out: torch_npu.npu_rms_norm(torch.ones(2, 4), torch.ones(4)),
    ],
    ids=["a replay", "a host wait", "a launch"],
)
def test_nothing_but_the_update_may_follow_a_replay_that_waits_for_it(then):
    graph, update_stream = _waiting_replay()
    with pytest.raises(GraphReplayHang):
        then(graph, None)
    graph.update(cpu_update_input=[{"actual_seq_lengths_kv": [6, 8]}])  # (leaves no replay waiting)
    torch_npu.npu.synchronize()


def test_an_update_stream_that_waited_after_the_replay_deadlocks():
    graph, update_stream = _waiting_replay()
    update_stream.wait_stream(torch_npu.npu.current_stream())  # now it also waits for the replay
    with pytest.raises(GraphReplayHang, match="take the wait before the replay"):
        graph.update(cpu_update_input=[{"actual_seq_lengths_kv": [6, 8]}])
    _graphs.waiting = None  # the device is stuck here for good: nothing to recover


def test_an_update_that_did_not_wait_for_the_last_replay_races_it():
    query, key, value, fixed = _decode_attention_case()
    graph, _ = _capture(
        lambda: torch_npu.npu_fused_infer_attention_score(
            query, key, value, actual_seq_lengths_kv=[5, 7], **fixed
        ),
        auto_dispatch=True,
    )
    graph.update(cpu_update_input=[{"actual_seq_lengths_kv": [5, 7]}])  # no replay yet: nothing to race
    graph.replay()
    with pytest.raises(GraphUpdateRace, match="wait for the replay stream first"):
        graph.update(cpu_update_input=[{"actual_seq_lengths_kv": [6, 8]}])


def test_an_update_on_the_capture_stream_is_refused():
    query, key, value, fixed = _decode_attention_case()
    capture_stream = torch_npu.npu.Stream()
    graph = torch_npu.npu.NPUGraph()
    with torch_npu.npu.graph(graph, stream=capture_stream, auto_dispatch_capture=True):
        torch_npu.npu_fused_infer_attention_score(query, key, value, actual_seq_lengths_kv=[5, 7], **fixed)
    [record] = graph.graph_dispatch_mode.graph_dispatch_records
    with pytest.raises(GraphCaptureError, match="update stream must be another one"):
        torch_npu.npu.graph_task_update_begin(capture_stream, record.handle)


def test_a_capture_on_the_default_stream_is_refused():
    graph = torch_npu.npu.NPUGraph()
    with (
        pytest.raises(GraphCaptureError, match="default stream"),
        torch_npu.npu.graph(graph, stream=torch_npu.npu.default_stream()),
    ):
        pass


def test_an_update_without_auto_dispatch_capture_is_torch_npus_error():
    query, key, value, fixed = _decode_attention_case()
    graph, _ = _capture(
        lambda: torch_npu.npu_fused_infer_attention_score(
            query, key, value, actual_seq_lengths_kv=[5, 7], **fixed
        )[0]
    )
    with pytest.raises(RuntimeError, match="auto_dispatch_capture=True"):
        graph.update(cpu_update_input=[{"actual_seq_lengths_kv": [6, 8]}])


@pytest.mark.parametrize(
    "read",
    [
        pytest.param(lambda x: (x * 2).sum().item(), id="item"),
        pytest.param(lambda x: bool((x > 0).any()), id="bool"),
        pytest.param(lambda x: torch.nonzero(x * 2), id="data-sized-output"),
    ],
)
def test_a_host_read_of_a_device_value_during_capture_is_refused(read):
    x = torch.randn(4)
    with pytest.raises(GraphCaptureError, match="NPU graph capture"):
        _capture(lambda: read(x))
    assert not torch_npu.npu.is_current_stream_capturing()  # the failed capture ended
    graph, out = _capture(lambda: x + 1)  # and the next one works
    graph.replay()
    torch.testing.assert_close(out, x + 1)


def _largest_count(counts: torch.Tensor) -> int:  # stands for a read of an upstream *_cpu tensor
    return int(counts.max())


def test_a_host_read_at_a_named_host_tensor_site_runs_during_capture(monkeypatch):
    counts, x = torch.tensor([3, 5]), torch.randn(4)
    with pytest.raises(GraphCaptureError, match="_largest_count"):  # unnamed: refused, with its site
        _capture(lambda: x + _largest_count(counts))
    monkeypatch.setenv("TORCH_NPU_DOUBLE_HOST_TENSOR_SITES", "npu_contract/test_graphs.py:_largest_count")
    graph, out = _capture(lambda: x + _largest_count(counts))
    counts[1] = 7  # the value read at capture is a Python int of the graph from here on
    graph.replay()
    torch.testing.assert_close(out, x + 5)
    monkeypatch.setenv("TORCH_NPU_DOUBLE_HOST_TENSOR_SITES", "npu_contract/test_graphs.py:another_function")
    with pytest.raises(GraphCaptureError, match="NPU graph capture"):
        _capture(lambda: x + _largest_count(counts))


def test_a_captured_input_freed_after_capture_is_detected_at_replay():
    kept = torch.randn(8)
    graph, out = _capture(lambda: kept * 2)
    graph.replay()
    torch.testing.assert_close(out, kept * 2)

    buffers = {"input": torch.randn(8)}
    graph, _ = _capture(lambda: buffers["input"] * 2)
    buffers["input"] = torch.randn(8)  # re-allocated instead of copied into
    gc.collect()
    with pytest.raises(StaleGraphInput, match="freed after capture"):
        graph.replay()


def test_a_number_assigned_into_a_slice_is_held_by_the_graph():
    """``t[:, -1] = False`` fills from a 0-dim tensor torch makes on the host for a host
    tensor but on the device, by a captured fill, for an NPU one: the graph holds it (a
    persistent input freed after capture still fails, above)."""
    mask = torch.ones(3, 4, dtype=torch.bool)

    def body():
        out = mask.clone()
        out[:, -1] = False
        return out

    graph, out = _capture(body)
    gc.collect()
    mask[0, 0] = False
    graph.replay()
    want = torch.ones(3, 4, dtype=torch.bool)
    want[0, 0] = want[:, -1] = False
    assert torch.equal(out, want)


def test_copies_that_reach_the_dispatcher_whole_are_tasks_and_expansions_are_views():
    """Under inference mode ``to``/``contiguous`` reach the dispatcher as themselves (their
    schema names an alias) and ``broadcast_tensors`` returns expanded views."""
    x = torch.arange(4, dtype=torch.int32)
    weight = torch.randn(10, 3)
    scale = torch.nn.Parameter(torch.randn(3), requires_grad=False)
    with torch.inference_mode():
        graph, out = _capture(
            lambda: (
                torch.nn.functional.embedding(x.long(), weight)
                * torch.broadcast_tensors(scale.to(torch.bfloat16), weight[:1])[0].float()
            )
        )
        x.copy_(torch.tensor([3, 2, 1, 0]))
        graph.replay()
        torch.testing.assert_close(out, weight[[3, 2, 1, 0]] * scale.to(torch.bfloat16).float())
    assert "aten.to.dtype" in graph.tasks()


def test_a_python_custom_op_is_captured_by_the_kernels_its_body_issues():
    lib = torch.library.Library("graphtest", "FRAGMENT")
    lib.define("twice_sin(Tensor x) -> Tensor")
    lib.impl("twice_sin", lambda x: x.sin() * 2, "CPU")
    x = torch.randn(5)
    graph, out = _capture(lambda: torch.ops.graphtest.twice_sin(x) + 1)
    assert graph.tasks() == ["aten.sin.default", "aten.mul.Tensor", "aten.add.Tensor"]
    x.copy_(torch.randn(5))
    graph.replay()
    torch.testing.assert_close(out, x.sin() * 2 + 1)


def test_a_fused_attention_inside_a_custom_op_is_not_updatable():
    """torch_npu's auto-dispatch mode does not see inside a Python custom op: the attention
    there is a plain task that keeps its capture-time lengths."""
    query, key, value, fixed = _decode_attention_case()
    lib = torch.library.Library("graphtest_attention", "FRAGMENT")
    lib.define("attend(Tensor q, Tensor k, Tensor v, int[] lens) -> Tensor")
    lib.impl(
        "attend",
        lambda q, k, v, lens: torch_npu.npu_fused_infer_attention_score(
            q, k, v, actual_seq_lengths_kv=list(lens), **fixed
        )[0],
        "CPU",
    )
    graph, out = _capture(lambda: torch.ops.graphtest_attention.attend(query, key, value, [5, 7]), True)
    assert not graph.graph_dispatch_mode.graph_dispatch_records  # nothing the update can rewrite
    assert "ExternalEvent.wait" not in graph.tasks()
    graph.replay()
    torch.testing.assert_close(
        out,
        torch_npu.npu_fused_infer_attention_score(query, key, value, actual_seq_lengths_kv=[5, 7], **fixed)[
            0
        ],
        rtol=0,
        atol=0,
    )


def test_a_graph_pool_counts_as_device_memory_until_the_graph_goes():
    before = torch_npu.npu.mem_get_info()[0]
    x = torch.randn(1024)
    graph, _ = _capture(lambda: x * 2)
    held = before - torch_npu.npu.mem_get_info()[0]
    assert held >= 1024 * 4 and held == graph.pool_bytes()
    del graph
    gc.collect()
    assert torch_npu.npu.mem_get_info()[0] == before


@pytest.mark.parametrize("collective", ["allreduce_", "_reduce_scatter_base_"])
def test_a_captured_collective_runs_again_at_every_replay(collective):
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        x = torch.randn(4)
        run = _all_reduced if collective == "allreduce_" else _reduce_scattered
        graph, out = _capture(lambda: run(x * 2))
        assert any(t.startswith(f"c10d.{collective}") for t in graph.tasks())
        gc.collect()  # (gloo's reduce-scatter buffer from capture is gone: no task may read it)
        x.copy_(torch.randn(4))
        graph.replay()
        torch.testing.assert_close(out, x * 2)  # one rank: the sum is the input
    finally:
        dist.destroy_process_group()


def _all_reduced(t):
    import torch.distributed as dist

    dist.all_reduce(t)
    return t


def _reduce_scattered(t):
    import torch.distributed as dist

    out = torch.empty_like(t)
    dist.reduce_scatter_tensor(out, t)
    return out
