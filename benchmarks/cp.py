"""Context parallelism in host emulation: engine start-up and output tokens/s of TP=1
and of DCP=2 (at TP=2), PCP=2 and PCP=2 x DCP=2 (at TP=2), side by side in one run, on
the tiny DeepSeek-V3 (MLA) and a tiny Qwen2 with one KV head (GQA), made here by
examples/make_tiny_model.py.

    nox -s bench -- cp [--prompts 8] [--max-tokens 32] [--prompt-words 150]

Host emulation runs every rank on the same CPU cores with gloo between processes, so
these numbers show the cost of the extra processes and collectives, not what context
parallelism gains on NPUs (more KV per sequence, split prefill); nothing here says
anything about NPU speed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = {
    "TP=1": {},
    "TP=2, DCP=2": {"tensor_parallel_size": 2, "decode_context_parallel_size": 2},
    "PCP=2": {"prefill_context_parallel_size": 2},
    "TP=2, PCP=2, DCP=2": {
        "tensor_parallel_size": 2,
        "prefill_context_parallel_size": 2,
        "decode_context_parallel_size": 2,
    },
}
MODELS = {
    "MLA (deepseek_v3)": ["--arch", "deepseek_v3"],
    "GQA (qwen2, 1 KV head)": ["--arch", "qwen2", "--kv-heads", "1"],
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt-words", type=int, default=150)
    args = p.parse_args()
    words = ("the quick brown fox jumps over the lazy dog " * args.prompt_words).split()[: args.prompt_words]
    prompts = [f"Request {i}: " + " ".join(words) for i in range(args.prompts)]
    print(f"{'model':24} {'layout':20} {'start-up s':>10} {'output tok/s':>12} {'vs TP=1':>8}")
    with tempfile.TemporaryDirectory() as tmp:
        for label, make in MODELS.items():
            model = Path(tmp) / make[1]
            subprocess.run(
                [sys.executable, str(ROOT / "examples" / "make_tiny_model.py"), *make, "--out", str(model)],
                check=True,
                capture_output=True,
            )
            runs = [
                {
                    "model": str(model),
                    "batches": [prompts[:2], prompts],
                    "max_tokens": args.max_tokens,
                    "engine": {
                        "dtype": "float32",
                        "max_model_len": 1024,
                        "seed": 0,
                        "block_size": 16,
                        "distributed_executor_backend": "mp",
                        **layout,
                    },
                }
                for layout in LAYOUTS.values()
            ]
            proc = subprocess.run(
                [sys.executable, "-m", "harness.vllm_runner", json.dumps({"runs": runs})],
                cwd=ROOT,
                env=dict(os.environ, VLLM_ASCEND_EMULATE="1"),
                capture_output=True,
                text=True,
            )
            lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
            if proc.returncode or not lines:
                sys.exit(f"benchmark engines failed:\n{proc.stderr[-4000:]}")
            base = None
            for name, run in zip(LAYOUTS, json.loads(lines[-1][len("RESULT ") :])["runs"]):
                tokens = sum(len(r["token_ids"]) for r in run["batches"][1])
                rate = tokens / run["generate_s"]
                base = base or rate
                print(
                    f"{label:24} {name:20} {run['startup_s']:>10.1f} {rate:>12.1f} {rate / base:>7.2f}x",
                    flush=True,
                )


if __name__ == "__main__":
    main()
