"""The errors this distribution raises at start-up. The CLI prints each as one
``error:`` line instead of a traceback (``platform.detect.exit_on_startup_error``, the
hook patch on upstream's CLI)."""

from __future__ import annotations


class AscendStartupError(RuntimeError):
    """A configuration this distribution cannot run; the message says what to change."""


class NoNPUError(AscendStartupError):
    """Serving was asked for on a host with no usable NPU and no host-emulation opt-in."""


class AscendConfigError(AscendStartupError):
    """An engine argument the Ascend platform cannot honour. Deliberately not a
    ValueError: pydantic would fold it into a multi-line validation report."""
