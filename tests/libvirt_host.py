"""Debian's libvirtd, run for a test without touching the host's libvirt.

libvirtd runs in a mount namespace of its own (unshare -m) in which
/etc/libvirt, /run/libvirt, /var/lib/libvirt, /var/log/libvirt and
/var/cache/libvirt are directories of the test, so the host's configuration,
state and any libvirtd of its own stay as they are.  The test and virsh
reach it through its socket (``uri``).  QEMU runs as root with no security
driver (QEMU_CONF), or as Debian's libvirt runs it by default, as the
libvirt-qemu user with the DAC driver (QEMU_CONF_UNPRIVILEGED); no cgroups
either way: this host has no systemd to delegate cgroups.  Every domain is destroyed and libvirtd
stopped when the test ends, on every exit path.  With it, the domain XML an
operator would write (domain_xml, disk), the filter's statistics through
libvirt (filter_stats) and `pageshare libvirt-watch` run from the checkout
(start_watcher, WatchLog), for test_libvirt_watch.py,
test_libvirt_unprivileged.py and test_libvirt_migrate.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

from pageshare.analysis.workload import FW_CFG_NAME, kernel_cmdline
from pageshare.image.image_inspect import Inspection

REPO = Path(__file__).resolve().parents[1]
DIRS = {
    "etc": "/etc/libvirt",
    "run": "/run/libvirt",
    "lib": "/var/lib/libvirt",
    "log": "/var/log/libvirt",
    "cache": "/var/cache/libvirt",
}

_HOST_LIMITS = """\
# no systemd here to hand out cgroups
cgroup_controllers = [ ]
# no virtlogd either: QEMU's output goes straight to /var/log/libvirt/qemu
stdio_handler = "file"
"""
QEMU_CONF = (
    """\
# QEMU as root: the pageshare filter reads the page server's memory
user = "root"
group = "root"
security_driver = "none"
"""
    + _HOST_LIMITS
)
# Debian's defaults: QEMU as libvirt's own user and group (libvirt-qemu),
# the DAC driver chowning each domain's images to them, ownership remembered.
QEMU_CONF_UNPRIVILEGED = _HOST_LIMITS

LIBVIRTD_CONF = """\
unix_sock_rw_perms = "0700"
auth_unix_rw = "none"
auth_unix_ro = "none"
"""


class PrivateLibvirtd:
    def __init__(
        self, root: Path, qemu_conf: str = QEMU_CONF, libvirtd_conf: str = LIBVIRTD_CONF
    ) -> None:
        self.root = root
        self.qemu_conf = qemu_conf
        self.libvirtd_conf = libvirtd_conf
        self.sock = root / "run" / "libvirt-sock"
        self.uri = f"qemu:///system?socket={self.sock}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = root / "libvirtd.log"

    def start(self, timeout: float = 60.0) -> None:
        for d in DIRS:
            (self.root / d).mkdir(parents=True, exist_ok=True)
        (self.root / "etc" / "qemu.conf").write_text(self.qemu_conf)
        (self.root / "etc" / "libvirtd.conf").write_text(self.libvirtd_conf)
        binds = "; ".join(
            f"mkdir -p {dst} && mount --bind {self.root / src} {dst}" for src, dst in DIRS.items()
        )
        script = (
            f"set -e; mount --make-rprivate /; {binds}; exec /usr/sbin/libvirtd "
            f"--config /etc/libvirt/libvirtd.conf --pid-file /run/libvirt/libvirtd.pid"
        )
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                ["unshare", "-m", "sh", "-c", script],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while self.virsh("version", check=False).returncode != 0:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    "libvirtd did not start:\n" + self.log.read_text(errors="replace")[-3000:]
                )
            time.sleep(0.5)

    def virsh(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        p = subprocess.run(
            ["virsh", "-q", "-c", self.uri, *args], capture_output=True, text=True, timeout=120
        )
        if check and p.returncode != 0:
            raise AssertionError(f"virsh {' '.join(args)}: {p.stderr.strip()}")
        return p

    def domain_log(self, name: str) -> str:
        p = self.root / "log" / "qemu" / f"{name}.log"
        return p.read_text(errors="replace") if p.exists() else ""

    def stop(self) -> None:
        if self.proc is None:
            return
        uuids: list[str] = []
        if self.proc.poll() is None:
            names = self.virsh("list", "--all", "--name", check=False).stdout.split()
            for n in names:
                uuids.append(self.virsh("domuuid", n, check=False).stdout.strip())
                self.virsh("destroy", n, check=False)
                self.virsh("undefine", n, "--nvram", check=False)
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        # libvirtd leaves domains running when it exits: make sure none is
        for u in filter(None, uuids):
            subprocess.run(["pkill", "-KILL", "-f", "--", f"-uuid {u}"], check=False)
        self.proc = None


def disk(path: Path, fmt: str, dev: str) -> str:
    return (
        f"<disk type='file' device='disk'><driver name='qemu' type='{fmt}'/>"
        f"<source file='{escape(str(path))}'/><target dev='{dev}' bus='virtio'/></disk>"
    )


def direct_boot(insp: Inspection) -> dict[str, str]:
    """domain_xml's BOOT for the image's own kernel and initrd (where it
    has one) with its root on the command line."""
    boot = {"kernel": str(insp.kernel), "cmdline": kernel_cmdline(insp.info.root_uuid)}
    if insp.initrd:
        boot["initrd"] = str(insp.initrd)
    return boot


def domain_xml(
    name: str,
    emulator: str,
    disks: list[str],
    serial: Path,
    boot: dict[str, str] | None = None,
    fwcfg: Path | None = None,
    serial_append: bool = False,
) -> str:
    """A domain an operator would define: TCG (type qemu), q35, virtio disks.
    SERIAL_APPEND: QEMU appends to the serial log instead of truncating it
    (a migration's destination on this host writes the same file)."""
    os_boot = ""
    if boot:
        os_boot = "".join(f"<{k}>{escape(v)}</{k}>" for k, v in boot.items())
    append = " append='on'" if serial_append else ""
    sysinfo = (
        f"<sysinfo type='fwcfg'><entry name='{FW_CFG_NAME}' file='{escape(str(fwcfg))}'/></sysinfo>"
        if fwcfg
        else ""
    )
    return f"""<domain type='qemu'>
  <name>{name}</name>
  <memory unit='MiB'>1024</memory>
  <vcpu>1</vcpu>
  <os><type arch='x86_64' machine='q35'>hvm</type>{os_boot}</os>
  {sysinfo}
  <features><acpi/><apic/></features>
  <cpu mode='custom' match='exact'><model fallback='allow'>qemu64</model></cpu>
  <on_poweroff>destroy</on_poweroff>
  <devices>
    <emulator>{escape(emulator)}</emulator>
    {"".join(disks)}
    <serial type='file'><source path='{escape(str(serial))}'{append}/><target port='0'/></serial>
    <memballoon model='none'/>
  </devices>
</domain>
"""


class WatchLog:
    """`pageshare libvirt-watch --json`'s lines, one attach (or note) each."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def records(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return [
            json.loads(line) for line in self.path.read_text().splitlines() if line.startswith("{")
        ]

    def wait(
        self, domain: str, event: str, after: int = 0, timeout: float = 120
    ) -> tuple[int, dict[str, Any]]:
        """The first record for DOMAIN and EVENT after the first AFTER
        records, and the number of records up to it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            recs = self.records()
            for i, r in enumerate(recs[after:], after):
                if r["domain"] == domain and r["event"] == event:
                    return i + 1, r
            time.sleep(0.5)
        raise AssertionError(f"no {event} record for {domain}: {self.records()}")


def start_watcher(uri: str, out: Path, err: Path, *args: str) -> subprocess.Popen[bytes]:
    """`pageshare libvirt-watch --json ARGS` from the checkout, once it
    listens to libvirt's events."""
    env = dict(os.environ, PYTHONPATH=str(REPO / "analyzer"))
    seen = err.read_text().count("watching") if err.exists() else 0
    with open(out, "ab") as o, open(err, "ab") as e:
        w = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pageshare.cli",
                "libvirt-watch",
                "--connect",
                uri,
                "--json",
                *args,
            ],
            stdout=o,
            stderr=e,
            env=env,
            start_new_session=True,
        )
    deadline = time.monotonic() + 60
    while err.read_text().count("watching") == seen:
        assert w.poll() is None and time.monotonic() < deadline, err.read_text()
        time.sleep(0.2)
    return w


def filter_stats(lv: PrivateLibvirtd, domain: str, node: str) -> dict[str, Any]:
    out = lv.virsh(
        "qemu-monitor-command",
        domain,
        json.dumps({"execute": "query-blockstats", "arguments": {"query-nodes": True}}),
    ).stdout
    for s in json.loads(out)["return"]:
        if s.get("node-name") == node:
            st: dict[str, Any] = s["driver-specific"]
            return st
    raise AssertionError(f"no node {node} in {out[:2000]}")
