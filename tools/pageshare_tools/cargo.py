"""cargo for the page server: found in one place, building into one target
directory shared by make lint, the tests and the kernel tests' payload."""

import shutil
from pathlib import Path

from pageshare.cache import cache_root


def cargo_target_dir() -> Path:
    """The cargo target directory make lint, the tests and the kernel tests'
    payload build the page server into (the packages have their own, under
    packages/: dpkg-buildpackage builds a copy with Debian's flags)."""
    return cache_root() / "cargo-target"


def cargo() -> str | None:
    """cargo on PATH, else rustup's ~/.cargo/bin/cargo (Debian 12's cargo is
    too old for the page server's lock file), else None."""
    found = shutil.which("cargo")
    if found:
        return found
    home = Path.home() / ".cargo" / "bin" / "cargo"
    return str(home) if home.exists() else None
