"""The raw disk and its qcow2: partition tables, LVM, file systems at their offsets.

sgdisk writes the GPT, sfdisk the "mbr" layout's label (and mkswap its swap
area); LVM's metadata is written in the libguestfs appliance, as the host
has no device-mapper.  The file system images are copied in sparsely at the
sectors disk_geometry.py gives, and the disk becomes an uncompressed qcow2.
"""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

from pageshare.image import lvm

from .disk_geometry import Geometry
from .host import _run, appliance
from .layout import GPT_BIOS_BOOT, GPT_ESP, GPT_ROOT_PARTITION, GPT_TYPE, LVM_LV, LVM_VG, SECTOR
from .spec import _Spec

QCOW2_CLUSTER_SIZE = 65536


def _write_gpt(disk: Path, spec: _Spec, geom: Geometry) -> None:
    guids = spec.partition_guids
    root_no = GPT_ROOT_PARTITION
    cmd = ["sgdisk", "--clear", f"--disk-guid={spec.disk_guid}"]
    root_type = "8e00" if geom.layout == "gpt-lvm" else "8300"  # 8e00: Linux LVM
    parts = [
        (*GPT_BIOS_BOOT, "ef02"),
        (*GPT_ESP, "ef00"),
        (root_no, geom.root_start_sector, geom.root_end_sector, root_type),
    ]
    if geom.layout == "gpt-efi":
        types = {f.mountpoint: GPT_TYPE[f.fstype] for f in spec.filesystems}
        parts = [
            (p.partition, p.start_sector, p.end_sector, types[p.mountpoint]) for p in geom.placed
        ]
    if geom.boot_partition is not None and geom.layout != "gpt-efi":
        # A plain Linux file system type, as Debian's installer gives /boot.
        parts.append((geom.boot_partition, geom.boot_start_sector, geom.boot_end_sector, "8300"))
    for number, first, last, code in parts:
        cmd += [f"--new={number}:{first}:{last}", f"--typecode={number}:{code}"]
        cmd += [f"--partition-guid={number}:{guids[str(number)]}"]
    _run([*cmd, str(disk)])


def _write_mbr(disk: Path, spec: _Spec, geom: Geometry) -> None:
    """The msdos label of the "mbr" layout, and the swap area in its logical partition."""
    assert geom.swap_partition is not None and spec.swap_uuid
    root_sectors = geom.root_end_sector - geom.root_start_sector + 1
    swap_sectors = geom.swap_end_sector - geom.swap_start_sector + 1
    extended_sectors = geom.swap_end_sector - geom.extended_start_sector + 1
    # sfdisk numbers a dos label's entries after an extended one as its logical
    # partitions (5, 6, ...), and keeps the starts as given.
    table = (
        f"label: dos\nlabel-id: {spec.disk_guid}\nunit: sectors\n\n"
        f"start={geom.root_start_sector}, size={root_sectors}, type=83, bootable\n"
        f"start={geom.extended_start_sector}, size={extended_sectors}, type=5\n"
        f"start={geom.swap_start_sector}, size={swap_sectors}, type=82\n"
    )
    proc = subprocess.run(
        ["sfdisk", "-q", "--no-reread", "--no-tell-kernel", str(disk)],
        input=table,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"sfdisk failed with exit code {proc.returncode}:\n{proc.stderr}")
    swap = disk.with_name("swap.img")
    with swap.open("wb") as f:
        f.truncate(swap_sectors * SECTOR)
    _run(["mkswap", "-U", spec.swap_uuid, str(swap)])
    _copy_sparse(swap, disk, geom.swap_start_sector * SECTOR)
    swap.unlink()


_COPY_CHUNK = 1 << 20


def _copy_sparse(src: Path, dst: Path, offset: int) -> None:
    """Copy src into dst at offset, writing only non-zero data so dst stays sparse."""
    zero = bytes(_COPY_CHUNK)
    with src.open("rb") as s, dst.open("r+b") as d:
        fd_in, fd_out = s.fileno(), d.fileno()
        size = os.fstat(fd_in).st_size
        pos = 0
        while pos < size:
            try:
                data = os.lseek(fd_in, pos, os.SEEK_DATA)
            except OSError as e:
                if e.errno == errno.ENXIO:  # only a hole is left
                    break
                raise
            end = os.lseek(fd_in, data, os.SEEK_HOLE)
            for chunk_at in range(data, end, _COPY_CHUNK):
                chunk = os.pread(fd_in, min(_COPY_CHUNK, end - chunk_at), chunk_at)
                if chunk != zero[: len(chunk)]:
                    os.pwrite(fd_out, chunk, offset + chunk_at)
            pos = end


def _assemble_disk(
    fs_image: Path,
    work: Path,
    spec: _Spec,
    geom: Geometry,
    boot_image: Path | None = None,
    others: tuple[tuple[Path, int], ...] = (),
) -> tuple[Path, int]:
    """The raw disk, and the sector where the root file system starts on it."""
    if geom.layout == "whole-disk":
        if spec.root_fstype != "ext4":
            raise ValueError("the whole-disk layout is built for ext4 roots only")
        return fs_image, 0
    disk = work / "disk.raw"
    with disk.open("wb") as f:
        f.truncate(geom.virtual_size)
    if geom.layout == "mbr":
        _write_mbr(disk, spec, geom)
    else:
        _write_gpt(disk, spec, geom)
    fs_start = geom.root_start_sector
    if geom.layout == "gpt-lvm":
        fs_start = _make_lvm(disk, geom)
    _copy_sparse(fs_image, disk, fs_start * SECTOR)
    fs_image.unlink()
    if boot_image is not None:
        _copy_sparse(boot_image, disk, geom.boot_start_sector * SECTOR)
        boot_image.unlink()
    for image, start_sector in others:
        _copy_sparse(image, disk, start_sector * SECTOR)
        image.unlink()
    return disk, fs_start


def _make_lvm(disk: Path, geom: Geometry) -> int:
    """Makes the root partition a PV with VG vg0 and linear LV root; returns the
    LV's first disk sector, read back from the PV's metadata with the
    analyzer's own reader (so a build checks it too).

    The host has no device-mapper, so LVM runs in the libguestfs appliance,
    which only writes LVM's metadata; the file system is copied in afterwards.
    """
    part = f"/dev/sda{GPT_ROOT_PARTITION}"
    with appliance(disk) as g:
        g.pvcreate(part)
        g.vgcreate(LVM_VG, [part])
        g.lvcreate(LVM_LV, LVM_VG, geom.fs_bytes // (1024 * 1024))
    offset = geom.root_start_sector * SECTOR
    with disk.open("rb") as f:

        def read(at: int, size: int) -> bytes:
            return os.pread(f.fileno(), size, offset + at)

        label = lvm.read_label(read)
    if label is None:
        raise RuntimeError(f"no LVM label on {part} after pvcreate")
    _, vg = lvm.volume_group(label.metadata)
    segments, why = lvm.lv_segments(
        vg, LVM_LV, {label.uuid: geom.root_start_sector + label.pe_start // SECTOR}
    )
    if len(segments) != 1 or segments[0].sectors * SECTOR != geom.fs_bytes:
        raise RuntimeError(f"unexpected layout of {LVM_VG}/{LVM_LV}: {segments} {why}")
    return segments[0].disk_start


def _to_qcow2(raw: Path, qcow: Path) -> None:
    # Uncompressed on purpose: the page server reads clusters directly.
    _run(
        ["qemu-img", "convert", "-f", "raw", "-O", "qcow2",
         "-o", f"cluster_size={QCOW2_CLUSTER_SIZE}", str(raw), str(qcow)]
    )  # fmt: skip
