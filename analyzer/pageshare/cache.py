"""Where heavy artefacts live: outside the clone, keyed by their inputs.

Golden images, debug vmlinux files and (later) kernel and QEMU builds are
expensive to make and identical for identical inputs, so they are stored under
$PAGESHARE_CACHE (default ~/.cache/pageshare) in a directory named by a hash of
everything that went into them.  A fresh clone on the same machine reuses them.
"""

import contextlib
import fcntl
import hashlib
import json
import os
from collections.abc import Iterator
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


@contextlib.contextmanager
def locked(lock_file: Path) -> Iterator[None]:
    """Exclusive use of what LOCK_FILE guards, across processes: two test
    workers (make test runs two) or two developers' runs that would build the
    same cache entry wait for each other instead of building it twice or
    writing one directory at once.  The kernel drops the lock if we die."""
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_file, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
