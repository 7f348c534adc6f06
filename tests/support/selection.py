"""The ``extended`` cases of a parametrized matrix (pyproject's marker: out of CI's run),
and which cases a module fixture that starts one engine per case has to start this run:
an engine nobody reads (its case deselected, e.g. ``-m "not extended"``) is not started."""

from __future__ import annotations

from collections.abc import Iterable

import pytest


def extended_params(values: Iterable, extended: Iterable) -> list:
    """``values`` as pytest params, those in ``extended`` marked ``extended``."""
    extended = set(extended)
    return [pytest.param(v, marks=[pytest.mark.extended] if v in extended else []) for v in values]


def cases_to_start(request: pytest.FixtureRequest, argname: str, cases: Iterable, extended: Iterable) -> list:
    """The ``cases`` a module fixture starts: every one that is not extended (other tests
    of the module may read it), and an extended one only if a selected test of the
    requesting module takes it as ``argname``."""
    selected = {
        item.callspec.params[argname]
        for item in request.session.items
        if getattr(item, "module", None) is request.module
        and argname in getattr(getattr(item, "callspec", None), "params", {})
    }
    extended = set(extended)
    return [case for case in cases if case not in extended or case in selected]
