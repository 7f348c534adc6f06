"""Step-by-step progress lines for long-running builder commands."""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager


class Progress:
    """Prints ``[i/n] step ...`` lines with the time each step took."""

    def __init__(self, total: int, stream=None) -> None:
        self.total = total
        self.index = 0
        self.stream = stream or sys.stderr
        self.started = time.monotonic()

    def note(self, message: str) -> None:
        print(f"      {message}", file=self.stream, flush=True)

    @contextmanager
    def step(self, title: str):
        self.index += 1
        print(f"[{self.index}/{self.total}] {title} ...", file=self.stream, flush=True)
        t0 = time.monotonic()
        yield self
        print(f"      done in {time.monotonic() - t0:.1f}s", file=self.stream, flush=True)

    def finish(self, message: str) -> None:
        total = time.monotonic() - self.started
        print(f"{message} ({total:.1f}s)", file=self.stream, flush=True)


class Silent(Progress):
    """Progress that prints nothing (used by callers that report on their own)."""

    def __init__(self, total: int = 0) -> None:
        super().__init__(total)

    def note(self, message: str) -> None:
        pass

    @contextmanager
    def step(self, title: str):
        yield self

    def finish(self, message: str) -> None:
        pass
