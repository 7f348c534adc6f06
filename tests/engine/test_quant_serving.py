"""msModelSlim W8A8 checkpoints served in host emulation (``--quantization ascend``).

The tiny Qwen2, DeepSeek-V3 and DeepSeek-V3.2 models are quantized here by
``examples/quantize_tiny_model.py`` (static W8A8 and dynamic W8A8), served by one
runner process (engines one after another), and compared token for token with the
fake-quantized transformers model of ``quant_reference.py``. DeepSeek's MTP module
is quantized too (and kept float with ``--float-mtp``); greedy MTP k=2 must equal
plain decoding of the same checkpoint. The static Qwen2 checkpoint is made from a
float16 model, so its ``deq_scale`` is stored as int64 (float32 bits), as msModelSlim
writes it for float16 models.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from tests.support.engines import IN_PROCESS, clean_shutdown, run_spec
from tests.support.models import make_model, quantize_model
from tests.support.prompts import PROMPTS
from tests.support.quant_reference import NEAR_TIE, STATIC_NEAR_TIE, compare, fake_quantized, greedy_with_gaps

MAX_TOKENS = 12
ENGINE = {"dtype": "float32", "max_model_len": 512, "seed": 0, "max_num_seqs": 8}
MTP2 = {"method": "deepseek_mtp", "num_speculative_tokens": 2}
CHECKPOINTS = {  # name -> (float model, scheme, extra quantizer arguments)
    "qwen2_w8a8": ("qwen2_float16", "w8a8", []),  # int64 deq_scale
    "dsv3_w8a8": ("deepseek_v3_q_lora", "w8a8", []),  # fused_qkv_a_proj: q_a_proj + kv_a_proj_with_mqa
    "dsv3_w8a8_dynamic": ("deepseek_v3", "w8a8_dynamic", []),
    "dsv3_w8a8_dynamic_float_mtp": ("deepseek_v3", "w8a8_dynamic", ["--float-mtp"]),
    # int4 experts (the MTP module's too), every other linear layer dynamic W8A8
    "dsv3_w4a8_dynamic": ("deepseek_v3", "w4a8_dynamic", []),
    "qwen3_moe_w4a8_dynamic": ("qwen3_moe", "w4a8_dynamic", []),  # softmax-routed experts, q/k norms
    # DeepSeek-V3.2: its indexer's query projection quantized (static: calibrated like the rest)
    "dsv32_w8a8": ("deepseek_v32", "w8a8", []),
}
# Qwen2 with dynamic W8A8 runs in test_npu_path.py (reference against NPU kernels); here
# each scheme is served on DeepSeek-V3, the static one on Qwen2 as well.
PLAIN = [
    "qwen2_w8a8",
    "dsv3_w8a8",
    "dsv3_w8a8_dynamic",
    "dsv32_w8a8",
    "dsv3_w4a8_dynamic",
    "qwen3_moe_w4a8_dynamic",
]
WITH_MTP = ["dsv3_w8a8", "dsv3_w8a8_dynamic_float_mtp", "dsv32_w8a8", "dsv3_w4a8_dynamic"]


@pytest.fixture(scope="module")
def served(tiny_models, tmp_path_factory):
    base = tmp_path_factory.mktemp("quantized")
    extra = {
        "deepseek_v3_q_lora": lambda: make_model(
            base / "deepseek_v3_q_lora", "--arch", "deepseek_v3", "--q-lora-rank", "32"
        ),
        "qwen2_float16": lambda: make_model(base / "qwen2_float16", "--arch", "qwen2", "--dtype", "float16"),
    }
    # only the float models quantized here (``{**tiny_models}`` would make every tiny model)
    archs = dict.fromkeys(arch for arch, _, _ in CHECKPOINTS.values())
    models = {arch: extra[arch]() if arch in extra else tiny_models[arch] for arch in archs}
    paths = {
        name: quantize_model(models[arch], base / name, scheme, *extra)
        for name, (arch, scheme, extra) in CHECKPOINTS.items()
    }
    runs = [
        {
            "model": str(paths[n]),
            "engine": ENGINE,
            "batches": [PROMPTS],
            "max_tokens": MAX_TOKENS,
            "env": IN_PROCESS,
        }
        for n in PLAIN
    ]
    runs += [
        {
            "model": str(paths[n]),
            "engine": {**ENGINE, "speculative_config": MTP2},
            "batches": [PROMPTS],
            "max_tokens": MAX_TOKENS,
            "env": IN_PROCESS,
        }
        for n in WITH_MTP
    ]
    result, output = run_spec({"runs": runs}, timeout=1800)
    clean_shutdown(output)
    tokens = [[r["token_ids"] for r in run["batches"][0]] for run in result["runs"]]
    names = PLAIN + [f"{n}+mtp2" for n in WITH_MTP]
    return paths, dict(zip(names, tokens)), output, models


def test_the_description_selects_the_ascend_method_without_a_flag(served):
    _, _, output, _ = served
    assert output.count("quantization=ascend") >= len(PLAIN) + len(WITH_MTP), (
        "an engine did not pick the ascend method from quant_model_description.json"
    )


@pytest.mark.parametrize("name", PLAIN)
def test_greedy_tokens_equal_the_fake_quantized_reference(served, name):
    from transformers import AutoTokenizer

    paths, tokens, _, models = served
    assert len(PROMPTS) >= 8
    hf = fake_quantized(models[CHECKPOINTS[name][0]], paths[name])
    reference = greedy_with_gaps(hf, AutoTokenizer.from_pretrained(paths[name]), PROMPTS, MAX_TOKENS)
    near_tie = STATIC_NEAR_TIE if CHECKPOINTS[name][1] == "w8a8" else NEAR_TIE
    mismatches, near_ties = compare(tokens[name], reference, near_tie)
    for tie in near_ties:  # reported, not hidden
        print(f"{name}: near-tie divergence (top-2 logit gap {tie['gap']:.2e} < {near_tie}): {tie}")
    assert not mismatches, repr(mismatches)
    # the comparison meant something: most sequences were compared to the end
    assert sum(1 for t in near_ties) <= len(PROMPTS) // 4, near_ties


def test_a_float16_checkpoint_stores_deq_scale_as_int64(served):
    """What makes the qwen2_w8a8 case above the float16 end-to-end case."""
    paths, _, _, _ = served
    with safe_open(str(paths["qwen2_w8a8"] / "quant_model_weights.safetensors"), "pt") as f:
        deq = f.get_tensor("model.layers.0.self_attn.q_proj.deq_scale")
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.float16
    assert deq.dtype == torch.int64
    decoded = (deq & 0xFFFFFFFF).to(torch.int32).view(torch.float32)
    assert bool((decoded > 0).all()) and bool((decoded < 1).all())


def test_quantized_and_float_models_differ(served):
    """The quantization is real: the int8 model's tokens are not all the float model's."""
    from tests.support.oracle import hf_greedy

    _, tokens, _, models = served
    float_tokens = hf_greedy(models["deepseek_v3"], PROMPTS, MAX_TOKENS)
    assert tokens["dsv3_w8a8_dynamic"] != float_tokens


def test_w4a8_expert_weights_take_a_quarter_of_their_bf16_bytes(served):
    """Two int4 per byte, against the float model's own expert weights in bfloat16 (the NPU
    kernels keep the packed form: tests/unit/kernels/test_npu_kernels.py)."""
    paths, tokens, _, models = served
    checkpoint = paths["dsv3_w4a8_dynamic"]
    description = json.loads((checkpoint / "quant_model_description.json").read_text())
    experts = [k for k, v in description.items() if v == "W4A8_DYNAMIC" and k.endswith(".weight")]
    assert experts and description["model_quant_type"] == "W4A8_DYNAMIC"
    with safe_open(checkpoint / "quant_model_weights.safetensors", "pt") as f:
        packed = sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in experts)
    float_model = models[CHECKPOINTS["dsv3_w4a8_dynamic"][0]]
    with safe_open(next(float_model.glob("*.safetensors")), "pt") as f:
        assert set(experts) <= set(f.keys())
        bf16 = sum(2 * f.get_tensor(k).numel() for k in experts)
    assert packed * 4 == bf16
    assert tokens["dsv3_w4a8_dynamic"] != tokens["dsv3_w8a8_dynamic"]  # the int4 experts mattered


def test_mtp_on_the_quantized_model_equals_plain_decoding(served):
    """Greedy MTP k=2 with the MTP module quantized (dynamic W8A8, or W4A8 experts) and kept float:
    token for token the checkpoint's plain decoding (the float-MTP checkpoint's other
    layers are the dynamic checkpoint's, quantized identically)."""
    paths, tokens, _, _ = served
    assert tokens["dsv3_w8a8+mtp2"] == tokens["dsv3_w8a8"]
    assert tokens["dsv3_w8a8_dynamic_float_mtp+mtp2"] == tokens["dsv3_w8a8_dynamic"]
    assert tokens["dsv32_w8a8+mtp2"] == tokens["dsv32_w8a8"]
    assert (
        tokens["dsv3_w4a8_dynamic+mtp2"] == tokens["dsv3_w4a8_dynamic"]
    )  # W4A8 experts in the MTP module too
    v32 = json.loads((paths["dsv32_w8a8"] / "quant_model_description.json").read_text())
    assert v32["model.layers.0.self_attn.indexer.wq_b.weight"] == "W8A8"
    assert v32["model.layers.0.self_attn.indexer.wk.weight"] == "FLOAT"  # upstream's indexer: float
    description = json.loads((paths["dsv3_w8a8"] / "quant_model_description.json").read_text())
    mtp_layer = json.loads((paths["dsv3_w8a8"] / "config.json").read_text())["num_hidden_layers"]
    assert description[f"model.layers.{mtp_layer}.self_attn.q_a_proj.weight"] == "W8A8_DYNAMIC"
    assert description["model.layers.0.self_attn.q_a_proj.weight"] == "W8A8"
    floats = json.loads((paths["dsv3_w8a8_dynamic_float_mtp"] / "quant_model_description.json").read_text())
    assert floats[f"model.layers.{mtp_layer}.self_attn.o_proj.weight"] == "FLOAT"


@pytest.mark.parametrize(
    "keep_float, message",
    [
        (r"layers\.1\.mlp\.experts\.[0-3]\.", "only some routed experts of model.layers.1.mlp.experts"),
        (r"layers\.(", "--keep-float 'layers\\\\.('"),
        (r".", "nothing left to quantize"),
    ],
)
def test_the_quantizer_refuses_what_vllm_could_not_serve(tiny_models, tmp_path, capsys, keep_float, message):
    import importlib.util

    from tests.support.models import ROOT

    spec = importlib.util.spec_from_file_location(
        "quantize_tiny_model", ROOT / "examples" / "quantize_tiny_model.py"
    )
    quantizer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(quantizer)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as stopped:
        quantizer.main(
            [
                "--model",
                str(tiny_models["deepseek_v3"]),
                "--out",
                str(out),
                "--scheme",
                "w8a8_dynamic",
                "--keep-float",
                keep_float,
            ]
        )
    assert stopped.value.code == 2
    assert message in capsys.readouterr().err
    assert not out.exists()  # nothing half-written
