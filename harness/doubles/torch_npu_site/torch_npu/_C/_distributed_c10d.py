"""Stub of ``torch_npu._C._distributed_c10d``: ``ProcessGroupHCCL.Options`` as the real
extension checks it, so the options the distribution builds for HCCL process groups are
exercised (no HCCL group is ever created by the double: host runs use gloo).

The checks mirror the messages in the pinned wheel's ``libtorch_npu.so``
("Value type of hccl_buffer_size should be int.") and what this distribution sets."""

from __future__ import annotations

from torch_npu._rules import require

_KNOWN_KEYS = ("hccl_buffer_size",)  # the only key the distribution sets; others: unmodelled


class ProcessGroupHCCL:
    class Options:
        def __init__(self, is_high_priority_stream: bool = False) -> None:
            self.is_high_priority_stream = is_high_priority_stream
            self._hccl_config: dict = {}
            self.global_ranks_in_group: list[int] = []
            self.group_id = ""

        @property
        def hccl_config(self) -> dict:
            return dict(self._hccl_config)

        @hccl_config.setter
        def hccl_config(self, config: dict) -> None:
            from torch_npu._rules import unmodelled

            for key, value in config.items():
                if key not in _KNOWN_KEYS:
                    raise unmodelled("ProcessGroupHCCL.Options", f"hccl_config key {key!r}")
                require(
                    isinstance(value, int) and not isinstance(value, bool) and value > 0,
                    "ProcessGroupHCCL.Options",
                    "HCCL.buffer_size",
                    f"hccl_buffer_size={value!r}",
                )
            self._hccl_config = dict(config)
