"""pageshare list refine on the golden images' other file systems: XFS, btrfs, 1 KiB ext4.

test_refine.py refines lists of the small image (ext4, 4 KiB blocks).
Here the same command, run as an operator runs it (`pageshare list refine
IMAGE --list PARENT --json` against a real redis-server holding two hosts'
summaries), refines a list of the xfs image (XFS root), the btrfs image
(root in subvolume @rootfs, one file stored compressed) and the small1k
image (ext4 with 1 KiB blocks on the whole disk).

For each, the fleet read blocks whose nature is found here with the file
system's own tools (xfs_db, btrfs inspect-internal, debugfs; never the
analyzer's readers, refine_helpers.py has them): pages of libc.so.6 and
dash (on small1k of the two programs with the most whole pages), which
must be added, and blocks that must be refused for their
reason: file system metadata and a directory's blocks, free space (zeros),
the partition table; on btrfs also a compressed extent and the unused tail
of a file's disk extent (stale bytes no file reads); on small1k 4 KiB
blocks that are not one page of one file (two files' 1 KiB blocks, a file's
data and its extent tree block, one file's blocks of two pages).  The list
written must hold exactly the parent's blocks and the pages, verify against
the image, and hash to the image's bytes read from a raw conversion of our
own (check_against_image).  The pages are also checked against the files'
bytes as debugfs dump and btrfs restore read them (xfsprogs has no such
reader: on XFS, the first page of each file must hold its ELF header).  The
images and their libguestfs inspections are cached (the image e2e tests
make them); nothing else boots.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from pageshare import golden
from pageshare.lists.fileblocks import NOT_REGULAR, NOT_WHOLE_PAGE, OUTSIDE_FS
from refine_helpers import (
    PAGE,
    Image,
    btrfs_chunks,
    btrfs_device,
    btrfs_extents,
    btrfs_inode,
    btrfs_items,
    btrfs_pages,
    btrfs_restore,
    btrfs_subvolume,
    check_file_pages,
    check_refinement,
    debugfs,
    ext4_files,
    ext4_in_use,
    ext4_owners,
    partition_copy,
    raw_image,
    xfs_bmap,
    xfs_free_extents,
    xfs_inode_block,
    xfs_linear,
    xfs_pages,
    xfs_sb,
)

# Marked as the image e2e tests are: only they and these need the xfs, btrfs
# and small1k golden images, which a cold cache builds (mmdebstrap and
# libguestfs appliances, minutes each), and their inspections boot one too.
pytestmark = pytest.mark.vm

LIBC = "/usr/lib/x86_64-linux-gnu/libc.so.6"
DASH = "/usr/bin/dash"
# small1k's candidates for whole pages (programs of Debian's minbase and the
# small image's packages)
SMALL1K_FILES: list[int | str] = [
    LIBC,
    DASH,
    "/usr/bin/bash",
    "/usr/lib/systemd/systemd",
    "/usr/bin/perl",
    "/usr/bin/tar",
    "/usr/bin/systemctl",
    "/usr/lib/x86_64-linux-gnu/libm.so.6",
]
ELF = b"\x7fELF"


@dataclass
class Golden:
    img: Image
    fs: Path  # the root file system's bytes as a file of their own
    start: int  # its first sector on the disk


def golden_image(name: str, tmp: Path) -> Golden:
    img = raw_image(golden.build_image(name).path, tmp / f"{name}.raw")
    geo = golden.geometry(name)
    if geo.root_start_sector == 0:  # whole disk: the raw file is the fs
        return Golden(img, img.raw, 0)
    fs = partition_copy(
        img.raw,
        geo.root_start_sector,
        geo.root_end_sector - geo.root_start_sector + 1,
        tmp / f"{name}.fs",
    )
    return Golden(img, fs, geo.root_start_sector)


@pytest.fixture(scope="module")
def xfs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Golden]:
    g = golden_image("xfs", tmp_path_factory.mktemp("refine-xfs"))
    yield g
    g.img.raw.unlink()
    g.fs.unlink()


@pytest.fixture(scope="module")
def btrfs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Golden]:
    g = golden_image("btrfs", tmp_path_factory.mktemp("refine-btrfs"))
    yield g
    g.img.raw.unlink()
    g.fs.unlink()


@pytest.fixture(scope="module")
def small1k(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Golden]:
    g = golden_image("small1k", tmp_path_factory.mktemp("refine-small1k"))
    yield g
    g.img.raw.unlink()


def some_pages(pages: dict[int, int], *indexes: int) -> list[int]:
    """The sectors of the pages at indexes (negative: from the last)."""
    order = sorted(pages)
    return [pages[order[i]] for i in indexes]


# --------------------------------------------------------------------------- XFS


def test_refine_on_xfs(xfs: Golden, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    img, fs, start = xfs.img, xfs.fs, xfs.start
    libc, dash = xfs_pages(fs, start, LIBC), xfs_pages(fs, start, DASH)
    # xfsprogs cannot read a file out of an unmounted XFS: that xfs_db's maps
    # put each file's first page where its ELF header is will do.
    assert img.block_bytes(libc[0])[:4] == ELF and img.block_bytes(dash[0])[:4] == ELF
    parent = some_pages(libc, 0, 1, 2, 3)
    # The last pages end past EOF: still a page the guest reads whole.
    pages = [*some_pages(libc, 10, 11, 200, -1), *some_pages(dash, 0, -1)]
    usr_bin = xfs_bmap(fs, "/usr/bin")[0][1]  # a directory block
    log = xfs_linear(fs, "fsblock", xfs_sb(fs, "logstart"))  # the internal log's first block
    first, n = max(xfs_free_extents(fs), key=lambda e: e[1])  # the largest free extent
    free = first + n - 1
    assert not any(img.block_bytes(start + free * 8))
    rejected = [
        (start, NOT_REGULAR),  # superblock, AGF, AGI, AGFL
        (start + xfs_inode_block(fs, LIBC) * 8, NOT_REGULAR),  # inodes
        (start + usr_bin * 8, NOT_REGULAR),
        (start + log * 8, NOT_REGULAR),
        (start + free * 8, NOT_REGULAR),  # free space, zeros
        (0, OUTSIDE_FS),  # the GPT
    ]
    check_refinement(img, tmp_path, capsys, parent, pages, rejected)


# --------------------------------------------------------------------------- btrfs


def test_refine_on_btrfs(btrfs: Golden, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    img, fs, start = btrfs.img, btrfs.fs, btrfs.start
    chunks = btrfs_chunks(fs)
    items = btrfs_items(fs, btrfs_subvolume(fs, "@rootfs"))
    libc, dash = btrfs_pages(items, chunks, start, LIBC), btrfs_pages(items, chunks, start, DASH)
    parent = some_pages(libc, 0, 1, 2, 3)
    pages = [*some_pages(libc, 10, 11, 300, -1), *some_pages(dash, 0, -1)]
    # Each of them is its file's page as btrfs-progs reads the file (restore).
    assert sum(
        check_file_pages(
            img, got, btrfs_restore(fs, "@rootfs", path, tmp_path / "r"), [*parent, *pages]
        )
        for path, got in ((LIBC, libc), (DASH, dash))
    ) == len(parent) + len(pages)

    # The tree block holding libc's inode, in both copies of the DUP metadata.
    ino = btrfs_inode(items, LIBC)
    leaf = next(it.leaf for it in items if it.objectid == str(ino) and it.type == "INODE_ITEM")
    copies = btrfs_device(chunks, leaf)
    assert len(copies) == 2
    # A compressed extent's first block: what is on disk is not the file's page.
    extents = [e for es in btrfs_extents(items).values() for e in es if e.disk]
    gpl = btrfs_extents(items)[btrfs_inode(items, "/usr/share/common-licenses/GPL-3")]
    (compressed,) = btrfs_device(chunks, next(e.disk for e in gpl if e.compression))
    # A block of a disk extent that no file extent uses (mkfs.btrfs --rootdir
    # leaves such tails): its bytes are no file's, no guest reads them.
    used = sorted((e.disk + e.offset, e.disk + e.offset + e.bytes) for e in extents)
    tails = sorted(
        t
        for e in extents
        if not e.compression and e.offset + e.bytes < e.disk_bytes
        for t in range(e.disk + e.offset + e.bytes, e.disk + e.disk_bytes, PAGE)
        if not any(a <= t < b for a, b in used)
    )
    assert tails, "the golden btrfs has no unused tail of a disk extent: pick another case"
    (stale,) = btrfs_device(chunks, tails[0])
    assert any(img.block_bytes(start + stale // 512))
    # Past every chunk, inside the file system: unallocated, zeros.
    dev = next(it.body for it in btrfs_items(fs, "chunk") if it.type == "DEV_ITEM")
    total = re.search(r"^devid 1 total_bytes (\d+) ", dev, re.M)
    assert total, dev
    free = (int(total.group(1)) // PAGE - 1) * PAGE
    assert all(free >= s + c.length for c in chunks for s in c.stripes)
    assert not any(img.block_bytes(start + free // 512))
    rejected = [
        (start + 65536 // 512, NOT_REGULAR),  # the superblock
        (start + copies[0] // 512, NOT_REGULAR),
        (start + copies[1] // 512, NOT_REGULAR),
        (start + compressed // 512, NOT_REGULAR),
        (start + stale // 512, NOT_REGULAR),
        (start + free // 512, NOT_REGULAR),
        (0, OUTSIDE_FS),  # the GPT
    ]
    check_refinement(img, tmp_path, capsys, parent, pages, rejected)


# --------------------------------------------------------------------------- ext4, 1 KiB blocks


def test_refine_on_ext4_with_1k_blocks(
    small1k: Golden, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A 4 KiB block is four file system blocks (block b at sector 2b, whole disk)."""
    img, raw = small1k.img, small1k.fs
    stats = debugfs(raw, "stats")
    assert re.search(r"^Block size:\s+1024$", stats, re.M)
    m = re.search(r"^First inode:\s+(\d+)", stats, re.M)
    assert m
    first_ino = int(m.group(1))  # below it: the journal, resize inode, root dir
    files = ext4_files(raw, SMALL1K_FILES)
    # Every 4 KiB unit (4 blocks from a multiple of 4) holding a block of these.
    units = sorted({b - b % 4 for f in files.values() for b in [*f.data, *f.tree]})
    owners = ext4_owners(raw, [u + k for u in units for k in range(4)])
    inodes = ext4_files(raw, sorted({o for o in owners.values() if o is not None}))
    regular = {
        ino: f
        for ino, f in inodes.items()
        if f.type == "regular" and isinstance(ino, int) and ino >= first_ino
    }

    def logical(block: int) -> int | None:
        """The file block a file system block is, None if it is no regular file's data."""
        o = owners[block]
        return None if o is None or o not in regular else regular[o].data.get(block)

    kinds: dict[str, list[int]] = {}
    for u in units:
        own = {owners[u + k] for k in range(4)}
        lb = [x for k in range(4) if (x := logical(u + k)) is not None]
        if len(lb) < 4:
            kind = "data-and-metadata" if lb else "metadata"
        elif len(own) > 1:
            kind = "two-files"
        elif lb[0] % 4 == 0 and lb == [lb[0] + k for k in range(4)]:
            kind = "page"
        else:
            kind = "one-file-not-a-page"
        kinds.setdefault(kind, []).append(u)
    for kind in ("page", "two-files", "data-and-metadata", "one-file-not-a-page"):
        assert kinds.get(kind), f"no 4 KiB block of these files is {kind}: {sorted(kinds)}"

    def pages_of(path: int | str) -> dict[int, int]:
        f = files[path]
        return {f.data[u] // 4: u * 2 for u in kinds["page"] if owners[u] == f.ino}

    # With 1 KiB blocks a file's data is a whole page only where its blocks
    # line up with 4 KiB units, which depends on where the allocator put it
    # in this build of the image (libc.so.6 has had hundreds and none): the
    # pages come from the two files that have the most.
    whole = {path: pages_of(path) for path in SMALL1K_FILES if files[path].type == "regular"}
    first, second = sorted(whole, key=lambda path: len(whole[path]), reverse=True)[:2]
    a, b = whole[first], whole[second]
    assert len(a) >= 16 and len(b) >= 2, {path: len(p) for path, p in whole.items()}
    parent = some_pages(a, 0, 1, 2, 3)
    pages = [*some_pages(a, 10, 11, len(a) - 2, -1), *some_pages(b, 0, -1)]
    # Each of them is its file's page as e2fsprogs reads the file (dump).
    checked = 0
    for path, got in ((first, a), (second, b)):
        debugfs(raw, f"dump {path} {tmp_path / 'file'}")
        checked += check_file_pages(img, got, (tmp_path / "file").read_bytes(), [*parent, *pages])
    assert checked == len(parent) + len(pages)

    # Preferably libc's extent tree block amid its data: a file and its metadata.
    lt = [u for u in kinds["data-and-metadata"] if any(u <= t < u + 4 for t in files[LIBC].tree)]
    usr_bin = min(ext4_files(raw, ["/usr/bin"])["/usr/bin"].data)
    count = re.search(r"^Block count:\s+(\d+)", stats, re.M)
    assert count
    free = int(count.group(1)) // 4 * 4 - 4  # the last whole unit
    assert set(ext4_owners(raw, [0, 1, 2, 3]).values()) == {None}
    assert ext4_in_use(raw, free, 4) == [False] * 4 and not any(img.block_bytes(free * 2))
    rejected = [
        (0, NOT_REGULAR),  # boot block, superblock, GDT
        ((usr_bin - usr_bin % 4) * 2, NOT_REGULAR),  # a directory's
        (free * 2, NOT_REGULAR),  # free, zeros
        (kinds["two-files"][0] * 2, NOT_WHOLE_PAGE),
        ((lt or kinds["data-and-metadata"])[0] * 2, NOT_REGULAR),
        (kinds["one-file-not-a-page"][0] * 2, NOT_WHOLE_PAGE),
    ]
    check_refinement(img, tmp_path, capsys, parent, pages, rejected)
