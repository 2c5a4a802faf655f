"""Driving host KSM for an analysis, and giving the host back as it was.

KSM is host-global: whatever we change affects every process on the host, so
the settings are saved before any change and written back on every exit path
(normal return, exception, Ctrl-C, SIGTERM).  We never write run=2: it would
unmerge every KSM page of every process on the host.
"""

import contextlib
import fcntl
import json
import os
import re
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UserError

# Tunables we may change, in the order they are written back.  advisor_mode
# must go first (in scan-time mode pages_to_scan is read-only) and run last
# (so that ksmd does not briefly run with our aggressive settings).
RESTORE_ORDER = (
    "advisor_mode",
    "smart_scan",
    "use_zero_pages",
    "max_page_sharing",
    "pages_to_scan",
    "sleep_millisecs",
    "run",
)

COUNTERS = (
    "full_scans",
    "pages_shared",
    "pages_sharing",
    "pages_unshared",
    "pages_volatile",
    "ksm_zero_pages",
    "pages_scanned",
    "general_profit",
    "pages_skipped",
)


def ksm_sysfs() -> Path:
    # Overridable so the "host has no KSM" error path can be tested for real.
    return Path(os.environ.get("PAGESHARE_KSM_SYSFS", "/sys/kernel/mm/ksm"))


@dataclass
class Sample:
    t: float
    values: dict[str, int]


@dataclass
class Convergence:
    converged: bool
    seconds: float
    full_scans: int
    samples: list[Sample] = field(default_factory=list)


class KSM:
    def __init__(self, root: Path | None = None) -> None:
        self.root = root or ksm_sysfs()
        self.saved: dict[str, str] = {}

    def check_usable(self) -> None:
        if not (self.root / "run").exists():
            raise UserError(
                f"host KSM is not available ({self.root}/run does not exist)",
                "run on a host kernel built with CONFIG_KSM=y",
            )
        if not os.access(self.root / "run", os.W_OK):
            raise UserError(
                "cannot write host KSM settings (need root)", "run analyze-image as root (sudo)"
            )

    def read(self, name: str) -> str:
        """A setting's value; for choice files ("[none] scan-time") the chosen one."""
        text = (self.root / name).read_text().strip()
        m = re.search(r"\[(\S+)\]", text)
        return m.group(1) if m else text

    def write(self, name: str, value: str) -> None:
        (self.root / name).write_text(value + "\n")

    def counters(self) -> dict[str, int]:
        out = {}
        for name in COUNTERS:
            p = self.root / name
            if p.exists():
                # A counter that vanished or is unreadable is just left out.
                with contextlib.suppress(ValueError, IndexError, OSError):
                    out[name] = int(p.read_text().split()[0])
        return out

    def save(self) -> dict[str, str]:
        self.saved = {n: self.read(n) for n in RESTORE_ORDER if (self.root / n).exists()}
        return dict(self.saved)

    def tune(self, pages_to_scan: int = 20000, sleep_ms: int = 10) -> dict[str, str]:
        """Aggressive settings for a short, dedicated analysis; returns what was set."""
        if not self.saved:
            self.save()
        wanted = [
            # Scan-time advisor would overwrite pages_to_scan.
            ("advisor_mode", "none"),
            # smart_scan skips pages that failed to merge recently: late merges would be lost.
            ("smart_scan", "0"),
            # Zero pages map to the zero page instead of forming huge KSM chains.
            ("use_zero_pages", "1"),
            ("pages_to_scan", str(pages_to_scan)),
            ("sleep_millisecs", str(sleep_ms)),
            ("run", "1"),
        ]
        applied = {}
        for name, value in wanted:
            if (self.root / name).exists():
                self.write(name, value)
                applied[name] = value
        return applied

    def restore(self) -> None:
        """Writes back every saved setting; keeps going past individual failures."""
        errors = []
        for name in RESTORE_ORDER:
            if name in self.saved:
                try:
                    if self.read(name) != self.saved[name]:
                        self.write(name, self.saved[name])
                except OSError as e:
                    errors.append(f"{name}: {e}")
        if errors:
            raise RuntimeError("could not restore KSM settings: " + "; ".join(errors))

    def converge(
        self,
        timeout: float = 600.0,
        min_scans: int = 3,
        interval: float = 1.0,
        on_sample: Callable[[Sample], None] | None = None,
        min_time: float = 0.0,
    ) -> Convergence:
        """Waits until KSM has done min_scans full scans and pages_sharing is stable.

        Samples from the start, but does not call it converged before min_time
        (the settle period, during which the guests keep running).

        Stable means it moved by less than max(0.1 %, 50 pages) across the last full
        scan: one more pass over all mergeable memory found (almost) nothing new.
        """
        t0 = time.monotonic()
        first = self.counters()
        f0 = first.get("full_scans", 0)
        samples = [Sample(0.0, first)]
        while True:
            time.sleep(interval)
            c = self.counters()
            s = Sample(time.monotonic() - t0, c)
            samples.append(s)
            if on_sample:
                on_sample(s)
            fs, sharing = c.get("full_scans", 0), c.get("pages_sharing", 0)
            # Reference: the newest sample taken at least one whole scan ago
            # (small guests finish several scans per sample interval).
            ref = next(
                (p for p in reversed(samples) if p.values.get("full_scans", 0) <= fs - 2), None
            )
            # A counter that could not be read says nothing: it must not pass
            # for 0 pages shared, as stable as the 0 of the first sample.
            complete = "full_scans" in c and "pages_sharing" in c
            if complete and s.t >= min_time and fs - f0 >= min_scans and ref is not None:
                delta = abs(sharing - ref.values.get("pages_sharing", 0))
                if delta < max(0.001 * sharing, 50):
                    return Convergence(True, s.t, fs - f0, samples)
            if s.t > min_time + timeout:
                return Convergence(False, s.t, fs - f0, samples)


def lock_path() -> Path:
    return Path(os.environ.get("PAGESHARE_KSM_LOCK", "/run/lock/pageshare-ksm.lock"))


def state_path() -> Path:
    """Where the saved settings live while KSM is tuned (next to the lock)."""
    return lock_path().with_suffix(".saved")


@contextmanager
def host_lock(on_wait: Callable[[str], None] | None = None) -> Iterator[None]:
    """One KSM user at a time on this host.

    Two analyses that each save, tune and restore KSM would interleave: the
    second saves the first one's tuned values and restores them last, leaving
    the host tuned.  The lock is released by the kernel if we die.
    """
    path = lock_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait:
                on_wait(f"another analysis is using host KSM ({path}); waiting for it to finish")
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextmanager
def ksm_session(ksm: KSM, on_wait: Callable[[str], None] | None = None) -> Iterator[KSM]:
    """Saves KSM settings, yields, and restores them however the block ends.

    SIGTERM is turned into SystemExit for the duration, so that `kill` of the
    analyzer still restores the host; SIGINT is ignored while restoring so a
    second Ctrl-C cannot interrupt the write-back half way.
    """
    ksm.check_usable()
    with host_lock(on_wait):
        _recover(ksm, on_wait)
        with _saved(ksm):
            yield ksm


def _recover(ksm: KSM, say: Callable[[str], None] | None) -> None:
    """Restores settings left tuned by an analysis that was killed (SIGKILL, power loss).

    We hold the lock, so a state file now can only be a dead run's.
    """
    state = state_path()
    if not state.exists():
        return
    try:
        saved = json.loads(state.read_text())
    except (OSError, ValueError):
        state.unlink(missing_ok=True)
        return
    if say:
        say(f"a previous analysis died with host KSM tuned; restoring its saved settings {saved}")
    ksm.saved = {k: str(v) for k, v in saved.items()}
    ksm.restore()
    state.unlink(missing_ok=True)


@contextmanager
def _saved(ksm: KSM) -> Iterator[None]:
    saved = ksm.save()
    state = state_path()
    tmp = state.with_suffix(".tmp")
    tmp.write_text(json.dumps(saved))
    os.replace(tmp, state)
    old_term = signal.getsignal(signal.SIGTERM)

    def on_term(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        old_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            ksm.restore()
            state.unlink(missing_ok=True)
        finally:
            signal.signal(signal.SIGINT, old_int)
            signal.signal(signal.SIGTERM, old_term)
