"""Which file systems of a golden image the analysis can map back to disk sectors.

The guest's page cache names a page by (file system UUID, partition start,
inode, index); a list entry names a 4 KiB block of the virtual disk.  For a
file system to be mapped, its block map must be readable offline (ext4
extents, through debugfs) and its blocks must be able to land on 4 KiB
boundaries of the virtual disk.  Every file system the image mounts from
/etc/fstab is looked at; the root must be mappable (without it nothing of
/usr is), any other one that is not is skipped with the reason, and the
analysis goes on with the rest.
"""

import re
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import UserError

PAGE_SECTORS = 8            # a 4 KiB page in 512-byte sectors
MAPPED_FSTYPES = ("ext4",)


@dataclass(frozen=True)
class MappedFs:
    """A file system whose file pages are mapped to virtual-disk sectors."""
    mountpoint: str
    device: str               # as libguestfs names it, e.g. /dev/sda2
    partition: int            # 0 = the whole disk
    start_sector: int         # of the partition on the virtual disk
    fstype: str
    uuid: str
    block_size: int
    features: str


@dataclass(frozen=True)
class SkippedFs:
    """A file system of the image that is not mapped, and why (said to the operator)."""
    mountpoint: str
    device: str
    fstype: str
    reason: str


_DISK_PART = re.compile(r"/dev/sda(\d*)")


def partition_number(device: str) -> int | None:
    """1.. for a partition of the image's disk, 0 for the whole disk, None for
    anything else (LVM, RAID, a second disk, an encrypted mapping)."""
    m = _DISK_PART.fullmatch(device)
    return int(m.group(1) or 0) if m else None


def unmappable_reason(fstype: str, features: str, partition: int | None, start_sector: int,
                      block_size: int) -> str:
    """Why a file system's pages cannot be listed, "" when they can."""
    if partition is None:
        return ("it is not on a partition of the disk or the whole disk (LVM, RAID, an "
                "encrypted volume or a second disk), which the mapping does not translate")
    if fstype not in ("ext2", "ext3", "ext4"):
        return f"{fstype or 'an unknown file system'} cannot be mapped (only ext4 is supported)"
    if "extent" not in features.split():
        return (f"{fstype} without the extent feature: its files use indirect block maps, "
                "which the mapping does not read (only ext4 is supported)")
    per_block = block_size // 512
    # A block starts at start + k * per_block; some k lands on a 4 KiB
    # boundary only if start is a multiple of gcd(per_block, 8).
    step = min(per_block, PAGE_SECTORS)
    if start_sector % step:
        return (f"the partition starts at sector {start_sector}, which is not a multiple of "
                f"{step}: none of its {block_size}-byte blocks is 4 KiB-aligned on the virtual "
                "disk, and the page server shares only aligned 4 KiB blocks")
    return ""


def realign_hint(device: str) -> str:
    return (f"realign {device} so that it starts on a 4 KiB boundary (a multiple of 8 "
            "sectors; tools today use sector 2048), e.g. with `virt-resize --align-first "
            "always` into a new image, or recreate the partition there and copy the file "
            "system over; then analyze the realigned image")


def root_must_map(image: Path, root: MappedFs | SkippedFs) -> MappedFs:
    """The root file system holds /usr: an image whose root cannot be mapped is refused."""
    if isinstance(root, MappedFs):
        return root
    if "not a multiple of" in root.reason:
        raise UserError(f"{image}: root file system {root.device} cannot be analyzed: "
                        f"{root.reason}", realign_hint(root.device))
    if partition_number(root.device) is None:
        raise UserError(f"{image}: root file system is on {root.device} (LVM, RAID or a second "
                        "disk); not supported", "use an image with the root file system on a "
                        "partition or on the whole disk")
    raise UserError(f"{image}: root file system is {root.fstype} on {root.device}; only ext4 is "
                    f"supported ({root.reason})", "mapping page-cache pages back to disk "
                    "sectors is implemented for ext4 with extents (the Debian cloud images' "
                    "root); convert or rebuild the image with an ext4 root")


def survey(g: Any, mountpoints: dict[str, str]) -> tuple[list[MappedFs], list[SkippedFs]]:
    """Looks at every file system /etc/fstab mounts (mountpoint -> device), root first."""
    parts: dict[int, int] = {}
    with suppress(RuntimeError):      # no partition table: a file system on the whole disk
        parts = {int(p["part_num"]): int(p["part_start"]) // 512
                 for p in g.part_list("/dev/sda")}
    mapped: list[MappedFs] = []
    skipped: list[SkippedFs] = []
    for mp in sorted(mountpoints, key=lambda m: (m != "/", m)):
        dev = mountpoints[mp]
        try:
            fstype = g.vfs_type(dev)
        except RuntimeError:
            fstype = ""
        partno = partition_number(dev)
        start = parts.get(partno, 0) if partno else 0
        block_size, features = 0, ""
        if fstype in ("ext2", "ext3", "ext4"):
            tune = g.tune2fs_l(dev)
            block_size = int(tune.get("Block size", "4096"))
            features = tune.get("Filesystem features", "")
        why = unmappable_reason(fstype, features, partno, start, block_size)
        if why:
            skipped.append(SkippedFs(mp, dev, fstype, why))
        else:
            assert partno is not None
            mapped.append(MappedFs(mp, dev, partno, start, fstype, g.vfs_uuid(dev), block_size,
                                   features))
    return mapped, skipped


def mount_all(g: Any, mountpoints: dict[str, str]) -> None:
    """Mounts the image's file systems read-only, parents first, as the guest would.

    A file system that does not mount (swap, an ESP the appliance cannot
    read) is left out: only paths on it become unreadable.
    """
    for mp in sorted(mountpoints, key=lambda m: (m.count("/") if m != "/" else 0, m)):
        try:
            if mp != "/" and not g.is_dir(mp):
                continue
            g.mount_ro(mountpoints[mp], mp)
        except RuntimeError:
            if mp == "/":
                raise
