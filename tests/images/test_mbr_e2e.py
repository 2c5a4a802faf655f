"""analyze-image end to end on an image with an MBR (msdos) partition table.

The mbr golden image is the small package set on a disk laid out as
Debian's installer does on a BIOS machine: the ext4 root in primary
partition 1 at sector 2048, swap in logical partition 5 inside extended
partition 2.  libguestfs finds the partitions (parted) and the guests boot
from /dev/vda1 with swap on.  Properties, not counts: the root's start
sector, read here from the MBR itself, is where the analysis mapped the
root; every listed block is byte-identical to the base image and lies
inside the root partition; blocks of files every boot reads are listed.
"""

import sqlite3
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import Analysis, analyze_cleanly
from listed_blocks import every_listed_block_is_the_images, list_verifies
from listed_file_bytes import every_listed_block_is_its_files_page
from pageshare import golden
from pageshare.image.ext4map import file_sectors
from pageshare.lists import sectorlist

pytestmark = pytest.mark.vm

# Fails (and the analyzer warns) unless the guest's root is partition 1 of a
# dos-labelled disk and the swap in logical partition 5 is on.
WORKLOAD = (
    "findmnt -n -o SOURCE / | grep -qx /dev/vda1 && "
    '[ "$(blkid -p -o value -s PTTYPE /dev/vda)" = dos ] && '
    "grep -q '^/dev/vda5 ' /proc/swaps"
)
ALWAYS_READ = ("/usr/lib/systemd/systemd", "/usr/lib/x86_64-linux-gnu/libc.so.6")


@pytest.fixture(scope="module")
def analysed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Analysis, Path]]:
    image = golden.build_image("mbr").path
    tmp = tmp_path_factory.mktemp("e2e-mbr")
    result, raw = analyze_cleanly(tmp, image, "--workload", WORKLOAD)
    yield result, raw
    raw.unlink()


def mbr_partitions(raw: Path) -> dict[int, tuple[int, int, int]]:
    """number -> (type, first sector, sectors) of the MBR's primary partitions and
    the logical ones in the extended partition's chain of EBRs, read from the disk."""
    parts: dict[int, tuple[int, int, int]] = {}
    with open(raw, "rb") as f:

        def entries(sector: int) -> list[tuple[int, int, int]]:
            f.seek(sector * 512)
            block = f.read(512)
            assert block[510:512] == b"\x55\xaa", f"no boot signature at sector {sector}"
            return [
                (e[4], *struct.unpack_from("<II", e, 8))
                for e in (block[446 + 16 * i : 462 + 16 * i] for i in range(4))
            ]

        extended = 0
        for n, (ptype, start, count) in enumerate(entries(0), 1):
            if ptype:
                parts[n] = (ptype, start, count)
            if ptype in (0x05, 0x0F):
                extended = start
        ebr, n = extended, 5
        while ebr:
            (ptype, start, count), (ntype, nstart, _) = entries(ebr)[:2]
            parts[n] = (ptype, ebr + start, count)
            ebr, n = (extended + nstart if ntype else 0), n + 1
    return parts


def test_the_mbr_is_debian_installers_layout(analysed: tuple[Analysis, Path]) -> None:
    _, raw = analysed
    geo = golden.geometry("mbr")
    parts = mbr_partitions(raw)
    assert sorted(parts) == [1, 2, 5]
    assert parts[1] == (
        0x83,
        geo.root_start_sector,
        geo.root_end_sector - geo.root_start_sector + 1,
    )
    assert parts[2][:2] == (0x05, geo.extended_start_sector)
    assert parts[5] == (
        0x82,
        geo.swap_start_sector,
        geo.swap_end_sector - geo.swap_start_sector + 1,
    )
    with open(raw, "rb") as f:
        f.seek(440)
        assert f.read(4) == int(str(golden._spec("mbr").disk_guid), 16).to_bytes(4, "little")


def test_the_root_was_mapped_at_its_mbr_partition(analysed: tuple[Analysis, Path]) -> None:
    result, raw = analysed
    assert "guest A ready" in result.stderr and "guest B ready" in result.stderr
    assert "warning: the workload" not in result.stderr, result.stderr
    start = mbr_partitions(raw)[1][1]
    assert f"root ext4 on /dev/sda1 at sector {start}, 4096-byte blocks" in result.stderr
    db = sqlite3.connect(result.db)
    rows = db.execute(
        "SELECT mountpoint, fstype, start_sector, block_size, mapped FROM "
        "filesystem WHERE analysis_id=?",
        (result.json()["analysis_id"],),
    ).fetchall()
    assert rows == [("/", "ext4", start, 4096, 1)]
    # Swap is no file system of /etc/fstab to map, nor one to skip.
    assert "is not mapped" not in result.stderr


def test_every_listed_block_matches_the_base_image(analysed: tuple[Analysis, Path]) -> None:
    result, raw = analysed
    _, start, count = mbr_partitions(raw)[1]
    every_listed_block_is_the_images(
        str(result.json()["list_path"]), raw, [range(start, start + count)], "the root partition"
    )


def test_files_every_boot_reads_are_listed(analysed: tuple[Analysis, Path]) -> None:
    result, raw = analysed
    sl = sectorlist.read(Path(str(result.json()["list_path"])))
    start = mbr_partitions(raw)[1][1]
    for path in ALWAYS_READ:
        sectors = set(file_sectors(raw, start * 512, path, start, 4096))
        assert sectors, f"{path} not found in the image"
        assert sectors & set(sl.blocks), f"no block of {path} is listed"


def test_list_verifies_against_the_image(analysed: tuple[Analysis, Path]) -> None:
    result, _ = analysed
    list_verifies(str(result.json()["list_path"]), golden.build_image("mbr").path)


def test_every_listed_block_is_its_files_page(
    analysed: tuple[Analysis, Path], tmp_path: Path
) -> None:
    """By e2fsprogs' own reading of each recorded (inode, offset), not the analyzer's map."""
    result, raw = analysed
    every_listed_block_is_its_files_page(result.db, result.json(), raw, tmp_path)
