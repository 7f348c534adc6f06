"""The Ascend forms of upstream's layer ops, registered through upstream's own seams.

Out-of-tree forms (``CustomOp.register_oot``, the registry upstream consults when it
builds a layer) of ``RMSNorm`` with and without the residual add (``norm.py``),
``RotaryEmbedding`` and its subclasses that only change the cosine/sine cache, and
DeepSeek's YaRN rotary (``rotary.py``), and ``SiluAndMul`` (``activation.py``); the
out-of-tree replacement (``PluggableLayer.register_oot``) of upstream's multi-head latent
attention layer, whose forward fuses the latent prolog (``mla.py``), and of the Qwen Gated
DeltaNet layer, whose core runs the reference kernels (``gdn.py``; registered in the
workers of hybrid models only). They run where upstream's
custom-op switch runs ``forward_oot``: ``compilation_config.custom_ops`` turns them on by
default; ``none`` turns all off, ``-rms_norm`` / ``-rotary_embedding`` / ``-silu_and_mul``
one of them (upstream's op names, which the forms keep).

Each calls one ``vllm.ascend.kernels`` entry: its torch_npu form with the NPU kernels, its
reference form in host emulation. Inputs outside what a form takes go to upstream's
native form.
"""

from __future__ import annotations

from functools import cache


@cache
def register_layer_ops() -> None:
    from vllm.ascend.ops import activation, mla, norm, rotary

    norm.register()
    rotary.register()
    activation.register()
    mla.register()


@cache
def register_state_layer_ops() -> None:
    """The Gated DeltaNet layer, for hybrid models only (its upstream module takes a second
    and a half to import)."""
    from vllm.ascend.ops import gdn

    gdn.register()
