"""Progress lines for long steps, on stderr so that --json stdout stays clean."""

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager


class Progress:
    def __init__(self, prefix: str = "analyze-image", quiet: bool = False) -> None:
        self.prefix = prefix
        self.quiet = quiet
        self.t0 = time.monotonic()
        self.phases: dict[str, float] = {}

    def say(self, msg: str) -> None:
        if not self.quiet:
            elapsed = time.monotonic() - self.t0
            print(f"[{self.prefix} {elapsed:7.1f}s] {msg}", file=sys.stderr, flush=True)

    @contextmanager
    def phase(self, name: str, msg: str = "") -> Iterator[None]:
        """Times a phase; the durations add up across runs (--runs N)."""
        self.say(msg or name)
        t = time.monotonic()
        try:
            yield
        finally:
            self.phases[name] = self.phases.get(name, 0.0) + time.monotonic() - t
