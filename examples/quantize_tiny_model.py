"""Quantize a float checkpoint into msModelSlim's W8A8 or W4A8 format (what ``--quantization ascend`` serves).

    python examples/quantize_tiny_model.py --model /tmp/tiny-qwen2 --out /tmp/tiny-qwen2-w8a8 --scheme w8a8
    python examples/quantize_tiny_model.py --model /tmp/tiny-dsv3 --out /tmp/tiny-dsv3-w8a8d \
        --scheme w8a8_dynamic [--float-mtp] [--keep-float REGEX ...]
    python examples/quantize_tiny_model.py --model /tmp/tiny-dsv3 --out /tmp/tiny-dsv3-w4a8 --scheme w4a8_dynamic

Works on any llama, qwen2, qwen3_moe, deepseek_v3 or deepseek_v32 checkpoint in safetensors (made by
``make_tiny_model.py`` or not); meant for small models, everything is held in memory.

* Weights: symmetric per output channel, ``scale = max|w| / 127``, rounded half to even.
* ``w8a8``: linear layers static W8A8. Their activation range is calibrated by running
  the float model (Hugging Face transformers) over a built-in text: per layer one
  asymmetric scale and offset over the range seen (widened to include 0). MoE experts
  are W8A8_DYNAMIC (msModelSlim has no static MoE scheme), and so are the layers of the
  DeepSeek MTP module, which transformers does not run (nothing to calibrate them on).
* ``w8a8_dynamic``: every linear layer W8A8_DYNAMIC (activations quantized per token at
  run time).
* ``w4a8_dynamic``: MoE routed experts W4A8_DYNAMIC in msModelSlim's per-channel format
  (version "1.0.0"): int4 weights, ``scale = max|w| / 7``, two per int8 byte along the
  output dim (row ``2j`` in the low nibble), and the offset term ``scale_bias = 8 * sum_k
  w * scale`` (gate/up ``[out, 1]``, down ``[H, 16]``: the input dim in 16 parts); every
  other linear layer W8A8_DYNAMIC, as msModelSlim's W4A8 recipes do.
* Always float: embeddings, norms, the LM heads, the MoE router, MLA's ``kv_b_proj`` (as
  msModelSlim leaves it), the MTP module's ``eh_proj`` and DeepSeek-V3.2's indexer key and
  weights projections (``wk``, ``weights_proj``: upstream's indexer builds them float; its
  query projection ``wq_b`` is quantized like the other linear layers); ``--float-mtp`` keeps the
  whole MTP module float; ``--keep-float REGEX`` (repeatable) keeps every linear weight
  whose name matches float (for example one MoE layer's experts, which vLLM then serves
  with the unquantized Ascend MoE method).

Output: ``quant_model_weights.safetensors``, ``quant_model_description.json`` (every
tensor's scheme), and the model's config, tokenizer and generation files.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

import vllm  # noqa: F401  (first: on hosts without CANN, hides an unusable torch_npu from transformers)

ARCHS = ("llama", "qwen2", "qwen3_moe", "deepseek_v3", "deepseek_v32")
LINEARS = {
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "q_a_proj",
    "q_b_proj",
    "kv_a_proj_with_mqa",
    "kv_b_proj",
    "wq_b",  # DeepSeek-V3.2's indexer query projection
}
ALWAYS_FLOAT = {"kv_b_proj"}
CALIBRATION = [
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.",
    "Large language models predict the next token from the tokens before it.",
    "Paged attention stores keys and values in fixed-size blocks; decode produces one token at a time.",
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 11 12 and punctuation , . ; : ! ? ( ) [ ] { }",
    "Mixture of experts routes each token to a few experts. Speculative decoding drafts tokens.",
    "Once upon a time there was a small model that learned to count: one two three four five.",
]
LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def fail(message: str) -> None:
    print(f"quantize_tiny_model: {message}", file=sys.stderr)
    raise SystemExit(2)


def load_tensors(model: Path) -> dict[str, torch.Tensor]:
    files = sorted(model.glob("*.safetensors"))
    if not files:
        fail(f"{model} has no *.safetensors files")
    tensors = {}
    for file in files:
        tensors.update(load_file(str(file)))
    return tensors


def linear_name(name: str) -> str | None:
    """The module name of a 2-D linear weight (``...q_proj.weight`` -> ``q_proj``)."""
    if not name.endswith(".weight") or not LAYER.match(name):
        return None
    module = name[: -len(".weight")].rsplit(".", 1)[-1]
    return module if module in LINEARS else None


def plan_schemes(
    tensors: dict, config: dict, scheme: str, float_mtp: bool, keep_float: tuple[re.Pattern, ...] = ()
) -> dict[str, str]:
    """Scheme per linear weight; everything else is FLOAT."""
    mtp_first = config["num_hidden_layers"] if config["model_type"].startswith("deepseek") else None
    plan = {}
    for name, tensor in tensors.items():
        module = linear_name(name)
        if module is None or tensor.dim() != 2 or module in ALWAYS_FLOAT:
            continue
        if any(pattern.search(name) for pattern in keep_float):
            continue
        layer = int(LAYER.match(name).group(1))
        in_mtp = mtp_first is not None and layer >= mtp_first
        if in_mtp and float_mtp:
            continue
        expert = ".mlp.experts." in name
        if scheme == "w4a8_dynamic":
            plan[name] = "W4A8_DYNAMIC" if expert else "W8A8_DYNAMIC"
            continue
        dynamic = scheme == "w8a8_dynamic" or expert or in_mtp
        plan[name] = "W8A8_DYNAMIC" if dynamic else "W8A8"
    check_whole_expert_layers(tensors, plan)
    return plan


def check_whole_expert_layers(tensors: dict, plan: dict[str, str]) -> None:
    """vLLM runs one MoE method per layer: its routed experts are all quantized or all float."""
    quantized: dict[str, set[bool]] = {}
    for name in tensors:
        if ".mlp.experts." in name and linear_name(name):
            quantized.setdefault(name.split(".mlp.experts.")[0], set()).add(name in plan)
    mixed = sorted(layer for layer, kinds in quantized.items() if len(kinds) > 1)
    if mixed:
        fail(
            f"--keep-float matches only some routed experts of {mixed[0]}.mlp.experts; "
            "keep all of a layer's experts float or none (match e.g. 'layers\\.2\\.mlp\\.experts\\.')"
        )


def calibrate(model: Path, names: list[str]) -> dict[str, tuple[float, float]]:
    """(min, max) of the input of each named linear layer over the calibration text."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model)
    wanted = {name[: -len(".weight")] for name in names}
    ranges: dict[str, tuple[float, float]] = {}

    def hook(module_name):
        def record(_module, args):
            x = args[0].detach()
            low, high = float(x.min()), float(x.max())
            old = ranges.get(module_name, (low, high))
            ranges[module_name] = (min(old[0], low), max(old[1], high))

        return record

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in hf.named_modules() if n in wanted]
    missing = wanted - {n for n, _ in hf.named_modules()}
    if missing:
        fail(f"transformers' model has no modules {sorted(missing)[:3]}... to calibrate")
    with torch.no_grad():
        for text in CALIBRATION:
            hf(**tokenizer(text, return_tensors="pt"))
    for handle in handles:
        handle.remove()
    return ranges


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    w = weight.to(torch.float32)
    scale = (w.abs().amax(dim=1, keepdim=True) / 127).clamp(min=torch.finfo(torch.float32).eps)
    return torch.round(w / scale).clamp(-128, 127).to(torch.int8), scale


DOWN_OFFSET_PARTS = 16


def quantize_w4a8(name: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """One expert projection in msModelSlim's per-channel W4A8_DYNAMIC tensors."""
    w = weight.to(torch.float32)
    out, inner = w.shape
    down = ".down_proj." in name
    if out % 2 or (down and inner % DOWN_OFFSET_PARTS):
        fail(
            f"{name} [{out}, {inner}]: W4A8 needs an even output size (and a down projection's input a multiple of 16)"
        )
    scale = (w.abs().amax(dim=1, keepdim=True) / 7).clamp(min=torch.finfo(torch.float32).eps)
    q = torch.round(w / scale).clamp(-8, 7).to(torch.int16)
    packed = ((q[1::2] & 0xF) << 4 | (q[0::2] & 0xF)).to(torch.uint8).view(torch.int8)
    dequantized = q.to(torch.float64) * scale.to(torch.float64)
    parts = DOWN_OFFSET_PARTS if down else 1
    offset = 8 * dequantized.view(out, parts, inner // parts).sum(dim=-1)
    return {
        "weight": packed,
        "weight_scale": scale,
        "weight_offset": torch.zeros_like(scale),
        "scale_bias": offset.to(torch.float32),
    }


def activation_qparams(low: float, high: float) -> tuple[float, float]:
    low, high = min(low, 0.0), max(high, 0.0)
    scale = max((high - low) / 255, torch.finfo(torch.float32).eps)
    return scale, float(round(-low / scale) - 128)


def encode_deq_scale(deq: torch.Tensor, float16_model: bool) -> torch.Tensor:
    if not float16_model:
        return deq
    return deq.to(torch.float32).view(torch.int32).to(torch.int64)  # float32 bits in the low word


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="float checkpoint directory")
    parser.add_argument("--out", type=Path, required=True, help="directory to write (must not exist)")
    parser.add_argument("--scheme", choices=("w8a8", "w8a8_dynamic", "w4a8_dynamic"), required=True)
    parser.add_argument("--float-mtp", action="store_true", help="keep the DeepSeek MTP module float")
    parser.add_argument(
        "--keep-float",
        action="append",
        default=[],
        metavar="REGEX",
        help="keep linear weights whose name matches float (repeatable)",
    )
    args = parser.parse_args(argv)
    try:
        keep_float = tuple(re.compile(pattern) for pattern in args.keep_float)
    except re.error as error:
        fail(f"--keep-float {error.pattern!r}: {error}")
    config_path = args.model / "config.json"
    if not config_path.is_file():
        fail(f"{args.model} has no config.json")
    config = json.loads(config_path.read_text())
    if config.get("model_type") not in ARCHS:
        fail(f"model_type {config.get('model_type')!r} is not supported; supported: {', '.join(ARCHS)}")
    if args.out.exists():
        fail(f"{args.out} exists; choose a new directory")
    tensors = load_tensors(args.model)
    plan = plan_schemes(tensors, config, args.scheme, args.float_mtp, keep_float)
    if not plan:
        fail("nothing left to quantize: --keep-float matches every linear layer")
    static = [name for name, scheme in plan.items() if scheme == "W8A8"]
    ranges = calibrate(args.model, static) if static else {}
    float16_model = config.get("torch_dtype", config.get("dtype")) == "float16"

    out_tensors: dict[str, torch.Tensor] = {}
    description: dict[str, str] = {}
    for name, tensor in tensors.items():
        scheme = plan.get(name)
        if scheme is None:
            out_tensors[name], description[name] = tensor.contiguous(), "FLOAT"
            continue
        prefix = name[: -len(".weight")]
        w_q, w_scale = quantize_weight(tensor)
        layer = {"weight": w_q}
        if scheme == "W4A8_DYNAMIC":
            layer = quantize_w4a8(name, tensor)
        elif scheme == "W8A8_DYNAMIC":
            layer["weight_scale"] = w_scale
            layer["weight_offset"] = torch.zeros_like(w_scale)
        else:
            if prefix not in ranges:
                fail(f"{prefix} was never run during calibration")
            in_scale, in_offset = activation_qparams(*ranges[prefix])
            deq = (in_scale * w_scale.squeeze(1)).to(torch.float32)
            bias = tensors.get(prefix + ".bias")
            folded = (
                bias.to(torch.float64) / deq.to(torch.float64)
                if bias is not None
                else torch.zeros_like(deq, dtype=torch.float64)
            )
            quant_bias = torch.round(folded - in_offset * w_q.to(torch.float64).sum(dim=1)).to(torch.int32)
            layer.update(
                input_scale=torch.tensor([in_scale], dtype=torch.float32),
                input_offset=torch.tensor([in_offset], dtype=torch.float32),
                deq_scale=encode_deq_scale(deq, float16_model),
                quant_bias=quant_bias,
            )
        for suffix, value in layer.items():
            out_tensors[f"{prefix}.{suffix}"], description[f"{prefix}.{suffix}"] = value.contiguous(), scheme
    schemes = set(plan.values())
    description = {
        "model_quant_type": next(k for k in ("W4A8_DYNAMIC", "W8A8", "W8A8_DYNAMIC") if k in schemes),
        "version": "1.0.0",
        "group_size": 0,
        **description,
    }

    args.out.mkdir(parents=True)
    try:
        save_file(out_tensors, str(args.out / "quant_model_weights.safetensors"))
        (args.out / "quant_model_description.json").write_text(json.dumps(description, indent=1) + "\n")
        config.pop("quantization_config", None)
        (args.out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for file in args.model.iterdir():
            if (
                file.is_file()
                and file.suffix != ".safetensors"
                and file.name not in ("config.json",)
                and not file.name.endswith(".safetensors.index.json")
            ):
                shutil.copy2(file, args.out / file.name)
    except BaseException:
        shutil.rmtree(args.out, ignore_errors=True)  # no half-written checkpoint
        raise
    counts = {s: sum(1 for v in plan.values() if v == s) for s in sorted(schemes)}
    print(f"wrote {args.out}: {counts} linear layers quantized, {len(tensors) - len(plan)} tensors float")


if __name__ == "__main__":
    main()
