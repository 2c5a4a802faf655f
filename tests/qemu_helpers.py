"""Helpers for the QEMU pageshare filter tests: the patched build (a
failed build fails the test), a long-lived qemu-io driven through its
command prompt, hexdump parsing, a model of the disk chain, and a golden
image booted through the filter: its -blockdev graph, command line and
the filter's statistics come from pageshare_tools.qemu_guest (shared with
the benchmarks), its serial log is waited for here.  (No tests here.)"""

from __future__ import annotations

import os
import re
import select
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from pageshare_tools.qemu_guest import (
    BUILD_PY,
    QemuBuild,
    QemuBuildError,
    blockdev_args,
    flat_stats,
    guest_cmd,
    ps_stats,
)
from pageshare_tools.qemu_guest import qemu_build as _qemu_build

REPO = Path(__file__).resolve().parents[1]
PROMPT = b"qemu-io> "

__all__ = [
    "BUILD_PY",
    "PROMPT",
    "REPO",
    "SEED_VERDICTS",
    "DiskModel",
    "QemuBuild",
    "QemuIo",
    "blockdev_args",
    "dump_range",
    "flat_stats",
    "guest_cmd",
    "image_opts",
    "parse_dump",
    "ps_stats",
    "qemu_build",
    "serial_until",
    "trace_counters",
]


def qemu_build(*, stock: bool = False) -> QemuBuild:
    """pageshare_tools.qemu_guest.qemu_build, a failed build a test failure."""
    try:
        return _qemu_build(stock=stock)
    except QemuBuildError as e:
        pytest.fail(str(e))


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
