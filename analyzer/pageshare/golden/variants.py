"""The golden image variants: what each image holds and how its disk is laid out.

VARIANTS is the authority (docs/ARCHITECTURE.md's table follows it).
spec.py reads an entry into a checked _Spec, and the cache key hashes the
entry as it is written here: any edit to an entry gives that variant a new
key, and so a rebuild.  Fields added for a new variant are optional, so that
the other variants' entries, and so their keys, stay as they were.
"""

from __future__ import annotations

from pageshare import debian

from .layout import GIB

HOSTNAME = "pageshare-golden"

_SOURCES = debian.sources(["bookworm"])
_TRIXIE_SOURCES = debian.sources(["trixie"])
_BOOT_PACKAGES = ["linux-image-cloud-amd64", "systemd-sysv", "udev", "kmod", "initramfs-tools"]
# Debian's libvirt as a hypervisor runs it (without Recommends, as
# mmdebstrap installs): the daemon, its Python binding (pageshare
# libvirt-watch) and AppArmor, which confines libvirt's QEMUs.
_LIBVIRT_PACKAGES = ["libvirt-daemon-system", "python3-libvirt", "apparmor"]

VARIANTS: dict[str, dict[str, object]] = {
    "demo": {
        "suite": "bookworm",
        "sources": _SOURCES,
        # "important" is what debootstrap and the installer give a plain
        # server (ifupdown, cron, logrotate, vim-tiny, ...), so the demo
        # guests carry the usual background daemons and libraries.
        "mmdebstrap_variant": "important",
        "packages": [*_BOOT_PACKAGES, "openssh-server", "nginx", "python3", "dbus"],
        "layout": "gpt",
        "virtual_size": 3 * GIB,
        "fs_uuid": "15bd0f73-494c-405f-90b0-e639164e0f52",
        "disk_guid": "dd41a87d-3f86-49cb-acfa-f136dcb3f4b0",
        "partition_guids": {
            "1": "21fbc2c0-54ca-4dc7-a341-aba7d1073ff6",
            "14": "d8737d59-35f2-41c7-9b07-9ff94762ab6c",
            "15": "e3ae3e4c-7fde-4180-8293-3dbfbf5018fb",
        },
        "hostname": HOSTNAME,
    },
    "small": {
        "suite": "bookworm",
        "sources": _SOURCES,
        "mmdebstrap_variant": "required",
        "packages": list(_BOOT_PACKAGES),
        "layout": "whole-disk",
        "virtual_size": 2 * GIB,
        "fs_uuid": "059a5ac6-84ce-4b8f-88bf-106cefac840b",
        "disk_guid": None,
        "partition_guids": {},
        "hostname": HOSTNAME,
    },
    # Debian 13 with its 6.12 kernel: the guest kernel the analyzer's
    # introspection must also handle (crash 8.0.x cannot open 6.12 dumps).
    # The package set is small's, the layout demo's, so both the partition
    # offset and the newer kernel are exercised by one image.
    "trixie": {
        "suite": "trixie",
        "sources": _TRIXIE_SOURCES,
        "mmdebstrap_variant": "required",
        "packages": list(_BOOT_PACKAGES),
        "layout": "gpt",
        "virtual_size": 2 * GIB,
        "fs_uuid": "6a1f3e52-0c4b-4d8e-9b57-2f8d4c0e7a13",
        "disk_guid": "b3c9d2e4-7f10-4a5b-8c6d-1e2f3a4b5c6d",
        "partition_guids": {
            "1": "c4d5e6f7-0819-4a2b-bc3d-4e5f60718293",
            "14": "a1b2c3d4-e5f6-4708-9a1b-2c3d4e5f6071",
            "15": "f0e1d2c3-b4a5-4697-8879-6a5b4c3d2e1f",
        },
        "hostname": HOSTNAME,
    },
    # small's packages with /boot on a partition of its own: the
    # kernel and initrd are not on the root file system, and the page cache
    # of /boot files maps to another partition's offset.
    "bootsplit": {
        "suite": "bookworm",
        "sources": _SOURCES,
        "mmdebstrap_variant": "required",
        "packages": list(_BOOT_PACKAGES),
        "layout": "gpt-bootsplit",
        "virtual_size": 2 * GIB,
        "fs_uuid": "8e0f5a2c-3b71-4c95-a6d4-0d2b9e7c1f38",
        "boot_fs_uuid": "2d6c9b1e-5f48-4a07-93e2-b8c1f4a6d750",
        "disk_guid": "7a3e1c59-d2b4-4f86-8e0a-65c9b3d1f274",
        "partition_guids": {
            "1": "e94b2d07-1c6a-4f3e-b5d8-2a7f0c9e6b41",
            "2": "5c1d8e3a-97f2-4b60-a4c7-e0b6d2f9a385",
            "14": "b7f2a6c1-0e94-4d3b-8a57-c1e9f4d2b068",
            "15": "0d9e4b7a-6c21-4f58-b3a0-9f7e2c5d1a64",
        },
        "hostname": HOSTNAME,
    },
    # small's packages, plus lvm2 for the initrd to activate the volume group,
    # with the root on an LVM logical volume: its blocks are at the
    # LV's extents on the PV partition.
    "lvm": {
        "suite": "bookworm",
        "sources": _SOURCES,
        "mmdebstrap_variant": "required",
        "packages": [*_BOOT_PACKAGES, "lvm2"],
        "layout": "gpt-lvm",
        "virtual_size": 2 * GIB,
        "fs_uuid": "c1a7e4d2-6b39-4f08-9e5a-3d2c8b7f1e64",
        "disk_guid": "4f8b2e6d-1a93-4c57-b0e2-7d6a9c3f5b18",
        "partition_guids": {
            "1": "9b3e7d1c-4a26-4f85-8c0b-e6d2a5f7b394",
            "14": "3c6f9a2e-8d14-4b7a-95e3-1f0c7b4d2a86",
            "15": "d5a2c8f1-7e39-4b06-a4d1-6c9e2b8f3a57",
        },
        "hostname": HOSTNAME,
    },
    # small with 1 KiB ext4 blocks: a page is four blocks, listed
    # only where they are contiguous and the first is 4 KiB-aligned on the disk.
    "small1k": {
        "suite": "bookworm",
        "sources": _SOURCES,
        "mmdebstrap_variant": "required",
        "packages": list(_BOOT_PACKAGES),
        "layout": "whole-disk",
        "fs_block": 1024,
        "virtual_size": 2 * GIB,
        "fs_uuid": "5b8e2f1a-c734-4d96-a0e5-7f3c9d1b6a28",
        "disk_guid": None,
        "partition_guids": {},
        "hostname": HOSTNAME,
    },
    # small's packages (plus xfsprogs, for fsck.xfs in the initrd) on the
    # trixie/demo GPT layout with an XFS root.
    "xfs": {
        "suite": "bookworm",
        "sources": _SOURCES,
        "mmdebstrap_variant": "required",
        "packages": [*_BOOT_PACKAGES, "xfsprogs"],
        "layout": "gpt",
        "root_fstype": "xfs",
        "virtual_size": 2 * GIB,
        "fs_uuid": "e3b5a1c7-2d94-4f60-8b1e-9c7d4a2f6e35",
        "disk_guid": "1d7c4e9a-b253-4f18-a6e0-3f9b2c5d8a71",
        "partition_guids": {
            "1": "7e2a9d4c-51b8-4c3f-9d06-b4e1a8c2f573",
            "14": "a8d3f6b1-29c4-4e75-b1a9-5c0e7d3b9f26",
            "15": "62c9e1f4-8a37-4d5b-a2c8-e9f1b6d4a037",
        },
        "hostname": HOSTNAME,
    },
    # small's packages (plus btrfs-progs, which puts `btrfs device scan` in
    # the initrd) on the GPT layout with a btrfs root, laid out as
    # Debian's installer does it: the root is subvolume @rootfs of a
    # single-device btrfs, mounted by /etc/fstab with subvol=@rootfs (the
    # boot loader adds rootflags=subvol=@rootfs; the analyzer does the same).
    # Data is stored uncompressed, except the files of "compressed_files",
    # rewritten through a compress-force mount, so that the analysis meets
    # compressed extents (which no disk block can serve) in a file guests read.
    "btrfs": {
        "suite": "bookworm",
        "sources": _SOURCES,
        "mmdebstrap_variant": "required",
        "packages": [*_BOOT_PACKAGES, "btrfs-progs"],
        "layout": "gpt",
        "root_fstype": "btrfs",
        "root_subvol": "@rootfs",
        "compressed_files": ["/usr/share/common-licenses/GPL-3"],
        "virtual_size": 2 * GIB,
        "fs_uuid": "9c4e2a71-d58b-4f36-a0e9-3b7d1c6f8e25",
        "disk_guid": "e6b1d3f8-2a49-4c75-9d0e-8f4a7c2b5e13",
        "partition_guids": {
            "1": "4a9d7e2c-83f1-4b06-b5c8-d1e6f3a9c720",
            "14": "b2e8c4f6-1d37-4a95-8c0b-7e3f9d5a1b64",
            "15": "71f5a3d9-c6e2-4b18-a47d-2c9e8b0f6d35",
        },
        "hostname": HOSTNAME,
    },
    # small's packages on an MBR (msdos) disk laid out as Debian's installer
    # does on a BIOS machine: the root in primary partition 1 at
    # sector 2048, swap (in /etc/fstab, so guests turn it on) in logical
    # partition 5 of extended partition 2.  "disk_guid" is the MBR's 32-bit
    # disk identifier (sfdisk's label-id; PARTUUIDs are made from it).
    "mbr": {
        "suite": "bookworm",
        "sources": _SOURCES,
        "mmdebstrap_variant": "required",
        "packages": list(_BOOT_PACKAGES),
        "layout": "mbr",
        "virtual_size": 2 * GIB,
        "fs_uuid": "4d739461-dbcd-4c52-b98c-314c84ba43e0",
        "swap_uuid": "3cd458a9-702c-4792-b5be-2caa5d614ebd",
        "disk_guid": "0x5a3c9e17",
        "partition_guids": {},
        "hostname": HOSTNAME,
    },
    # Debian 13 on a UEFI machine's disk, as an operator's
    # installer-made golden image has it: GPT, a FAT32 EFI system partition
    # at /boot/efi holding GRUB (EFI/debian/grubx64.efi and the removable
    # path EFI/BOOT/BOOTX64.EFI, made by the image's own grub-mkimage), a
    # separate /boot with GRUB's grub.cfg and modules, the root, and /var on
    # a partition of its own.  /boot is ext2 and /var ext3, as images that
    # have been carried forward for years still have: their files use
    # indirect block maps, not extents.  It boots with OVMF and GRUB, and the
    # analyzer finds its kernel through grub.cfg on /boot.
    "efi": {
        "suite": "trixie",
        "sources": _TRIXIE_SOURCES,
        "mmdebstrap_variant": "required",
        "packages": [*_BOOT_PACKAGES, "grub-efi-amd64-bin", "dosfstools"],
        "layout": "gpt-efi",
        "virtual_size": 2 * GIB,
        "fs_uuid": "b8d4f2a6-3c71-4e95-8a0d-6f1e9c2b7d43",
        "filesystems": [
            {"mountpoint": "/boot/efi", "fstype": "vfat", "uuid": "5A1C-3E97", "mib": 64},
            {
                "mountpoint": "/boot",
                "fstype": "ext2",
                "uuid": "f3a9c1e5-7d28-4b64-9e0a-2c5b8d1f6a79",
                "mib": 192,
            },
            {"mountpoint": "/", "fstype": "ext4"},
            {
                "mountpoint": "/var",
                "fstype": "ext3",
                "uuid": "6e2b9d4f-1a85-4c37-b0e6-d9f3a7c2e518",
                "mib": 256,
            },
        ],
        "disk_guid": "2f7c9e4b-d6a1-4853-b9e2-0c4a8f1d5e36",
        "partition_guids": {
            "1": "0b6e3f9a-2d74-4c1e-a8b5-97f4d2c6e830",
            "2": "8d3b6f1e-4a29-4c57-a0e8-5b2d9f7c1e46",
            "3": "4e9a2c7d-b158-4f03-8d6e-a1c3f5b9e027",
            "4": "a7f1d3b9-62e4-4c8a-95d0-3e8b1c6f4a52",
        },
        "hostname": HOSTNAME,
    },
    # small's packages and libvirt's (Debian 12, then 13): a hypervisor that
    # has libvirt and not yet pageshare, for pageshare-host's package test
    # (tests/deploy/test_host_package_guest.py), which would otherwise
    # install libvirt with apt in a TCG guest (5 minutes each).  Debian
    # 13's libvirt QEMU driver brings Debian's QEMU too.
    "libvirt": {
        "suite": "bookworm",
        "sources": _SOURCES,
        "mmdebstrap_variant": "required",
        "packages": [*_BOOT_PACKAGES, *_LIBVIRT_PACKAGES],
        "layout": "whole-disk",
        "virtual_size": 2 * GIB,
        "fs_uuid": "1326eec7-624b-43a0-97ae-275ec3605dfd",
        "disk_guid": None,
        "partition_guids": {},
        "hostname": HOSTNAME,
    },
    "libvirt-trixie": {
        "suite": "trixie",
        "sources": _TRIXIE_SOURCES,
        "mmdebstrap_variant": "required",
        "packages": [*_BOOT_PACKAGES, *_LIBVIRT_PACKAGES],
        "layout": "whole-disk",
        "virtual_size": 2 * GIB,
        "fs_uuid": "a86cee3e-78ad-4c8e-8ea3-271e935c89fc",
        "disk_guid": None,
        "partition_guids": {},
        "hostname": HOSTNAME,
    },
}
