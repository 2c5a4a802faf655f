"""Raw golden images with an XFS or btrfs file system on the whole disk (no
partition table), as a Debian root written straight to a raw disk is.

The images are real: mkfs.xfs from a protofile and mkfs.btrfs --rootdir
write files of random bytes into a file (nothing mounted).  The probe must
take them as disk images, as it takes the same bytes in a qcow2; the survey
(through a stand-in for libguestfs that reads the image's own bytes and
blkid's answers) must map the file system at sector 0 of the disk; and the
file system readers, on the copy analyze-image gives them, must map each
file to the disk blocks that hold its bytes.
"""

import os
import subprocess
from pathlib import Path

from pageshare.image import btrfsmap, fslayout, xfsmap
from pageshare.image.ext4map import Extent, fs_image
from pageshare.image.image_inspect import probe_format

SIZE = 320 << 20
FILES = {"big": 300_000, "sub/deep": 70_000}


class WholeDisk:
    """What fslayout.survey asks libguestfs, answered from a raw image whose
    file system covers the whole disk (libguestfs' /dev/sda)."""

    def __init__(self, image: Path) -> None:
        self.image = image

    def part_list(self, dev: str) -> list[dict[str, int]]:
        raise RuntimeError("part_list: unrecognised disk label")

    def pread_device(self, dev: str, size: int, offset: int) -> bytes:
        assert dev == "/dev/sda"
        with open(self.image, "rb") as f:
            f.seek(offset)
            return f.read(size)

    def _blkid(self, tag: str) -> str:
        return subprocess.run(
            ["blkid", "-p", "-o", "value", "-s", tag, str(self.image)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()

    def vfs_type(self, dev: str) -> str:
        assert dev == "/dev/sda"
        return self._blkid("TYPE")

    def vfs_uuid(self, dev: str) -> str:
        assert dev == "/dev/sda"
        return self._blkid("UUID")

    def list_md_devices(self) -> list[str]:
        return []


def _files(tmp: Path) -> dict[str, bytes]:
    files = {rel: os.urandom(n) for rel, n in FILES.items()}
    for rel, data in files.items():
        (tmp / "root" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp / "root" / rel).write_bytes(data)
    return files


def _empty_disk(tmp: Path) -> Path:
    disk = tmp / "disk.raw"
    with open(disk, "wb") as f:
        f.truncate(SIZE)
    return disk


def _raw_xfs(tmp: Path) -> tuple[Path, dict[str, bytes]]:
    files = _files(tmp)
    (tmp / "proto").write_text(
        "/dev/null\n0 0\nd--755 0 0\n"
        f"big ---644 0 0 {tmp}/root/big\n"
        "sub d--755 0 0\n"
        f"deep ---644 0 0 {tmp}/root/sub/deep\n"
        "$\n$\n"
    )
    disk = _empty_disk(tmp)
    subprocess.run(["mkfs.xfs", "-q", "-p", str(tmp / "proto"), str(disk)], check=True)
    return disk, files


def _raw_btrfs(tmp: Path) -> tuple[Path, dict[str, bytes]]:
    files = _files(tmp)
    disk = _empty_disk(tmp)
    subprocess.run(
        ["mkfs.btrfs", "-q", "-r", str(tmp / "root"), str(disk)], check=True, capture_output=True
    )
    return disk, files


def _surveyed(disk: Path, fstype: str) -> fslayout.MappedFs:
    """The survey of the whole disk as the root: mapped at sector 0, one run."""
    mapped, skipped = fslayout.survey(WholeDisk(disk), {"/": "/dev/sda"}, SIZE // 512)
    assert skipped == []
    [fs] = mapped
    assert (fs.mountpoint, fs.fstype, fs.partition, fs.start_sector, fs.block_size) == (
        "/",
        fstype,
        0,
        0,
        4096,
    )
    assert fs.runs == ((0, SIZE // 512, 0),)
    return fs


def _check_bytes(disk: Path, ext: list[Extent], data: bytes) -> int:
    """Every mapped block's bytes on the disk equal the file's bytes at its offset."""
    blocks = 0
    with open(disk, "rb") as f:
        for e in ext:
            for k in range(e.length):
                f.seek((e.physical + k) * 4096)
                want = data[(e.logical + k) * 4096 : (e.logical + k + 1) * 4096]
                assert f.read(len(want)) == want, f"block {e.logical + k}"
                blocks += 1
    return blocks


def _inodes_by_path(paths: dict[int, str]) -> dict[str, int]:
    return {p.lstrip("/"): ino for ino, p in paths.items()}


def test_a_raw_whole_disk_xfs_is_probed_surveyed_and_its_files_mapped(tmp_path: Path) -> None:
    disk, files = _raw_xfs(tmp_path)
    assert probe_format(disk) == ("raw", SIZE)
    fs = _surveyed(disk, "xfs")
    # analyze-image hands xfs_db a copy of the file system's runs.
    copy, offset = fs_image(disk, fs.runs, tmp_path / "fs.img", copy=True)
    assert offset == 0
    out = subprocess.run(
        ["xfs_db", "-r", "-c", "blockget -n", "-c", "ncheck", str(copy)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    inos = {line.split()[1]: int(line.split()[0]) for line in out.splitlines() if line.strip()}
    assert _inodes_by_path(xfsmap.read_paths(copy, [inos[p] for p in files])) == {
        p: inos[p] for p in files
    }
    ext = xfsmap.read_extents(copy, [inos[p] for p in files])
    for rel, data in files.items():
        assert _check_bytes(disk, ext[inos[rel]], data) == -(-len(data) // 4096), rel


def test_a_raw_whole_disk_btrfs_is_probed_surveyed_and_its_files_mapped(tmp_path: Path) -> None:
    disk, files = _raw_btrfs(tmp_path)
    assert probe_format(disk) == ("raw", SIZE)
    fs = _surveyed(disk, "btrfs")
    assert fs.features == "devices=1"
    copy, offset = fs_image(disk, fs.runs, tmp_path / "fs.img", copy=True)
    assert offset == 0
    # mkfs.btrfs --rootdir keeps the source files' inode numbers: every
    # inode with a name in the top-level subvolume, and its path.
    dump = subprocess.run(
        ["btrfs", "inspect-internal", "dump-tree", "-t", "5", str(copy)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    named = sorted(
        {int(line.split("(")[1].split()[0]) for line in dump.splitlines() if " INODE_REF " in line}
    )
    inos = _inodes_by_path(btrfsmap.read_paths(copy, named))
    assert set(files) <= set(inos), inos
    ext, skipped = btrfsmap.read_extents(copy, [inos[p] for p in files])
    assert skipped.inodes == set() and skipped.compressed_extents == 0
    for rel, data in files.items():
        assert _check_bytes(disk, ext[inos[rel]], data) == -(-len(data) // 4096), rel
