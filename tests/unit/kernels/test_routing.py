"""MoE routing (``vllm/ascend/kernels/routing.py``): the reference form and the torch_npu
form (through the contract double) against a brute-force oracle that shares no code with
either, for every scoring option upstream's fused-MoE layer offers; the double's routing
ops against their documented semantics, and each of their documented preconditions
refused; the MoE method's reading of a layer's options, and its refusals."""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm.ascend.kernels import routing as R

torch_npu = pytest.importorskip("torch_npu")
DOUBLE = getattr(torch_npu, "IS_CONTRACT_DOUBLE", False)
GTKS = "npu::npu_moe_gating_top_k_softmax"
GTKS2 = "npu::npu_moe_gating_top_k_softmax_v2"
GTK = "npu::npu_moe_gating_top_k"


def brute_route(logits, top_k, scoring, renormalize, groups, topk_group, scale, bias):
    """Token by token in float64, by sorting python lists: {expert: weight}."""
    out = []
    experts = logits.shape[1]
    size = experts // groups
    for row in logits.double().tolist():
        if scoring == "softmax":
            m = max(row)
            e = [math.exp(v - m) for v in row]
            scores = [v / sum(e) for v in e]
        else:
            scores = [1 / (1 + math.exp(-v)) for v in row]
        choice = [s + (0.0 if bias is None else float(bias[i])) for i, s in enumerate(scores)]
        eligible = set(range(experts))
        if groups > 1:
            ranked = []
            for g in range(groups):
                members = sorted(choice[g * size : (g + 1) * size], reverse=True)
                ranked.append((members[0] if bias is None else sum(members[:2]), g))
            kept = {g for _, g in sorted(ranked, reverse=True)[:topk_group]}
            eligible = {i for i in range(experts) if i // size in kept}
        chosen = sorted(eligible, key=lambda i: choice[i], reverse=True)[:top_k]
        w = {i: scores[i] for i in chosen}
        if renormalize:
            total = sum(w.values())
            w = {i: v / total for i, v in w.items()}
        out.append({i: v * scale for i, v in w.items()})
    return out


def _as_dicts(weights, ids):
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    return [dict(zip(i.tolist(), w.tolist())) for w, i in zip(weights, ids)]


def _assert_same(got, expected, tol=1e-5):
    for t, (g, e) in enumerate(zip(got, expected)):
        assert set(g) == set(e), (t, g, e)
        for i in e:
            assert math.isclose(g[i], e[i], rel_tol=tol, abs_tol=tol), (t, i, g[i], e[i])


# scoring, renormalize, (groups, topk_group), bias, routed_scaling_factor
COMBINATIONS = list(
    itertools.product(["softmax", "sigmoid"], [False, True], [(1, 1), (4, 2)], [False, True], [1.0, 2.5])
)


@pytest.mark.parametrize("form", ["reference", "npu"])
@pytest.mark.parametrize("scoring,renormalize,grouping,with_bias,scale", COMBINATIONS)
def test_route_equals_brute_force(form, scoring, renormalize, grouping, with_bias, scale):
    if form == "npu" and not DOUBLE:
        pytest.skip("needs the contract double")
    torch.manual_seed(hash((scoring, renormalize, grouping, with_bias, scale)) % 1000)
    groups, topk_group = grouping
    experts, top_k = 16, 3
    logits = torch.randn(7, experts) * 2
    bias = torch.randn(experts) * 0.3 if with_bias else None
    routing = R.Routing(top_k, scoring, renormalize, groups, topk_group, scale)
    routing.check(experts)
    if form == "npu":
        from torch_npu import _contract

        before = dict(_contract.calls)
        got = R.npu_route(logits, routing, bias)
        plain_softmax = scoring == "softmax" and bias is None and groups == 1
        # plain softmax (renormalised or not) takes the softmax op's _v2, the rest the gating op
        fused = GTKS2 if plain_softmax else GTK
        assert _contract.calls[fused] == before.get(fused, 0) + 1  # the fused op did the routing
    else:
        got = R.reference_route(logits, routing, bias)
    _assert_same(
        _as_dicts(*got), brute_route(logits, top_k, scoring, renormalize, groups, topk_group, scale, bias)
    )


@settings(max_examples=25, deadline=None)
@given(
    data=st.data(),
    scoring=st.sampled_from(["softmax", "sigmoid"]),
    renormalize=st.booleans(),
    with_bias=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_reference_and_npu_forms_agree_on_random_layers(data, scoring, renormalize, with_bias, dtype):
    groups = data.draw(st.sampled_from([1, 2, 4, 8]))
    size = data.draw(st.sampled_from([2, 3, 4, 8]))  # size 2 is beyond the fused op: plain torch
    experts = groups * size
    topk_group = data.draw(st.integers(1, groups))
    top_k = data.draw(st.integers(1, min(8, size * topk_group)))
    torch.manual_seed(data.draw(st.integers(0, 10_000)))
    tokens = data.draw(st.integers(1, 9))
    # distinct logits in every row, exact in bfloat16 (a tie may be broken either way)
    logits = ((torch.stack([torch.randperm(experts) for _ in range(tokens)]) - experts / 2) * 0.25).to(dtype)
    bias = (torch.randn(experts) * 0.3).to(dtype) if with_bias else None
    routing = R.Routing(top_k, scoring, renormalize, groups, topk_group, 1.5)
    expected = brute_route(logits.float(), top_k, scoring, renormalize, groups, topk_group, 1.5, bias)
    _assert_same(_as_dicts(*R.reference_route(logits, routing, bias)), expected)
    if DOUBLE:
        _assert_same(_as_dicts(*R.npu_route(logits, routing, bias)), expected)


@pytest.mark.skipif(not DOUBLE, reason="needs the contract double")
def test_npu_form_computes_shapes_beyond_the_fused_op_without_it():
    from torch_npu import _contract

    before = sum(_contract.calls.values())
    logits, bias = torch.randn(5, 8), torch.randn(8) * 0.3
    routing = R.Routing(2, "sigmoid", True, 4, 2, 1.0)  # groups of 2: the op wants more than 2
    got = R.npu_route(logits, routing, bias)
    assert sum(_contract.calls.values()) == before
    _assert_same(_as_dicts(*got), brute_route(logits, 2, "sigmoid", True, 4, 2, 1.0, bias))


def test_routing_check_refuses_what_it_cannot_compute():
    with pytest.raises(ValueError, match="sqrtsoftplus"):
        R.Routing(2, "sqrtsoftplus").check(8)
    with pytest.raises(ValueError, match="equal expert groups"):
        R.Routing(2, "sigmoid", num_expert_group=3, topk_group=1).check(8)
    with pytest.raises(ValueError, match="topk_group"):
        R.Routing(2, "sigmoid", num_expert_group=2, topk_group=3).check(8)
    with pytest.raises(ValueError, match="exceeds"):
        R.Routing(5, "sigmoid", num_expert_group=2, topk_group=1).check(8)
    with pytest.raises(ValueError, match="top_k"):
        R.Routing(9).check(8)


# -- the MoE method's reading of a layer ---------------------------------------------------------
def _layer(**change):
    fields = dict(
        layer_name="model.layers.1.mlp.experts",
        moe_config=SimpleNamespace(
            has_hash_routing=False, num_logical_experts=8, moe_parallel_config=SimpleNamespace()
        ),
        use_grouped_topk=False,
        num_expert_group=None,
        topk_group=None,
        e_score_correction_bias=None,
        top_k=2,
        scoring_func="softmax",
        renormalize=True,
        routed_scaling_factor=2.5,
        global_num_experts=8,
        custom_routing_function=None,
    )
    fields.update(change)
    return SimpleNamespace(**fields)


def test_layer_routing_follows_upstreams_router_choice():
    from vllm.ascend.moe.method import layer_routing

    # plain top-k: upstream's FusedTopKRouter does not apply routed_scaling_factor
    assert layer_routing(_layer()) == R.Routing(2, "softmax", True, 1, 1, 1.0)
    bias = torch.zeros(8)
    assert layer_routing(_layer(e_score_correction_bias=bias)).routed_scaling_factor == 2.5
    grouped = layer_routing(
        _layer(use_grouped_topk=True, num_expert_group=2, topk_group=1, scoring_func="sigmoid")
    )
    assert grouped == R.Routing(2, "sigmoid", True, 2, 1, 2.5)


def test_layer_routing_scores_the_logical_experts_under_eplb():
    """With EPLB the layer holds 8 logical experts as 12 physical ones: the router scores
    the 8 (eight groups of one works, three groups does not), not the 12."""
    from vllm.ascend.moe.method import layer_routing

    grouped = dict(use_grouped_topk=True, topk_group=2, scoring_func="sigmoid", global_num_experts=12)
    assert layer_routing(_layer(num_expert_group=8, **grouped)).num_expert_group == 8
    with pytest.raises(NotImplementedError, match="equal expert groups"):
        layer_routing(_layer(num_expert_group=3, **grouped))


@pytest.mark.parametrize(
    "change,match",
    [
        ({"scoring_func": "sqrtsoftplus"}, "sqrtsoftplus"),
        ({"moe_config": SimpleNamespace(has_hash_routing=True, moe_parallel_config=None)}, "hash routing"),
        ({"use_grouped_topk": True, "num_expert_group": 3, "topk_group": 1}, "equal expert groups"),
    ],
)
def test_layer_routing_refuses_with_the_layer_and_the_reason(change, match):
    from vllm.ascend.moe.method import layer_routing

    with pytest.raises(NotImplementedError, match=match) as info:
        layer_routing(_layer(**change))
    assert "model.layers.1.mlp.experts" in str(info.value)


def test_method_routes_with_the_models_own_function_when_it_has_one():
    from vllm.ascend.moe.method import AscendMoEMethod

    def custom(hidden_states, gating_output, topk, renormalize):
        return torch.sigmoid(gating_output).topk(topk, dim=-1)

    logits = torch.randn(3, 8)
    w, ids = AscendMoEMethod().select_experts(_layer(custom_routing_function=custom), None, logits)
    assert w.dtype == torch.float32 and ids.dtype == torch.int32
    assert torch.equal(ids, torch.sigmoid(logits).topk(2, dim=-1).indices.to(torch.int32))


# -- the double's routing ops: semantics and documented preconditions ----------------------------
needs_double = pytest.mark.skipif(not DOUBLE, reason="the contract double's own rules")


@needs_double
def test_double_gating_top_k_semantics():
    """Sigmoid (norm_type 1): y_out = chosen scores / (sum + eps) * routed_scaling_factor; softmax
    (norm_type 0, renorm 0): y_out = chosen scores * routed_scaling_factor, not renormalised (CANN
    aclnnMoeGatingTopK, Step 5); norm_out is the norm function's result. The softmax op's _v2:
    renorm 0 the softmax's top k, renorm 1 the softmax of the top k logits."""
    torch.manual_seed(1)
    x, bias = torch.randn(6, 16), torch.randn(16) * 0.3
    y, idx, norm = torch_npu.npu_moe_gating_top_k(
        x,
        3,
        bias=bias,
        k_group=2,
        group_count=4,
        group_select_mode=1,
        norm_type=1,
        out_flag=True,
        routed_scaling_factor=2.0,
    )
    expected = brute_route(x, 3, "sigmoid", True, 4, 2, 2.0, bias)
    _assert_same(_as_dicts(y, idx), expected)
    torch.testing.assert_close(norm, torch.sigmoid(x))
    y, idx, norm = torch_npu.npu_moe_gating_top_k(
        x,
        3,
        bias=bias,
        k_group=2,
        group_count=4,
        group_select_mode=1,
        norm_type=0,
        out_flag=True,
        routed_scaling_factor=2.0,
    )
    _assert_same(_as_dicts(y, idx), brute_route(x, 3, "softmax", False, 4, 2, 2.0, bias))
    assert (y.sum(dim=-1) < 2.0 - 1e-3).all()  # 3 of 16 softmax scores: well short of 1 before scaling
    torch.testing.assert_close(norm, torch.softmax(x, dim=-1))
    for renorm in (0, 1):
        y, idx, soft = torch_npu.npu_moe_gating_top_k_softmax_v2(x, k=4, renorm=renorm, output_softmax=True)
        _assert_same(_as_dicts(y, idx), brute_route(x, 4, "softmax", bool(renorm), 1, 1, 1.0, None))
        assert soft.shape == ((6, 16) if renorm == 0 else (0,))
    y, idx, row = torch_npu.npu_moe_gating_top_k_softmax(x.to(torch.bfloat16), None, 4)
    assert y.dtype == torch.bfloat16 and row.tolist()[1] == [1, 7, 13, 19]  # row + slot * rows
    _assert_same(
        _as_dicts(y.float(), idx),
        brute_route(x.to(torch.bfloat16).float(), 4, "softmax", False, 1, 1, 1.0, None),
        1e-2,
    )


def _gtk(x=None, k=2, **kw):
    return torch_npu.npu_moe_gating_top_k(torch.randn(4, 16) if x is None else x, k, **kw)


VIOLATIONS = {
    "GTKS.x": lambda: torch_npu.npu_moe_gating_top_k_softmax(torch.randn(2, 3, 4, 8), None, 2),
    "GTKS.x dtype": lambda: torch_npu.npu_moe_gating_top_k_softmax(torch.randn(4, 8).double(), None, 2),
    "GTKS.finished": lambda: torch_npu.npu_moe_gating_top_k_softmax(
        torch.randn(4, 8), torch.zeros(3, dtype=torch.bool), 2
    ),
    "GTKS.k": lambda: torch_npu.npu_moe_gating_top_k_softmax(torch.randn(4, 8), None, 9),
    "GTKS.k 1024": lambda: torch_npu.npu_moe_gating_top_k_softmax(torch.randn(1, 1100), None, 1025),
    "GTKS2.x": lambda: torch_npu.npu_moe_gating_top_k_softmax_v2(torch.randn(2, 3, 4, 8), k=2),
    "GTKS2.x dtype": lambda: torch_npu.npu_moe_gating_top_k_softmax_v2(torch.randn(4, 8).double(), k=2),
    "GTKS2.k": lambda: torch_npu.npu_moe_gating_top_k_softmax_v2(torch.randn(4, 8), k=9),
    "GTKS2.renorm": lambda: torch_npu.npu_moe_gating_top_k_softmax_v2(torch.randn(4, 8), k=2, renorm=2),
    "GTK.x": lambda: _gtk(torch.randn(2, 4, 16)),
    "GTK.x experts": lambda: _gtk(torch.randn(2, 2304)),
    "GTK.bias": lambda: _gtk(bias=torch.randn(16, dtype=torch.bfloat16)),
    "GTK.bias shape": lambda: _gtk(bias=torch.randn(8)),
    "GTK.group_count": lambda: _gtk(group_count=8, k_group=2),  # groups of 2
    "GTK.group_count divides": lambda: _gtk(group_count=3),
    "GTK.group_count aligned": lambda: _gtk(
        torch.randn(2, 2048), group_count=128, k_group=1
    ),  # 128 x 32 > 2048
    "GTK.k_group": lambda: _gtk(group_count=2, k_group=3),
    "GTK.k": lambda: _gtk(k=5, group_count=4, k_group=1),
    "GTK.k zero": lambda: _gtk(k=0),
    "GTK.group_select_mode": lambda: _gtk(group_count=2, group_select_mode=2),
    "GTK.renorm": lambda: _gtk(renorm=1),
    "GTK.norm_type": lambda: _gtk(norm_type=2),
}


@needs_double
@pytest.mark.parametrize("case", VIOLATIONS)
def test_documented_routing_violation_is_refused(case):
    from torch_npu._rules import ContractViolation

    rule = case.split()[0]
    with pytest.raises(ContractViolation) as info:
        VIOLATIONS[case]()
    assert f"[{rule};" in str(info.value)


@needs_double
def test_routing_rules_quote_the_wheel_and_each_has_a_failing_case():
    from torch_npu import _rules

    ids = {r for r in _rules.RULES if r.startswith(("GTKS.", "GTKS2.", "GTK."))}
    assert ids == {case.split()[0] for case in VIOLATIONS}


@needs_double
def test_unmodelled_routing_arguments_are_refused():
    with pytest.raises(NotImplementedError, match="tid2eid|input_ids"):
        _gtk(input_ids=torch.zeros(4, dtype=torch.int64), tid2eid=torch.zeros(10, 2, dtype=torch.int64))
    with pytest.raises(NotImplementedError, match="finished"):
        torch_npu.npu_moe_gating_top_k_softmax(torch.randn(4, 8), torch.zeros(4, dtype=torch.bool), 2)
    with pytest.raises(NotImplementedError, match="finished"):
        torch_npu.npu_moe_gating_top_k_softmax_v2(
            torch.randn(4, 8), k=2, finished=torch.zeros(4, dtype=torch.bool)
        )


# -- zero-computation experts (LongCat) ----------------------------------------------------------
def test_split_zero_experts_equals_a_loop_over_slots():
    torch.manual_seed(2)
    real, zero, tokens, k = 6, 3, 40, 3
    ids = torch.stack([torch.randperm(real + zero)[:k] for _ in range(tokens)]).to(torch.int32)
    weights = torch.rand(tokens, k)
    got_w, got_ids, got_zero = R.split_zero_experts(weights, ids, real)
    assert got_ids.dtype == torch.int32 and got_w.dtype == torch.float32
    assert got_zero.shape == (tokens, 1)
    for t in range(tokens):
        total = 0.0
        for s in range(k):
            if ids[t, s] >= real:
                total += float(weights[t, s])
                assert got_ids[t, s] == 0 and got_w[t, s] == 0  # expert 0 at weight 0
            else:
                assert got_ids[t, s] == ids[t, s] and got_w[t, s] == weights[t, s]
        assert torch.isclose(got_zero[t, 0], torch.tensor(total))
    assert (ids >= real).any()  # the draw chose zero experts


def test_layer_routing_scores_the_zero_experts_beside_the_real_ones():
    from vllm.ascend.moe.method import layer_routing, zero_experts

    layer = _layer(e_score_correction_bias=torch.zeros(12), top_k=10)  # 8 real + 4 zero
    assert zero_experts(layer) == 4
    assert layer_routing(layer).top_k == 10  # more than the real experts: checked against 12
    assert zero_experts(_layer()) == 0 and zero_experts(_layer(e_score_correction_bias=torch.zeros(8))) == 0


def test_method_hands_over_the_identity_experts_output_once():
    """Zero experts' slots leave the routes (expert 0 at weight 0); their output is the
    token times their summed weight, taken once by upstream's runner (the hook patch)."""
    from vllm.ascend.moe.method import AscendMoEMethod

    torch.manual_seed(3)
    layer = _layer(e_score_correction_bias=torch.randn(12) * 0.1, renormalize=False)
    logits, x = torch.randn(5, 12), torch.randn(5, 16)
    seen = {}

    class Method(AscendMoEMethod):
        def apply(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input):
            seen.update(weights=topk_weights, ids=topk_ids)
            return torch.zeros_like(x)

    method = Method()
    method.apply_monolithic(layer, x, logits)
    weights, ids = R.route(logits, R.Routing(2, "softmax", False, 1, 1, 2.5), layer.e_score_correction_bias)
    zero = ids >= 8
    assert zero.any()  # the router chose zero experts for some token
    assert torch.equal(seen["ids"], torch.where(zero, 0, ids))
    expected = x * torch.where(zero, weights, 0.0).sum(-1, keepdim=True)
    assert torch.allclose(method.take_zero_expert_output(), expected)
    assert method.take_zero_expert_output() is None
