"""ktest's boot() takes its VM down with it on every way out.

A command that boots a kernel under QEMU (kernel-syscall/ktest.py,
bench/e2e_vs_ksm.py) and is stopped with SIGTERM, as `kill` or a CI
runner stops it, must leave no qemu-system-x86_64 behind: before
exit_on_sigterm() and boot()'s finally, a stopped benchmark left its
pageshare host VM running, orphaned, with 6 GiB and both cores.

The VM here is the series' debug kernel (built and cached for the kernel
suite) with ktest's own initramfs, whose one test sleeps.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from pageshare_tools import ktestlib as ktest

pytestmark = [pytest.mark.vm, pytest.mark.build]

# The child: a command line as ktest.py's and the benchmark's are.
CHILD = """
import sys
from pathlib import Path
from pageshare_tools import ktestlib as ktest
ktest.exit_on_sigterm()
ktest.boot(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), 600, show=lambda s: True)
"""


def children(pid: int) -> list[int]:
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return [int(c) for c in text.split()]


def alive(pid: int) -> bool:
    """A process that exists and is not a zombie waiting for its parent."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_sigterm_stops_the_booted_vm(tmp_path: Path) -> None:
    root = ktest.cache_root()
    src = ktest.ensure_source(root)
    with src.locked():
        kdir = ktest.ensure_kernel(src, ktest.series_files(), "debug")
    tests = tmp_path / "tests"
    tests.mkdir()
    initramfs = tmp_path / "initramfs.cpio.gz"
    idle = ktest.GuestTest("idle", ["/bin/sleep", "600"], 600)
    ktest.build_initramfs(ktest.ensure_busybox(root), tests, [idle], initramfs)

    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(kdir), str(initramfs), str(tmp_path / "serial.log")],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    qemu = 0
    try:
        assert child.stdout is not None
        seen = []
        # the kernel is up and the VM is what boot() waits on (should it
        # never get there, boot()'s own timeout ends the child and its output)
        for line in child.stdout:
            seen.append(line)
            if "KTEST-BEGIN" in line:
                break
        assert any("KTEST-BEGIN 1 idle" in s for s in seen), "".join(seen[-30:])
        (qemu,) = children(child.pid)
        assert Path(f"/proc/{qemu}/exe").resolve().name == "qemu-system-x86_64"
        assert alive(qemu)

        child.send_signal(signal.SIGTERM)
        rc = child.wait(60)
        assert rc == 128 + signal.SIGTERM, (rc, child.stdout.read())
        assert not alive(qemu), f"qemu-system-x86_64 {qemu} outlived the command"
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
        if qemu and alive(qemu):
            os.kill(qemu, signal.SIGKILL)
