"""Attention on the kernels facade: the GQA/MHA backend (``backend``) and the MLA backend
(``mla``), the names they register under (``registry``), the KV-cache layout they share
with the P/D connector (``kv_layout``), and what both use under context parallelism
(``context_parallel``: the ranks' partial results combined; ``cp_step``: one step as a rank sees it;
``prefill_chunks``: long prefill histories in bounded memory)."""
