"""What every part of ktest uses: the paths of kernel-syscall/, run(), log(),
KtestError, the cache root and the make parallelism."""

from __future__ import annotations

import hashlib
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

from pageshare import cache

# The repository (this file is tools/pageshare_tools/ktestlib/common.py) and
# kernel-syscall/, the series and ktest.py
REPO = Path(__file__).resolve().parents[3]
HERE = REPO / "kernel-syscall"
PATCHES = HERE / "patches"
CONFIGS = HERE / "config"
GUEST = HERE / "tests"
LIBDIR = HERE / "lib"
UAPI = HERE / "include"

GIT_ID = [
    "-c",
    "user.name=pageshare ktest",
    "-c",
    "user.email=ktest@pageshare.invalid",
    "-c",
    "advice.detachedHead=false",
    "-c",
    "gc.auto=0",
]


class KtestError(Exception):
    """A failure with a message that says what to do."""


def log(msg: str) -> None:
    print(f"ktest: {msg}", flush=True)


def exit_on_sigterm() -> None:
    """Make SIGTERM (`kill`, a CI runner's stop) an exit that runs the
    finally blocks, so a booted VM goes with its command (boot()) instead of
    running on, orphaned, with its RAM and a core.  For command lines only."""

    def stop(signum: int, _frame: object) -> None:
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)


def cache_root() -> Path:
    return cache.cache_dir("kernel")


def run(
    cmd: list[str],
    *,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    capture: bool = False,
    check: bool = True,
    logfile: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run a command; with logfile, append its output there instead of the terminal."""
    if logfile is not None:
        with open(logfile, "a") as f:
            f.write(f"\n$ {shlex.join(cmd)}\n")
            f.flush()
            p = subprocess.run(cmd, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT, text=True)
    else:
        p = subprocess.run(cmd, cwd=cwd, env=env, text=True, capture_output=capture)
    if check and p.returncode != 0:
        tail = ""
        if logfile is not None:
            tail = "\n".join(logfile.read_text(errors="replace").splitlines()[-40:])
        elif capture:
            tail = (p.stdout or "")[-2000:] + (p.stderr or "")[-2000:]
        raise KtestError(f"command failed ({p.returncode}): {shlex.join(cmd)}\n{tail}")
    return p


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def nice_prefix() -> list[str]:
    return ["nice", "-n", "10"]


def jobs() -> str:
    return os.environ.get("KTEST_JOBS", str(os.cpu_count() or 2))


def cpio_gz(top: Path) -> bytes:
    """The directory TOP as an initramfs: a newc cpio archive of everything
    under it, owned by root, gzip -1."""
    files = subprocess.run(
        ["find", ".", "-print0"], cwd=top, capture_output=True, check=True
    ).stdout
    cpio = subprocess.run(
        ["cpio", "--null", "-o", "-H", "newc", "--quiet", "--owner=0:0"],
        cwd=top,
        input=files,
        capture_output=True,
        check=True,
    ).stdout
    return subprocess.run(["gzip", "-1"], input=cpio, capture_output=True, check=True).stdout
