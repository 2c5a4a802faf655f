"""analyze-image end to end on an image whose root file system is XFS.

The xfs golden image is the small package set on the GPT layout with an XFS
root.  Its page-cache pages are mapped with xfs_db's block maps (xfsmap.py)
on a copy of the root partition.  Properties, not counts: every listed block
is byte-identical to the base image and lies inside the root partition, and
blocks of files every boot reads (looked up here with xfs_db) are listed.
"""

import re
import sqlite3
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import Analysis, analyze_cleanly
from listed_blocks import every_listed_block_is_the_images, list_verifies
from pageshare import golden
from pageshare.image import xfsmap
from pageshare.image.ext4map import fs_image
from pageshare.lists import sectorlist

pytestmark = pytest.mark.vm

WORKLOAD = "findmnt -n -o FSTYPE / | grep -qx xfs"
ALWAYS_READ = ("/usr/lib/systemd/systemd", "/usr/lib/x86_64-linux-gnu/libc.so.6")


@pytest.fixture(scope="module")
def analysed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Analysis, Path, Path]]:
    image = golden.build_image("xfs").path
    tmp = tmp_path_factory.mktemp("e2e-xfs")
    result, raw = analyze_cleanly(tmp, image, "--workload", WORKLOAD)
    geo = golden.geometry("xfs")
    root, _ = fs_image(
        raw,
        ((0, geo.root_end_sector - geo.root_start_sector + 1, geo.root_start_sector),),
        tmp / "root.xfs",
        copy=True,
    )
    yield result, raw, root
    raw.unlink()
    root.unlink()


def sectors_of(root: Path, path: str) -> set[int]:
    """The 4 KiB-aligned disk sectors holding a file of the XFS root."""
    out = subprocess.run(
        ["xfs_db", "-r", "-c", f"path {path}", "-c", "inode", str(root)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    m = re.search(r"current inode number is (\d+)", out)
    assert m, f"{path} not found in the image: {out}"
    ino = int(m.group(1))
    start = golden.geometry("xfs").root_start_sector
    return {
        start + b * 8
        for e in xfsmap.read_extents(root, [ino])[ino]
        for b in range(e.physical, e.physical + e.length)
    }


def test_the_guest_root_was_xfs(analysed: tuple[Analysis, Path, Path]) -> None:
    result, _, _ = analysed
    assert "warning: the workload" not in result.stderr, result.stderr
    db = sqlite3.connect(result.db)
    rows = db.execute(
        "SELECT mountpoint, fstype, start_sector, block_size, mapped FROM "
        "filesystem WHERE analysis_id=?",
        (result.json()["analysis_id"],),
    ).fetchall()
    assert rows == [("/", "xfs", golden.geometry("xfs").root_start_sector, 4096, 1)]
    # Listed files got their paths from xfs_db.
    (paths,) = db.execute("SELECT count(*) FROM file WHERE path LIKE '/usr/%'").fetchone()
    assert paths > 0


def test_every_listed_block_matches_the_base_image(analysed: tuple[Analysis, Path, Path]) -> None:
    result, raw, _ = analysed
    geo = golden.geometry("xfs")
    every_listed_block_is_the_images(
        str(result.json()["list_path"]),
        raw,
        [range(geo.root_start_sector, geo.root_end_sector + 1)],
        "the root partition",
    )


def test_files_every_boot_reads_are_listed(analysed: tuple[Analysis, Path, Path]) -> None:
    result, _, root = analysed
    sl = sectorlist.read(Path(str(result.json()["list_path"])))
    for path in ALWAYS_READ:
        sectors = sectors_of(root, path)
        assert sectors, f"{path} has no blocks"
        assert sectors & set(sl.blocks), f"no block of {path} is listed"


def test_list_verifies_against_the_image(analysed: tuple[Analysis, Path, Path]) -> None:
    result, _, _ = analysed
    list_verifies(str(result.json()["list_path"]), golden.build_image("xfs").path)
