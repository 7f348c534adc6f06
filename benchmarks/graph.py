"""Decode steps in NPU-path mode, eager against decode graphs, side by side in one run.

    nox -s bench -- graph [--arch qwen2 deepseek_v3 deepseek_v3_mtp2] [--batch 1 8] [--steps 8]

Each (architecture, mode) pair runs in a process of its own: one engine in host emulation
with the torch_npu kernels through the contract double (``VLLM_ASCEND_KERNELS=npu``),
bfloat16, TP=1, a tiny model from ``examples/make_tiny_model.py`` (``deepseek_v3_mtp2``:
the DeepSeek-V3 model with MTP, two draft tokens). "eager" starts it with
``--enforce-eager``, "graph" with the defaults (decode graphs, FULL_DECODE_ONLY). For
every batch size the engine decodes ``--steps`` steps of that many requests and reports,
per decode step (every model forward of the step: target and, with MTP, the drafter's):

- **host launches**: what the host issues to the device. Eager: every op that launches a
  kernel (views, allocations and vLLM's custom-op wrappers not counted; the ops inside a
  wrapper are). Graph: one per graph replay plus one per op the update re-issues (torch_npu
  rewrites each fused-attention task of the graph with the step's lengths);
- **host ms / step**: eager, the wall time of the model forwards minus the time inside the
  dispatched ops; graph, the wall time of the replays (updates included) minus the time the
  double spends running the replayed tasks (what the device would run). Median.

Beside them: the goals, for decode steps without drafts (graph launches <= 1 + attention
layers per decode step; graph host time at least 5x lower than eager at batch 1). Host
numbers of this machine through the double; no claim about NPU time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from driver import (  # the same op counting and driver as the launches benchmark
    VLLM_OPS,
    launches_kernel,
    make_tiny_model,
    npu_path_env,
    record_vllm_ops,
    run_child,
)

ARCHS = {  # name -> (make_tiny_model arguments, speculative config)
    "qwen2": (["--arch", "qwen2"], None),
    "deepseek_v3": (["--arch", "deepseek_v3", "--kv-lora-rank", "512"], None),
    "deepseek_v3_mtp2": (
        ["--arch", "deepseek_v3", "--kv-lora-rank", "512"],
        {"method": "mtp", "num_speculative_tokens": 2},
    ),
}
MODES = {"eager": {"enforce_eager": True}, "graph": {}}
HOST_TIME_GOAL = 5.0


# -- the engine side (a child process) --------------------------------------------------------
class _Step:
    """What one engine step issued: launches, host time, forwards."""

    def __init__(self) -> None:
        self.launches = 0
        self.host_s = 0.0
        self.tokens = 0


def _counting_mode(step_of):
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
            step = step_of()
            step.host_s -= time.perf_counter() - start  # device work, not host time
            step.launches += launches_kernel(func, name, args, kwargs, out)
            return out

    return Mode()


def child(spec: dict) -> None:
    record_vllm_ops()
    import torch_npu
    from torch_npu import _graphs

    from vllm import LLM, SamplingParams

    from vllm.ascend.graph import capture

    engine = {
        "dtype": "bfloat16",
        "max_model_len": 512,
        "max_num_seqs": max(spec["batches"]),
        "block_size": 128,
        "seed": 0,
        **MODES[spec["mode"]],
    }
    if spec["speculative"]:
        engine["speculative_config"] = spec["speculative"]
    llm = LLM(model=spec["model"], **engine)
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    steps: list[_Step] = []
    current = {"step": _Step()}

    def step_of() -> _Step:
        return current["step"]

    mode = _counting_mode(step_of)
    forward_start = {}

    def pre(module, args, kwargs):
        forward_start[id(module)] = time.perf_counter()
        mode.__enter__()

    def post(module, args, kwargs, out):
        mode.__exit__(None, None, None)
        current["step"].host_s += time.perf_counter() - forward_start.pop(id(module))

    models = [runner.model]
    drafter = getattr(getattr(runner, "speculator", None), "model", None)
    if drafter is not None:
        models.append(drafter)
    for model in models:
        model.register_forward_pre_hook(pre, with_kwargs=True)
        model.register_forward_hook(post, with_kwargs=True)

    # graph replays: the update and the replay call are host work; the tasks the double
    # re-runs are what the device would run. The double runs them as a replay advances,
    # from the replay call up to the first task that waits for its update, and the rest
    # from the update call (replay, then update: the device's order)
    replay, tasks = capture.AscendGraph.replay, _graphs._Replay.advance

    def timed_replay(self):
        start, before = time.perf_counter(), _graphs.stats["update_ops"]
        replay(self)
        step = current["step"]
        step.host_s += time.perf_counter() - start
        step.launches += 1 + _graphs.stats["update_ops"] - before

    def timed_tasks(self):
        start = time.perf_counter()
        try:
            return tasks(self)
        finally:
            current["step"].host_s -= time.perf_counter() - start

    capture.AscendGraph.replay, _graphs._Replay.advance = timed_replay, timed_tasks
    execute = runner.execute_model

    def per_step(scheduler_output, *args, **kwargs):
        current["step"] = _Step()
        current["step"].tokens = scheduler_output.total_num_scheduled_tokens
        try:
            return execute(scheduler_output, *args, **kwargs)
        finally:
            steps.append(current["step"])

    runner.execute_model = per_step
    del torch_npu  # (imported first: the double, whose graph module is timed above)

    results = {}
    prompt = "the quick brown fox jumps over the lazy dog " * 3
    k = (spec["speculative"] or {}).get("num_speculative_tokens", 0)
    for batch in spec["batches"]:
        steps.clear()
        params = SamplingParams(max_tokens=spec["steps"] * (k + 1), temperature=0.0, ignore_eos=True)
        llm.generate([f"{i} {prompt}" for i in range(batch)], params, use_tqdm=False)
        decode = [s for s in steps if s.tokens == batch * (k + 1)]
        results[batch] = {
            "launches": statistics.median(s.launches for s in decode),
            "host_ms": statistics.median(s.host_s * 1e3 for s in decode),
            "steps": len(decode),
        }
    config = llm.llm_engine.vllm_config.model_config.hf_config
    results["attention_layers"] = config.num_hidden_layers
    print("RESULT " + json.dumps(results))


# -- the driver ----------------------------------------------------------------------------------
def _run(model: Path, arch: str, mode: str, batches: list[int], steps: int, env: dict) -> dict:
    spec = {
        "model": str(model),
        "mode": mode,
        "batches": batches,
        "steps": steps,
        "speculative": ARCHS[arch][1],
    }
    return run_child(__file__, spec, env, 1800, f"{arch} ({mode})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", nargs="+", default=list(ARCHS), choices=list(ARCHS))
    p.add_argument("--batch", nargs="+", type=int, default=[1, 8])
    p.add_argument("--steps", type=int, default=8, help="decode steps per batch")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(json.loads(args.child))
        return

    env = npu_path_env()
    table = {}
    with tempfile.TemporaryDirectory() as tmp:
        for arch in args.arch:
            model = make_tiny_model(ARCHS[arch][0], Path(tmp))  # (the MTP case shares its model)
            for mode in MODES:
                print(f"{arch}: {mode} ...", flush=True)
                table[(arch, mode)] = _run(model, arch, mode, args.batch, args.steps, env)
    print()
    print(
        "| arch | batch | launches/step eager | launches/step graph | goal (graph) | "
        "host ms/step eager | host ms/step graph | eager / graph | goal (batch 1) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for arch in args.arch:
        e, g = table[(arch, "eager")], table[(arch, "graph")]
        for batch in args.batch:
            eb, gb = e[str(batch)], g[str(batch)]
            goal = f"<= {1 + g['attention_layers']}" if ARCHS[arch][1] is None else "-"
            speedup = eb["host_ms"] / gb["host_ms"] if gb["host_ms"] > 0 else float("inf")
            print(
                f"| {arch} | {batch} | {eb['launches']:g} | {gb['launches']:g} | {goal} | "
                f"{eb['host_ms']:.2f} | {gb['host_ms']:.2f} | {speedup:.1f}x | "
                f"{'>= ' + str(HOST_TIME_GOAL) + 'x' if batch == 1 and ARCHS[arch][1] is None else '-'} |"
            )


if __name__ == "__main__":
    main()
