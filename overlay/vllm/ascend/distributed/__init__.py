"""Collective communication for the Ascend platform (HCCL on NPU, gloo in host mode)."""
