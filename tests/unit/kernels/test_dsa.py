"""DeepSeek sparse attention's reference kernels (kernels/dsa.py) against transformers'
DeepSeek-V3.2: the indexer's top-k over a paged key cache (requests with history, as in
chunked prefill and prefix hits) equals ``DeepseekV32Indexer``'s selection, and sparse MLA
over the selected positions equals attention masked to them."""

from __future__ import annotations

import pytest
import torch

from vllm.ascend.kernels import dsa

hf = pytest.importorskip("transformers.models.deepseek_v32.modeling_deepseek_v32")
from transformers import DeepseekV32Config  # noqa: E402

TOPK = 8


def _indexer(seed: int = 0):
    torch.manual_seed(seed)
    config = DeepseekV32Config(
        hidden_size=64,
        q_lora_rank=32,
        qk_rope_head_dim=16,
        index_n_heads=8,  # many heads: keys whose every head's relu is 0 (ties) stay rare
        index_head_dim=32,
        index_topk=TOPK,
    )
    indexer = hf.DeepseekV32Indexer(config, layer_idx=0).eval()
    for p in indexer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return config, indexer, hf.DeepseekV32RotaryEmbedding(config)


def _paged(length: int, block_size: int, table: list[int], blocks: int, values: torch.Tensor):
    cache = torch.zeros(blocks, block_size, values.shape[-1])
    slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(length)])
    dsa.reference_indexer_write(values, cache, slots)
    return cache


@pytest.mark.parametrize("length, new", [(5, 5), (30, 30), (30, 7), (30, 1)])
def test_indexer_topk_equals_transformers(length, new):
    """``new`` query rows at the end of a ``length``-token request (the rest is history in
    the cache): each row's selected positions equal transformers' for that row."""
    config, indexer, rotary = _indexer(length + new)
    hidden = torch.randn(1, length, config.hidden_size)
    q_resid = torch.randn(1, length, config.q_lora_rank)
    positions = torch.arange(length)[None]
    cos, sin = rotary(hidden, positions)
    causal = torch.ones(length, length, dtype=torch.bool).tril()[None]
    want = indexer(hidden, q_resid, (cos, sin), causal, positions)[0]  # [S, topk]

    # the same q, k and head weights as transformers computes them
    heads, dim, rope = config.index_n_heads, config.index_head_dim, config.qk_rope_head_dim
    q = indexer.wq_b(q_resid).view(1, length, heads, dim)
    k = indexer.k_norm(indexer.wk(hidden)).unsqueeze(2)
    q_rot, k_rot = hf.apply_rotary_pos_emb(q[..., :rope], k[..., :rope], cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q[..., rope:]], -1)[0]
    k = torch.cat([k_rot, k[..., rope:]], -1)[0, :, 0]
    weights = indexer.weights_proj(hidden)[0] * heads**-0.5 * dim**-0.5

    block_size, table = 4, [5, 2, 7, 0, 3, 6, 1, 4]
    cache = _paged(length, block_size, table, 8, k.detach())
    got = dsa.reference_indexer_topk(
        q[-new:].detach(),
        weights[-new:].detach(),
        cache,
        torch.tensor([table]),
        [0, new],
        [length],
        TOPK,
    )
    for row in range(new):
        position = length - new + row
        picked = sorted(p for p in got[row].tolist() if p >= 0)
        assert len(picked) == min(TOPK, position + 1)
        assert picked == sorted(p for p in want[position].tolist() if p <= position)


def test_sparse_mla_equals_attention_masked_to_the_selection():
    torch.manual_seed(1)
    heads, rank, rope, block_size = 3, 16, 8, 4
    lengths, news = [9, 6], [3, 6]
    table = torch.tensor([[1, 4, 0], [2, 3, 0]])
    latent = torch.randn(5, block_size, 1, rank)
    rope_plane = torch.randn(5, block_size, 1, rope)
    rows = sum(news)
    q_nope, q_pe = torch.randn(rows, heads, rank), torch.randn(rows, heads, rope)
    positions = torch.full((rows, 4), -1, dtype=torch.int32)
    starts = [0, 3, 9]
    for r, (length, new) in enumerate(zip(lengths, news)):
        for i in range(new):
            visible = length - new + i + 1
            chosen = torch.randperm(visible)[: min(4, visible)]
            positions[starts[r] + i, : chosen.numel()] = chosen.to(torch.int32)
    got = dsa.reference_sparse_mla(q_nope, q_pe, latent, rope_plane, table, starts, positions, 0.3)
    for r, (length, new) in enumerate(zip(lengths, news)):
        slots = [int(table[r][p // block_size]) * block_size + p % block_size for p in range(length)]
        c = latent.view(-1, rank)[slots]
        pe = rope_plane.view(-1, rope)[slots]
        for i in range(new):
            t = starts[r] + i
            mask = torch.full((length,), float("-inf"))
            mask[positions[t][positions[t] >= 0].long()] = 0.0
            scores = (q_nope[t] @ c.t() + q_pe[t] @ pe.t()) * 0.3 + mask
            torch.testing.assert_close(got[t], torch.softmax(scores, -1) @ c)


def test_npu_forms_equal_the_reference_forms_through_the_contract_double():
    """The key write, the top-k and sparse MLA through torch_npu's ops (the contract double)
    against the reference forms, bf16, three requests with history (chunked prefill, a
    prefix hit, a decode) and 3 query heads (padded to 4 for the sparse attention)."""
    torch_npu = pytest.importorskip("torch_npu")
    if not getattr(torch_npu, "IS_CONTRACT_DOUBLE", False):
        pytest.skip("the real torch_npu is active on this host")
    torch.manual_seed(5)
    bf16, block_size, blocks, topk = torch.bfloat16, 16, 12, 8
    seq_lens = [40, 21, 9]  # 7, 1 and 9 query rows
    starts = [0, 7, 8, 17]
    table = torch.tensor([[3, 7, 1], [5, 2, 0], [9, 0, 0]], dtype=torch.int32)
    rows = starts[-1]
    # every token's indexer key written as its request's steps did, this step's rows last
    keys = [torch.randn(n, 128).to(bf16) for n in seq_lens]
    slots = torch.tensor(
        [
            int(table[r][p // block_size]) * block_size + p % block_size
            for r, n in enumerate(seq_lens)
            for p in range(n)
        ]
    )
    flat = torch.cat(keys)
    caches = [torch.zeros(blocks, block_size, 128, dtype=bf16) for _ in range(2)]
    dsa.reference_indexer_write(flat, caches[0], slots)
    dsa.npu_indexer_write(flat, caches[1], slots)
    assert torch.equal(caches[0], caches[1])
    q = torch.randn(rows, 8, 128).to(bf16)
    weights = torch.randn(rows, 8).to(bf16).float()  # representable in bf16: the same scores
    want = dsa.reference_indexer_topk(q, weights, caches[0], table, starts, seq_lens, topk)
    got = dsa.npu_indexer_topk(q, weights, caches[1], table, starts, seq_lens, topk)
    # the step's device buffers (what a decode graph reads) give the same as the host lists
    step = (torch.tensor(starts[1:], dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32))
    assert torch.equal(dsa.npu_indexer_topk(q, weights, caches[1], table, starts, [], topk, step), got)
    for r, (lo, hi) in enumerate(zip(starts, starts[1:])):
        for t in range(lo, hi):
            position = seq_lens[r] - (hi - lo) + (t - lo)
            visible = [p for p in got[t].tolist() if 0 <= p <= position]
            assert visible == [p for p in want[t].tolist() if p >= 0]  # same keys, same ranking
    latent = torch.randn(blocks, block_size, 1, 512).to(bf16)
    rope_plane = torch.randn(blocks, block_size, 1, 64).to(bf16)
    q_nope = (torch.randn(rows, 3, 512) * 0.05).to(bf16)
    q_pe = (torch.randn(rows, 3, 64) * 0.05).to(bf16)
    reference = dsa.reference_sparse_mla(q_nope, q_pe, latent, rope_plane, table, starts, want, 0.1)
    npu = dsa.npu_sparse_mla(q_nope, q_pe, latent, rope_plane, table, starts, got, 0.1, seq_lens=seq_lens)
    torch.testing.assert_close(npu.float(), reference.float(), rtol=3e-2, atol=3e-2)
    from_step = dsa.npu_sparse_mla(
        q_nope, q_pe, latent, rope_plane, table, starts, got, 0.1, device_lengths=step
    )
    assert torch.equal(from_step, npu)
