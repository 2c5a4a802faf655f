"""The root tree: Debian installed by mmdebstrap into a directory, made fit to clone.

Nothing is mounted: the tree is a plain directory that filesystems.py makes
into file system images.  _customize() gives it what a sysprepped golden
image has (its fstab, no SSH host keys, an empty machine id, root locked);
the split functions move the contents of mount points that are file systems
of their own (/boot, /boot/efi, /var) out into trees of their own.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from pageshare import debian
from pageshare.errors import UserError

from .host import Log, _check_free_space, _run_logged, _step, _tail
from .layout import LVM_LV, LVM_VG
from .spec import _Spec


# initramfs-tools finds the root's type for its fsck hook by probing the
# device named in fstab, which does not exist in a chroot; without this the
# initrd has no fsck.ext4 and every boot warns "fsck not present".  It must be
# in place before the kernel package builds the initrd, hence an essential hook.
def _root_fstype_hook(fstype: str) -> str:
    return (
        'mkdir -p "$1/etc/initramfs-tools/conf.d" && '
        f'echo FSTYPE={fstype} > "$1/etc/initramfs-tools/conf.d/root-fstype"'
    )


def _mmdebstrap(spec: _Spec, rootdir: Path, work: Path, log: Log) -> None:
    cmd = [
        "mmdebstrap",
        "--mode=root",
        f"--variant={spec.mmdebstrap_variant}",
        f"--include={','.join(spec.packages)}",
        f"--essential-hook={_root_fstype_hook(spec.root_fstype)}",
        spec.suite,
        str(rootdir),
        *spec.sources,
    ]
    logfile = work / "mmdebstrap.log"
    with _step(log, f"mmdebstrap {spec.suite} (this takes 5-10 min on first run)"):
        rc = _run_logged(cmd, logfile, log)
    if rc != 0:
        log(f"last lines of {logfile}:\n{_tail(logfile)}")
        _check_free_space(work)
        raise UserError(
            f"mmdebstrap failed with exit code {rc}",
            f"see the output above; check that {debian.MIRROR} is reachable",
        )


def _kernel_version(rootdir: Path) -> str:
    kernels = sorted((rootdir / "boot").glob("vmlinuz-*"))
    if len(kernels) != 1:
        raise RuntimeError(f"expected exactly one kernel in {rootdir}/boot, found {kernels}")
    return kernels[0].name.removeprefix("vmlinuz-")


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _lock_root(rootdir: Path) -> None:
    # Same effect as `passwd --lock root`: a leading "!" makes the hash unmatchable.
    shadow = rootdir / "etc/shadow"
    lines = shadow.read_text().splitlines()
    for i, line in enumerate(lines):
        fields = line.split(":")
        if fields[0] == "root" and not fields[1].startswith("!"):
            fields[1] = "!" + fields[1]
            lines[i] = ":".join(fields)
    shadow.write_text("\n".join(lines) + "\n")


_SSH_KEYGEN_UNIT = """\
[Unit]
Description=Generate SSH host keys missing after cloning
ConditionPathExistsGlob=!/etc/ssh/ssh_host_*_key
Before=ssh.service

[Service]
Type=oneshot
ExecStart=/usr/bin/ssh-keygen -A

[Install]
WantedBy=multi-user.target
"""


def _enable_unit(rootdir: Path, unit: str, target: str = "multi-user.target") -> None:
    wants = rootdir / "etc/systemd/system" / f"{target}.wants"
    wants.mkdir(parents=True, exist_ok=True)
    link = wants / unit
    if link.is_symlink() or link.exists():
        return
    for base in ("etc/systemd/system", "lib/systemd/system"):
        if (rootdir / base / unit).exists():
            link.symlink_to(f"/{base}/{unit}")
            return
    raise RuntimeError(f"cannot enable {unit}: no unit file in the image")


def _prepare_ssh(rootdir: Path) -> None:
    # Clones must not share host keys, so the image ships without them and,
    # as on any sysprepped golden image, the first boot generates them.
    for key in (rootdir / "etc/ssh").glob("ssh_host_*"):
        key.unlink()
    _write(rootdir / "etc/systemd/system/ssh-host-keys.service", _SSH_KEYGEN_UNIT)
    _enable_unit(rootdir, "ssh-host-keys.service")
    _enable_unit(rootdir, "ssh.service")


def _clean_apt(rootdir: Path) -> None:
    # mmdebstrap already drops lists and .debs; these are the leftovers.
    for pattern in ("var/lib/apt/lists/*", "var/cache/apt/*.bin", "var/cache/apt/archives/*.deb"):
        for p in rootdir.glob(pattern):
            if p.is_file() and p.name != "lock":
                p.unlink()


def _customize(rootdir: Path, spec: _Spec) -> None:
    _write(rootdir / "etc/hostname", f"{spec.hostname}\n")
    _write(
        rootdir / "etc/hosts",
        f"127.0.0.1\tlocalhost\n127.0.1.1\t{spec.hostname}\n\n"
        "::1\tlocalhost ip6-localhost ip6-loopback\n"
        "ff02::1\tip6-allnodes\nff02::2\tip6-allrouters\n",
    )
    root = f"UUID={spec.fs_uuid}"
    if spec.layout == "gpt-lvm":
        root = f"/dev/mapper/{LVM_VG}-{LVM_LV}"  # as Debian's installer writes it
    options = "rw,discard,errors=remount-ro" if spec.root_fstype == "ext4" else "rw,discard"
    passno = 1
    if spec.root_fstype == "btrfs":
        # As Debian's installer writes it (btrfs has no boot-time fsck: pass 0).
        options, passno = (
            "defaults" + (f",subvol={spec.root_subvol}" if spec.root_subvol else ""),
            0,
        )
    fstab = f"{root}\t/\t{spec.root_fstype}\t{options}\t0\t{passno}\n"
    if spec.boot_fs_uuid:
        fstab += f"UUID={spec.boot_fs_uuid}\t/boot\text4\tdefaults\t0\t2\n"
    for f in spec.filesystems:
        if f.mountpoint != "/":  # as Debian's installer writes them
            options, passno = ("umask=0077", 1) if f.fstype == "vfat" else ("defaults", 2)
            fstab += f"UUID={f.uuid}\t{f.mountpoint}\t{f.fstype}\t{options}\t0\t{passno}\n"
    if spec.swap_uuid:
        fstab += f"UUID={spec.swap_uuid}\tnone\tswap\tsw\t0\t0\n"  # as the installer's
    _write(rootdir / "etc/fstab", fstab)
    # mmdebstrap copies the build host's resolver config in; it is not ours to ship.
    (rootdir / "etc/resolv.conf").unlink(missing_ok=True)
    # Empty, not absent: systemd then makes a fresh id per clone at boot.
    _write(rootdir / "etc/machine-id", "")
    dbus_id = rootdir / "var/lib/dbus/machine-id"
    if dbus_id.is_file() and not dbus_id.is_symlink():
        dbus_id.unlink()
    _lock_root(rootdir)
    if "openssh-server" in spec.packages:
        _prepare_ssh(rootdir)
    if "nginx" in spec.packages:
        _enable_unit(rootdir, "nginx.service")
    _clean_apt(rootdir)


def _split_out(rootdir: Path, mountpoint: str, tree: Path) -> None:
    """Moves a mount point's contents out of the root tree into tree, leaving
    the empty mount point (made if the tree had none)."""
    src = rootdir / mountpoint.lstrip("/")
    src.mkdir(parents=True, exist_ok=True)
    tree.mkdir()
    for entry in sorted(src.iterdir()):
        shutil.move(str(entry), str(tree / entry.name))


def _split_trees(rootdir: Path, work: Path, spec: _Spec) -> dict[str, Path]:
    """Moves each other file system's contents out of the root tree (deepest
    mount point first, so /boot/efi's files leave /boot), leaving the empty
    mount points; returns mountpoint -> tree."""
    trees = {}
    for f in sorted(spec.filesystems, key=lambda f: -f.mountpoint.count("/")):
        if f.mountpoint == "/":
            continue
        tree = work / ("fs" + f.mountpoint.replace("/", "-"))
        _split_out(rootdir, f.mountpoint, tree)
        trees[f.mountpoint] = tree
    return trees
