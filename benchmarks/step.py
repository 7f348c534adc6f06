"""The whole decode step in NPU-path mode: device ops outside the forward, by site.

    nox -s bench -- step [--case qwen2 deepseek_v3 deepseek_v3_random deepseek_v3_mtp2 ...]
                         [--batch 1 64] [--steps 6] [--top 10]

Each case runs in a process of its own: one engine in host emulation with the torch_npu
kernels through the contract double (``VLLM_ASCEND_KERNELS=npu``), bfloat16, 128-token
blocks, decode graphs on (the defaults), TP=1, the engine core in the benchmark's process,
a tiny model from ``examples/make_tiny_model.py``. For every batch size the engine decodes
that many requests and reports, per decode step (from the start of the runner's
``execute_model`` to the end of its ``sample_tokens``; with MTP, a step verifies the drafts
and proposes the next ones):

- **device ops**: every op the host issues to the device outside the graph replays (views,
  allocations and no-op conversions not counted; the ops inside vLLM's custom-op wrappers
  are), with the sites that issue the most (the first frame outside torch);
- **replays** and **updates**: graph replays (each one launch) and the ops a graph update
  re-issues (torch_npu rewrites captured tasks with the step's lengths);
- **syncs**: host reads of a device value while device work is in flight, as the double
  counts them, by site; the reads it counts at the sites of ``HOST_TENSOR_READS`` read host
  tensors upstream's runner made from numpy (the double cannot tell them apart) and are
  listed apart as host-tensor reads;
- **host ms**: the step's wall time minus the time inside the dispatched ops and the
  replayed tasks (Python and argument handling an NPU would not hide). Median.

Goals (issue 63): at most 24 device ops per decode step (48 with MTP k = 2), a graph
replay counting as one, and no host synchronisation. Ops issued from other threads than
the engine's are not seen. Host numbers of this machine through the double; no claim
about NPU time.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import tempfile
import time
from pathlib import Path

from driver import (
    VLLM_OPS,
    call_site,
    launches_kernel,
    make_tiny_model,
    npu_path_env,
    record_vllm_ops,
    run_child,
)

MODELS = {
    "qwen2": ["--arch", "qwen2"],
    "deepseek_v3": ["--arch", "deepseek_v3", "--kv-lora-rank", "512"],
}
GREEDY = {"temperature": 0.0}
RANDOM = {"temperature": 0.8, "top_p": 0.95, "top_k": 50, "seed": 7}
CASES = {  # name -> (model, sampling, draft tokens)
    "qwen2": ("qwen2", GREEDY, 0),
    "qwen2_random": ("qwen2", RANDOM, 0),
    "deepseek_v3": ("deepseek_v3", GREEDY, 0),
    "deepseek_v3_random": ("deepseek_v3", RANDOM, 0),
    "deepseek_v3_mtp1": ("deepseek_v3", GREEDY, 1),
    "deepseek_v3_mtp2": ("deepseek_v3", GREEDY, 2),
    "deepseek_v3_mtp2_random": ("deepseek_v3", RANDOM, 2),
}
GOAL_OPS = {0: 24, 1: 48, 2: 48}
# Reads the double counts as syncs (device work is in flight since a graph replay) whose
# tensor is a host one, made from numpy by upstream's runner: on an NPU they wait for
# nothing. Listed apart, with what they read. (file, function) -> the host tensor.
HOST_TENSOR_READS = {
    ("ascend/attention/backend.py", "build"): "query_start_loc_cpu (from numpy, model_states/default.py)",
    ("ascend/attention/mla.py", "build"): "query_start_loc_cpu (from numpy, model_states/default.py)",
    ("gpu/model_states/default.py", "prepare_attn"): "seq_lens_cpu_upper_bound[:n].max()",
    ("target_dependent_ar/speculator.py", "propose"): "seq_lens_cpu_upper_bound[:n].max()",
}


def host_tensor_read(site: str) -> bool:
    """``site``: the double's "path:line (function)"."""
    path, _, rest = site.partition(":")
    function = rest.partition("(")[2].partition(")")[0]
    return any(path.endswith(f) and function == fn for f, fn in HOST_TENSOR_READS)


# -- the engine side (a child process) --------------------------------------------------------
class _Step:
    def __init__(self, tokens: int) -> None:
        self.tokens = tokens
        self.sites: collections.Counter = collections.Counter()
        self.replays = 0
        self.updates = 0
        self.syncs: collections.Counter = collections.Counter()
        self.start = time.perf_counter()
        self.device_s = 0.0  # inside dispatched ops and replayed tasks
        self.host_ms = 0.0
        self.done = False


def _counting_mode(state: dict):
    from torch.utils._python_dispatch import TorchDispatchMode

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = func.overloadpacket.__name__
            if func.namespace == "vllm" and name in VLLM_OPS:  # a wrapper: count what runs inside
                with self:
                    return VLLM_OPS[name](*args, **kwargs)
            start = time.perf_counter()
            out = func(*args, **kwargs)
            step = state["step"]
            if step is not None and not state["replaying"]:
                step.device_s += time.perf_counter() - start
                if launches_kernel(func, name, args, kwargs, out):
                    step.sites[call_site(__file__, with_line=False)] += 1
            return out

    return Mode()


def _sync_calls() -> collections.Counter:
    from torch_npu import _syncs

    return collections.Counter({site: c["calls"] for site, c in _syncs.records.items()})


def child(spec: dict) -> None:
    record_vllm_ops()
    import torch_npu
    from torch_npu import _graphs, _syncs

    from vllm import LLM, SamplingParams

    from vllm.ascend.graph import capture

    del torch_npu  # (imported first: the double, whose graph module is hooked below)
    _syncs.ensure_wrappers()
    engine = {
        "dtype": "bfloat16",
        "max_model_len": 512,
        "max_num_seqs": max(spec["batches"]),
        "block_size": 128,
        "seed": 0,
    }
    if spec["draft_tokens"]:
        engine["speculative_config"] = {"method": "mtp", "num_speculative_tokens": spec["draft_tokens"]}
    llm = LLM(model=spec["model"], **engine)
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    steps: list[_Step] = []
    state: dict = {"step": None, "replaying": False, "syncs": None}
    mode = _counting_mode(state)

    def close(step: _Step) -> None:
        step.host_ms = (time.perf_counter() - step.start - step.device_s) * 1e3
        step.syncs = _sync_calls() - state["syncs"]
        step.done = True
        state["step"] = None

    replay, graph_replay, tasks = capture.AscendGraph.replay, _graphs._Graph.replay, _graphs._Replay.advance

    def counted_replay(self):  # a decode graph's: its replay, then its update
        step, before = state["step"], _graphs.stats["update_ops"]
        state["replaying"] = True
        try:
            replay(self)
        finally:
            state["replaying"] = False
        if step is not None:
            step.updates += _graphs.stats["update_ops"] - before

    def counted_graph_replay(self):  # any graph's (decode or sampler)
        replaying, state["replaying"] = state["replaying"], True
        try:
            graph_replay(self)
        finally:
            state["replaying"] = replaying
        if state["step"] is not None:
            state["step"].replays += 1

    def timed_tasks(self):
        start = time.perf_counter()
        try:
            return tasks(self)
        finally:
            if state["step"] is not None:
                state["step"].device_s += time.perf_counter() - start

    capture.AscendGraph.replay, _graphs._Replay.advance = counted_replay, timed_tasks
    _graphs._Graph.replay = counted_graph_replay
    execute, sample = runner.execute_model, runner.sample_tokens

    def execute_step(scheduler_output, *args, **kwargs):
        if state["step"] is not None:  # the previous step sampled nothing
            close(state["step"])
        state["step"] = _Step(scheduler_output.total_num_scheduled_tokens)
        steps.append(state["step"])
        state["syncs"] = _sync_calls()
        # the mode is entered inside each call: the worker's inference-mode context around
        # the call restores the thread's dispatch keys on exit, and a mode left on the stack
        # across it would stop seeing ops
        with mode:
            return execute(scheduler_output, *args, **kwargs)

    def sample_step(*args, **kwargs):
        try:
            with mode:
                return sample(*args, **kwargs)
        finally:
            if state["step"] is not None:
                close(state["step"])

    runner.execute_model, runner.sample_tokens = execute_step, sample_step

    results = {}
    prompt = "the quick brown fox jumps over the lazy dog " * 3
    k = spec["draft_tokens"]
    for batch in spec["batches"]:
        steps.clear()
        params = SamplingParams(max_tokens=spec["steps"] * (k + 1), ignore_eos=True, **spec["sampling"])
        llm.generate([f"{i} {prompt}" for i in range(batch)], params, use_tqdm=False)
        decode = [s for s in steps if s.done and s.tokens == batch * (k + 1)][1:]  # past the first
        sites, syncs, host_reads = collections.Counter(), collections.Counter(), collections.Counter()
        for s in decode:
            sites.update(s.sites)
            for site, c in s.syncs.items():
                (host_reads if host_tensor_read(site) else syncs)[site] += c
        n = max(len(decode), 1)
        results[batch] = {
            "ops": statistics.median(sum(s.sites.values()) for s in decode) if decode else 0,
            "replays": statistics.median(s.replays for s in decode) if decode else 0,
            "updates": statistics.median(s.updates for s in decode) if decode else 0,
            "syncs": sum(syncs.values()) / n,
            "host_reads": sum(host_reads.values()) / n,
            "host_ms": statistics.median(s.host_ms for s in decode) if decode else 0.0,
            "sites": {site: c / n for site, c in sites.most_common()},
            "sync_sites": {site: c / n for site, c in syncs.most_common()},
            "host_read_sites": {site: c / n for site, c in host_reads.most_common()},
            "steps": len(decode),
        }
    print("RESULT " + json.dumps(results))


# -- the driver ----------------------------------------------------------------------------------
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--batch", nargs="+", type=int, default=[1, 64])
    p.add_argument("--steps", type=int, default=6, help="decode steps per batch")
    p.add_argument("--top", type=int, default=10, help="sites listed per case")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(json.loads(args.child))
        return

    env = npu_path_env(TORCH_NPU_DOUBLE_SYNC_LOG=tempfile.mkdtemp(prefix="step-syncs-"))
    table = {}
    with tempfile.TemporaryDirectory() as tmp:
        for case in args.case:
            model, sampling, k = CASES[case]
            spec = {
                "model": str(make_tiny_model(MODELS[model], Path(tmp))),
                "sampling": sampling,
                "draft_tokens": k,
                "batches": args.batch,
                "steps": args.steps,
            }
            print(f"{case} ...", flush=True)
            table[case] = run_child(__file__, spec, env, 1800, case)
    print()
    print(
        "| case | batch | device ops/step | replays | ops + replays | goal | update ops | syncs/step "
        "| host-tensor reads | host ms/step |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for case in args.case:
        for batch in args.batch:
            r = table[case][str(batch)]
            print(
                f"| {case} | {batch} | {r['ops']:g} | {r['replays']:g} | {r['ops'] + r['replays']:g} | "
                f"<= {GOAL_OPS[CASES[case][2]]} | {r['updates']:g} | {r['syncs']:g} (goal 0) | "
                f"{r['host_reads']:g} | {r['host_ms']:.2f} |"
            )
    for case in args.case:
        r = table[case][str(args.batch[0])]
        print(f"\n{case}, batch {args.batch[0]}, over {r['steps']} decode steps: ops per step by site")
        for site, n in list(r["sites"].items())[: args.top]:
            print(f"  {n:7.1f}  {site}")
        for site, n in r["sync_sites"].items():
            print(f"  sync {n:4.1f}  {site}")
        for site, n in r["host_read_sites"].items():
            print(f"  host-tensor read {n:4.1f}  {site}")


if __name__ == "__main__":
    main()
