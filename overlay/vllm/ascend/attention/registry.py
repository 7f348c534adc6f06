"""The names the Ascend attention backends go by in vLLM's backend enum, and their
registration (per process, idempotent): the platform answers upstream's backend
selection with these names, and every process that builds models registers them."""

from __future__ import annotations

ATTENTION_BACKEND = "ASCEND_ATTN"
MLA_BACKEND = "ASCEND_MLA"
SPARSE_MLA_BACKEND = "ASCEND_MLA_SPARSE"  # DeepSeek sparse attention (V3.2)
BACKEND_PATHS = {
    ATTENTION_BACKEND: "vllm.ascend.attention.backend.AscendAttentionBackend",
    MLA_BACKEND: "vllm.ascend.attention.mla.AscendMLABackend",
    SPARSE_MLA_BACKEND: "vllm.ascend.attention.sparse_mla.AscendSparseMLABackend",
}


def register_attention_backends() -> None:
    """Make our backend names members of vLLM's backend enum."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    for name, path in BACKEND_PATHS.items():
        if name not in AttentionBackendEnum.__members__:
            register_backend(name, path)
