"""What the `pageshare list refine` tests share: a golden image as a raw file
of our own (to read its blocks independently of the analyzer), a parent list
made from its real blocks, the fleet's summaries written into a real Redis as
page servers write them (feedback.encode), the independent check of a
refined list against the image, a whole refinement run through the CLI and
checked block by block (check_refinement), and where the golden images'
files, metadata and free space are, asked of xfs_db, btrfs inspect-internal
and debugfs rather than the analyzer's readers.  (No tests here.)"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from page_server_helpers import redis_server
from pageshare.cli import main
from pageshare.image.diskimage import image_content_sha256, raw_file_reader
from pageshare.lists import feedback, sectorlist

PAGE = 4096


@dataclass
class Image:
    path: Path
    raw: Path
    vsize: int
    content: str

    @property
    def key(self) -> str:
        return f"{self.vsize}-{self.content}"

    def block_bytes(self, sector: int) -> bytes:
        with open(self.raw, "rb") as f:
            f.seek(sector * 512)
            return f.read(PAGE)


def raw_image(image: Path, raw: Path) -> Image:
    """image converted to raw at raw by qemu-img (the caller removes it)."""
    subprocess.run(["qemu-img", "convert", "-O", "raw", str(image), str(raw)], check=True)
    read_at, size = raw_file_reader(raw)
    return Image(image, raw, size, image_content_sha256(read_at, size))


def parent_list(
    img: Image, sectors: list[int], path: Path, wrong: tuple[int, ...] = ()
) -> sectorlist.SectorList:
    """A list as analyze-image writes one (generation 1) of the image's blocks at
    sectors, written to path; the blocks at `wrong` get a hash of other bytes."""
    sl = sectorlist.SectorList(
        image=sectorlist.ImageIdentity(img.vsize, img.content, img.path.name),
        blocks={
            s: hashlib.sha256(
                img.block_bytes(s) if s not in wrong else b"not the image's bytes"
            ).hexdigest()
            for s in [*sectors, *wrong]
        },
        generator="analyze-image 0.1.0",
        criteria="cross-vm-ksm",
        runs="1 run(s)",
    )
    sectorlist.write(sl, path)
    return sl


def publish_summaries(
    url: str, key: str, hosts: dict[str, dict[int, tuple[int, int, int]]], since: float, now: float
) -> None:
    """Each host's summary (block -> (guests, reads, flags)) as its page server
    publishes it, replacing what it published before."""
    r = redis.Redis.from_url(url)
    for host, recs in hosts.items():
        guests = max((g for g, _, _ in recs.values()), default=0)
        r.hset(
            f"pageshare:feedback:{key}:{host}",
            mapping=dict[Any, Any](feedback.encode(host, key, int(since), int(now), guests, recs)),
        )
        r.sadd(f"pageshare:feedback:{key}:hosts", host)


def check_against_image(img: Image, path: Path, expect: set[int]) -> sectorlist.SectorList:
    """The independent check: the list's blocks are expect, each hashing to the
    image's bytes, read here from a raw conversion of our own."""
    sl = sectorlist.read(path)
    assert set(sl.blocks) == expect
    assert (sl.image.virtual_size, sl.image.content_sha256) == (img.vsize, img.content)
    for s, digest in sl.blocks.items():
        data = img.block_bytes(s)
        assert hashlib.sha256(data).hexdigest() == digest, f"sector {s}"
        assert any(data)
    return sl


# --------------------------------------------------------------------------- refine, run as by hand


def refine_reads(
    img: Image, parent: list[int], read: list[int], tmp: Path, capsys: pytest.CaptureFixture[str]
) -> tuple[dict[str, Any], Path]:
    """`pageshare list refine IMAGE --list PARENT --json` (default thresholds) after
    two hosts published that two guests each read every block at `read`: each
    such block is read by 4 guests on 2 hosts, enough to be added if it is a
    page of a regular file.  Returns the JSON result and the list written."""
    parent_path, out = tmp / "parent.pcsl", tmp / "next.pcsl"
    parent_list(img, parent, parent_path)
    recs = {s // (PAGE // 512): (2, 2, 0) for s in read}
    assert len(recs) == len(read), "two of the blocks read are one page"
    now = time.time()
    with redis_server(tmp) as rd:
        publish_summaries(rd.url, img.key, {"h1": recs, "h2": recs}, now - 86400, now)
        rc = main(
            [
                "list",
                "refine",
                str(img.path),
                "--list",
                str(parent_path),
                "-o",
                str(out),
                "--db",
                str(tmp / "results.sqlite"),
                "--redis",
                rd.url,
                "--json",
            ]
        )
        cap = capsys.readouterr()
    assert rc == 0, cap.err
    res: dict[str, Any] = json.loads(cap.out)
    return res, out


def check_refinement(
    img: Image,
    tmp: Path,
    capsys: pytest.CaptureFixture[str],
    parent: list[int],
    pages: list[int],
    rejected: list[tuple[int, str]],
) -> dict[str, Any]:
    """Refine img's list of `parent` after the fleet read `pages` (file pages found
    independently of the analyzer) and the `rejected` blocks (each with the
    reason refine must give): exactly the pages are added, the others are
    refused for their reasons, the list verifies against the image and each
    of its blocks is the image's bytes (check_against_image).  Returns the
    result."""
    refused = [s for s, _ in rejected]
    every = [*parent, *pages, *refused]
    assert len(set(every)) == len(every), "a block is in two roles"
    assert all(s % (PAGE // 512) == 0 for s in every)
    res, out = refine_reads(img, parent, [*pages, *refused], tmp, capsys)
    assert res["ok"] and res["generation"] == 2 and not res["failures"]
    assert res["reported_unlisted"] == len(pages) + len(refused)
    assert (res["added"], res["rejected"]) == (
        len(pages),
        dict(Counter(why for _, why in rejected)),
    )
    check_against_image(img, out, {*parent, *pages})
    assert main(["list", "verify", str(out), "--image", str(img.path)]) == 0
    assert "OK:" in capsys.readouterr().out
    return res


def check_file_pages(img: Image, pages: dict[int, int], data: bytes, sectors: list[int]) -> int:
    """The image's block at each of sectors is the page of data (a file's bytes,
    read by its file system's own tools) that pages (page index -> sector)
    says; past EOF a page reads as zeros.  Returns how many were checked."""
    checked = 0
    for index, sector in pages.items():
        if sector in sectors:
            want = data[index * PAGE : (index + 1) * PAGE]
            assert img.block_bytes(sector) == want + bytes(PAGE - len(want)), f"page {index}"
            checked += 1
    return checked


# --------------------------------------------------------------------------- golden file systems
#
# Where a golden image's files and metadata are, asked of each file system's
# own tools (xfs_db, btrfs inspect-internal, debugfs), never of the
# analyzer's readers (xfsmap, btrfsmap, ext4map, fileblocks): what refine
# must add and refuse is decided here without them.


def partition_copy(raw: Path, start: int, sectors: int, dest: Path) -> Path:
    """The sectors [start, start + sectors) of raw as a file of their own (sparse):
    xfs_db and btrfs read a file system from a file's first byte."""
    subprocess.run(
        [
            "dd",
            f"if={raw}",
            f"of={dest}",
            "bs=512",
            f"skip={start}",
            f"count={sectors}",
            "conv=sparse",
            "status=none",
        ],
        check=True,
    )
    return dest


def tool_output(*args: str) -> str:
    return subprocess.run(args, capture_output=True, text=True, check=True).stdout


# XFS: xfs_db prints a block as agno<<agblklog|agbno (its "startblock") and
# as (agno/agbno); a linear block, as a daddr counts them, is agno * agblocks + agbno.
_XFS_BMAP = re.compile(
    r"^data offset (\d+) startblock \d+ \((\d+)/(\d+)\) count (\d+) "
    r"flag (\d)$"
)
_XFS_FREE = re.compile(r"^\s*(\d+)\s+(\d+)\s+(\d+)$")


def xfs_sb(fs: Path, field: str) -> int:
    out = tool_output("xfs_db", "-r", "-c", "sb 0", "-c", f"p {field}", str(fs))
    m = re.search(rf"^{field} = (\d+)$", out, re.M)
    assert m, f"xfs_db: no {field} in the superblock of {fs}"
    return int(m.group(1))


def xfs_bmap(fs: Path, path: str) -> list[tuple[int, int, int, bool]]:
    """(file block, linear file system block, blocks, written) of each extent of
    path's data fork, by xfs_db's bmap."""
    agblocks = xfs_sb(fs, "agblocks")
    out = []
    bmap = tool_output("xfs_db", "-r", "-c", f"path {path}", "-c", "bmap", str(fs))
    for line in bmap.splitlines():
        m = _XFS_BMAP.match(line)
        assert m, f"xfs_db bmap of {path}: {line!r}"
        off, ag, agb, n, flag = map(int, m.groups())
        out.append((off, ag * agblocks + agb, n, flag == 0))
    assert out, f"{path} has no extents"
    return out


def xfs_pages(fs: Path, start: int, path: str) -> dict[int, int]:
    """Page index -> disk sector of each written block of path (4 KiB blocks: a
    block is a page), for a file system at disk sector start."""
    assert xfs_sb(fs, "blocksize") == PAGE
    return {
        off + k: start + (b + k) * 8
        for off, b, n, written in xfs_bmap(fs, path)
        if written
        for k in range(n)
    }


def xfs_linear(fs: Path, kind: str, value: int) -> int:
    """The linear 4 KiB block of an inode or an fsblock (xfs_db's convert to a daddr)."""
    out = tool_output("xfs_db", "-r", "-c", f"convert {kind} {value} daddr", str(fs))
    m = re.search(r"^0x[0-9a-f]+ \((\d+)\)$", out, re.M)
    assert m, f"xfs_db: no daddr for {kind} {value}"
    return int(m.group(1)) // 8


def xfs_inode_block(fs: Path, path: str) -> int:
    """The linear block holding path's inode."""
    m = re.search(
        r"current inode number is (\d+)",
        tool_output("xfs_db", "-r", "-c", f"path {path}", "-c", "inode", str(fs)),
    )
    assert m, f"xfs_db: no inode for {path}"
    return xfs_linear(fs, "inode", int(m.group(1)))


def xfs_free_extents(fs: Path) -> list[tuple[int, int]]:
    """(linear block, blocks) of each free extent, from the free space btrees."""
    agblocks = xfs_sb(fs, "agblocks")
    return [
        (int(m.group(1)) * agblocks + int(m.group(2)), int(m.group(3)))
        for line in tool_output("xfs_db", "-r", "-c", "freesp -d", str(fs)).splitlines()
        if (m := _XFS_FREE.match(line))
    ]


# btrfs: dump-tree's items, the chunk tree's logical -> device map.
_BTRFS_ITEM = re.compile(r"^\titem \d+ key \((\S+) (\S+) (\d+)\)")
_BTRFS_LEAF = re.compile(r"^leaf (\d+) items")


@dataclass(frozen=True)
class BtrfsItem:
    leaf: int  # logical address of the tree block holding it
    objectid: str
    type: str
    offset: int
    body: str


@dataclass(frozen=True)
class BtrfsChunk:
    logical: int
    length: int
    type: str
    stripes: tuple[int, ...]  # device offsets, one per copy (DUP: two)


def btrfs_items(fs: Path, tree: str) -> list[BtrfsItem]:
    items: list[BtrfsItem] = []
    leaf, cur, body = 0, None, list[str]()
    for line in [
        *tool_output("btrfs", "inspect-internal", "dump-tree", "-t", tree, str(fs)).splitlines(),
        "\titem 0 key (END END 0)",
    ]:
        m = _BTRFS_ITEM.match(line)
        if m or _BTRFS_LEAF.match(line) or line.startswith("node "):
            if cur is not None:
                items.append(BtrfsItem(leaf, cur[0], cur[1], int(cur[2]), "\n".join(body)))
                cur = None
            if m:
                cur, body = m.groups(), []
            elif (lm := _BTRFS_LEAF.match(line)) is not None:
                leaf = int(lm.group(1))
        elif cur is not None:
            body.append(line.strip())
    return items


def btrfs_chunks(fs: Path) -> list[BtrfsChunk]:
    out = []
    for it in btrfs_items(fs, "chunk"):
        if it.type == "CHUNK_ITEM":
            m = re.search(r"length (\d+) owner \d+ stripe_len \d+ type (\S+)", it.body)
            assert m, it.body
            out.append(
                BtrfsChunk(
                    it.offset,
                    int(m.group(1)),
                    m.group(2),
                    tuple(int(s) for s in re.findall(r"stripe \d+ devid 1 offset (\d+)", it.body)),
                )
            )
    return out


def btrfs_device(chunks: list[BtrfsChunk], logical: int) -> tuple[int, ...]:
    """The device offsets of a logical address (each copy's)."""
    c = next(c for c in chunks if c.logical <= logical < c.logical + c.length)
    return tuple(s + logical - c.logical for s in c.stripes)


def btrfs_subvolume(fs: Path, name: str) -> str:
    """A top-level subvolume's tree id, from its ROOT_REF in the root tree."""
    for it in btrfs_items(fs, "root"):
        if it.objectid == "FS_TREE" and it.type == "ROOT_REF" and it.body.endswith(f" name {name}"):
            return str(it.offset)
    raise AssertionError(f"no subvolume {name} at the top level of {fs}")


def btrfs_inode(items: list[BtrfsItem], path: str) -> int:
    """path's inode in a subvolume, walking down from its root directory (256) by
    the INODE_REFs (key: inode, INODE_REF, parent; body: its name)."""
    ino = 256
    for part in path.strip("/").split("/"):
        found = [
            int(it.objectid)
            for it in items
            if it.type == "INODE_REF" and it.offset == ino and it.body.endswith(f" name: {part}")
        ]
        assert len(found) == 1, f"{path}: {part!r} in directory inode {ino}: {found}"
        ino = found[0]
    return ino


@dataclass(frozen=True)
class BtrfsExtent:
    file_offset: int
    kind: str  # regular, prealloc, inline
    disk: int  # logical address of the disk extent (0: a hole)
    disk_bytes: int
    offset: int  # where in the disk extent the file's bytes begin
    bytes: int  # how many of them the file uses
    compression: int


def btrfs_extents(items: list[BtrfsItem]) -> dict[int, list[BtrfsExtent]]:
    """Every inode's EXTENT_DATA items, by inode."""
    out: dict[int, list[BtrfsExtent]] = {}
    for it in items:
        if it.type != "EXTENT_DATA":
            continue
        kind = re.search(r"type \d+ \((\w+)\)", it.body)
        assert kind, it.body
        disk = re.search(r"extent data disk byte (\d+) nr (\d+)", it.body)
        used = re.search(r"extent data offset (\d+) nr (\d+)", it.body)
        comp = re.search(r"compression (\d+)", it.body)
        e = BtrfsExtent(it.offset, kind.group(1), 0, 0, 0, 0, 0)
        if disk and used and comp:
            e = BtrfsExtent(
                it.offset,
                kind.group(1),
                int(disk.group(1)),
                int(disk.group(2)),
                int(used.group(1)),
                int(used.group(2)),
                int(comp.group(1)),
            )
        out.setdefault(int(it.objectid), []).append(e)
    return out


def btrfs_pages(
    items: list[BtrfsItem], chunks: list[BtrfsChunk], start: int, path: str
) -> dict[int, int]:
    """Page index -> disk sector of path's pages held uncompressed on disk (a
    file system at disk sector start, 4 KiB sectors)."""
    out = {}
    for e in btrfs_extents(items)[btrfs_inode(items, path)]:
        if e.kind == "regular" and e.disk and not e.compression:
            for k in range(e.bytes // PAGE):
                (dev,) = btrfs_device(chunks, e.disk + e.offset + k * PAGE)
                out[e.file_offset // PAGE + k] = start + dev // 512
    return out


def btrfs_restore(fs: Path, subvolume: str, path: str, dest: Path) -> bytes:
    """A file's bytes as btrfs restore reads them from the unmounted file system."""
    parts = [subvolume, *path.strip("/").split("/")]
    # Every directory on the way must match too: ^/(|@rootfs(|/usr(|/bin(|/dash))))$
    regex = (
        "^/"
        + "".join(("(|" if i == 0 else "(|/") + p.replace(".", r"\.") for i, p in enumerate(parts))
        + ")" * len(parts)
        + "$"
    )
    dest.mkdir(parents=True, exist_ok=True)
    tool_output("btrfs", "restore", "--path-regex", regex, str(fs), str(dest))
    return (dest / subvolume / path.strip("/")).read_bytes()


# ext2/3/4, by debugfs.
_EX = re.compile(
    r"^\s*(\d+)/\s*(\d+)\s+\d+/\s*\d+\s+(\d+)\s*-\s*(\d+)\s+(\d+)"
    r"(?:\s*-\s*(\d+))?\s+(\d+)\s*(\S*)$"
)


def debugfs(raw: Path, *commands: str) -> str:
    """debugfs' answers to commands, on a file system at the start of raw."""
    return subprocess.run(
        ["debugfs", "-f", "-", str(raw)],
        input="\n".join(commands) + "\n",
        capture_output=True,
        text=True,
        check=True,
    ).stdout


@dataclass(frozen=True)
class Ext4File:
    ino: int
    type: str  # debugfs' name: regular, directory, ...
    data: dict[int, int]  # file system block -> file block (initialized)
    tree: frozenset[int]  # its extent tree's own blocks


def ext4_files(raw: Path, inodes: list[int | str]) -> dict[int | str, Ext4File]:
    """Each inode's (number or path) type and block map, by debugfs stat and ex."""
    out: dict[int | str, Ext4File] = {}
    for name in inodes:
        spec = f"<{name}>" if isinstance(name, int) else name
        stat = debugfs(raw, f"stat {spec}")
        m = re.search(r"^Inode: (\d+)\s+Type: (\S+)", stat, re.M)
        assert m, f"debugfs: no inode {spec}: {stat[:200]}"
        data, tree = {}, set()
        for line in debugfs(raw, f"ex {spec}").splitlines():
            e = _EX.match(line)
            if e is None:
                continue
            level, depth, lo, hi, phys, _, n, flags = e.groups()
            if level != depth:  # an index entry: a tree block
                tree.add(int(phys))
            elif flags != "Uninit":
                assert int(hi) - int(lo) + 1 == int(n)
                data.update({int(phys) + k: int(lo) + k for k in range(int(n))})
        out[name] = Ext4File(int(m.group(1)), m.group(2), data, frozenset(tree))
    return out


def ext4_owners(raw: Path, blocks: list[int]) -> dict[int, int | None]:
    """File system block -> the inode debugfs' icheck says owns it (None: no inode)."""
    out: dict[int, int | None] = {}
    for i in range(0, len(blocks), 200):  # debugfs reads lines of about 8 KiB
        for line in debugfs(raw, "icheck " + " ".join(map(str, blocks[i : i + 200]))).splitlines():
            m = re.match(r"^(\d+)\t(\d+|<block not found>)$", line)
            if m:
                out[int(m.group(1))] = int(m.group(2)) if m.group(2).isdigit() else None
    assert set(out) == set(blocks)
    return out


def ext4_in_use(raw: Path, block: int, count: int) -> list[bool]:
    text = debugfs(raw, f"testb {block} {count}")
    return [f"Block {b} marked in use" in text for b in range(block, block + count)]
