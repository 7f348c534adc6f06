"""What the tests and the benchmarks both drive, and neither owns (not shipped in the wheel).

- ``doubles/``: stand-ins for what cannot run on this machine, each a directory put
  first on ``PYTHONPATH``: the torch_npu contract double (``torch_npu_site``, with the
  pinned wheel it reads in ``torch_npu_wheel.py`` and the schema extractor), the
  LLM-DataDist double (``llm_datadist_site``) and the collective recorder
  (``collective_recorder``).
- ``vllm_runner``, ``moe_ranks``: programs started in processes of their own (an
  offline vLLM engine; a set of gloo ranks running one MoE layer per strategy).
- ``ports``: free local ports for the servers and process groups they start.

Imports go one way: ``tests/`` and ``benchmarks/`` import from here, never the reverse.
"""
