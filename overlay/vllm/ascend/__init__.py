"""vLLM Ascend distribution: everything this distribution adds to upstream vLLM.

Upstream code never imports from here except through the small hooks that the
patch set adds; see ``provenance()`` for exactly what was built into this wheel.
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources


@cache
def provenance() -> dict:
    """What this wheel was built from: upstream sdist, patches, overlay digest, builder revision.

    Returns ``{}`` in a development work tree, where the builder has not stamped one.
    """
    try:
        text = resources.files(__name__).joinpath("provenance.json").read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    return json.loads(text)
