"""Device layer: the only place that touches torch_npu (see ``npu_runtime``)."""
