"""The build from start to finish: build_image() and its steps, in order.

mmdebstrap installs the tree and it is customized; it is split into the
layout's file systems and each is made into an image; the disk is assembled
and converted to qcow2, and the result is published into the image cache.
The work directory is removed on every exit, without descending into mounts
an interrupted mmdebstrap may leave.
"""

from __future__ import annotations

import errno
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pageshare.cache import cache_dir, locked

from .bootloader import _install_grub_efi
from .disk import _assemble_disk, _to_qcow2
from .disk_geometry import Geometry, geometry
from .filesystems import _make_btrfs, _make_ext4, _make_vfat, _make_xfs
from .host import Log, _disk_full, _preflight, _run, _step
from .image_cache import GoldenImage, _image_dir, _manifest, _publish, cached_image
from .layout import BOOT_LABEL, SECTOR
from .rootfs import _customize, _kernel_version, _mmdebstrap, _split_out, _split_trees
from .spec import _Spec, _spec


def _log_stderr(message: str) -> None:
    print(f"[golden] {message}", file=sys.stderr, flush=True)


# --- cleanup --------------------------------------------------------------


def _unescape_mountinfo(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), field)


def _mounts_below(path: Path) -> list[str]:
    top = str(path.resolve())
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        mountpoint = _unescape_mountinfo(line.split()[4])
        if mountpoint == top or mountpoint.startswith(top + "/"):
            found.append(mountpoint)
    return found


def _remove_tree(path: Path, log: Log) -> None:
    """rmtree that refuses to descend into mounts an interrupted mmdebstrap may leave."""
    if not path.exists():
        return
    # rmtree does not stop at mount points; a leftover /dev or /proc bind
    # mount inside the chroot would otherwise be emptied on the host.
    for mountpoint in sorted(_mounts_below(path), key=len, reverse=True):
        subprocess.run(["umount", "--lazy", mountpoint], check=False, capture_output=True)
    if _mounts_below(path):
        log(f"warning: not removing {path}: something is still mounted below it")
        return
    shutil.rmtree(path, ignore_errors=True)


# --- the build ------------------------------------------------------------


def _make_other_filesystems(
    rootdir: Path, work: Path, spec: _Spec, geom: Geometry, kernel: str, log: Log
) -> tuple[tuple[Path, int], ...]:
    """ "gpt-efi": installs GRUB, then makes each file system besides the root
    from its part of the tree; returns (image, start sector) of each."""
    if spec.layout != "gpt-efi":
        return ()
    with _step(log, "GRUB for UEFI (grub-mkimage in the image)"):
        _install_grub_efi(rootdir, spec, kernel)
    trees = _split_trees(rootdir, work, spec)
    made = []
    for f in spec.filesystems:
        if f.mountpoint == "/":
            continue
        place, tree = geom.at(f.mountpoint), trees[f.mountpoint]
        image = work / f"{tree.name}.img"
        size = (place.end_sector - place.start_sector + 1) * SECTOR
        with _step(log, f"mkfs.{f.fstype} -d {f.mountpoint} ({f.mib} MiB)"):
            if f.fstype == "vfat":
                _make_vfat(tree, image, size, f.uuid, "EFI")
            else:
                _make_ext4(
                    tree,
                    image,
                    size,
                    f.uuid,
                    label=f.mountpoint.rsplit("/", 1)[-1],
                    fstype=f.fstype,
                )
        shutil.rmtree(tree)
        made.append((image, place.start_sector))
    return tuple(made)


def _build_in(work: Path, variant: str, force: bool, log: Log) -> GoldenImage:
    start = time.monotonic()
    spec, geom = _spec(variant), geometry(variant)
    rootdir = work / "rootfs"
    _mmdebstrap(spec, rootdir, work, log)
    _customize(rootdir, spec)
    kernel = _kernel_version(rootdir)
    boot_image = None
    if spec.boot_fs_uuid:
        bootdir, boot_image = work / "bootfs", work / "boot.ext4"
        _split_out(rootdir, "/boot", bootdir)
        with _step(log, f"mkfs.ext4 -d /boot ({geom.boot_fs_bytes // (1024 * 1024)} MiB)"):
            _make_ext4(bootdir, boot_image, geom.boot_fs_bytes, spec.boot_fs_uuid, BOOT_LABEL)
        shutil.rmtree(bootdir)
    others = _make_other_filesystems(rootdir, work, spec, geom, kernel, log)
    fs_image = work / "root.ext4"
    if spec.root_fstype in ("xfs", "btrfs"):
        # No mkfs.xfs can fill a file system from a directory with every
        # attribute (its protofiles lose sticky bits, hard links, xattrs),
        # nor can mkfs.btrfs 6.2 put it in a subvolume: the tree travels as
        # a tar into the libguestfs appliance instead.
        tree, fs_image = work / "root.tar", work / f"root.{spec.root_fstype}"
        _run(
            [
                "tar",
                "--numeric-owner",
                "--xattrs",
                "--xattrs-include=*",
                "--acls",
                "-C",
                str(rootdir),
                "-cf",
                str(tree),
                ".",
            ]
        )
        what = f"mkfs.{spec.root_fstype} + unpack in the appliance ({geom.fs_bytes >> 20} MiB)"
        with _step(log, what):
            if spec.root_fstype == "xfs":
                _make_xfs(tree, fs_image, geom.fs_bytes, spec.fs_uuid)
            else:
                _make_btrfs(
                    tree,
                    fs_image,
                    geom.fs_bytes,
                    spec.fs_uuid,
                    spec.root_subvol,
                    spec.compressed_files,
                )
        tree.unlink()
    else:
        with _step(log, f"mkfs.ext4 -d ({geom.fs_bytes // (1024 * 1024)} MiB)"):
            _make_ext4(rootdir, fs_image, geom.fs_bytes, spec.fs_uuid, block=spec.fs_block)
    _remove_tree(rootdir, log)  # frees ~1 GB before the next copies
    out = work / "out"
    out.mkdir()
    qcow = out / "base.qcow2"
    with _step(log, f"assemble {geom.layout} disk and convert to qcow2"):
        disk, fs_start = _assemble_disk(fs_image, work, spec, geom, boot_image, others)
        _to_qcow2(disk, qcow)
    manifest = _manifest(variant, spec, geom, kernel, qcow, time.monotonic() - start)
    # Where the root file system's bytes start: after the PV's metadata on LVM.
    manifest["root_fs_start_sector"] = fs_start
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    final = _publish(out, _image_dir(variant), work, force)
    log(f"{variant}: {final / 'base.qcow2'} (kernel {kernel}, {manifest['build_seconds']} s)")
    image = cached_image(variant)
    if image is None:
        raise RuntimeError(f"{final} was published but does not read back as an image")
    return image


def build_image(variant: str, *, force: bool = False, log: Log = _log_stderr) -> GoldenImage:
    """Build the variant's image, or return the cached one unless force."""
    spec = _spec(variant)
    if not force:
        cached = cached_image(variant)
        if cached is not None:
            return cached
    images = cache_dir("images")
    with locked(images / f".lock-{variant}"):
        if not force:
            cached = cached_image(variant)  # built while we waited
            if cached is not None:
                return cached
        return _build_locked(variant, spec, images, force, log)


def _build_locked(variant: str, spec: _Spec, images: Path, force: bool, log: Log) -> GoldenImage:
    _preflight(spec, images)
    # The work dir sits beside the final one so publication is a rename
    # within one filesystem, and so big temporaries stay off a small /tmp.
    work = Path(tempfile.mkdtemp(prefix=f".build-{variant}-", dir=images))
    try:
        return _build_in(work, variant, force, log)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise _disk_full(images) from e
        raise
    finally:
        _remove_tree(work, log)
