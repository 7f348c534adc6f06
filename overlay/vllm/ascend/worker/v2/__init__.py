"""The Ascend forms of Model Runner V2's step around the forward (``vllm/v1/worker/gpu``),
one module per upstream module, beside the runner as upstream's CPU runner keeps its own.

Two kinds live here. The runner's class seams: the sampler (``sample.py``, with its graphs
for random batches in ``gumbel_graphs.py``), the rejection sampler (``rejection_sampler.py``)
and the exact host sequence lengths (``seq_lens.py``). And the torch forms of the Triton kernels upstream
launches around the forward, which have no torch fallback upstream (``input_batch.py``,
``buffer_utils.py``, ``cp_utils.py``, ``rope.py``, ``mamba_hybrid.py``, ``gumbel.py``,
``logits_processing.py``, ``rejection_sampler_utils.py``, ``speculator.py``), each named
after the upstream module whose kernels it replaces and registered through one table
(``kernel_table.py``).

The forms' contract: each has its kernel's signature and fills the same outputs (the grid
is not passed: every size comes from the tensors); written with torch tensor ops and no
reads back to the host (no ``.item()``, no boolean-mask indexing), so on an NPU they run
as device ops (checked by the torch_npu contract double; not run on an NPU here) and in
host emulation alike. Masked scatters into integer state tensors add ``new - old`` with
``index_put_(accumulate=True)`` (``input_batch.masked_set``), which makes masked-out rows
harmless without knowing how many rows are real. ``tests/unit/worker/test_v2_runner_kernels.py``
compares each with upstream's Triton kernel run by Triton's interpreter. The pointer-table
kernels of the block tables are not here: ``vllm.ascend.worker.block_tables`` replaces the
class that launches them.
"""
