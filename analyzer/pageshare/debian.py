"""The Debian archive: its mirror, and apt-get with a private configuration.

The one place that names the mirror (PAGESHARE_DEBIAN_MIRROR and
PAGESHARE_DEBIAN_SECURITY override it) and that builds a private apt
configuration: sources, lists and archives in a directory of the cache, so
the host's /etc/apt is never read or written and one host can fetch from
Debian 12 and 13 alike.  Used by the debug-symbol fetcher, the golden images'
sources, kernel-syscall/ktest.py and qemu-patches/build.py.

Standard library only: the two scripts run with the system python3 and
import this module from the checkout (analyzer/ on sys.path).
"""

import os
from collections.abc import Iterable
from pathlib import Path

MIRROR = os.environ.get("PAGESHARE_DEBIAN_MIRROR", "http://deb.debian.org/debian")
SECURITY = os.environ.get("PAGESHARE_DEBIAN_SECURITY", "http://deb.debian.org/debian-security")


def sources(suites: Iterable[str], kind: str = "deb") -> list[str]:
    """sources.list lines for each suite, its -updates and its -security
    (kind "deb-src" for source packages), main only."""
    lines = []
    for suite in suites:
        lines.append(f"{kind} {MIRROR} {suite} main")
        lines.append(f"{kind} {MIRROR} {suite}-updates main")
        lines.append(f"{kind} {SECURITY} {suite}-security main")
    return lines


class PrivateApt:
    """apt-get and apt-cache with their own sources, lists and archives under root.

    sandbox_root: run apt's downloads as root rather than as _apt (which may
    not be able to write into the cache).
    """

    def __init__(self, root: Path, source_lines: list[str], sandbox_root: bool = False) -> None:
        self.root = root
        self.sandbox_root = sandbox_root
        for sub in ("lists/partial", "archives/partial", "etc"):
            (root / sub).mkdir(parents=True, exist_ok=True)
        text = "\n".join(source_lines) + "\n"
        f = root / "etc/sources.list"
        if not f.exists() or f.read_text() != text:
            f.write_text(text)

    def opts(self) -> list[str]:
        r = self.root
        opts = [
            "-o",
            f"Dir::Etc::SourceList={r}/etc/sources.list",
            "-o",
            "Dir::Etc::SourceParts=/nonexistent",
            "-o",
            f"Dir::State::Lists={r}/lists",
            "-o",
            f"Dir::Cache={r}",
            "-o",
            f"Dir::Cache::archives={r}/archives",
            "-o",
            "Dir::State::status=/dev/null",
            "-o",
            "Debug::NoLocking=1",
        ]
        if self.sandbox_root:
            opts += ["-o", "APT::Sandbox::User=root"]
        return [*opts, "-o", "APT::Get::List-Cleanup=0"]

    def command(self, tool: str, *args: str) -> list[str]:
        """[flock, lock, tool, private options..., args...] for apt-get or
        apt-cache.  apt's own locks are off (Debug::NoLocking: they want
        root's /var/lib/dpkg), so flock(1) on a file in the root keeps two
        runs (make test's two workers) from writing its lists at once."""
        return ["flock", str(self.root / ".lock"), tool, *self.opts(), *args]
