"""The oracle for quantized serving: Hugging Face transformers' float model with every
layer the description quantizes replaced by the same quantize / dequantize math written
plainly in PyTorch (activation quantization in float32 as the kernels do it, integer
products summed exactly in float64), reading the quantized checkpoint's own tensors.

Greedy decoding records, per step, the gap between the two best logits, so that a
divergence from vLLM can be told apart: at a near-tie (gap below ``NEAR_TIE``) a last-bit
difference may pick the other token, and the rest of that sequence is not comparable.
"""

from __future__ import annotations

import json
import types
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

NEAR_TIE = 1e-2  # logits; float32 rounding differences between the two sides are ~1e-5
# Static W8A8 rounds every activation against a calibrated per-tensor grid: a float32
# difference of one ulp that lands on a rounding boundary moves that activation by a whole
# step of the grid, and the tiny models' logits by up to a few 1e-2 (0.021 measured: the
# Ascend routing's float32 formula against upstream's moved one such rounding, issue 24).
STATIC_NEAR_TIE = 5e-2


def _static(tensors: dict, prefix: str):
    w_q = tensors[f"{prefix}.weight"].double()
    scale, offset = tensors[f"{prefix}.input_scale"].float(), tensors[f"{prefix}.input_offset"].float()
    deq = tensors[f"{prefix}.deq_scale"]
    if deq.dtype == torch.int64:
        deq = (deq & 0xFFFFFFFF).to(torch.int32).view(torch.float32)
    deq, quant_bias = deq.double(), tensors[f"{prefix}.quant_bias"].double()

    def forward(_self, x):
        x_q = torch.clamp(torch.round(x.float() / scale + offset), -128, 127)
        return ((x_q.double() @ w_q.t() + quant_bias) * deq).to(x.dtype)

    return forward


def _per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True) / 127
    x_q = torch.clamp(torch.round(xf / torch.where(scale > 0, scale, torch.ones_like(scale))), -128, 127)
    return x_q.double(), scale.double()


def _dynamic_matmul(x, w_q, w_scale, bias=None):
    x_q, scale = _per_token(x)
    y = (x_q @ w_q.t()) * w_scale.reshape(1, -1) * scale
    return y if bias is None else y + bias.double()


def _dynamic(tensors: dict, prefix: str, bias):
    w_q, w_scale = tensors[f"{prefix}.weight"].double(), tensors[f"{prefix}.weight_scale"].double()

    def forward(_self, x):
        return _dynamic_matmul(x, w_q, w_scale, bias).to(x.dtype)

    return forward


def int4_rows(packed: torch.Tensor) -> torch.Tensor:
    """msModelSlim's W4A8 weight [out/2, in] int8, two int4 per byte (row 2j low nibble,
    2j+1 high), as its values [out, in]; written out byte by byte from the format's
    description, not with the code under test."""
    byte = packed.view(torch.uint8).to(torch.int64)
    rows = torch.empty(packed.shape[0] * 2, packed.shape[1], dtype=torch.int64)
    for nibble, shift in ((0, 0), (1, 4)):
        value = (byte >> shift) & 0xF
        rows[nibble::2] = value - 16 * (value >= 8).to(torch.int64)
    return rows


def _experts(tensors: dict, prefix: str, num_experts: int, int4: bool = False):
    def stacked(proj, suffix):
        def one(e):
            t = tensors[f"{prefix}.{e}.{proj}.{suffix}"]
            return int4_rows(t) if int4 and suffix == "weight" else t

        return torch.stack([one(e) for e in range(num_experts)]).double()

    gate, up, down = (stacked(p, "weight") for p in ("gate_proj", "up_proj", "down_proj"))
    s_gate, s_up, s_down = (stacked(p, "weight_scale") for p in ("gate_proj", "up_proj", "down_proj"))

    def forward(_self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros(hidden_states.shape, dtype=torch.float64)
        for e in torch.unique(top_k_index).tolist():
            tokens, slots = torch.nonzero(top_k_index == e, as_tuple=True)
            h = hidden_states[tokens]
            w13, s13 = torch.cat([gate[e], up[e]]), torch.cat([s_gate[e], s_up[e]])
            g, u = _dynamic_matmul(h, w13, s13).float().chunk(2, dim=-1)
            act = F.silu(g) * u
            y = _dynamic_matmul(act, down[e], s_down[e])
            out.index_add_(0, tokens, y * top_k_weights[tokens, slots].double().unsqueeze(1))
        return out.to(hidden_states.dtype)

    return forward


def fake_quantized(float_model: Path, quantized: Path):
    """transformers' model of ``float_model`` computing like the checkpoint in ``quantized``."""
    from tests.support.oracle import transformers_classes

    description = json.loads((quantized / "quant_model_description.json").read_text())
    tensors = load_file(str(quantized / "quant_model_weights.safetensors"))
    config, model_class = transformers_classes(float_model, vision_language=False)
    hf = model_class.from_pretrained(float_model, config=config, dtype=torch.float32).eval()
    replaced = 0
    for name, module in hf.named_modules():
        scheme = description.get(f"{name}.weight")
        if isinstance(module, torch.nn.Linear) and scheme == "W8A8":
            module.forward = types.MethodType(_static(tensors, name), module)
        elif isinstance(module, torch.nn.Linear) and scheme == "W8A8_DYNAMIC":
            module.forward = types.MethodType(_dynamic(tensors, name, module.bias), module)
        elif type(module).__name__.endswith("Experts") and description.get(
            f"{name}.0.gate_proj.weight"
        ) not in (None, "FLOAT"):
            int4 = description[f"{name}.0.gate_proj.weight"] == "W4A8_DYNAMIC"
            module.forward = types.MethodType(_experts(tensors, name, module.num_experts, int4), module)
        else:
            continue
        replaced += 1
    assert replaced, f"no layer of {float_model} was replaced: nothing quantized?"
    return hf


def greedy_with_gaps(
    hf, tokenizer, prompts: list[str], max_tokens: int
) -> list[tuple[list[int], list[float]]]:
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            tokens, gaps = [], []
            for _ in range(max_tokens):
                logits = hf(ids).logits[0, -1].double()
                top = logits.topk(2).values
                token = int(logits.argmax())
                tokens.append(token)
                gaps.append(float(top[0] - top[1]))
                ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
            out.append((tokens, gaps))
    return out


def compare(
    got: list[list[int]], reference: list[tuple[list[int], list[float]]], near_tie: float = NEAR_TIE
) -> tuple[list, list]:
    """(mismatches, near_ties): a divergence at a step whose reference gap is below
    ``near_tie`` is a near-tie (reported); any other divergence is a mismatch."""
    mismatches, near_ties = [], []
    for i, (tokens, (expected, gaps)) in enumerate(zip(got, reference)):
        for step, (a, b) in enumerate(zip(tokens, expected)):
            if a != b:
                (near_ties if gaps[step] < near_tie else mismatches).append(
                    {"prompt": i, "step": step, "got": a, "expected": b, "gap": gaps[step]}
                )
                break
    return mismatches, near_ties
