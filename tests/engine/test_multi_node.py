"""Multi-node deployments, every "node" its own processes on 127.0.0.1 (host emulation, gloo
between the nodes), each against transformers' greedy tokens:

- vLLM's own launcher, ``--nnodes 2 --node-rank N --master-addr``, the second node
  ``--headless``: TP=2 of the tiny Qwen2 and PP=2 of the tiny DeepSeek-V3 (MoE + MLA), one
  rank per node;
- data parallelism across nodes: DP=2 of the tiny Qwen2, rank 1 on a ``--headless`` node;
- the Ray executor on a two-node local Ray cluster that this module starts (``ray start``
  twice, each node declaring one NPU, as Ray's resource for Ascend is named), so TP=2 has to
  place one worker on each node.

A Ray node's platform is decided where its worker imports vLLM, so the Ray nodes are started
with ``VLLM_ASCEND_EMULATE=1`` (on an NPU host, detection finds the devices). The
``--nnodes`` deployments start side by side, then the DP one, then the Ray cluster.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import re
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.ports import free_port
from tests.support.engines import RUNNER_LINE, VllmServer, greedy_completion
from tests.support.oracle import hf_greedy
from tests.support.prompts import PROMPTS

MAX_TOKENS = 12
COMMON = ["--dtype", "float32", "--max-model-len", "512", "--seed", "0"]
START_BOUND = 900  # seconds for every deployment of a group to be healthy (2 cores)


def _nnodes(parallel: list[str]) -> tuple[list[str], list[str]]:
    """Arguments of node 0 and node 1 for vLLM's own multi-node launch."""
    shared = [*COMMON, *parallel, "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port"]
    shared.append(str(free_port()))
    return [*shared, "--node-rank", "0"], [*shared, "--node-rank", "1"]


def _dp_across_nodes() -> tuple[list[str], list[str]]:
    shared = [
        *COMMON,
        "--data-parallel-size",
        "2",
        "--data-parallel-size-local",
        "1",
        "--data-parallel-address",
        "127.0.0.1",
        "--data-parallel-rpc-port",
        str(free_port()),
    ]
    # one API server (upstream starts one per DP rank); a headless node takes no such flag
    return [*shared, "--api-server-count", "1"], [*shared, "--data-parallel-start-rank", "1"]


class Deployment:
    """A head node with the API server and a ``--headless`` second node."""

    def __init__(self, name: str, model: Path, args: tuple[list[str], list[str]], root: Path, env=None):
        self.name, self.model = name, model
        head, other = args
        self.head = VllmServer(model, head, root / f"{name}.node0.log", env)
        self.other = VllmServer(model, other, root / f"{name}.node1.log", env, headless=True)

    def wait(self, deadline: float) -> None:
        # the head would wait for a dead node 1 until the deadline
        self.head.wait(deadline, companions=(self.other,))

    def stop(self) -> None:
        self.head.stop()
        # upstream's headless TP/PP node keeps waiting for its worker once the head is gone
        # and SIGTERM does not end that wait (vLLM 0.33.0): after 10 s its group is killed
        self.other.stop(grace=10)

    def logs(self) -> str:
        return self.head.log.read_text() + self.other.log.read_text()


def _complete_all(url: str, model: Path) -> list[list[int]]:
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(lambda p: greedy_completion(url, model, p, MAX_TOKENS), PROMPTS))


def _no_traceback_before_shutdown(name: str, text: str) -> None:
    # up to the shutdown: the head's exit may reach a headless node as a lost peer
    before = text.split("[shutdown]", 1)[0]
    assert "Traceback" not in before, f"{name}:\n{before[-4000:]}"


@contextlib.contextmanager
def _running(deployments: dict[str, Deployment]):
    """Started side by side; stopped (and their logs checked) when the block ends."""
    try:
        deadline = time.monotonic() + START_BOUND
        for deployment in deployments.values():
            deployment.wait(deadline)
        yield deployments
    finally:
        _stop(deployments)
    for name, deployment in deployments.items():
        _no_traceback_before_shutdown(name, deployment.logs())


def _stop(deployments: dict[str, Deployment]) -> None:
    """Also to free the cores and memory for the next group: the groups run one after
    another to keep this module's peak low beside another module's engines."""
    for deployment in deployments.values():
        deployment.stop()


@pytest.fixture(scope="module")
def launcher(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("multi_node")
    with _running(
        {
            "tp": Deployment("tp", tiny_models["qwen2"], _nnodes(["-tp", "2"]), root),
            "pp": Deployment("pp", tiny_models["deepseek_v3"], _nnodes(["-pp", "2"]), root),
        }
    ) as started:
        yield started


@pytest.fixture(scope="module")
def dp_nodes(launcher, tiny_models, tmp_path_factory):
    _stop(launcher)
    root = tmp_path_factory.mktemp("dp_across_nodes")
    with _running({"dp": Deployment("dp", tiny_models["qwen2"], _dp_across_nodes(), root)}) as started:
        yield started["dp"]


@pytest.mark.parametrize("name", ["tp", "pp"])
def test_two_node_launch_equals_transformers(launcher, name):
    deployment = launcher[name]
    got = _complete_all(deployment.head.url, deployment.model)
    assert got == hf_greedy(deployment.model, PROMPTS, MAX_TOKENS)


@pytest.mark.parametrize(("name", "rank_1"), [("tp", "Worker_TP1"), ("pp", "Worker_PP1")])
def test_each_node_holds_one_rank_of_the_model(launcher, name, rank_1):
    head = launcher[name].head.log.read_text()
    # upstream's multiproc executor names the group it leads: two ranks, one on this node
    assert re.search(r"DP group leader: node_rank=0, .*world_size=2, local_world_size=1", head), head[-3000:]
    assert RUNNER_LINE in head and f"({rank_1} " not in head
    other = launcher[name].other.log.read_text()
    assert f"({rank_1} " in other and RUNNER_LINE not in other, other[-3000:]


@pytest.mark.extended  # the cross-node DP handshake; DP itself: test_dp_serving.py
def test_dp_across_nodes_equals_transformers(dp_nodes):
    got = _complete_all(dp_nodes.head.url, dp_nodes.model)
    assert got == hf_greedy(dp_nodes.model, PROMPTS, MAX_TOKENS)


@pytest.mark.extended  # the cross-node DP handshake; DP itself: test_dp_serving.py
def test_dp_rank_1_runs_on_the_headless_node(dp_nodes):
    head, other = (log.read_text() for log in (dp_nodes.head.log, dp_nodes.other.log))
    assert "(EngineCore_DP1 " in other and "(EngineCore_DP1 " not in head, other[-3000:]
    assert RUNNER_LINE in other  # each replica's rank 0 says which runner it runs


def _ray() -> str:
    exe = Path(sys.executable).with_name("ray")
    assert exe.exists(), "ray is not installed: the wheel's `ray` extra brings it"
    return str(exe)


@pytest.fixture(scope="module")
def ray_cluster(dp_nodes, tmp_path_factory):
    """Two Ray nodes on 127.0.0.1, one NPU each, once the launcher deployments are stopped."""
    dp_nodes.stop()
    root = tmp_path_factory.mktemp("ray")
    port = free_port()
    # Ray 2.60 turns token authentication on by itself once ~/.ray/auth_token exists (any
    # local ray.init() writes one), and then a joining node without the token is refused:
    # this cluster's own token, given to every node and to vLLM
    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(auth, VLLM_ASCEND_EMULATE="1")
    node = [
        "--node-ip-address",
        "127.0.0.1",
        "--num-cpus",
        "1",
        "--resources",
        '{"NPU": 1}',
        "--object-store-memory",
        str(200 * 1024 * 1024),
        "--disable-usage-stats",
    ]
    head = [_ray(), "start", "--head", "--port", str(port), "--include-dashboard=false", *node]
    worker = [_ray(), "start", "--address", f"127.0.0.1:{port}", *node]
    try:
        for i, cmd in enumerate((head, worker)):
            with open(root / f"ray-start-{i}.log", "w") as out:
                subprocess.run(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=180, check=True)
        yield {"env": {"RAY_ADDRESS": f"127.0.0.1:{port}", **auth}, "root": root}
    finally:
        with contextlib.suppress(subprocess.SubprocessError):
            subprocess.run([_ray(), "stop", "--force"], env=env, capture_output=True, timeout=120)


@pytest.fixture(scope="module")
def ray_server(ray_cluster, tiny_models):
    model = tiny_models["qwen2"]
    args = [*COMMON, "-tp", "2", "--distributed-executor-backend", "ray"]
    server = VllmServer(model, args, ray_cluster["root"] / "ray-tp.log", ray_cluster["env"])
    try:
        server.wait(time.monotonic() + START_BOUND)
        yield server, model
    finally:
        server.stop()
    _no_traceback_before_shutdown("ray", server.log.read_text())


def test_ray_executor_on_two_nodes_equals_transformers(ray_server):
    server, model = ray_server
    assert _complete_all(server.url, model) == hf_greedy(model, PROMPTS, MAX_TOKENS)
    text = server.log.read_text()
    assert "Connected to Ray cluster" in text, text[-3000:]
    # upstream's placement check names every node that holds fewer NPUs than TP: both do
    nodes = set(re.findall(r"reserved number of NPUs \(1 NPUs\) in a node (\w+)", text))
    assert len(nodes) == 2, text[-3000:]
