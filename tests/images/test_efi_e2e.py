"""analyze-image end to end on a UEFI installer's layout: ESP, /boot, root and /var.

The efi golden image is Debian 13 on GPT with a FAT32 EFI system partition
at /boot/efi, /boot on ext2 (GRUB's grub.cfg names the kernel relative to
it), the root on ext4 and /var on ext3.  The analysis must find the kernel
through grub.cfg on /boot, map the pages of /boot and /var files (indirect
block maps, not extents) at their own partitions' offsets, and say that the
ESP is not mapped.  Properties, not counts: every listed block is
byte-identical to the base image and is, by e2fsprogs' own reading, the page
of the file at the offset the analysis recorded; some listed blocks are the
kernel on /boot and dpkg's database on /var; nothing outside the three mapped
file systems is listed.
"""

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import Analysis, analyze_cleanly
from listed_blocks import every_listed_block_is_the_images
from listed_file_bytes import every_listed_block_is_its_files_page
from pageshare import golden
from pageshare.image.ext4map import file_sectors
from pageshare.lists import sectorlist

pytestmark = pytest.mark.vm

# Fails (and the analyzer warns with its exit status) unless the guest mounted
# all three file systems from its /etc/fstab.
WORKLOAD = (
    "mountpoint -q /boot && mountpoint -q /boot/efi && mountpoint -q /var && "
    "md5sum /boot/vmlinuz-* /var/lib/dpkg/status /var/lib/dpkg/info/*.list >/dev/null"
)


@pytest.fixture(scope="module")
def analysed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Analysis, Path]]:
    image = golden.build_image("efi").path
    tmp = tmp_path_factory.mktemp("e2e-efi")
    result, raw = analyze_cleanly(tmp, image, "--workload", WORKLOAD)
    yield result, raw
    raw.unlink()


def listed(result: Analysis) -> sectorlist.SectorList:
    return sectorlist.read(Path(str(result.json()["list_path"])))


def test_guest_booted_with_every_file_system_mounted(analysed: tuple[Analysis, Path]) -> None:
    result, _ = analysed
    geo = golden.geometry("efi")
    assert "guest A ready" in result.stderr and "guest B ready" in result.stderr
    assert "warning: the workload" not in result.stderr, result.stderr
    for mp, fstype in (("/boot", "ext2"), ("/var", "ext3")):
        p = geo.at(mp)
        assert (
            f"also mapped: {mp} ({fstype} on /dev/sda{p.partition}, at sector "
            f"{p.start_sector}, 4096-byte blocks)"
        ) in result.stderr, result.stderr
    assert "note: /boot/efi (vfat on /dev/sda1) is not mapped" in result.stderr, result.stderr
    # The kernel the image's grub.cfg on /boot boots (its paths are relative to /boot).
    kernel = golden.build_image("efi").manifest["kernel_version"]
    assert (
        f"kernel {kernel}, root ext4 on /dev/sda3 at sector "
        f"{geo.root_start_sector}" in result.stderr
    ), result.stderr


def test_every_listed_block_is_its_files_page(
    analysed: tuple[Analysis, Path], tmp_path: Path
) -> None:
    result, raw = analysed
    geo = golden.geometry("efi")
    mapped = [
        range(geo.at(mp).start_sector, geo.at(mp).end_sector + 1) for mp in ("/", "/boot", "/var")
    ]
    every_listed_block_is_the_images(str(result.json()["list_path"]), raw, mapped, "/, /boot, /var")
    checked = every_listed_block_is_its_files_page(result.db, result.json(), raw, tmp_path / "dump")
    assert all(checked[mp] > 0 for mp in ("/", "/boot", "/var")), checked


def test_block_mapped_files_are_listed_at_their_partitions(analysed: tuple[Analysis, Path]) -> None:
    result, raw = analysed
    sl = listed(result)
    geo = golden.geometry("efi")
    kernel = golden.build_image("efi").manifest["kernel_version"]
    for mp, path in (("/boot", f"/vmlinuz-{kernel}"), ("/var", "/lib/dpkg/status")):
        start = geo.at(mp).start_sector
        sectors = set(file_sectors(raw, start * 512, path, start, 4096))
        assert sectors, f"{mp}{path} not found in the image"
        assert sectors & set(sl.blocks), f"no block of {mp}{path}, read by the workload, listed"
    db = sqlite3.connect(result.db)
    fss = db.execute(
        "SELECT mountpoint, fstype, start_sector, mapped FROM filesystem "
        "WHERE analysis_id=? ORDER BY mountpoint",
        (result.json()["analysis_id"],),
    ).fetchall()
    assert fss == [
        ("/", "ext4", geo.at("/").start_sector, 1),
        ("/boot", "ext2", geo.at("/boot").start_sector, 1),
        ("/boot/efi", "vfat", None, 0),  # skipped: no offset recorded
        ("/var", "ext3", geo.at("/var").start_sector, 1),
    ], fss
