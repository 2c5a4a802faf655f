"""File system images made from a tree, with nothing mounted on the host.

ext2, ext3 and ext4 by mkfs -d; an EFI system partition's FAT32 by mkfs.vfat
and mtools' mcopy; XFS and btrfs by their mkfs on the host, filled from a tar
of the tree in the libguestfs appliance (mkfs.xfs cannot copy a directory
with all its attributes, and mkfs.btrfs 6.2 makes no subvolumes).
"""

from __future__ import annotations

from pathlib import Path

from .host import _run, appliance
from .layout import FS_BLOCK

FS_LABEL = "root"


def _make_ext4(
    rootdir: Path,
    fs_image: Path,
    fs_bytes: int,
    fs_uuid: str,
    label: str = FS_LABEL,
    block: int = FS_BLOCK,
    fstype: str = "ext4",
) -> None:
    """An ext4 (or, by fstype, ext2 or ext3: indirect block maps) file system
    image holding the tree."""
    with fs_image.open("wb") as f:
        f.truncate(fs_bytes)
    # Zeroing inode tables and journal now is free on a sparse file, and it
    # spares every clone the ext4lazyinit writes after its first mount.
    extended = f"hash_seed={fs_uuid},lazy_itable_init=0,lazy_journal_init=0"
    _run(
        [f"mkfs.{fstype}", "-q", "-F", "-b", str(block), "-L", label, "-U", fs_uuid,
         "-E", extended, "-d", str(rootdir), str(fs_image)]
    )  # fmt: skip


def _make_vfat(tree: Path, fs_image: Path, fs_bytes: int, volume_id: str, label: str) -> None:
    """A FAT32 file system image (an EFI system partition) holding the tree.
    mkfs.vfat and mtools' mcopy work on the file: nothing is mounted, and
    the host needs no vfat driver."""
    with fs_image.open("wb") as f:
        f.truncate(fs_bytes)
    _run(
        [
            "mkfs.vfat",
            "-F",
            "32",
            "-s",
            "1",
            "-i",
            volume_id.replace("-", ""),
            "-n",
            label,
            str(fs_image),
        ]
    )
    entries = sorted(str(e) for e in tree.iterdir())
    if entries:
        _run(["mcopy", "-s", "-p", "-m", "-i", str(fs_image), *entries, "::/"])


def _make_xfs(tree: Path, fs_image: Path, fs_bytes: int, fs_uuid: str) -> None:
    """An XFS file system image (the spec's UUID, label root) holding the root
    tree's tar.  mkfs.xfs runs on the host; the tar is unpacked by the
    libguestfs appliance, which mounts the image (nothing is mounted on the
    host)."""
    with fs_image.open("wb") as f:
        f.truncate(fs_bytes)
    _run(
        [
            "mkfs.xfs",
            "-q",
            "-f",
            "-b",
            f"size={FS_BLOCK}",
            "-L",
            FS_LABEL,
            "-m",
            f"uuid={fs_uuid}",
            str(fs_image),
        ]
    )
    with appliance(fs_image) as g:
        g.mount("/dev/sda", "/")
        g.tar_in(str(tree), "/", xattrs=True, acls=True)
        g.umount_all()


def _make_btrfs(
    tree: Path,
    fs_image: Path,
    fs_bytes: int,
    fs_uuid: str,
    subvol: str,
    compressed: tuple[str, ...],
) -> None:
    """A single-device btrfs image (the spec's UUID, label root; mkfs' defaults:
    SINGLE data, DUP metadata, 4 KiB sectors) holding the root tree's tar in
    subvolume subvol (the top level if ""), written uncompressed by the
    libguestfs appliance's kernel; then the files of compressed are rewritten
    in place through a compress-force mount, so their extents are compressed.
    mkfs.btrfs runs on the host; nothing is mounted on the host."""
    with fs_image.open("wb") as f:
        f.truncate(fs_bytes)
    _run(
        [
            "mkfs.btrfs",
            "-q",
            "-f",
            "-s",
            str(FS_BLOCK),
            "-L",
            FS_LABEL,
            "-U",
            fs_uuid,
            str(fs_image),
        ]
    )
    top = f"/{subvol}" if subvol else "/"
    with appliance(fs_image) as g:
        g.mount("/dev/sda", "/")
        if subvol:
            g.btrfs_subvolume_create(top)
        g.tar_in(str(tree), top, xattrs=True, acls=True)
        g.umount_all()
        if compressed:
            g.mount_options("compress-force=zlib", "/dev/sda", "/")
            for path in compressed:
                inside = top.rstrip("/") + path
                # Rewritten in place (same inode, owner and mode): the new
                # extents are compressed.  A copy could reflink the old ones.
                g.write(inside, g.read_file(inside))
            g.umount_all()
