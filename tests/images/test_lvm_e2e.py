"""analyze-image end to end on an image whose root is an LVM logical volume.

The lvm golden image has its root file system on vg0/root, a linear LV on
GPT partition 1 (an LVM PV).  Nothing on the host activates LVM: the
inspection reads the PV's label and metadata to find the LV's extents, the
guest's initrd activates the volume group, and page-cache pages of the root
(which the guest sees on dm-0, start sector 0) are mapped through the LV's
segments to virtual-disk sectors.  Properties, not counts: every listed
block is byte-identical to the base image and lies inside the LV's extents,
and blocks of files every boot reads are listed.
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

# Fails (and the analyzer warns with its exit status) unless the guest's root
# really is the logical volume.
WORKLOAD = "findmnt -n -o SOURCE / | grep -qx /dev/mapper/vg0-root"
ALWAYS_READ = ("/usr/lib/systemd/systemd", "/usr/lib/x86_64-linux-gnu/libc.so.6", "/usr/sbin/lvm")


@pytest.fixture(scope="module")
def analysed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Analysis, Path, int]]:
    image = golden.build_image("lvm")
    tmp = tmp_path_factory.mktemp("e2e-lvm")
    result, raw = analyze_cleanly(tmp, image.path, "--workload", WORKLOAD)
    yield result, raw, int(image.manifest["root_fs_start_sector"])
    raw.unlink()


def test_guest_root_was_the_logical_volume(analysed: tuple[Analysis, Path, int]) -> None:
    result, _, lv_start = analysed
    assert "warning: the workload" not in result.stderr, result.stderr
    assert (
        f"mapped: / (ext4 on /dev/vg0/root, LV vg0/root, 1 segment(s) from sector "
        f"{lv_start}" in result.stderr
    )
    # The LV starts after the PV's label and metadata, not at the partition.
    assert lv_start > golden.geometry("lvm").root_start_sector
    db = sqlite3.connect(result.db)
    rows = db.execute(
        "SELECT mountpoint, device, start_sector, mapped FROM filesystem WHERE analysis_id=?",
        (result.json()["analysis_id"],),
    ).fetchall()
    assert rows == [("/", "/dev/vg0/root", lv_start, 1)]


def test_every_listed_block_matches_the_base_image(analysed: tuple[Analysis, Path, int]) -> None:
    result, raw, lv_start = analysed
    lv = range(lv_start, lv_start + golden.LVM_ROOT_BYTES // 512)
    every_listed_block_is_the_images(
        str(result.json()["list_path"]), raw, [lv], "the logical volume"
    )


def test_files_every_boot_reads_are_listed(analysed: tuple[Analysis, Path, int]) -> None:
    result, raw, lv_start = analysed
    sl = sectorlist.read(Path(str(result.json()["list_path"])))
    for path in ALWAYS_READ:
        sectors = set(file_sectors(raw, lv_start * 512, path, lv_start, 4096))
        assert sectors, f"{path} not found in the image"
        assert sectors & set(sl.blocks), f"no block of {path} is listed"


def test_list_verifies_against_the_image(analysed: tuple[Analysis, Path, int]) -> None:
    result, _, _ = analysed
    list_verifies(str(result.json()["list_path"]), golden.build_image("lvm").path)


def test_every_listed_block_is_its_files_page(
    analysed: tuple[Analysis, Path, int], tmp_path: Path
) -> None:
    """By e2fsprogs' own reading of each recorded (inode, offset), not the analyzer's map."""
    result, raw, _ = analysed
    every_listed_block_is_its_files_page(result.db, result.json(), raw, tmp_path)
