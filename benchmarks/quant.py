"""W8A8 and W4A8 (msModelSlim) checkpoints vs their float models, side by side in one run:
bytes of the linear-layer and expert weights (with their scales and offsets), of the
routed experts alone, and host-emulation output tokens/s, for the tiny Qwen2 and
DeepSeek-V3 made here (examples/make_tiny_model.py, quantized by
examples/quantize_tiny_model.py).

    nox -s bench -- quant [--prompts 16] [--max-tokens 32] [--hidden-size 256]

The weight ratio is a property of the format (int8 plus per-channel float32 scale and
offset against the float32 weights of the tiny models; against bfloat16 it would be about
twice as large; W4A8's experts hold two int4 per byte, so theirs is about half W8A8's).
W4A8 runs on DeepSeek-V3 only (it quantizes MoE experts; Qwen2 has none). Host tokens/s
compares the reference int8 kernels on the CPU with float matmuls; it says nothing about
NPU speed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WEIGHT = re.compile(
    r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|q_a_proj|q_b_proj|"
    r"kv_a_proj_with_mqa|kv_b_proj)\."
)


def linear_bytes(model: Path, experts_only: bool = False) -> int:
    """Bytes of every tensor that belongs to a linear layer or an expert (weights and their
    quantization parameters; ``experts_only``: the routed experts'), from the safetensors
    headers."""
    total = 0
    for file in model.glob("*.safetensors"):
        with open(file, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for name, entry in header.items():
            if experts_only and ".mlp.experts." not in name:
                continue
            if name != "__metadata__" and WEIGHT.search(name):
                start, end = entry["data_offsets"]
                total += end - start
    return total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--hidden-size", type=int, default=256, help="of the tiny models (64 in the tests)")
    args = p.parse_args()
    prompts = [f"Request {i}: the quick brown fox jumps over the lazy dog" for i in range(args.prompts)]
    with tempfile.TemporaryDirectory() as tmp:
        rows, runs = [], []
        for arch in ("qwen2", "deepseek_v3"):
            float_model = Path(tmp) / arch
            subprocess.run(
                [
                    sys.executable,
                    str(ROOT / "examples" / "make_tiny_model.py"),
                    "--arch",
                    arch,
                    "--hidden-size",
                    str(args.hidden_size),
                    "--intermediate-size",
                    str(2 * args.hidden_size),
                    "--out",
                    str(float_model),
                ],
                check=True,
                capture_output=True,
            )
            variants = [("float", float_model)]
            for scheme in ("w8a8", "w8a8_dynamic", "w4a8_dynamic")[: 3 if arch == "deepseek_v3" else 2]:
                out = Path(tmp) / f"{arch}-{scheme}"
                done = subprocess.run(
                    [
                        sys.executable,
                        str(ROOT / "examples" / "quantize_tiny_model.py"),
                        "--model",
                        str(float_model),
                        "--out",
                        str(out),
                        "--scheme",
                        scheme,
                    ],
                    capture_output=True,
                    text=True,
                )
                if done.returncode:
                    sys.exit(f"quantizing {arch} ({scheme}) failed:\n{done.stderr[-3000:]}")
                variants.append((scheme, out))
            for scheme, model in variants:
                rows.append(
                    (
                        arch,
                        scheme,
                        linear_bytes(model),
                        linear_bytes(float_model),
                        linear_bytes(model, experts_only=True),
                        linear_bytes(float_model, experts_only=True),
                    )
                )
                engine = {"dtype": "float32", "max_model_len": 512, "seed": 0}
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
    print(
        f"\n{'model':12} {'scheme':13} {'linear+expert MiB':>17} {'vs float':>8} {'experts MiB':>11} {'vs float':>8} "
        f"{'output tok/s':>12} {'vs float':>8}"
    )
    base_rate = {}
    for (arch, scheme, size, float_size, experts, float_experts), run in zip(rows, results):
        tokens = sum(len(r["token_ids"]) for batch in run["batches"] for r in batch)
        rate = tokens / run["generate_s"]  # both batches: the warm-up is short and the same for every row
        base_rate.setdefault(arch, rate)
        print(
            f"{arch:12} {scheme:13} {size / 2**20:>17.3f} {size / float_size:>8.3f} "
            + (
                f"{experts / 2**20:>11.3f} {experts / float_experts:>8.3f} "
                if float_experts
                else f"{'-':>11} {'-':>8} "
            )
            + f"{rate:>12.1f} {rate / base_rate[arch]:>7.2f}x"
        )
    print("\ngoal: linear + expert weight bytes <= 0.30 of float")


if __name__ == "__main__":
    main()
