"""Values computed once per forward pass and shared by every layer that asks for them:
the cache-write coordinates of a KV-cache group's slots, a rotary module's cosine and
sine rows for the step's positions.

A value lives as long as the forward context it was made in (``set_forward_context``
opens a new one for every model call, drafts included). Keys name the inputs by identity
and shape (``data_ptr`` of the runner's persistent buffers, which stay put through a
call). Outside a forward pass nothing is cached.

``dummy_run`` marks a runner's dummy runs, which layers that write caches themselves
must not treat as real steps.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from contextlib import contextmanager
from typing import Any

from vllm.forward_context import get_forward_context, is_forward_context_available

_step: tuple[Any, dict] | None = None  # (forward context, key -> value); the context held strongly


def once_per_step(key: Hashable, compute: Callable[[], Any]) -> Any:
    global _step
    if not is_forward_context_available():
        return compute()
    context = get_forward_context()
    if _step is None or _step[0] is not context:
        _step = (context, {})
    values = _step[1]
    if key not in values:
        values[key] = compute()
    return values[key]


_dummy_runs = 0


@contextmanager
def dummy_run():
    """Marks the forward passes of a runner's dummy run (memory profile, an idle DP rank's
    step): their tokens are padding, their cache slots -1."""
    global _dummy_runs
    _dummy_runs += 1
    try:
        yield
    finally:
        _dummy_runs -= 1


def in_dummy_run() -> bool:
    return _dummy_runs > 0
