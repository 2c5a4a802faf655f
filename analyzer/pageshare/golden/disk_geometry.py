"""Where a variant's file systems sit on its disk.

geometry() computes, from the spec and layout.py's numbers, the partition
and sectors of the root, and of /boot, the swap area or, on "gpt-efi", every
file system; the build lays the disk out by it, the manifest records it,
and the tests check the images against it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .layout import (
    BOOT_PARTITION,
    BOOT_SECTORS,
    EFI_FIRST_SECTOR,
    FS_BLOCK,
    GPT_BACKUP_SECTORS,
    GPT_ROOT_PARTITION,
    GPT_ROOT_START_SECTOR,
    LVM_ROOT_BYTES,
    MBR_EXTENDED_PARTITION,
    MBR_ROOT_PARTITION,
    MBR_ROOT_START_SECTOR,
    MBR_SWAP_PARTITION,
    MBR_SWAP_SECTORS,
    MIB_SECTORS,
    SECTOR,
)
from .spec import _Spec, _spec


@dataclass(frozen=True)
class Placed:
    """Where a "gpt-efi" file system sits: its partition and sectors (inclusive)."""

    mountpoint: str
    partition: int
    start_sector: int
    end_sector: int


@dataclass(frozen=True)
class Geometry:
    """Where the root filesystem (and a separate /boot, if any) sits on the virtual disk."""

    layout: str
    virtual_size: int
    root_partition: int | None
    root_start_sector: int
    root_end_sector: int  # inclusive, like sgdisk
    fs_bytes: int
    boot_partition: int | None = None
    boot_start_sector: int = 0
    boot_end_sector: int = 0  # inclusive
    boot_fs_bytes: int = 0
    # "mbr": the extended partition's first sector (its EBR) and the swap
    # partition inside it.
    extended_partition: int | None = None
    extended_start_sector: int = 0
    swap_partition: int | None = None
    swap_start_sector: int = 0
    swap_end_sector: int = 0  # inclusive
    # "gpt-efi": every file system's partition, the root's too, in disk order.
    placed: tuple[Placed, ...] = ()

    def at(self, mountpoint: str) -> Placed:
        return next(p for p in self.placed if p.mountpoint == mountpoint)


def geometry(variant: str) -> Geometry:
    spec = _spec(variant)
    size = spec.virtual_size
    if spec.layout == "whole-disk":
        return Geometry(spec.layout, size, None, 0, size // SECTOR - 1, size)
    if spec.layout == "mbr":
        return _mbr_geometry(spec)
    if spec.layout == "gpt-efi":
        return _efi_geometry(spec)
    if spec.layout not in ("gpt", "gpt-bootsplit", "gpt-lvm"):
        raise ValueError(f"unknown layout {spec.layout!r}")
    last_usable = size // SECTOR - GPT_BACKUP_SECTORS - 1
    root_start = GPT_ROOT_START_SECTOR
    if spec.layout == "gpt-bootsplit":
        root_start += BOOT_SECTORS
    part_bytes = (last_usable - root_start + 1) * SECTOR
    # The partition ends where Debian's does (last usable sector), which is
    # not a whole number of 4 KiB blocks; the filesystem leaves the tail.
    fs_bytes = part_bytes // FS_BLOCK * FS_BLOCK
    if spec.layout == "gpt-lvm":
        # root_start_sector is the PV partition's; the LV (and so the file
        # system) starts at the PV's first extent, known once LVM wrote it.
        fs_bytes = LVM_ROOT_BYTES
    geom = Geometry(spec.layout, size, GPT_ROOT_PARTITION, root_start, last_usable, fs_bytes)
    if spec.layout == "gpt-bootsplit":
        geom = replace(
            geom,
            boot_partition=BOOT_PARTITION,
            boot_start_sector=GPT_ROOT_START_SECTOR,
            boot_end_sector=root_start - 1,
            boot_fs_bytes=BOOT_SECTORS * SECTOR,
        )
    return geom


def _mbr_geometry(spec: _Spec) -> Geometry:
    total = spec.virtual_size // SECTOR
    swap_start = total - MBR_SWAP_SECTORS
    extended_start = swap_start - 2
    # The root ends on the last MiB boundary before the extended partition.
    root_end = extended_start // 2048 * 2048 - 1
    fs_bytes = (root_end - MBR_ROOT_START_SECTOR + 1) * SECTOR // FS_BLOCK * FS_BLOCK
    return Geometry(
        spec.layout,
        spec.virtual_size,
        MBR_ROOT_PARTITION,
        MBR_ROOT_START_SECTOR,
        root_end,
        fs_bytes,
        extended_partition=MBR_EXTENDED_PARTITION,
        extended_start_sector=extended_start,
        swap_partition=MBR_SWAP_PARTITION,
        swap_start_sector=swap_start,
        swap_end_sector=total - 1,
    )


def _efi_geometry(spec: _Spec) -> Geometry:
    last_usable = spec.virtual_size // SECTOR - GPT_BACKUP_SECTORS - 1
    fixed = sum(f.mib for f in spec.filesystems) * MIB_SECTORS
    root_sectors = (last_usable + 1 - EFI_FIRST_SECTOR - fixed) // MIB_SECTORS * MIB_SECTORS
    placed, at = [], EFI_FIRST_SECTOR
    for number, f in enumerate(spec.filesystems, 1):
        sectors = f.mib * MIB_SECTORS if f.mountpoint != "/" else root_sectors
        placed.append(Placed(f.mountpoint, number, at, at + sectors - 1))
        at += sectors
    root = next(p for p in placed if p.mountpoint == "/")
    boot = next(p for p in placed if p.mountpoint == "/boot")
    return Geometry(
        spec.layout,
        spec.virtual_size,
        root.partition,
        root.start_sector,
        root.end_sector,
        root_sectors * SECTOR,
        boot_partition=boot.partition,
        boot_start_sector=boot.start_sector,
        boot_end_sector=boot.end_sector,
        boot_fs_bytes=(boot.end_sector - boot.start_sector + 1) * SECTOR,
        placed=tuple(placed),
    )
