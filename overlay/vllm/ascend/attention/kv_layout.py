"""The Ascend KV-cache layout: each kernel input is its own contiguous plane.

vLLM gives every attention layer one contiguous region of ``num_blocks`` pages (our
backends ask for the layer-compact layout ``LBHNC``) and hands the backend a
``[blocks, heads, block_size, K|V]`` view of it. The torch_npu kernels need K and V
(MLA: the latent ``c_kv`` and the rotary key) each as one contiguous tensor, so the
region is read as consecutive planes:

* GQA/MHA: ``K [num_blocks, kv_heads, block_size, head_size]``, then
  ``V [num_blocks, kv_heads, block_size, head_size_v]``;
* MLA: ``latent [num_blocks, block_size, 1, kv_lora_rank]``, then
  ``rope [num_blocks, block_size, 1, rope_dim]``;
* DeepSeek V3.2's indexer keys (a layer of their own): one plane
  ``[num_blocks, block_size, index_head_dim]``.

The bytes are exactly vLLM's page accounting (``heads x block_size x (K + V)`` per
block); only their order differs, and the views cost nothing per step.

Why head-major blocks (``(blocknum, KV_N, blocksize, D)``, the cache format the
torch_npu attention docs recommend over ``(blocknum, blocksize, H)``): one head's
tokens of a block, and any range of consecutive heads, are one contiguous run. In
P/D disaggregation a decode rank with a different TP size needs a head slice of a
prefill rank's block (or a prefill block fills a head slice of its own block); with
this layout every such piece is one run per plane and per block, so transfers need
no staging buffer and no transpose. The price: the per-token cache write is a
scatter over (block, head, offset) coordinates (``npu_scatter_nd_update_``) instead of
ATB's token-major ``ReshapeAndCache``, and a token's heads are not adjacent. MLA has a
single latent head, so both orders coincide there and MLA keeps ``ReshapeAndCache``.

vLLM's own block-granular helpers (copy-on-write copies, block zeroing, upstream KV
connectors) address blocks through the unsplit view and do not know about planes;
the platform refuses the configurations that would use them (see
``platform/npu.py``), and this distribution's P/D connector addresses planes through
:class:`LayerLayout`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class KVLayoutError(RuntimeError):
    """The per-layer cache vLLM handed over cannot be read as planes."""


# vLLM's name of the per-layer layout the planes are read from (one contiguous region
# per layer); a KV connector that moves Ascend planes requires it.
VLLM_LAYOUT = "LBHNC"


def connector_addresses_planes(kv_transfer_config) -> bool:
    """Whether the configured KV connector moves this cache's planes. A connector class
    declares it with ``addresses_ascend_kv_planes = True``; upstream's connectors address
    blocks through vLLM's unsplit per-layer view and would move the wrong bytes."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        connector = KVConnectorFactory.get_connector_class(kv_transfer_config)
    except Exception:  # a connector that cannot even load (its library missing) is not one of ours
        return False
    return bool(getattr(connector, "addresses_ascend_kv_planes", False))


# rows of the within-blocks planes per block: its K half-page, then its V half-page
PAGE_ROWS = 2


def paged_rows(block_table: torch.Tensor) -> torch.Tensor:
    """Block ids -> rows of the within-blocks planes."""
    return block_table * PAGE_ROWS


def paged_slots(slot_mapping: torch.Tensor, block_size: int) -> torch.Tensor:
    """Token slots (block x block_size + offset) -> slots of the within-blocks planes."""
    return (
        slot_mapping
        + torch.div(slot_mapping, block_size, rounding_mode="floor") * (PAGE_ROWS - 1) * block_size
    )


def _flat(kv_cache: torch.Tensor) -> torch.Tensor:
    if not kv_cache.is_contiguous():
        raise KVLayoutError(
            f"the Ascend KV-cache layout needs each layer's cache as one contiguous region "
            f"(layout LBHNC, no page padding); got shape {tuple(kv_cache.shape)} with strides "
            f"{kv_cache.stride()}. Unset VLLM_KV_CACHE_LAYOUT or set it to LBHNC."
        )
    return kv_cache.view(-1)


def gqa_planes(
    kv_cache: torch.Tensor, head_size: int, head_size_v: int, within_blocks: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``kv_cache [blocks, kv_heads, block_size, head_size + head_size_v]`` -> (K, V) planes.

    ``within_blocks``: each block's K and V stay inside that block's page (K, then V, per
    block). A hybrid model's attention layers share their pages with the state layers'
    (upstream's hybrid manager hands one block id to one group at a time), so a plane that
    spans the whole region would write into other blocks' states. The torch_npu kernels
    take contiguous planes only, so these are two contiguous views of the region in
    half-page rows, the V view one half-page later: block ``b``'s K and V are row
    ``PAGE_ROWS * b`` of each (``paged_rows``, ``paged_slots``). Needs K and V of one size."""
    blocks, heads, block_size, content = kv_cache.shape
    if content != head_size + head_size_v:
        raise KVLayoutError(f"cache content {content} != head_size {head_size} + head_size_v {head_size_v}")
    flat = _flat(kv_cache)
    if within_blocks:
        if head_size != head_size_v:
            raise KVLayoutError(
                f"a hybrid model's attention pages need K and V of one head size (got {head_size} and {head_size_v})"
            )
        half = heads * block_size * head_size
        rows = (
            PAGE_ROWS * blocks - 1
        )  # the K view ends before the last V, the V view starts after the first K
        k = flat[: rows * half].view(rows, heads, block_size, head_size)
        return k, flat[half:].view(rows, heads, block_size, head_size)
    k_elems = blocks * heads * block_size * head_size
    k = flat[:k_elems].view(blocks, heads, block_size, head_size)
    v = flat[k_elems:].view(blocks, heads, block_size, head_size_v)
    return k, v


def mla_planes(kv_cache: torch.Tensor, kv_lora_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``kv_cache [blocks, block_size, kv_lora_rank + rope_dim]`` -> (latent, rope) planes,
    each ``[blocks, block_size, 1, dim]``."""
    blocks, block_size, content = kv_cache.shape
    rope_dim = content - kv_lora_rank
    flat = _flat(kv_cache)
    split = blocks * block_size * kv_lora_rank
    latent = flat[:split].view(blocks, block_size, 1, kv_lora_rank)
    rope = flat[split:].view(blocks, block_size, 1, rope_dim)
    return latent, rope


@dataclass(frozen=True)
class Plane:
    name: str
    heads: int
    head_bytes: int  # one head's tokens of one block: block_size x dim x dtype size

    @property
    def block_bytes(self) -> int:
        return self.heads * self.head_bytes


@dataclass(frozen=True)
class LayerLayout:
    """Byte addressing of one layer's region, for code that moves blocks (P/D transfer).

    ``run(plane, block, h0, h1)`` is the (offset, length) of heads ``h0..h1-1`` of a
    block in one plane, relative to the start of the layer's region: always one
    contiguous run.
    """

    num_blocks: int
    planes: tuple[Plane, ...]

    @classmethod
    def gqa(
        cls,
        num_blocks: int,
        kv_heads: int,
        block_size: int,
        head_size: int,
        head_size_v: int,
        dtype_size: int,
    ) -> LayerLayout:
        return cls(
            num_blocks,
            (
                Plane("k", kv_heads, block_size * head_size * dtype_size),
                Plane("v", kv_heads, block_size * head_size_v * dtype_size),
            ),
        )

    @classmethod
    def mla(
        cls, num_blocks: int, block_size: int, kv_lora_rank: int, rope_dim: int, dtype_size: int
    ) -> LayerLayout:
        return cls(
            num_blocks,
            (
                Plane("latent", 1, block_size * kv_lora_rank * dtype_size),
                Plane("rope", 1, block_size * rope_dim * dtype_size),
            ),
        )

    @classmethod
    def indexer(cls, num_blocks: int, block_size: int, head_dim: int, dtype_size: int) -> LayerLayout:
        """DeepSeek V3.2's indexer keys: one key per token, like the latent one head on
        every TP rank."""
        return cls(num_blocks, (Plane("indexer", 1, block_size * head_dim * dtype_size),))

    @classmethod
    def of_cache(
        cls, kv_cache: torch.Tensor, head_size: int, kv_lora_rank: int | None, indexer: bool = False
    ) -> LayerLayout:
        """The planes the attention backends read from this layer's cache (the view vLLM
        hands them: layout LBHNC, MLA with one head); ``kv_lora_rank`` None for GQA/MHA;
        ``indexer``: the layer holds V3.2's indexer keys."""
        size = kv_cache.element_size()
        if indexer:
            blocks, block_size, head_dim = kv_cache.shape[0], kv_cache.shape[-2], kv_cache.shape[-1]
            return cls.indexer(blocks, block_size, head_dim, size)
        if kv_lora_rank is not None:
            blocks, block_size, content = kv_cache.shape[0], kv_cache.shape[-2], kv_cache.shape[-1]
            return cls.mla(blocks, block_size, kv_lora_rank, content - kv_lora_rank, size)
        blocks, heads, block_size, content = kv_cache.shape
        return cls.gqa(blocks, heads, block_size, head_size, content - head_size, size)

    def plane_offset(self, index: int) -> int:
        return sum(p.block_bytes * self.num_blocks for p in self.planes[:index])

    def run(self, index: int, block: int, h0: int = 0, h1: int | None = None) -> tuple[int, int]:
        plane = self.planes[index]
        h1 = plane.heads if h1 is None else h1
        if not (0 <= block < self.num_blocks and 0 <= h0 < h1 <= plane.heads):
            raise IndexError(f"block {block} heads [{h0}, {h1}) outside plane {plane.name}")
        offset = self.plane_offset(index) + block * plane.block_bytes + h0 * plane.head_bytes
        return offset, (h1 - h0) * plane.head_bytes

    @property
    def total_bytes(self) -> int:
        return self.plane_offset(len(self.planes))
