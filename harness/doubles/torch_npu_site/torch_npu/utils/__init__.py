"""Stub of ``torch_npu.utils`` (only what torch_npu's own meta functions import)."""
