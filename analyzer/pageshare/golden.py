"""Build the golden images that guests are cloned from.

A golden image here is an ordinary Debian 12 (bookworm) or 13 (trixie) system disk as qcow2,
the kind an operator would make once and clone many VMs from.  Nothing in it
knows about the analysis: the point of the project is to measure what ordinary
guests keep in their page caches, so the image must not be special.

The image is built without mounting anything: mmdebstrap installs into a
directory, ``mkfs.ext4 -d`` turns that directory into a filesystem image, and
for the partitioned layouts the filesystem is copied into a GPT disk at the same
offset Debian's cloud images use ("gpt"), behind a separate /boot partition
made the same way from the tree's /boot ("gpt-bootsplit"), or into a linear
LVM logical volume on that partition ("gpt-lvm"; LVM's metadata is written
in the libguestfs appliance).  An XFS root ("xfs") is made by mkfs.xfs and
filled from a tar of the tree in the appliance, since mkfs.xfs cannot copy a
directory with all its attributes; so is a btrfs root ("btrfs"), unpacked
into a subvolume @rootfs as Debian's installer lays it out (mkfs.btrfs 6.2
makes no subvolumes).  The "mbr" layout is Debian's installer's on a BIOS
machine: an MBR (msdos) label written by sfdisk, the root in primary
partition 1 at sector 2048 and swap in logical partition 5 inside extended
partition 2 at the end of the disk.  The "gpt-efi" layout is a UEFI
installer's: a FAT32 EFI system partition (mkfs.vfat and mtools' mcopy, no
mount) with GRUB made by the image's own grub-mkimage, /boot (ext2) with
GRUB's modules and a grub.cfg as update-grub writes it, the root, and /var
(ext3), each made by mkfs -d from its part of the tree.  The other layouts
have no boot loader: the analyzer boots guests by direct kernel boot with
the image's own kernel and initrd from /boot.

Images are cached under ``cache_dir("images")/<variant>-<key>/`` where the key
hashes the variant's spec and BUILDER_VERSION.  The Debian mirror moves on, so
two builds with the same key may differ in package versions; the cached image
is kept until ``--force``.  Bump BUILDER_VERSION whenever a change to this file
changes what ends up in an image.
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pageshare import debian, lvm
from pageshare.cache import cache_dir, inputs_key
from pageshare.errors import UserError, print_error

BUILDER_VERSION = 2

SECTOR = 512
FS_BLOCK = 4096
GIB = 1024**3

# Debian's cloud images put the root filesystem at this sector, after a BIOS
# boot partition (14) and an ESP (15); copying the layout keeps block offsets
# comparable with images operators really use.
GPT_ROOT_START_SECTOR = 262144
GPT_ROOT_PARTITION = 1
GPT_BIOS_BOOT = (14, 2048, 8191)
GPT_ESP = (15, 8192, GPT_ROOT_START_SECTOR - 1)
# The "gpt-bootsplit" layout puts a separate /boot (partition 2, 128 MiB,
# room for two kernels and initrds) where the root starts in "gpt", and the
# root right after it, as Debian's installer and the RHEL family lay out a
# separate /boot.
BOOT_PARTITION = 2
BOOT_SECTORS = 128 * 1024 * 1024 // 512
BOOT_LABEL = "boot"
# The "gpt-lvm" layout: the root partition is an LVM physical volume holding
# volume group vg0 with one linear logical volume "root" (what Debian's
# installer makes with "guided - use entire disk and set up LVM", minus swap).
LVM_VG, LVM_LV = "vg0", "root"
LVM_ROOT_BYTES = 1536 * 1024 * 1024
# The "mbr" layout, as Debian's installer partitions a BIOS machine's disk
# ("guided - use entire disk", fdisk -l of a fresh install): an MBR (msdos)
# label, the root in primary partition 1 (bootable) from sector 2048 to a
# MiB boundary, then a gap, extended partition 2 starting two sectors before
# its one logical partition 5 (its EBR is the extended partition's first
# sector), which holds swap up to the end of the disk.
MBR_ROOT_START_SECTOR = 2048
MBR_ROOT_PARTITION = 1
MBR_EXTENDED_PARTITION = 2
MBR_SWAP_PARTITION = 5
MBR_SWAP_SECTORS = 128 * 1024 * 1024 // 512
# The "gpt-efi" layout: a UEFI machine's disk as Debian's installer lays it
# out with a separate /boot and /var ("guided - use entire disk", then /boot
# and /var as partitions of their own): the EFI system partition (FAT32,
# mounted at /boot/efi), /boot, the root, /var, in that order from sector
# 2048, each on a MiB boundary; the root takes what the others leave.  The
# variant's "filesystems" gives them in disk order, the root as "/".
EFI_FIRST_SECTOR = 2048
MIB_SECTORS = 1024 * 1024 // 512
GPT_TYPE = {"vfat": "ef00", "ext2": "8300", "ext3": "8300", "ext4": "8300"}
# The backup GPT at the end of the disk: 32 sectors of entries plus the header.
GPT_BACKUP_SECTORS = 33

QCOW2_CLUSTER_SIZE = 65536
HOSTNAME = "pageshare-golden"
FS_LABEL = "root"

_SOURCES = debian.sources(["bookworm"])
_TRIXIE_SOURCES = debian.sources(["trixie"])
_BOOT_PACKAGES = ["linux-image-cloud-amd64", "systemd-sysv", "udev", "kmod", "initramfs-tools"]

VARIANTS: dict[str, dict[str, object]] = {
    "demo": {
        "suite": "bookworm",
        "sources": _SOURCES,
        # "important" is what debootstrap and the installer give a plain
        # server (ifupdown, cron, logrotate, vim-tiny, ...), so the demo
        # guests carry the usual background daemons and libraries.
        "mmdebstrap_variant": "important",
        "packages": [*_BOOT_PACKAGES, "openssh-server", "nginx", "python3", "dbus"],
        "layout": "gpt",
        "virtual_size": 3 * GIB,
        "fs_uuid": "15bd0f73-494c-405f-90b0-e639164e0f52",
        "disk_guid": "dd41a87d-3f86-49cb-acfa-f136dcb3f4b0",
        "partition_guids": {
            "1": "21fbc2c0-54ca-4dc7-a341-aba7d1073ff6",
            "14": "d8737d59-35f2-41c7-9b07-9ff94762ab6c",
            "15": "e3ae3e4c-7fde-4180-8293-3dbfbf5018fb",
        },
        "hostname": HOSTNAME,
    },
    "small": {
        "suite": "bookworm",
        "sources": _SOURCES,
        "mmdebstrap_variant": "required",
        "packages": list(_BOOT_PACKAGES),
        "layout": "whole-disk",
        "virtual_size": 2 * GIB,
        "fs_uuid": "059a5ac6-84ce-4b8f-88bf-106cefac840b",
        "disk_guid": None,
        "partition_guids": {},
        "hostname": HOSTNAME,
    },
    # Debian 13 with its 6.12 kernel: the guest kernel the analyzer's
    # introspection must also handle (crash 8.0.x cannot open 6.12 dumps).
    # The package set is small's, the layout demo's, so both the partition
    # offset and the newer kernel are exercised by one image.
    "trixie": {
        "suite": "trixie",
        "sources": _TRIXIE_SOURCES,
        "mmdebstrap_variant": "required",
        "packages": list(_BOOT_PACKAGES),
        "layout": "gpt",
        "virtual_size": 2 * GIB,
        "fs_uuid": "6a1f3e52-0c4b-4d8e-9b57-2f8d4c0e7a13",
        "disk_guid": "b3c9d2e4-7f10-4a5b-8c6d-1e2f3a4b5c6d",
        "partition_guids": {
            "1": "c4d5e6f7-0819-4a2b-bc3d-4e5f60718293",
            "14": "a1b2c3d4-e5f6-4708-9a1b-2c3d4e5f6071",
            "15": "f0e1d2c3-b4a5-4697-8879-6a5b4c3d2e1f",
        },
        "hostname": HOSTNAME,
    },
    # small's packages with /boot on a partition of its own: the
    # kernel and initrd are not on the root file system, and the page cache
    # of /boot files maps to another partition's offset.
    "bootsplit": {
        "suite": "bookworm",
        "sources": _SOURCES,
        "mmdebstrap_variant": "required",
        "packages": list(_BOOT_PACKAGES),
        "layout": "gpt-bootsplit",
        "virtual_size": 2 * GIB,
        "fs_uuid": "8e0f5a2c-3b71-4c95-a6d4-0d2b9e7c1f38",
        "boot_fs_uuid": "2d6c9b1e-5f48-4a07-93e2-b8c1f4a6d750",
        "disk_guid": "7a3e1c59-d2b4-4f86-8e0a-65c9b3d1f274",
        "partition_guids": {
            "1": "e94b2d07-1c6a-4f3e-b5d8-2a7f0c9e6b41",
            "2": "5c1d8e3a-97f2-4b60-a4c7-e0b6d2f9a385",
            "14": "b7f2a6c1-0e94-4d3b-8a57-c1e9f4d2b068",
            "15": "0d9e4b7a-6c21-4f58-b3a0-9f7e2c5d1a64",
        },
        "hostname": HOSTNAME,
    },
    # small's packages, plus lvm2 for the initrd to activate the volume group,
    # with the root on an LVM logical volume: its blocks are at the
    # LV's extents on the PV partition.
    "lvm": {
        "suite": "bookworm",
        "sources": _SOURCES,
        "mmdebstrap_variant": "required",
        "packages": [*_BOOT_PACKAGES, "lvm2"],
        "layout": "gpt-lvm",
        "virtual_size": 2 * GIB,
        "fs_uuid": "c1a7e4d2-6b39-4f08-9e5a-3d2c8b7f1e64",
        "disk_guid": "4f8b2e6d-1a93-4c57-b0e2-7d6a9c3f5b18",
        "partition_guids": {
            "1": "9b3e7d1c-4a26-4f85-8c0b-e6d2a5f7b394",
            "14": "3c6f9a2e-8d14-4b7a-95e3-1f0c7b4d2a86",
            "15": "d5a2c8f1-7e39-4b06-a4d1-6c9e2b8f3a57",
        },
        "hostname": HOSTNAME,
    },
    # small with 1 KiB ext4 blocks: a page is four blocks, listed
    # only where they are contiguous and the first is 4 KiB-aligned on the disk.
    "small1k": {
        "suite": "bookworm",
        "sources": _SOURCES,
        "mmdebstrap_variant": "required",
        "packages": list(_BOOT_PACKAGES),
        "layout": "whole-disk",
        "fs_block": 1024,
        "virtual_size": 2 * GIB,
        "fs_uuid": "5b8e2f1a-c734-4d96-a0e5-7f3c9d1b6a28",
        "disk_guid": None,
        "partition_guids": {},
        "hostname": HOSTNAME,
    },
    # small's packages (plus xfsprogs, for fsck.xfs in the initrd) on the
    # trixie/demo GPT layout with an XFS root.
    "xfs": {
        "suite": "bookworm",
        "sources": _SOURCES,
        "mmdebstrap_variant": "required",
        "packages": [*_BOOT_PACKAGES, "xfsprogs"],
        "layout": "gpt",
        "root_fstype": "xfs",
        "virtual_size": 2 * GIB,
        "fs_uuid": "e3b5a1c7-2d94-4f60-8b1e-9c7d4a2f6e35",
        "disk_guid": "1d7c4e9a-b253-4f18-a6e0-3f9b2c5d8a71",
        "partition_guids": {
            "1": "7e2a9d4c-51b8-4c3f-9d06-b4e1a8c2f573",
            "14": "a8d3f6b1-29c4-4e75-b1a9-5c0e7d3b9f26",
            "15": "62c9e1f4-8a37-4d5b-a2c8-e9f1b6d4a037",
        },
        "hostname": HOSTNAME,
    },
    # small's packages (plus btrfs-progs, which puts `btrfs device scan` in
    # the initrd) on the GPT layout with a btrfs root, laid out as
    # Debian's installer does it: the root is subvolume @rootfs of a
    # single-device btrfs, mounted by /etc/fstab with subvol=@rootfs (the
    # boot loader adds rootflags=subvol=@rootfs; the analyzer does the same).
    # Data is stored uncompressed, except the files of "compressed_files",
    # rewritten through a compress-force mount, so that the analysis meets
    # compressed extents (which no disk block can serve) in a file guests read.
    "btrfs": {
        "suite": "bookworm",
        "sources": _SOURCES,
        "mmdebstrap_variant": "required",
        "packages": [*_BOOT_PACKAGES, "btrfs-progs"],
        "layout": "gpt",
        "root_fstype": "btrfs",
        "root_subvol": "@rootfs",
        "compressed_files": ["/usr/share/common-licenses/GPL-3"],
        "virtual_size": 2 * GIB,
        "fs_uuid": "9c4e2a71-d58b-4f36-a0e9-3b7d1c6f8e25",
        "disk_guid": "e6b1d3f8-2a49-4c75-9d0e-8f4a7c2b5e13",
        "partition_guids": {
            "1": "4a9d7e2c-83f1-4b06-b5c8-d1e6f3a9c720",
            "14": "b2e8c4f6-1d37-4a95-8c0b-7e3f9d5a1b64",
            "15": "71f5a3d9-c6e2-4b18-a47d-2c9e8b0f6d35",
        },
        "hostname": HOSTNAME,
    },
    # small's packages on an MBR (msdos) disk laid out as Debian's installer
    # does on a BIOS machine: the root in primary partition 1 at
    # sector 2048, swap (in /etc/fstab, so guests turn it on) in logical
    # partition 5 of extended partition 2.  "disk_guid" is the MBR's 32-bit
    # disk identifier (sfdisk's label-id; PARTUUIDs are made from it).
    "mbr": {
        "suite": "bookworm",
        "sources": _SOURCES,
        "mmdebstrap_variant": "required",
        "packages": list(_BOOT_PACKAGES),
        "layout": "mbr",
        "virtual_size": 2 * GIB,
        "fs_uuid": "4d739461-dbcd-4c52-b98c-314c84ba43e0",
        "swap_uuid": "3cd458a9-702c-4792-b5be-2caa5d614ebd",
        "disk_guid": "0x5a3c9e17",
        "partition_guids": {},
        "hostname": HOSTNAME,
    },
    # Debian 13 on a UEFI machine's disk, as an operator's
    # installer-made golden image has it: GPT, a FAT32 EFI system partition
    # at /boot/efi holding GRUB (EFI/debian/grubx64.efi and the removable
    # path EFI/BOOT/BOOTX64.EFI, made by the image's own grub-mkimage), a
    # separate /boot with GRUB's grub.cfg and modules, the root, and /var on
    # a partition of its own.  /boot is ext2 and /var ext3, as images that
    # have been carried forward for years still have: their files use
    # indirect block maps, not extents.  It boots with OVMF and GRUB, and the
    # analyzer finds its kernel through grub.cfg on /boot.
    "efi": {
        "suite": "trixie",
        "sources": _TRIXIE_SOURCES,
        "mmdebstrap_variant": "required",
        "packages": [*_BOOT_PACKAGES, "grub-efi-amd64-bin", "dosfstools"],
        "layout": "gpt-efi",
        "virtual_size": 2 * GIB,
        "fs_uuid": "b8d4f2a6-3c71-4e95-8a0d-6f1e9c2b7d43",
        "filesystems": [
            {"mountpoint": "/boot/efi", "fstype": "vfat", "uuid": "5A1C-3E97", "mib": 64},
            {
                "mountpoint": "/boot",
                "fstype": "ext2",
                "uuid": "f3a9c1e5-7d28-4b64-9e0a-2c5b8d1f6a79",
                "mib": 192,
            },
            {"mountpoint": "/", "fstype": "ext4"},
            {
                "mountpoint": "/var",
                "fstype": "ext3",
                "uuid": "6e2b9d4f-1a85-4c37-b0e6-d9f3a7c2e518",
                "mib": 256,
            },
        ],
        "disk_guid": "2f7c9e4b-d6a1-4853-b9e2-0c4a8f1d5e36",
        "partition_guids": {
            "1": "0b6e3f9a-2d74-4c1e-a8b5-97f4d2c6e830",
            "2": "8d3b6f1e-4a29-4c57-a0e8-5b2d9f7c1e46",
            "3": "4e9a2c7d-b158-4f03-8d6e-a1c3f5b9e027",
            "4": "a7f1d3b9-62e4-4c8a-95d0-3e8b1c6f4a52",
        },
        "hostname": HOSTNAME,
    },
}

# Peak use is the unpacked root tree plus the filesystem image plus the qcow2.
_MIN_FREE_BYTES = 4 * GIB
_HEARTBEAT_SECONDS = 60

Log = Callable[[str], None]


def _log_stderr(message: str) -> None:
    print(f"[golden] {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class GoldenImage:
    variant: str
    path: Path
    manifest: dict[str, Any]


@dataclass(frozen=True)
class _Spec:
    suite: str
    sources: list[str]
    mmdebstrap_variant: str
    packages: list[str]
    layout: str
    virtual_size: int
    fs_uuid: str
    disk_guid: str | None
    partition_guids: dict[str, str]
    hostname: str
    boot_fs_uuid: str | None = None  # a separate /boot file system (gpt-bootsplit)
    root_fstype: str = "ext4"
    fs_block: int = FS_BLOCK  # the root ext4's block size
    root_subvol: str = ""  # a btrfs root: the subvolume / is mounted from
    compressed_files: tuple[str, ...] = ()  # a btrfs root: files stored compressed
    swap_uuid: str | None = None  # a swap partition ("mbr": logical partition 5)
    # "gpt-efi": the file systems in disk order, the root among them as "/".
    filesystems: tuple[OtherFs, ...] = ()


@dataclass(frozen=True)
class OtherFs:
    """A file system of a "gpt-efi" image besides the root, on a partition of its own."""

    mountpoint: str
    fstype: str  # vfat, ext2, ext3 or ext4 ("ext4" for the root)
    uuid: str  # vfat: its volume id, as blkid and fstab give it
    mib: int  # partition size; 0 for the root (the rest)


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


# --- spec and key ---------------------------------------------------------


def _variant_dict(variant: str) -> dict[str, object]:
    try:
        return VARIANTS[variant]
    except KeyError:
        raise UserError(
            f"unknown golden image variant {variant!r}",
            f"choose one of: {', '.join(sorted(VARIANTS))}",
        ) from None


def _field(d: dict[str, object], name: str, kind: type) -> Any:
    value = d[name]
    if not isinstance(value, kind):
        raise TypeError(f"variant field {name!r} must be {kind.__name__}, not {value!r}")
    return value


def _spec(variant: str) -> _Spec:
    d = _variant_dict(variant)
    disk_guid = d["disk_guid"]
    if disk_guid is not None and not isinstance(disk_guid, str):
        raise TypeError("variant field 'disk_guid' must be str or None")
    # Optional, so that the older variants' specs (and so their cache keys) stay as they were.
    boot_fs_uuid = d.get("boot_fs_uuid")
    if boot_fs_uuid is not None and not isinstance(boot_fs_uuid, str):
        raise TypeError("variant field 'boot_fs_uuid' must be str or None")
    fs_block = d.get("fs_block", FS_BLOCK)
    if fs_block not in (1024, 2048, 4096):
        raise TypeError("variant field 'fs_block' must be 1024, 2048 or 4096")
    root_fstype = d.get("root_fstype", "ext4")
    if root_fstype not in ("ext4", "xfs", "btrfs"):
        raise TypeError("variant field 'root_fstype' must be ext4, xfs or btrfs")
    root_subvol = d.get("root_subvol", "")
    compressed = d.get("compressed_files", [])
    if not isinstance(root_subvol, str) or not isinstance(compressed, list):
        raise TypeError("variant fields 'root_subvol' (str) and 'compressed_files' (list)")
    if (root_subvol or compressed) and root_fstype != "btrfs":
        raise TypeError("'root_subvol' and 'compressed_files' need a btrfs root")
    swap_uuid = d.get("swap_uuid")
    if swap_uuid is not None and (not isinstance(swap_uuid, str) or d["layout"] != "mbr"):
        raise TypeError("variant field 'swap_uuid' must be a str, on the mbr layout")
    filesystems = tuple(
        OtherFs(
            str(f["mountpoint"]), str(f["fstype"]), str(f.get("uuid", "")), int(f.get("mib", 0))
        )
        for f in d.get("filesystems", [])  # type: ignore[attr-defined]
    )
    if (d["layout"] == "gpt-efi") != bool(filesystems) or (
        filesystems
        and (
            [f.mountpoint for f in filesystems].count("/") != 1
            or any(
                f.fstype not in GPT_TYPE or (f.mountpoint != "/") != bool(f.mib and f.uuid)
                for f in filesystems
            )
        )
    ):
        raise TypeError(
            "a gpt-efi variant lists its file systems (vfat or ext2/3/4, each "
            "with uuid and mib) in disk order, the root once as '/'"
        )
    if d["layout"] == "mbr" and not (
        isinstance(disk_guid, str) and re.fullmatch(r"0x[0-9a-f]{8}", disk_guid)
    ):
        raise TypeError("an mbr variant's 'disk_guid' is its disk identifier, 0x and 8 hex digits")
    return _Spec(
        suite=_field(d, "suite", str),
        sources=[str(s) for s in _field(d, "sources", list)],
        mmdebstrap_variant=_field(d, "mmdebstrap_variant", str),
        packages=[str(p) for p in _field(d, "packages", list)],
        layout=_field(d, "layout", str),
        virtual_size=_field(d, "virtual_size", int),
        fs_uuid=_field(d, "fs_uuid", str),
        disk_guid=disk_guid,
        partition_guids={str(k): str(v) for k, v in _field(d, "partition_guids", dict).items()},
        hostname=_field(d, "hostname", str),
        boot_fs_uuid=boot_fs_uuid,
        root_fstype=str(root_fstype),
        fs_block=int(fs_block),
        root_subvol=root_subvol,
        compressed_files=tuple(str(f) for f in compressed),
        swap_uuid=swap_uuid,
        filesystems=filesystems,
    )


def image_key(variant: str) -> str:
    """Hash of everything that decides the image's content, short and stable."""
    spec = _variant_dict(variant)
    return inputs_key({"builder_version": BUILDER_VERSION, "variant": variant, "spec": spec})


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


def _image_dir(variant: str) -> Path:
    return cache_dir("images") / f"{variant}-{image_key(variant)}"


# --- cache lookup ---------------------------------------------------------


def cached_image(variant: str) -> GoldenImage | None:
    """The finished image for this variant's current key, or None."""
    d = _image_dir(variant)
    qcow, manifest_path = d / "base.qcow2", d / "manifest.json"
    if not (qcow.is_file() and manifest_path.is_file()):
        return None
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("key") != image_key(variant):
        return None
    return GoldenImage(variant, qcow, manifest)


# --- host checks ----------------------------------------------------------


def _required_tools(spec: _Spec) -> dict[str, str]:
    tools = {"mmdebstrap": "mmdebstrap", "mkfs.ext4": "e2fsprogs", "qemu-img": "qemu-utils"}
    if spec.root_fstype == "xfs":
        tools["mkfs.xfs"] = "xfsprogs"
    if spec.root_fstype == "btrfs":
        tools["mkfs.btrfs"] = "btrfs-progs"
    if spec.layout == "gpt-efi":
        tools |= {"mkfs.vfat": "dosfstools", "mcopy": "mtools"}
    if spec.layout == "mbr":
        tools |= {"sfdisk": "fdisk", "mkswap": "util-linux"}
    elif spec.layout != "whole-disk":
        tools["sgdisk"] = "gdisk"
    return tools


def _preflight(spec: _Spec, where: Path) -> None:
    if os.geteuid() != 0:
        raise UserError(
            "building a golden image needs root",
            "run as root: mmdebstrap --mode=root chroots and creates device nodes",
        )
    missing = {t: p for t, p in _required_tools(spec).items() if shutil.which(t) is None}
    if missing:
        raise UserError(
            f"missing tools: {', '.join(sorted(missing))}",
            f"apt-get install -y {' '.join(sorted(set(missing.values())))}",
        )
    _check_free_space(where)


def _check_free_space(where: Path) -> None:
    free = shutil.disk_usage(where).free
    if free < _MIN_FREE_BYTES:
        raise _disk_full(where, free)


def _disk_full(where: Path, free: int | None = None) -> UserError:
    if free is None:
        free = shutil.disk_usage(where).free
    return UserError(
        f"not enough free space in {where}: {free / GIB:.1f} GiB free, "
        f"a build needs about {_MIN_FREE_BYTES // GIB} GiB",
        "free some space or set PAGESHARE_CACHE to a directory on a bigger filesystem",
    )


# --- running tools --------------------------------------------------------


@contextmanager
def _step(log: Log, what: str) -> Iterator[None]:
    start = time.monotonic()
    log(f"{what}...")
    yield
    log(f"{what}: done in {time.monotonic() - start:.0f} s")


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(
            f"{' '.join(cmd)} failed with exit code {proc.returncode}:\n{proc.stderr.strip()}"
        )


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _run_logged(cmd: list[str], logfile: Path, log: Log) -> int:
    """Run a long command with its output in logfile, saying now and then that it lives."""
    start = time.monotonic()
    with logfile.open("wb") as out:
        # Its own session, so that on interrupt the whole tree (mmdebstrap's
        # worker and the apt/dpkg inside the chroot) can be stopped: signalling
        # only the main mmdebstrap process leaves it waiting for the worker.
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            while True:
                try:
                    return proc.wait(timeout=_HEARTBEAT_SECONDS)
                except subprocess.TimeoutExpired:
                    log(f"  ... still running ({time.monotonic() - start:.0f} s)")
        except BaseException:
            _stop_group(proc)
            raise


def _stop_group(proc: subprocess.Popen[bytes]) -> None:
    # TERM first so mmdebstrap can undo its own mounts before our cleanup;
    # KILL afterwards for whatever in the group outlived it.
    with suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=60)
    with suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


# --- build steps ----------------------------------------------------------


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


def _make_ext4(
    rootdir: Path,
    fs_image: Path,
    fs_bytes: int,
    fs_uuid: str,
    label: str = FS_LABEL,
    block: int = FS_BLOCK,
    fstype: str = "ext4",
) -> None:
    """An ext4 (or, by fstype, ext2 or ext3: indirect block maps) file system
    image holding the tree."""
    with fs_image.open("wb") as f:
        f.truncate(fs_bytes)
    # Zeroing inode tables and journal now is free on a sparse file, and it
    # spares every clone the ext4lazyinit writes after its first mount.
    extended = f"hash_seed={fs_uuid},lazy_itable_init=0,lazy_journal_init=0"
    _run(
        [f"mkfs.{fstype}", "-q", "-F", "-b", str(block), "-L", label, "-U", fs_uuid,
         "-E", extended, "-d", str(rootdir), str(fs_image)]
    )  # fmt: skip


def _make_vfat(tree: Path, fs_image: Path, fs_bytes: int, volume_id: str, label: str) -> None:
    """A FAT32 file system image (an EFI system partition) holding the tree.
    mkfs.vfat and mtools' mcopy work on the file: nothing is mounted, and
    the host needs no vfat driver."""
    with fs_image.open("wb") as f:
        f.truncate(fs_bytes)
    _run(
        [
            "mkfs.vfat",
            "-F",
            "32",
            "-s",
            "1",
            "-i",
            volume_id.replace("-", ""),
            "-n",
            label,
            str(fs_image),
        ]
    )
    entries = sorted(str(e) for e in tree.iterdir())
    if entries:
        _run(["mcopy", "-s", "-p", "-m", "-i", str(fs_image), *entries, "::/"])


# GRUB as Debian's grub-install puts it on a UEFI machine, made with the
# image's own grub-mkimage: a core image whose early configuration (Debian's
# EFI/debian/grub.cfg) finds /boot by its UUID and reads grub.cfg there, the
# modules in /boot/grub/x86_64-efi, and grub.cfg as update-grub writes it
# for a separate /boot (paths relative to /boot, `search --fs-uuid` of /boot).
# No shim: the image boots without Secure Boot.
_GRUB_MODULES = (
    "part_gpt",
    "part_msdos",
    "fat",
    "ext2",
    "search",
    "search_fs_uuid",
    "configfile",
    "normal",
    "linux",
    "echo",
    "test",
    "gzio",
    "serial",
    "terminal",
    "all_video",
    "efi_gop",
    "boot",
)


def _early_grub_cfg(boot_uuid: str) -> str:
    return (
        f"search.fs_uuid {boot_uuid} root\nset prefix=($root)'/grub'\nconfigfile $prefix/grub.cfg\n"
    )


def _grub_entry(boot_uuid: str, root_uuid: str, kernel: str, args: str, indent: str) -> str:
    lines = [
        "load_video",
        "insmod gzio",
        "insmod part_gpt",
        "insmod ext2",
        f"search --no-floppy --fs-uuid --set=root {boot_uuid}",
        f"echo\t'Loading Linux {kernel} ...'",
        f"linux\t/vmlinuz-{kernel} root=UUID={root_uuid} ro {args}",
        "echo\t'Loading initial ramdisk ...'",
        f"initrd\t/initrd.img-{kernel}",
    ]
    return "".join(f"{indent}\t{line}\n" for line in lines)


def _grub_cfg(root_uuid: str, boot_uuid: str, kernel: str) -> str:
    """grub.cfg of Debian 13's update-grub for this layout (00_header, 10_linux;
    GRUB_TERMINAL="console serial" and the serial console cloud images use)."""
    args = "console=tty0 console=ttyS0,115200"
    classes = "--class debian --class gnu-linux --class gnu --class os $menuentry_id_option"
    return (
        "#\n# DO NOT EDIT THIS FILE\n#\n# It is automatically generated by grub-mkconfig "
        "using templates\n# from /etc/grub.d and settings from /etc/default/grub\n#\n\n"
        "### BEGIN /etc/grub.d/00_header ###\n"
        "if [ -s $prefix/grubenv ]; then\n  load_env\nfi\n"
        'set default="0"\n'
        'if [ x"${feature_menuentry_id}" = xy ]; then\n  menuentry_id_option="--id"\n'
        'else\n  menuentry_id_option=""\nfi\nexport menuentry_id_option\n'
        "function load_video {\n  insmod all_video\n}\n"
        "serial --unit=0 --speed=115200 --word=8 --parity=no --stop=1\n"
        "terminal_input console serial\nterminal_output console serial\n"
        "set timeout=1\n### END /etc/grub.d/00_header ###\n\n"
        "### BEGIN /etc/grub.d/10_linux ###\n"
        f"menuentry 'Debian GNU/Linux' {classes} 'gnulinux-simple-{root_uuid}' {{\n"
        + _grub_entry(boot_uuid, root_uuid, kernel, args, "")
        + "}\n"
        f"submenu 'Advanced options for Debian GNU/Linux' $menuentry_id_option "
        f"'gnulinux-advanced-{root_uuid}' {{\n"
        f"\tmenuentry 'Debian GNU/Linux, with Linux {kernel} (recovery mode)' {classes} "
        f"'gnulinux-{kernel}-recovery-{root_uuid}' {{\n"
        + _grub_entry(boot_uuid, root_uuid, kernel, "single " + args, "\t")
        + "\t}\n}\n### END /etc/grub.d/10_linux ###\n"
    )


def _install_grub_efi(rootdir: Path, spec: _Spec, kernel: str) -> None:
    boot_uuid = next(f.uuid for f in spec.filesystems if f.mountpoint == "/boot")
    early = _early_grub_cfg(boot_uuid)
    _write(rootdir / "boot/efi/EFI/debian/grub.cfg", early)
    _write(rootdir / "tmp/grub-early.cfg", early)
    try:
        _run(
            [
                "chroot",
                str(rootdir),
                "grub-mkimage",
                "-O",
                "x86_64-efi",
                "-o",
                "/boot/efi/EFI/debian/grubx64.efi",
                "-c",
                "/tmp/grub-early.cfg",
                "-p",
                "/grub",
                *_GRUB_MODULES,
            ]
        )
    finally:
        (rootdir / "tmp/grub-early.cfg").unlink()
    # The removable-media path, which firmware boots with no boot entry in NVRAM.
    (rootdir / "boot/efi/EFI/BOOT").mkdir()
    shutil.copyfile(
        rootdir / "boot/efi/EFI/debian/grubx64.efi", rootdir / "boot/efi/EFI/BOOT/BOOTX64.EFI"
    )
    modules = rootdir / "boot/grub/x86_64-efi"
    modules.mkdir(parents=True, exist_ok=True)
    for m in (rootdir / "usr/lib/grub/x86_64-efi").iterdir():
        if m.suffix in (".mod", ".lst"):
            shutil.copyfile(m, modules / m.name)
    _write(rootdir / "boot/grub/grub.cfg", _grub_cfg(spec.fs_uuid, boot_uuid, kernel))


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
    import guestfs  # Debian's python3-guestfs, as image_inspect uses it

    part = f"/dev/sda{GPT_ROOT_PARTITION}"
    g = guestfs.GuestFS(python_return_dict=True)
    try:
        g.set_backend_settings(["force_tcg"])
        g.add_drive_opts(str(disk), format="raw", readonly=0)
        g.launch()
        g.pvcreate(part)
        g.vgcreate(LVM_VG, [part])
        g.lvcreate(LVM_LV, LVM_VG, geom.fs_bytes // (1024 * 1024))
        g.shutdown()
    finally:
        g.close()
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


def _make_xfs(tree: Path, fs_image: Path, fs_bytes: int, fs_uuid: str) -> None:
    """An XFS file system image (the spec's UUID, label root) holding the root
    tree's tar.  mkfs.xfs runs on the host; the tar is unpacked by the
    libguestfs appliance, which mounts the image (nothing is mounted on the
    host)."""
    import guestfs  # Debian's python3-guestfs, as image_inspect uses it

    with fs_image.open("wb") as f:
        f.truncate(fs_bytes)
    _run(
        [
            "mkfs.xfs",
            "-q",
            "-f",
            "-b",
            f"size={FS_BLOCK}",
            "-L",
            FS_LABEL,
            "-m",
            f"uuid={fs_uuid}",
            str(fs_image),
        ]
    )
    g = guestfs.GuestFS(python_return_dict=True)
    try:
        g.set_backend_settings(["force_tcg"])
        g.add_drive_opts(str(fs_image), format="raw", readonly=0)
        g.launch()
        g.mount("/dev/sda", "/")
        g.tar_in(str(tree), "/", xattrs=True, acls=True)
        g.umount_all()
        g.shutdown()
    finally:
        g.close()


def _make_btrfs(
    tree: Path,
    fs_image: Path,
    fs_bytes: int,
    fs_uuid: str,
    subvol: str,
    compressed: tuple[str, ...],
) -> None:
    """A single-device btrfs image (the spec's UUID, label root; mkfs' defaults:
    SINGLE data, DUP metadata, 4 KiB sectors) holding the root tree's tar in
    subvolume subvol (the top level if ""), written uncompressed by the
    libguestfs appliance's kernel; then the files of compressed are rewritten
    in place through a compress-force mount, so their extents are compressed.
    mkfs.btrfs runs on the host; nothing is mounted on the host."""
    import guestfs  # Debian's python3-guestfs, as image_inspect uses it

    with fs_image.open("wb") as f:
        f.truncate(fs_bytes)
    _run(
        [
            "mkfs.btrfs",
            "-q",
            "-f",
            "-s",
            str(FS_BLOCK),
            "-L",
            FS_LABEL,
            "-U",
            fs_uuid,
            str(fs_image),
        ]
    )
    top = f"/{subvol}" if subvol else "/"
    g = guestfs.GuestFS(python_return_dict=True)
    try:
        g.set_backend_settings(["force_tcg"])
        g.add_drive_opts(str(fs_image), format="raw", readonly=0)
        g.launch()
        g.mount("/dev/sda", "/")
        if subvol:
            g.btrfs_subvolume_create(top)
        g.tar_in(str(tree), top, xattrs=True, acls=True)
        g.umount_all()
        if compressed:
            g.mount_options("compress-force=zlib", "/dev/sda", "/")
            for path in compressed:
                inside = top.rstrip("/") + path
                # Rewritten in place (same inode, owner and mode): the new
                # extents are compressed.  A copy could reflink the old ones.
                g.write(inside, g.read_file(inside))
            g.umount_all()
        g.shutdown()
    finally:
        g.close()


def _to_qcow2(raw: Path, qcow: Path) -> None:
    # Uncompressed on purpose: the page server reads clusters directly.
    _run(
        ["qemu-img", "convert", "-f", "raw", "-O", "qcow2",
         "-o", f"cluster_size={QCOW2_CLUSTER_SIZE}", str(raw), str(qcow)]
    )  # fmt: skip


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


# --- cleanup and publication ---------------------------------------------


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


def _publish(out: Path, final: Path, work: Path, force: bool) -> Path:
    """Rename the finished directory into place; a rename is all-or-nothing."""
    if final.exists():
        if not force:
            return final  # another build finished first; its image is as good
        final.rename(work / "replaced")
    out.rename(final)
    return final


# --- the build ------------------------------------------------------------


def _manifest(
    variant: str, spec: _Spec, geom: Geometry, kernel: str, qcow: Path, seconds: float
) -> dict[str, Any]:
    return {
        "variant": variant,
        "key": image_key(variant),
        "builder_version": BUILDER_VERSION,
        "suite": spec.suite,
        "sources": spec.sources,
        "mmdebstrap_variant": spec.mmdebstrap_variant,
        "packages": spec.packages,
        "kernel_version": kernel,
        "layout": geom.layout,
        "root_partition": geom.root_partition,
        "root_start_sector": geom.root_start_sector,
        "root_fs_bytes": geom.fs_bytes,
        "fs_uuid": spec.fs_uuid,
        "root_fstype": spec.root_fstype,
        "root_subvol": spec.root_subvol,
        "boot_partition": geom.boot_partition,
        "boot_start_sector": geom.boot_start_sector,
        "boot_fs_uuid": spec.boot_fs_uuid,
        **(
            {
                "filesystems": [
                    {
                        "mountpoint": p.mountpoint,
                        "partition": p.partition,
                        "start_sector": p.start_sector,
                        "end_sector": p.end_sector,
                    }
                    for p in geom.placed
                ]
            }
            if geom.placed
            else {}
        ),
        **(
            {
                "swap_partition": geom.swap_partition,
                "swap_start_sector": geom.swap_start_sector,
                "swap_uuid": spec.swap_uuid,
            }
            if spec.swap_uuid
            else {}
        ),
        "hostname": spec.hostname,
        "virtual_size": geom.virtual_size,
        "file_size": qcow.stat().st_size,
        "built_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "build_seconds": round(seconds, 1),
        "sha256": _sha256(qcow),
    }


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


# --- CLI ------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    lines = []
    for name in VARIANTS:
        spec = _spec(name)
        lines.append(
            f"  {name}: Debian {spec.suite} ({spec.mmdebstrap_variant}), {spec.layout}, "
            f"{spec.virtual_size // GIB} GiB, plus {' '.join(spec.packages)}"
        )
    variants = "\n".join(lines)
    return argparse.ArgumentParser(
        prog="python -m pageshare.golden",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Build the Debian golden images (plain qcow2) that analysed guests are cloned\n"
            "from, with mmdebstrap and mkfs.ext4 -d (needs root, no mounting).\n\n"
            f"Variants:\n{variants}\n\n"
            "Images are cached in $PAGESHARE_CACHE/images (default ~/.cache/pageshare/images)\n"
            "as <variant>-<key>/base.qcow2 + manifest.json, keyed by a hash of the variant's\n"
            "spec and the builder version; a cached image is reused unless --force.\n"
            "Prints the image path, or with --json one JSON object per image per line."
        ),
    )


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    parser.add_argument("--variant", choices=[*VARIANTS, "all"], default="demo")
    parser.add_argument("--force", action="store_true", help="rebuild even if cached")
    parser.add_argument("--json", action="store_true", help="print path and manifest as JSON")
    args = parser.parse_args(argv)
    names = list(VARIANTS) if args.variant == "all" else [args.variant]
    try:
        for name in names:
            image = build_image(name, force=args.force)
            if args.json:
                record = {"variant": name, "path": str(image.path), "manifest": image.manifest}
                print(json.dumps(record), flush=True)
            else:
                print(image.path, flush=True)
    except UserError as e:
        print_error(e.message, e.hint)
        return e.exit_code
    except KeyboardInterrupt:
        print("error: interrupted; temporary files were removed", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
