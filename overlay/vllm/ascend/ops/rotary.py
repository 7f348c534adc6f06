"""Out-of-tree forms of upstream's ``RotaryEmbedding``, of each subclass that keeps its
forward (the scaled variants that only compute another cosine/sine cache: linear,
dynamic NTK, YaRN, Llama 3, ...) and of DeepSeek's YaRN rotary
(``DeepseekScalingRotaryEmbedding``: the same cache layout and formula; calls with
position offsets keep its native form).

The full-width cosine/sine tables are built once per module and dtype; the rows for a
step's positions are gathered once per forward pass and reused by every layer that
shares the module (``get_rope`` shares one per configuration) with the same positions
tensor. YaRN's caches carry its attention factor (``mscale``: cos and sin scaled by it,
outside the [-1, 1] torch_npu's rotary op documents): those rotate in plain torch
(``kernels.rotary.rotate_in_torch``) with either kernel set. Partial rotary
(``rotary_dim < head_size``) and shapes outside torch_npu's documented limits keep
upstream's native form; the reason is logged once per class.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from vllm.logger import init_logger
from vllm.model_executor.custom_op import CustomOp
from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

from vllm.ascend.kernels import rotary
from vllm.ascend.step_cache import once_per_step

logger = init_logger(__name__)


class AscendRotaryForm:
    """Mixed in before an upstream rotary class: its ``forward_oot``."""

    # what the upstream rotary class it is mixed into has (annotations only: no attribute)
    cos_sin_cache: torch.Tensor
    is_neox_style: bool
    rotary_dim: int
    head_size: int
    forward_native: Callable[..., Any]

    _ascend_tables: dict | None = None

    _ascend_rotate = None

    def _rotation(self):
        """``rotary.rotate``, or ``rotary.rotate_in_torch`` when the cache rows carry a factor
        (YaRN's mscale) that puts them outside torch_npu's rotary range; chosen once."""
        if self._ascend_rotate is None:
            scale = float(getattr(self, "mscale", 1.0))
            if scale == 1.0:
                self._ascend_rotate = rotary.rotate
            else:
                logger.info(
                    "Ascend rotary: %s's tables carry a factor %.4f (outside torch_npu's rotary "
                    "range [-1, 1]): rotated in plain torch",
                    type(self).__name__,
                    scale,
                )
                self._ascend_rotate = rotary.rotate_in_torch
        return self._ascend_rotate

    def _tables(self, query: torch.Tensor, neox: bool):
        key = (query.dtype, query.device, neox)
        if self._ascend_tables is None:
            self._ascend_tables = {}
        if key not in self._ascend_tables:
            # the module's own buffer (on the device since load; gpt-oss keeps it in float32),
            # cast here: upstream's dtype match copies it with a device argument
            cache = self.cos_sin_cache
            if cache.device != query.device:
                cache = cache.to(query.device)
            self._ascend_tables[key] = rotary.full_tables(cache.to(dtype=query.dtype), neox)
        return self._ascend_tables[key]

    def step_tables(self, positions: torch.Tensor, query: torch.Tensor, neox: bool | None = None):
        """(cos, sin) ``[1, T, 1, rot]`` for the step's positions, in ``query``'s dtype: the
        rows of this module's tables laid out for ``neox`` (default: its own style), gathered
        once per forward pass for every layer sharing the module."""
        neox = self.is_neox_style if neox is None else neox
        key = ("rope-rows", id(self), positions.data_ptr(), positions.numel(), query.dtype, neox)
        return once_per_step(key, lambda: rotary.tables_at(self._tables(query, neox), positions))

    def forward_oot(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
        offsets: torch.Tensor | None = None,
    ):
        if offsets is not None:  # DeepSeek YaRN's position offsets: upstream's native form
            return self.forward_native(positions, query, key, offsets)
        if not all(rotary.takes(x, self.rotary_dim, self.head_size) for x in (query, key) if x is not None):
            logger.info_once(
                "Ascend rotary form not used by %s (rotary_dim %d, head_size %d): upstream's native form runs",
                type(self).__name__,
                self.rotary_dim,
                self.head_size,
            )
            return self.forward_native(positions, query, key)
        cos, sin = self.step_tables(positions, query)
        tokens, rotate = positions.numel(), self._rotation()

        def heads(x: torch.Tensor) -> torch.Tensor:
            return x.view(tokens, -1, self.head_size)

        if key is not None and rotate is rotary.rotate:  # both in one launch where the op takes them
            q, k = rotary.rotate_pair(heads(query), heads(key), cos, sin, self.is_neox_style)
            return q.view(query.shape), k.view(key.shape)

        def turn(x: torch.Tensor) -> torch.Tensor:
            return rotate(heads(x), cos, sin, self.is_neox_style).view(x.shape)

        return turn(query), None if key is None else turn(key)


def _keeps_forward(cls: type) -> bool:
    return all(
        getattr(cls, name) is getattr(RotaryEmbedding, name)
        for name in ("forward_native", "forward_static", "forward_oot", "forward_cuda")
    )


def _subclasses(cls: type) -> list[type]:
    found: list[type] = []
    direct: list[type] = type.__subclasses__(cls)
    for sub in direct:
        found += [sub, *_subclasses(sub)]
    return found


def register() -> None:
    import vllm.model_executor.layers.rotary_embedding  # noqa: F401  (defines every subclass)
    from vllm.model_executor.layers.rotary_embedding.deepseek_scaling_rope import (
        DeepseekScalingRotaryEmbedding,
    )

    # DeepSeek's YaRN rotary is not a RotaryEmbedding subclass, but its cache has the same
    # layout and its native forward the same formula (plus position offsets, kept native).
    for cls in [RotaryEmbedding, *_subclasses(RotaryEmbedding), DeepseekScalingRotaryEmbedding]:
        if cls is DeepseekScalingRotaryEmbedding or (
            cls.__module__.startswith("vllm.model_executor") and _keeps_forward(cls)
        ):
            form = type(f"Ascend{cls.__name__}", (AscendRotaryForm, cls), {"__module__": __name__})
            CustomOp.register_oot(form, name=cls.__name__)
            form.name = cls.name  # type: ignore[attr-defined]  # register_oot renamed it; custom_ops uses upstream's
