"""btrfs block maps read with btrfs-progs' dump-tree: parsing, and real
file systems made here.

The file systems are made by mkfs.btrfs --rootdir (no mounting).  Its
btrfs-progs (6.2, Debian 12) has no --compress, so compressed extents are
written by the kernel of the libguestfs appliance (a mount with
compress-force), which also writes a file into a second data chunk whose
device offset differs from its logical address.  Every mapped block's bytes
on disk are checked against the file's bytes at that offset.
"""

import os
import struct
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
from analysis_failures import assert_clean_failure
from conftest import run_analyze
from fake_image_tree import FakeImage
from image_trees import DEBIAN_TREE
from pageshare.analysis import analyze, workload
from pageshare.analysis.classify import PageRecord
from pageshare.analysis.mapping import Candidate, Geometry, Placement, map_page
from pageshare.errors import UserError
from pageshare.image import bootfiles, btrfsmap, fslayout
from pageshare.image.btrfsmap import BtrfsUnsupported, Chunk, Subvolume
from pageshare.image.ext4map import Extent, fs_image
from pageshare.image.image_inspect import inspect_image, probe_format

CHUNKS = """\
chunk tree
leaf 22036480 items 4 free space 15781 generation 6 owner CHUNK_TREE
\titem 0 key (DEV_ITEMS DEV_ITEM 1) itemoff 16185 itemsize 98
\t\tdevid 1 total_bytes 209715200 bytes_used 92274688
\titem 1 key (FIRST_CHUNK_TREE CHUNK_ITEM 13631488) itemoff 16105 itemsize 80
\t\tlength 8388608 owner 2 stripe_len 65536 type DATA|single
\t\tio_align 65536 io_width 65536 sector_size 4096
\t\tnum_stripes 1 sub_stripes 1
\t\t\tstripe 0 devid 1 offset 13631488
\t\t\tdev_uuid a29ca65d-dee7-4a65-958c-08ddcd0d3b0b
\titem 2 key (FIRST_CHUNK_TREE CHUNK_ITEM 30408704) itemoff 15881 itemsize 112
\t\tlength 33554432 owner 2 stripe_len 65536 type METADATA|DUP
\t\tnum_stripes 2 sub_stripes 1
\t\t\tstripe 0 devid 1 offset 38797312
\t\t\tdev_uuid a29ca65d-dee7-4a65-958c-08ddcd0d3b0b
\t\t\tstripe 1 devid 1 offset 72351744
\t\t\tdev_uuid a29ca65d-dee7-4a65-958c-08ddcd0d3b0b
\titem 3 key (FIRST_CHUNK_TREE CHUNK_ITEM 298844160) itemoff 15801 itemsize 80
\t\tlength 209715200 owner 2 stripe_len 65536 type DATA|single
\t\tnum_stripes 1 sub_stripes 1
\t\t\tstripe 0 devid 1 offset 105906176
\t\t\tdev_uuid a29ca65d-dee7-4a65-958c-08ddcd0d3b0b
"""

FS = """\
fs tree key (FS_TREE ROOT_ITEM 0)
leaf 30457856 items 12 free space 15000 generation 8 owner FS_TREE
\titem 0 key (256 INODE_REF 256) itemoff 16111 itemsize 12
\t\tindex 0 namelen 2 name: ..
\titem 1 key (257 INODE_REF 256) itemoff 16000 itemsize 13
\t\tindex 2 namelen 3 name: usr
\titem 2 key (258 INODE_REF 257) itemoff 15900 itemsize 14
\t\tindex 2 namelen 8 name: two word
\titem 3 key (258 EXTENT_DATA 0) itemoff 15370 itemsize 53
\t\tgeneration 7 type 1 (regular)
\t\textent data disk byte 14680064 nr 303104
\t\textent data offset 0 nr 303104 ram 303104
\t\textent compression 0 (none)
\titem 4 key (258 EXTENT_DATA 303104) itemoff 15300 itemsize 53
\t\tgeneration 7 type 1 (regular)
\t\textent data disk byte 0 nr 0
\t\textent data offset 0 nr 8192 ram 8192
\t\textent compression 0 (none)
\titem 5 key (258 EXTENT_DATA 311296) itemoff 15200 itemsize 53
\t\tgeneration 8 type 1 (regular)
\t\textent data disk byte 298844160 nr 1048576
\t\textent data offset 65536 nr 16384 ram 1048576
\t\textent compression 0 (none)
leaf 30474240 items 8 free space 15000 generation 8 owner FS_TREE
\titem 0 key (258 EXTENT_DATA 327680) itemoff 15100 itemsize 53
\t\tgeneration 8 type 2 (prealloc)
\t\textent data disk byte 299892736 nr 4096
\t\textent data offset 0 nr 4096 ram 4096
\t\textent compression 0 (none)
\titem 1 key (259 INODE_REF 256) itemoff 15050 itemsize 15
\t\tindex 3 namelen 5 name: small
\titem 2 key (259 EXTENT_DATA 0) itemoff 15000 itemsize 27
\t\tgeneration 7 type 0 (inline)
\t\tinline extent data size 6 ram_bytes 6 compression 0 (none)
\titem 3 key (260 EXTENT_DATA 0) itemoff 14900 itemsize 53
\t\tgeneration 8 type 1 (regular)
\t\textent data disk byte 15286272 nr 12288
\t\textent data offset 0 nr 131072 ram 131072
\t\textent compression 1 (zlib)
\titem 4 key (261 EXTENT_DATA 0) itemoff 14800 itemsize 53
\t\tgeneration 8 type 1 (regular)
\t\textent data disk byte 13631488 nr 4096
\t\textent data offset 0 nr 4096 ram 4096
\t\textent compression 0 (none)
\titem 5 key (EXTENT_CSUM EXTENT_CSUM 13631488) itemoff 14700 itemsize 4
\t\trange start 13631488 end 13635584 length 4096
"""


def test_parse_chunks_stripe_zero_by_logical_address() -> None:
    chunks = btrfsmap.parse_chunks(CHUNKS)
    assert chunks == [
        Chunk(13631488, 8388608, "single", "DATA", 13631488, 1),
        Chunk(30408704, 33554432, "DUP", "METADATA", 38797312, 1),
        Chunk(298844160, 209715200, "single", "DATA", 105906176, 1),
    ]
    btrfsmap.check_profiles(chunks)
    assert btrfsmap.to_physical(chunks, 298844160 + 4096, 8192) == 105906176 + 4096
    with pytest.raises(RuntimeError, match="in no chunk"):
        btrfsmap.to_physical(chunks, 13631488 + 8388608 - 4096, 8192)  # runs past its chunk
    with pytest.raises(RuntimeError, match="in no chunk"):
        btrfsmap.to_physical(chunks, 4096, 4096)


def test_parse_extents_skips_and_counts_what_disk_blocks_cannot_serve() -> None:
    chunks = btrfsmap.parse_chunks(CHUNKS)
    ext, skipped = btrfsmap.parse_file_extents(FS, chunks, 4096, {258, 259, 260, 262})
    # 258: a regular extent in the identity-mapped chunk, a hole (disk byte
    # 0), a part (offset 64 KiB, 16 KiB) of an extent in the chunk whose
    # device offset differs, and a prealloc extent (zeros) left out.
    assert ext[258] == [
        Extent(0, 14680064 // 4096, 74),
        Extent(311296 // 4096, (105906176 + 65536) // 4096, 4),
    ]
    assert ext[259] == [] and ext[260] == [] and ext[262] == []
    assert 261 not in ext  # not asked for
    assert (skipped.inline_extents, skipped.inline_bytes) == (1, 6)
    assert (skipped.compressed_extents, skipped.compressed_bytes) == (1, 131072)
    assert skipped.inodes == {259, 260}
    # Which of the file's sectors they hold, for the pages' verdicts.
    assert skipped.ranges == {259: [(0, 1, "inline")], 260: [(0, 32, "compressed")]}
    everything, _ = btrfsmap.parse_file_extents(FS, chunks, 4096)
    assert everything[261] == [Extent(0, 13631488 // 4096, 1)]


def test_parse_paths_walks_inode_refs() -> None:
    assert btrfsmap.parse_paths(FS, [258, 259, 257, 999]) == {
        258: "/usr/two word",
        259: "/small",
        257: "/usr",
    }


def test_unaligned_or_unknown_extents_are_errors() -> None:
    chunks = btrfsmap.parse_chunks(CHUNKS)
    bad = FS.replace("extent data offset 65536 nr 16384", "extent data offset 512 nr 16384")
    with pytest.raises(RuntimeError, match="not 4096-byte aligned"):
        btrfsmap.parse_file_extents(bad, chunks, 4096, {258})
    garbled = FS.replace("extent compression 1 (zlib)", "something new")
    with pytest.raises(RuntimeError, match="inode 260 at 0 not understood"):
        btrfsmap.parse_file_extents(garbled, chunks, 4096, {260})


def test_raid_profiles_and_several_devices_are_refused() -> None:
    raid = CHUNKS.replace("type DATA|single\n\t\tio_align", "type DATA|RAID1\n\t\tio_align")
    with pytest.raises(BtrfsUnsupported, match=r"RAID1 profile.*one device"):
        btrfsmap.check_profiles(btrfsmap.parse_chunks(raid))
    with pytest.raises(BtrfsUnsupported, match="over 2 devices"):
        btrfsmap.check_single_device({"num_devices": "2"})
    btrfsmap.check_single_device({"num_devices": "1"})


def test_a_real_raid1_btrfs_is_refused(tmp_path: Path) -> None:
    devs = [tmp_path / "a.img", tmp_path / "b.img"]
    for d in devs:
        with open(d, "wb") as f:
            f.truncate(200 << 20)
    subprocess.run(
        ["mkfs.btrfs", "-q", "-d", "raid1", "-m", "raid1", *map(str, devs)],
        check=True,
        capture_output=True,
    )
    with pytest.raises(BtrfsUnsupported, match="over 2 devices"):
        btrfsmap.read_extents(devs[0], [256])


def _tree(tmp: Path) -> dict[str, bytes]:
    files = {
        "big": os.urandom(300_000),
        "sub/deep": os.urandom(70_000),
        "small": b"inline\n",
        "empty": b"",
    }
    for rel, data in files.items():
        (tmp / "root" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp / "root" / rel).write_bytes(data)
    return files


def _inodes(image: Path) -> dict[str, int]:
    """path -> inode of the top-level subvolume, from its INODE_REFs."""
    out = subprocess.run(
        ["btrfs", "inspect-internal", "dump-tree", "-t", "5", str(image)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    candidates = sorted(
        {int(line.split("(")[1].split()[0]) for line in out.splitlines() if " INODE_REF " in line}
    )
    return {p.lstrip("/"): i for i, p in btrfsmap.parse_paths(out, candidates).items()}


def _check_bytes(image: Path, ext: list[Extent], data: bytes, base: int = 0) -> int:
    """Every mapped block's bytes on disk equal the file's bytes at its offset."""
    blocks = 0
    with open(image, "rb") as f:
        for e in ext:
            for k in range(e.length):
                f.seek(base + (e.physical + k) * 4096)
                want = data[(e.logical + k) * 4096 : (e.logical + k + 1) * 4096]
                assert f.read(len(want)) == want, f"block {e.logical + k}"
                blocks += 1
    return blocks


def test_real_btrfs_made_by_mkfs(tmp_path: Path) -> None:
    files = _tree(tmp_path)
    img = tmp_path / "btrfs.img"
    with open(img, "wb") as f:
        f.truncate(200 << 20)
    subprocess.run(
        ["mkfs.btrfs", "-q", "-r", str(tmp_path / "root"), str(img)],
        check=True,
        capture_output=True,
    )
    inos = _inodes(img)
    assert set(files) <= set(inos)
    ext, skipped = btrfsmap.read_extents(img, [inos[p] for p in files])
    assert _check_bytes(img, ext[inos["big"]], files["big"]) == 74
    assert _check_bytes(img, ext[inos["sub/deep"]], files["sub/deep"]) == 18
    assert ext[inos["small"]] == [] and ext[inos["empty"]] == []
    assert skipped.inodes == {inos["small"]} and skipped.inline_bytes == len(files["small"])
    assert skipped.compressed_extents == 0
    assert btrfsmap.read_paths(img, [inos["sub/deep"], inos["big"]]) == {
        inos["sub/deep"]: "/sub/deep",
        inos["big"]: "/big",
    }
    # The same through a copy of a partition, as the analysis would give dump-tree.
    disk = tmp_path / "disk.raw"
    with open(disk, "wb") as f:
        f.truncate(300 << 20)
    subprocess.run(
        ["dd", f"if={img}", f"of={disk}", "bs=1M", "seek=1", "conv=notrunc,sparse", "status=none"],
        check=True,
    )
    copy, offset = fs_image(disk, ((0, (200 << 20) // 512, 2048),), tmp_path / "fs.img", copy=True)
    assert offset == 0
    assert btrfsmap.read_extents(copy, [inos["big"]])[0] == {inos["big"]: ext[inos["big"]]}
    # Blocks count from the file system's start: on the disk they are 1 MiB further.
    assert _check_bytes(disk, ext[inos["big"]], files["big"], base=1 << 20) == 74


@pytest.mark.vm
def test_compressed_extents_and_a_second_data_chunk(tmp_path: Path) -> None:
    """Written by the appliance's kernel: compressed extents are counted and not
    mapped; a file in a later data chunk maps through the chunk tree."""
    import guestfs  # Debian's python3-guestfs, as image_inspect uses it

    files = _tree(tmp_path)
    img = tmp_path / "btrfs.img"
    with open(img, "wb") as f:
        f.truncate(300 << 20)
    subprocess.run(
        ["mkfs.btrfs", "-q", "-r", str(tmp_path / "root"), str(img)],
        check=True,
        capture_output=True,
    )
    later = os.urandom(24 << 20)  # more than mkfs' first 8 MiB data chunk
    text = b"".join(b"line %d of a file that compresses well\n" % i for i in range(20000))
    (tmp_path / "later").write_bytes(later)
    (tmp_path / "text").write_bytes(text)
    g = guestfs.GuestFS(python_return_dict=True)
    try:
        g.set_backend_settings(["force_tcg"])
        g.add_drive_opts(str(img), format="raw", readonly=0)
        g.launch()
        g.mount("/dev/sda", "/")
        g.upload(str(tmp_path / "later"), "/later")
        g.umount_all()
        g.mount_options("compress-force=zlib", "/dev/sda", "/")
        g.upload(str(tmp_path / "text"), "/text")
        g.umount_all()
        g.shutdown()
    finally:
        g.close()
    inos = _inodes(img)
    ext, skipped = btrfsmap.read_extents(img, [inos["later"], inos["text"], inos["big"]])
    assert ext[inos["text"]] == []
    assert skipped.compressed_extents >= 2
    assert skipped.compressed_bytes == -(-len(text) // 4096) * 4096  # whole sectors
    assert skipped.inodes == {inos["text"]}
    assert _check_bytes(img, ext[inos["later"]], later) == len(later) // 4096
    assert _check_bytes(img, ext[inos["big"]], files["big"]) == 74
    out = subprocess.run(
        ["btrfs", "inspect-internal", "dump-tree", "-t", "chunk", str(img)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    moved = [c for c in btrfsmap.parse_chunks(out) if c.kind == "DATA" and c.logical != c.physical]
    assert moved, "no data chunk whose device offset differs from its logical address"
    assert any(
        moved[0].physical <= e.physical * 4096 < moved[0].physical + moved[0].length
        for e in ext[inos["later"]]
    )


# --- subvolumes --------------------------------------------------------------------

# `dump-tree -t root` of a btrfs made in the appliance (lines of no interest
# here left out): @rootfs (256) at the top level, the default subvolume;
# machines (257) in @rootfs's directory /var/lib (inode 258); @snap (258), a
# snapshot of @rootfs.
ROOT_TREE = """\
root tree
leaf 31014912 items 20 free space 11019 generation 11 owner ROOT_TREE
\titem 0 key (EXTENT_TREE ROOT_ITEM 0) itemoff 15844 itemsize 439
\t\tgeneration 11 root_dirid 0 bytenr 31031296 byte_limit 0 bytes_used 16384
\titem 2 key (FS_TREE INODE_REF 6) itemoff 15388 itemsize 17
\t\tindex 0 namelen 7 name: default
\titem 3 key (FS_TREE ROOT_ITEM 0) itemoff 14949 itemsize 439
\t\tgeneration 9 root_dirid 256 bytenr 30867456 byte_limit 0 bytes_used 16384
\titem 4 key (FS_TREE ROOT_REF 256) itemoff 14924 itemsize 25
\t\troot ref key dirid 256 sequence 2 name @rootfs
\titem 5 key (FS_TREE ROOT_REF 258) itemoff 14901 itemsize 23
\t\troot ref key dirid 256 sequence 3 name @snap
\titem 7 key (ROOT_TREE_DIR INODE_REF 6) itemoff 14729 itemsize 12
\t\tindex 0 namelen 2 name: ..
\titem 8 key (ROOT_TREE_DIR DIR_ITEM 2378154706) itemoff 14692 itemsize 37
\t\tlocation key (256 ROOT_ITEM 0) type DIR
\t\ttransid 0 data_len 0 name_len 7
\t\tname: default
\titem 10 key (UUID_TREE ROOT_ITEM 0) itemoff 13814 itemsize 439
\t\tgeneration 9 root_dirid 0 bytenr 30883840 byte_limit 0 bytes_used 16384
\titem 12 key (256 ROOT_ITEM 0) itemoff 12936 itemsize 439
\t\tgeneration 9 root_dirid 256 bytenr 30769152 byte_limit 0 bytes_used 16384
\titem 13 key (256 ROOT_BACKREF 5) itemoff 12911 itemsize 25
\t\troot backref key dirid 256 sequence 2 name @rootfs
\titem 14 key (256 ROOT_REF 257) itemoff 12885 itemsize 26
\t\troot ref key dirid 258 sequence 2 name machines
\titem 15 key (257 ROOT_ITEM 0) itemoff 12446 itemsize 439
\t\tgeneration 10 root_dirid 256 bytenr 30982144 byte_limit 0 bytes_used 16384
\titem 16 key (257 ROOT_BACKREF 256) itemoff 12420 itemsize 26
\t\troot backref key dirid 258 sequence 2 name machines
\titem 17 key (258 ROOT_ITEM 9) itemoff 11981 itemsize 439
\t\tgeneration 9 root_dirid 256 bytenr 30834688 byte_limit 0 bytes_used 16384
\titem 18 key (258 ROOT_BACKREF 5) itemoff 11958 itemsize 23
\t\troot backref key dirid 256 sequence 3 name @snap
\titem 19 key (DATA_RELOC_TREE ROOT_ITEM 0) itemoff 11519 itemsize 439
\t\tgeneration 5 root_dirid 256 bytenr 30523392 byte_limit 0 bytes_used 16384
"""


def test_parse_subvolumes_their_places_and_the_default() -> None:
    subvols, default = btrfsmap.parse_subvolumes(ROOT_TREE)
    assert subvols == [
        Subvolume(5),
        Subvolume(256, 5, 256, "@rootfs"),
        Subvolume(257, 256, 258, "machines"),
        Subvolume(258, 5, 256, "@snap"),
    ]
    assert default == 256
    without = ROOT_TREE.replace(
        "location key (256 ROOT_ITEM 0)", "location key (FS_TREE ROOT_ITEM 18446744073709551615)"
    )
    assert btrfsmap.parse_subvolumes(without)[1] == 5
    asked: list[tuple[int, int]] = []

    def dir_path(tree: int, dirid: int) -> str | None:
        asked.append((tree, dirid))
        return "/var/lib" if (tree, dirid) == (256, 258) else None

    assert btrfsmap.subvolume_paths(subvols, dir_path) == {
        5: "",
        256: "@rootfs",
        257: "@rootfs/var/lib/machines",
        258: "@snap",
    }
    assert asked == [(256, 258)]  # subvolumes in a root directory need no lookup
    # A subvolume whose directory is not found (being deleted) has no path.
    assert 257 not in btrfsmap.subvolume_paths(subvols, lambda t, d: None)


REC = PageRecord(
    pfn=1,
    kind="file",
    index=2,
    ino=300,
    fstype="btrfs",
    fs_uuid="d61e0c15-e3ef-45fb-9dec-31107edbfefa",
    start_sect=0,
    blkbits=12,
    state="U---",
)
BTRFS = Placement.partition("d61e0c15e3ef45fb9dec31107edbfefa", 2048, "/", "btrfs")
GEO = Geometry((Placement(BTRFS.uuid, 0, BTRFS.runs, "/", "btrfs", (("@rootfs", "/"),)),), 1 << 30)


def test_a_btrfs_page_keeps_the_first_subvolume_whose_block_verifies() -> None:
    key = (GEO.filesystems[0].key, 300)
    disk = {2048 + 8 * 100: b"a" * 4096, 2048 + 8 * 200: b"b" * 4096}
    read = disk.__getitem__
    same_ino = [Candidate(256, [Extent(0, 98, 4)]), Candidate(258, [Extent(0, 198, 4)])]
    # Inode 300 of tree 256 has other bytes there; that of 258 has the page's.
    assert map_page(REC, b"b" * 4096, read, {}, GEO, False, {key: same_ino}) == (
        2048 + 8 * 200,
        "stable",
        258,
    )
    assert map_page(REC, b"a" * 4096, read, {}, GEO, False, {key: same_ino}) == (
        2048 + 8 * 100,
        "stable",
        256,
    )
    # None verifies: a mismatch says more than a hole, compressed data most.
    hole = Candidate(257, [Extent(5, 1000, 1)])
    assert map_page(REC, b"c" * 4096, read, {}, GEO, False, {key: [hole, *same_ino]}) == (
        2048 + 8 * 100,
        "mismatch",
        256,
    )
    squeezed = Candidate(259, [], ((0, 32, "compressed"),))
    assert map_page(REC, b"c" * 4096, read, {}, GEO, False, {key: [hole, same_ino[0], squeezed]})[
        1:
    ] == ("compressed", 259)
    tiny = Candidate(256, [], ((0, 1, "inline"),))
    assert map_page(replace(REC, index=0), b"c" * 4096, read, {}, GEO, False, {key: [tiny]}) == (
        None,
        "inline",
        256,
    )
    assert map_page(REC, b"c" * 4096, read, {}, GEO, False, {key: [tiny]})[1] == "hole"
    # No subvolume has the inode; another file system; a page of another btrfs.
    assert map_page(REC, b"c" * 4096, read, {}, GEO, False, {})[:2] == (None, "unmapped")
    assert map_page(
        replace(REC, fstype="ext4"), b"b" * 4096, read, {}, GEO, False, {key: same_ino}
    )[:2] == (None, "other-fs")
    assert map_page(
        replace(REC, fs_uuid="00" * 16), b"b" * 4096, read, {}, GEO, False, {key: same_ino}
    )[:2] == (None, "other-fs")
    # btrfs' own metadata is cached as pages of its btree inode (1).
    assert map_page(replace(REC, ino=1), b"b" * 4096, read, {}, GEO, True, {})[:2] == (
        None,
        "metadata",
    )
    # A dirty page is not listed whichever subvolume it is in.
    assert map_page(replace(REC, state="UD--"), b"b" * 4096, read, {}, GEO, False, {key: same_ino})[
        :2
    ] == (None, "dirty")


def test_placements_merge_the_mounts_of_one_btrfs() -> None:
    def fs(mp: str, uuid: str, subvol: str, fstype: str = "btrfs") -> fslayout.MappedFs:
        return fslayout.MappedFs(
            mp,
            "/dev/sda1",
            1,
            2048,
            fstype,
            uuid,
            4096,
            "devices=1",
            ((0, 1 << 20, 2048),),
            0,
            subvol=subvol,
        )

    a, b = "d61e0c15-e3ef-45fb-9dec-31107edbfefa", "0c7e2f0d-3d4b-4b8e-9a51-5b8c2f3c9d11"
    placed = analyze.placements((fs("/", a, "@rootfs"), fs("/home", a, "@home"), fs("/srv", b, "")))
    assert [(p.mountpoint, p.subvols) for p in placed] == [
        ("/", (("@rootfs", "/"), ("@home", "/home"))),
        ("/srv", (("", "/srv"),)),
    ]
    paths = {5: "", 256: "@rootfs", 257: "@home", 258: "@rootfs/var/lib/machines"}
    assert analyze.mounted_trees(placed[0], 5, paths) == [(256, "/"), (257, "/home")]
    # "" is the default subvolume; a subvolume the file system lacks is left out.
    assert analyze.mounted_trees(placed[1], 256, paths) == [(256, "/srv")]
    gone = Placement(placed[0].uuid, 0, placed[0].runs, "/", "btrfs", (("@old", "/"),))
    assert analyze.mounted_trees(gone, 5, paths) == []


def test_split_btrfsvol() -> None:
    assert fslayout.split_btrfsvol("btrfsvol:/dev/sda1/@rootfs") == ("/dev/sda1", "@rootfs")
    assert fslayout.split_btrfsvol("btrfsvol:/dev/sda2/@/var/lib") == ("/dev/sda2", "@/var/lib")
    assert fslayout.split_btrfsvol("btrfsvol:/dev/vg0/root/@") == ("/dev/vg0/root", "@")
    assert fslayout.split_btrfsvol("btrfsvol:/dev/mapper/luks-1/@") == ("/dev/mapper/luks-1", "@")
    assert fslayout.split_btrfsvol("/dev/sda1") == ("/dev/sda1", "")


def test_a_btrfsvol_on_a_device_the_image_lacks_is_found_by_its_uuid() -> None:
    class Disk(BtrfsDisk):
        def list_devices(self) -> list[str]:
            return ["/dev/sda"]

        def list_partitions(self) -> list[str]:
            return ["/dev/sda1", "/dev/sda15"]

        def lvs(self) -> list[str]:
            return []

        def vfs_type(self, dev: str) -> str:
            return {"/dev/sda": "", "/dev/sda15": "vfat"}.get(dev, "btrfs")

    mps = {"/": "btrfsvol:/dev/sdb1/@rootfs", "/boot/efi": "/dev/sda15"}
    assert fslayout.canonical_btrfsvols(Disk(1), mps) == {
        "/": "btrfsvol:/dev/sda1/@rootfs",
        "/boot/efi": "/dev/sda15",
    }
    good = {"/": "btrfsvol:/dev/sda1/@rootfs"}
    assert fslayout.canonical_btrfsvols(Disk(1), good) == good


def test_kernel_in_a_subvolume_through_grub() -> None:
    # grub.cfg on a btrfs names files from its top level: /@rootfs/boot/...
    v = "6.1.0-56-cloud-amd64"
    cfg = (
        f"menuentry 'Debian GNU/Linux' {{\n\tlinux\t/@rootfs/boot/vmlinuz-{v} "
        f"root=UUID=x ro rootflags=subvol=@rootfs\n\tinitrd\t/@rootfs/boot/initrd.img-{v}"
        "\n}\n"
    )
    g = FakeImage(
        {
            "/boot/grub/grub.cfg": cfg,
            f"/boot/vmlinuz-{v}": "",
            f"/boot/initrd.img-{v}": "",
            "/boot/vmlinuz-6.1.0-10-cloud-amd64": "",
        }
    )
    assert bootfiles.find_kernel(g, {"@rootfs": "/"}) == (
        f"/boot/vmlinuz-{v}",
        f"/boot/initrd.img-{v}",
        v,
    )
    # A /boot subvolume of its own, mounted on /boot.
    assert (
        bootfiles.resolve(g, f"/@boot/vmlinuz-{v}", {"@boot": "/boot", "@rootfs": "/"})
        == f"/boot/vmlinuz-{v}"
    )


def test_the_guests_mount_the_root_subvolume() -> None:
    assert "root=UUID=u rootflags=subvol=@rootfs ro " in workload.kernel_cmdline(
        "u", "subvol=@rootfs"
    )
    assert "rootflags" not in workload.kernel_cmdline("u")


@pytest.mark.vm
def test_candidates_and_paths_across_subvolumes_and_a_snapshot(tmp_path: Path) -> None:
    """A real btrfs with @rootfs (the default), a subvolume nested in its /var/lib
    and a snapshot of it: each inode number's candidates, and guest paths."""
    import guestfs  # Debian's python3-guestfs, as image_inspect uses it

    img = tmp_path / "btrfs.img"
    with open(img, "wb") as f:
        f.truncate(200 << 20)
    subprocess.run(["mkfs.btrfs", "-q", str(img)], check=True, capture_output=True)
    data = {"file": os.urandom(20480), "machine": os.urandom(12288)}
    g = guestfs.GuestFS(python_return_dict=True)
    try:
        g.set_backend_settings(["force_tcg"])
        g.add_drive_opts(str(img), format="raw", readonly=0)
        g.launch()
        g.mount("/dev/sda", "/")
        g.btrfs_subvolume_create("/@rootfs")
        g.mkdir_p("/@rootfs/var/lib")
        g.btrfs_subvolume_create("/@rootfs/var/lib/machines")
        g.write("/@rootfs/var/lib/machines/data", data["machine"])
        g.write("/@rootfs/file", data["file"])
        g.btrfs_subvolume_snapshot("/@rootfs", "/@snap")
        g.btrfs_subvolume_set_default(256, "/")
        g.umount_all()
        g.shutdown()
    finally:
        g.close()
    _, default, paths = btrfsmap.read_subvolumes(img)
    assert default == 256
    assert paths == {5: "", 256: "@rootfs", 257: "@rootfs/var/lib/machines", 258: "@snap"}
    # Mounted as the default subvolume on /: inode 257 is /var in @rootfs (no
    # data) and /data in machines; 259 is /file in @rootfs and in the snapshot.
    fs = Placement.partition("x", 0, "/", "btrfs")
    fs = Placement(fs.uuid, 0, fs.runs, "/", "btrfs", (("", "/"),))
    cands = analyze._btrfs_candidates(fs, img, [257, 259])
    assert [c.tree for c in cands[257]] == [257]
    assert [c.tree for c in cands[259]] == [256, 258]  # the mounted one first
    assert cands[259][0].extents == cands[259][1].extents  # the snapshot shares them
    assert _check_bytes(img, cands[259][0].extents, data["file"]) == 5
    assert _check_bytes(img, cands[257][0].extents, data["machine"]) == 3
    assert analyze._btrfs_paths(fs, img, {(256, 259), (257, 257), (258, 259)}) == {
        (256, 259): "/file",
        (257, 257): "/var/lib/machines/data",
    }  # @snap is not mounted
    on_snap = Placement(fs.uuid, 0, fs.runs, "/", "btrfs", (("", "/"), ("@snap", "/snap")))
    assert analyze._btrfs_paths(on_snap, img, {(258, 259)}) == {(258, 259): "/snap/file"}


# --- what the analysis does with a btrfs ------------------------------------------------


def _btrfs_super(devices: int) -> bytes:
    sb = bytearray(4096)
    sb[0x40:0x48] = b"_BHRfS_M"
    struct.pack_into("<QQI", sb, 0x88 - 8, 0, devices, 4096)  # root_dir, num_devices, sectorsize
    return bytes(sb)


class BtrfsDisk:
    """libguestfs' answers about a disk with a btrfs on partition 1 (and on 2)."""

    def __init__(self, devices: int) -> None:
        self.devices = devices

    def part_list(self, dev: str) -> list[dict[str, int]]:
        return [
            {"part_num": n, "part_start": s * 512, "part_size": 2048 * 512}
            for n, s in ((1, 2048), (2, 4096))
        ]

    def vfs_type(self, dev: str) -> str:
        return "btrfs"

    def vfs_uuid(self, dev: str) -> str:
        return "d61e0c15-e3ef-45fb-9dec-31107edbfefa"

    def pread_device(self, dev: str, size: int, offset: int) -> bytes:
        assert (size, offset) == (4096, 65536)
        return _btrfs_super(self.devices)


def test_a_single_device_btrfs_is_mapped_from_its_subvolume() -> None:
    mapped, skipped = fslayout.survey(
        BtrfsDisk(1), {"/": "btrfsvol:/dev/sda1/@rootfs", "/srv": "/dev/sda2"}, 1 << 20
    )
    assert skipped == []
    assert [
        (m.mountpoint, m.device, m.subvol, m.start_sector, m.guest_start_sector, m.block_size)
        for m in mapped
    ] == [("/", "/dev/sda1", "@rootfs", 2048, 0, 4096), ("/srv", "/dev/sda2", "", 4096, 0, 4096)]
    assert fslayout.root_must_map(Path("g.qcow2"), mapped[0]) is mapped[0]


def test_a_btrfs_over_several_devices_is_skipped_and_as_root_refused() -> None:
    mapped, skipped = fslayout.survey(
        BtrfsDisk(3), {"/": "btrfsvol:/dev/sda1/@", "/srv": "/dev/sda2"}, 1 << 20
    )
    assert mapped == []
    assert [(s.mountpoint, s.device, s.fstype) for s in skipped] == [
        ("/", "/dev/sda1", "btrfs"),
        ("/srv", "/dev/sda2", "btrfs"),
    ]
    why = "btrfs over 3 devices (a multi-device or RAID pool)"
    assert all(why in s.reason and "only a btrfs of one device" in s.reason for s in skipped)
    with pytest.raises(UserError) as e:
        fslayout.root_must_map(Path("g.qcow2"), skipped[0])
    assert (
        "g.qcow2: root file system is btrfs on /dev/sda1, which cannot be analyzed: over 3 "
        "devices (a multi-device or RAID pool)" in e.value.message
    )
    assert "root btrfs lives on one device" in e.value.hint


def _btrfs_disk(tmp: Path, files: dict[str, str], root_fs: str) -> Path:
    """A raw disk with GPT partitions of 128 MiB (mkfs.btrfs makes no smaller file system)
    at 1 MiB (the root, root_fs) and at 129 MiB (a btrfs)."""
    tree = tmp / "tree"
    for rel, content in files.items():
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_text(content)
    disk = tmp / "disk.raw"
    with open(disk, "wb") as f:
        f.truncate(300 << 20)
    subprocess.run(
        ["sfdisk", "-q", "--no-reread", "-X", "gpt", str(disk)],
        text=True,
        input="start=2048, size=262144\nstart=264192, size=262144\n",
        check=True,
    )
    for at, size, fstype, src in ((2048, 128, root_fs, tree), (264192, 128, "btrfs", None)):
        fs = tmp / f"fs-{at}.img"
        with open(fs, "wb") as f:
            f.truncate(size << 20)
        args = (
            ["mkfs.ext4", "-q", "-F", "-b", "4096"] + (["-d", str(src)] if src else [])
            if fstype == "ext4"
            else ["mkfs.btrfs", "-q"] + (["-r", str(src)] if src else [])
        )
        subprocess.run([*args, str(fs)], check=True, capture_output=True)
        assert fs.stat().st_size == size << 20, "mkfs grew the file system past its partition"
        subprocess.run(
            [
                "dd",
                f"if={fs}",
                f"of={disk}",
                "bs=512",
                f"seek={at}",
                "conv=notrunc,sparse",
                "status=none",
            ],
            check=True,
        )
        fs.unlink()
    return disk


def _raid1_disk(tmp: Path, files: dict[str, str]) -> Path:
    """A raw disk whose two GPT partitions of 128 MiB are the two devices of one
    btrfs with RAID1 data and metadata, holding files.  mkfs.btrfs --rootdir
    takes one device only: the appliance unpacks a tar of them."""
    import guestfs  # Debian's python3-guestfs, as image_inspect uses it

    tree = tmp / "tree"
    for rel, content in files.items():
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_text(content)
    subprocess.run(["tar", "-C", str(tree), "-cf", str(tmp / "tree.tar"), "."], check=True)
    disk = tmp / "disk.raw"
    with open(disk, "wb") as f:
        f.truncate(300 << 20)
    subprocess.run(
        ["sfdisk", "-q", "--no-reread", "-X", "gpt", str(disk)],
        text=True,
        input="start=2048, size=262144\nstart=264192, size=262144\n",
        check=True,
    )
    devs = [tmp / "a.img", tmp / "b.img"]
    for d in devs:
        with open(d, "wb") as f:
            f.truncate(128 << 20)
    subprocess.run(
        ["mkfs.btrfs", "-q", "-d", "raid1", "-m", "raid1", *map(str, devs)],
        check=True,
        capture_output=True,
    )
    for at, d in zip((2048, 264192), devs, strict=True):
        subprocess.run(
            [
                "dd",
                f"if={d}",
                f"of={disk}",
                "bs=512",
                f"seek={at}",
                "conv=notrunc,sparse",
                "status=none",
            ],
            check=True,
        )
        d.unlink()
    g = guestfs.GuestFS(python_return_dict=True)
    try:
        g.set_backend_settings(["force_tcg"])
        g.add_drive_opts(str(disk), format="raw", readonly=0)
        g.launch()
        g.mount("/dev/sda1", "/")
        g.tar_in(str(tmp / "tree.tar"), "/")
        g.umount_all()
        g.shutdown()
    finally:
        g.close()
    return disk


@pytest.mark.vm
@pytest.mark.usefixtures("host_guard")
def test_image_with_a_raid1_btrfs_root_is_refused_before_any_guest_boots(tmp_path: Path) -> None:
    files = dict(DEBIAN_TREE, **{"etc/fstab": "/dev/sda1 / btrfs defaults 0 0\n"})
    img = _raid1_disk(tmp_path, files)
    r = run_analyze(tmp_path, str(img))
    assert_clean_failure(
        r,
        "disk.raw: root file system is btrfs on /dev/sda1, which cannot "
        "be analyzed: over 2 devices (a multi-device or RAID pool)",
    )
    assert "root btrfs lives on one device" in r.stderr
    assert "booting guests" not in r.stderr


@pytest.mark.vm
@pytest.mark.usefixtures("host_guard")
def test_a_btrfs_srv_is_mapped_next_to_the_ext4_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PAGESHARE_CACHE", str(tmp_path / "cache"))
    files = dict(
        DEBIAN_TREE,
        **{
            "etc/fstab": "/dev/sda1 / ext4 defaults 0 1\n/dev/sda2 /srv btrfs defaults 0 0\n",
            "srv/.keep": "",
        },
    )
    img = _btrfs_disk(tmp_path, files, "ext4")
    fmt, vsize = probe_format(img)
    info = inspect_image(img, fmt, vsize).info
    assert [
        (f.mountpoint, f.fstype, f.start_sector, f.guest_start_sector) for f in info.filesystems
    ] == [("/", "ext4", 2048, 2048), ("/srv", "btrfs", 264192, 0)]
    assert info.skipped == ()


def test_a_raid_profile_found_in_the_chunk_tree_refuses_the_root_and_skips_the_rest(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from pageshare.image.image_inspect import ImageInfo, Inspection
    from pageshare.progress import Progress

    def fs(mp: str, uuid: str) -> fslayout.MappedFs:
        return fslayout.MappedFs(
            mp, "/dev/sda1", 1, 2048, "btrfs", uuid, 4096, "devices=1", ((0, 1 << 20, 2048),), 0
        )

    a, b = "d61e0c15-e3ef-45fb-9dec-31107edbfefa", "0c7e2f0d-3d4b-4b8e-9a51-5b8c2f3c9d11"
    info = ImageInfo(
        "g",
        "raw",
        1 << 30,
        "debian",
        "12",
        12,
        0,
        "/dev/sda1",
        1,
        2048,
        "btrfs",
        a,
        4096,
        "",
        "6.1",
        "/boot/vmlinuz",
        "",
        (fs("/", a), fs("/srv", b)),
    )
    insp = Inspection(info, tmp_path / "vmlinuz", None)
    geo = Geometry(analyze.placements(info.filesystems), 1 << 30)
    sources = {p.key: (tmp_path / p.uuid, 0) for p in geo.filesystems}

    def check(image: Path) -> None:
        if image.name == b.replace("-", ""):
            raise BtrfsUnsupported("btrfs DATA chunk at 1 has the RAID0 profile")

    monkeypatch.setattr(btrfsmap, "check_chunks", check)
    said: list[str] = []
    progress = Progress(quiet=True)
    monkeypatch.setattr(progress, "say", said.append)
    insp2, geo2 = analyze._check_btrfs_chunks(Path("g"), insp, geo, sources, progress)
    assert [f.mountpoint for f in insp2.info.filesystems] == ["/"]
    assert [(s.mountpoint, s.reason) for s in insp2.info.skipped] == [
        ("/srv", "btrfs DATA chunk at 1 has the RAID0 profile")
    ]
    assert [p.mountpoint for p in geo2.filesystems] == ["/"]
    assert said and "/srv (btrfs) is not mapped" in said[0]
    monkeypatch.setattr(btrfsmap, "check_chunks", lambda image: check(Path(b.replace("-", ""))))
    with pytest.raises(
        UserError,
        match="root file system is btrfs, which cannot be analyzed: "
        "btrfs DATA chunk at 1 has the RAID0 profile",
    ):
        analyze._check_btrfs_chunks(Path("g"), insp, geo, sources, progress)
