"""The vLLM Ascend distribution builder.

Turns a pinned upstream sdist + a versioned patch set + the overlay tree into one
reproducible wheel. Lives in ``build/`` but is deliberately *not* a package named
``build``: that name belongs to the PyPA frontend this builder runs.
"""
