"""The random batch's sampler replayed from NPU graphs (worker/v2/gumbel_graphs.py), through
the contract double's graphs (capture launches nothing, replay re-runs exactly the captured
ops on the captured memory): every row count up to the largest size, padded or not, draws
the tokens the eager form draws, with temperatures and seeds that change after capture in
buffers at new addresses (as the sampling states upload them), and each call is one
replay."""

from __future__ import annotations

import pytest
import torch

torch_npu = pytest.importorskip("torch_npu")
if not getattr(torch_npu, "IS_CONTRACT_DOUBLE", False):
    pytest.skip("the real torch_npu is active on this host", allow_module_level=True)

from torch_npu import _graphs  # noqa: E402

from vllm.v1.worker.gpu.sample.gumbel import gumbel_sample  # noqa: E402

from vllm.ascend import device as ascend_device  # noqa: E402
from vllm.ascend.device.npu import NPUPathDevice  # noqa: E402
from vllm.ascend.platform.npu import NPUPlatform  # noqa: E402
from vllm.ascend.worker.v2.gumbel_graphs import GumbelGraphs  # noqa: E402

VOCAB = 2500  # three of the sampler's 1024-wide blocks
MAX_REQS = 12
SIZES = [1, 2, 4, 8]


@pytest.fixture(scope="module")
def graphs():
    NPUPlatform.register_triton_kernel_overrides()  # upstream's Triton kernels -> torch forms (once)
    with pytest.MonkeyPatch.context() as mp:
        # the process's device is the NPU-path one (the double's graphs), as in an NPU-path engine
        npu_path = NPUPathDevice()
        mp.setattr(ascend_device, "current", lambda: npu_path)
        graphs = GumbelGraphs(SIZES, VOCAB, MAX_REQS, False, torch.device("cpu"))
        assert not graphs.covers(1), "nothing is captured yet"
        graphs.capture()
        yield graphs


def _batch(rows: int, step: int):
    g = torch.Generator().manual_seed(100 * rows + step)
    logits = torch.randn(rows, VOCAB, generator=g) * 3
    logits[0, 7] = float("-inf")
    req = torch.randperm(MAX_REQS, generator=g)[:rows].to(torch.int32)  # any request slots
    pos = torch.randint(0, 4000, (rows,), generator=g)
    # new buffers each call, as the sampling states' rotating uploads are
    temperature = torch.rand(MAX_REQS, generator=g) + 0.3
    temperature[req[-1]] = 0.0  # one greedy row in the batch
    seeds = torch.randint(0, 2**62, (MAX_REQS,), generator=g)
    return logits, req, pos, temperature, seeds


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8])
def test_replayed_tokens_are_the_eager_tokens(graphs, rows):
    for step in range(2):
        logits, req, pos, temperature, seeds = _batch(rows, step)
        want = gumbel_sample(logits, req, temperature, seeds, pos, apply_temperature=False, is_drafting=False)
        before = _graphs.stats["replays"]
        assert graphs.covers(rows)
        got = graphs.sample(logits, req, pos, temperature, seeds)
        assert _graphs.stats["replays"] == before + 1
        assert torch.equal(got, want), (rows, step)
        greedy = logits[-1].argmax()
        assert got[-1] == greedy  # the greedy row took no noise
        # a changed seed: the graph reads this call's seeds, not a copy from before
        seeds[req[0]] ^= 0x5DEECE66D
        again = graphs.sample(logits, req, pos, temperature, seeds)
        want_again = gumbel_sample(
            logits, req, temperature, seeds, pos, apply_temperature=False, is_drafting=False
        )
        assert torch.equal(again, want_again)


def test_tokens_survive_the_next_replay(graphs):
    first = graphs.sample(*_batch(4, 0))
    kept = first.clone()
    graphs.sample(*_batch(4, 1))
    assert torch.equal(first, kept), "a step's tokens were overwritten by the next replay"


def test_batches_beyond_the_largest_size_are_not_covered(graphs):
    assert graphs.covers(8) and not graphs.covers(9)
