"""A variant's spec, checked, and the cache key of its image.

_spec() reads a VARIANTS entry into a typed _Spec and refuses a malformed
one; image_key() hashes the entry, as written, with BUILDER_VERSION.  Bump
BUILDER_VERSION whenever a change to this package changes what ends up in an
image: the key is all that tells a cached image from a stale one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from pageshare.cache import inputs_key
from pageshare.errors import UserError

from .layout import FS_BLOCK, GPT_TYPE
from .variants import VARIANTS

BUILDER_VERSION = 2


@dataclass(frozen=True)
class _Spec:
    suite: str
    sources: list[str]
    mmdebstrap_variant: str
    packages: list[str]
    layout: str
    virtual_size: int
    fs_uuid: str
    disk_guid: str | None
    partition_guids: dict[str, str]
    hostname: str
    boot_fs_uuid: str | None = None  # a separate /boot file system (gpt-bootsplit)
    root_fstype: str = "ext4"
    fs_block: int = FS_BLOCK  # the root ext4's block size
    root_subvol: str = ""  # a btrfs root: the subvolume / is mounted from
    compressed_files: tuple[str, ...] = ()  # a btrfs root: files stored compressed
    swap_uuid: str | None = None  # a swap partition ("mbr": logical partition 5)
    # "gpt-efi": the file systems in disk order, the root among them as "/".
    filesystems: tuple[OtherFs, ...] = ()


@dataclass(frozen=True)
class OtherFs:
    """A file system of a "gpt-efi" image besides the root, on a partition of its own."""

    mountpoint: str
    fstype: str  # vfat, ext2, ext3 or ext4 ("ext4" for the root)
    uuid: str  # vfat: its volume id, as blkid and fstab give it
    mib: int  # partition size; 0 for the root (the rest)


def _variant_dict(variant: str) -> dict[str, object]:
    try:
        return VARIANTS[variant]
    except KeyError:
        raise UserError(
            f"unknown golden image variant {variant!r}",
            f"choose one of: {', '.join(sorted(VARIANTS))}",
        ) from None


def _field(d: dict[str, object], name: str, kind: type) -> Any:
    value = d[name]
    if not isinstance(value, kind):
        raise TypeError(f"variant field {name!r} must be {kind.__name__}, not {value!r}")
    return value


def _spec(variant: str) -> _Spec:
    d = _variant_dict(variant)
    disk_guid = d["disk_guid"]
    if disk_guid is not None and not isinstance(disk_guid, str):
        raise TypeError("variant field 'disk_guid' must be str or None")
    # Optional, so that the older variants' specs (and so their cache keys) stay as they were.
    boot_fs_uuid = d.get("boot_fs_uuid")
    if boot_fs_uuid is not None and not isinstance(boot_fs_uuid, str):
        raise TypeError("variant field 'boot_fs_uuid' must be str or None")
    fs_block = d.get("fs_block", FS_BLOCK)
    if fs_block not in (1024, 2048, 4096):
        raise TypeError("variant field 'fs_block' must be 1024, 2048 or 4096")
    root_fstype = d.get("root_fstype", "ext4")
    if root_fstype not in ("ext4", "xfs", "btrfs"):
        raise TypeError("variant field 'root_fstype' must be ext4, xfs or btrfs")
    root_subvol = d.get("root_subvol", "")
    compressed = d.get("compressed_files", [])
    if not isinstance(root_subvol, str) or not isinstance(compressed, list):
        raise TypeError("variant fields 'root_subvol' (str) and 'compressed_files' (list)")
    if (root_subvol or compressed) and root_fstype != "btrfs":
        raise TypeError("'root_subvol' and 'compressed_files' need a btrfs root")
    swap_uuid = d.get("swap_uuid")
    if swap_uuid is not None and (not isinstance(swap_uuid, str) or d["layout"] != "mbr"):
        raise TypeError("variant field 'swap_uuid' must be a str, on the mbr layout")
    filesystems = tuple(
        OtherFs(
            str(f["mountpoint"]), str(f["fstype"]), str(f.get("uuid", "")), int(f.get("mib", 0))
        )
        for f in d.get("filesystems", [])  # type: ignore[attr-defined]
    )
    if (d["layout"] == "gpt-efi") != bool(filesystems) or (
        filesystems
        and (
            [f.mountpoint for f in filesystems].count("/") != 1
            or any(
                f.fstype not in GPT_TYPE or (f.mountpoint != "/") != bool(f.mib and f.uuid)
                for f in filesystems
            )
        )
    ):
        raise TypeError(
            "a gpt-efi variant lists its file systems (vfat or ext2/3/4, each "
            "with uuid and mib) in disk order, the root once as '/'"
        )
    if d["layout"] == "mbr" and not (
        isinstance(disk_guid, str) and re.fullmatch(r"0x[0-9a-f]{8}", disk_guid)
    ):
        raise TypeError("an mbr variant's 'disk_guid' is its disk identifier, 0x and 8 hex digits")
    return _Spec(
        suite=_field(d, "suite", str),
        sources=[str(s) for s in _field(d, "sources", list)],
        mmdebstrap_variant=_field(d, "mmdebstrap_variant", str),
        packages=[str(p) for p in _field(d, "packages", list)],
        layout=_field(d, "layout", str),
        virtual_size=_field(d, "virtual_size", int),
        fs_uuid=_field(d, "fs_uuid", str),
        disk_guid=disk_guid,
        partition_guids={str(k): str(v) for k, v in _field(d, "partition_guids", dict).items()},
        hostname=_field(d, "hostname", str),
        boot_fs_uuid=boot_fs_uuid,
        root_fstype=str(root_fstype),
        fs_block=int(fs_block),
        root_subvol=root_subvol,
        compressed_files=tuple(str(f) for f in compressed),
        swap_uuid=swap_uuid,
        filesystems=filesystems,
    )


def image_key(variant: str) -> str:
    """Hash of everything that decides the image's content, short and stable."""
    spec = _variant_dict(variant)
    return inputs_key({"builder_version": BUILDER_VERSION, "variant": variant, "spec": spec})
