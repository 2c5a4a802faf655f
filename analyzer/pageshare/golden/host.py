"""The build host: what a build needs of it, and running its tools.

A build runs as root, needs mmdebstrap, mkfs and qemu-img (and more by
layout) and about 4 GiB free; the checks say what is missing before anything
starts.  Tools run with their output kept for the error message; a long one
(mmdebstrap) runs in its own session, logging now and then that it lives,
so that an interrupt can stop its whole process tree.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from pageshare.errors import UserError

from .layout import GIB
from .spec import _Spec

# Peak use is the unpacked root tree plus the filesystem image plus the qcow2.
_MIN_FREE_BYTES = 4 * GIB
_HEARTBEAT_SECONDS = 60

Log = Callable[[str], None]


# --- host checks ----------------------------------------------------------


def _required_tools(spec: _Spec) -> dict[str, str]:
    tools = {"mmdebstrap": "mmdebstrap", "mkfs.ext4": "e2fsprogs", "qemu-img": "qemu-utils"}
    if spec.root_fstype == "xfs":
        tools["mkfs.xfs"] = "xfsprogs"
    if spec.root_fstype == "btrfs":
        tools["mkfs.btrfs"] = "btrfs-progs"
    if spec.layout == "gpt-efi":
        tools |= {"mkfs.vfat": "dosfstools", "mcopy": "mtools"}
    if spec.layout == "mbr":
        tools |= {"sfdisk": "fdisk", "mkswap": "util-linux"}
    elif spec.layout != "whole-disk":
        tools["sgdisk"] = "gdisk"
    return tools


def _preflight(spec: _Spec, where: Path) -> None:
    if os.geteuid() != 0:
        raise UserError(
            "building a golden image needs root",
            "run as root: mmdebstrap --mode=root chroots and creates device nodes",
        )
    missing = {t: p for t, p in _required_tools(spec).items() if shutil.which(t) is None}
    if missing:
        raise UserError(
            f"missing tools: {', '.join(sorted(missing))}",
            f"apt-get install -y {' '.join(sorted(set(missing.values())))}",
        )
    _check_free_space(where)


def _check_free_space(where: Path) -> None:
    free = shutil.disk_usage(where).free
    if free < _MIN_FREE_BYTES:
        raise _disk_full(where, free)


def _disk_full(where: Path, free: int | None = None) -> UserError:
    if free is None:
        free = shutil.disk_usage(where).free
    return UserError(
        f"not enough free space in {where}: {free / GIB:.1f} GiB free, "
        f"a build needs about {_MIN_FREE_BYTES // GIB} GiB",
        "free some space or set PAGESHARE_CACHE to a directory on a bigger filesystem",
    )


# --- running tools --------------------------------------------------------


@contextmanager
def _step(log: Log, what: str) -> Iterator[None]:
    start = time.monotonic()
    log(f"{what}...")
    yield
    log(f"{what}: done in {time.monotonic() - start:.0f} s")


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(
            f"{' '.join(cmd)} failed with exit code {proc.returncode}:\n{proc.stderr.strip()}"
        )


@contextmanager
def appliance(image: Path) -> Iterator[Any]:
    """A libguestfs appliance (Debian's python3-guestfs) with the raw IMAGE as
    its writable /dev/sda, launched; its kernel writes the image, so nothing
    is mounted on the host.  Shut down (which syncs) when the block ends,
    closed however it ends."""
    import guestfs

    g = guestfs.GuestFS(python_return_dict=True)
    try:
        g.set_backend_settings(["force_tcg"])
        g.add_drive_opts(str(image), format="raw", readonly=0)
        g.launch()
        yield g
        g.shutdown()
    finally:
        g.close()


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _run_logged(cmd: list[str], logfile: Path, log: Log) -> int:
    """Run a long command with its output in logfile, saying now and then that it lives."""
    start = time.monotonic()
    with logfile.open("wb") as out:
        # Its own session, so that on interrupt the whole tree (mmdebstrap's
        # worker and the apt/dpkg inside the chroot) can be stopped: signalling
        # only the main mmdebstrap process leaves it waiting for the worker.
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            while True:
                try:
                    return proc.wait(timeout=_HEARTBEAT_SECONDS)
                except subprocess.TimeoutExpired:
                    log(f"  ... still running ({time.monotonic() - start:.0f} s)")
        except BaseException:
            _stop_group(proc)
            raise


def _stop_group(proc: subprocess.Popen[bytes]) -> None:
    # TERM first so mmdebstrap can undo its own mounts before our cleanup;
    # KILL afterwards for whatever in the group outlived it.
    with suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=60)
    with suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
