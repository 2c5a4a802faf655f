"""analyze-image end to end on an image whose root file system is btrfs.

The btrfs golden image is the small package set on the GPT layout with the
root in subvolume @rootfs of a single-device btrfs, as Debian's installer
lays it out, and one file (base-files' GPL-3) stored compressed.  Its
page-cache pages are mapped with btrfs-progs' dump-tree (btrfsmap.py) on a
copy of the root partition, trying the inode number in each subvolume and
keeping the block whose bytes equal the page.  Properties, not counts:
every listed block is byte-identical to the base image and lies inside the
root partition, blocks of files every boot reads (looked up here by walking
the subvolume's directory items) are listed, and the compressed file's and
small inline files' pages are counted with their verdicts, never listed.
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
from pageshare.image import btrfsmap
from pageshare.image.ext4map import fs_image
from pageshare.lists import sectorlist

pytestmark = pytest.mark.vm

COMPRESSED = "/usr/share/common-licenses/GPL-3"
WORKLOAD = f"findmnt -n -o FSTYPE / | grep -qx btrfs && cat {COMPRESSED} >/dev/null"
ALWAYS_READ = ("/usr/lib/systemd/systemd", "/usr/lib/x86_64-linux-gnu/libc.so.6")

_DIR_ITEM = re.compile(r"^\s*item \d+ key \((\d+) DIR_ITEM \d+\)")
_LOCATION = re.compile(r"^\s*location key \((\d+) INODE_ITEM 0\)")
_NAME = re.compile(r"^\s*name: (.*)$")


@pytest.fixture(scope="module")
def analysed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Analysis, Path, Path]]:
    image = golden.build_image("btrfs").path
    tmp = tmp_path_factory.mktemp("e2e-btrfs")
    result, raw = analyze_cleanly(tmp, image, "--workload", WORKLOAD)
    geo = golden.geometry("btrfs")
    root, _ = fs_image(
        raw,
        ((0, geo.root_end_sector - geo.root_start_sector + 1, geo.root_start_sector),),
        tmp / "root.btrfs",
        copy=True,
    )
    yield result, raw, root
    raw.unlink()
    root.unlink()


def dump(root: Path, tree: str) -> str:
    return subprocess.run(
        ["btrfs", "inspect-internal", "dump-tree", "-t", tree, str(root)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout


def rootfs_tree(root: Path) -> int:
    """The tree id of subvolume @rootfs, from its ROOT_BACKREF in the root tree."""
    m = re.search(
        r"key \((\d+) ROOT_BACKREF 5\)[^\n]*\n\s*root backref key dirid 256 "
        r"sequence \d+ name @rootfs\n",
        dump(root, "root"),
    )
    assert m, "no subvolume @rootfs at the top level"
    return int(m.group(1))


def inode_of(root: Path, path: str) -> int:
    """A path's inode in @rootfs, walking DIR_ITEMs from its root directory (256)
    (the analysis walks INODE_REFs the other way)."""
    entries: dict[tuple[int, str], int] = {}
    parent: int | None = None
    target: int | None = None
    for line in dump(root, str(rootfs_tree(root))).splitlines():
        m = _DIR_ITEM.match(line)
        if m:
            parent, target = int(m.group(1)), None
            continue
        if line.lstrip().startswith("item "):
            parent = None
        elif parent is not None:
            loc, name = _LOCATION.match(line), _NAME.match(line)
            if loc:
                target = int(loc.group(1))
            elif name and target is not None:
                entries[parent, name.group(1)] = target
    ino = 256
    for part in path.strip("/").split("/"):
        assert (ino, part) in entries, f"{path}: no {part!r} in directory inode {ino}"
        ino = entries[ino, part]
    return ino


def sectors_of(root: Path, path: str) -> set[int]:
    """The 4 KiB-aligned disk sectors holding a file of @rootfs."""
    ino = inode_of(root, path)
    start = golden.geometry("btrfs").root_start_sector
    ext, _ = btrfsmap.read_extents(root, [ino], rootfs_tree(root))
    return {start + b * 8 for e in ext[ino] for b in range(e.physical, e.physical + e.length)}


def test_the_guest_root_was_btrfs(analysed: tuple[Analysis, Path, Path]) -> None:
    result, _, _ = analysed
    assert "warning: the workload" not in result.stderr, result.stderr
    assert "root btrfs on btrfsvol:/dev/sda1/@rootfs" in result.stderr
    db = sqlite3.connect(result.db)
    aid = result.json()["analysis_id"]
    rows = db.execute(
        "SELECT mountpoint, fstype, start_sector, block_size, mapped FROM "
        "filesystem WHERE analysis_id=?",
        (aid,),
    ).fetchall()
    assert rows == [("/", "btrfs", golden.geometry("btrfs").root_start_sector, 4096, 1)]
    # Listed files got their paths, in the subvolume mounted on /.
    (paths,) = db.execute("SELECT count(*) FROM file WHERE path LIKE '/usr/%'").fetchone()
    assert paths > 0
    (odd,) = db.execute("SELECT count(*) FROM file WHERE path LIKE '%@rootfs%'").fetchone()
    assert odd == 0
    # btrfs' metadata (its btree inode's page cache) is metadata, not a file.
    verdicts = {
        v
        for (v,) in db.execute(
            "SELECT DISTINCT verdict FROM guest_page g JOIN run r "
            "ON g.run_id=r.id WHERE r.analysis_id=? AND ino=1 "
            "AND kind='file'",
            (aid,),
        )
    }
    assert verdicts <= {"metadata"}


def test_every_listed_block_matches_the_base_image(analysed: tuple[Analysis, Path, Path]) -> None:
    result, raw, _ = analysed
    geo = golden.geometry("btrfs")
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


def test_compressed_and_inline_data_is_counted_not_listed(
    analysed: tuple[Analysis, Path, Path],
) -> None:
    result, _, root = analysed
    ino = inode_of(root, COMPRESSED)
    _, skipped = btrfsmap.read_extents(root, [ino], rootfs_tree(root))
    assert skipped.compressed_extents > 0, f"{COMPRESSED} is not stored compressed"
    unservable = result.json()["unservable_pages"]
    assert isinstance(unservable, dict)
    assert unservable.get("compressed", 0) > 0 and unservable.get("inline", 0) > 0
    assert "btrfs page cache no disk block holds as read" not in result.stdout  # --json
    db = sqlite3.connect(result.db)
    aid = result.json()["analysis_id"]
    verdicts = {
        v
        for (v,) in db.execute(
            "SELECT DISTINCT verdict FROM guest_page g JOIN run r ON g.run_id=r.id "
            "WHERE r.analysis_id=? AND kind='file' AND ino=?",
            (aid, ino),
        )
    }
    assert verdicts == {"compressed"}, verdicts  # the workload read it in both guests
    assert db.execute(
        "SELECT count(*) FROM listed_block WHERE analysis_id=? AND ino=?", (aid, ino)
    ).fetchone() == (0,)


def test_list_verifies_against_the_image(analysed: tuple[Analysis, Path, Path]) -> None:
    result, _, _ = analysed
    list_verifies(str(result.json()["list_path"]), golden.build_image("btrfs").path)
