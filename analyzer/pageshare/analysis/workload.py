"""Running an operator's workload inside the analysis guests, without touching the image.

The guests boot the image's own kernel directly (-kernel/-initrd), so we own
the kernel command line.  The workload script travels in a QEMU fw_cfg file,
which the guest sees under /sys/firmware/qemu_fw_cfg once its qemu_fw_cfg
driver is loaded (modules_load= asks systemd to load it; it also publishes
VMCOREINFO for the dumps).  systemd's systemd.run= starts the script after
sysinit; the script hands itself to `systemd-run --no-block`, because a
oneshot boot job that waited for the end of boot would wait for itself.
Markers on the serial console, with a per-run token, tell the host where the
guest is.  None of this writes to the guest's disk.
"""

import secrets
from dataclasses import dataclass
from pathlib import Path

FW_CFG_NAME = "opt/org.pageshare/workload"
FW_CFG_PATH = f"/sys/firmware/qemu_fw_cfg/by_name/{FW_CFG_NAME}/raw"


@dataclass(frozen=True)
class Workload:
    command: str = ""  # shell command run as root after boot; "" = boot only
    timeout: float = 600.0

    def describe(self) -> str:
        return self.command or "boot to multi-user"


@dataclass(frozen=True)
class Markers:
    token: str

    @property
    def booted(self) -> str:
        return f"PAGESHARE-BOOTED-{self.token}"

    @property
    def ready(self) -> str:
        return f"PAGESHARE-READY-{self.token}"

    @staticmethod
    def new() -> "Markers":
        return Markers(secrets.token_hex(4))


def script(workload: Workload, markers: Markers) -> str:
    lines = [
        "#!/bin/sh",
        "# pageshare analysis workload (delivered by fw_cfg; not stored in the image)",
        "exec >/dev/ttyS0 2>&1",
        "systemctl is-system-running --wait >/dev/null 2>&1",
        f"echo {markers.booted} state=$(systemctl is-system-running)",
    ]
    if workload.command:
        lines += ["(", workload.command, ")", "rc=$?"]
    else:
        lines.append("rc=0")
    lines += ["sync", f"echo {markers.ready} rc=$rc"]
    return "\n".join(lines) + "\n"


def kernel_cmdline(root_uuid: str, rootflags: str = "") -> str:
    """rootflags: the root's mount options the initrd needs, as a boot loader
    passes them: subvol=@rootfs for a btrfs root in a subvolume (GRUB's
    10_linux adds rootflags=subvol=... from the root's mount)."""
    run = f"/usr/bin/systemd-run --no-block --unit=pageshare-workload /bin/sh {FW_CFG_PATH}"
    return " ".join(
        [
            f"root=UUID={root_uuid}",
            *([f"rootflags={rootflags}"] if rootflags else []),
            "ro",
            "console=ttyS0",
            # A boot that fails in the kernel or the initramfs (no root, no
            # init) reboots at once, which -no-reboot turns into QEMU's exit:
            # the analysis then stops with the guest's last serial lines
            # instead of waiting out --boot-timeout (15 minutes by default).
            # initramfs-tools' panic() reads the same parameter.
            "panic=-1",
            "modules_load=qemu_fw_cfg",
            # Keep the guest quiet and deterministic: no kernel messages racing
            # with markers, and no reboot when the workload service ends.
            "loglevel=4",
            f'systemd.run="{run}"',
            "systemd.run_success_action=none",
            "systemd.run_failure_action=none",
        ]
    )


def write_script(workdir: Path, workload: Workload, markers: Markers) -> Path:
    p = workdir / "workload.sh"
    p.write_text(script(workload, markers))
    return p
