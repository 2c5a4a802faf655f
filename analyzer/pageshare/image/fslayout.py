"""Which file systems of a golden image the analysis can map back to disk sectors.

The guest's page cache names a page by (file system UUID, start sector of
its block device, inode, index); a list entry names a 4 KiB block of the
virtual disk.  For a file system to be mapped, its block map must be
readable offline (ext2/3/4 extents and block maps through debugfs, XFS extents through
xfs_db, btrfs extents through btrfs inspect-internal), its bytes must sit at
known places of the disk (a partition, the whole disk, or the extents of a
linear LVM logical volume, lvm.py; a btrfs on one device only), and its
blocks must be able to land on 4 KiB boundaries of the virtual disk.  Every
file system the image mounts from /etc/fstab is looked at; the root must be
mappable (without it nothing of /usr is), any other one that is not is
skipped with the reason, and the analysis goes on with the rest.

A btrfs mounted from a subvolume (fstab's subvol=, as Debian's installer
puts the root in @rootfs) is named by libguestfs "btrfsvol:/dev/sda1/@rootfs";
it is surveyed as the device, with the subvolume kept in MappedFs.subvol.

A file system on a linear MD array (mdadm --level=linear) is mapped like a
multi-segment LV: its members' data areas, in role order, are its runs
(linear_runs, from their version-1 superblocks).  On any other RAID level,
or on LVM whose physical volume is an array, it is not mapped: its blocks
are striped, mirrored or carry parity, and the mapping does not translate
them to the members' sectors.  It is skipped, or refused as the root, with
the array's level, metadata and members (MdArray, read in the appliance,
which assembles the arrays).
"""

import re
import struct
from contextlib import suppress
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..errors import UserError
from . import lvm

PAGE_SECTORS = 8  # a 4 KiB page in 512-byte sectors

# (file system sector, sectors, disk sector): a run of the file system's bytes
# on the virtual disk.  One run for a partition; one per LV segment.
Run = tuple[int, int, int]


@dataclass(frozen=True)
class MappedFs:
    """A file system whose file pages are mapped to virtual-disk sectors."""

    mountpoint: str
    device: str  # as libguestfs names it, e.g. /dev/sda2, /dev/vg0/root
    partition: int  # 0 = the whole disk; for an LV, the PV's partition
    start_sector: int  # where the file system starts on the virtual disk
    fstype: str
    uuid: str
    block_size: int
    features: str
    runs: tuple[Run, ...] = ()
    # start_sect as the guest's page cache reports the file system's block
    # device: the partition's start, 0 for a device-mapper volume.
    guest_start_sector: int = 0
    lv: str = ""  # "vg/lv" for a logical volume
    # btrfs: the subvolume mounted there (fstab's subvol=, path from the top
    # level), "" for the file system's default subvolume.
    subvol: str = ""
    md: str = ""  # a linear MD array: its device, e.g. /dev/md0


@dataclass(frozen=True)
class SkippedFs:
    """A file system of the image that is not mapped, and why (said to the operator)."""

    mountpoint: str
    device: str
    fstype: str
    reason: str


@dataclass(frozen=True)
class MdArray:
    """An MD (Linux software RAID) array of the image, as the appliance assembled it."""

    device: str  # as libguestfs names it, e.g. /dev/md0
    level: str  # mdadm's: raid0, raid1, raid5, linear, ...
    metadata: str  # superblock version: 1.2, 1.1, 1.0, 0.90
    members: tuple[str, ...]  # the image's devices in the array (spares too)
    data_offset: int | None  # sectors from each member's start to the array's data

    def describe(self) -> str:
        members = (
            " and ".join(self.members)
            if len(self.members) < 3
            else f"{', '.join(self.members[:-1])} and {self.members[-1]}"
        )
        offset = (
            ""
            if self.data_offset is None
            else ", data from the start of each member"
            if self.data_offset == 0
            else f", data {self.data_offset} sectors into each member"
        )
        return f"{self.level} over {members}, metadata {self.metadata}{offset}"

    def why(self) -> str:
        """What the level does to a file system's blocks, for the operator."""
        level = self.level.removeprefix("raid")
        if level == "1":
            return (
                "a mirror keeps a copy of every block in each member, and md reads each "
                "block from whichever member it picks"
            )
        if level == "linear":
            return "it runs through its members one after the other"
        parity = " and parity" if level in ("4", "5", "6") else ""
        copies = ", each in two copies" if level == "10" else ""
        return f"it stripes consecutive chunks{parity} of its data over the members{copies}"


_MD = re.compile(r"/dev/md(\d+|/.+)")
_MD_SB_MAGIC = b"\xfc\x4e\x2b\xa9"  # 0xa92b4efc, little-endian (md_p.h)
_DISK_PART = re.compile(r"/dev/sda(\d*)")
_LV = re.compile(r"/dev/([^/]+)/([^/]+)")  # libguestfs names LVs /dev/VG/LV
# libguestfs' name of a btrfs subvolume: btrfsvol:<device>/<subvolume path>.
_BTRFSVOL = re.compile(
    r"btrfsvol:(/dev/(?:[sv]d[a-z]+\d*|md\d+|mapper/[^/]+|[^/]+/[^/]+))"
    r"/(.*)"
)


def split_btrfsvol(mountable: str) -> tuple[str, str]:
    """(device, btrfs subvolume) of a libguestfs mountable; subvolume "" for a device."""
    m = _BTRFSVOL.fullmatch(mountable)
    return (m.group(1), m.group(2).strip("/")) if m else (mountable, "")


def partition_number(device: str) -> int | None:
    """1.. for a partition of the image's disk, 0 for the whole disk, None for
    anything else (LVM, RAID, a second disk, an encrypted mapping)."""
    m = _DISK_PART.fullmatch(device)
    return int(m.group(1) or 0) if m else None


def md_arrays(g: Any) -> dict[str, MdArray]:
    """The image's MD arrays, by every name libguestfs may give one (/dev/mdN,
    /dev/md/NAME); empty where there are none (or no mdadm in the appliance).

    mdadm names the members as the appliance's kernel does, which need not be
    the image's names (/dev/sdb2 for the image's /dev/sda2 when the
    appliance's own disk came first): the members are the image's devices
    whose blkid UUID is the array's."""
    out: dict[str, MdArray] = {}
    try:
        devices = g.list_md_devices()
    except RuntimeError:
        return out
    if not devices:
        return out
    known: list[str] = []
    with suppress(RuntimeError):
        known = [*g.list_devices(), *g.list_partitions()]
    for md in devices:
        try:
            detail = g.md_detail(md)
        except RuntimeError:
            continue
        uuid = detail.get("uuid", "").replace(":", "").lower()
        members = tuple(
            d for d in known if _md_member(g, d) and _vfs(g, d)[1].replace("-", "").lower() == uuid
        )
        if not members:  # as mdadm names them, in role order
            roles = sorted(
                (int(v), detail.get(k.removesuffix("_role") + "_dev", ""))
                for k, v in detail.items()
                if k.startswith("device_") and k.endswith("_role") and v.isdigit()
            )
            members = tuple(d for _, d in roles if d)
        metadata = detail.get("metadata", "?")
        array = MdArray(
            md,
            detail.get("level", "?"),
            metadata,
            members,
            _md_data_offset(g, metadata, members[0] if members else ""),
        )
        out[md] = array
        if detail.get("devname"):
            out[f"/dev/md/{detail['devname']}"] = array
    return out


def _md_data_offset(g: Any, metadata: str, member: str) -> int | None:
    """Sectors from a member's start to the array's data: 0 for the superblocks at
    the end (0.90, 1.0), else data_offset in the version-1 superblock (at 0
    for 1.1, 4 KiB for 1.2); None where unknown."""
    if metadata in ("0.90", "0.9", "1.0"):
        return 0
    at = _md_sb_offset(metadata, 0)  # 1.1 and 1.2: at a fixed offset
    if at is None or not member:
        return None
    try:
        sb = g.pread_device(member, 256, at)
    except RuntimeError:
        return None
    if sb[:4] != _MD_SB_MAGIC:
        return None
    offset: int = struct.unpack_from("<Q", sb, 128)[0]
    return offset


# struct mdp_superblock_1 (include/uapi/linux/raid/md_p.h): level (s32) at
# 72, chunksize at 88, data_offset and data_size (sectors) at 128 and 136,
# dev_number at 160, dev_roles[] (u16) from 256.
_MD_LEVEL_LINEAR = -1
_MD_ROLE_SPARE = 0xFFFE  # 0xfffe faulty, 0xffff spare: no data


def _md_sb_offset(metadata: str, member_sectors: int) -> int | None:
    """Byte offset of a member's version-1 superblock (md_p.h, mdadm's super1.c)."""
    if metadata == "1.0":
        return ((member_sectors - 16) & ~7) * 512
    return {"1.1": 0, "1.2": 4096}.get(metadata)


def linear_runs(
    g: Any, array: MdArray, parts: dict[int, tuple[int, int]]
) -> tuple[tuple[Run, ...], str]:
    """A linear array's data as runs on the virtual disk, from its members'
    superblocks, or ((), why not).

    md's linear level appends its members' data areas in role order; each
    member gives data_size sectors from data_offset (rounded down to the
    chunk size when there is one, as md-linear does).  The sum must be the
    size the appliance's kernel assembled, or nothing is mapped."""
    if array.metadata not in ("1.0", "1.1", "1.2"):
        return (), (f"its metadata {array.metadata} is not read here (version-1 superblocks are)")
    members: list[tuple[int, int, int]] = []  # role, data sectors, disk sector
    for dev in array.members:
        partno = partition_number(dev)
        if not partno or partno not in parts:
            return (), f"member {dev} is not a partition of the disk"
        start, sectors = parts[partno]
        at = _md_sb_offset(array.metadata, sectors)
        try:
            sb = g.pread_device(dev, 512, at) if at is not None else b""
        except RuntimeError as e:
            return (), f"member {dev}'s superblock could not be read: {e}"
        if len(sb) < 512 or sb[:4] != _MD_SB_MAGIC:
            return (), f"member {dev} has no version-1 superblock at byte {at}"
        (level,) = struct.unpack_from("<i", sb, 72)
        (chunk,) = struct.unpack_from("<I", sb, 88)
        data_offset, data_size = struct.unpack_from("<QQ", sb, 128)
        (dev_number,) = struct.unpack_from("<I", sb, 160)
        if level != _MD_LEVEL_LINEAR:
            return (), f"member {dev}'s superblock says level {level}, not linear"
        if 256 + 2 * dev_number + 2 > len(sb):
            return (), f"member {dev}'s role is beyond the first 512 bytes of its superblock"
        (role,) = struct.unpack_from("<H", sb, 256 + 2 * dev_number)
        if role >= _MD_ROLE_SPARE:
            continue
        if chunk:
            data_size -= data_size % chunk
        members.append((role, data_size, start + data_offset))
    members.sort()
    if [r for r, _, _ in members] != list(range(len(members))):
        return (), f"its members' roles {[r for r, _, _ in members]} leave a gap"
    runs, pos = [], 0
    for _, sectors, disk in members:
        runs.append((pos, sectors, disk))
        pos += sectors
    try:
        assembled = int(g.blockdev_getsz(array.device))
    except RuntimeError as e:
        return (), f"its size could not be read: {e}"
    if pos != assembled:
        return (), (
            f"its members' superblocks add up to {pos} sectors, but md assembled {assembled}"
        )
    return tuple(runs), ""


def md_reason(array: MdArray, what: str) -> str:
    """Why a file system on array (what: the array's role, e.g. "/dev/md0 is") is not mapped."""
    return (
        f"{what} an MD RAID array ({array.describe()}): {array.why()}, and the mapping "
        "does not translate a file system's blocks on an array to its members' sectors "
        "on the virtual disk, so none of its pages can be listed; to have it mapped, put "
        "it on a plain partition or a linear LV in the golden image"
    )


MD_HINT = (
    "RAID inside the one virtual disk of a golden image adds no redundancy (that is "
    "the host storage's job): rebuild the golden image with its root file system on a "
    "plain partition or a linear LVM volume, or move the root file system off the array "
    "(copy its files to a new partition, e.g. with virt-tar-out and virt-make-fs, point "
    "/etc/fstab at it and rebuild the initrd), then analyze the new image; file systems "
    "on MD RAID other than the root are skipped and the rest is mapped"
)


def canonical_btrfsvols(g: Any, mountpoints: dict[str, str]) -> dict[str, str]:
    """mountpoints with each btrfsvol's device named as the image's own devices are.

    Once (of many inspections, with a second appliance booting beside it)
    libguestfs named the root "btrfsvol:/dev/sdb1/@rootfs" on a one-disk
    image: its appliance's disk order, it seems, leaking into a subvolume's
    name where device names are otherwise translated.  Such a device is
    found again by the file system's UUID among the image's devices."""
    known: list[str] = []
    with suppress(RuntimeError):
        known = [*g.list_partitions(), *g.lvs(), *g.list_devices()]
    out = dict(mountpoints)
    for mp, mountable in mountpoints.items():
        dev, subvol = split_btrfsvol(mountable)
        if not subvol or not known or dev in known:
            continue
        with suppress(RuntimeError):
            uuid = g.vfs_uuid(mountable)
            same = [d for d in known if _vfs(g, d) == ("btrfs", uuid)]
            if same:
                out[mp] = f"btrfsvol:{same[0]}/{subvol}"
    return out


def _vfs(g: Any, dev: str) -> tuple[str, str]:
    try:
        return g.vfs_type(dev), g.vfs_uuid(dev)
    except RuntimeError:
        return "", ""


def unmappable_reason(
    fstype: str, features: str, partition: int | None, start_sector: int, block_size: int
) -> str:
    """Why a file system's pages cannot be listed, "" when they can."""
    if partition is None:
        return (
            "it is not on a partition of the disk or the whole disk (LVM, RAID, an "
            "encrypted volume or a second disk), which the mapping does not translate"
        )
    if fstype == "btrfs" and btrfs_reason(features):
        return btrfs_reason(features)
    if fstype not in ("ext2", "ext3", "ext4", "xfs", "btrfs"):
        return (
            f"{fstype or 'an unknown file system'} cannot be mapped (ext2, ext3, ext4, "
            "XFS and single-device btrfs can)"
        )
    if fstype == "xfs" and "realtime" in features.split():
        return (
            "XFS with a realtime section: its realtime files' blocks are on another "
            "device, which the mapping does not follow"
        )
    if block_size < 512:
        return f"its {fstype} superblock gives no block size"
    return alignment_reason(start_sector, block_size, "the partition starts")


def btrfs_reason(features: str) -> str:
    """Why a btrfs is not mapped, "" when it can be: its block map is read
    offline (btrfsmap.py) for a btrfs of one device, whose chunks (SINGLE or
    DUP) keep whole copies on it; a RAID profile inside one device is found
    only when its chunk tree is read, and refused then."""
    devices = next((int(f[8:]) for f in features.split() if f.startswith("devices=")), 1)
    if devices > 1:
        return (
            f"btrfs over {devices} devices (a multi-device or RAID pool): its extents "
            "may be on another device, and only a btrfs of one device (SINGLE or DUP "
            "profiles) is mapped"
        )
    return ""


def alignment_reason(start_sector: int, block_size: int, what: str) -> str:
    """Why blocks of a run that starts (file system block 0) at start_sector can
    never be 4 KiB-aligned on the disk, "" when they can."""
    per_block = block_size // 512
    # A block starts at start + k * per_block; some k lands on a 4 KiB
    # boundary only if start is a multiple of gcd(per_block, 8).
    step = min(per_block, PAGE_SECTORS)
    if start_sector % step:
        return (
            f"{what} at sector {start_sector}, which is not a multiple of "
            f"{step}: none of its {block_size}-byte blocks is 4 KiB-aligned on the virtual "
            "disk, and the page server shares only aligned 4 KiB blocks"
        )
    return ""


def realign_hint(device: str) -> str:
    return (
        f"realign {device} so that it starts on a 4 KiB boundary (a multiple of 8 "
        "sectors; tools today use sector 2048), e.g. with `virt-resize --align-first "
        "always` into a new image, or recreate the partition there and copy the file "
        "system over; then analyze the realigned image"
    )


def root_must_map(image: Path, root: MappedFs | SkippedFs) -> MappedFs:
    """The root file system holds /usr: an image whose root cannot be mapped is refused."""
    if isinstance(root, MappedFs):
        return root
    if "an MD RAID array (" in root.reason:
        raise UserError(
            f"{image}: root file system ({root.fstype or 'unknown'} on "
            f"{root.device}) cannot be analyzed: {root.reason.split('; to have')[0]}",
            MD_HINT,
        )
    if "not a multiple of" in root.reason:
        raise UserError(
            f"{image}: root file system {root.device} cannot be analyzed: {root.reason}",
            realign_hint(root.device),
        )
    if (
        _LV.fullmatch(root.device)
        and partition_number(root.device) is None
        and ("volume group" in root.reason or "linear" in root.reason)
    ):
        raise UserError(
            f"{image}: root file system on {root.device} cannot be mapped: {root.reason}",
            "only linear logical volumes on the image's own disk "
            "are mapped: convert the LV (lvconvert --type linear) or move the root "
            "to a linear LV or a partition in the golden image",
        )
    if partition_number(root.device) is None:
        raise UserError(
            f"{image}: root file system is on {root.device} (LVM, RAID or a second "
            "disk); not supported",
            "use an image with the root file system on a partition or on the whole disk",
        )
    if root.fstype == "btrfs":
        raise UserError(
            f"{image}: root file system is btrfs on {root.device}, which cannot be "
            f"analyzed: {root.reason.removeprefix('btrfs ')}",
            "analyze an image "
            "whose root btrfs lives on one device (convert the pool with `btrfs "
            "balance start -dconvert=single -mconvert=dup` and `btrfs device "
            "remove` down to one device), or with an ext4 or XFS root; btrfs file "
            "systems over several devices other than the root are skipped and the "
            "rest is mapped",
        )
    raise UserError(
        f"{image}: root file system is {root.fstype} on {root.device}; only "
        f"ext2/3/4, XFS and btrfs are supported ({root.reason})",
        "mapping "
        "page-cache pages back to disk sectors is implemented for ext2, ext3 and "
        "ext4, XFS and single-device btrfs, whose block maps can be read offline; "
        "convert or rebuild the image with such a root",
    )


# Where the file systems analyze-image maps say what they are: btrfs's
# superblock at 64 KiB with its magic at 0x40; XFS's at 0.
BTRFS_SUPER_OFFSET = 65536
BTRFS_MAGIC = b"_BHRfS_M"
XFS_MAGIC = b"XFSB"


def _fs_facts(g: Any, dev: str) -> tuple[str, int, str]:
    """(type, block size, features) of a device's file system."""
    try:
        fstype = g.vfs_type(dev)
    except RuntimeError:
        fstype = ""
    block_size, features = 0, ""
    if fstype in ("ext2", "ext3", "ext4"):
        tune = g.tune2fs_l(dev)
        block_size = int(tune.get("Block size", "4096"))
        features = tune.get("Filesystem features", "")
    elif fstype == "btrfs":
        # The superblock at 64 KiB: magic, num_devices, sectorsize.
        sb = g.pread_device(dev, 4096, BTRFS_SUPER_OFFSET)
        if sb[0x40:0x48] == BTRFS_MAGIC:
            (devices,) = struct.unpack_from("<Q", sb, 0x88)
            (block_size,) = struct.unpack_from("<I", sb, 0x90)
            features = f"devices={devices}"
    elif fstype == "xfs":
        # From the superblock itself: libguestfs' xfs_info needs its optional
        # xfs feature (Debian's libguestfs-xfs), which the appliance may lack.
        sb = g.pread_device(dev, 512, 0)
        if sb[:4] == XFS_MAGIC:
            (block_size,) = struct.unpack_from(">I", sb, 4)  # sb_blocksize
            (rblocks,) = struct.unpack_from(">Q", sb, 16)  # sb_rblocks
            features = "realtime" if rblocks else ""
    return fstype, block_size, features


def survey(
    g: Any, mountpoints: dict[str, str], disk_sectors: int
) -> tuple[list[MappedFs], list[SkippedFs]]:
    """Looks at every file system /etc/fstab mounts (mountpoint -> device), root first."""
    parts: dict[int, tuple[int, int]] = {}  # number -> (start, sectors)
    with suppress(RuntimeError):  # no partition table: a file system on the whole disk
        parts = {
            int(p["part_num"]): (int(p["part_start"]) // 512, int(p["part_size"]) // 512)
            for p in g.part_list("/dev/sda")
        }
    vgs: dict[str, lvm.VolumeGroup] | None = None
    arrays: dict[str, MdArray] | None = None
    mapped: list[MappedFs] = []
    skipped: list[SkippedFs] = []
    for mp in sorted(mountpoints, key=lambda m: (m != "/", m)):
        dev, subvol = split_btrfsvol(mountpoints[mp])
        fstype, block_size, features = _fs_facts(g, dev)
        partno = partition_number(dev)
        lv = _LV.fullmatch(dev) if partno is None else None
        if _MD.fullmatch(dev):
            arrays = md_arrays(g) if arrays is None else arrays
            if dev in arrays:
                fs, why = _linear_array(
                    mp, dev, arrays[dev], parts, g, fstype, block_size, features
                )
                if fs is None:
                    skipped.append(SkippedFs(mp, dev, fstype, why))
                else:
                    mapped.append(replace(fs, uuid=g.vfs_uuid(dev), subvol=subvol))
                continue
        if lv and lv.group(1) not in ("mapper", "md", "disk"):
            if vgs is None:
                # A PV inside an MD member (superblock at its end, data from its
                # start) shows a label there too; its VG is on the array, not here.
                vgs = lvm.volume_groups(
                    g, {n: s for n, (s, _) in parts.items() if not _md_member(g, f"/dev/sda{n}")}
                )
            fs, why = _logical_volume(
                mp, dev, lv.group(1), lv.group(2), vgs, fstype, block_size, features
            )
            if fs is None and lv.group(1) not in vgs:
                arrays = md_arrays(g) if arrays is None else arrays
                on_md = _md_physical_volume(g, lv.group(1), arrays)
                if on_md:
                    why = md_reason(
                        on_md, f"volume group {lv.group(1)}'s physical volume {on_md.device} is"
                    )
            if fs is None:
                skipped.append(SkippedFs(mp, dev, fstype, why))
            else:
                mapped.append(replace(fs, uuid=g.vfs_uuid(dev), subvol=subvol))
            continue
        start, size = parts.get(partno, (0, 0)) if partno else (0, disk_sectors)
        why = unmappable_reason(fstype, features, partno, start, block_size)
        if why:
            skipped.append(SkippedFs(mp, dev, fstype, why))
        else:
            assert partno is not None
            # The guest's page cache names a btrfs page's device by nothing
            # (btrfs leaves its super_block's s_bdev unset: it may span several
            # devices), so start_sect reads 0 there, as for an LV.
            guest_start = 0 if fstype == "btrfs" else start
            mapped.append(
                MappedFs(
                    mp,
                    dev,
                    partno,
                    start,
                    fstype,
                    g.vfs_uuid(dev),
                    block_size,
                    features,
                    ((0, size, start),),
                    guest_start,
                    subvol=subvol,
                )
            )
    return mapped, skipped


def _linear_array(
    mp: str,
    dev: str,
    array: MdArray,
    parts: dict[int, tuple[int, int]],
    g: Any,
    fstype: str,
    block_size: int,
    features: str,
) -> tuple[MappedFs | None, str]:
    """A file system on a linear MD array, mapped through its members; other
    levels, and a linear array whose layout cannot be read, are not."""
    if array.level != "linear":
        return None, md_reason(array, f"{dev} is")
    why = unmappable_reason(fstype, features, 0, 0, block_size)
    if why:
        return None, why
    runs, why = linear_runs(g, array, parts)
    if why:
        return None, f"{dev} is a linear MD array ({array.describe()}), but {why}"
    for fs_start, _, disk in runs:
        why = alignment_reason(
            disk - fs_start, block_size, f"a member of {dev} puts its file system start"
        )
        if why:
            return None, why
    first = partition_number(array.members[0]) or 0
    return MappedFs(
        mp, dev, first, runs[0][2], fstype, "", block_size, features, runs, 0, md=dev
    ), ""


def _md_member(g: Any, dev: str) -> bool:
    try:
        return bool(g.vfs_type(dev) == "linux_raid_member")
    except RuntimeError:
        return False


def _md_physical_volume(g: Any, vg_name: str, arrays: dict[str, MdArray]) -> MdArray | None:
    """The MD array holding a physical volume of volume group vg_name, if any."""
    for md in dict.fromkeys(arrays.values()):

        def read(at: int, size: int, dev: str = md.device) -> bytes:
            data: bytes = g.pread_device(dev, size, at)
            return data

        try:
            label = lvm.read_label(read)
            if (
                label is not None
                and label.metadata
                and lvm.volume_group(label.metadata)[0] == vg_name
            ):
                return md
        except (RuntimeError, lvm.LvmError, UnicodeDecodeError):
            continue
    return None


def _logical_volume(
    mp: str,
    dev: str,
    vg_name: str,
    lv_name: str,
    vgs: dict[str, "lvm.VolumeGroup"],
    fstype: str,
    block_size: int,
    features: str,
) -> tuple[MappedFs | None, str]:
    """A file system on an LVM logical volume, mapped through its segments."""
    why = unmappable_reason(fstype, features, 0, 0, block_size)
    if why:
        return None, why
    vg = vgs.get(vg_name)
    if vg is None:
        return None, (
            f"volume group {vg_name} has no physical volume on the image's disk "
            "(a second disk?), so its extents cannot be located"
        )
    segments, why = lvm.lv_segments(vg.metadata, lv_name, vg.pv_starts)
    if why:
        return None, why
    for seg in segments:
        why = alignment_reason(
            seg.disk_start - seg.lv_start,
            block_size,
            f"a segment of {vg_name}/{lv_name} puts its file system start",
        )
        if why:
            return None, why
    runs = tuple((s.lv_start, s.sectors, s.disk_start) for s in segments)
    first = segments[0].disk_start - segments[0].lv_start
    return MappedFs(
        mp,
        dev,
        vg.partition_of(segments[0].disk_start),
        first,
        fstype,
        "",
        block_size,
        features,
        runs,
        0,
        f"{vg_name}/{lv_name}",
    ), ""


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
