"""Host-emulation serving benchmark: engine start-up time and output tokens/s of the tiny
models (``nox -s bench -- serve``). Each model runs in its own process; numbers are
printed side by side. Start-up goal: <= 15 s. Host mode is for development and CI, so
tokens/s here track regressions of the runtime, not NPU performance.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARCHS = ("llama", "qwen2", "deepseek_v3")


def child(model: str, num_prompts: int, max_tokens: int) -> None:
    os.environ.setdefault("VLLM_ASCEND_EMULATE", "1")
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams

    t_import = time.perf_counter() - t0
    t1 = time.perf_counter()
    llm = LLM(model=model, dtype="float32", max_model_len=512, seed=0)
    startup = time.perf_counter() - t1
    prompts = [f"Request {i}: the quick brown fox jumps over the lazy dog" for i in range(num_prompts)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
    t2 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t2
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print(
        "RESULT "
        + json.dumps({"import_s": t_import, "startup_s": startup, "tokens": tokens, "elapsed_s": elapsed}),
        flush=True,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--child", nargs=3, metavar=("MODEL", "PROMPTS", "TOKENS"), help=argparse.SUPPRESS)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--archs", default=",".join(ARCHS))
    args = p.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]), int(args.child[2]))
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for arch in args.archs.split(","):
            model = Path(tmp) / arch
            subprocess.run(
                [
                    sys.executable,
                    str(ROOT / "examples" / "make_tiny_model.py"),
                    "--arch",
                    arch,
                    "--out",
                    str(model),
                ],
                check=True,
                capture_output=True,
            )
            print(f"{arch}: starting engine ...", flush=True)
            proc = subprocess.run(
                [sys.executable, __file__, "--child", str(model), str(args.prompts), str(args.max_tokens)],
                capture_output=True,
                text=True,
                env=dict(os.environ, VLLM_ASCEND_EMULATE="1"),
            )
            lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
            if proc.returncode != 0 or not lines:
                sys.exit(f"error: benchmark of {arch} failed:\n{proc.stderr[-3000:]}")
            r = json.loads(lines[-1][7:])
            rows.append((arch, r))
    print(f"\n{'model':<12} {'import s':>9} {'start-up s':>11} {'goal':>6} {'out tok/s':>10}")
    for arch, r in rows:
        ok = "ok" if r["startup_s"] <= 15 else "SLOW"
        print(
            f"{arch:<12} {r['import_s']:>9.1f} {r['startup_s']:>11.1f} {ok:>6} "
            f"{r['tokens'] / r['elapsed_s']:>10.1f}"
        )
    print(f"({args.prompts} prompts x {args.max_tokens} tokens, greedy, float32, host emulation)")


if __name__ == "__main__":
    main()
