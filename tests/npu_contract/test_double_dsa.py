"""The contract double's DeepSeek sparse attention ops against brute-force oracles written
here from the documented formulas (no code shared with the double): the lightning indexer's
top-k over a paged key cache with history (as chunked prefill and prefix hits give it),
sparse MLA-absorb attention equal to dense attention masked to the selection, the two
chained under ``sparse_mode`` 3, and the documented limits each refuses."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

torch_npu = pytest.importorskip("torch_npu")
if not getattr(torch_npu, "IS_CONTRACT_DOUBLE", False):
    pytest.skip("the real torch_npu is active on this host", allow_module_level=True)

from torch_npu._rules import ContractViolation  # noqa: E402

BF16 = torch.bfloat16
BLOCK = 16


def _cache(rows_per_batch: list[torch.Tensor], blocks: int, seed: int = 0):
    """A paged cache ``[blocks, BLOCK, 1, D]`` holding each batch's rows through a shuffled
    block table; returns (cache, table)."""
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(blocks, generator=gen).tolist()
    width = max(-(-r.shape[0] // BLOCK) for r in rows_per_batch)
    cache = torch.randn(blocks, BLOCK, 1, rows_per_batch[0].shape[-1], generator=gen).to(
        BF16
    )  # junk elsewhere
    table = torch.zeros(len(rows_per_batch), width, dtype=torch.int32)
    for b, rows in enumerate(rows_per_batch):
        for j in range(-(-rows.shape[0] // BLOCK)):
            block = order.pop()
            table[b, j] = block
            part = rows[j * BLOCK : (j + 1) * BLOCK]
            cache[block, : part.shape[0], 0] = part.to(BF16)
    return cache, table


def _batches(kv_lens, q_lens, heads, seed=0):
    gen = torch.Generator().manual_seed(seed)
    keys = [torch.randn(n, 128, generator=gen).to(BF16) for n in kv_lens]
    q = torch.randn(sum(q_lens), heads, 128, generator=gen).to(BF16)
    w = torch.randn(sum(q_lens), heads, generator=gen).to(BF16)
    return keys, q, w


def _indexer(q, keys, w, q_lens, kv_lens, sparse_count, cache, table, **change):
    args = dict(
        actual_seq_lengths_query=torch.tensor(q_lens, dtype=torch.int32).cumsum(0).to(torch.int32),
        actual_seq_lengths_key=torch.tensor(kv_lens, dtype=torch.int32),
        block_table=table,
        layout_query="TND",
        layout_key="PA_BSND",
        sparse_count=sparse_count,
        sparse_mode=3,
    )
    args.update(change)
    return torch_npu.npu_lightning_indexer(q, cache, w, **args)[0]


@pytest.mark.parametrize("sparse_count", [4, 2048])
def test_indexer_top_k_equals_brute_force(sparse_count):
    """Three requests with history (query rows at the end of each): each row's top-k of the
    positions it sees, ranked by sum_h w_h relu(q_h . k); the positions it does not see next
    (ascending), then -1."""
    q_lens, kv_lens = [1, 5, 3], [40, 21, 3]
    keys, q, w = _batches(kv_lens, q_lens, heads=8)
    cache, table = _cache(keys, blocks=8)
    got = _indexer(q, keys, w, q_lens, kv_lens, sparse_count, cache, table)
    assert got.shape == (sum(q_lens), 1, sparse_count) and got.dtype == torch.int32
    row = 0
    for s1, s2, k in zip(q_lens, kv_lens, keys):
        for i in range(s1):
            seen = s2 - s1 + i + 1
            score = sum(
                w[row, h].float() * torch.relu(k.float() @ q[row, h].float()) for h in range(q.shape[1])
            )
            want_top = torch.topk(score[:seen], min(sparse_count, seen)).indices
            entries = got[row, 0].tolist()
            top = entries[: min(sparse_count, seen)]
            assert sorted(top) == sorted(want_top.tolist())
            assert all(score[a] >= score[b] for a, b in zip(top, top[1:]))  # ranked
            rest = entries[len(top) :]
            masked = list(range(seen, s2))[: max(0, min(sparse_count, s2) - seen)]
            assert rest == masked + [-1] * (len(rest) - len(masked))
            row += 1


def _mla(t, heads, seed=1):
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(t, heads, 512, generator=gen) * 0.05).to(BF16)
    q_rope = (torch.randn(t, heads, 64, generator=gen) * 0.05).to(BF16)
    return q, q_rope


def test_sparse_attention_equals_dense_attention_masked_to_the_selection():
    q_lens, kv_lens, heads = [2, 1], [37, 20], 4
    gen = torch.Generator().manual_seed(3)
    latent = [torch.randn(n, 512, generator=gen).to(BF16) for n in kv_lens]
    rope = [torch.randn(n, 64, generator=gen).to(BF16) for n in kv_lens]
    key, table = _cache(latent, blocks=6, seed=4)
    key_rope, table2 = _cache(rope, blocks=6, seed=4)
    assert torch.equal(table, table2)
    q, q_rope = _mla(sum(q_lens), heads)
    # row 0 picks 36, which it does not see (causal): the oracle's mask leaves it out
    picks = [[36, 0, 5, 17, -1, -1], [35, 2, 9, 30, 11, -1], [19, 3, -1, -1, -1, -1]]
    indices = torch.tensor(picks, dtype=torch.int32)[:, None]
    scale = 0.07
    out = torch_npu.npu_sparse_flash_attention(
        q,
        key,
        key,
        indices,
        scale,
        block_table=table,
        actual_seq_lengths_query=torch.tensor([2, 3], dtype=torch.int32),
        actual_seq_lengths_kv=torch.tensor(kv_lens, dtype=torch.int32),
        query_rope=q_rope,
        key_rope=key_rope,
        sparse_block_size=1,
        layout_query="TND",
        layout_kv="PA_BSND",
        sparse_mode=3,
        attention_mode=2,
    )[0]
    rows = [(0, 0, 35), (0, 1, 36), (1, 2, 19)]  # (batch, row, last visible position)
    for b, r, last in rows:
        mask = torch.zeros(kv_lens[b], dtype=torch.bool)
        mask[[p for p in picks[r] if 0 <= p <= last]] = True
        k = torch.cat([latent[b], rope[b]], -1).float()
        qq = torch.cat([q[r], q_rope[r]], -1).float()
        want = F.scaled_dot_product_attention(
            qq[:, None],
            k[None].expand(heads, -1, -1),
            latent[b].float()[None].expand(heads, -1, -1),
            attn_mask=mask[None, None],
            scale=scale,
        )[:, 0]
        torch.testing.assert_close(out[r].float(), want, atol=2e-2, rtol=2e-2)


def test_indexer_into_sparse_attention_under_causal_mode_ignores_the_masked_entries():
    """A prefill of 6 rows over 6 keys with sparse_count 4: the first rows' entries after
    their visible positions are future positions, which sparse_mode 3 masks."""
    heads, n = 4, 6
    gen = torch.Generator().manual_seed(7)
    ikeys, iq, w = _batches([n], [n], heads=8, seed=7)
    icache, table = _cache(ikeys, blocks=2, seed=8)
    top = _indexer(iq, ikeys, w, [n], [n], 4, icache, table)
    assert top[0, 0].tolist()[0] == 0 and top[0, 0].tolist()[1:] == [1, 2, 3]  # row 0 sees key 0 only
    latent = torch.randn(n, 512, generator=gen).to(BF16)
    rope = torch.randn(n, 64, generator=gen).to(BF16)
    key, _ = _cache([latent], blocks=2, seed=8)
    key_rope, _ = _cache([rope], blocks=2, seed=8)
    q, q_rope = _mla(n, heads, seed=9)
    out = torch_npu.npu_sparse_flash_attention(
        q,
        key,
        key,
        top,
        0.1,
        block_table=table,
        actual_seq_lengths_query=torch.tensor([n], dtype=torch.int32),
        actual_seq_lengths_kv=torch.tensor([n], dtype=torch.int32),
        query_rope=q_rope,
        key_rope=key_rope,
        layout_query="TND",
        layout_kv="PA_BSND",
        sparse_mode=3,
        attention_mode=2,
    )[0]
    # row 0 attends to key 0 alone: its output is that key's latent
    torch.testing.assert_close(out[0].float(), latent[0].float()[None].expand(heads, -1), atol=1e-2, rtol=0)


def _limits_case():
    keys, q, w = _batches([20], [2], heads=8)
    cache, table = _cache(keys, blocks=4)
    return keys, q, w, cache, table


@pytest.mark.parametrize(
    "change, rule",
    [
        ({"q_heads": 72}, "LI.dims"),
        ({"w_dtype": torch.float32}, "LI.weights"),
        ({"sparse_count": 2049}, "LI.sparse_count"),
        ({"sparse_mode": 1}, "LI.sparse_mode"),
        ({"actual_seq_lengths_query": torch.tensor([3], dtype=torch.int32)}, "LI.lengths"),
        ({"block_table": torch.zeros(1, 1, dtype=torch.int32)}, "LI.block_table"),
        ({"actual_seq_lengths_key": torch.tensor([20], dtype=torch.int64)}, "LI.key_lengths"),
    ],
)
def test_indexer_refuses_what_its_documents_exclude(change, rule):
    keys, q, w, cache, table = _limits_case()
    heads = change.pop("q_heads", None)
    if heads:
        q = torch.randn(2, heads, 128).to(BF16)
        w = torch.randn(2, heads).to(BF16)
    w = w.to(change.pop("w_dtype", w.dtype))
    sparse_count = change.pop("sparse_count", 8)
    with pytest.raises(ContractViolation, match=rule.replace(".", r"\.")):
        _indexer(q, keys, w, [2], [20], sparse_count, cache, table, **change)


@pytest.mark.parametrize(
    "case, rule",
    [
        ("heads_3", "SFA.dims"),
        ("latent_576", "SFA.dims"),
        ("mode_0", "SFA.modes"),
        ("hole", "SFA.indices"),
        ("past_end", "SFA.indices"),
    ],
)
def test_sparse_attention_refuses_what_its_documents_exclude(case, rule):
    heads = 3 if case == "heads_3" else 4
    width = 576 if case == "latent_576" else 512
    gen = torch.Generator().manual_seed(0)
    key, table = _cache([torch.randn(20, width, generator=gen)], blocks=4)
    key_rope, _ = _cache([torch.randn(20, 64, generator=gen)], blocks=4)
    q = torch.randn(1, heads, width).to(BF16)
    q_rope = torch.randn(1, heads, 64).to(BF16)
    picks = {"hole": [3, -1, 4], "past_end": [3, 20, -1]}.get(case, [3, 4, -1])
    with pytest.raises(ContractViolation, match=rule.replace(".", r"\.")):
        torch_npu.npu_sparse_flash_attention(
            q,
            key,
            key,
            torch.tensor([[picks]], dtype=torch.int32),
            0.1,
            block_table=table,
            actual_seq_lengths_query=torch.tensor([1], dtype=torch.int32),
            actual_seq_lengths_kv=torch.tensor([20], dtype=torch.int32),
            query_rope=q_rope,
            key_rope=key_rope,
            layout_query="TND",
            layout_kv="PA_BSND",
            sparse_mode=3,
            attention_mode=0 if case == "mode_0" else 2,
        )
