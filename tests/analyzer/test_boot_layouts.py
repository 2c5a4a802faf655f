"""Images whose file systems are not just an ext4 root, without booting anything:
which kernel and initrd a boot loader picks, which file systems are mapped or
skipped and why, and the results database's file table keyed by file system.
"""

import shutil
import sqlite3
import struct
from pathlib import Path
from typing import Any

import pytest
from fake_image_tree import FakeImage
from pageshare.analysis import resultsdb
from pageshare.errors import UserError
from pageshare.image import bootfiles, fslayout
from pageshare.image.bootfiles import BootEntry, bls_entry, grub_default_entry

# What update-grub writes on Debian 12 with a separate /boot (trimmed): paths
# are relative to /boot's own file system.
DEBIAN_GRUB = """\
if [ "${next_entry}" ] ; then
   set default="${next_entry}"
   set next_entry=
else
   set default="0"
fi
menuentry 'Debian GNU/Linux' --class debian $menuentry_id_option 'gnulinux-simple-8e0f' {
	insmod ext2
	search --no-floppy --fs-uuid --set=root 2d6c9b1e-5f48-4a07-93e2-b8c1f4a6d750
	echo	'Loading Linux 6.1.0-56-cloud-amd64 ...'
	linux	/vmlinuz-6.1.0-56-cloud-amd64 root=UUID=8e0f ro  console=ttyS0
	echo	'Loading initial ramdisk ...'
	initrd	/initrd.img-6.1.0-56-cloud-amd64
}
submenu 'Advanced options for Debian GNU/Linux' $menuentry_id_option 'gnulinux-advanced-8e0f' {
	menuentry 'Debian GNU/Linux, with Linux 6.1.0-56-cloud-amd64' --class debian $menuentry_id_option 'gnulinux-6.1.0-56-cloud-amd64-advanced-8e0f' {
		linux	/vmlinuz-6.1.0-56-cloud-amd64 root=UUID=8e0f ro  console=ttyS0
		initrd	/initrd.img-6.1.0-56-cloud-amd64
	}
	menuentry 'Debian GNU/Linux, with Linux 6.1.0-10-cloud-amd64' --class debian $menuentry_id_option 'gnulinux-6.1.0-10-cloud-amd64-advanced-8e0f' {
		linux	/vmlinuz-6.1.0-10-cloud-amd64 root=UUID=8e0f ro  console=ttyS0
		initrd	/intel-ucode.img /initrd.img-6.1.0-10-cloud-amd64
	}
}
"""  # noqa: E501


def test_grub_default_is_the_first_entry() -> None:
    assert grub_default_entry(DEBIAN_GRUB) == BootEntry(
        "/vmlinuz-6.1.0-56-cloud-amd64", "/initrd.img-6.1.0-56-cloud-amd64"
    )


@pytest.mark.parametrize(
    "default,kernel",
    [
        ("1>1", "/vmlinuz-6.1.0-10-cloud-amd64"),
        ("1", "/vmlinuz-6.1.0-56-cloud-amd64"),  # a submenu: its first entry
        (
            "gnulinux-advanced-8e0f>gnulinux-6.1.0-10-cloud-amd64-advanced-8e0f",
            "/vmlinuz-6.1.0-10-cloud-amd64",
        ),
        (
            "Advanced options for Debian GNU/Linux>"
            "Debian GNU/Linux, with Linux 6.1.0-10-cloud-amd64",
            "/vmlinuz-6.1.0-10-cloud-amd64",
        ),
        ("${saved_entry}", "/vmlinuz-6.1.0-56-cloud-amd64"),  # unresolved: the first entry
        ("7", "/vmlinuz-6.1.0-56-cloud-amd64"),
    ],
)
def test_grub_default_by_index_title_or_id(default: str, kernel: str) -> None:
    cfg = DEBIAN_GRUB.replace('set default="0"', f'set default="{default}"')
    entry = grub_default_entry(cfg)
    assert entry is not None and entry.kernel == kernel
    if kernel.endswith("-10-cloud-amd64"):
        # Several initrds (microcode first): the last one is the distribution's.
        assert entry.initrd == "/initrd.img-6.1.0-10-cloud-amd64"


def test_grub_without_linux_entries() -> None:
    assert grub_default_entry("set timeout=5\nmenuentry 'UEFI settings' {\n\tfwsetup\n}\n") is None


def test_bls_entry() -> None:
    text = (
        "title Rocky Linux (5.14.0-427.el9.x86_64)\nversion 5.14.0-427.el9.x86_64\n"
        "linux /vmlinuz-5.14.0-427.el9.x86_64\n"
        "initrd /initramfs-5.14.0-427.el9.x86_64.img $tuned_initrd\n"
        "options root=UUID=abc ro\n"
    )
    e = bls_entry(text)
    assert e is not None and e.kernel == "/vmlinuz-5.14.0-427.el9.x86_64"
    assert bls_entry("title nothing\n") is None


def test_version_order() -> None:
    versions = ["6.1.0-9-amd64", "6.1.0-10-amd64", "5.10.0-28-amd64", "6.12.1+deb13-amd64"]
    assert sorted(versions, key=bootfiles.version_key) == [
        "5.10.0-28-amd64",
        "6.1.0-9-amd64",
        "6.1.0-10-amd64",
        "6.12.1+deb13-amd64",
    ]


V = "6.1.0-56-cloud-amd64"


def test_kernel_on_a_separate_boot_through_grub() -> None:
    # /boot's grub.cfg names /vmlinuz-V: in the guest's tree that is /boot/vmlinuz-V.
    g = FakeImage(
        {
            "/boot/grub/grub.cfg": DEBIAN_GRUB,
            f"/boot/vmlinuz-{V}": "",
            f"/boot/initrd.img-{V}": "",
            "/boot/vmlinuz-6.1.0-10-cloud-amd64": "",
        }
    )
    assert bootfiles.find_kernel(g) == (f"/boot/vmlinuz-{V}", f"/boot/initrd.img-{V}", V)


def test_grub_entry_missing_falls_back_to_the_symlink() -> None:
    g = FakeImage(
        {
            "/boot/grub/grub.cfg": DEBIAN_GRUB.replace(V, "6.1.0-1-cloud-amd64"),
            f"/boot/vmlinuz-{V}": "",
            f"/boot/initrd.img-{V}": "",
        },
        {"/vmlinuz": f"boot/vmlinuz-{V}"},
    )
    assert bootfiles.find_kernel(g) == (f"/boot/vmlinuz-{V}", f"/boot/initrd.img-{V}", V)


def test_bls_entries_newest_with_initramfs_naming() -> None:
    old, new = "5.14.0-70.el9.x86_64", "5.14.0-427.el9.x86_64"
    entries = "/boot/loader/entries"
    g = FakeImage(
        {
            f"{entries}/abc-{old}.conf": f"linux /vmlinuz-{old}\ninitrd /initramfs-{old}.img\n",
            f"{entries}/abc-{new}.conf": f"linux /vmlinuz-{new}\n",
            f"/boot/vmlinuz-{old}": "",
            f"/boot/initramfs-{old}.img": "",
            f"/boot/vmlinuz-{new}": "",
            f"/boot/initramfs-{new}.img": "",
        }
    )
    # The entry has no initrd line: the initramfs-V.img convention finds it.
    assert bootfiles.find_kernel(g) == (f"/boot/vmlinuz-{new}", f"/boot/initramfs-{new}.img", new)


def test_newest_kernel_without_boot_loader_or_symlink() -> None:
    g = FakeImage(
        {
            "/boot/vmlinuz-6.1.0-9-amd64": "",
            "/boot/vmlinuz-6.1.0-10-amd64": "",
            "/boot/initrd-6.1.0-10-amd64": "",
            "/boot/config-6.1.0-10-amd64": "",
        }
    )
    assert bootfiles.find_kernel(g) == (
        "/boot/vmlinuz-6.1.0-10-amd64",
        "/boot/initrd-6.1.0-10-amd64",
        "6.1.0-10-amd64",
    )


def test_no_kernel_says_that_fstab_must_mount_boot() -> None:
    # A separate /boot that /etc/fstab does not mount: the root's /boot is empty.
    with pytest.raises(UserError, match="no kernel") as e:
        bootfiles.find_kernel(FakeImage({"/boot/.keep": ""}))
    assert "/etc/fstab must mount it" in e.value.hint
    g = FakeImage({"/etc/hostname": ""}, {"/vmlinuz": f"boot/vmlinuz-{V}"})
    with pytest.raises(UserError, match=f"kernel /boot/vmlinuz-{V} .the target of /vmlinuz."):
        bootfiles.find_kernel(g)


# --- which file systems are mapped ------------------------------------------------

EXT4 = "has_journal ext_attr dir_index filetype extent 64bit flex_bg"


@pytest.mark.parametrize(
    "fstype,features,part,start,bs,why",
    [
        ("ext4", EXT4, 1, 2048, 4096, ""),
        ("ext4", EXT4, 0, 0, 4096, ""),
        ("ext4", EXT4, 1, 63, 4096, "starts at sector 63, which is not a multiple of 8"),
        ("ext4", EXT4, 1, 2050, 4096, "not a multiple of 8"),
        # 1 KiB blocks: a block lands on a 4 KiB boundary whenever start is even.
        ("ext4", EXT4, 1, 2050, 1024, ""),
        ("ext4", EXT4, 1, 63, 1024, "not a multiple of 2"),
        # Indirect block maps are read too (debugfs stat), at any block size.
        ("ext2", "ext_attr filetype", 1, 2048, 4096, ""),
        ("ext3", "has_journal ext_attr filetype", 1, 2048, 1024, ""),
        ("ext3", "has_journal ext_attr filetype", 1, 63, 4096, "not a multiple of 8"),
        ("squashfs", "", 1, 2048, 4096, "squashfs cannot be mapped"),
        ("xfs", "", 1, 2048, 4096, ""),
        ("xfs", "", 1, 63, 4096, "not a multiple of 8"),
        ("xfs", "realtime", 1, 2048, 4096, "realtime section"),
        ("btrfs", "devices=1", 1, 2048, 4096, ""),
        ("btrfs", "devices=1", 1, 63, 4096, "not a multiple of 8"),
        ("btrfs", "devices=2", 1, 2048, 4096, "btrfs over 2 devices"),
        ("vfat", "", 15, 8192, 0, "vfat cannot be mapped"),
        ("ext4", EXT4, None, 0, 4096, "LVM, RAID, an encrypted volume or a second disk"),
    ],
)
def test_unmappable_reason(
    fstype: str, features: str, part: int | None, start: int, bs: int, why: str
) -> None:
    got = fslayout.unmappable_reason(fstype, features, part, start, bs)
    assert (why in got and bool(got)) if why else got == ""


def test_partition_numbers() -> None:
    assert fslayout.partition_number("/dev/sda") == 0
    assert fslayout.partition_number("/dev/sda15") == 15
    assert fslayout.partition_number("/dev/vg0/root") is None
    assert fslayout.partition_number("/dev/sdb1") is None
    assert fslayout.partition_number("/dev/mapper/luks-1") is None


class FakeDisk:
    """libguestfs' answers about a disk's partitions and file systems."""

    def __init__(
        self,
        parts: dict[int, int],
        fs: dict[str, tuple[str, int, str]],
        realtime: tuple[str, ...] = (),
    ) -> None:
        self.parts, self.fs = parts, fs  # fs: device -> (type, block size, uuid)
        self.realtime = realtime

    def part_list(self, dev: str) -> list[dict[str, int]]:
        if not self.parts:
            raise RuntimeError("part_list: unrecognised disk label")
        return [
            {"part_num": n, "part_start": s * 512, "part_size": 2048 * 512}
            for n, s in self.parts.items()
        ]

    def pread_device(self, dev: str, size: int, offset: int) -> bytes:
        if self.fs.get(dev, ("",))[0] == "xfs" and offset == 0:
            # An XFS superblock: magic, sb_blocksize, sb_dblocks, sb_rblocks.
            rblocks = 1000 if dev in self.realtime else 0
            return (b"XFSB" + struct.pack(">IQQ", self.fs[dev][1], 1 << 20, rblocks)).ljust(
                size, b"\0"
            )
        return bytes(size)  # no LVM label anywhere

    def vfs_type(self, dev: str) -> str:
        return self.fs[dev][0]

    def tune2fs_l(self, dev: str) -> dict[str, Any]:
        return {"Block size": str(self.fs[dev][1]), "Filesystem features": EXT4}

    def vfs_uuid(self, dev: str) -> str:
        return self.fs[dev][2]

    def list_md_devices(self) -> list[str]:
        return []  # no MD RAID arrays


def test_survey_maps_each_ext4_and_skips_the_rest() -> None:
    g = FakeDisk(
        {1: 524288, 2: 262144, 15: 8192, 3: 63},
        {
            "/dev/sda1": ("ext4", 4096, "root-uuid"),
            "/dev/sda2": ("ext4", 4096, "boot"),
            "/dev/sda15": ("vfat", 0, "ESP"),
            "/dev/sda3": ("ext4", 4096, "var"),
            "/dev/vg/opt": ("ext4", 4096, "opt"),
        },
    )
    mapped, skipped = fslayout.survey(
        g,
        {
            "/boot": "/dev/sda2",
            "/": "/dev/sda1",
            "/boot/efi": "/dev/sda15",
            "/var": "/dev/sda3",
            "/opt": "/dev/vg/opt",
        },
        1 << 22,
    )
    assert [
        (f.mountpoint, f.partition, f.start_sector, f.uuid, f.guest_start_sector) for f in mapped
    ] == [("/", 1, 524288, "root-uuid", 524288), ("/boot", 2, 262144, "boot", 262144)]
    assert mapped[1].runs == ((0, 2048, 262144),)
    assert {s.mountpoint: s.device for s in skipped} == {
        "/boot/efi": "/dev/sda15",
        "/opt": "/dev/vg/opt",
        "/var": "/dev/sda3",
    }
    # An LV of a volume group whose PVs are not on this disk cannot be located.
    assert "volume group vg has no physical volume on the image's disk" in next(
        s.reason for s in skipped if s.mountpoint == "/opt"
    )
    assert "sector 63" in next(s.reason for s in skipped if s.mountpoint == "/var")


def test_xfs_file_systems_from_their_superblock() -> None:
    g = FakeDisk(
        {1: 262144, 2: 8192 + 1, 3: 2048},
        {
            "/dev/sda1": ("xfs", 4096, "root"),
            "/dev/sda2": ("xfs", 4096, "srv"),
            "/dev/sda3": ("xfs", 4096, "rt"),
        },
        realtime=("/dev/sda3",),
    )
    mapped, skipped = fslayout.survey(
        g, {"/": "/dev/sda1", "/srv": "/dev/sda2", "/rt": "/dev/sda3"}, 1 << 22
    )
    assert [(f.mountpoint, f.fstype, f.block_size, f.start_sector) for f in mapped] == [
        ("/", "xfs", 4096, 262144)
    ]
    why = {s.mountpoint: s.reason for s in skipped}
    assert "sector 8193, which is not a multiple of 8" in why["/srv"]
    assert "realtime section" in why["/rt"]


def test_whole_disk_root() -> None:
    g = FakeDisk({}, {"/dev/sda": ("ext4", 4096, "u")})
    mapped, skipped = fslayout.survey(g, {"/": "/dev/sda"}, 1 << 22)
    assert [(f.partition, f.start_sector) for f in mapped] == [(0, 0)] and skipped == []
    assert mapped[0].runs == ((0, 1 << 22, 0),)


def test_unaligned_root_is_refused_with_what_to_do() -> None:
    g = FakeDisk({1: 63}, {"/dev/sda1": ("ext4", 4096, "u")})
    _, skipped = fslayout.survey(g, {"/": "/dev/sda1"}, 1 << 22)
    with pytest.raises(UserError, match="starts at sector 63") as e:
        fslayout.root_must_map(Path("old.qcow2"), skipped[0])
    assert "virt-resize --align-first always" in e.value.hint


# --- results database -------------------------------------------------------------


def test_version_1_database_is_migrated_to_file_per_file_system(tmp_path: Path) -> None:
    path = tmp_path / "results.sqlite"
    old = sqlite3.connect(path)
    old.executescript("""
        CREATE TABLE image (id INTEGER PRIMARY KEY, path TEXT NOT NULL, format TEXT NOT NULL,
            virtual_size INTEGER NOT NULL, content_sha256 TEXT NOT NULL);
        CREATE TABLE analysis (id INTEGER PRIMARY KEY, image_id INTEGER NOT NULL,
            started_at TEXT NOT NULL, status TEXT NOT NULL);
        CREATE TABLE file (analysis_id INTEGER NOT NULL REFERENCES analysis(id),
            ino INTEGER NOT NULL, path TEXT, PRIMARY KEY (analysis_id, ino));
        INSERT INTO image VALUES (1, '/i.qcow2', 'qcow2', 1, 'aa');
        INSERT INTO analysis VALUES (1, 1, 't', 'ok');
        INSERT INTO file VALUES (1, 12, '/usr/bin/true');
        PRAGMA user_version=1;
    """)
    old.commit()
    old.close()
    db = resultsdb.connect(path)
    assert db.execute("SELECT fs_uuid, ino, path FROM file").fetchall() == [
        ("", 12, "/usr/bin/true")
    ]
    # Inode 12 of another file system of the same analysis is a row of its own.
    db.execute(
        "INSERT INTO file (analysis_id, fs_uuid, ino, path) VALUES (1, 'b00f', 12, '/boot/vmlinuz')"
    )
    assert db.execute("SELECT count(*) FROM file WHERE ino=12").fetchone() == (2,)
    assert db.execute("PRAGMA user_version").fetchone() == (resultsdb.SCHEMA_VERSION,)
    db.close()
    resultsdb.connect(path).close()  # connecting again changes nothing


def test_space_for_file_system_copies(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # XFS and btrfs (and LVs of several segments) are read from a copy: the work
    # directory must hold the image's data once more.
    from collections import namedtuple

    from pageshare.analysis import analyze

    image = tmp_path / "golden.qcow2"
    image.write_bytes(b"\0" * 4096)
    opts = analyze.Options(image=image, ram_mib=256, workdir_parent=tmp_path / "work")
    need = 2 * 256 * 2**20 + 4096
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage(0, 0, int(need * 1.1) + 1024))
    analyze.check_space(opts)
    with pytest.raises(UserError, match="copies of its XFS or btrfs file systems"):
        analyze.check_space(opts, fs_copies=True)
