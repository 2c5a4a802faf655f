"""The inspection cache: one entry per image content, nothing left by a refusal.

Real libguestfs inspections of the small golden image, each test with its own
PAGESHARE_CACHE so that what it counts is its own.
"""

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from conftest import run_analyze
from image_trees import mkfs_image
from pageshare.errors import UserError
from pageshare.image import image_inspect
from pageshare.image.image_inspect import inspect_image, probe_format


def entries(cache: Path) -> list[Path]:
    """The inspection entries (not the by-file index)."""
    return sorted(p for p in (cache / "inspect").iterdir() if p.name != "by-file")


def no_empty_dirs(cache: Path) -> None:
    empty = [d for d, subdirs, files in os.walk(cache / "inspect") if not subdirs and not files]
    assert empty == [], f"empty directories left: {empty}"


@pytest.mark.vm
def test_same_image_under_other_paths_shares_one_entry(
    tmp_path: Path, small_image: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("PAGESHARE_CACHE", str(cache))
    first = tmp_path / "images" / "golden.qcow2"
    first.parent.mkdir()
    shutil.copyfile(small_image, first)
    fmt, vsize = probe_format(first)
    a = inspect_image(first, fmt, vsize)
    assert a.kernel.is_file() and a.info.path == str(first.resolve())
    assert entries(cache) == [a.kernel.parent]

    # From here on an appliance boot would be a cache miss.
    def no_guestfs(*_: Any) -> None:
        raise AssertionError("inspected again instead of reusing the cache entry")

    monkeypatch.setattr(image_inspect, "_inspect_with_guestfs", no_guestfs)

    link = tmp_path / "elsewhere" / "same-file.qcow2"
    link.parent.mkdir()
    os.link(first, link)
    copy = tmp_path / "copy.qcow2"
    shutil.copyfile(first, copy)
    for other in (link, copy, first):
        b = inspect_image(other, fmt, vsize)
        assert b.kernel == a.kernel and b.initrd == a.initrd
        assert b.info.path == str(other.resolve())  # the path asked about, not the first
        assert b.info.kernel_version == a.info.kernel_version
    assert entries(cache) == [a.kernel.parent]  # one kernel and initrd, not three
    no_empty_dirs(cache)

    # Other bytes are another image: a changed copy is inspected again.
    with open(copy, "r+b") as f:
        f.seek(0, os.SEEK_END)
        f.write(b"\0" * 512)
    with pytest.raises(AssertionError, match="inspected again"):
        inspect_image(copy, fmt, vsize)
    no_empty_dirs(cache)


@pytest.mark.vm
def test_refused_inspection_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("PAGESHARE_CACHE", str(cache))
    img = mkfs_image(tmp_path, "ext4", {"data/readme.txt": "just data\n"})
    fmt, vsize = probe_format(img)
    with pytest.raises(UserError, match="no Linux installation found"):
        inspect_image(img, fmt, vsize)
    assert entries(cache) == []
    no_empty_dirs(cache)
    # The same through the real command, twice.
    for _ in range(2):
        r = run_analyze(tmp_path, str(img), env={"PAGESHARE_CACHE": str(cache)})
        assert r.rc == 2 and "no Linux installation found" in r.stderr, r.stderr
    assert entries(cache) == []
    no_empty_dirs(cache)
