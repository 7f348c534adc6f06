"""The errors this distribution raises at start-up. The CLI prints each as one
``error:`` line instead of a traceback (``exit_on_startup_error``, used by the hook patch
on upstream's CLI)."""

from __future__ import annotations

from contextlib import contextmanager


class AscendStartupError(RuntimeError):
    """A configuration this distribution cannot run; the message says what to change."""


class NoNPUError(AscendStartupError):
    """Serving was asked for on a host with no usable NPU and no host-emulation opt-in."""


class AscendConfigError(AscendStartupError):
    """An engine argument the Ascend platform cannot honour. Deliberately not a
    ValueError: pydantic would fold it into a multi-line validation report."""


@contextmanager
def exit_on_startup_error():
    """Turn :class:`AscendStartupError`, and an engine argument upstream's config
    validation rejects, into one ``error:`` line and exit status 1 (CLI hook)."""
    from pydantic import ValidationError

    try:
        yield
    except AscendStartupError as exc:
        raise SystemExit(f"error: {exc}") from None
    except ValidationError as exc:  # pydantic's report spans many lines and a traceback
        reasons = "; ".join(e["msg"].removeprefix("Value error, ") for e in exc.errors())
        raise SystemExit(f"error: {reasons}") from None
