"""Page -> base-image sector mapping: partition offsets, extents, holes, verification."""

import random
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
from pageshare.analysis.classify import PageRecord
from pageshare.analysis.mapping import FsKey, Geometry, Placement, page_sector, verify
from pageshare.image.ext4map import (
    Extent,
    lookup,
    parse_block_maps,
    parse_extents,
    read_extents,
    read_paths,
)

UUID = "059a5ac684ce4b8f88bf106cefac840b"
BOOT_UUID = "2d6c9b1e5f484a0793e2b8c1f4a6d750"
ROOT = Placement.partition(UUID, 262144)
GEO = Geometry((ROOT,), virtual_size=3 << 30)
REC = PageRecord(
    pfn=1,
    kind="file",
    index=0,
    ino=12,
    fstype="ext4",
    fs_uuid=UUID,
    disk="vda",
    start_sect=262144,
    blkbits=12,
    state="U----",
)

DEBUGFS = """debugfs 1.47.0 (5-Feb-2023)
debugfs: ex <12>
Level Entries       Logical      Physical Length Flags
 0/ 0   1/  2     0 -     9 33000 - 33009     10
 0/ 0   2/  2    12 -    15 40000 - 40003      4 Uninit
debugfs: ex <13>
Level Entries       Logical      Physical Length Flags
 0/ 1   1/  1     0 - 4294967295 5000            4294967296
 1/ 1   1/  2     0 -     3  7000 -  7003      4
 1/ 1   2/  2     4 -     7  9000 -  9003      4
debugfs: ex <14>
ex: Inode does not use extents
"""


def on(fs: FsKey, by_ino: dict[int, list[Extent]]) -> dict[tuple[FsKey, int], list[Extent]]:
    """Extents of one file system's inodes, keyed as analyze.py reads them."""
    return {(fs, ino): exts for ino, exts in by_ino.items()}


def test_parse_extents_leaf_only_and_skips_unwritten() -> None:
    ext = parse_extents(DEBUGFS)
    assert ext[12] == [Extent(0, 33000, 10)]
    assert ext[13] == [Extent(0, 7000, 4), Extent(4, 9000, 4)]
    assert ext[14] == []


DEBUGFS_STAT = """debugfs 1.47.0 (5-Feb-2023)
debugfs: stat <12>
Inode: 12   Type: regular    Mode:  0644   Flags: 0x0
BLOCKS:
(0-11):1553-1564, (IND):1565, (12-267):1566-1821, (DIND):1822, (IND):1823, (268-292):1824-1848
TOTAL: 296

debugfs: stat <13>
Inode: 13   Type: regular    Mode:  0644   Flags: 0x80000
EXTENTS:
(0):4678, (1-4):4679-4682, (5-9[u]):4683-4687, (ETB0):4700, (20-21):5000-5001
debugfs: stat <14>
Inode: 14   Type: regular    Mode:  0644   Flags: 0x0
BLOCKS:
(DIND):1850, (IND):1851, (5000-5002):1852-1854
TOTAL: 5

debugfs: stat <15>
Inode: 15   Type: regular    Mode:  0644   Flags: 0x0
"""


def test_parse_block_maps_of_both_kinds() -> None:
    ext = parse_block_maps(DEBUGFS_STAT)
    # Indirect blocks hold no file data; runs that continue on disk are one.
    assert ext[12] == [Extent(0, 1553, 12), Extent(12, 1566, 256), Extent(268, 1824, 25)]
    assert ext[13] == [Extent(0, 4678, 5), Extent(20, 5000, 2)]  # unwritten left out
    assert ext[14] == [Extent(5000, 1852, 3)]
    assert ext[15] == []


def test_ext3_mounted_as_ext4_is_the_same_file_system() -> None:
    geo = replace(GEO, filesystems=(Placement.partition(UUID, 262144, fstype="ext3"),))
    ext = on(geo.filesystems[0].key, {12: [Extent(0, 33000, 10)]})
    for fstype in ("ext3", "ext4", "ext2"):
        assert page_sector(replace(REC, fstype=fstype), ext, geo, False) == (262144 + 33000 * 8, "")


def _random_tree(root: Path) -> dict[str, bytes]:
    """Files whose pages need every kind of map entry: direct, (D)IND, holes."""
    rnd = random.Random(7)
    files = {
        "direct": rnd.randbytes(9000),
        "indirect": rnd.randbytes(300_000),  # past 12 blocks: IND
        "double": rnd.randbytes(1_200_000),  # past 268 1 KiB blocks: DIND
        "tail": rnd.randbytes(4096 * 3 + 17),
    }
    root.mkdir()
    for name, data in files.items():
        (root / name).write_bytes(data)
    with (root / "sparse").open("wb") as f:  # a hole, then data
        f.seek(5 << 20)
        f.write(rnd.randbytes(10_000))
    files["sparse"] = bytes(5 << 20) + (root / "sparse").read_bytes()[5 << 20 :]
    return files


@pytest.mark.parametrize(
    "mkfs,block,upgrade",
    [
        ("mkfs.ext2", 4096, False),
        ("mkfs.ext3", 1024, False),
        ("mkfs.ext3", 4096, False),
        ("mkfs.ext4", 1024, False),
        # ext3 turned into ext4 in place: the old files keep their indirect maps.
        ("mkfs.ext3", 4096, True),
    ],
)
def test_block_maps_lead_to_the_files_bytes(
    tmp_path: Path, mkfs: str, block: int, upgrade: bool
) -> None:
    """Every page read_extents maps holds the file's bytes at that offset on the
    image, whatever the block map's kind and block size; pages it does not map
    are holes (zeros) or have a block that is not contiguous with the others."""
    files = _random_tree(tmp_path / "root")
    img = tmp_path / "fs.img"
    subprocess.run(
        [mkfs, "-q", "-F", "-b", str(block), "-d", str(tmp_path / "root"), str(img), "64M"],
        check=True,
        capture_output=True,
    )
    if upgrade:
        subprocess.run(["tune2fs", "-O", "extent", str(img)], check=True, capture_output=True)
        features = subprocess.run(
            ["dumpe2fs", "-h", str(img)], capture_output=True, text=True, check=True
        ).stdout
        assert " extent" in features
    listing = subprocess.run(
        ["debugfs", "-R", "ls -l /", str(img)], capture_output=True, text=True, check=True
    ).stdout
    inos = {f[-1]: int(f[0]) for f in map(str.split, listing.splitlines()) if f and f[-1] in files}
    ext = read_extents(img, 0, sorted(inos.values()))
    per_page = 4096 // block
    data = img.read_bytes()
    for name, content in files.items():
        mapped = 0
        for index in range((len(content) + 4095) // 4096):
            blocks = [lookup(ext[inos[name]], index * per_page + k) for k in range(per_page)]
            page = content[index * 4096 : (index + 1) * 4096]
            if blocks[0] is None:
                assert page == bytes(len(page)), f"{name} page {index}: data but no block"
                continue
            if any(b != blocks[0] + k for k, b in enumerate(blocks)):
                continue
            at = blocks[0] * block
            assert data[at : at + len(page)] == page, f"{name} page {index} at block {blocks[0]}"
            mapped += 1
        assert mapped > 0, name


def test_lookup_holes() -> None:
    ext = parse_extents(DEBUGFS)[13]
    assert lookup(ext, 0) == 7000 and lookup(ext, 3) == 7003 and lookup(ext, 4) == 9000
    assert lookup(ext, 8) is None
    assert lookup([], 0) is None


def test_partition_offset_and_block_size() -> None:
    ext = on(ROOT.key, {12: [Extent(0, 33000, 10)]})
    sector, why = page_sector(replace(REC, index=3), ext, GEO, False)
    assert why == "" and sector == 262144 + (33000 + 3) * 8


def test_whole_disk_layout() -> None:
    geo = replace(GEO, filesystems=(Placement.partition(UUID, 0),))
    rec = replace(REC, start_sect=0, index=1)
    assert page_sector(rec, on((UUID, 0), {12: [Extent(0, 500, 4)]}), geo, False) == (501 * 8, "")


def test_each_file_system_at_its_own_offset() -> None:
    # A separate /boot: the same inode number on two file systems, each
    # mapped with its own extents and partition start.
    boot = Placement.partition(BOOT_UUID, 2048, "/boot")
    geo = replace(GEO, filesystems=(ROOT, boot))
    ext = {**on(ROOT.key, {12: [Extent(0, 33000, 10)]}), **on(boot.key, {12: [Extent(0, 700, 10)]})}
    assert page_sector(REC, ext, geo, False) == (262144 + 33000 * 8, "")
    brec = replace(REC, fs_uuid=BOOT_UUID, start_sect=2048)
    assert page_sector(brec, ext, geo, False) == (2048 + 700 * 8, "")
    # /boot's UUID at root's offset: a clone of the partition, not the one mapped.
    assert page_sector(replace(brec, start_sect=262144), ext, geo, False) == (None, "other-disk")
    # Not mapped (e.g. skipped as unaligned): never listed.
    assert page_sector(brec, ext, GEO, False) == (None, "other-fs")


def test_logical_volume_segments() -> None:
    # An LV of two linear segments (4 MiB extents): the guest names its device
    # with start_sect 0; the file system's sectors map run by run.
    lv = Placement(UUID, 0, ((0, 8192, 264192), (8192, 8192, 400000)))
    geo = replace(GEO, filesystems=(lv,))
    rec = replace(REC, start_sect=0, disk="dm-0")
    ext = on(lv.key, {12: [Extent(0, 1023, 2)]})
    assert page_sector(rec, ext, geo, False) == (264192 + 1023 * 8, "")
    assert page_sector(replace(rec, index=1), ext, geo, False) == (400000, "")
    # 1 KiB blocks: a page of blocks 4094..4097 (sectors 8188..8195) spans both segments.
    ext = on(lv.key, {12: [Extent(0, 4094, 4)]})
    assert page_sector(replace(rec, blkbits=10), ext, geo, False) == (None, "discontiguous")
    # The PV partition's start_sect is not the LV's.
    assert page_sector(replace(rec, start_sect=262144), ext, geo, False) == (None, "other-disk")


def test_small_blocks_need_four_contiguous() -> None:
    # 1 KiB blocks: page 1 = logical blocks 4..7
    rec = replace(REC, blkbits=10, index=1)
    ok = on(ROOT.key, {12: [Extent(0, 2000, 8)]})
    assert page_sector(rec, ok, GEO, False) == (262144 + 2004 * 2, "")
    split = on(ROOT.key, {12: [Extent(0, 2000, 6), Extent(6, 3000, 2)]})
    assert page_sector(rec, split, GEO, False) == (None, "discontiguous")
    hole = on(ROOT.key, {12: [Extent(0, 2000, 6)]})
    assert page_sector(rec, hole, GEO, False) == (None, "hole")


def test_unaligned_block_is_refused() -> None:
    rec = replace(REC, blkbits=10, index=0)
    # 1 KiB blocks starting at an odd block: sector not a multiple of 8
    assert page_sector(rec, on(ROOT.key, {12: [Extent(0, 2001, 4)]}), GEO, False) == (
        None,
        "unaligned",
    )


@pytest.mark.parametrize(
    "change,why",
    [
        ({"fs_uuid": "00" * 16}, "other-fs"),
        ({"start_sect": 2048}, "other-disk"),
        ({"fstype": "vfat"}, "unsupported-fs"),
        ({"fstype": "xfs"}, "other-fs"),
        ({"state": "UD---"}, "dirty"),
        ({"kind": "anon"}, "not-page-cache"),
        ({"index": 10}, "hole"),
    ],
)
def test_rejections(change: dict[str, object], why: str) -> None:
    rec = replace(REC, **change)  # type: ignore[arg-type]
    assert page_sector(rec, on(ROOT.key, {12: [Extent(0, 33000, 10)]}), GEO, False) == (None, why)


def test_unmapped_inode() -> None:
    assert page_sector(REC, {}, GEO, False) == (None, "unmapped")


def test_past_end_of_image() -> None:
    geo = replace(GEO, virtual_size=(262144 + 8) * 512)
    assert page_sector(
        replace(REC, index=1), on(ROOT.key, {12: [Extent(0, 0, 10)]}), geo, False
    ) == (None, "out-of-range")


def test_bdev_pages_only_with_metadata() -> None:
    rec = replace(REC, kind="bdev", index=5, fstype="bdev")
    assert page_sector(rec, {}, GEO, False) == (None, "metadata")
    assert page_sector(rec, {}, GEO, True) == (262144 + 40, "")
    assert page_sector(replace(rec, disk="vdb"), {}, GEO, True) == (None, "other-disk")


def test_verify() -> None:
    disk = {8: b"\x01" * 4096}
    assert verify(8, b"\x01" * 4096, disk.__getitem__) == "stable"
    assert verify(8, b"\x02" * 4096, disk.__getitem__) == "mismatch"
    assert verify(8, bytes(4096), disk.__getitem__) == "zero"
    assert verify(8, None, disk.__getitem__) == "not-in-dump"


def test_read_paths_of_thousands_of_inodes(tmp_path: Path) -> None:
    """A workload that reads thousands of files: every inode gets its path
    (one long ncheck line made debugfs run its tail as a command)."""
    root = tmp_path / "root"
    d = root / "usr" / "lib"
    d.mkdir(parents=True)
    for i in range(3000):
        (d / f"lib{i:05d}.so").write_bytes(b"x")
    img = tmp_path / "fs.ext4"
    subprocess.run(
        ["mkfs.ext4", "-q", "-F", "-N", "4096", "-d", str(root), str(img), "32M"],
        check=True,
        capture_output=True,
    )
    listing = subprocess.run(
        ["debugfs", "-R", "ls -l /usr/lib", str(img)], capture_output=True, text=True, check=True
    ).stdout
    names = {
        int(f[0]): f[-1]
        for f in map(str.split, listing.splitlines())
        if f and f[-1].startswith("lib")
    }
    assert len(names) == 3000
    assert read_paths(img, 0, sorted(names)) == {i: f"/usr/lib/{n}" for i, n in names.items()}
