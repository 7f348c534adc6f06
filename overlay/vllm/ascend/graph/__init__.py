"""Decode graphs on the NPU: ACL graphs, through torch_npu's ``NPUGraph``, for Model Runner
V2's full-graph manager (``CudaGraphManager``, FULL_DECODE_ONLY).

Upstream captures one graph per batch shape and replays it for decode-only steps; the hook
patch ``v2-runner-capture-its-full-graphs-through-the-platform`` has it ask the platform for
the graph and the capture context, which this package answers (``capture.py``). What an
NPU graph needs that a CUDA graph does not: torch_npu's fused attention takes its sequence
lengths as host lists, which a captured task keeps from capture time. Graphs are captured
with torch_npu's ``auto_dispatch_capture``, which makes every such call a task group that
``NPUGraph.update`` can rewrite; before every replay the graph is updated with the lengths
of the step the attention metadata builders built last (``host_params.py``).

How graph mode is chosen, capture sizes and what is refused: ``policy.py``; with what
is NPU-unverified: docs/model_runner.md, "Decode graphs".
"""
