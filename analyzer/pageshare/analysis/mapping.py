"""From a classified guest page to a verified base-image block.

A page is listed only when all of this holds (see docs/ARCHITECTURE.md):
clean page cache of a regular file on one of the base image's mapped ext4,
XFS or btrfs file systems (the root, a separate /boot, /usr, ...; or, with
include_metadata, block-device cache of the base disk); its file offset maps
to 4096/blocksize contiguous, allocated blocks; the block starts on an
8-sector boundary; the page is not all zeros; and its bytes equal the base
image at that sector.  The verdict names the first rule that failed.

A btrfs inode number names a file only within one subvolume, and the
guest's page record names no subvolume, so a btrfs page has one candidate
block map per subvolume tree holding that inode number (map_page): each is
tried in turn and the first whose block's bytes equal the page is kept.
"""

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from ..image.ext4map import Extent, lookup
from .classify import PageRecord

PAGE = 4096
ZERO_PAGE = bytes(PAGE)
SECTORS_PER_PAGE = PAGE // 512

STABLE = "stable"
# btrfs keeps its metadata (tree blocks, by logical address) in the page cache
# of an internal inode of this number: metadata, as the block device's is.
BTRFS_BTREE_INODE = 1
# btrfs file data no disk block holds as the page's bytes (btrfsmap.Unservable).
INLINE = "inline"
COMPRESSED = "compressed"


def norm_uuid(u: str) -> str:
    return u.replace("-", "").lower()


# A mapped file system, as the guest's page cache names it: its UUID (hex,
# no dashes) and its block device's start sector (a partition's start, 0 for
# an LVM volume).  Both must match, so that a clone of a partition (same UUID
# elsewhere on the disk) is never mistaken for it.
FsKey = tuple[str, int]
# (file system sector, sectors, disk sector): where a run of the file
# system's bytes is on the virtual disk (one for a partition, one per LV segment).
Run = tuple[int, int, int]
WHOLE = 1 << 62  # a partition's run: as long as the file system is


@dataclass(frozen=True)
class Placement:
    uuid: str  # hex, no dashes
    guest_start: int  # start_sect the guest reports for its block device
    runs: tuple[Run, ...]
    mountpoint: str = "/"
    fstype: str = "ext4"
    # btrfs: (subvolume, mountpoint) of each mount of it, "" meaning the
    # default subvolume: one file system, wherever fstab mounts its subvolumes.
    subvols: tuple[tuple[str, str], ...] = ()

    @classmethod
    def partition(
        cls, uuid: str, start: int, mountpoint: str = "/", fstype: str = "ext4"
    ) -> "Placement":
        return cls(uuid, start, ((0, WHOLE, start),), mountpoint, fstype)

    @property
    def key(self) -> FsKey:
        return self.uuid, self.guest_start

    def to_disk(self, fs_sector: int, count: int) -> int | None:
        """The disk sector of file system sectors [fs_sector, fs_sector + count),
        None unless they are all in one run (contiguous on the disk)."""
        for start, length, disk in self.runs:
            if start <= fs_sector < start + length:
                return disk + fs_sector - start if fs_sector + count <= start + length else None
        return None


@dataclass(frozen=True)
class Geometry:
    filesystems: tuple[Placement, ...]
    virtual_size: int
    disk: str = "vda"

    def find(self, rec: PageRecord) -> Placement | None:
        return next(
            (
                f
                for f in self.filesystems
                if f.uuid == norm_uuid(rec.fs_uuid) and f.guest_start == rec.start_sect
            ),
            None,
        )


@dataclass(frozen=True)
class Candidate:
    """One subvolume's block map of a btrfs inode number."""

    tree: int  # the subvolume's tree id
    extents: list[Extent]
    # (first block, blocks, INLINE or COMPRESSED): file data not on disk as it reads.
    unservable: tuple[tuple[int, int, str], ...] = ()

    def unservable_at(self, block: int) -> str:
        return next((why for first, n, why in self.unservable if first <= block < first + n), "")


MAPPED_FSTYPES = ("ext2", "ext3", "ext4", "xfs", "btrfs")


def fs_family(fstype: str) -> str:
    """ext2 and ext3 are ext4's on-disk format: the guest mounts one as another
    (an fstab that says ext4 on an ext3 file system is common), and libguestfs
    names it by its features; either way debugfs reads its block map."""
    return "ext4" if fstype in ("ext2", "ext3") else fstype


def file_page_sector(
    rec: PageRecord, extents: list[Extent] | None, geo: Geometry
) -> tuple[int | None, str]:
    """Sector of a file page per the base image's block map, or (None, reason)."""
    if rec.fstype not in MAPPED_FSTYPES:
        return None, "unsupported-fs"
    fs = geo.find(rec)
    if fs is None:
        if any(f.uuid == norm_uuid(rec.fs_uuid) for f in geo.filesystems):
            return None, "other-disk"
        return None, "other-fs"
    if fs_family(rec.fstype) != fs_family(fs.fstype):
        return None, "other-fs"
    if rec.fstype == "btrfs" and rec.ino == BTRFS_BTREE_INODE:
        return None, "metadata"
    if extents is None:
        return None, "unmapped"
    if rec.blkbits < 9 or rec.blkbits > 12:
        return None, "unsupported-blocksize"
    bs = 1 << rec.blkbits
    per_page = PAGE // bs
    first = rec.index * per_page
    blocks = [lookup(extents, first + k) for k in range(per_page)]
    if blocks[0] is None or any(b is None for b in blocks):
        return None, "hole"
    b0 = blocks[0]
    if any(b != b0 + k for k, b in enumerate(blocks)):
        return None, "discontiguous"
    sector = fs.to_disk(b0 * (bs // 512), PAGE // 512)
    if sector is None:
        return None, "discontiguous"  # the page spans two LV segments
    return sector, ""


def page_sector(
    rec: PageRecord,
    extents: dict[tuple[FsKey, int], list[Extent]],
    geo: Geometry,
    include_metadata: bool,
) -> tuple[int | None, str]:
    """extents: by (file system, inode), as read from the base image."""
    if rec.kind == "file":
        sector, why = file_page_sector(rec, extents.get(file_key(rec)), geo)
    elif rec.kind == "bdev":
        if rec.disk != geo.disk:
            return None, "other-disk"
        if not include_metadata:
            return None, "metadata"
        sector, why = rec.start_sect + rec.index * SECTORS_PER_PAGE, ""
    else:
        return None, "not-page-cache"
    return _servable(rec, sector, why, geo)


def file_key(rec: PageRecord) -> tuple[FsKey, int]:
    """The (file system, inode) a file page's extents are filed under."""
    return (norm_uuid(rec.fs_uuid), rec.start_sect), rec.ino


def _servable(
    rec: PageRecord, sector: int | None, why: str, geo: Geometry
) -> tuple[int | None, str]:
    if sector is None:
        return None, why
    if not rec.clean:
        return None, "dirty"
    if sector % SECTORS_PER_PAGE:
        return None, "unaligned"
    if (sector * 512) + PAGE > geo.virtual_size:
        return None, "out-of-range"
    return sector, ""


def verify(sector: int, guest_bytes: bytes | None, read_base: Callable[[int], bytes]) -> str:
    if guest_bytes is None:
        return "not-in-dump"
    if guest_bytes == ZERO_PAGE:
        return "zero"
    if read_base(sector) != guest_bytes:
        return "mismatch"
    return STABLE


# Which failed candidate's verdict a btrfs page gets: data that exists but no
# block can serve says most, a byte mismatch next, no data at all least.
_FAILURE_RANK = {INLINE: 0, COMPRESSED: 0, "hole": 3, "unmapped": 4}


def map_page(
    rec: PageRecord,
    data: bytes | None,
    read_base: Callable[[int], bytes],
    extents: dict[tuple[FsKey, int], list[Extent]],
    geo: Geometry,
    include_metadata: bool,
    candidates: Mapping[tuple[FsKey, int], Sequence[Candidate]] | None = None,
) -> tuple[int | None, str, int]:
    """(sector or None, verdict, btrfs tree or 0) of a page-cache page: page_sector,
    then verify.  A btrfs file page has a Candidate per subvolume holding its
    inode number, tried in order; the first whose block verifies is kept.
    That is sound whichever subvolume the block belongs to: a list entry only
    claims that the block's bytes equal the page every guest read, and
    snapshots share their extents anyway.  When none verifies, the verdict
    is the most telling candidate's (inline or compressed data first)."""
    options = candidates.get(file_key(rec)) if candidates and rec.kind == "file" else None
    if not options:
        sector, why = page_sector(rec, extents, geo, include_metadata)
        return sector, why if sector is None else verify(sector, data, read_base), 0
    failed: list[tuple[int, int, int | None, str, int]] = []
    for n, c in enumerate(options):
        sector, why = file_page_sector(rec, c.extents, geo)
        if why == "hole":
            bits = rec.blkbits if 9 <= rec.blkbits <= 12 else 12
            why = c.unservable_at(rec.index * (PAGE >> bits)) or why
        sector, why = _servable(rec, sector, why, geo)
        if sector is not None:
            why = verify(sector, data, read_base)
            if why == STABLE:
                return sector, why, c.tree
        failed.append(
            (_FAILURE_RANK.get(why, 1 if sector is not None else 2), n, sector, why, c.tree)
        )
    _, _, sector, why, tree = min(failed)
    return sector, why, tree
