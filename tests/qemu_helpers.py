"""Helpers for the QEMU pageshare filter tests: the patched build, a
long-lived qemu-io driven through its command prompt, hexdump parsing, a
model of the disk chain, and a golden image booted through the filter
(its -blockdev graph and command line, its serial log, the filter's
statistics).  (No tests here.)"""

from __future__ import annotations

import json
import os
import re
import select
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from pageshare.analysis.workload import FW_CFG_NAME, kernel_cmdline
from pageshare.host.qmp import QMP
from pageshare.image.image_inspect import Inspection

REPO = Path(__file__).resolve().parents[1]
BUILD_PY = REPO / "qemu-patches" / "build.py"
PROMPT = b"qemu-io> "


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
    series (build.py --stock)."""
    if stock not in _builds:
        argv = [sys.executable, str(BUILD_PY), *(["--stock"] if stock else [])]
        p = subprocess.run(argv, capture_output=True, text=True, timeout=3 * 3600)
        if p.returncode != 0:
            pytest.fail(f"{' '.join(argv[1:])} failed:\n{p.stderr[-4000:]}")
        _builds[stock] = QemuBuild(Path(p.stdout.strip().splitlines()[-1]))
    return _builds[stock]


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
) -> list[str]:
    """qemu-system for a golden image booted with its own kernel, running
    WORKLOAD (fw_cfg, pageshare.analysis.workload) and writing its console to
    SERIAL.  Guest RAM is a private anonymous memory-backend-ram, so
    virtio-blk reads land in buffers the filter accepts as guest RAM (no
    x-any-buffer).  DISKS: the -blockdev (and other) arguments of its disks;
    the guest's disks are the "-device" entries among them.  MACHINE: the
    machine type (q35 is the newest pc-q35-*; a migration between two
    builds names one)."""
    cmd = [
        q.qemu_system,
        "-machine",
        f"{machine},accel={accel},memory-backend=pc.ram",
        "-object",
        "memory-backend-ram,id=pc.ram,size=1024M,share=off",
        "-m",
        "1024M",
        "-smp",
        "1",
        "-cpu",
        "host" if accel == "kvm" else "max,la57=off",
        "-nodefaults",
        "-display",
        "none",
        "-vga",
        "none",
        "-no-reboot",
        "-serial",
        f"file:{serial}",
        *disks,
        "-qmp",
        f"unix:{qmp},server=on,wait=off",
        "-kernel",
        str(insp.kernel),
        "-append",
        kernel_cmdline(insp.info.root_uuid),
        "-fw_cfg",
        f"name={FW_CFG_NAME},file={workload}",
    ]
    if insp.initrd:
        cmd += ["-initrd", str(insp.initrd)]
    return cmd


def serial_until(
    proc: subprocess.Popen[bytes], serial: Path, qlog: Path, marker: str, timeout: float = 300
) -> str:
    """The guest's serial log once it holds MARKER.  Fails if QEMU exits
    (with its log), the guest panics, or TIMEOUT passes: under TCG the small
    image is ready in 20-60 s, and a guest that got bad data hangs or panics."""
    deadline = time.monotonic() + timeout
    text = ""
    while marker not in text:
        assert proc.poll() is None, qlog.read_text(errors="replace")[-3000:]
        assert time.monotonic() < deadline, f"no {marker} from the guest:\n" + text[-3000:]
        assert "Kernel panic" not in text, "guest panicked:\n" + text[-3000:]
        time.sleep(1)
        text = serial.read_text(errors="replace") if serial.exists() else ""
    return text


def image_opts(
    overlay: Path | None,
    base: Path,
    *,
    server: Path | None,
    base_fmt: str = "qcow2",
    opts: dict[str, object] | None = None,
) -> str:
    """--image-opts for overlay <- [pageshare filter] <- base.  With server
    None there is no filter; with overlay None the filter (or base) is the
    top.  Below an overlay, the base's file name comes from the overlay's
    header: the block layer hands it down to the protocol node under the
    filter (giving it as an option too would conflict with it)."""

    def kv(d: dict[str, object]) -> list[str]:
        out = []
        for k, v in d.items():
            if isinstance(v, bool):
                v = "on" if v else "off"
            out.append(f"{k}={v}")
        return out

    if overlay is None:
        bottom = [f"driver={base_fmt}", "file.driver=file", f"file.filename={base}"]
    else:
        bottom = [f"driver={base_fmt}"]
    if server is not None:
        mid = [
            "driver=pageshare",
            f"server={server}",
            *kv(opts or {}),
            *("file." + x for x in bottom),
        ]
    else:
        mid = bottom
    if overlay is None:
        return ",".join(mid)
    return ",".join(
        [
            "driver=qcow2",
            "file.driver=file",
            f"file.filename={overlay}",
            *("backing." + x for x in mid),
        ]
    )


def parse_dump(text: str) -> dict[int, bytes]:
    """qemu-io `read -v` hexdump lines -> {offset: 16 bytes or fewer}."""
    out: dict[int, bytes] = {}
    for line in text.splitlines():
        m = re.match(r"^([0-9a-f]{8,}):  ((?:[0-9a-f]{2} )+) ", line)
        if m:
            out[int(m.group(1), 16)] = bytes.fromhex(m.group(2))
    return out


def dump_range(text: str, offset: int, length: int) -> bytes:
    rows = parse_dump(text)
    buf = bytearray()
    for off in range(offset, offset + length, 16):
        row = rows.get(off)
        if row is None:
            raise AssertionError(f"hexdump has no row at {off:#x}")
        buf += row
    return bytes(buf[:length])


@dataclass
class QemuIo:
    """qemu-io with commands on its stdin, one at a time (it reads stdin
    with fgets from a main-loop handler, so its main loop, timers and the
    filter's socket handler run between commands)."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    stderr_path: Path | None = None

    def start(self) -> None:
        err = open(self.stderr_path, "wb") if self.stderr_path else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(
            self.argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            env={**os.environ, **self.env},
        )
        if self.stderr_path:
            err.close()  # type: ignore[union-attr]
        self._read_until_prompt(60)

    def _read_until_prompt(self, timeout: float) -> str:
        assert self.proc and self.proc.stdout
        fd = self.proc.stdout.fileno()
        buf = bytearray()
        deadline = time.monotonic() + timeout
        while not buf.endswith(PROMPT):
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(
                    f"qemu-io: no prompt after {timeout} s; got {bytes(buf[-500:])!r}"
                )
            r, _, _ = select.select([fd], [], [], left)
            if r:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    raise AssertionError(
                        f"qemu-io exited (rc {self.proc.wait()}): "
                        f"{bytes(buf[-500:])!r} {self.stderr()[-2000:]}"
                    )
                buf += chunk
        return buf[: -len(PROMPT)].decode(errors="replace")

    def cmd(self, line: str, timeout: float = 120) -> str:
        assert self.proc and self.proc.stdin
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()
        return self._read_until_prompt(timeout)

    def idle(self, seconds: float) -> None:
        """Let qemu-io's main loop run (reconnect timers, socket messages)."""
        self.cmd(f"sleep {int(seconds * 1000)}", timeout=seconds + 60)

    def close(self, timeout: float = 60) -> int:
        assert self.proc and self.proc.stdin
        try:
            self.proc.stdin.write(b"quit\n")
            self.proc.stdin.close()
        except BrokenPipeError:
            pass
        assert self.proc.stdout
        self.proc.stdout.read()
        rc = self.proc.wait(timeout)
        return rc

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stderr(self) -> str:
        return (
            self.stderr_path.read_text(errors="replace")
            if self.stderr_path and self.stderr_path.exists()
            else ""
        )


class DiskModel:
    """The disk chain's content: the base image (a raw copy, read with
    pread) plus the writes made to the overlay."""

    def __init__(self, raw: Path) -> None:
        self.fd = os.open(raw, os.O_RDONLY)
        self.size = os.fstat(self.fd).st_size
        self.written: dict[int, bytearray] = {}  # 4 KiB block -> content

    def _block(self, b: int) -> bytearray:
        blk = self.written.get(b)
        if blk is None:
            data = os.pread(self.fd, 4096, b * 4096)
            return bytearray(data.ljust(4096, b"\0"))
        return blk

    def read(self, off: int, length: int) -> bytes:
        out = bytearray()
        pos = off
        while pos < off + length:
            b, o = divmod(pos, 4096)
            n = min(4096 - o, off + length - pos)
            out += self._block(b)[o : o + n]
            pos += n
        return bytes(out)

    def write(self, off: int, data: bytes) -> None:
        pos = off
        i = 0
        while i < len(data):
            b, o = divmod(pos, 4096)
            n = min(4096 - o, len(data) - i)
            blk = self._block(b)
            blk[o : o + n] = data[i : i + n]
            self.written[b] = blk
            pos += n
            i += n

    def close(self) -> None:
        os.close(self.fd)


def trace_counters(log: str) -> dict[str, int]:
    """The pageshare_close trace line's counters (last one)."""
    found = list(
        re.finditer(
            r"pageshare_close .*?requests (\d+) hits (\d+) merged (\d+) "
            r"fallback-no-table (\d+) fallback-merge-failed (\d+) "
            r"connects (\d+)",
            log,
        )
    )
    if not found:
        raise AssertionError(f"no pageshare_close trace line in:\n{log[-3000:]}")
    keys = ["requests", "hits", "merged", "no_table", "failed", "connects"]
    return dict(zip(keys, map(int, found[-1].groups()), strict=True))


# What every reader of a page server's table (QEMU's block/pageshare-table.c,
# page-server/client/pageshare_table.h) must make of each seed that
# qemu-patches/fuzz/make_seeds.py writes: accepted, or refused for this reason.
SEED_VERDICTS = {
    "bad-addr": "malformed table: an entry outside the image or arena",
    "dense": "accepted",
    "empty": "accepted",
    # every bucket taken: the lookup that spun forever on the I/O path
    "full": "malformed table: entry count does not match the buckets",
    "lie": "malformed table: entry count does not match the buckets",
    "one": "accepted",
    "random": "accepted",
}
