"""analyze-image end to end on raw images whose XFS or btrfs root is the whole
disk, no partition table: a Debian root written straight to a raw disk.

Each image is the root partition of the xfs or btrfs golden image (the
small package set; the btrfs root in subvolume @rootfs) copied out into a
raw file of the file system's size.  Its /etc/fstab names the root by UUID,
so it boots as /dev/vda.  Properties, not counts: the probe takes the raw
file, the guests' root was that file system on the whole disk, the root is
mapped at sector 0, every listed block is byte-identical to the image, the
list verifies against it, and blocks of files every boot reads are listed,
each the file's own page as the kernel's file system driver reads it (the
file copied out with libguestfs, not through the analyzer's block maps).
"""

import sqlite3
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import Analysis, analyze_cleanly
from listed_blocks import every_listed_block_is_the_images, list_verifies
from pageshare import golden
from pageshare.image.ext4map import fs_image

pytestmark = pytest.mark.vm

ALWAYS_READ = ("/usr/lib/systemd/systemd", "/usr/lib/x86_64-linux-gnu/libc.so.6")
PAGE = 4096


@pytest.fixture(scope="module", params=["xfs", "btrfs"])
def analysed(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Analysis, Path]]:
    variant: str = request.param
    tmp = tmp_path_factory.mktemp(f"e2e-raw-whole-disk-{variant}")
    geo = golden.geometry(variant)
    disk = tmp / "golden.raw"
    subprocess.run(
        ["qemu-img", "convert", "-O", "raw", str(golden.build_image(variant).path), str(disk)],
        check=True,
    )
    whole, _ = fs_image(
        disk, ((0, geo.fs_bytes // 512, geo.root_start_sector),), tmp / "whole-disk.raw", copy=True
    )
    disk.unlink()
    assert whole.stat().st_size == geo.fs_bytes
    # The workload fails (and the test with it) unless / is this file system on
    # the whole virtual disk (findmnt shows btrfs' subvolume in brackets).
    workload = f"findmnt -n -o FSTYPE,SOURCE / | grep -Eq '^{variant} +/dev/vda(\\[|$)'"
    result, raw = analyze_cleanly(tmp, whole, "--workload", workload)
    raw.unlink()  # the same bytes as whole
    yield variant, result, whole
    whole.unlink()


def test_the_guest_root_was_the_whole_disk(analysed: tuple[str, Analysis, Path]) -> None:
    variant, result, whole = analysed
    assert "warning: the workload" not in result.stderr, result.stderr
    db = sqlite3.connect(result.db)
    aid = result.json()["analysis_id"]
    assert db.execute(
        "SELECT i.format, i.virtual_size FROM image i JOIN analysis a ON "
        "a.image_id=i.id WHERE a.id=?",
        (aid,),
    ).fetchone() == ("raw", whole.stat().st_size)
    rows = db.execute(
        "SELECT mountpoint, device, fstype, start_sector, block_size, mapped FROM "
        "filesystem WHERE analysis_id=?",
        (aid,),
    ).fetchall()
    assert rows == [("/", "/dev/sda", variant, 0, 4096, 1)]
    root = "btrfsvol:/dev/sda/@rootfs" if variant == "btrfs" else "/dev/sda"
    assert f"root {variant} on {root} at sector 0" in result.stderr


def test_every_listed_block_matches_the_image(analysed: tuple[str, Analysis, Path]) -> None:
    _, result, whole = analysed
    every_listed_block_is_the_images(
        str(result.json()["list_path"]), whole, [range(0, whole.stat().st_size // 512)], "the disk"
    )
    list_verifies(str(result.json()["list_path"]), whole)


def _copied_out(variant: str, image: Path, paths: tuple[str, ...], dest: Path) -> dict[str, bytes]:
    """The files' bytes, as the appliance kernel's file system driver reads them."""
    import guestfs  # Debian's python3-guestfs

    g = guestfs.GuestFS(python_return_dict=True)
    try:
        g.set_backend_settings(["force_tcg"])  # as image_inspect does by default
        g.add_drive_opts(str(image), readonly=1, format="raw")
        g.launch()
        g.mount_options("ro" + (",subvol=@rootfs" if variant == "btrfs" else ""), "/dev/sda", "/")
        got = {}
        for i, path in enumerate(paths):
            g.download(path, str(dest / str(i)))
            got[path] = (dest / str(i)).read_bytes()
        return got
    finally:
        g.close()


def test_files_every_boot_reads_are_listed_as_their_own_pages(
    analysed: tuple[str, Analysis, Path], tmp_path: Path
) -> None:
    variant, result, whole = analysed
    files = _copied_out(variant, whole, ALWAYS_READ, tmp_path)
    db = sqlite3.connect(result.db)
    aid = result.json()["analysis_id"]
    with whole.open("rb") as disk:
        for path, data in files.items():
            blocks = db.execute(
                "SELECT lb.sector, lb.file_offset FROM listed_block lb JOIN file f ON "
                "f.analysis_id=lb.analysis_id AND f.ino=lb.ino WHERE lb.analysis_id=? "
                "AND lb.kind='file' AND f.path=?",
                (aid, path),
            ).fetchall()
            assert blocks, f"no block of {path} is listed"
            for sector, offset in blocks:
                page = data[offset : offset + PAGE]
                disk.seek(sector * 512)
                assert disk.read(PAGE) == page + bytes(PAGE - len(page)), (
                    f"{path} offset {offset} listed at sector {sector} is not its page"
                )
