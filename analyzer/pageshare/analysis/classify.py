"""Guest page classification records, as the crash extension writes them.

The format is pagescan's ("#pagescan v1" header naming the columns, then one
tab-separated record per PFN, documented in crash-ext/README.md).  Short
records carry only pfn, kind and flags: frames that are not page cache.
"""

from dataclasses import dataclass
from pathlib import Path

from pageshare.errors import PageshareError

PAGE_CACHE_KINDS = ("file", "bdev")
COLUMNS = (
    "pfn",
    "kind",
    "flags",
    "index",
    "inode",
    "ino",
    "s_dev",
    "fstype",
    "fs_uuid",
    "bd_dev",
    "disk",
    "start_sect",
    "i_size",
    "blkbits",
    "state",
)
KINDS = (
    "file",
    "bdev",
    "shmem",
    "anon",
    "ksm",
    "movable",
    "slab",
    "nomapping",
    "badmapping",
    "nopage",
    "unreadable",
)


class ClassificationError(PageshareError, ValueError):
    pass


@dataclass(frozen=True)
class PageRecord:
    pfn: int
    kind: str
    flags: int = 0
    index: int = 0
    inode: int = 0
    ino: int = 0
    s_dev: int = 0
    fstype: str = ""
    fs_uuid: str = ""
    bd_dev: int = 0
    disk: str = ""
    start_sect: int = 0
    i_size: int = 0
    blkbits: int = 0
    state: str = ""

    @property
    def clean(self) -> bool:
        """Uptodate and neither dirty, under writeback nor locked (being read)."""
        return self.state[:4] == "U---"

    @property
    def page_cache(self) -> bool:
        return self.kind in PAGE_CACHE_KINDS


def _dash(s: str) -> str:
    return "" if s == "-" else s


def parse_line(line: str, lineno: int = 0) -> PageRecord:
    f = line.rstrip("\n").split("\t")
    try:
        if len(f) == 2:
            return PageRecord(int(f[0]), f[1])
        if len(f) == 3:
            return PageRecord(int(f[0]), f[1], int(f[2], 16))
        if len(f) != len(COLUMNS):
            raise ClassificationError(
                f"line {lineno}: {len(f)} fields, expected 2, 3 or {len(COLUMNS)}"
            )
        return PageRecord(
            pfn=int(f[0]),
            kind=f[1],
            flags=int(f[2], 16),
            index=int(f[3]),
            inode=int(f[4], 16),
            ino=int(f[5]),
            s_dev=int(f[6], 16),
            fstype=_dash(f[7]),
            fs_uuid=_dash(f[8]),
            bd_dev=int(f[9], 16),
            disk=_dash(f[10]),
            start_sect=int(f[11]),
            i_size=int(f[12]),
            blkbits=int(f[13]),
            state=f[14],
        )
    except ValueError as e:
        if isinstance(e, ClassificationError):
            raise
        raise ClassificationError(f"line {lineno}: {e}") from None


def parse(text: str) -> dict[int, PageRecord]:
    lines = text.splitlines()
    if not lines or not lines[0].startswith("#pagescan v1\t"):
        raise ClassificationError("missing '#pagescan v1' header: not pagescan output")
    header = lines[0].split("\t")[1:]
    if tuple(header) != COLUMNS:
        raise ClassificationError(f"unexpected columns {header}")
    out = {}
    for i, line in enumerate(lines[1:], start=2):
        if line:
            rec = parse_line(line, i)
            if rec.kind not in KINDS:
                raise ClassificationError(f"line {i}: unknown kind {rec.kind!r}")
            out[rec.pfn] = rec
    return out


def parse_file(path: Path) -> dict[int, PageRecord]:
    return parse(path.read_text())
