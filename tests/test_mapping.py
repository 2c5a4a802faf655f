"""Page -> base-image sector mapping: partition offsets, extents, holes, verification."""

import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
from pageshare.classify import PageRecord
from pageshare.ext4map import Extent, lookup, parse_extents, read_paths
from pageshare.mapping import FsKey, Geometry, Placement, page_sector, verify

UUID = "059a5ac684ce4b8f88bf106cefac840b"
BOOT_UUID = "2d6c9b1e5f484a0793e2b8c1f4a6d750"
ROOT = Placement.partition(UUID, 262144)
GEO = Geometry((ROOT,), virtual_size=3 << 30)
REC = PageRecord(pfn=1, kind="file", index=0, ino=12, fstype="ext4",
                 fs_uuid=UUID, disk="vda", start_sect=262144, blkbits=12, state="U----")

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
    assert page_sector(rec, on((UUID, 0), {12: [Extent(0, 500, 4)]}), geo, False) \
        == (501 * 8, "")


def test_each_file_system_at_its_own_offset() -> None:
    # A separate /boot: the same inode number on two file systems, each
    # mapped with its own extents and partition start.
    boot = Placement.partition(BOOT_UUID, 2048, "/boot")
    geo = replace(GEO, filesystems=(ROOT, boot))
    ext = {**on(ROOT.key, {12: [Extent(0, 33000, 10)]}),
           **on(boot.key, {12: [Extent(0, 700, 10)]})}
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
    assert page_sector(rec, on(ROOT.key, {12: [Extent(0, 2001, 4)]}), GEO, False) \
        == (None, "unaligned")


@pytest.mark.parametrize("change,why", [
    ({"fs_uuid": "00" * 16}, "other-fs"),
    ({"start_sect": 2048}, "other-disk"),
    ({"fstype": "vfat"}, "unsupported-fs"),
    ({"state": "UD---"}, "dirty"),
    ({"kind": "anon"}, "not-page-cache"),
    ({"index": 10}, "hole"),
])
def test_rejections(change: dict[str, object], why: str) -> None:
    rec = replace(REC, **change)  # type: ignore[arg-type]
    assert page_sector(rec, on(ROOT.key, {12: [Extent(0, 33000, 10)]}), GEO, False) \
        == (None, why)


def test_unmapped_inode() -> None:
    assert page_sector(REC, {}, GEO, False) == (None, "unmapped")


def test_past_end_of_image() -> None:
    geo = replace(GEO, virtual_size=(262144 + 8) * 512)
    assert page_sector(replace(REC, index=1), on(ROOT.key, {12: [Extent(0, 0, 10)]}), geo,
                       False) \
        == (None, "out-of-range")


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
    subprocess.run(["mkfs.ext4", "-q", "-F", "-N", "4096", "-d", str(root), str(img), "32M"],
                   check=True, capture_output=True)
    listing = subprocess.run(["debugfs", "-R", "ls -l /usr/lib", str(img)],
                             capture_output=True, text=True, check=True).stdout
    names = {int(f[0]): f[-1] for f in map(str.split, listing.splitlines())
             if f and f[-1].startswith("lib")}
    assert len(names) == 3000
    assert read_paths(img, 0, sorted(names)) == {i: f"/usr/lib/{n}" for i, n in names.items()}
