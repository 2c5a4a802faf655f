"""Build the golden images that guests are cloned from.

A golden image here is an ordinary Debian 12 (bookworm) or 13 (trixie) system disk as qcow2,
the kind an operator would make once and clone many VMs from.  Nothing in it
knows about the analysis: the point of the project is to measure what ordinary
guests keep in their page caches, so the image must not be special.

The image is built without mounting anything: mmdebstrap installs into a
directory, ``mkfs.ext4 -d`` turns that directory into a filesystem image, and
for the partitioned layouts the filesystem is copied into a GPT disk at the same
offset Debian's cloud images use ("gpt"), behind a separate /boot partition
made the same way from the tree's /boot ("gpt-bootsplit"), or into a linear
LVM logical volume on that partition ("gpt-lvm"; LVM's metadata is written
in the libguestfs appliance).  An XFS root ("xfs") is made by mkfs.xfs and
filled from a tar of the tree in the appliance, since mkfs.xfs cannot copy a
directory with all its attributes; so is a btrfs root ("btrfs"), unpacked
into a subvolume @rootfs as Debian's installer lays it out (mkfs.btrfs 6.2
makes no subvolumes).  The "mbr" layout is Debian's installer's on a BIOS
machine: an MBR (msdos) label written by sfdisk, the root in primary
partition 1 at sector 2048 and swap in logical partition 5 inside extended
partition 2 at the end of the disk.  The "gpt-efi" layout is a UEFI
installer's: a FAT32 EFI system partition (mkfs.vfat and mtools' mcopy, no
mount) with GRUB made by the image's own grub-mkimage, /boot (ext2) with
GRUB's modules and a grub.cfg as update-grub writes it, the root, and /var
(ext3), each made by mkfs -d from its part of the tree.  The other layouts
have no boot loader: the analyzer boots guests by direct kernel boot with
the image's own kernel and initrd from /boot.

Images are cached under ``cache_dir("images")/<variant>-<key>/`` where the key
hashes the variant's spec and BUILDER_VERSION.  The Debian mirror moves on, so
two builds with the same key may differ in package versions; the cached image
is kept until ``--force``.  Bump BUILDER_VERSION (spec.py) whenever a change
to this package changes what ends up in an image.

Start from build_image(), or ``python -m pageshare.golden --help``.  The
modules, in the order a build uses them:

- variants: VARIANTS, the table of what each image holds (the authority);
- spec: a variant's checked _Spec, and image_key() with BUILDER_VERSION;
- layout, disk_geometry: the layouts' sectors and sizes, and geometry(),
  where a variant's file systems sit on its disk;
- host: the checks of the build host, and running its tools;
- rootfs: mmdebstrap's tree, customized and split by mount point;
- bootloader: GRUB for the "gpt-efi" layout;
- filesystems: ext2/3/4, vfat, XFS and btrfs images of the trees;
- disk: partition tables, LVM, the raw disk and its qcow2;
- image_cache: GoldenImage, cached_image(), the manifest, publication;
- build: build_image(), the steps in order; cli: the command line.

Everything other code uses is re-exported here, and code outside the
package looks it up here when called, so patching a name here (monkeypatch)
reaches that code.  The modules import what they use from the module that
defines it: to change what the package itself reads, patch it there
(BUILDER_VERSION in spec for image_key, build_image in cli for main).
"""

from __future__ import annotations

# The public names, and (imported as themselves) the internals that tests
# and packaging/tests call directly.
from .build import _unescape_mountinfo as _unescape_mountinfo
from .build import build_image
from .cli import main
from .disk import QCOW2_CLUSTER_SIZE
from .disk import _copy_sparse as _copy_sparse
from .disk_geometry import Geometry, Placed, geometry
from .filesystems import FS_LABEL
from .filesystems import _make_ext4 as _make_ext4
from .host import Log
from .host import _required_tools as _required_tools
from .image_cache import GoldenImage, cached_image
from .image_cache import _sha256 as _sha256
from .layout import (
    BOOT_LABEL,
    BOOT_PARTITION,
    BOOT_SECTORS,
    EFI_FIRST_SECTOR,
    FS_BLOCK,
    GIB,
    GPT_BACKUP_SECTORS,
    GPT_BIOS_BOOT,
    GPT_ESP,
    GPT_ROOT_PARTITION,
    GPT_ROOT_START_SECTOR,
    GPT_TYPE,
    LVM_LV,
    LVM_ROOT_BYTES,
    LVM_VG,
    MBR_EXTENDED_PARTITION,
    MBR_ROOT_PARTITION,
    MBR_ROOT_START_SECTOR,
    MBR_SWAP_PARTITION,
    MBR_SWAP_SECTORS,
    MIB_SECTORS,
    SECTOR,
)
from .rootfs import _customize as _customize
from .rootfs import _root_fstype_hook as _root_fstype_hook
from .spec import BUILDER_VERSION, OtherFs, image_key
from .spec import _Spec as _Spec
from .spec import _spec as _spec
from .variants import HOSTNAME, VARIANTS

__all__ = [
    "BOOT_LABEL",
    "BOOT_PARTITION",
    "BOOT_SECTORS",
    "BUILDER_VERSION",
    "EFI_FIRST_SECTOR",
    "FS_BLOCK",
    "FS_LABEL",
    "GIB",
    "GPT_BACKUP_SECTORS",
    "GPT_BIOS_BOOT",
    "GPT_ESP",
    "GPT_ROOT_PARTITION",
    "GPT_ROOT_START_SECTOR",
    "GPT_TYPE",
    "HOSTNAME",
    "LVM_LV",
    "LVM_ROOT_BYTES",
    "LVM_VG",
    "MBR_EXTENDED_PARTITION",
    "MBR_ROOT_PARTITION",
    "MBR_ROOT_START_SECTOR",
    "MBR_SWAP_PARTITION",
    "MBR_SWAP_SECTORS",
    "MIB_SECTORS",
    "QCOW2_CLUSTER_SIZE",
    "SECTOR",
    "VARIANTS",
    "Geometry",
    "GoldenImage",
    "Log",
    "OtherFs",
    "Placed",
    "build_image",
    "cached_image",
    "geometry",
    "image_key",
    "main",
]
