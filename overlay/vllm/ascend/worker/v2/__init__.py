"""The Ascend forms of Model Runner V2's step around the forward (``vllm/v1/worker/gpu``),
one module per upstream module, chosen by the runner's class seams."""
