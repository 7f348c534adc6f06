"""Attention backends on the kernels facade: GQA/MHA (``backend``) and MLA (``mla``)."""
