"""Model Runner V2's kernels: the Ascend torch forms (``vllm.ascend.worker.v2``, registered
through its ``kernel_table``, and the block tables of vllm.ascend.worker.block_tables) against upstream's own Triton
kernels run unchanged by Triton's interpreter in a process of its own
(``v2_kernel_cases.py``: the same random cases through upstream's launchers on both
sides). The torch forms also run under a guard that fails on any read-back to the host."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.unit.kernels.host_reads import no_host_reads
from tests.unit.worker import v2_kernel_cases as cases

ROOT = Path(__file__).resolve().parents[3]
EXACT_FLOAT = {"staged_write"}  # copies: bit for bit
# the staged write's launcher copies its host lists to the device itself


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    pytest.importorskip("triton", reason="the oracle runs upstream's kernels in Triton's interpreter")
    out = tmp_path_factory.mktemp("v2") / "oracle.pt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-m", "tests.unit.worker.v2_kernel_cases", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return torch.load(out, weights_only=True)


@pytest.fixture(scope="module", autouse=True)
def overrides():
    from vllm.platforms import current_platform

    current_platform.register_triton_kernel_overrides()  # once per process (cached)


@pytest.mark.parametrize("seed", cases.SEEDS)
@pytest.mark.parametrize("name", sorted(cases.CASES))
def test_torch_form_matches_upstream_kernel(oracle, name, seed):
    got = cases.run(name, seed, "ascend", guard=lambda: no_host_reads(name != "staged_write"))
    want = oracle[f"{name}/{seed}"]
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        if b is None:
            assert a is None
            continue
        assert a.shape == b.shape and a.dtype == b.dtype, (i, a.shape, b.shape, a.dtype, b.dtype)
        if a.is_floating_point() and name not in EXACT_FLOAT:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=f"output {i}")
        else:
            assert torch.equal(a, b), f"output {i} of {name}/{seed}:\n{a}\n!=\n{b}"


def test_seeded_sampling_depends_on_seed_position_and_temperature():
    """The Gumbel noise: the same (seed, position) draws the same token, another seed or
    position other noise, and temperature 0 is a plain argmax (independent of the oracle:
    these are the properties the runner relies on)."""
    from vllm.ascend.worker.v2.gumbel import gumbel_noised

    logits = torch.randn(1, 1000, generator=torch.Generator().manual_seed(0)).expand(4, -1)
    temp = torch.tensor([1.0, 1.0, 1.0, 0.0])
    seed = torch.tensor([7, 7, 8, 7])
    pos = torch.tensor([3, 3, 3, 3])
    scores = gumbel_noised(logits, temp, seed, pos, False, False, True)
    assert torch.equal(scores[0], scores[1])  # same seed and position: same draw
    assert not torch.equal(scores[0], scores[2])  # another seed
    moved = gumbel_noised(logits, temp, seed, pos + 1, False, False, True)
    assert not torch.equal(scores[0], moved[0])  # another position
    assert torch.equal(scores[3], logits[3])  # greedy: no noise
    # the noise is Gumbel(0, 1): mean ~0.577, variance ~pi^2/6
    one = torch.ones(1)
    noise = gumbel_noised(
        torch.zeros(1, 200000), one, torch.tensor([1]), torch.tensor([0]), False, False, True
    )
    assert abs(noise.mean().item() - 0.5772) < 0.02
    assert abs(noise.var().item() - 1.6449) < 0.05
