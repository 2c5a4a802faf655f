"""A golden image booted on the patched QEMU, for the tests and the benchmarks.

The patched build (qemu-patches/build.py, cached), the -blockdev graph of
overlay <- pageshare filter <- base, the qemu-system command line of a
guest booted with its image's own kernel and a workload over fw_cfg, the
process started with its output in a log, the filter's statistics over
QMP, and the signal disk a guest polls for the host's word.  The tests
(tests/qemu_helpers.py adds their pytest glue, tests/guest_phases.py the
hashed phases) and bench/migration_bench.py share it.  Errors are plain
exceptions (QemuBuildError); the tests turn them into pytest failures.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pageshare.analysis.vm import child_setup, console_args
from pageshare.analysis.workload import FW_CFG_NAME, kernel_cmdline
from pageshare.host.qmp import QMP
from pageshare.image.image_inspect import Inspection

# the repository (this file is tools/pageshare_tools/qemu_guest.py)
REPO = Path(__file__).resolve().parents[2]
BUILD_PY = REPO / "qemu-patches" / "build.py"


class QemuBuildError(Exception):
    """qemu-patches/build.py failed: the patched QEMU is not there."""


@dataclass(frozen=True)
class QemuBuild:
    dir: Path

    def bin(self, name: str) -> str:
        return str(self.dir / "bin" / name)

    @property
    def qemu_io(self) -> str:
        return self.bin("qemu-io")

    @property
    def qemu_img(self) -> str:
        return self.bin("qemu-img")

    @property
    def qemu_system(self) -> str:
        return self.bin("qemu-system-x86_64")

    @property
    def info(self) -> dict[str, object]:
        data: dict[str, object] = json.loads((self.dir / "info.json").read_text())
        return data


_builds: dict[bool, QemuBuild] = {}


def qemu_build(*, stock: bool = False) -> QemuBuild:
    """The patched QEMU (qemu-patches/build.py; cached, a warm run is
    instant); with STOCK the same source and configuration without the
    series (build.py --stock).  Raises QemuBuildError with build.py's
    stderr if it fails."""
    if stock not in _builds:
        argv = [sys.executable, str(BUILD_PY), *(["--stock"] if stock else [])]
        p = subprocess.run(argv, capture_output=True, text=True, timeout=3 * 3600)
        if p.returncode != 0:
            raise QemuBuildError(f"{' '.join(argv[1:])} failed:\n{p.stderr[-4000:]}")
        _builds[stock] = QemuBuild(Path(p.stdout.strip().splitlines()[-1]))
    return _builds[stock]


def make_overlay(image: Path, ovl: Path, qemu_img: str = "qemu-img") -> Path:
    """OVL, a new qcow2 overlay over the qcow2 IMAGE (made by QEMU_IMG)."""
    subprocess.run(
        [qemu_img, "create", "-q", "-f", "qcow2", "-b", str(image), "-F", "qcow2", str(ovl)],
        check=True,
    )
    return ovl


def blockdev_args(base: Path, ovl: Path, sock: Path, **ps: object) -> list[str]:
    """-blockdev JSON for overlay <- pageshare filter (node "ps") <- qcow2
    base, as the README shows; the guest's disk is node "ovl"."""
    nodes = [
        {"driver": "file", "node-name": "base-file", "filename": str(base), "read-only": True},
        {"driver": "qcow2", "node-name": "base", "file": "base-file", "read-only": True},
        {
            "driver": "pageshare",
            "node-name": "ps",
            "file": "base",
            "read-only": True,
            "server": str(sock),
            **ps,
        },
        {"driver": "file", "node-name": "ovl-file", "filename": str(ovl)},
        {"driver": "qcow2", "node-name": "ovl", "file": "ovl-file", "backing": "ps"},
    ]
    return [arg for n in nodes for arg in ("-blockdev", json.dumps(n))]


def flat_stats(driver_specific: dict[str, Any]) -> dict[str, int]:
    """A filter's query-blockstats counters as one flat dict: booleans as
    0/1, histograms (lists such as merge-batches) as NAME-I per bucket,
    the driver name dropped."""
    out: dict[str, int] = {}
    for k, v in driver_specific.items():
        if k == "driver":
            continue
        if isinstance(v, list):
            out.update({f"{k}-{i}": int(x) for i, x in enumerate(v)})
        else:
            out[k] = int(v)
    return out


def ps_stats(qmp: QMP) -> dict[str, int]:
    """The filter's counters of node ps (see flat_stats)."""
    for s in qmp.command("query-blockstats", **{"query-nodes": True}):
        if s.get("node-name") == "ps":
            return flat_stats(s["driver-specific"])
    raise AssertionError("no stats for node ps")


def boot_args(insp: Inspection, workload: Path) -> list[str]:
    """The image's own kernel and initrd, its root on the kernel command
    line, and WORKLOAD (a shell script) over fw_cfg
    (pageshare.analysis.workload runs it in the guest)."""
    args = [
        "-kernel",
        str(insp.kernel),
        "-append",
        kernel_cmdline(insp.info.root_uuid),
        "-fw_cfg",
        f"name={FW_CFG_NAME},file={workload}",
    ]
    if insp.initrd:
        args += ["-initrd", str(insp.initrd)]
    return args


def guest_cmd(
    q: QemuBuild,
    insp: Inspection,
    accel: str,
    *,
    serial: Path,
    qmp: Path,
    workload: Path,
    disks: Sequence[str],
    machine: str = "q35",
    more_qmp: Sequence[Path] = (),
) -> list[str]:
    """qemu-system for a golden image booted with its own kernel, running
    WORKLOAD (fw_cfg, pageshare.analysis.workload) and writing its console to
    SERIAL.  Guest RAM is a private anonymous memory-backend-ram, so
    virtio-blk reads land in buffers the filter accepts as guest RAM (no
    x-any-buffer), and mergeable (QEMU's default): merge_pages() refuses a
    destination that is not VM_MERGEABLE, so merge mode needs it.  DISKS:
    the -blockdev (and other) arguments of its disks; the guest's disks are
    the "-device" entries among them.  MACHINE: the
    machine type (q35 is the newest pc-q35-*; a migration between two
    builds names one).  QMP, then each of MORE_QMP: a QMP socket."""
    return [
        q.qemu_system,
        "-machine",
        f"{machine},accel={accel},memory-backend=pc.ram",
        "-object",
        "memory-backend-ram,id=pc.ram,size=1024M,share=off",
        *console_args(accel, serial),
        *disks,
        *(a for p in (qmp, *more_qmp) for a in ("-qmp", f"unix:{p},server=on,wait=off")),
        *boot_args(insp, workload),
    ]


def start_qemu(cmd: Sequence[str], log: Path) -> subprocess.Popen[bytes]:
    """CMD started in a session of its own, its stdout and stderr in LOG,
    killed when this process dies, without transparent huge pages."""
    with open(log, "wb") as lf:
        return subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=lf,
            stderr=lf,
            preexec_fn=child_setup,
            start_new_session=True,
        )


def kill_qemu(proc: subprocess.Popen[bytes], qmp: QMP | None = None) -> None:
    """Close QMP (if any), then SIGKILL the QEMU's whole session and reap it."""
    if qmp is not None:
        with contextlib.suppress(Exception):
            qmp.close()
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


# --------------------------------------------------------------------------- the signal disk

# A guest waits for the host's word by polling the first sector of a small
# second disk (vdb) with O_DIRECT reads; the host writes the word into the
# disk's file (signal_guest).
WAIT_FOR = (
    'until [ "$(dd if=/dev/vdb bs=512 count=1 iflag=direct 2>/dev/null '
    '| head -c {n})" = "{word}" ]; do sleep 0.5; done'
)


def wait_for(word: str) -> str:
    """Shell: wait until vdb's first bytes are WORD."""
    return WAIT_FOR.format(n=len(word), word=word)


def signal_guest(disk: Path, word: bytes) -> None:
    """Write WORD (or zeros over it) at the start of the signal disk."""
    with open(disk, "r+b") as f:
        f.write(word)
        f.flush()
        os.fsync(f.fileno())


def make_signal_disk(path: Path) -> Path:
    """PATH, a signal disk of 1 MiB of zeros."""
    path.write_bytes(bytes(1 << 20))
    return path


def signal_disk_blockdev(disk: Path) -> list[str]:
    """-blockdev JSON for the signal disk DISK: raw node "go" over file
    node "go-file"."""
    nodes = [
        {"driver": "file", "node-name": "go-file", "filename": str(disk)},
        {"driver": "raw", "node-name": "go", "file": "go-file"},
    ]
    return [a for n in nodes for a in ("-blockdev", json.dumps(n))]


@dataclass
class Guest:
    """A running qemu-system: the process, QMP, its serial log and QEMU's
    own output."""

    proc: subprocess.Popen[bytes]
    qmp: QMP
    serial: Path
    log: Path

    def kill(self) -> None:
        kill_qemu(self.proc, self.qmp)
