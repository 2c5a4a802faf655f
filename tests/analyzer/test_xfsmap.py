"""XFS block maps read with xfs_db: parsing, and a real file system made here.

The file system is made by mkfs.xfs from a protofile (no mounting), with a
file in a second allocation group, so the (ag/agblock) to linear block
conversion is checked against the bytes on disk.
"""

import os
import subprocess
from dataclasses import replace
from pathlib import Path

from pageshare.analysis.classify import PageRecord
from pageshare.analysis.mapping import Geometry, Placement, page_sector
from pageshare.image import xfsmap
from pageshare.image.ext4map import Extent, fs_image

BMAP = """\
ino 131
data offset 0 startblock 24 (0/24) count 25 flag 0
data offset 30 startblock 4194404 (1/100) count 2 flag 1
data offset 40 startblock 4194504 (1/200) count 3 flag 0
ino 132
ino 133
data offset 0 startblock 10 (0/10) count 1 flag 0
"""


def test_parse_bmaps_linear_blocks_and_unwritten() -> None:
    ext = xfsmap.parse_bmaps(BMAP, agblocks=19200)
    # (1/200) is block 200 of the second allocation group; the unwritten
    # extent (flag 1) reads as zeros and is left out, like a hole.
    assert ext[131] == [Extent(0, 24, 25), Extent(40, 19200 + 200, 3)]
    assert ext[132] == []  # inline data: no extents
    assert ext[133] == [Extent(0, 10, 1)]


def test_xfs_pages_map_only_on_their_own_file_system() -> None:
    uuid = "e3b5a1c72d944f608b1e9c7d4a2f6e35"
    fs = Placement.partition(uuid, 262144, fstype="xfs")
    geo = Geometry((fs,), virtual_size=2 << 30)
    rec = PageRecord(
        pfn=1,
        kind="file",
        index=2,
        ino=131,
        fstype="xfs",
        fs_uuid=uuid,
        disk="vda",
        start_sect=262144,
        blkbits=12,
        state="U----",
    )
    ext = {(fs.key, 131): [Extent(0, 24, 25)]}
    assert page_sector(rec, ext, geo, False) == (262144 + 26 * 8, "")
    # The same UUID named as ext4 by the guest is not this file system.
    assert page_sector(replace(rec, fstype="ext4"), ext, geo, False) == (None, "other-fs")


def test_real_xfs_extents_and_paths(tmp_path: Path) -> None:
    data = os.urandom(100_000)
    (tmp_path / "big").write_bytes(data)
    (tmp_path / "proto").write_text(
        "/dev/null\n0 0\nd--755 0 0\n"
        f"big ---644 0 0 {tmp_path}/big\n"
        "sub d--755 0 0\n"
        f"deep ---644 0 0 {tmp_path}/big\n"
        "$\n$\n"
    )
    # 4 allocation groups of 75 MiB: the subdirectory's file lands in another one.
    img = tmp_path / "xfs.img"
    with open(img, "wb") as f:
        f.truncate(300 << 20)
    subprocess.run(
        ["mkfs.xfs", "-q", "-d", "agcount=4", "-p", str(tmp_path / "proto"), str(img)], check=True
    )
    out = subprocess.run(
        ["xfs_db", "-r", "-c", "blockget -n", "-c", "ncheck", str(img)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    inos = {line.split()[1]: int(line.split()[0]) for line in out.splitlines() if line.strip()}
    big, deep = inos["big"], inos["sub/deep"]
    paths = xfsmap.read_paths(img, [big, deep])
    assert paths == {big: "/big", deep: "/sub/deep"}
    ext = xfsmap.read_extents(img, [big, deep])
    agblocks = xfsmap.ag_blocks(img)
    assert any(e.physical >= agblocks for e in ext[deep]), "deep is not in a later AG"
    with open(img, "rb") as f:
        for ino in (big, deep):
            got = b""
            for e in ext[ino]:
                f.seek(e.physical * 4096)
                got += f.read(e.length * 4096)
            assert got[: len(data)] == data, f"inode {ino}"
    # The same through a copy of a partition, as analyze-image gives xfs_db.
    disk = tmp_path / "disk.raw"
    with open(disk, "wb") as f:
        f.truncate(400 << 20)
    subprocess.run(
        ["dd", f"if={img}", f"of={disk}", "bs=1M", "seek=1", "conv=notrunc,sparse", "status=none"],
        check=True,
    )
    copy, offset = fs_image(disk, ((0, (300 << 20) // 512, 2048),), tmp_path / "fs.img", copy=True)
    assert offset == 0 and xfsmap.read_extents(copy, [big]) == {big: ext[big]}
