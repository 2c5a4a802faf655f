"""analyze-image end to end on an ext4 root with 1 KiB blocks.

With 1 KiB blocks a 4 KiB page is four file system blocks: it can be listed
only where its four blocks are contiguous on the disk and the first starts
on a 4 KiB boundary (a block number that is a multiple of 4 on this
whole-disk image).  The small1k golden image is small's package set with
`mkfs.ext4 -b 1024`.  Properties, not counts: every listed block is
byte-identical to the base image, every listed block of the files every
boot reads is one of their pages that can be listed, some are listed, and
the pages that cannot be were kept out as `unaligned` or `discontiguous`.
"""

import sqlite3
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import Analysis, analyze_cleanly
from listed_blocks import every_listed_block_is_the_images
from listed_file_bytes import every_listed_block_is_its_files_page
from pageshare import golden
from pageshare.image.ext4map import lookup, parse_extents
from pageshare.lists import sectorlist

pytestmark = pytest.mark.vm

ALWAYS_READ = (
    "/usr/lib/systemd/systemd",
    "/usr/lib/x86_64-linux-gnu/libc.so.6",
    "/usr/lib/x86_64-linux-gnu/systemd/libsystemd-shared-252.so",
    "/usr/bin/bash",
    "/usr/lib/x86_64-linux-gnu/libcrypto.so.3",
)


@pytest.fixture(scope="module")
def analysed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Analysis, Path]]:
    image = golden.build_image("small1k").path
    tmp = tmp_path_factory.mktemp("e2e-small1k")
    result, raw = analyze_cleanly(tmp, image)
    yield result, raw
    raw.unlink()


def pages(raw: Path, path: str) -> tuple[set[int], set[int]]:
    """(sectors of the file's listable pages, sectors of all its blocks' 4 KiB units)."""
    out = subprocess.run(
        ["debugfs", "-R", f"ex {path}", str(raw)], capture_output=True, text=True, check=True
    ).stdout
    exts = next(iter(parse_extents("debugfs: ex <1>\n" + out).values()))
    assert exts, f"{path}: no extents"
    size = max(e.logical + e.length for e in exts)
    listable, every = set(), set()
    for first in range(0, size, 4):
        blocks = [lookup(exts, first + k) for k in range(4)]
        for b in blocks:
            if b is not None:
                every.add(b * 2 - b * 2 % 8)
        b0 = blocks[0]
        if b0 is not None and all(b == b0 + k for k, b in enumerate(blocks)) and b0 % 4 == 0:
            listable.add(b0 * 2)
    return listable, every


def test_every_listed_block_matches_the_base_image(analysed: tuple[Analysis, Path]) -> None:
    result, raw = analysed
    every_listed_block_is_the_images(str(result.json()["list_path"]), raw)


def test_only_whole_aligned_pages_are_listed(analysed: tuple[Analysis, Path]) -> None:
    result, raw = analysed
    listed = set(sectorlist.read(Path(str(result.json()["list_path"]))).blocks)
    some = False
    for path in ALWAYS_READ:
        listable, every = pages(raw, path)
        mine = listed & every
        assert mine <= listable, f"{path}: listed blocks that are not a whole aligned page"
        some = some or bool(mine)
    assert some, "no page of the files every boot reads is listed"
    db = sqlite3.connect(result.db)
    (size,) = db.execute("SELECT block_size FROM filesystem WHERE mountpoint='/'").fetchone()
    assert size == 1024
    verdicts = {
        v for (v,) in db.execute("SELECT DISTINCT verdict FROM guest_page WHERE kind='file'")
    }
    assert "stable" in verdicts and verdicts & {"unaligned", "discontiguous"}, verdicts


def test_every_listed_block_is_its_files_page(
    analysed: tuple[Analysis, Path], tmp_path: Path
) -> None:
    """By e2fsprogs' own reading of each recorded (inode, offset), not the analyzer's map."""
    result, raw = analysed
    every_listed_block_is_its_files_page(result.db, result.json(), raw, tmp_path)
