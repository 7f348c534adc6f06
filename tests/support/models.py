"""Tiny random-weight models (examples/make_tiny_model.py) and their msModelSlim W8A8
checkpoints (examples/quantize_tiny_model.py), made in a subprocess."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ARCHS = ("llama", "qwen2", "deepseek_v3")
# A Qwen3-MoE (softmax top-k routing): served by the MoE tests only (tests/engine/test_moe_serving.py).
QWEN3_MOE = "qwen3_moe"
# The DeepSeek variant whose MLA sizes (latent 512, rope 64) torch_npu's MLA kernel takes.
MLA512 = "deepseek_v3_mla512"
# The LongCat-Flash variant with those MLA sizes (its identity experts on the NPU path).
LONGCAT512 = "longcat_flash_mla512"
# Qwen3.5 (dense and MoE) and Qwen3-Next whose Gated DeltaNet heads (2 key, 4 value, 128
# wide) and attention heads (128) torch_npu's ops take: the NPU path's hybrids
# (tests/engine/test_npu_path.py).
QWEN35_NPU = "qwen3_5_npu"
QWEN35_MOE_NPU = "qwen3_5_moe_npu"
QWEN3_NEXT_NPU = "qwen3_next_npu"
NPU_HYBRIDS = {QWEN35_NPU: "qwen3_5", QWEN35_MOE_NPU: "qwen3_5_moe", QWEN3_NEXT_NPU: "qwen3_next"}
# The DeepSeek-V3.2 variant torch_npu's sparse attention ops take: MLA latent 512 + rope 64,
# indexer heads of 128 (tests/engine/test_npu_path.py).
V32_NPU = "deepseek_v32_npu"
# A Qwen2 with one KV head: at TP=2 each rank holds a replica of it, which DCP shards.
QWEN2_KV1 = "qwen2_kv1"
# A Qwen2-VL (M-RoPE positions; text prompts only): tests/engine/test_model_runner_v2.py.
QWEN2_VL = "qwen2_vl"
# A smaller Llama with other weights: a separate draft model for the tiny Llama, and an
# EAGLE head made from it (``eagle_head``).
LLAMA_DRAFT = "llama_draft"
LLAMA_EAGLE = "llama_eagle"
# Families served by tests/engine/test_model_families.py: sliding windows on every layer
# (Mistral), alternating with full attention (Gemma 3; Gemma 2 with soft-capped attention
# logits), dense q/k-norm attention (Qwen3), sinks and biased experts (gpt-oss), MLA with
# zero-computation (identity) experts (LongCat-Flash), Gated DeltaNet linear attention with
# a full-attention layer every fourth (Qwen3-Next with its MoE, Qwen3.5 dense and MoE),
# DeepSeek sparse attention (V3.2: a lightning indexer picks 16 keys per query; GLM-5: the
# same layers, its indexer's rope interleaved).
FAMILIES = (
    "mistral",
    "gemma2",
    "gemma3",
    "qwen3",
    "gpt_oss",
    "longcat_flash",
    "qwen3_next",
    "qwen3_5",
    "qwen3_5_moe",
    "deepseek_v32",
    "glm_moe_dsa",
)
# name: make_tiny_model.py's options
VARIANTS = {
    **{arch: ["--arch", arch] for arch in FAMILIES},
    # four layers: three Gated DeltaNet, one full attention
    **{arch: ["--arch", arch, "--layers", "4"] for arch in ("qwen3_next", "qwen3_5", "qwen3_5_moe")},
    # heads of 64 (the others have 16): the head sizes torch_npu's fused q/k rotary takes
    "qwen3": ["--arch", "qwen3", "--hidden-size", "128", "--heads", "2"],
    **{arch: ["--arch", arch] for arch in ARCHS},
    MLA512: ["--arch", "deepseek_v3", "--kv-lora-rank", "512"],
    LONGCAT512: ["--arch", "longcat_flash", "--kv-lora-rank", "512"],
    V32_NPU: ["--arch", "deepseek_v32", "--kv-lora-rank", "512", "--index-head-dim", "128"],
    QWEN2_KV1: ["--arch", "qwen2", "--kv-heads", "1"],
    **{
        name: [
            "--arch",
            arch,
            "--layers",
            "4",
            "--hidden-size",
            "256",
            "--heads",
            "2",
            "--linear-head-dim",
            "128",
        ]
        for name, arch in NPU_HYBRIDS.items()
    },
    QWEN3_MOE: ["--arch", "qwen3_moe"],
    QWEN2_VL: ["--arch", "qwen2_vl"],
    LLAMA_DRAFT: ["--arch", "llama", "--seed", "1", "--layers", "1"],
}


def engine_config(directory: Path, hf_config, dtype: str = "float32", **engine_args):
    """Upstream's engine config for ``hf_config`` (a transformers config written to
    ``directory`` as config.json; no weights, no tokenizer), built in this process, so the
    platform's config checks run here."""
    from vllm.engine.arg_utils import EngineArgs

    hf_config.save_pretrained(directory)
    args = EngineArgs(model=str(directory), skip_tokenizer_init=True, dtype=dtype, **engine_args)
    return args.create_engine_config()


def make_model(out: Path, *args: str) -> Path:
    """A tiny model by examples/make_tiny_model.py (``args``: its options)."""
    made = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "make_tiny_model.py"), *args, "--out", str(out)],
        capture_output=True,
        text=True,
    )
    assert made.returncode == 0, made.stderr[-3000:]
    return out


def quantize_model(model: Path, out: Path, scheme: str, *extra: str) -> Path:
    """An msModelSlim W8A8 checkpoint of ``model`` by examples/quantize_tiny_model.py."""
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "quantize_tiny_model.py"),
            "--model",
            str(model),
            "--out",
            str(out),
            "--scheme",
            scheme,
            *extra,
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def eagle_head(base: Path, out: Path) -> Path:
    """An EAGLE draft head for the tiny Llama, from a one-layer Llama with other weights:
    its embedding and decoder layer (EAGLE's first layer has no input norm) and a random
    ``fc`` that joins the token embedding with the target's hidden state, in the layout
    vLLM's EagleLlamaForCausalLM loads (no ``model.`` prefix, no final norm or LM head)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(base, out)
    weights = load_file(str(base / "model.safetensors"))
    head = {
        name.removeprefix("model."): w
        for name, w in weights.items()
        if name == "model.embed_tokens.weight"
        or (name.startswith("model.layers.") and "0.input_layernorm" not in name)
    }
    hidden = weights["model.embed_tokens.weight"].shape[1]
    head["fc.weight"] = torch.rand(hidden, 2 * hidden, generator=torch.Generator().manual_seed(2)) - 0.5
    save_file(head, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


class TinyModels(Mapping[str, Path]):
    """The tiny models of ``VARIANTS`` by name, each made into ``base`` on first use (a
    unit test that needs one model does not pay for the others)."""

    def __init__(self, base: Path):
        self.base = base
        self._made: dict[str, Path] = {}

    def __getitem__(self, name: str) -> Path:
        if name == LLAMA_EAGLE and name not in self._made:
            self._made[name] = eagle_head(self[LLAMA_DRAFT], self.base / name)
        if name not in self._made:
            self._made[name] = make_model(self.base / name, *VARIANTS[name])
        return self._made[name]

    def __iter__(self) -> Iterator[str]:
        return iter(VARIANTS)

    def __len__(self) -> int:
        return len(VARIANTS)


def skew_router(model: Path, out: Path, hot_experts: int, bias: float) -> Path:
    """A copy of ``model`` whose MoE routers prefer their first ``hot_experts`` experts: every
    gate's correction bias (DeepSeek-V3's ``e_score_correction_bias``, with which transformers
    and vLLM both select experts) raised by ``bias`` for them, so expert load is skewed."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(model, out)
    raised = 0
    for path in out.glob("*.safetensors"):
        tensors = load_file(path)
        for name, tensor in tensors.items():
            if name.endswith("mlp.gate.e_score_correction_bias"):
                tensor[:hot_experts] += bias
                raised += 1
        save_file(tensors, path, metadata={"format": "pt"})
    if not raised:
        raise ValueError(f"{model} has no e_score_correction_bias to skew")
    return out
