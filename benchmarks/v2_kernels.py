"""Model Runner V2's per-step kernels on the host, two ways side by side: the Ascend torch
forms (what host emulation and the NPU run) against upstream's Triton kernels run
unchanged by Triton's interpreter (the other way host emulation could run them).

    nox -s bench -- v2-kernels [--batch 32] [--vocab 32000] [--repeats 5]

One decode step of ``--batch`` requests (one token each, block size 128, 2k-token
contexts): the launchers a greedy/random step calls (positions and sequence lengths,
sampled-token placement, block-table gather, slot mapping, a staged block-table write,
Gumbel sampling at mixed temperatures, sampled counts, post-update), each timed as the
median of ``--repeats`` calls, and their sum: the host time one step spends in these
kernels; then what MTP with two draft tokens adds (the standard rejection sampler over
three logits rows per request, the draft step's input kernels), and, outside both sums,
what n-gram drafting (k=3, 4k-token model length) and an M-RoPE model add. The interpreter side
runs in a process of its own (vLLM must see Triton usable there). Host numbers on this
machine, not NPU time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

BLOCK = 128
CONTEXT = 2048
MAX_REQS = 256
MTP_STEPS = 2


def _scenario(batch: int, vocab: int, side: str):
    """name -> a callable running one launch of that kernel on a decode step's inputs."""
    import torch

    from vllm.v1.worker.gpu import input_batch as ib
    from vllm.v1.worker.gpu.buffer_utils import StagedWriteTensor
    from vllm.v1.worker.gpu.sample.gumbel import gumbel_sample

    if side == "interpreter":
        from vllm.v1.worker.gpu.block_table import BlockTables as tables_cls
    else:
        from vllm.ascend.worker.block_tables import NPUBlockTables as tables_cls

    g = torch.Generator().manual_seed(0)
    cpu = torch.device("cpu")
    idx = torch.randperm(MAX_REQS, generator=g)[:batch].to(torch.int32)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    computed = torch.full((MAX_REQS,), CONTEXT, dtype=torch.int32)
    positions = torch.zeros(batch * 4, dtype=torch.int64)
    seq_lens = torch.zeros(MAX_REQS, dtype=torch.int32)
    input_ids = torch.zeros(batch * 4, dtype=torch.int32)
    last = torch.randint(0, vocab, (MAX_REQS, 1), generator=g)
    prefill = torch.full((MAX_REQS,), 16, dtype=torch.int32)
    drafts = torch.zeros(MAX_REQS, 0, dtype=torch.int64)
    blocks_per_req = CONTEXT // BLOCK + 2
    tables = tables_cls([BLOCK], MAX_REQS, batch * 4, [blocks_per_req], cpu)
    for r in range(MAX_REQS):
        tables.append_block_ids(r, (list(range(r * 20, r * 20 + CONTEXT // BLOCK)),), overwrite=True)
    tables.apply_staged_writes()
    all_ids = torch.zeros(MAX_REQS, CONTEXT + 64, dtype=torch.int32)
    total = torch.full((MAX_REQS,), CONTEXT, dtype=torch.int32)
    state = StagedWriteTensor(MAX_REQS, dtype=torch.int32, device=cpu)
    logits = torch.randn(batch, vocab, generator=g)
    temperature = torch.where(torch.rand(MAX_REQS, generator=g) < 0.5, 0.0, 0.8)
    seeds = torch.randint(0, 2**31, (MAX_REQS,), generator=g)
    sampled = torch.randint(0, vocab, (batch, 1), generator=g)

    def staged_write():
        state.stage_write_elem(int(idx[0]), 5)
        state.apply_write()

    # MTP k=2: every request verifies two drafts (3 logits rows), then drafts again
    from types import SimpleNamespace

    from vllm.v1.worker.gpu.spec_decode.rejection_sampler_utils import rejection_sample
    from vllm.v1.worker.gpu.spec_decode.target_dependent_ar import speculator as tdar

    k = MTP_STEPS
    spec_cu = torch.arange(batch + 1, dtype=torch.int32) * (k + 1)
    spec_rows = batch * (k + 1)
    spec_logits = torch.randn(spec_rows, vocab, generator=g)
    spec_drafts = torch.randint(0, vocab, (spec_rows,), generator=g)
    spec_expanded = idx.repeat_interleave(k + 1)
    spec_local = torch.arange(k + 1, dtype=torch.int32).repeat(batch)
    spec_pos = torch.arange(spec_rows, dtype=torch.int64) + CONTEXT
    draft_tokens = torch.randint(0, vocab, (MAX_REQS, k), generator=g)
    buffers = SimpleNamespace(
        input_ids=torch.zeros(batch * 4, dtype=torch.int32),
        positions=torch.zeros(batch * 4, dtype=torch.int64),
        query_start_loc=torch.zeros(MAX_REQS + 1, dtype=torch.int32),
        seq_lens=torch.zeros(MAX_REQS, dtype=torch.int32),
    )
    sample_src = torch.zeros(MAX_REQS, dtype=torch.int64)
    hidden = torch.randn(batch, 1024, generator=g)
    next_hidden = torch.zeros(MAX_REQS, 1024)
    step = torch.tensor(0, dtype=torch.int64)
    zeros = torch.zeros(batch, dtype=torch.int32)

    model_len_scalar = torch.tensor(4096, dtype=torch.int32)  # 0.34: a device scalar

    def draft_inputs():
        # the speculator's _prepare_decode_inputs launches this kernel (0.34 has no launcher)
        tdar._prepare_decode_inputs_kernel[(batch + 1,)](
            draft_tokens[:batch, 0],
            draft_tokens.stride(0),
            seq_lens[:batch],
            zeros,
            buffers.input_ids,
            buffers.positions,
            sample_src,
            buffers.query_start_loc,
            buffers.seq_lens,
            4096,
            MAX_REQS,
            BLOCK_SIZE=1024,
            ADVANCE_DRAFT_POSITIONS=True,
        )
        tdar.update_draft_inputs(
            draft_tokens[:batch, 0],
            step,
            hidden,
            draft_tokens,
            next_hidden,
            buffers,
            sample_src,
            batch,
            model_len_scalar,
            k,
            True,
        )

    # n-gram drafting (k=3, n from 1 to 3) over the 2k-token histories, as propose launches it
    from vllm.v1.worker.gpu.mm.rope import RopeState
    from vllm.v1.worker.gpu.spec_decode.ngram import speculator as ngram

    model_len, block_l, n_drafts = 4096, 256, 3
    history = torch.randint(0, 8, all_ids.shape, generator=g, dtype=torch.int32)
    scratch = torch.zeros(MAX_REQS, model_len // block_l, dtype=torch.int64)
    ngram_out = torch.zeros(MAX_REQS, n_drafts, dtype=torch.int64)
    ones = torch.ones(batch, dtype=torch.int32)

    def ngram_drafts():
        common = (history, history.stride(0), idx.long(), total, ones)
        blocks = scratch.shape[1]
        ngram._ngram_scan_kernel[(batch, blocks)](*common, scratch, blocks, model_len, 1, 3, 4, block_l)
        ngram._ngram_finalize_kernel[(batch,)](
            *common, last.view(-1), scratch, blocks, ngram_out, model_len, blocks, n_drafts, 4, blocks
        )

    # M-RoPE (three channels) positions of a decode step
    rope = RopeState(3, MAX_REQS, batch * 4, model_len, cpu)

    return {
        "positions and seq_lens": lambda: ib.prepare_pos_seq_lens(idx, qsl, computed, positions, seq_lens),
        "sampled-token placement": lambda: ib.combine_sampled_and_draft_tokens(
            input_ids, idx, last, qsl, seq_lens, prefill, drafts, qsl, batch
        ),
        "block-table gather": lambda: tables.gather_block_tables(idx, batch),
        "slot mapping": lambda: tables.compute_slot_mappings(idx, qsl, positions, batch),
        "staged write": staged_write,
        "Gumbel sampling": lambda: gumbel_sample(
            logits, idx, temperature, seeds, positions[:batch], True, False
        ),
        "sampled counts": lambda: ib.get_num_sampled_and_rejected(
            torch.ones(batch, dtype=torch.int32), seq_lens, qsl, idx, prefill
        ),
        "post-update": lambda: ib.post_update(
            idx,
            computed.clone(),
            last,
            None,
            sampled,
            torch.ones(batch, dtype=torch.int32),
            torch.zeros(batch, dtype=torch.int32),
            qsl,
            all_ids,
            total.clone(),
        ),
        "MTP: verification": lambda: rejection_sample(
            spec_logits,
            None,
            spec_drafts,
            spec_cu,
            spec_pos,
            idx,
            spec_expanded,
            spec_local,
            temperature,
            seeds,
            k,
        ),
        "MTP: draft-step inputs": draft_inputs,
        "n-gram: drafts (k=3)": ngram_drafts,
        "M-RoPE: positions": lambda: rope.prepare_positions(idx.long(), qsl, prefill, computed),
    }


def measure(batch: int, vocab: int, repeats: int, side: str) -> dict[str, float]:
    if side == "torch":
        from vllm.platforms import current_platform

        current_platform.register_triton_kernel_overrides()
    out = {}
    for name, launch in _scenario(batch, vocab, side).items():
        launch()  # warm-up (the interpreter parses the kernel once)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            launch()
            times.append(time.perf_counter() - t0)
        out[name] = statistics.median(times) * 1e3
    return out


def _interpreted(args) -> dict[str, float]:
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "", "VLLM_ASCEND_EMULATE": "1"}
    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, __file__, "--side", "interpreter", "--batch", str(args.batch)]
    cmd += ["--vocab", str(args.vocab), "--repeats", str(args.repeats)]
    done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"the interpreter side failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--side", choices=["both", "torch", "interpreter"], default="both")
    args = p.parse_args()
    if args.side == "interpreter":
        import triton  # noqa: F401  (before vLLM: its bootstrap hides Triton in host emulation)

        print(json.dumps(measure(args.batch, args.vocab, args.repeats, "interpreter")))
        return
    print(f"decode step of {args.batch} requests, vocabulary {args.vocab}, median of {args.repeats} ...")
    torch_ms = measure(args.batch, args.vocab, args.repeats, "torch")
    interp_ms = _interpreted(args) if args.side == "both" else {}
    print(f"{'kernel':26} {'torch forms ms':>15} {'interpreter ms':>15} {'ratio':>8}")
    for name, ms in torch_ms.items():
        other = interp_ms.get(name)
        ratio = f"{other / ms:8.0f}x" if other else ""
        print(f"{name:26} {ms:15.3f} {other if other is not None else float('nan'):15.3f} {ratio}")
    # (the n-gram and M-RoPE rows are what those configurations add; not in either sum)
    for label, prefix in (("one step", None), ("added by MTP k=2", "MTP")):
        names = [name for name in torch_ms if (name.split(": ")[0] if ": " in name else None) == prefix]
        total = sum(torch_ms[n] for n in names)
        other_total = sum(interp_ms[n] for n in names) if interp_ms else float("nan")
        print(f"{label:26} {total:15.3f} {other_total:15.3f} {other_total / total:8.0f}x")


if __name__ == "__main__":
    main()
