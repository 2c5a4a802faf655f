"""QEMU guests for the analysis: launch, wait for markers, dump, tear down.

Guests run as children of the analyzer (not -daemonize) with
PR_SET_PDEATHSIG, so that no QEMU outlives the analyzer even if it is killed
with SIGKILL, and in their own session, so that Ctrl-C reaches only the
analyzer, which then shuts them down in order.  Host THP is disabled per
process (PR_SET_THP_DISABLE): KSM would otherwise split huge pages as it
merges, which slows convergence and adds noise.
"""

import contextlib
import ctypes
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..cache import cache_dir
from ..errors import UserError
from ..host.qmp import QMP

PR_SET_PDEATHSIG = 1
PR_SET_THP_DISABLE = 41

QEMU = os.environ.get("PAGESHARE_QEMU", "qemu-system-x86_64")


def child_setup() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    libc.prctl(PR_SET_THP_DISABLE, 1, 0, 0, 0)


def console_args(accel: str, serial: Path, ram_mib: int = 1024) -> list[str]:
    """What every guest runs with: RAM_MIB of RAM and one vCPU (the host's CPU
    under KVM, TCG's max without 5-level paging: one variable less), no
    default devices, no display, no reboot, its console written to SERIAL."""
    return [
        "-m",
        f"{ram_mib}M",
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
    ]


def qemu_version() -> str:
    out = subprocess.run([QEMU, "--version"], capture_output=True, text=True, check=True)
    return out.stdout.splitlines()[0]


def require_qemu() -> None:
    for tool in (QEMU, "qemu-img"):
        if not shutil.which(tool):
            raise UserError(
                f"{tool} not found", "run scripts/install-deps.sh (apt: qemu-system-x86 qemu-utils)"
            )


@dataclass
class BootSpec:
    kernel: Path
    initrd: Path | None
    cmdline: str


def probe_kvm(kernel: Path, timeout: float = 20.0) -> tuple[bool, str]:
    """Does an ordinary guest kernel run under KVM on this host?

    /dev/kvm existing is not enough: on some hosts (nested or paravirtual KVM
    variants) QEMU starts and the guest hangs or QEMU aborts.  So boot the
    guest kernel itself without a root file system: a working KVM gets it to
    the "VFS: Unable to mount root" panic within seconds.
    """
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return False, "/dev/kvm is not accessible"
    with tempfile.TemporaryDirectory(prefix="pageshare-kvmprobe-") as d:
        log = Path(d) / "serial.log"
        cmd = [
            QEMU,
            "-accel",
            "kvm",
            "-machine",
            "q35",
            "-cpu",
            "host",
            "-m",
            "256",
            "-nodefaults",
            "-display",
            "none",
            "-no-reboot",
            "-serial",
            f"file:{log}",
            "-kernel",
            str(kernel),
            "-append",
            "console=ttyS0 panic=-1 root=/dev/nonexistent",
        ]
        p = subprocess.Popen(
            cmd,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            preexec_fn=child_setup,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        ok = False
        while time.monotonic() < deadline and p.poll() is None:
            if log.exists() and b"Kernel panic" in log.read_bytes():
                ok = True
                break
            time.sleep(0.2)
        if p.poll() is None:
            p.kill()
        _, err = p.communicate()
        if ok or (log.exists() and b"Kernel panic" in log.read_bytes()):
            return True, "probe boot under KVM reached the kernel"
        tail = err.decode(errors="replace").strip().splitlines()[-1:] or ["guest hung"]
        return False, f"probe boot under KVM failed ({tail[0]})"


def choose_accel(requested: str, kernel: Path) -> tuple[str, str]:
    """Returns (accel, reason).  'auto' picks KVM only after a working probe boot."""
    if requested in ("kvm", "tcg"):
        return requested, "requested with --accel"
    marker = cache_dir("probe") / "kvm.json"
    boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    if marker.exists():
        cached = json.loads(marker.read_text())
        if cached.get("boot_id") == boot_id:
            return str(cached["accel"]), str(cached["reason"]) + " (cached for this host boot)"
    ok, why = probe_kvm(kernel)
    accel = "kvm" if ok else "tcg"
    marker.write_text(json.dumps({"boot_id": boot_id, "accel": accel, "reason": why}))
    return accel, why


@dataclass
class Guest:
    name: str
    workdir: Path
    base: Path
    base_format: str
    boot: BootSpec
    accel: str
    ram_mib: int = 1024
    fw_cfg: dict[str, Path] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    qmp: QMP | None = None

    @property
    def overlay(self) -> Path:
        return self.workdir / f"{self.name}.qcow2"

    @property
    def serial_log(self) -> Path:
        return self.workdir / f"{self.name}.serial.log"

    @property
    def qmp_path(self) -> Path:
        return self.workdir / f"{self.name}.qmp"

    def command(self) -> list[str]:
        cmd = [
            QEMU,
            "-name",
            self.name,
            "-machine",
            f"q35,accel={self.accel},memory-backend=pc.ram",
            # Private anonymous RAM: KSM ignores shared (memfd) and hugetlb mappings.
            "-object",
            f"memory-backend-ram,id=pc.ram,size={self.ram_mib}M,merge=on",
            *console_args(self.accel, self.serial_log, self.ram_mib),
            "-device",
            "vmcoreinfo",
            "-drive",
            f"file={self.overlay},format=qcow2,if=virtio,cache=unsafe,discard=ignore",
            # Relative to QEMU's working directory, the work directory (start()):
            # a unix socket's path has at most 107 bytes, and the work
            # directory's own path may be long.
            "-qmp",
            f"unix:{self.qmp_path.name},server=on,wait=off",
            "-kernel",
            str(self.boot.kernel),
            "-append",
            self.boot.cmdline,
        ]
        if self.boot.initrd:
            cmd += ["-initrd", str(self.boot.initrd)]
        for name, path in self.fw_cfg.items():
            cmd += ["-fw_cfg", f"name={name},file={path}"]
        return cmd

    def start(self) -> None:
        subprocess.run(
            [
                "qemu-img",
                "create",
                "-q",
                "-f",
                "qcow2",
                "-b",
                str(self.base.resolve()),
                "-F",
                self.base_format,
                str(self.overlay),
            ],
            check=True,
        )
        self.serial_log.write_bytes(b"")
        stderr = open(self.workdir / f"{self.name}.qemu.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            self.command(),
            stdin=subprocess.DEVNULL,
            stdout=stderr,
            stderr=stderr,
            preexec_fn=child_setup,
            start_new_session=True,
            cwd=self.workdir,
        )
        stderr.close()
        try:
            self.qmp = QMP(self.qmp_path, timeout=30)
        except Exception:
            self.check_alive()
            raise

    def check_alive(self) -> None:
        """Raises when QEMU is gone: a guest that panics or powers off during analysis."""
        if self.proc is not None and self.proc.poll() is not None:
            log = (self.workdir / f"{self.name}.qemu.log").read_text(errors="replace").strip()
            tail = "\n    ".join(self.serial_text().strip().splitlines()[-12:])
            raise UserError(
                f"guest {self.name} stopped during the analysis (QEMU exit "
                f"{self.proc.returncode}{': ' + log[-300:] if log else ''}); last "
                f"serial lines:\n    {tail}",
                "the image must boot with its own kernel and initrd to multi-user; "
                "try it by hand with qemu-system-x86_64 -kernel/-initrd",
            )

    def serial_text(self) -> str:
        try:
            return self.serial_log.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def stop_cpus(self) -> None:
        assert self.qmp
        self.qmp.command("stop")

    def dump(self, path: Path, timeout: float = 600) -> None:
        """ELF dump of guest-physical memory (paging=false: what crash needs)."""
        assert self.qmp
        self.qmp.command(
            "dump-guest-memory",
            timeout=timeout,
            paging=False,
            protocol=f"file:{path}",
            format="elf",
        )

    def shutdown(self) -> None:
        """Kills QEMU and removes its overlay and sockets; safe to call twice."""
        if self.qmp:
            # It may be gone already; the process is killed below regardless.
            with contextlib.suppress(Exception):
                self.qmp.command("quit", timeout=5)
            self.qmp.close()
            self.qmp = None
        if self.proc:
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None
        for p in (self.overlay, self.qmp_path):
            p.unlink(missing_ok=True)
