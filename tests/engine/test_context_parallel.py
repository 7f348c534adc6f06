"""Context parallelism in host emulation: DCP and PCP for MLA and GQA, scaled down to two
and four ranks, against TP=1 and Hugging Face transformers, and the KV placement.

One process per model runs the TP=1 reference and two context-parallel layouts (MLA:
DCP=2 at TP=2, the MoE model with expert parallelism; GQA: PCP=2; both: PCP=2 x DCP=2 at
TP=2, so each mechanism runs alone once and combined for both attention kinds) on
batches that mix decode with chunked prefill (16-token steps) and prefix-cache hits
(8-token blocks). Before the
batches each engine prefills one probe prompt alone and every rank saves its first
attention layer's cache blocks of that request: each token's KV must sit exactly where
``vllm.ascend.context_parallel.placement`` puts it, exactly once per context-parallel
group, equal to the value the TP=1 engine stored.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.engines import IN_PROCESS, clean_shutdown, run_spec
from tests.support.models import QWEN2_KV1
from tests.support.oracle import hf_greedy
from tests.support.prompts import PREFIX_PROMPTS, PROMPTS
from vllm.ascend.context_parallel.placement import CPLayout, place

BLOCK_SIZE, BUDGET = 8, 16
ENGINE = {
    "dtype": "float32",
    "max_model_len": 512,
    "seed": 0,
    "block_size": BLOCK_SIZE,
    "enable_prefix_caching": True,
    "enable_chunked_prefill": True,
    "max_num_batched_tokens": BUDGET,
    "max_num_seqs": 8,
    "distributed_executor_backend": "mp",
}
LAYOUTS = {  # name -> parallel settings (the interleave sizes vary: 1, 2, 4)
    "dcp2": {"tensor_parallel_size": 2, "decode_context_parallel_size": 2},
    "pcp2": {"prefill_context_parallel_size": 2, "cp_kv_cache_interleave_size": 2},
    "pcp2_dcp2": {
        "tensor_parallel_size": 2,
        "prefill_context_parallel_size": 2,
        "decode_context_parallel_size": 2,
        "cp_kv_cache_interleave_size": 4,
    },
}
MODELS = {"mla": "deepseek_v3", "gqa": QWEN2_KV1}
# Each engine here is two or four processes; one standalone mechanism per attention kind
# keeps the module's starts down (the combined layout runs for both).
MODEL_LAYOUTS = {"mla": ["dcp2", "pcp2_dcp2"], "gqa": ["pcp2", "pcp2_dcp2"]}
CASES = [(kind, layout) for kind, layouts in MODEL_LAYOUTS.items() for layout in layouts]
PROBE = PROMPTS[4]  # ~40 tokens: several virtual blocks at every layout
BATCHES = [PROMPTS, PREFIX_PROMPTS[:1], PREFIX_PROMPTS[1:]]
MAX_TOKENS = 12


def _spec(model: Path, name: str, parallel: dict, dump: Path) -> dict:
    dump.mkdir()
    return {
        "model": str(model),
        "engine": {**ENGINE, **parallel},
        "batches": BATCHES,
        "max_tokens": MAX_TOKENS,
        "kv_dump": {"prompt": PROBE, "dir": str(dump)},
        "report_runner": True,
        # A history chunk of 16 tokens: the ~40-token prompts and the prefix-cache hits span
        # several chunks, so every run (MLA at TP=1 too) merges chunk partials by log-sum-exp
        # and must still equal transformers.
        "env": {
            **IN_PROCESS,
            "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
            "VLLM_ASCEND_PREFILL_CHUNK_TOKENS": "16",
        },
    }


@pytest.fixture(scope="module")
def runs(tiny_models, tmp_path_factory):
    """model kind -> layout name (and "tp1") -> (result, dump directory)."""
    out = {}
    for kind, arch in MODELS.items():
        base = tmp_path_factory.mktemp(f"cp_{kind}")
        names = ["tp1", *MODEL_LAYOUTS[kind]]
        # the MoE model's DCP run also shards its experts (expert parallelism over TP)
        extra = {"dcp2": {"enable_expert_parallel": True}} if kind == "mla" else {}
        specs = [
            _spec(tiny_models[arch], n, {**LAYOUTS.get(n, {}), **extra.get(n, {})}, base / n) for n in names
        ]
        result, output = run_spec({"runs": specs}, timeout=1500)
        clean_shutdown(output)
        out[kind] = {n: (r, base / n) for n, r in zip(names, result["runs"])}
    return out


def _tokens(result: dict) -> list[list[int]]:
    return [r["token_ids"] for batch in result["batches"] for r in batch]


@pytest.mark.parametrize(("kind", "layout"), CASES)
def test_greedy_tokens_equal_tp1_and_transformers(runs, tiny_models, kind, layout):
    reference, _ = runs[kind]["tp1"]
    result, _ = runs[kind][layout]
    expected = hf_greedy(tiny_models[MODELS[kind]], PROMPTS + PREFIX_PROMPTS, MAX_TOKENS)
    assert _tokens(reference) == expected
    assert _tokens(result) == expected
    assert result["runner"] == "NPUModelRunner"
    # the batches exercised what they should: chunked prefill, and prefix-cache hits of
    # whole scheduler blocks (BLOCK_SIZE x PCP x DCP tokens)
    assert max(r["prompt_len"] for r in result["batches"][0]) > 2 * BUDGET
    shards = LAYOUTS[layout].get("prefill_context_parallel_size", 1) * LAYOUTS[layout].get(
        "decode_context_parallel_size", 1
    )
    hits = [r["num_cached_tokens"] for r in result["batches"][2]]
    assert all(h > 0 and h % (BLOCK_SIZE * shards) == 0 for h in hits), hits


def _load(directory: Path) -> dict[int, dict]:
    return {int(p.stem[4:]): torch.load(p) for p in directory.glob("rank*.pt")}


@pytest.mark.parametrize(("kind", "layout"), CASES)
def test_each_token_kv_is_where_the_placement_says_once_per_group(runs, kind, layout):
    reference_result, reference_dir = runs[kind]["tp1"]
    result, directory = runs[kind][layout]
    n = result["kv_dump"]["prompt_len"]
    # more than one scheduler block at every layout
    assert n == reference_result["kv_dump"]["prompt_len"] and n > BLOCK_SIZE * 4
    [reference] = _load(reference_dir).values()
    ref = reference["planes"]  # [blocks, heads, block_size, D]: token t at block t // B, offset t % B
    ranks = _load(directory)
    settings = LAYOUTS[layout]
    cp = CPLayout(
        tp=settings.get("tensor_parallel_size", 1),
        pcp=settings.get("prefill_context_parallel_size", 1),
        dcp=settings.get("decode_context_parallel_size", 1),
        interleave=settings.get("cp_kv_cache_interleave_size", 1),
        block_size=BLOCK_SIZE,
        kv_heads=None if kind == "mla" else 1,
    ).check()
    assert len(ranks) == cp.pcp * cp.tp
    for rank, dump in ranks.items():  # the rank numbering the placement uses
        assert rank == cp.rank(dump["pcp_rank"], dump["tp_rank"])
    for t in range(n):
        expected = ref[t // BLOCK_SIZE, :, t % BLOCK_SIZE]
        p = place(cp, t)
        for holder in p.holders:
            got = ranks[holder.rank]["planes"][p.block_index, :, p.offset]
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    # nothing else anywhere: per context-parallel group, exactly n slots are written
    for first in range(0, cp.tp, cp.dcp):
        group = [r for r, d in ranks.items() if first <= d["tp_rank"] < first + cp.dcp]
        assert len(group) == cp.cp
        written = sum(int(ranks[r]["planes"].abs().sum(dim=(1, 3)).ne(0).sum()) for r in group)
        assert written == n, f"group of TP ranks {first}..: {written} slots written for {n} tokens"
