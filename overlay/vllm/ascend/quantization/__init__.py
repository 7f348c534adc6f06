"""Ascend quantization: msModelSlim W8A8 checkpoints (``--quantization ascend``).

``description.py`` reads ``quant_model_description.json``; ``config.py`` is the vLLM
quantization config that picks each layer's method; ``linear.py`` and ``moe.py`` are
the methods; the int8 math is in ``vllm/ascend/kernels/quant.py``.
"""
