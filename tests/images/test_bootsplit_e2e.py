"""analyze-image end to end on an image with /boot on a partition of its own.

The bootsplit golden image has its kernel and initrd only on /boot (GPT
partition 2, before the root), so the analysis must find them through the
image's /etc/fstab, boot the guest with the root file system's UUID, and map
page-cache pages of /boot files with /boot's own partition offset.  The
workload reads the kernel image from /boot in both guests.  Properties, not
counts: every listed block is byte-identical to the base image, some listed
blocks are /boot's kernel at /boot's offset, blocks of files every boot reads
are listed at the root's offset, and nothing outside the two file systems is.
"""

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import Analysis, analyze_cleanly
from listed_blocks import every_listed_block_is_the_images, list_verifies
from listed_file_bytes import every_listed_block_is_its_files_page
from pageshare import golden
from pageshare.image.ext4map import file_sectors
from pageshare.lists import sectorlist

pytestmark = pytest.mark.vm

# Fails (and the analyzer warns with its exit status) unless /boot is the
# separate file system, mounted by the guest from its /etc/fstab.
WORKLOAD = "mountpoint -q /boot && md5sum /boot/vmlinuz-* /boot/config-* >/dev/null"
ALWAYS_READ = ("/usr/lib/systemd/systemd", "/usr/lib/x86_64-linux-gnu/libc.so.6")


@pytest.fixture(scope="module")
def analysed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Analysis, Path]]:
    image = golden.build_image("bootsplit").path
    tmp = tmp_path_factory.mktemp("e2e-bootsplit")
    result, raw = analyze_cleanly(tmp, image, "--workload", WORKLOAD)
    yield result, raw
    raw.unlink()


def listed(result: Analysis) -> sectorlist.SectorList:
    return sectorlist.read(Path(str(result.json()["list_path"])))


def test_guest_booted_with_boot_mounted_and_ran_the_workload(
    analysed: tuple[Analysis, Path],
) -> None:
    result, _ = analysed
    assert "guest A ready" in result.stderr and "guest B ready" in result.stderr
    assert "warning: the workload" not in result.stderr, result.stderr
    assert (
        "also mapped: /boot (ext4 on /dev/sda2, at sector 262144, 4096-byte blocks)"
        in result.stderr
    )


def test_every_listed_block_matches_the_base_image(analysed: tuple[Analysis, Path]) -> None:
    result, raw = analysed
    geo = golden.geometry("bootsplit")
    boot = range(geo.boot_start_sector, geo.boot_end_sector + 1)
    root = range(geo.root_start_sector, geo.root_end_sector + 1)
    # File pages only (no --include-metadata): inside one of the two file systems.
    every_listed_block_is_the_images(
        str(result.json()["list_path"]), raw, [boot, root], "/boot and /"
    )


def test_boot_files_are_listed_at_the_boot_partition(analysed: tuple[Analysis, Path]) -> None:
    result, raw = analysed
    sl = listed(result)
    geo = golden.geometry("bootsplit")
    kernel = golden.build_image("bootsplit").manifest["kernel_version"]
    start = geo.boot_start_sector
    # On /boot's own file system the kernel is /vmlinuz-<version>.
    sectors = set(file_sectors(raw, start * 512, f"/vmlinuz-{kernel}", start, 4096))
    assert sectors and all(geo.boot_start_sector <= s <= geo.boot_end_sector for s in sectors)
    assert sectors & set(sl.blocks), "no block of /boot's kernel, read by the workload, listed"
    db = sqlite3.connect(result.db)
    analysis_id = result.json()["analysis_id"]
    # Its path is the guest's, and its inode is told apart from the root's by file system.
    rows = db.execute(
        "SELECT fs_uuid, path FROM file WHERE analysis_id=? AND path=?",
        (analysis_id, f"/boot/vmlinuz-{kernel}"),
    ).fetchall()
    boot_uuid = str(golden._spec("bootsplit").boot_fs_uuid).replace("-", "")
    assert rows == [(boot_uuid, f"/boot/vmlinuz-{kernel}")]
    fss = db.execute(
        "SELECT mountpoint, start_sector, mapped FROM filesystem "
        "WHERE analysis_id=? ORDER BY mountpoint",
        (analysis_id,),
    ).fetchall()
    assert fss == [("/", geo.root_start_sector, 1), ("/boot", geo.boot_start_sector, 1)]


def test_files_every_boot_reads_are_listed_at_the_root(analysed: tuple[Analysis, Path]) -> None:
    result, raw = analysed
    sl = listed(result)
    start = golden.geometry("bootsplit").root_start_sector
    for path in ALWAYS_READ:
        sectors = set(file_sectors(raw, start * 512, path, start, 4096))
        assert sectors, f"{path} not found in the image"
        assert sectors & set(sl.blocks), f"no block of {path} is listed"


def test_list_verifies_against_the_image(analysed: tuple[Analysis, Path]) -> None:
    result, _ = analysed
    list_verifies(str(result.json()["list_path"]), golden.build_image("bootsplit").path)


def test_every_listed_block_is_its_files_page(
    analysed: tuple[Analysis, Path], tmp_path: Path
) -> None:
    """By e2fsprogs' own reading of each recorded (inode, offset), not the analyzer's map."""
    result, raw = analysed
    every_listed_block_is_its_files_page(result.db, result.json(), raw, tmp_path)
