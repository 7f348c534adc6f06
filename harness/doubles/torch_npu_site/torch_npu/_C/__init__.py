"""Stub of ``torch_npu._C``: only what the distribution reaches through Python imports
(``torch_npu._C._distributed_c10d``); the ops live in ``torch.ops.npu`` (``_contract``)."""
