"""Where heavy artefacts live: outside the clone, keyed by their inputs.

Golden images, debug vmlinux files and (later) kernel and QEMU builds are
expensive to make and identical for identical inputs, so they are stored under
$PAGESHARE_CACHE (default ~/.cache/pageshare) in a directory named by a hash of
everything that went into them.  A fresh clone on the same machine reuses them.
"""

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any


def cache_root() -> Path:
    env = os.environ.get("PAGESHARE_CACHE")
    if env:
        root = Path(env)
    else:
        base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        root = Path(base) / "pageshare"
    root.mkdir(parents=True, exist_ok=True)
    return root


def cache_dir(kind: str) -> Path:
    d = cache_root() / kind
    d.mkdir(parents=True, exist_ok=True)
    return d


def inputs_key(inputs: Any) -> str:
    """A short stable hash of JSON-serialisable inputs (sorted keys)."""
    blob = json.dumps(inputs, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


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
