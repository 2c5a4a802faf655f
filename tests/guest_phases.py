"""A booted golden-image guest that hashes files on cue, for tests that
change its disks' graph while it runs (attach, detach, libvirt).

The list serves every non-zero block of some regular files of the image;
the guest hashes those files in named phases, each after dropping its page
cache, and between phases waits until the host writes a word into the
first sector of a small second disk (vdb), which it polls with O_DIRECT
reads (wait_for and signal_guest: pageshare_tools.qemu_guest).  Every
hash must equal the image's.  The files (regular_files), their blocks and
hashes in the image are read with debugfs, also for
test_qemu_filter_guest.py and test_attach_guest.py.
"""

from __future__ import annotations

import hashlib
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from page_server_helpers import content_sha256, make_list
from pageshare.lists import sectorlist

# the signal disk's two ends, shared with the benchmarks
from pageshare_tools.qemu_guest import signal_guest as signal_guest
from pageshare_tools.qemu_guest import wait_for as wait_for

CANDIDATES = [
    "/usr/bin/bash",
    "/usr/lib/x86_64-linux-gnu/libc.so.6",
    "/usr/bin/sha256sum",
    "/usr/lib/systemd/systemd",
    "/usr/lib/systemd/libsystemd-shared-252.so",
    "/usr/bin/perl",
    "/usr/lib/x86_64-linux-gnu/libcrypto.so.3",
    "/usr/bin/apt",
    "/usr/bin/coreutils",
    "/usr/bin/ls",
    "/usr/bin/tar",
    "/usr/sbin/sshd",
    "/usr/lib/x86_64-linux-gnu/libapt-pkg.so.6.0",
    "/usr/bin/dpkg",
    "/usr/lib/x86_64-linux-gnu/libstdc++.so.6",
]


def debugfs(raw: Path, request: str) -> str:
    p = subprocess.run(["debugfs", "-R", request, str(raw)], capture_output=True, text=True)
    return p.stdout


def regular_files(raw: Path) -> list[str]:
    return [f for f in CANDIDATES if "Type: regular" in debugfs(raw, f"stat {f}")]


def file_blocks(raw: Path, path: str) -> list[int]:
    """4 KiB blocks of a file (the small image is ext4 with 4 KiB blocks on
    the whole disk, so file system block n is disk block n)."""
    return [int(x) for x in debugfs(raw, f"blocks {path}").split()]


def nonzero_file_blocks(raw: Path, files: list[str]) -> dict[int, str]:
    """Every non-zero 4 KiB block of FILES in the image (debugfs's block
    map), as block -> sha256 of its bytes."""
    out: dict[int, str] = {}
    zero = bytes(4096)
    with open(raw, "rb") as r:
        for f in files:
            for b in file_blocks(raw, f):
                r.seek(b * 4096)
                data = r.read(4096)
                if data != zero:
                    out[b] = hashlib.sha256(data).hexdigest()
    return out


def file_sha256(raw: Path, path: str, tmp: Path) -> str:
    out = tmp / "dump"
    subprocess.run(
        ["debugfs", "-R", f"dump {path} {out}", str(raw)], check=True, capture_output=True
    )
    digest = hashlib.sha256(out.read_bytes()).hexdigest()
    out.unlink()
    return digest


@dataclass
class ListedFiles:
    files: list[str]
    want: dict[str, str]  # path -> sha256 in the image
    blocks: dict[int, str]  # listed sector -> sha256 of its 4 KiB


def list_files(image: Path, raw: Path, lst: Path, tmp: Path) -> ListedFiles:
    """Write LST, a list of every non-zero block of the image's chosen files."""
    files = regular_files(raw)
    assert len(files) >= 6, files
    want = {f: file_sha256(raw, f, tmp) for f in files}
    blocks: dict[int, str] = {}
    zero = bytes(4096)
    with open(raw, "rb") as r:
        for f in files:
            for b in file_blocks(raw, f):
                r.seek(b * 4096)
                chunk = r.read(4096)
                if chunk != zero:
                    blocks[b * 8] = hashlib.sha256(chunk).hexdigest()
    make_list(
        sectorlist.ImageIdentity(raw.stat().st_size, content_sha256(raw), image.name), blocks, lst
    )
    return ListedFiles(files, want, blocks)


def phase(files: list[str], name: str) -> str:
    """Shell: drop caches, then hash FILES between "<name>-begin/-end"."""
    return "; ".join(
        [
            "echo 3 > /proc/sys/vm/drop_caches",
            f"echo {name}-begin",
            *(f"sha256sum {f}" for f in files),
            f"echo {name}-end",
        ]
    )


def hashes(text: str, name: str) -> dict[str, str]:
    """sha256sum lines the guest printed between "<name>-begin" and "<name>-end"."""
    m = re.search(rf"^{name}-begin\s*$(.*?)^{name}-end\s*$", text, re.M | re.S)
    assert m, f"no {name} in the serial log:\n{text[-3000:]}"
    return {f: h for h, f in re.findall(r"^([0-9a-f]{64})  (\S+)\s*$", m.group(1), re.M)}
