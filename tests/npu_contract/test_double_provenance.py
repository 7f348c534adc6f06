"""The contract double's provenance: its schemas are the pinned wheel's, every rule quotes
the wheel's docs, and its meta comparison catches a wrong output shape."""

from __future__ import annotations

import json
import zipfile

import pytest
import torch

from harness.doubles import extract_schemas
from harness.doubles import torch_npu_wheel as npu_wheel
from tests.npu_contract.contract_cases import BF16

torch_npu = pytest.importorskip("torch_npu")
if not getattr(torch_npu, "IS_CONTRACT_DOUBLE", False):
    pytest.skip("the real torch_npu is active on this host", allow_module_level=True)

from torch_npu import _contract, _rules  # noqa: E402


@pytest.fixture(scope="module")
def wheel_zip():
    with zipfile.ZipFile(npu_wheel.fetch()) as zf:
        yield zf


def test_schemas_are_the_pinned_wheels(wheel_zip):
    committed = json.loads((npu_wheel.HERE / "schemas.json").read_text())
    regenerated = extract_schemas.extract(npu_wheel.fetch(), None, None)
    assert regenerated["torch_npu"] == committed["torch_npu"]
    assert regenerated["schemas"]["npu"] == committed["schemas"]["npu"]
    header = wheel_zip.read(extract_schemas.ATB_HEADER).decode()
    decls = extract_schemas._atb_cpp_declarations(header)
    for key, text in committed["schemas"]["atb"].items():
        if committed["atb_sources"][key] == "libop_plugin_atb.so":
            assert regenerated["schemas"]["atb"][key] == text
        else:  # taken from op-plugin sources: must still agree with the wheel's C++ header
            assert extract_schemas._agrees_with_header(text, decls), key


def test_every_cited_quote_is_in_the_wheels_docs(wheel_zip):
    cited = [r for r in _rules.RULES.values() if r.in_wheel]
    assert len(cited) > 30
    missing = [r.id for r in cited if r.quote not in wheel_zip.read(r.source).decode()]
    assert not missing, f"rules quoting text the wheel's docs do not contain: {missing}"


def test_names_and_schemas_are_torch_npus():
    assert torch_npu.npu_fused_infer_attention_score is torch.ops.npu.npu_fused_infer_attention_score
    assert torch_npu._npu_reshape_and_cache is torch.ops.atb._npu_reshape_and_cache
    assert torch_npu.atb.npu_multi_head_latent_attention is torch.ops.atb.npu_multi_head_latent_attention
    q = torch.zeros(1, 2, 16, dtype=BF16)
    with pytest.raises(Exception, match="positional argument"):  # num_heads is keyword-only
        torch_npu.npu_fused_infer_attention_score(q, q, q, 2)
    with pytest.raises(Exception):  # noqa: B017  (the dispatcher's error type is torch's to choose)
        torch_npu.npu_fused_infer_attention_score(q, q, q, num_head=2)  # a misspelt keyword
    with pytest.raises(NotImplementedError):  # a registered op the project does not call has no kernel
        torch_npu.npu_gemma_rms_norm(torch.zeros(2, 4), torch.ones(4))


def test_meta_comparison_catches_a_wrong_output_shape():
    overload = torch.ops.npu.npu_swiglu.default
    full = {"input": torch.zeros(3, 8), "dim": -1}
    _contract._compare_with_meta("npu::npu_swiglu", overload, overload._schema, full, torch.zeros(3, 4))
    with pytest.raises(AssertionError, match="meta function"):
        _contract._compare_with_meta("npu::npu_swiglu", overload, overload._schema, full, torch.zeros(3, 8))
