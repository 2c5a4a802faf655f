"""An XFS file system's block map, read offline with xfs_db (the ext4map of XFS).

xfs_db reads a file system image read-only (-r) without mounting it; it
cannot start at an offset inside a disk, so it is given a copy of the file
system's bytes (ext4map.fs_image).  For each inode, `bmap` lists its data
extents: file offset, start block and length in file system blocks.  The
start block is printed both as XFS's internal number (allocation group in
the high bits) and as "(ag/agblock)"; the linear block, the one at
block * blocksize from the file system's start, is ag * agblocks + agblock.
Unwritten extents (flag 1) read as zeros and have no data on disk, so they
are left out, as ext4map leaves out Uninit extents.  Files whose data is
inline in the inode (small directories, symlinks) have no extents.
"""

import re
import subprocess
from pathlib import Path

from .ext4map import Extent

# "data offset 0 startblock 24 (0/24) count 25 flag 0"
_BMAP = re.compile(r"^data offset (\d+) startblock \d+ \((\d+)/(\d+)\) count (\d+) flag (\d)")
_MARK = re.compile(r"^ino (\d+)\s*$")
# Inodes per xfs_db process: its command line holds three -c per inode.
CHUNK = 2000


def _xfs_db(image: Path, commands: list[str]) -> str:
    args = ["xfs_db", "-r"]
    for c in commands:
        args += ["-c", c]
    p = subprocess.run([*args, str(image)], capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"xfs_db failed: {p.stderr.strip()[-300:]}")
    return p.stdout


def ag_blocks(image: Path) -> int:
    out = _xfs_db(image, ["sb 0", "print agblocks"])
    m = re.search(r"agblocks = (\d+)", out)
    if not m:
        raise RuntimeError(f"xfs_db printed no agblocks: {out[:200]}")
    return int(m.group(1))


def parse_bmaps(output: str, agblocks: int) -> dict[int, list[Extent]]:
    """Written data extents per inode from xfs_db output of `echo ino N`, `inode N`, `bmap`."""
    res: dict[int, list[Extent]] = {}
    cur: int | None = None
    for line in output.splitlines():
        m = _MARK.match(line)
        if m:
            cur = int(m.group(1))
            res[cur] = []
            continue
        m = _BMAP.match(line)
        if m and cur is not None and m.group(5) == "0":
            res[cur].append(
                Extent(
                    int(m.group(1)), int(m.group(2)) * agblocks + int(m.group(3)), int(m.group(4))
                )
            )
    for exts in res.values():
        exts.sort(key=lambda e: e.logical)
    return res


def read_extents(image: Path, inodes: list[int]) -> dict[int, list[Extent]]:
    if not inodes:
        return {}
    agblocks = ag_blocks(image)
    out: dict[int, list[Extent]] = {}
    for i in range(0, len(inodes), CHUNK):
        cmds = [
            c for ino in inodes[i : i + CHUNK] for c in (f"echo ino {ino}", f"inode {ino}", "bmap")
        ]
        out.update(parse_bmaps(_xfs_db(image, cmds), agblocks))
    return out


def read_paths(image: Path, inodes: list[int]) -> dict[int, str]:
    """One path per inode, "/"-rooted in the file system (ncheck needs the
    directory tree walked first: blockget -n, a few seconds per GiB used)."""
    if not inodes:
        return {}
    out = _xfs_db(image, ["blockget -n", "ncheck " + " ".join(f"-i {i}" for i in inodes)])
    paths: dict[int, str] = {}
    for line in out.splitlines():
        ino, _, path = line.strip().partition(" ")
        if ino.isdigit() and path:
            paths.setdefault(int(ino), "/" + path.strip())
    return paths
