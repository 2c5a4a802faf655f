"""Each listed block is the file page it claims to be, read by e2fsprogs itself.

The analysis records, for every listed block, the file (file system UUID,
inode) and offset whose page it is.  The other e2e checks compare a listed
block with the image at its sector; this one reads the file's bytes at that
offset with debugfs `dump <ino>` (e2fsprogs' own reading of the inode, not
the analyzer's block map) and compares them with the image's block at the
listed sector.  A block map that led to the wrong place, or a page that
belongs to another file, fails here even when the sector's bytes equal the
list's digest.
"""

import hashlib
import sqlite3
import subprocess
from pathlib import Path

from pageshare.lists import sectorlist

PAGE = 4096


def _norm(uuid: str) -> str:
    return uuid.replace("-", "").lower()


def check_listed_file_bytes(
    db_path: Path, analysis_id: int, raw: Path, scratch: Path
) -> dict[str, int]:
    """Checks every listed file block on the image's ext2/3/4 file systems that sit
    at one offset of the disk; returns how many were checked per mount point.
    Raises AssertionError naming the first block that is not its file's page."""
    db = sqlite3.connect(db_path)
    fss = {
        _norm(uuid or ""): (mp, start)
        for mp, uuid, start in db.execute(
            "SELECT mountpoint, uuid, start_sector FROM filesystem "
            "WHERE analysis_id=? AND mapped=1 AND fstype IN ('ext2', 'ext3', 'ext4')",
            (analysis_id,),
        )
    }
    rows = db.execute(
        "SELECT sector, sha256, ino, file_offset, fs_uuid FROM listed_block "
        "WHERE analysis_id=? AND kind='file'",
        (analysis_id,),
    ).fetchall()
    db.close()
    checked = {mp: 0 for mp, _ in fss.values()}
    by_fs: dict[str, list[tuple[int, str, int, int]]] = {}
    for sector, digest, ino, offset, fs_uuid in rows:
        if _norm(fs_uuid or "") in fss:
            by_fs.setdefault(_norm(fs_uuid), []).append((sector, digest, ino, offset))
    scratch.mkdir(parents=True, exist_ok=True)
    with raw.open("rb") as disk:
        for uuid, blocks in by_fs.items():
            mountpoint, start = fss[uuid]
            inos = sorted({ino for _, _, ino, _ in blocks})
            commands = "".join(f"dump <{i}> {scratch}/{i}\n" for i in inos)
            subprocess.run(
                ["debugfs", "-c", "-f", "-", f"{raw}?offset={start * 512}"],
                input=commands,
                capture_output=True,
                text=True,
                check=True,
            )
            for sector, digest, ino, offset in blocks:
                dumped = scratch / str(ino)
                assert dumped.exists(), f"{mountpoint}: debugfs could not dump inode {ino}"
                with dumped.open("rb") as f:
                    f.seek(offset)
                    page = f.read(PAGE)
                page += bytes(PAGE - len(page))  # past EOF a page reads as zeros
                disk.seek(sector * 512)
                block = disk.read(PAGE)
                where = f"{mountpoint} inode {ino} offset {offset} listed at sector {sector}"
                assert block == page, f"{where}: the image's block is not the file's page"
                assert hashlib.sha256(page).hexdigest() == digest, f"{where}: digest differs"
                checked[mountpoint] += 1
            for ino in inos:
                (scratch / str(ino)).unlink(missing_ok=True)
    return checked


def every_listed_block_is_its_files_page(
    db: Path, summary: dict[str, object], raw: Path, scratch: Path
) -> dict[str, int]:
    """Checks every block of an analysis' list (``summary``: its --json output)
    as check_listed_file_bytes does; all of them must be file blocks on ext
    file systems.  Returns the blocks checked per mount point."""
    n = len(sectorlist.read(Path(str(summary["list_path"]))).blocks)
    checked = check_listed_file_bytes(db, int(str(summary["analysis_id"])), raw, scratch)
    assert n > 0 and sum(checked.values()) == n, checked
    return checked
