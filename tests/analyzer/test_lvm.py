"""LVM logical volumes to disk sectors, from the PV's on-disk label and metadata.

The label and metadata area are built byte by byte as LVM2 writes them
(label in sector 1, metadata text in a ring after the area's header; in
lvm_samples.py); the real thing, written by LVM in the libguestfs
appliance, is read by the golden builder's lvm variant and checked end to
end in test_lvm_e2e.py.
"""

import os
from pathlib import Path

import pytest
from lvm_samples import MDA_SIZE, METADATA, OTHER_PV, PE_START, PV_ID, pv_device
from pageshare.image import lvm
from pageshare.image.ext4map import fs_image


def reader(dev: bytes) -> lvm.Reader:
    return lambda at, size: dev[at : at + size]


def test_label_and_metadata() -> None:
    label = lvm.read_label(reader(pv_device(METADATA)))
    assert label is not None
    assert label.uuid == PV_ID and label.pe_start == PE_START
    assert label.metadata.startswith("vg0 {")


def test_metadata_that_wraps_around_the_ring() -> None:
    # A copy written near the end of the area continues after its header.
    label = lvm.read_label(reader(pv_device(METADATA, ring_offset=MDA_SIZE - 300)))
    assert label is not None and label.metadata == METADATA


def test_not_a_pv() -> None:
    assert lvm.read_label(reader(bytes(4096))) is None


def test_parse_config() -> None:
    name, vg = lvm.volume_group(METADATA)
    assert name == "vg0" and vg["extent_size"] == 8192
    assert vg["status"] == ["RESIZEABLE", "READ", "WRITE"]
    assert vg["logical_volumes"]["root"]["segment2"]["stripes"] == ["pv0", 150]
    assert vg["physical_volumes"]["pv0"]["id"] == PV_ID


def test_linear_segments_to_disk_sectors() -> None:
    _, vg = lvm.volume_group(METADATA)
    pv_start = 262144 + PE_START // 512  # partition start + pe_start
    segs, why = lvm.lv_segments(vg, "root", {PV_ID: pv_start})
    assert why == ""
    assert segs == [
        lvm.Segment(0, 100 * 8192, pv_start),
        lvm.Segment(100 * 8192, 20 * 8192, pv_start + 150 * 8192),
    ]
    assert lvm.to_disk(segs, 5) == pv_start + 5
    assert lvm.to_disk(segs, 100 * 8192 + 8) == pv_start + 150 * 8192 + 8
    assert lvm.to_disk(segs, 100 * 8192 - 4, 8) is None  # spans the two segments
    assert lvm.to_disk(segs, 120 * 8192) is None  # past the end


@pytest.mark.parametrize(
    "lv,why",
    [
        ("striped", "segment 1 of striped is not linear (2 stripes)"),
        ("mirrored", "segment 1 of mirrored is not linear (type 'raid1')"),
        ("elsewhere", f"elsewhere has extents on PV {OTHER_PV}, which is not on the image's disk"),
        ("nope", "logical volume nope is not in the volume group's metadata"),
    ],
)
def test_what_is_not_mapped(lv: str, why: str) -> None:
    _, vg = lvm.volume_group(METADATA)
    segs, reason = lvm.lv_segments(vg, lv, {PV_ID: 264192})
    assert segs == [] and why in reason


class FakeGuestfs:
    """pread_device over partitions of one raw disk image in memory."""

    def __init__(self, disk: bytes, parts: dict[int, int]) -> None:
        self.disk, self.parts = disk, parts

    def pread_device(self, dev: str, size: int, offset: int) -> bytes:
        start = self.parts[int(dev.removeprefix("/dev/sda") or 0)] * 512
        return self.disk[start + offset : start + offset + size]


def test_volume_groups_on_the_disk() -> None:
    disk = bytes(2048 * 512) + pv_device(METADATA) + bytes(1 << 20)
    vgs = lvm.volume_groups(FakeGuestfs(disk, {1: 2048, 2: 1}), {1: 2048, 2: 1})
    assert list(vgs) == ["vg0"]
    vg = vgs["vg0"]
    assert vg.pv_starts == {PV_ID: 2048 + PE_START // 512}
    assert vg.partition_of(2048 + PE_START // 512 + 99) == 1


def test_fs_image_assembles_segments(tmp_path: Path) -> None:
    raw = tmp_path / "disk.raw"
    with open(raw, "wb") as f:
        f.truncate(64 << 20)
        f.seek(16 << 20)
        f.write(b"A" * 4096)  # LV sectors 0.. at disk sector 32768
        f.seek(40 << 20)
        f.write(b"B" * 4096)  # LV sectors 2048.. at disk sector 81920
    runs = ((0, 2048, 32768), (2048, 2048, 81920))
    image, offset = fs_image(raw, runs, tmp_path / "lv.img")
    assert offset == 0 and image.stat().st_size == 4096 * 512
    data = image.read_bytes()
    assert data[:4096] == b"A" * 4096 and data[1 << 20 : (1 << 20) + 4096] == b"B" * 4096
    assert data.count(0) == len(data) - 8192
    assert image.stat().st_blocks * 512 < 1 << 20  # holes stayed holes
    # One run from the start: debugfs reads the raw disk at an offset, nothing copied.
    assert fs_image(raw, ((0, 2048, 32768),), tmp_path / "x.img") == (raw, 32768 * 512)
    assert not os.path.exists(tmp_path / "x.img")


class FakeImage(FakeGuestfs):
    """Also the file system facts survey() asks libguestfs for."""

    def part_list(self, dev: str) -> list[dict[str, int]]:
        return [
            {"part_num": n, "part_start": s * 512, "part_size": 8 << 20}
            for n, s in self.parts.items()
        ]

    def vfs_type(self, dev: str) -> str:
        return "ext4"

    def tune2fs_l(self, dev: str) -> dict[str, str]:
        return {"Block size": "4096", "Filesystem features": "has_journal extent 64bit"}

    def vfs_uuid(self, dev: str) -> str:
        return "c1a7e4d2-6b39-4f08-9e5a-3d2c8b7f1e64"


def test_survey_maps_a_linear_lv_and_refuses_the_others() -> None:
    from pageshare.errors import UserError
    from pageshare.image import fslayout

    disk = bytes(2048 * 512) + pv_device(METADATA) + bytes(1 << 20)
    g = FakeImage(disk, {1: 2048})
    mapped, skipped = fslayout.survey(
        g, {"/": "/dev/vg0/root", "/srv": "/dev/vg0/mirrored", "/data": "/dev/vg0/striped"}, 1 << 22
    )
    pv_start = 2048 + PE_START // 512
    assert len(mapped) == 1
    root = mapped[0]
    assert (root.device, root.lv, root.partition, root.start_sector, root.guest_start_sector) == (
        "/dev/vg0/root",
        "vg0/root",
        1,
        pv_start,
        0,
    )
    assert root.runs == ((0, 100 * 8192, pv_start), (100 * 8192, 20 * 8192, pv_start + 150 * 8192))
    why = {s.mountpoint: s.reason for s in skipped}
    assert "not linear (type 'raid1')" in why["/srv"]
    assert "not linear (2 stripes)" in why["/data"]
    # The same refusal for a root: refused with what to do.
    with pytest.raises(UserError, match="cannot be mapped: segment 1 of mirrored") as e:
        fslayout.root_must_map(Path("x.qcow2"), next(s for s in skipped if s.mountpoint == "/srv"))
    assert "lvconvert --type linear" in e.value.hint
