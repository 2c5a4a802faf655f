"""A btrfs file system's block map, read offline with btrfs-progs (the ext4map of btrfs).

`btrfs inspect-internal dump-tree` reads a file system image without
mounting it; like xfs_db it takes no offset inside a disk, so it is given a
copy of the file system's bytes (ext4map.fs_image with copy).  Two trees
are read:

- the chunk tree maps btrfs' logical addresses to (device, physical
  offset): each CHUNK_ITEM covers [logical, logical + length) and lists its
  stripes.  Only one device is followed: a file system of several devices
  (num_devices > 1) or a chunk with a RAID profile is refused
  (BtrfsUnsupported).  SINGLE and DUP chunks hold whole copies of their
  data, so stripe 0 is where the bytes are.
- a file system tree (5, the top-level subvolume, unless told another)
  holds per inode its EXTENT_DATA items: file offset, type, compression,
  disk byte and length of the extent, and the part of it the file uses
  (offset, nr).  A regular uncompressed extent is file bytes stored as they
  are, so its blocks can be served from disk.  Inline extents (the data is
  inside the metadata leaf) and compressed extents (the bytes on disk are
  not the page's bytes) cannot: they are left out and counted.
  Preallocated extents read as zeros and holes (disk byte 0) have no
  data, so they are left out as well, as ext4map leaves out Uninit extents.

Blocks are btrfs sectors (sectorsize, 4 KiB on x86), numbered from the
start of the file system's device, so physical blocks mean the same as
ext4map's: block * block_size bytes from where the file system starts.

Inode numbers are per subvolume: every subvolume (and snapshot) is a file
system tree of its own, and inode 257 of one is not inode 257 of another.
The root tree (`dump-tree -t root`) lists them: a ROOT_ITEM per tree (5, the
top level, and 256 and up), a ROOT_BACKREF naming where each one sits in
its parent (parse_subvolumes), and the "default" directory item naming the
subvolume a mount without subvol= gets.  read_subvolume_extents reads an
inode's extents in each tree; which of them the guest's page belongs to is
decided by comparing bytes (mapping.map_page).
"""

import re
import subprocess
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import PageshareError
from .ext4map import Extent

FS_TREE = 5  # the top-level subvolume
FIRST_INODE = 256  # a subvolume's root directory

_KEY = re.compile(r"^\s*item \d+ key \((\S+) (\S+) (\d+)\)")
_CHUNK_HEAD = re.compile(r"^\s*length (\d+) owner \d+ stripe_len \d+ type (\S+)")
_STRIPES = re.compile(r"^\s*num_stripes (\d+)")
_STRIPE = re.compile(r"^\s*stripe (\d+) devid (\d+) offset (\d+)")
_TYPE = re.compile(r"^\s*generation \d+ type (\d+) \((\w+)\)", re.M)
_DISK = re.compile(r"^\s*extent data disk byte (\d+) nr (\d+)", re.M)
_OFFSET = re.compile(r"^\s*extent data offset (\d+) nr (\d+) ram (\d+)", re.M)
_COMPRESSION = re.compile(r"^\s*extent compression (\d+)", re.M)
_INLINE = re.compile(r"^\s*inline extent data size (\d+) ram_bytes (\d+) compression (\d+)", re.M)
_NAME = re.compile(r"^\s*index \d+ namelen \d+ name: (.*)$")
_SUPER = re.compile(r"^(\w+)\s+(\S+)")
_ANY_KEY = re.compile(r"^\s*item \d+ key \((\S+) (\S+) (\d+)\)")
_BACKREF = re.compile(r"^\s*root backref key dirid (\d+) sequence \d+ name (.*)$")
_LOCATION = re.compile(r"^\s*location key \((\S+) ROOT_ITEM")
_DIR_NAME = re.compile(r"^\s*name: (.*)$")
# Tree ids of subvolumes: 5, then 256 up to the reserved ids at the top of
# the u64 range, which dump-tree prints by name (DATA_RELOC_TREE, ...).
_LAST_SUBVOLUME = (1 << 64) - 256

# Profiles whose chunks keep a whole copy of the data in stripe 0.
_ONE_COPY_PROFILES = {"single", "DUP"}


class BtrfsUnsupported(PageshareError, ValueError):
    """A btrfs layout this mapping does not follow (said to the operator)."""


@dataclass(frozen=True)
class Chunk:
    logical: int
    length: int
    profile: str  # "single", "DUP", "RAID1", ...
    kind: str  # "DATA", "METADATA", "SYSTEM" or a mix
    physical: int  # stripe 0's offset on the device
    devid: int


@dataclass
class Unservable:
    """File data whose pages cannot be served from disk blocks, counted per kind."""

    compressed_extents: int = 0
    compressed_bytes: int = 0  # file bytes they cover, in whole sectors
    inline_extents: int = 0
    inline_bytes: int = 0
    inodes: set[int] = field(default_factory=set)
    # Per inode, the file's sectors they hold: (first sector, sectors, "inline"
    # or "compressed"), so that a page there gets that verdict, not "hole".
    ranges: dict[int, list[tuple[int, int, str]]] = field(default_factory=dict)


def _dump(args: list[str]) -> str:
    p = subprocess.run(args, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(args[:3])} failed: {p.stderr.strip()[-300:]}")
    return p.stdout


def superblock(image: Path) -> dict[str, str]:
    """dump-super's fields: sectorsize, num_devices, fsid, ..."""
    out = _dump(["btrfs", "inspect-internal", "dump-super", str(image)])
    return {m.group(1): m.group(2) for m in map(_SUPER.match, out.splitlines()) if m}


def sector_size(image: Path) -> int:
    return int(superblock(image)["sectorsize"])


def check_single_device(sb: dict[str, str]) -> None:
    devices = int(sb.get("num_devices", "0"))
    if devices != 1:
        raise BtrfsUnsupported(
            f"btrfs over {devices} devices: its extents may sit on a device that is not this "
            "disk, and only a btrfs of one device (SINGLE or DUP profiles) is mapped"
        )


def parse_chunks(output: str) -> list[Chunk]:
    """CHUNK_ITEMs of `dump-tree -t chunk` output, by logical address."""
    chunks: list[Chunk] = []
    logical: int | None = None
    head: tuple[int, str, str] | None = None
    for line in output.splitlines():
        m = _KEY.match(line)
        if m:
            logical = int(m.group(3)) if m.group(2) == "CHUNK_ITEM" else None
            head = None
            continue
        if logical is None:
            continue
        m = _CHUNK_HEAD.match(line)
        if m:
            kinds, _, profile = m.group(2).rpartition("|")
            head = (int(m.group(1)), profile, kinds)
            continue
        m = _STRIPE.match(line)
        if m and head is not None and m.group(1) == "0":
            chunks.append(
                Chunk(logical, head[0], head[1], head[2], int(m.group(3)), int(m.group(2)))
            )
            logical = None
    chunks.sort(key=lambda c: c.logical)
    return chunks


def check_profiles(chunks: list[Chunk]) -> None:
    """Refuses chunks whose data is striped or mirrored over devices."""
    for c in chunks:
        if c.profile not in _ONE_COPY_PROFILES:
            raise BtrfsUnsupported(
                f"btrfs {c.kind} chunk at {c.logical} has the {c.profile} profile: its data "
                "is striped or mirrored over several devices, and only a btrfs of one device "
                "(SINGLE or DUP profiles) is mapped"
            )


def to_physical(chunks: list[Chunk], logical: int, length: int) -> int:
    """Byte offset on the device of [logical, logical + length), which one chunk holds."""
    lo, hi = 0, len(chunks)
    while lo < hi:
        mid = (lo + hi) // 2
        if chunks[mid].logical <= logical:
            lo = mid + 1
        else:
            hi = mid
    if lo:
        c = chunks[lo - 1]
        if logical + length <= c.logical + c.length:
            return c.physical + logical - c.logical
    raise RuntimeError(f"btrfs logical range {logical}+{length} is in no chunk")


def _items(lines: Iterable[str], wanted: str) -> Iterator[tuple[int, int, list[str]]]:
    """(objectid, offset, body lines) of each item of type wanted with a numeric objectid."""
    cur: tuple[int, int] | None = None
    body: list[str] = []
    for line in lines:
        m = _KEY.match(line)
        if m:
            if cur is not None:
                yield cur[0], cur[1], body
            cur = (
                (int(m.group(1)), int(m.group(3)))
                if m.group(2) == wanted and m.group(1).isdigit()
                else None
            )
            body = []
        elif cur is not None:
            if not line.startswith("\t"):  # a new leaf or node header
                yield cur[0], cur[1], body
                cur = None
            else:
                body.append(line)
    if cur is not None:
        yield cur[0], cur[1], body


def parse_file_extents(
    output: str, chunks: list[Chunk], sectorsize: int, inodes: set[int] | None = None
) -> tuple[dict[int, list[Extent]], Unservable]:
    """Servable extents per inode (in sectors, from the device's start) from
    `dump-tree -t <fs tree>` output, and what was left out as inline or compressed."""
    res: dict[int, list[Extent]] = {i: [] for i in inodes or ()}
    skipped = Unservable()
    for ino, file_offset, body in _items(output.splitlines(), "EXTENT_DATA"):
        if inodes is not None and ino not in inodes:
            continue
        res.setdefault(ino, [])
        text = "\n".join(body)
        t = _TYPE.search("\n".join(body[:1]))
        m = _INLINE.search(text)
        if m or (t and t.group(2) == "inline"):
            size = int(m.group(2)) if m else 0
            skipped.inline_extents += 1
            skipped.inline_bytes += size
            skipped.inodes.add(ino)
            skipped.ranges.setdefault(ino, []).append(
                (file_offset // sectorsize, max(1, -(-size // sectorsize)), "inline")
            )
            continue
        disk, used, comp = (_DISK.search(text), _OFFSET.search(text), _COMPRESSION.search(text))
        if t is None or disk is None or used is None or comp is None:
            raise RuntimeError(
                f"btrfs EXTENT_DATA of inode {ino} at {file_offset} not understood: {text[:300]}"
            )
        if comp.group(1) != "0":
            skipped.compressed_extents += 1
            skipped.compressed_bytes += int(used.group(2))
            skipped.inodes.add(ino)
            skipped.ranges.setdefault(ino, []).append(
                (file_offset // sectorsize, -(-int(used.group(2)) // sectorsize), "compressed")
            )
            continue
        disk_byte = int(disk.group(1))
        if t.group(2) != "regular" or disk_byte == 0:  # prealloc, or a hole
            continue
        start = disk_byte + int(used.group(1))
        length = int(used.group(2))
        if (file_offset | start | length) % sectorsize:
            raise RuntimeError(
                f"btrfs extent of inode {ino} at {file_offset} is not {sectorsize}-byte aligned"
            )
        phys = to_physical(chunks, start, length)
        res[ino].append(Extent(file_offset // sectorsize, phys // sectorsize, length // sectorsize))
    for exts in res.values():
        exts.sort(key=lambda e: e.logical)
    return res, skipped


def _checked_chunks(image: Path) -> tuple[list[Chunk], int]:
    sb = superblock(image)
    check_single_device(sb)
    chunks = parse_chunks(
        _dump(["btrfs", "inspect-internal", "dump-tree", "-t", "chunk", str(image)])
    )
    check_profiles(chunks)
    return chunks, int(sb["sectorsize"])


def check_chunks(image: Path) -> None:
    """Raises BtrfsUnsupported for several devices or a RAID profile."""
    _checked_chunks(image)


def _fs_tree(image: Path, tree: int) -> str:
    return _dump(["btrfs", "inspect-internal", "dump-tree", "-t", str(tree), str(image)])


def read_extents(
    image: Path, inodes: list[int], tree: int = FS_TREE
) -> tuple[dict[int, list[Extent]], Unservable]:
    """Servable extents of the given inodes of one subvolume, and what was left out.

    Raises BtrfsUnsupported for several devices or a RAID profile."""
    if not inodes:
        return {}, Unservable()
    chunks, sectorsize = _checked_chunks(image)
    return parse_file_extents(_fs_tree(image, tree), chunks, sectorsize, set(inodes))


def parse_paths(output: str, inodes: list[int]) -> dict[int, str]:
    """One "/"-rooted path per inode (hard links: the first name) from INODE_REF items."""
    parent: dict[int, tuple[int, str]] = {}
    for ino, par, body in _items(output.splitlines(), "INODE_REF"):
        for line in body:
            m = _NAME.match(line)
            if m:
                parent.setdefault(ino, (par, m.group(1)))
                break
    paths: dict[int, str] = {}
    for ino in inodes:
        parts: list[str] = []
        cur, seen = ino, set()
        while cur != FIRST_INODE and cur in parent and cur not in seen:
            seen.add(cur)
            cur, name = parent[cur]
            parts.append(name)
        if cur == FIRST_INODE and parts:
            paths[ino] = "/" + "/".join(reversed(parts))
    return paths


def read_paths(image: Path, inodes: list[int], tree: int = FS_TREE) -> dict[int, str]:
    if not inodes:
        return {}
    return parse_paths(_fs_tree(image, tree), inodes)


@dataclass(frozen=True)
class Subvolume:
    """A file system tree: the top level (5), a subvolume or a snapshot."""

    tree: int
    parent: int = 0  # the tree holding its directory entry; 0 for the top level
    dirid: int = 0  # the directory (inode of parent) it sits in
    name: str = ""


def _tree_id(text: str) -> int | None:
    if text == "FS_TREE":
        return FS_TREE
    if text.isdigit() and (int(text) == FS_TREE or FIRST_INODE <= int(text) < _LAST_SUBVOLUME):
        return int(text)
    return None


def parse_subvolumes(output: str) -> tuple[list[Subvolume], int]:
    """The file system trees of `dump-tree -t root` output (by tree id, the top
    level first) and the default subvolume's tree (what a mount without
    subvol= or subvolid= mounts; 5 unless `btrfs subvolume set-default`)."""
    trees: set[int] = set()
    where: dict[int, tuple[int, int, str]] = {}
    default = FS_TREE
    key: tuple[str, str, int] | None = None
    location: int | None = None
    for line in output.splitlines():
        m = _ANY_KEY.match(line)
        if m:
            key, location = (m.group(1), m.group(2), int(m.group(3))), None
            tree = _tree_id(m.group(1))
            if m.group(2) == "ROOT_ITEM" and tree is not None:
                trees.add(tree)
            continue
        if key is None or not line.startswith("\t"):
            key = None
            continue
        if key[1] == "ROOT_BACKREF":
            b = _BACKREF.match(line)
            child, parent = _tree_id(key[0]), _tree_id(str(key[2]))
            if b and child is not None and parent is not None:
                where[child] = (parent, int(b.group(1)), b.group(2))
        elif key[0] == "ROOT_TREE_DIR" and key[1] == "DIR_ITEM":
            loc = _LOCATION.match(line)
            if loc:
                location = _tree_id(loc.group(1))
            name = _DIR_NAME.match(line)
            if name and name.group(1) == "default" and location is not None:
                default = location
    subvols = [Subvolume(t, *where.get(t, (0, 0, ""))) for t in sorted(trees)]
    return subvols, default


def subvolume_paths(
    subvols: list[Subvolume], dir_path: Callable[[int, int], str | None]
) -> dict[int, str]:
    """Each tree's path from the top level, without a leading "/" ("" for the
    top level; "@rootfs"; "@rootfs/var/lib/machines").  dir_path(tree, dirid)
    is a directory's path in a tree ("/var/lib"), None if unknown; a tree
    whose place is unknown (a deleted subvolume not yet cleaned) is left out."""
    by_tree = {s.tree: s for s in subvols}
    paths: dict[int, str] = {}

    def path(tree: int, seen: frozenset[int]) -> str | None:
        if tree in paths:
            return paths[tree]
        s = by_tree.get(tree)
        found = ""
        if tree != FS_TREE:
            if s is None or not s.parent or tree in seen:
                return None
            parent = path(s.parent, seen | {tree})
            where = "" if s.dirid == FIRST_INODE else dir_path(s.parent, s.dirid)
            if parent is None or where is None:
                return None
            found = "/".join(p for p in (parent, where.strip("/"), s.name) if p)
        paths[tree] = found
        return found

    for s in subvols:
        path(s.tree, frozenset())
    return paths


def read_subvolumes(image: Path) -> tuple[list[Subvolume], int, dict[int, str]]:
    """The file system's trees, its default subvolume, and each tree's path."""
    subvols, default = parse_subvolumes(
        _dump(["btrfs", "inspect-internal", "dump-tree", "-t", "root", str(image)])
    )
    dumps: dict[int, str] = {}

    def dir_path(tree: int, dirid: int) -> str | None:
        if tree not in dumps:
            dumps[tree] = _fs_tree(image, tree)
        return parse_paths(dumps[tree], [dirid]).get(dirid)

    return subvols, default, subvolume_paths(subvols, dir_path)


def read_subvolume_extents(
    image: Path, inodes: list[int], trees: list[int]
) -> dict[int, tuple[dict[int, list[Extent]], Unservable]]:
    """read_extents of the same inode numbers in each of the given trees (one
    dump-tree each), the chunk tree read once.  Raises BtrfsUnsupported for
    several devices or a RAID profile."""
    if not inodes:
        return {}
    chunks, sectorsize = _checked_chunks(image)
    wanted = set(inodes)
    return {t: parse_file_extents(_fs_tree(image, t), chunks, sectorsize, wanted) for t in trees}
