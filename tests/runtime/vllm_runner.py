"""Run vLLM (LLM API) in its own process and print JSON results: one engine per call.

    python -m tests.runtime.vllm_runner '<json spec>'

Spec: {"model": DIR, "engine": {...EngineArgs...}, "batches": [[prompt, ...], ...],
"chats": [[message, ...], ...], "max_tokens": N}. Batches run one after another on the same engine (so later batches
can hit the prefix cache). Output: {"batches": [[{"token_ids": [...],
"num_cached_tokens": n, "prompt_len": n}, ...], ...], "startup_s": t}.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> None:
    spec = json.loads(sys.argv[1])
    os.environ.setdefault("VLLM_ASCEND_EMULATE", "1")
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=spec["model"], **spec.get("engine", {}))
    startup = time.perf_counter() - t0
    params = SamplingParams(max_tokens=spec.get("max_tokens", 16), temperature=0.0, ignore_eos=True)
    results = []
    for batch in spec["batches"]:
        outs = llm.generate(batch, params, use_tqdm=False)
        results.append([
            {"token_ids": list(o.outputs[0].token_ids), "text": o.outputs[0].text,
             "num_cached_tokens": o.num_cached_tokens or 0, "prompt_len": len(o.prompt_token_ids)}
            for o in outs
        ])
    chats = []
    for conversation in spec.get("chats", []):
        [out] = llm.chat(conversation, params, use_tqdm=False)
        chats.append({"token_ids": list(out.outputs[0].token_ids), "text": out.outputs[0].text})
    print("RESULT " + json.dumps({"batches": results, "chats": chats, "startup_s": startup}), flush=True)


if __name__ == "__main__":
    main()
