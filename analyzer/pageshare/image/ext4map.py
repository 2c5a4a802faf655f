"""The base image's own ext2/ext3/ext4 block map, read offline with debugfs.

The guest tells us (inode number, page index); the base image is the ground
truth for where that page's bytes live on disk.  debugfs reads the file
system inside the raw image at the partition's byte offset (e2fsprogs'
"image?offset=N" syntax) without mounting anything, and one process answers
for all inodes at once.

ext4 files use extent trees (`ex <ino>`).  ext2 and ext3 files, and ext4
files that were written before the extent feature was turned on (a file
system upgraded from ext3 in place), use the older indirect block maps,
which `ex` does not read: those inodes are asked again with `stat <ino>`,
whose BLOCKS list gives each run of logical blocks with its physical blocks
(and names the indirect blocks themselves, which hold no file data, as
(IND), (DIND), (TIND)).
"""

import errno
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

# " 1/ 1   1/ 12     0 -    10  5678 -  5688     11 Uninit"
_EXTENT = re.compile(
    r"^\s*(\d+)/\s*(\d+)\s+\d+/\s*\d+\s+(\d+) -\s+(\d+)\s+(\d+) -\s+(\d+)\s+(\d+)\s*(\S*)"
)
_CMD = re.compile(r"^debugfs: ex <(\d+)>")


@dataclass(frozen=True)
class Extent:
    logical: int
    physical: int
    length: int


def parse_extents(output: str) -> dict[int, list[Extent]]:
    """Leaf extents per inode from `debugfs -f` output of `ex <ino>` commands.

    Unwritten (Uninit) extents read as zeros and have no data on disk, so
    they are left out: a page there is treated as a hole.
    """
    res: dict[int, list[Extent]] = {}
    cur: int | None = None
    for line in output.splitlines():
        m = _CMD.match(line)
        if m:
            cur = int(m.group(1))
            res[cur] = []
            continue
        m = _EXTENT.match(line)
        if m and cur is not None and m.group(1) == m.group(2) and m.group(8) != "Uninit":
            res[cur].append(Extent(int(m.group(3)), int(m.group(5)), int(m.group(7))))
    for exts in res.values():
        exts.sort(key=lambda e: e.logical)
    return res


def lookup(extents: list[Extent], lblk: int) -> int | None:
    """Physical block of logical block lblk, None for a hole."""
    lo, hi = 0, len(extents)
    while lo < hi:
        mid = (lo + hi) // 2
        e = extents[mid]
        if lblk < e.logical:
            hi = mid
        elif lblk >= e.logical + e.length:
            lo = mid + 1
        else:
            return e.physical + (lblk - e.logical)
    return None


# "(0-11):1553-1564, (IND):1565, (12):1566, (5-9[u]):4683-4687": stat's BLOCKS or
# EXTENTS list; [u] marks an unwritten extent, (IND)/(ETB0)... metadata blocks.
_RUN = re.compile(r"\((\d+)(?:-(\d+))?(\[u\])?\):(\d+)(?:-(\d+))?")
_STAT = re.compile(r"^debugfs: stat <(\d+)>")
_MAP_HEADER = ("BLOCKS:", "EXTENTS:")


def parse_block_maps(output: str) -> dict[int, list[Extent]]:
    """Data block runs per inode from `debugfs -f` output of `stat <ino>` commands.

    Works for both kinds of inode: an indirect block map's BLOCKS list and an
    extent tree's EXTENTS list.  Unwritten extents are left out (holes), as in
    parse_extents; adjacent runs are joined.
    """
    res: dict[int, list[Extent]] = {}
    cur: int | None = None
    in_map = False
    for line in output.splitlines():
        m = _STAT.match(line)
        if m:
            cur, in_map = int(m.group(1)), False
            res[cur] = []
            continue
        if cur is None:
            continue
        if line.strip() in _MAP_HEADER:
            in_map = True
            continue
        if not in_map:
            continue
        if line.startswith("TOTAL:") or not line.strip():
            in_map = False
            continue
        for r in _RUN.finditer(line):
            if r.group(3):  # unwritten: reads as zeros
                continue
            first = int(r.group(1))
            last = int(r.group(2)) if r.group(2) else first
            phys = int(r.group(4))
            phys_last = int(r.group(5)) if r.group(5) else phys
            if phys_last - phys != last - first:
                raise ValueError(f"debugfs stat <{cur}>: run {r.group(0)} has unequal lengths")
            runs = res[cur]
            if (
                runs
                and runs[-1].logical + runs[-1].length == first
                and runs[-1].physical + runs[-1].length == phys
            ):
                runs[-1] = Extent(
                    runs[-1].logical, runs[-1].physical, runs[-1].length + last - first + 1
                )
            else:
                runs.append(Extent(first, phys, last - first + 1))
    for exts in res.values():
        exts.sort(key=lambda e: e.logical)
    return res


def _debugfs(raw: Path, part_offset: int, commands: str) -> str:
    p = subprocess.run(
        ["debugfs", "-c", "-f", "-", f"{raw}?offset={part_offset}"],
        input=commands,
        capture_output=True,
        text=True,
    )
    if p.returncode != 0:
        raise RuntimeError(f"debugfs failed: {p.stderr.strip()[-300:]}")
    return p.stdout


def read_extents(raw: Path, part_offset: int, inodes: list[int]) -> dict[int, list[Extent]]:
    """Each inode's data block runs, whichever kind of block map it has.

    `ex` answers for extent-mapped inodes; the ones it leaves empty (indirect
    block maps, and files with no written data) are asked again with `stat`,
    which reads both kinds.
    """
    if not inodes:
        return {}
    res = parse_extents(_debugfs(raw, part_offset, "".join(f"ex <{i}>\n" for i in inodes)))
    again = [i for i in inodes if not res.get(i)]
    if again:
        res.update(
            parse_block_maps(_debugfs(raw, part_offset, "".join(f"stat <{i}>\n" for i in again)))
        )
    return res


# Inodes per `ncheck` command: debugfs reads its commands in lines of a few
# KiB and runs the rest of a longer line as a command of its own ("Command
# not found 6"), which a workload that reads thousands of files reached.
NCHECK_CHUNK = 256


def read_paths(raw: Path, part_offset: int, inodes: list[int]) -> dict[int, str]:
    """One path per inode (hard links: the first one found)."""
    if not inodes:
        return {}
    commands = "".join(
        "ncheck -c " + " ".join(map(str, inodes[i : i + NCHECK_CHUNK])) + "\n"
        for i in range(0, len(inodes), NCHECK_CHUNK)
    )
    out = _debugfs(raw, part_offset, commands)
    paths: dict[int, str] = {}
    for line in out.splitlines():
        ino, sep, path = line.partition("\t")
        if sep and ino.strip().isdigit():
            paths.setdefault(int(ino), path)
    return paths


def file_sectors(
    raw: Path, part_offset: int, path: str, start_sector: int, block_size: int
) -> list[int]:
    """4 KiB-aligned base-image sectors holding a file's data (for tests and reports)."""
    out = _debugfs(raw, part_offset, f"stat {path}\n")
    exts = next(iter(parse_block_maps(out.replace(f"stat {path}", "stat <0>", 1)).values()), [])
    per = block_size // 512
    sectors = set()
    for e in exts:
        for b in range(e.physical, e.physical + e.length):
            s = start_sector + b * per
            sectors.add(s - s % 8)
    return sorted(sectors)


# (file system sector, sectors, disk sector), as fslayout/mapping describe runs.
Run = tuple[int, int, int]


def fs_image(
    raw: Path, runs: tuple[Run, ...], scratch: Path, copy: bool = False
) -> tuple[Path, int]:
    """Where debugfs (or xfs_db) can read a file system: (image, byte offset).

    One run (a partition, a one-segment LV) is the raw disk at its offset.
    debugfs needs the file system's bytes in one piece, so an LV of several
    segments is copied, run by run, into the sparse file scratch (only the
    data the raw copy holds; holes stay holes); so is any file system with
    copy (xfs_db takes no offset).
    """
    if len(runs) == 1 and runs[0][0] == 0 and not copy:
        return raw, runs[0][2] * 512
    with open(raw, "rb") as src, open(scratch, "wb") as dst:
        fd_in, fd_out = src.fileno(), dst.fileno()
        for fs_start, sectors, disk_start in runs:
            pos, end = disk_start * 512, (disk_start + sectors) * 512
            while pos < end:
                try:
                    data = os.lseek(fd_in, pos, os.SEEK_DATA)
                except OSError as e:
                    if e.errno != errno.ENXIO:  # ENXIO: only a hole is left
                        raise
                    break
                hole = min(os.lseek(fd_in, data, os.SEEK_HOLE), end)
                if data >= end:
                    break
                at = data
                while at < hole:
                    chunk = os.pread(fd_in, min(1 << 20, hole - at), at)
                    os.pwrite(fd_out, chunk, fs_start * 512 + at - disk_start * 512)
                    at += len(chunk)
                pos = hole
        last = max(r[0] + r[1] for r in runs)
        os.ftruncate(fd_out, max(os.fstat(fd_out).st_size, last * 512))
    return scratch, 0
