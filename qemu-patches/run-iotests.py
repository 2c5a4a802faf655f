#!/usr/bin/env python3
"""Run QEMU's iotests (the series' and a few neighbours) against the
patched build.

    qemu-patches/run-iotests.py                 # pageshare + neighbours, qcow2
    qemu-patches/run-iotests.py pageshare -d    # extra args go to ./check

Builds first if needed (build.py, cached).  The tests run in the build's
work tree (source + build dir at the series commit) with the installed
binaries, whose share/qemu links Debian's firmware.  Exit status is
./check's.
"""

from __future__ import annotations

import os
import subprocess
import sys

import build  # qemu-patches/build.py, this script's neighbour

DEFAULT_TESTS = ["pageshare", "024", "detect-zeroes-registered-buf", "backing-file-invalidation"]


def main() -> int:
    args = sys.argv[1:]
    tests = [a for a in args if not a.startswith("-")] or DEFAULT_TESTS
    flags = [a for a in args if a.startswith("-")]
    out = build.ensure_built()
    work = build.worktree_for(out)
    b = out / "bin"
    env = dict(
        os.environ,
        QEMU_PROG=str(b / "qemu-system-x86_64"),
        QEMU_IMG_PROG=str(b / "qemu-img"),
        QEMU_IO_PROG=str(b / "qemu-io"),
        QEMU_NBD_PROG=str(b / "qemu-nbd"),
        QSD_PROG=str(b / "qemu-storage-daemon"),
    )
    cwd = work / "build" / "tests" / "qemu-iotests"
    cmd = ["./check", "-qcow2", *flags, *tests]
    print(f"[run-iotests] cd {cwd} && {' '.join(cmd)}", file=sys.stderr, flush=True)
    return subprocess.run(cmd, cwd=cwd, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
