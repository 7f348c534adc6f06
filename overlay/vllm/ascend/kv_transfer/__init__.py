"""P2P disaggregated prefill: ``AscendP2PConnector`` (``connector.py``; its scheduler side
and worker side are separate modules sharing ``metadata.py``), the transfer plan
(``plan.py``, pure; inspected with ``python -m vllm.ascend.kv_transfer.inspector``), byte
addressing of the KV planes (``addressing.py``), the planner a decode rank keeps per
prefill replica (``planner.py``), the ZeroMQ control plane and its msgspec wire types
(``control.py``, ``wire.py``), holds and leases (``holds.py``), the transports
(``transport/``: Mooncake, LLM-DataDist) and the xPyD proxy (``proxy.py``).
docs/pd_disaggregation.md, docs/pd_plan.md."""
