"""Which 4 KiB blocks of a base image are one whole page of a regular file.

analyze-image goes from a guest's page (file system, inode, page index) to a
disk block through the base image's own block maps (mapping.py with
ext4map, xfsmap, btrfsmap).  ``pageshare list refine`` starts from the
other end, a disk block the fleet's guests read, and asks the same readers
the reverse question:

- ext2/3/4: debugfs ``icheck`` names the inode owning each file system block,
  ``stat`` its type; reserved inodes (the journal, the resize inode, below
  the superblock's first inode) are metadata.
- XFS: xfs_db ``blockget -n`` then ``daddr``/``blockuse -n`` per block: its
  type (``data`` is regular file data) and inode.
- btrfs: every subvolume tree's regular, uncompressed extents
  (btrfsmap.parse_file_extents), the chunk tree mapping them to the device.

Then, as mapping.file_page_sector does forwards, the owner's data extents
(read with ext4map/xfsmap.read_extents, which leave out unwritten extents)
must hold the block as file blocks [index * per_page, (index + 1) *
per_page) of one file, contiguous on disk: one page of the file's page
cache, so the block is what a guest reads and caches whole.  Directories,
symlinks, extent tree and indirect blocks, the journal, inode tables, free
space, and blocks outside every mapped file system are not.

:func:`classify` answers for many blocks at once (one debugfs or xfs_db per
file system, chunked); its verdict per block is "" (a regular file's page)
or the reason it is not (the REASONS below).
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable, Iterable
from pathlib import Path

from ..analysis.mapping import WHOLE, Placement, fs_family
from ..image import btrfsmap
from ..image.ext4map import Extent, _debugfs, read_extents
from ..image.xfsmap import ag_blocks
from ..image.xfsmap import read_extents as xfs_read_extents

PAGE = 4096
SECTORS_PER_PAGE = PAGE // 512

OUTSIDE_FS = "outside-file-systems"  # on no mapped file system (partition table, swap, ...)
NOT_REGULAR = "not-regular-file-data"  # metadata, directory, symlink, free space, journal
NOT_WHOLE_PAGE = "not-a-whole-file-page"  # 1 KiB blocks not one page of one file
UNSUPPORTED = "unsupported-file-system"
REASONS = (OUTSIDE_FS, NOT_REGULAR, NOT_WHOLE_PAGE, UNSUPPORTED)

# Blocks per debugfs `icheck` line: debugfs reads command lines of about 8 KiB
# and runs the rest of a longer one as a command of its own.
ICHECK_CHUNK = 256
# Blocks per xfs_db process (two -c arguments each, plus one blockget).
XFS_CHUNK = 4000


def placement_of(filesystems: Iterable[Placement], sector: int) -> tuple[Placement, int] | None:
    """(file system, sector within it) of a disk sector: the run holding it.

    A partition's run is open-ended (mapping.WHOLE): of several, the one that
    starts last before the sector is the partition it is in (a sector past a
    file system's end is then found by no owner, and refused as such)."""
    best: tuple[int, Placement, int] | None = None
    for fs in filesystems:
        for start, length, disk in fs.runs:
            if disk <= sector < disk + length and sector - disk + SECTORS_PER_PAGE <= length:
                exact = length != WHOLE
                rank = (1 << 63) + disk if exact else disk
                if best is None or rank > best[0]:
                    best = (rank, fs, start + sector - disk)
    return None if best is None else (best[1], best[2])


def _page_verdict(
    blocks: list[int], owners: list[int | None], extents: dict[int, list[Extent]], per_page: int
) -> str:
    """ "" if the file system blocks are one whole page of one file's data."""
    ino = owners[0]
    if ino is None or any(o != ino for o in owners):
        return NOT_REGULAR if any(o is None for o in owners) else NOT_WHOLE_PAGE
    logical: list[int] = []
    for b in blocks:
        e = next((e for e in extents.get(ino, []) if e.physical <= b < e.physical + e.length), None)
        if e is None:
            return NOT_REGULAR  # the inode's metadata (extent tree, indirect block)
        logical.append(e.logical + b - e.physical)
    if logical[0] % per_page or any(lb != logical[0] + k for k, lb in enumerate(logical)):
        return NOT_WHOLE_PAGE
    return ""


# --------------------------------------------------------------------------- ext2/3/4

_ICHECK = re.compile(r"^(\d+)\t(\d+|<block not found>)")
_TYPE = re.compile(r"^Inode: (\d+)\s+Type: (\S+)")
_STAT_CMD = re.compile(r"^debugfs: stat <(\d+)>")


def ext4_owners(image: Path, offset: int, blocks: list[int]) -> dict[int, int]:
    """File system block -> inode owning it (debugfs icheck); free blocks and
    the file system's own metadata are absent."""
    out: dict[int, int] = {}
    for i in range(0, len(blocks), ICHECK_CHUNK):
        cmd = "icheck " + " ".join(map(str, blocks[i : i + ICHECK_CHUNK])) + "\n"
        for line in _debugfs(image, offset, cmd).splitlines():
            m = _ICHECK.match(line)
            if m and m.group(2).isdigit():
                out[int(m.group(1))] = int(m.group(2))
    return out


def ext4_inode_types(image: Path, offset: int, inodes: list[int]) -> dict[int, str]:
    """Inode -> debugfs' type name (regular, directory, symlink, ...)."""
    out: dict[int, str] = {}
    for i in range(0, len(inodes), ICHECK_CHUNK):
        cur: int | None = None
        cmds = "".join(f"stat <{n}>\n" for n in inodes[i : i + ICHECK_CHUNK])
        for line in _debugfs(image, offset, cmds).splitlines():
            m = _STAT_CMD.match(line)
            if m:
                cur = int(m.group(1))
                continue
            m = _TYPE.match(line)
            if m and cur is not None and int(m.group(1)) == cur:
                out[cur] = m.group(2)
    return out


def ext4_first_inode(image: Path, offset: int) -> int:
    m = re.search(r"^First inode:\s+(\d+)", _debugfs(image, offset, "stats\n"), re.M)
    return int(m.group(1)) if m else 11


def _classify_ext4(
    image: Path, offset: int, block_size: int, fs_sectors: dict[int, int]
) -> dict[int, str]:
    """fs_sectors: disk sector -> sector within the file system."""
    per = max(1, PAGE // block_size)
    spb = block_size // 512
    want = {s: [fs // spb + k for k in range(per)] for s, fs in fs_sectors.items()}
    owners = ext4_owners(image, offset, sorted({b for bl in want.values() for b in bl}))
    first = ext4_first_inode(image, offset)
    inodes = sorted({i for i in owners.values() if i >= first})
    types = ext4_inode_types(image, offset, inodes)
    regular = [i for i in inodes if types.get(i) == "regular"]
    extents = read_extents(image, offset, regular)
    out: dict[int, str] = {}
    for s, bl in want.items():
        own: list[int | None] = [owners.get(b) for b in bl]
        own = [o if o is not None and o in extents else None for o in own]
        out[s] = _page_verdict(bl, own, extents, per)
    return out


# --------------------------------------------------------------------------- XFS

_BLOCKUSE = re.compile(r"^block \d+ \((\d+)/(\d+)\) type (\S+)(?: inode (\d+))?")


def xfs_owners(image: Path, fs_sectors: list[int], per: int) -> dict[int, int]:
    """Linear file system block -> inode, for blocks xfs_db calls regular file data."""
    agblocks = ag_blocks(image)
    out: dict[int, int] = {}
    for i in range(0, len(fs_sectors), XFS_CHUNK):
        args = ["xfs_db", "-r", "-c", "blockget -n"]
        for s in fs_sectors[i : i + XFS_CHUNK]:
            args += ["-c", f"daddr {s}", "-c", f"blockuse -n -c {per}"]
        p = subprocess.run([*args, str(image)], capture_output=True, text=True)
        if p.returncode != 0:
            raise RuntimeError(f"xfs_db failed: {p.stderr.strip()[-300:]}")
        for line in p.stdout.splitlines():
            m = _BLOCKUSE.match(line)
            if m and m.group(3) == "data" and m.group(4):
                out[int(m.group(1)) * agblocks + int(m.group(2))] = int(m.group(4))
    return out


def _classify_xfs(image: Path, block_size: int, fs_sectors: dict[int, int]) -> dict[int, str]:
    per = max(1, PAGE // block_size)
    spb = block_size // 512
    owners = xfs_owners(image, sorted(set(fs_sectors.values())), per)
    extents = xfs_read_extents(image, sorted(set(owners.values())))
    out: dict[int, str] = {}
    for s, fs in fs_sectors.items():
        bl = [fs // spb + k for k in range(per)]
        out[s] = _page_verdict(bl, [owners.get(b) for b in bl], extents, per)
    return out


# --------------------------------------------------------------------------- btrfs


def _classify_btrfs(image: Path, fs_sectors: dict[int, int]) -> dict[int, str]:
    """Every subvolume tree's regular data extents, by physical block.  Blocks
    of compressed or inline extents are not among them: not servable."""
    chunks, sectorsize = btrfsmap._checked_chunks(image)
    subvols, default, _ = btrfsmap.read_subvolumes(image)
    trees = list(dict.fromkeys([btrfsmap.FS_TREE, default, *(s.tree for s in subvols)]))
    spb = sectorsize // 512
    per = max(1, PAGE // sectorsize)
    wanted = {fs // spb + k for fs in fs_sectors.values() for k in range(per)}
    # Per (tree, inode), the extents touching a wanted block: an inode number
    # names a file within one tree only.
    owners: dict[int, int] = {}
    extents: dict[int, list[Extent]] = {}
    key = 0
    for tree in trees:
        exts, _ = btrfsmap.parse_file_extents(
            btrfsmap._fs_tree(image, tree), chunks, sectorsize, None
        )
        for _ino, es in exts.items():
            hit = [b for e in es for b in _wanted_in(e, wanted)]
            if hit:
                key += 1
                extents[key] = es
                for b in hit:
                    owners.setdefault(b, key)
    out: dict[int, str] = {}
    for s, fs in fs_sectors.items():
        bl = [fs // spb + k for k in range(per)]
        out[s] = _page_verdict(bl, [owners.get(b) for b in bl], extents, per)
    return out


def _wanted_in(e: Extent, wanted: set[int]) -> list[int]:
    if e.length <= len(wanted):
        return [b for b in range(e.physical, e.physical + e.length) if b in wanted]
    return [b for b in wanted if e.physical <= b < e.physical + e.length]


# --------------------------------------------------------------------------- all of them


def classify(
    sectors: Iterable[int],
    filesystems: Iterable[Placement],
    sources: dict[tuple[str, int], tuple[Path, int]],
    block_sizes: dict[tuple[str, int], int],
    say: Callable[[str], None] = lambda _: None,
) -> dict[int, str]:
    """Disk sector (4 KiB aligned) -> "" for a page of a regular file, else the reason.

    sources: where each file system's bytes are readable (as analyze.py makes
    them with ext4map.fs_image: the raw disk at an offset, or a copy);
    block_sizes: each file system's block size."""
    fss = list(filesystems)
    out: dict[int, str] = {}
    by_fs: dict[Placement, dict[int, int]] = {}
    for s in sectors:
        found = placement_of(fss, s)
        if found is None:
            out[s] = OUTSIDE_FS
        else:
            by_fs.setdefault(found[0], {})[s] = found[1]
    for fs, fs_sectors in by_fs.items():
        image, offset = sources[fs.key]
        bs = block_sizes.get(fs.key, PAGE)
        say(f"mapping {len(fs_sectors)} block(s) on {fs.mountpoint} ({fs.fstype}) to files")
        family = fs_family(fs.fstype)
        if family == "ext4":
            out.update(_classify_ext4(image, offset, bs, fs_sectors))
        elif family == "xfs":
            out.update(_classify_xfs(image, bs, fs_sectors))
        elif family == "btrfs":
            out.update(_classify_btrfs(image, fs_sectors))
        else:
            out.update(dict.fromkeys(fs_sectors, UNSUPPORTED))
    return out
