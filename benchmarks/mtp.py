"""DeepSeek MTP speculative decoding in host emulation: acceptance rate, accepted tokens
per verification step and output tokens/s, without MTP and with k = 1, 2 draft tokens,
side by side in one run on the tiny DeepSeek-V3 (made here by examples/make_tiny_model.py).

    nox -s bench -- mtp [--prompts 16] [--max-tokens 32]

The tiny model's MTP layer is random, so its drafts are almost never accepted: the
acceptance rate here measures nothing about a real checkpoint and sets no target, and
tokens/s shows the cost of drafting and verifying on the host CPU. The "all accepted"
row (upstream's synthetic rejection mode, every draft accepted) shows what the same
machinery gives when drafts are accepted. Host numbers say nothing about NPU speed.
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


def configs() -> dict[str, dict | None]:
    def mtp(k: int, **extra) -> dict:
        return {"method": "deepseek_mtp", "num_speculative_tokens": k, **extra}

    return {
        "no MTP": None,
        "MTP k=1": mtp(1),
        "MTP k=2": mtp(2),
        "MTP k=2, all accepted": mtp(
            2, rejection_sample_method="synthetic", synthetic_acceptance_rates=[1.0, 1.0]
        ),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "deepseek_v3"
        subprocess.run(
            [
                sys.executable,
                str(ROOT / "examples" / "make_tiny_model.py"),
                "--arch",
                "deepseek_v3",
                "--out",
                str(model),
            ],
            check=True,
            capture_output=True,
        )
        prompts = [f"Request {i}: the quick brown fox jumps over the lazy dog" for i in range(args.prompts)]
        runs = []
        for spec in configs().values():
            engine = {"dtype": "float32", "max_model_len": 512, "seed": 0, "disable_log_stats": False}
            if spec:
                engine["speculative_config"] = spec
            # The first batch warms the engine up; the second is measured.
            runs.append(
                {
                    "model": str(model),
                    "engine": engine,
                    "batches": [prompts[:2], prompts],
                    "max_tokens": args.max_tokens,
                }
            )
        print(
            f"running {len(runs)} engines on {args.prompts} prompts x {args.max_tokens} tokens ...",
            flush=True,
        )
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
        results = json.loads(lines[-1][len("RESULT ") :])["runs"]
    base = None
    header = f"{'configuration':24} {'accept rate':>11} {'accepted/step':>13} {'output tok/s':>12}"
    print(f"\n{header} {'vs no MTP':>9}")
    for name, run in zip(configs(), results):
        tokens = sum(len(r["token_ids"]) for batch in run["batches"] for r in batch)
        rate = tokens / run["generate_s"]  # both batches: the warm-up is short and the same for every row
        base = base or rate
        c = run["counters"]
        drafts, steps = c.get("vllm:spec_decode_num_draft_tokens", 0), c.get("vllm:spec_decode_num_drafts", 0)
        accepted = c.get("vllm:spec_decode_num_accepted_tokens", 0)
        acc = f"{accepted / drafts:.3f}" if drafts else "-"
        per_step = f"{accepted / steps:.2f}" if steps else "-"
        print(f"{name:24} {acc:>11} {per_step:>13} {rate:>12.1f} {rate / base:>8.2f}x")


if __name__ == "__main__":
    main()
