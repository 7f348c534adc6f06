"""Device launches per decode step in NPU-path mode, upstream's native op forms against the
Ascend forms, side by side in one run.

    nox -s bench -- launches [--batch 1 32] [--arch qwen2 llama deepseek_v3 qwen3_moe]

Each (architecture, forms) pair runs in a process of its own: one engine in host emulation
with the torch_npu kernels through the contract double (``VLLM_ASCEND_KERNELS=npu``),
bfloat16, eager, TP=1, made from the tiny models of ``examples/make_tiny_model.py``.
"native" starts it with ``custom_ops=["none"]`` (upstream's torch forms of RMSNorm,
rotary embedding, SiLU-and-mul and the MoE router), "ascend" with the defaults (the
platform's registered forms). For every batch size the engine decodes ``--steps`` steps of
that many requests, and for the decode steps only it reports:

- **ops / layer**: operators that reach the dispatcher inside one middle decoder layer's
  forward (views, allocations, and vLLM's own custom-op wrappers not counted; the ops
  inside a wrapper are), and the most frequent of them;
- **syncs / step**: host reads of a device value inside the model forward, as the double
  counts them (``harness/doubles/torch_npu_site/torch_npu/_syncs.py``);
- **host ms / step**: wall time of the model forward minus the time spent inside the
  dispatched ops (the host work an NPU would not hide: Python, argument handling), median.

Beside the counts it prints the lower bound the layer needs, op by op, and the goals
(GQA <= 14, MLA + MoE <= 28, 0 syncs). Host numbers of this machine through the double;
no claim about NPU time.
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

ARCHS = {  # name -> make_tiny_model arguments
    "llama": ["--arch", "llama"],
    "qwen2": ["--arch", "qwen2"],
    "deepseek_v3": ["--arch", "deepseek_v3", "--kv-lora-rank", "512"],
    "qwen3_moe": ["--arch", "qwen3_moe"],
}
# What one decoder layer of each family needs at least, op by op.
LOWER_BOUND = {
    "gqa": [
        "add_rms_norm",
        "qkv matmul",
        "rotary",
        "cache write k",
        "cache write v",
        "attention",
        "o matmul",
        "add_rms_norm",
        "gate_up matmul",
        "swiglu",
        "down matmul",
    ],
    "mla_moe": [
        "add_rms_norm",
        "q matmul",
        "kv_a matmul",
        "kv rms_norm + rope + cache write",
        "q rope",
        "q absorb (bmm)",
        "attention",
        "v up-projection (bmm)",
        "o matmul",
        "add_rms_norm",
        "router matmul",
        "gating top-k",
        "init routing",
        "grouped gate_up",
        "swiglu",
        "grouped down",
        "finalize routing",
        "shared gate_up",
        "shared swiglu",
        "shared down",
        "add",
    ],
}
FAMILY = {"llama": "gqa", "qwen2": "gqa", "deepseek_v3": "mla_moe", "qwen3_moe": "gqa_moe"}
GOAL = {"gqa": 14, "mla_moe": 28, "gqa_moe": 28}
FORMS = {"native": {"custom_ops": ["none"]}, "ascend": {}}


# -- the engine side (a child process) --------------------------------------------------------
class _Counter:
    """Counts the ops of one layer's forward and times every top-level op of the model."""

    def __init__(self) -> None:
        self.layer_ops: list[collections.Counter] = []
        self.current: collections.Counter | None = None
        self.inside_ops = 0.0
        self.sites = False

    def mode(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                name = func.overloadpacket.__name__
                if func.namespace == "vllm" and name in VLLM_OPS:  # a wrapper: count what runs inside
                    with self:
                        return VLLM_OPS[name](*args, **kwargs)
                start = time.perf_counter()
                out = func(*args, **kwargs)
                counter.inside_ops += time.perf_counter() - start
                if counter.current is not None and launches_kernel(func, name, args, kwargs, out):
                    key = name if func.namespace == "aten" else f"{func.namespace}::{name}"
                    counter.current[f"{key} @ {call_site(__file__)}" if counter.sites else key] += 1
                return out

        return Mode()


def _middle_layer(model):
    import torch

    layers = [
        m
        for name, m in model.named_modules()
        if name.endswith("layers") and isinstance(m, torch.nn.ModuleList)
    ]
    blocks = layers[0]
    return blocks[len(blocks) // 2]


def child(spec: dict) -> None:

    record_vllm_ops()
    from vllm import LLM, SamplingParams

    counter = _Counter()
    counter.sites = spec["sites"]
    llm = LLM(
        model=spec["model"],
        dtype="bfloat16",
        enforce_eager=True,
        max_model_len=512,
        max_num_seqs=max(spec["batches"]),
        block_size=128,
        seed=0,
        compilation_config=FORMS[spec["forms"]],
    )
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    model = runner.model
    layer = _middle_layer(model)
    state = {"tokens": 0}
    mode = counter.mode()
    forwards: list[tuple[int, float, float]] = []  # (tokens, wall s, inside-op s)

    def model_pre(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        state["tokens"] = int(ids.shape[0]) if ids is not None else 0
        state["start"] = time.perf_counter()
        counter.inside_ops = 0.0
        mode.__enter__()

    def model_post(module, args, kwargs, out):
        mode.__exit__(None, None, None)
        forwards.append((state["tokens"], time.perf_counter() - state["start"], counter.inside_ops))

    def layer_pre(module, args):
        counter.current = collections.Counter()

    def layer_post(module, args, out):
        counter.layer_ops.append(counter.current)
        counter.current = None

    model.register_forward_pre_hook(model_pre, with_kwargs=True)
    model.register_forward_hook(model_post, with_kwargs=True)
    layer.register_forward_pre_hook(layer_pre)
    layer.register_forward_hook(layer_post)

    from torch_npu import _syncs

    def forward_syncs() -> int:
        return sum(c["in_region"] for c in _syncs.records.values())

    results = {}
    prompt = "the quick brown fox jumps over the lazy dog " * 3
    for batch in spec["batches"]:
        forwards.clear()
        counter.layer_ops.clear()
        before = forward_syncs()
        params = SamplingParams(max_tokens=spec["steps"], temperature=0.0, ignore_eos=True)
        llm.generate([f"{i} {prompt}" for i in range(batch)], params, use_tqdm=False)
        syncs = forward_syncs() - before
        # decode forwards: exactly one token per request (the prefill has many per request)
        decode = [i for i, f in enumerate(forwards) if f[0] == batch]
        ops = [counter.layer_ops[i] for i in decode]
        per_layer = [sum(c.values()) for c in ops]
        merged = collections.Counter()
        for c in ops:
            merged.update(c)
        results[batch] = {
            "ops": statistics.median(per_layer),
            "top": {k: v / len(ops) for k, v in merged.most_common()},
            "syncs": syncs / max(len(forwards), 1),
            "host_ms": statistics.median((forwards[i][1] - forwards[i][2]) * 1e3 for i in decode),
            "steps": len(decode),
        }
    print("RESULT " + json.dumps(results))


def _run(model: Path, forms: str, batches: list[int], steps: int, env: dict, sites: bool) -> dict:
    spec = {"model": str(model), "forms": forms, "batches": batches, "steps": steps, "sites": sites}
    result = run_child(__file__, spec, env, 1200, f"{model.name} ({forms})")
    return {int(k): v for k, v in result.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", nargs="+", default=list(ARCHS), choices=list(ARCHS))
    p.add_argument("--batch", nargs="+", type=int, default=[1, 32])
    p.add_argument("--steps", type=int, default=6, help="decode steps per batch")
    p.add_argument("--top", type=int, default=8, help="most frequent ops listed per layer")
    p.add_argument("--sites", action="store_true", help="list each op with the code that launched it")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(json.loads(args.child))
        return

    env = npu_path_env(TORCH_NPU_DOUBLE_SYNC_LOG=tempfile.mkdtemp(prefix="launches-syncs-"))
    with tempfile.TemporaryDirectory() as tmp:
        models = {arch: make_tiny_model(ARCHS[arch], Path(tmp)) for arch in args.arch}
        table = {}
        for arch, model in models.items():
            for forms in FORMS:
                print(f"{arch}: {forms} forms ...", flush=True)
                table[(arch, forms)] = _run(model, forms, args.batch, args.steps, env, args.sites)
    print()
    print(
        "| arch | batch | ops/layer native | ops/layer ascend | ratio | goal | syncs/step native, ascend "
        "| host ms/step native, ascend |"
    )
    print("|---|---:|---:|---:|---:|---:|---|---|")
    for arch in args.arch:
        for batch in args.batch:
            n, a = table[(arch, "native")][batch], table[(arch, "ascend")][batch]
            print(
                f"| {arch} | {batch} | {n['ops']:g} | {a['ops']:g} | {a['ops'] / n['ops']:.2f} | "
                f"<= {GOAL[FAMILY[arch]]} | {n['syncs']:g}, {a['syncs']:g} | "
                f"{n['host_ms']:.2f}, {a['host_ms']:.2f} |"
            )
    print()
    for arch in args.arch:
        for forms in FORMS:
            top = table[(arch, forms)][args.batch[0]]["top"]
            listed = ", ".join(f"{k} {v:g}" for k, v in list(top.items())[: args.top])
            print(f"{arch} {forms} (batch {args.batch[0]}): {listed}")
    print()
    for family, ops in LOWER_BOUND.items():
        print(f"lower bound, {family} layer ({len(ops)}): " + "; ".join(ops))


if __name__ == "__main__":
    main()
