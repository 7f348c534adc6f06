"""MoE layers on Ascend: the layer's method (``method.py``), the routed experts
(``experts.py``), the communication strategies AllGather / AllToAll / MC2 as one
upstream modular-kernel prepare/finalize (``prepare_finalize.py``), and the choice of a
strategy per forward (``selector.py``: the pure rule; ``step.py``: the process's plan and
each forward's step). docs/moe.md has the table and the settings."""
