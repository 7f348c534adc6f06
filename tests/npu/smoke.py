"""The first run on an Ascend host: what this distribution assumes about torch_npu and CANN
but could only take from documents and the incumbent's hardware reports, checked against
the reference kernels on the device (``nox -s npu-smoke``; a few minutes).

Each check prints PASS, FAIL or INFO with what it saw; the exit status is 1 if any check
failed. INFO checks record how the device answers a call the distribution does not make
(or makes only where the answer allows), for the docs. Without an NPU the script says why
and exits 0. ``--double`` runs the same checks on the CPU through the torch_npu contract
double (CI does: it proves the checks themselves run; the double's answers are its models
of the device, not evidence about it).

    nox -s npu-smoke             # on the Ascend host, in the environment with the wheel[npu]
    python -m tests.npu.smoke --double
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass

BF16_TOL = {"rtol": 3e-2, "atol": 3e-2}


@dataclass
class Outcome:
    status: str  # PASS, FAIL, INFO
    detail: str


def _close(a, b, tol=BF16_TOL) -> bool:
    import torch

    return bool(torch.allclose(a.float().cpu(), b.float().cpu(), **tol))


def _max_diff(a, b) -> float:
    return float((a.float().cpu() - b.float().cpu()).abs().max())


# -- the checks -----------------------------------------------------------------------------
def _gqa_case(dev, seqs, heads=4, kv_heads=2, head_size=64, block_size=128, seed=0):
    """A paged GQA batch: (query, k plane, v plane, block table, cumulative query lengths,
    KV lengths), each request's blocks laid out from block 1 on (block 0: the null block)."""
    import torch

    torch.manual_seed(seed)
    per = max(-(-kv // block_size) for kv, _ in seqs)
    blocks = 1 + per * len(seqs)
    planes = [
        torch.randn(blocks, kv_heads, block_size, head_size, dtype=torch.bfloat16, device=dev) for _ in "kv"
    ]
    table = torch.arange(1, blocks, dtype=torch.int32, device=dev).view(len(seqs), per)
    qsl = [0]
    for _, q in seqs:
        qsl.append(qsl[-1] + q)
    query = torch.randn(qsl[-1], heads, head_size, dtype=torch.bfloat16, device=dev)
    return query, planes, table, qsl, [kv for kv, _ in seqs]


def band_in_decode(dev) -> Outcome:
    """A sliding window in a decode-only step as the band (sparse_mode 4, pre_tokens = window
    - 1), over 700 keys (past window + 512), in the fused attention and in its v2 with
    learnable sinks (gpt-oss): vllm-ascend #8508/#8387 apply it so with v1; the docs say
    sparse_mode and pre_tokens do nothing at Q_S = 1."""
    import torch

    from vllm.ascend.kernels import attention as k

    query, planes, table, qsl, lens = _gqa_case(dev, [(700, 1), (130, 1), (5, 1)])
    seen = []
    for sinks in (None, torch.randn(4, device=dev).to(torch.bfloat16)):
        out_npu, out_ref, full = (query.new_zeros(query.shape) for _ in range(3))
        k.npu_paged_attention(query, *planes, table, qsl, lens, 0.125, out_npu, window=24, sinks=sinks)
        k.reference_paged_attention(query, *planes, table, qsl, lens, 0.125, out_ref, window=24, sinks=sinks)
        k.reference_paged_attention(query, *planes, table, qsl, lens, 0.125, full, sinks=sinks)
        op = "v1" if sinks is None else "v2 with sinks"
        if not _close(out_npu, out_ref):
            got = (
                "the band was ignored (full attention)"
                if _close(out_npu, full)
                else "neither windowed nor full"
            )
            seen.append(f"{op}: {got}, max diff {_max_diff(out_npu, out_ref):.3g}")
    if seen:
        return Outcome("FAIL", "; ".join(seen))
    return Outcome("PASS", "the band applies with one query row per request (v1 and v2)")


def mask_past_512(dev) -> Outcome:
    """The route the distribution no longer takes: the window as a sparse-0 defaultMask in a
    TND decode step (vllm-ascend #15503: ignored past KV position 512)."""
    import torch

    from vllm.ascend.kernels import attention as k
    from vllm.ascend.kernels import torch_npu

    query, planes, table, qsl, lens = _gqa_case(dev, [(700, 1), (130, 1)])
    width = table.shape[1] * planes[0].shape[2]
    starts = torch.tensor([max(0, n - 24) for n in lens], device=dev)
    mask = (torch.arange(width, device=dev).unsqueeze(0) < starts.unsqueeze(1)).view(len(lens), 1, 1, width)
    try:
        out, _ = torch_npu().npu_fused_infer_attention_score(
            query,
            *planes,
            num_heads=4,
            num_key_value_heads=2,
            input_layout="TND",
            block_table=table,
            block_size=planes[0].shape[2],
            actual_seq_lengths=qsl[1:],
            actual_seq_lengths_kv=lens,
            scale=0.125,
            atten_mask=mask,
            sparse_mode=0,
        )
    except Exception as e:  # the double refuses it (FIA.tnd_sparse); a device may too
        return Outcome("INFO", f"refused: {str(e).splitlines()[0][:200]}")
    ref = query.new_zeros(query.shape)
    k.reference_paged_attention(query, *planes, table, qsl, lens, 0.125, ref, window=24)
    return Outcome("INFO", "mask honoured" if _close(out, ref) else "mask not honoured (as #15503 reports)")


def dense_non_causal(dev) -> Outcome:
    """Non-causal dense TND (sparse_mode 0, no mask), the MLA prefill's history chunks:
    vllm-ascend #13699 saw uniform averages in fp16; the distribution runs it in bf16."""
    import torch

    from vllm.ascend.kernels import mla

    torch.manual_seed(1)
    q = torch.randn(40, 8, 192, dtype=torch.bfloat16, device=dev)
    kv = torch.randn(300, 8, 192, dtype=torch.bfloat16, device=dev)
    v = torch.randn(300, 8, 128, dtype=torch.bfloat16, device=dev)
    got, _ = mla.npu_dense_attention(q, kv, v, [25, 15], [200, 100], 0.07, causal=False)
    want, _ = mla.reference_dense_attention(q, kv, v, [25, 15], [200, 100], 0.07, causal=False)
    if _close(got, want):
        return Outcome("PASS", "equals the reference")
    return Outcome("FAIL", f"max diff {_max_diff(got, want):.3g}")


def blocknum_shared_blocks(dev) -> Outcome:
    """One fused-attention call whose requests share prefix blocks, needing more blocks in sum
    than the cache has (the docs' blocknum rule). The distribution splits such eager steps;
    a graph replay cannot, so what the device does decides whether it must."""
    import torch

    from vllm.ascend.kernels import attention as k
    from vllm.ascend.kernels import torch_npu

    torch.manual_seed(2)
    planes = [torch.randn(12, 2, 128, 64, dtype=torch.bfloat16, device=dev) for _ in "kv"]
    table = torch.tensor([[1, 2, 3, 4 + r] for r in range(8)], dtype=torch.int32, device=dev)
    lens = [3 * 128 + 5 + r for r in range(8)]
    qsl = list(range(9))
    query = torch.randn(8, 4, 64, dtype=torch.bfloat16, device=dev)
    ref = query.new_zeros(query.shape)
    k.reference_paged_attention(query, *planes, table, qsl, lens, 0.125, ref)
    split = query.new_zeros(query.shape)
    k.npu_paged_attention(query, *planes, table, qsl, lens, 0.125, split)
    if not _close(split, ref):
        return Outcome("FAIL", f"the split calls differ from the reference: {_max_diff(split, ref):.3g}")
    try:
        out, _ = torch_npu().npu_fused_infer_attention_score(
            query,
            *planes,
            num_heads=4,
            num_key_value_heads=2,
            input_layout="TND",
            block_table=table,
            block_size=128,
            actual_seq_lengths=qsl[1:],
            actual_seq_lengths_kv=lens,
            scale=0.125,
        )
    except Exception as e:
        return Outcome("INFO", f"split calls correct; one call refused: {str(e).splitlines()[0][:160]}")
    same = "equals" if _close(out, ref) else "differs from"
    return Outcome(
        "INFO", f"split calls correct; one call over 32 of 12 blocks accepted and {same} the reference"
    )


def capture_workspace(dev) -> Outcome:
    """A decode graph captured with its replays' longest lengths (host_params.capture_lengths),
    replayed and updated with long ones, against eager; and one captured with 1-key lengths
    (INFO in the detail: whether the handler's capture-time workspace was enough)."""

    from vllm.ascend import device as ascend_device
    from vllm.ascend.graph.host_params import capture_lengths
    from vllm.ascend.kernels import attention as k

    device = ascend_device.current()
    query, planes, table, qsl, lens = _gqa_case(dev, [(600, 1), (900, 1)])
    eager = query.new_zeros(query.shape)
    k.npu_paged_attention(query, *planes, table, qsl, lens, 0.125, eager)
    results = {}
    for name, captured in (
        ("capture_lengths", capture_lengths([1, 1], table.shape[1], 128, planes[0].shape[0])),
        ("one key", [1, 1]),
    ):
        out = query.new_zeros(query.shape)
        graph, stream = device.new_graph(), device.stream()
        stream.wait_stream(device.current_stream())
        with device.stream_context(stream), device.capture_graph(graph, None, stream):
            k.npu_paged_attention(query, *planes, table, qsl, captured, 0.125, out)
        device.current_stream().wait_stream(stream)
        device.replay_graph(graph, {"actual_seq_lengths": qsl[1:], "actual_seq_lengths_kv": lens})
        device.synchronize()
        results[name] = _close(out, eager)
    if not results["capture_lengths"]:
        return Outcome("FAIL", "a graph captured with capture_lengths differs from eager after its update")
    return Outcome(
        "PASS", f"equals eager; captured with one key: {'equal' if results['one key'] else 'DIFFERS'}"
    )


def gmm_rows_past_groups(dev) -> Outcome:
    """npu_grouped_matmul with rows past the group list's end (the MoE paths pass a buffer
    sized for the most rows): the rows inside the groups must be right, the rest unread."""
    import torch

    from vllm.ascend.kernels import torch_npu

    torch.manual_seed(3)
    x = torch.randn(20, 64, dtype=torch.bfloat16, device=dev)
    w = torch.randn(3, 64, 32, dtype=torch.bfloat16, device=dev)
    counts = torch.tensor([4, 0, 9], dtype=torch.int64, device=dev)  # 13 of 20 rows
    [y] = torch_npu().npu_grouped_matmul(
        [x], [w], group_list=counts, split_item=2, group_type=0, group_list_type=1
    )
    want = torch.cat([x[:4].float() @ w[0].float(), x[4:13].float() @ w[2].float()])
    if _close(y[:13], want):
        return Outcome("PASS", "rows inside the groups equal the reference")
    return Outcome("FAIL", f"max diff {_max_diff(y[:13], want):.3g}")


def attention_update_empty_rank(dev) -> Outcome:
    """npu_attention_update where one rank holds no key of some rows (lse -inf, output 0):
    the merge must give the other rank's output, finite."""
    import torch

    from vllm.ascend.kernels import context_parallel as cp

    torch.manual_seed(4)
    outs = torch.randn(2, 6, 4, 64, dtype=torch.bfloat16, device=dev)
    lses = torch.randn(2, 6, 4, dtype=torch.float32, device=dev)
    lses[1, :3] = float("-inf")
    outs[1, :3] = 0
    got = cp.npu_combine_partials(outs, lses)
    want = cp.reference_combine_partials(outs, lses)
    if bool(torch.isfinite(got.float()).all()) and _close(got, want):
        return Outcome("PASS", "equals the reference, finite")
    return Outcome(
        "FAIL", f"finite={bool(torch.isfinite(got.float()).all())}, max diff {_max_diff(got, want):.3g}"
    )


def routing_semantics(dev) -> Outcome:
    """npu_moe_gating_top_k with softmax (norm_type 0, renorm 0) gives unnormalised, scaled
    weights (CANN Step 5), and npu_moe_gating_top_k_softmax_v2 with renorm 1 the top k's
    softmax: the routing form against the reference for both kinds of router."""
    import torch

    from vllm.ascend.kernels import routing as r

    torch.manual_seed(5)
    logits = torch.randn(9, 64, device=dev)
    bias = torch.randn(64, device=dev) * 0.1
    cases = {
        "softmax renormalised": (r.Routing(8, "softmax", True), None),
        "softmax grouped biased": (r.Routing(4, "softmax", True, 4, 2, 2.5), bias),
        "sigmoid grouped biased": (r.Routing(4, "sigmoid", True, 4, 2, 2.5), bias),
        "softmax plain": (r.Routing(8, "softmax", False), None),
    }
    bad = []
    for name, (routing, b) in cases.items():
        w_npu, i_npu = r.npu_route(logits, routing, b)
        w_ref, i_ref = r.reference_route(logits, routing, b)
        got = {(t, int(e)): float(w) for t in range(9) for e, w in zip(i_npu[t], w_npu[t])}
        want = {(t, int(e)): float(w) for t in range(9) for e, w in zip(i_ref[t], w_ref[t])}
        if got.keys() != want.keys() or any(abs(got[key] - want[key]) > 1e-3 for key in want):
            bad.append(name)
    return (
        Outcome("FAIL", f"differ: {bad}")
        if bad
        else Outcome("PASS", f"{len(cases)} routers equal the reference")
    )


def rope_orders(dev) -> Outcome:
    """The MLA latent prolog's rope plane order (npu_kv_rmsnorm_rope_cache: even elements,
    then odd) equals a GPT-J rotation put in that order (kernels.mla.rope_order); and
    npu_apply_rotary_pos_emb rotates q and k like the reference."""
    import torch

    from vllm.ascend.kernels import mla, rotary

    torch.manual_seed(6)
    tokens = 5
    kv_lora = torch.randn(tokens, 576, dtype=torch.bfloat16, device=dev)
    gamma = torch.rand(512, dtype=torch.bfloat16, device=dev) + 0.5
    positions = torch.arange(3, 3 + tokens, device=dev)
    angles = positions.float().unsqueeze(1) * torch.rand(32, device=dev)
    cache = torch.cat([angles.cos(), angles.sin()], dim=-1)  # [P, 64]: as upstream lays it out
    planes = {
        form: (
            torch.zeros(4, 16, 1, 512, dtype=torch.bfloat16, device=dev),
            torch.zeros(4, 16, 1, 64, dtype=torch.bfloat16, device=dev),
        )
        for form in ("npu", "ref")
    }
    slots = torch.arange(16, 16 + tokens, device=dev)
    full = {neox: rotary.full_tables(cache.to(torch.bfloat16), neox) for neox in (True, False)}
    rows = {neox: tuple(t[None, :, None] for t in full[neox]) for neox in (True, False)}
    _, pe_npu = mla.npu_latent_prolog(kv_lora, gamma, 1e-6, rows[True], *planes["npu"], slots)
    _, pe_ref = mla.reference_latent_prolog(kv_lora, gamma, 1e-6, rows[False], *planes["ref"], slots)
    ok_prolog = _close(pe_npu, mla.npu_rope_order(pe_ref)) and _close(
        planes["npu"][1], mla.npu_rope_order(planes["ref"][1])
    )
    q, k_ = (torch.randn(tokens, n, 64, dtype=torch.bfloat16, device=dev) for n in (4, 2))
    cos, sin = rows[True]
    got = rotary.npu_rotate_pair(q.clone(), k_.clone(), cos, sin, True)
    want = rotary.reference_rotate_pair(q, k_, cos, sin, True)
    ok_pair = all(_close(a, b) for a, b in zip(got, want))
    if ok_prolog and ok_pair:
        return Outcome("PASS", "prolog rope order and fused q/k rotary equal the reference")
    return Outcome(
        "FAIL",
        f"prolog order {'ok' if ok_prolog else 'DIFFERS'}, q/k rotary {'ok' if ok_pair else 'DIFFERS'}",
    )


def hccl_group_options(dev) -> Outcome:
    """pg_options at init_process_group: an HCCL group of one rank made with the buffer-size
    options the distribution passes (distributed/groups.py), and an all-reduce on it."""
    import torch
    import torch.distributed as dist

    from vllm.ascend.distributed.groups import hccl_group_options as options

    if dev.type != "npu":
        return Outcome("INFO", "skipped: needs HCCL (an NPU)")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    dist.init_process_group("hccl", rank=0, world_size=1, pg_options=options("smoke"))
    try:
        x = torch.ones(4, device=dev)
        dist.all_reduce(x)
        ok = bool((x.cpu() == 1).all())
    finally:
        dist.destroy_process_group()
    return Outcome("PASS" if ok else "FAIL", "all-reduce on a group made with pg_options")


CHECKS: list[Callable] = [
    band_in_decode,
    mask_past_512,
    dense_non_causal,
    blocknum_shared_blocks,
    capture_workspace,
    gmm_rows_past_groups,
    attention_update_empty_rank,
    routing_semantics,
    rope_orders,
    hccl_group_options,
]


# -- running them ---------------------------------------------------------------------------
def _environment(double: bool):
    """The device the checks run on, or the reason there is none. ``double``: the caller put
    the contract double on the path (harness/doubles/torch_npu_wheel.py's ``double_env``)."""
    if double:  # host emulation running the NPU kernels, through the double
        os.environ.update(VLLM_ASCEND_EMULATE="1", VLLM_ASCEND_KERNELS="npu")
    try:
        import vllm  # noqa: F401  (the bootstrap loads torch_npu where it can)

        from vllm.ascend.device import npu_device_count
        from vllm.ascend.device.npu_runtime import failure_reason, load_torch_npu
    except ImportError as e:
        return None, f"the wheel is not installed ({e})"
    import torch

    npu = load_torch_npu()
    if npu is None:
        return None, failure_reason() or "torch_npu does not load"
    if getattr(npu, "IS_CONTRACT_DOUBLE", False) != double:
        return None, "the contract double is on the path: run with --double" if not double else "no double"
    if double:
        return torch.device("cpu"), "the torch_npu contract double on the CPU (its models, not the device)"
    if npu_device_count() == 0:
        return None, "torch_npu sees no NPU"
    npu.npu.set_device(0)
    return torch.device("npu:0"), f"Ascend NPU {npu.npu.get_device_name(0)}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--double", action="store_true", help="run through the torch_npu contract double")
    parser.add_argument("checks", nargs="*", help="names of checks to run (default: all)")
    args = parser.parse_args(argv)
    dev, where = _environment(args.double)
    if dev is None:
        print(f"npu-smoke skipped: {where}")
        return 0
    print(f"npu-smoke on {where}")
    failed = 0
    for check in CHECKS:
        if args.checks and check.__name__ not in args.checks:
            continue
        try:
            outcome = check(dev)
        except Exception as e:
            outcome = Outcome("FAIL", f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
            with contextlib.suppress(Exception):
                traceback.print_exc(limit=3)
        failed += outcome.status == "FAIL"
        print(f"{outcome.status:4}  {check.__name__}: {outcome.detail}")
    print(f"{failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
