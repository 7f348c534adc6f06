"""Run vLLM (LLM API) engines in this process and print JSON results.

    python -m harness.vllm_runner '<json spec>'

Spec: {"model": DIR, "engine": {...EngineArgs...}, "batches": [[prompt, ...], ...] (a prompt:
text, or {"embeds_of": text}: the model's input embeddings of its tokens, as prompt embeddings),
"chats": [[message, ...], ...], "max_tokens": N, "logprobs": K, "sampling": {...SamplingParams...},
"batch_sampling": [{...SamplingParams...} per batch] (added to "sampling" for that batch),
"batch_loras": [[adapter dir or null per prompt] per batch] (each adapter one LoRARequest),
"drafter_parameters": true (also return the drafter's parameter sums; the engine's
processes need VLLM_ALLOW_INSECURE_SERIALIZATION=1 in "env"), "report_runner": true (also
return the worker's model runner class name, as "runner"; the same condition),
"eplb_placement": true (also return, per worker, each EPLB model's physical-to-logical
expert map of every MoE layer, as "eplb_placement"; the same condition), "calls":
[[{"method": name, "args": [...], "kwargs": {...}}, ...] per batch] (LLM methods called
before that batch, such as sleep, wake_up or collective_rpc; a dotted name is an
attribute path from the LLM, as llm_engine.is_sleeping; each result or error message is
returned in "call_results"), "kv_dump": {"prompt": str,
"dir": DIR} (before the batches, prefill that prompt alone and have every worker save its
first attention layer's KV planes of the request's blocks to DIR/rank<N>.pt; needs
VLLM_ENABLE_V1_MULTIPROCESSING=0 and VLLM_ALLOW_INSECURE_SERIALIZATION=1),
"freeze_graph_updates": true (every decode graph replays with the host arguments of its
capture: harness/graph_sabotage.py; an in-process engine), "env": {...}}, or
{"runs": [spec, ...]} to run several engines one after another in this process (each
with its own environment overrides, applied before its engine processes start).
Batches run one after another on the same engine (so later batches can hit the
prefix cache). Output per run: {"batches": [[{"token_ids": [...], "logprobs": [[[id,
lp], ...] per step] and "prompt_logprobs" (when asked), "num_cached_tokens": n, "prompt_len": n}, ...], ...],
"chats": [...], "startup_s": t, "generate_s": t (all batches), "counters": {name: value}, "async_scheduling": bool (the
engine's final setting), "graphs": {"replays": n, "update_ops": n} (what the contract double's decode graphs did in
this process during the run: an in-process engine's)}
(vLLM's counter metrics, when the engine has ``"disable_log_stats": false``); with "runs"
the output is {"runs": [...]}.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import sys
import time
from pathlib import Path

from harness.stacks import stacks_if_slow


def _run(spec: dict) -> dict:
    from vllm import LLM, SamplingParams

    saved = {k: os.environ.get(k) for k in spec.get("env", {})}
    os.environ.update(spec.get("env", {}))
    restore = None
    if spec.get("freeze_graph_updates"):
        from harness.graph_sabotage import freeze_graph_updates

        restore = freeze_graph_updates()
    graphs_before = _graph_stats()
    try:
        t0 = time.perf_counter()
        llm = LLM(model=spec["model"], **spec.get("engine", {}))
        startup = time.perf_counter() - t0
        base = _from_json(
            {
                "max_tokens": spec.get("max_tokens", 16),
                "temperature": 0.0,
                "ignore_eos": True,
                "logprobs": spec.get("logprobs"),
                **spec.get("sampling", {}),
            }
        )
        params = SamplingParams(**base)
        per_batch = [_from_json(b) for b in spec.get("batch_sampling") or [{}] * len(spec["batches"])]
        kv_dump = _kv_dump(llm, **spec["kv_dump"]) if "kv_dump" in spec else None
        calls = spec.get("calls") or [[]] * len(spec["batches"])
        loras = spec.get("batch_loras") or [None] * len(spec["batches"])
        results, call_results = [], []
        t0 = time.perf_counter()
        for batch, extra, before, adapters in zip(spec["batches"], per_batch, calls, loras, strict=True):
            call_results.append([_call(llm, **call) for call in before])
            batch = [_prompt(p, llm) for p in batch]
            outs = llm.generate(
                batch,
                SamplingParams(**{**base, **extra}) if extra else params,
                use_tqdm=False,
                lora_request=None if adapters is None else [_lora(a) for a in adapters],
            )
            results.append([_completion(o) for o in outs])
        generate = time.perf_counter() - t0
        chats = []
        for conversation in spec.get("chats", []):
            [out] = llm.chat(conversation, params, use_tqdm=False)
            chats.append({"token_ids": list(out.outputs[0].token_ids), "text": out.outputs[0].text})
        counters = _counters(llm)
        drafter = llm.collective_rpc(_drafter_parameters)[0] if spec.get("drafter_parameters") else None
        runner = llm.collective_rpc(_runner_class)[0] if spec.get("report_runner") else None
        placement = llm.collective_rpc(_eplb_placement) if spec.get("eplb_placement") else None
        async_scheduling = bool(llm.llm_engine.vllm_config.scheduler_config.async_scheduling)
        # the engine-core process gets the same exit grace as its workers (upstream's
        # explicit shutdown() gives it 5 s, which a loaded 2-core machine can exceed)
        from vllm import envs

        grace = envs.VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS
        with stacks_if_slow(os.getpid(), after=0.75 * grace):  # where a process hangs, before the force-kill
            llm.llm_engine.engine_core.shutdown(timeout=grace)
        del llm
        gc.collect()
    finally:
        if restore is not None:
            restore()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        # an in-process engine core caches vLLM's environment; the next run reads its own
        from vllm import envs

        envs.disable_envs_cache()
    return {
        "batches": results,
        "chats": chats,
        "startup_s": startup,
        "generate_s": generate,
        "counters": counters,
        "drafter_parameters": drafter,
        "runner": runner,
        "eplb_placement": placement,
        "async_scheduling": async_scheduling,
        "kv_dump": kv_dump,
        "call_results": call_results,
        "graphs": {k: v - graphs_before.get(k, 0) for k, v in _graph_stats().items()},
    }


def _graph_stats() -> dict:
    """The contract double's graph counts in this process (empty without the double)."""
    graphs = sys.modules.get("torch_npu._graphs")
    return dict(graphs.stats) if graphs is not None else {}


_LORA_IDS: dict[str, int] = {}  # adapter dir -> its LoRA id (1, 2, ... in first use)


def _lora(adapter: str | None):
    from vllm.lora.request import LoRARequest

    if adapter is None:
        return None
    return LoRARequest(Path(adapter).name, _LORA_IDS.setdefault(adapter, len(_LORA_IDS) + 1), adapter)


def _call(llm, method: str, args: list | None = None, kwargs: dict | None = None) -> dict:
    try:
        target = functools.reduce(getattr, method.split("."), llm)  # "llm_engine.is_sleeping"
        return {"result": target(*(args or []), **(kwargs or {})), "error": None}
    except Exception as exc:  # the test decides whether this call had to fail
        return {"result": None, "error": f"{type(exc).__name__}: {exc}"}


def _prompt(prompt, llm):
    """A prompt as the spec gives it: text, or {"embeds_of": text}: the model's own input
    embeddings of the text's tokens (as the tokenizer makes them for a text prompt), given
    as prompt embeddings (the engine needs "enable_prompt_embeds")."""
    if not (isinstance(prompt, dict) and "embeds_of" in prompt):
        return prompt
    import torch

    ids = llm.get_tokenizer()(prompt["embeds_of"]).input_ids
    table = _input_embeddings(llm.llm_engine.vllm_config.model_config.model)
    return {"prompt_embeds": table[torch.tensor(ids)].float()}


@functools.cache
def _input_embeddings(model_dir: str):
    """The checkpoint's input embedding table (read once per model)."""
    from safetensors import safe_open

    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            names = [n for n in f.keys() if n.endswith("embed_tokens.weight")]  # noqa: SIM118 (not iterable)
            if names:
                return f.get_tensor(names[0])
    raise ValueError(f"no embed_tokens weight in {model_dir}")


def _from_json(sampling: dict) -> dict:
    """SamplingParams options as JSON carries them: logit_bias keys back to token ids."""
    if "logit_bias" in sampling:
        sampling = {**sampling, "logit_bias": {int(k): v for k, v in sampling["logit_bias"].items()}}
    return sampling


def _kv_dump(llm, prompt: str, dir: str) -> dict:
    """Prefill ``prompt`` alone by stepping the in-process engine core until its prompt is
    computed (before any decode step writes more KV), then dump every worker's cache."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    engine.add_request("kv-dump", prompt, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    scheduler = engine.engine_core.engine_core.scheduler
    while True:
        engine.step()
        [request] = scheduler.requests.values()
        if request.num_computed_tokens >= request.num_prompt_tokens:
            break
    block_ids = list(scheduler.kv_cache_manager.get_block_ids(request.request_id)[0])
    llm.collective_rpc(_save_kv, args=(block_ids, dir))
    while engine.has_unfinished_requests():
        engine.step()
    return {"prompt_len": request.num_prompt_tokens, "block_ids": block_ids}


def _save_kv(worker, block_ids: list[int], directory: str) -> None:
    """Runs in the worker: the first attention layer's cache planes at ``block_ids``, head-major
    ``[blocks, heads, block_size, D]`` (MLA: latent | rope; GQA: K | V)."""
    import torch

    from vllm.distributed.parallel_state import get_pcp_group, get_tp_group

    from vllm.ascend.attention.kv_layout import gqa_planes, mla_planes

    context = worker.model_runner.vllm_config.compilation_config.static_forward_context
    name = next(n for n in sorted(context) if ".layers.0." in n and hasattr(context[n], "kv_cache"))
    layer = context[name]
    impl, cache = layer.impl, layer.kv_cache
    ids = torch.tensor(block_ids, dtype=torch.int64)
    if hasattr(impl, "kv_lora_rank"):
        planes = [p[ids].transpose(1, 2) for p in mla_planes(cache, impl.kv_lora_rank)]
    else:
        planes = [p[ids] for p in gqa_planes(cache, impl.head_size, cache.shape[-1] - impl.head_size)]
    torch.save(
        {
            "tp_rank": get_tp_group().rank_in_group,
            "pcp_rank": get_pcp_group().rank_in_group,
            "planes": torch.cat(planes, dim=-1).clone(),
        },
        f"{directory}/rank{worker.rank}.pt",
    )


def _runner_class(worker) -> str:
    """Runs in the worker: the class name of its model runner."""
    return type(worker.model_runner).__name__


def _eplb_placement(worker) -> list:
    """Runs in the worker: each EPLB model's physical-to-logical expert map ([MoE layer]
    [physical expert] -> logical expert), as upstream's EplbState holds it."""
    state = worker.model_runner.eplb.state
    if state is None:
        return []
    return [model.physical_to_logical_map.tolist() for model in state.model_states.values()]


def _drafter_parameters(worker) -> dict:
    """Runs in the worker: the speculative drafter's parameters (name -> float64 sum and
    element count), to compare with the checkpoint it was loaded from."""
    runner = worker.model_runner
    model = runner.speculator.model
    return {name: [float(p.detach().double().sum()), p.numel()] for name, p in model.named_parameters()}


def _counters(llm) -> dict:
    from vllm.v1.metrics.reader import Counter

    try:
        metrics = llm.get_metrics()
    except AssertionError:  # stats logging is off for this engine
        return {}
    counters: dict = {}
    for m in metrics:
        if isinstance(m, Counter):  # summed over engines (data-parallel ranks)
            counters[m.name] = counters.get(m.name, 0) + m.value
    return counters


def _completion(o) -> dict:
    out = {
        "token_ids": list(o.outputs[0].token_ids),
        "text": o.outputs[0].text,
        "num_cached_tokens": o.num_cached_tokens or 0,
        "prompt_len": len(o.prompt_token_ids),
    }
    if o.outputs[0].logprobs is not None:
        out["logprobs"] = [
            sorted(([tid, lp.logprob] for tid, lp in step.items()), key=lambda p: -p[1])
            for step in o.outputs[0].logprobs
        ]
    if o.prompt_logprobs is not None:
        out["prompt_logprobs"] = [
            None
            if step is None
            else sorted(([tid, lp.logprob] for tid, lp in step.items()), key=lambda p: -p[1])
            for step in o.prompt_logprobs
        ]
    return out


def main() -> None:
    spec = json.loads(sys.argv[1])
    os.environ.setdefault("VLLM_ASCEND_EMULATE", "1")
    if "runs" in spec:
        result = {"runs": [_run(run) for run in spec["runs"]]}
    else:
        result = _run(spec)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
