"""Which parametrized cases of a module this run selected, for module fixtures that start
one engine per case: an engine nobody reads (its case deselected, e.g. ``-m "not
extended"``) is not started."""

from __future__ import annotations

import pytest


def selected_params(request: pytest.FixtureRequest, argname: str) -> set:
    """The values of ``argname`` among the selected tests of the requesting module."""
    return {
        item.callspec.params[argname]
        for item in request.session.items
        if getattr(item, "module", None) is request.module
        and argname in getattr(getattr(item, "callspec", None), "params", {})
    }
