"""The Ascend KV-cache layout: planes are views of the layer's region, and every head
slice of a block is the one contiguous byte run LayerLayout says it is."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm.ascend.attention.kv_layout import (
    KVLayoutError,
    LayerLayout,
    gqa_planes,
    mla_planes,
    paged_rows,
    paged_slots,
)


def _bytes_of(t: torch.Tensor, base: torch.Tensor) -> tuple[int, int]:
    """(offset, length) in bytes of a contiguous tensor inside ``base``'s storage."""
    assert t.is_contiguous()
    return t.data_ptr() - base.data_ptr(), t.numel() * t.element_size()


@settings(max_examples=60, deadline=None)
@given(
    blocks=st.integers(1, 6),
    heads=st.integers(1, 5),
    block_size=st.sampled_from([1, 4, 16]),
    head_size=st.sampled_from([2, 8]),
    head_size_v=st.sampled_from([2, 8]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    data=st.data(),
)
def test_gqa_head_slices_are_one_run(blocks, heads, block_size, head_size, head_size_v, dtype, data):
    region = torch.zeros(blocks, heads, block_size, head_size + head_size_v, dtype=dtype)
    k, v = gqa_planes(region, head_size, head_size_v)
    assert k.shape == (blocks, heads, block_size, head_size)
    assert v.shape == (blocks, heads, block_size, head_size_v)
    assert k.data_ptr() == region.data_ptr()  # views: no copy, planes back to back
    layout = LayerLayout.gqa(blocks, heads, block_size, head_size, head_size_v, region.element_size())
    assert layout.total_bytes == region.numel() * region.element_size()
    block = data.draw(st.integers(0, blocks - 1))
    h0 = data.draw(st.integers(0, heads - 1))
    h1 = data.draw(st.integers(h0 + 1, heads))
    for index, plane in enumerate((k, v)):
        assert _bytes_of(plane[block, h0:h1], region) == layout.run(index, block, h0, h1)
    # Writing through a plane lands exactly in that run of the region's bytes.
    k[block, h0:h1] = 1
    raw = region.view(-1).view(torch.uint8)
    offset, length = layout.run(0, block, h0, h1)
    touched = (raw != 0).nonzero().flatten()
    assert touched.min() >= offset and touched.max() < offset + length


def test_mla_planes_and_runs():
    blocks, block_size, rank, rope = 3, 4, 8, 2
    region = torch.zeros(blocks, block_size, rank + rope)
    latent, rope_plane = mla_planes(region, rank)
    assert latent.shape == (blocks, block_size, 1, rank) and rope_plane.shape == (blocks, block_size, 1, rope)
    layout = LayerLayout.mla(blocks, block_size, rank, rope, region.element_size())
    for block in range(blocks):
        assert _bytes_of(latent[block], region) == layout.run(0, block)
        assert _bytes_of(rope_plane[block], region) == layout.run(1, block)


def test_non_contiguous_region_is_refused_with_the_fix():
    strided = torch.zeros(4, 2, 8, 6).transpose(1, 2).contiguous().transpose(1, 2)
    with pytest.raises(KVLayoutError, match="LBHNC"):
        gqa_planes(strided, 3, 3)


def test_run_bounds_are_checked():
    layout = LayerLayout.gqa(2, 2, 4, 8, 8, 2)
    with pytest.raises(IndexError):
        layout.run(0, 2)
    with pytest.raises(IndexError):
        layout.run(1, 0, 1, 1)


def test_planes_within_blocks_stay_inside_each_blocks_page():
    """A hybrid model shares pages between attention and state layers: writing block b's K
    and V (row PAGE_ROWS * b of the planes within blocks, both contiguous as the torch_npu
    kernels take them) changes block b's page and no other byte; the region-wide planes
    would write into other blocks' pages. Slots and block tables map to those rows."""
    blocks, heads, block_size, hk = 5, 2, 3, 4
    cache = torch.zeros(blocks, heads, block_size, 2 * hk)
    k, v = gqa_planes(cache, hk, hk, within_blocks=True)
    assert k.is_contiguous() and v.is_contiguous()
    assert k.shape == v.shape == (2 * blocks - 1, heads, block_size, hk)
    row = int(paged_rows(torch.tensor([3])))
    k[row].fill_(1.0)
    v[row].fill_(2.0)
    pages = cache.view(blocks, -1)
    assert pages[3].count_nonzero() == pages[3].numel()  # K and V fill block 3's page exactly
    assert pages[[0, 1, 2, 4]].count_nonzero() == 0
    slots = torch.tensor([3 * block_size + 2, -1])  # block 3, offset 2; a padding slot stays negative
    mapped = paged_slots(slots, block_size)
    assert mapped.tolist()[0] == row * block_size + 2 and mapped.tolist()[1] < 0
    with pytest.raises(KVLayoutError):
        gqa_planes(torch.zeros(blocks, heads, block_size, hk + 2), hk, 2, within_blocks=True)
    hv = hk
    region = torch.zeros_like(cache)
    region_k, _ = gqa_planes(region, hk, hv)
    region_k[3].fill_(1.0)  # the region-wide K plane of block 3 lies in other blocks' pages
    touched = region.view(blocks, -1).count_nonzero(dim=1)
    assert touched[3] < touched.sum()


def test_indexer_keys_are_one_plane_one_run_per_block():
    blocks, block_size, head_dim = 3, 4, 8
    region = torch.zeros(blocks, block_size, head_dim, dtype=torch.bfloat16)
    layout = LayerLayout.of_cache(region, head_size=576, kv_lora_rank=512, indexer=True)
    assert [p.name for p in layout.planes] == ["indexer"] and layout.planes[0].heads == 1
    assert layout.total_bytes == region.numel() * region.element_size()
    for block in range(blocks):  # the block the indexer reads is the run a transfer moves
        assert _bytes_of(region[block], region) == layout.run(0, block)
