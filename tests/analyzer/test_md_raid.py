"""Golden images with Linux software RAID (MD, mdadm) inside.

The analysis maps a file system's blocks to sectors of the virtual disk; on
an MD array they are numbered on the array, which the mapping does not
translate to its members' sectors.  Before, a root on MD was refused as
"on /dev/md127 (LVM, RAID or a second disk)" and another file system on MD
skipped with the same words.  Now the message names the array, its level,
metadata and members, why it is not mapped and what the operator can do.
The images are partitioned by sfdisk; the arrays are created, formatted and
filled in the libguestfs appliance (mdadm there, no md on the host), and
kept in the cache (test-images/) by a hash of how they are made, since an
appliance boot takes a minute under TCG.  Nothing else boots.  How the
survey reads arrays (members named as the appliance's kernel names them, an
LVM physical volume on an array) is also checked on a fake appliance.
"""

import os
import random
import subprocess
import tempfile
from pathlib import Path

import pytest
from analysis_failures import assert_clean_failure, json_error
from conftest import run_analyze
from image_trees import DEBIAN_TREE
from lvm_samples import METADATA, pv_device
from pageshare.analysis import mapping
from pageshare.cache import cache_dir, inputs_key
from pageshare.errors import UserError
from pageshare.image import ext4map, fslayout
from pageshare.image.image_inspect import inspect_image, probe_format

ROOT_UUID = "8f3b6c2a-51d7-4e09-b6a4-2c9e7d1f5a38"
SRV_UUID = "c26e9a41-7b3d-4f85-9e12-5d0a8c6b3f74"
MIB = 2048  # sectors
# kind -> (sfdisk table, RAID level, member partitions, mount point on the array, fstab)
KINDS = {
    # The root on a RAID1 of two partitions (Debian's installer's "software
    # RAID" recipe, without LVM): types fd, as the installer sets them.
    "root-raid1": (
        f"start={MIB}, size={64 * MIB}, type=fd\nstart={65 * MIB}, size={64 * MIB}, type=fd\n",
        "raid1",
        (1, 2),
        "/",
        f"UUID={ROOT_UUID} / ext4 defaults 0 1\n",
    ),
    # A plain root (partition 1) and /srv on a RAID0 of partitions 2 and 3.
    "srv-raid0": (
        f"start={MIB}, size={32 * MIB}, type=83\n"
        f"start={33 * MIB}, size={32 * MIB}, type=fd\n"
        f"start={65 * MIB}, size={32 * MIB}, type=fd\n",
        "raid0",
        (2, 3),
        "/srv",
        f"/dev/sda1 / ext4 defaults 0 1\nUUID={SRV_UUID} /srv ext4 defaults 0 2\n",
    ),
    # A plain root and /srv on a linear array of partitions 2 (24 MiB) and 3
    # (32 MiB): mdadm --level=linear appends them; a 40 MiB file spans both.
    "srv-linear": (
        f"start={MIB}, size={32 * MIB}, type=83\n"
        f"start={33 * MIB}, size={24 * MIB}, type=fd\n"
        f"start={57 * MIB}, size={32 * MIB}, type=fd\n",
        "linear",
        (2, 3),
        "/srv",
        f"/dev/sda1 / ext4 defaults 0 1\nUUID={SRV_UUID} /srv ext4 defaults 0 2\n",
    ),
}
VERSION = 1  # of md_disk: bump when what it builds changes
# Files put on an array of a kind that is not the root: name -> (bytes, seed).
ARRAY_FILES = {"srv-linear": {"big.bin": (40 << 20, 11), "small.txt": (5000, 12)}}


def array_file(kind: str, name: str) -> bytes:
    size, seed = ARRAY_FILES[kind][name]
    return random.Random(seed).randbytes(size)


def md_disk(kind: str) -> Path:
    """The raw disk of KINDS[kind], built once and cached under test-images/."""
    table, level, members, mountpoint, fstab = KINDS[kind]
    files = {**DEBIAN_TREE, "etc/fstab": fstab, "srv/.keep": ""}
    spec = {"version": VERSION, "kind": KINDS[kind], "files": files}
    if kind in ARRAY_FILES:
        spec["array_files"] = ARRAY_FILES[kind]
    key = inputs_key(spec)
    out = cache_dir("test-images") / f"md-{kind}-{key}.raw"
    if out.exists():
        return out
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".md-") as t:
        tmp = Path(t)
        tree = tmp / "tree"
        for rel, content in files.items():
            (tree / rel).parent.mkdir(parents=True, exist_ok=True)
            (tree / rel).write_text(content)
        disk = tmp / "disk.raw"
        with open(disk, "wb") as f:
            f.truncate(100 * MIB * 512 if kind == "srv-raid0" else 132 * MIB * 512)
        subprocess.run(
            ["sfdisk", "-q", "--no-reread", str(disk)],
            input=table,
            text=True,
            check=True,
            capture_output=True,
        )
        if mountpoint != "/":
            # The plain root, made on the host as the other test images' are.
            fs = tmp / "root.ext4"
            with open(fs, "wb") as f:
                f.truncate(32 * MIB * 512)
            subprocess.run(
                ["mkfs.ext4", "-q", "-F", "-b", "4096", "-d", str(tree), str(fs)], check=True
            )
            subprocess.run(
                [
                    "dd",
                    f"if={fs}",
                    f"of={disk}",
                    "bs=512",
                    f"seek={MIB}",
                    "conv=notrunc,sparse",
                    "status=none",
                ],
                check=True,
            )
            fs.unlink()
        tar = tmp / "tree.tar"
        subprocess.run(["tar", "-C", str(tree), "-cf", str(tar), "."], check=True)
        if kind in ARRAY_FILES:
            srv = tmp / "srv"
            srv.mkdir()
            for name in ARRAY_FILES[kind]:
                (srv / name).write_bytes(array_file(kind, name))
            subprocess.run(["tar", "-C", str(srv), "-cf", str(tar), "."], check=True)
        _make_array(
            disk,
            level,
            [f"/dev/sda{n}" for n in members],
            ROOT_UUID if mountpoint == "/" else SRV_UUID,
            tar if mountpoint == "/" or kind in ARRAY_FILES else None,
        )
        os.replace(disk, out)
    return out


def _make_array(disk: Path, level: str, members: list[str], uuid: str, tar: Path | None) -> None:
    """An MD array of level over members (mdadm's defaults: metadata 1.2), an ext4
    with uuid on it, holding tar's files if any, made in the libguestfs appliance."""
    import guestfs  # Debian's python3-guestfs, as image_inspect uses it

    g = guestfs.GuestFS(python_return_dict=True)
    try:
        g.set_backend_settings(["force_tcg"])
        g.add_drive_opts(str(disk), format="raw", readonly=0)
        g.launch()
        g.md_create("md0", members, level=level)
        (md,) = g.list_md_devices()
        g.mkfs("ext4", md, blocksize=4096)
        g.set_uuid(md, uuid)
        if tar is not None:
            g.mount(md, "/")
            g.tar_in(str(tar), "/")
            g.umount_all()
        g.md_stop(md)
        g.shutdown()
    finally:
        g.close()


@pytest.mark.vm
@pytest.mark.usefixtures("host_guard")
def test_root_on_md_raid1_is_refused_naming_the_array(tmp_path: Path) -> None:
    img = md_disk("root-raid1")
    r = run_analyze(tmp_path, str(img))
    # Before: "root file system is on /dev/md0 (LVM, RAID or a second disk); not supported".
    assert_clean_failure(
        r,
        f"{img.name}: root file system (ext4 on /dev/md0) cannot be "
        "analyzed: /dev/md0 is an MD RAID array (raid1 over /dev/sda1 "
        "and /dev/sda2, metadata 1.2, data ",
    )
    assert (
        "sectors into each member): a mirror keeps a copy of every block in each member" in r.stderr
    )
    assert (
        "does not translate a file system's blocks on an array to its members' sectors" in r.stderr
    )
    assert "rebuild the golden image with its root file system on a plain partition" in r.stderr
    assert "booting guests" not in r.stderr
    error = json_error(
        run_analyze(tmp_path, "--json", str(img)),
        "user-error",
        "/dev/md0 is an MD RAID array (raid1 over /dev/sda1 and /dev/sda2",
    )
    assert "move the root file system off the array" in str(error["hint"])
    assert "adds no redundancy" in str(error["hint"])


@pytest.mark.vm
@pytest.mark.usefixtures("host_guard")
def test_a_file_system_on_md_raid0_is_skipped_naming_the_array_and_the_root_mapped(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    img = md_disk("srv-raid0")  # from the shared cache, before it is redirected
    monkeypatch.setenv("PAGESHARE_CACHE", str(tmp_path / "cache"))
    fmt, vsize = probe_format(img)
    info = inspect_image(img, fmt, vsize).info
    assert [(f.mountpoint, f.device, f.start_sector) for f in info.filesystems] == [
        ("/", "/dev/sda1", MIB)
    ]
    assert [(s.mountpoint, s.device, s.fstype) for s in info.skipped] == [
        ("/srv", "/dev/md0", "ext4")
    ]
    reason = info.skipped[0].reason
    assert reason.startswith(
        "/dev/md0 is an MD RAID array (raid0 over /dev/sda2 and /dev/sda3, metadata 1.2, data "
    ), reason
    # mdadm's data offset for members this small, read from the superblock.
    offset = int(reason.split(", data ")[1].split(" sectors")[0])
    assert offset > 0 and offset % 8 == 0
    assert "it stripes consecutive chunks of its data over the members" in reason
    assert "put it on a plain partition or a linear LV" in reason


@pytest.mark.vm
def test_a_file_system_on_a_linear_array_is_mapped_through_its_members(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Its runs are the members' data areas in role order: every page of a file
    that spans both members, read from the disk where the runs put it, is the
    file's own bytes (written through md in the appliance)."""
    img = md_disk("srv-linear")
    monkeypatch.setenv("PAGESHARE_CACHE", str(tmp_path / "cache"))
    fmt, vsize = probe_format(img)
    info = inspect_image(img, fmt, vsize).info
    assert info.skipped == (), info.skipped
    root, srv = info.filesystems
    assert (root.mountpoint, srv.mountpoint, srv.device, srv.md) == (
        "/",
        "/srv",
        "/dev/md0",
        "/dev/md0",
    )
    assert srv.guest_start_sector == 0 and srv.lv == ""
    (_, n2, d2), (p3, n3, d3) = srv.runs  # partition 2 first: role 0
    offset = d2 - 33 * MIB
    assert offset > 0 and d3 == 57 * MIB + offset and p3 == n2, srv.runs
    assert n2 <= 24 * MIB - offset and n3 <= 32 * MIB - offset
    fs, at = ext4map.fs_image(img, srv.runs, tmp_path / "srv.img")
    assert at == 0
    listing = subprocess.run(
        ["debugfs", "-R", "ls -l /", str(fs)], capture_output=True, text=True, check=True
    ).stdout
    inos = {
        f[-1]: int(f[0])
        for f in map(str.split, listing.splitlines())
        if f and f[-1] in ARRAY_FILES["srv-linear"]
    }
    ext = ext4map.read_extents(fs, 0, sorted(inos.values()))
    geo = mapping.Geometry(
        (mapping.Placement(srv.uuid.replace("-", ""), 0, srv.runs, "/srv"),), vsize
    )
    members_seen = set()
    with open(img, "rb") as disk:
        for name in ARRAY_FILES["srv-linear"]:
            data = array_file("srv-linear", name)
            for index in range((len(data) + 4095) // 4096):
                block = ext4map.lookup(ext[inos[name]], index)
                assert block is not None, f"{name} page {index}"
                sector = geo.filesystems[0].to_disk(block * 8, 8)
                assert sector is not None, f"{name} page {index} spans two members"
                disk.seek(sector * 512)
                page = data[index * 4096 : (index + 1) * 4096]
                assert disk.read(len(page)) == page, f"{name} page {index} at sector {sector}"
                members_seen.add(sector >= 57 * MIB)
    assert members_seen == {False, True}, "the file should span both members"


class FakeAppliance:
    """What survey() asks libguestfs, for a disk whose partitions 2-4 are the members
    of /dev/md127 (named /dev/sdb2.. by the appliance's kernel, as when its own disk
    came first), or whose partitions 1-2 are a RAID1 (metadata 1.0) holding an LVM PV."""

    UUID = "78ffa8a0:0b834ac6:9dab4a81:4d4da182"

    def __init__(
        self, level: str, metadata: str, members: tuple[int, ...], md_content: bytes = b""
    ) -> None:
        self.level, self.metadata, self.members, self.md = level, metadata, members, md_content

    def part_list(self, dev: str) -> list[dict[str, int]]:
        return [{"part_num": n, "part_start": n << 30, "part_size": 1 << 30} for n in (1, 2, 3, 4)]

    def list_devices(self) -> list[str]:
        return ["/dev/sda"]

    def list_partitions(self) -> list[str]:
        return [f"/dev/sda{n}" for n in (1, 2, 3, 4)]

    def list_md_devices(self) -> list[str]:
        return ["/dev/md127"]

    def md_detail(self, md: str) -> dict[str, str]:
        d = {
            "level": self.level,
            "devices": str(len(self.members)),
            "metadata": self.metadata,
            "uuid": self.UUID,
            "devname": "0",
        }
        for role, n in enumerate(self.members):
            d |= {f"device_dev_sdb{n}_role": str(role), f"device_dev_sdb{n}_dev": f"/dev/sdb{n}"}
        return d

    def vfs_type(self, dev: str) -> str:
        if dev.startswith("/dev/sda") and dev[8:] and int(dev[8:]) in self.members:
            return "linux_raid_member"
        return "LVM2_member" if self.md and dev == "/dev/md127" else "ext4"

    def vfs_uuid(self, dev: str) -> str:
        u = self.UUID.replace(":", "")
        return (
            f"{u[:8]}-{u[8:12]}-{u[12:16]}-{u[16:20]}-{u[20:]}"
            if self.vfs_type(dev) == "linux_raid_member"
            else "0f1e2d3c-0000-4000-8000-1"
        )

    def tune2fs_l(self, dev: str) -> dict[str, str]:
        return {"Block size": "4096", "Filesystem features": "has_journal extent 64bit"}

    def pread_device(self, dev: str, size: int, offset: int) -> bytes:
        if dev == "/dev/md127" or (
            self.metadata == "1.0"
            and dev != "/dev/sda"
            and self.vfs_type(dev) == "linux_raid_member"
        ):
            # metadata 1.0: the array's data, so the PV label, from each member's start.
            return self.md[offset : offset + size].ljust(size, b"\0")
        sb = bytearray(size)
        if dev == "/dev/sda2" and offset == 4096:  # the version-1 superblock of 1.2
            sb[:4] = b"\xfc\x4e\x2b\xa9"
            sb[128:136] = (2048).to_bytes(8, "little")
        return bytes(sb)


def test_the_members_are_the_images_devices_and_the_level_is_said() -> None:
    g = FakeAppliance("raid5", "1.2", (2, 3, 4))
    mapped, skipped = fslayout.survey(g, {"/": "/dev/sda1", "/srv": "/dev/md127"}, 1 << 32)
    assert [m.mountpoint for m in mapped] == ["/"]
    assert [(s.mountpoint, s.device) for s in skipped] == [("/srv", "/dev/md127")]
    assert skipped[0].reason.startswith(
        "/dev/md127 is an MD RAID array (raid5 over /dev/sda2, /dev/sda3 and /dev/sda4, "
        "metadata 1.2, data 2048 sectors into each member): it stripes consecutive chunks "
        "and parity of its data over the members, and the mapping does not translate"
    )
    # /dev/md/NAME, as an fstab may name it, is the same array.
    _, skipped = fslayout.survey(g, {"/": "/dev/sda1", "/srv": "/dev/md/0"}, 1 << 32)
    assert "raid5 over /dev/sda2, /dev/sda3 and /dev/sda4" in skipped[0].reason


def test_a_root_lv_whose_physical_volume_is_an_md_array_is_refused_naming_it() -> None:
    # RAID1 with metadata 1.0 shows the PV's label at each member's start too:
    # the members are not taken for PVs of their own.
    g = FakeAppliance("raid1", "1.0", (1, 2), pv_device(METADATA))
    mapped, skipped = fslayout.survey(g, {"/": "/dev/vg0/root"}, 1 << 32)
    assert mapped == []
    assert skipped[0].reason.startswith(
        "volume group vg0's physical volume /dev/md127 is an MD RAID array (raid1 over "
        "/dev/sda1 and /dev/sda2, metadata 1.0, data from the start of each member): a mirror "
        "keeps a copy of every block in each member"
    )
    with pytest.raises(UserError) as e:
        fslayout.root_must_map(Path("g.qcow2"), skipped[0])
    assert e.value.message.startswith(
        "g.qcow2: root file system (ext4 on /dev/vg0/root) "
        "cannot be analyzed: volume group vg0's physical volume "
        "/dev/md127 is an MD RAID array (raid1 over"
    )
    assert "to have it mapped" not in e.value.message
    assert "move the root file system off the array" in e.value.hint


def test_an_array_on_no_known_device_keeps_mdadms_names() -> None:
    g = FakeAppliance("raid10", "1.1", (2, 3))
    g.list_partitions = lambda: []  # type: ignore[method-assign]
    g.list_devices = lambda: []  # type: ignore[method-assign]
    arrays = fslayout.md_arrays(g)
    assert arrays["/dev/md127"] is arrays["/dev/md/0"]
    assert arrays["/dev/md127"].describe() == "raid10 over /dev/sdb2 and /dev/sdb3, metadata 1.1"
    assert "each in two copies" in arrays["/dev/md127"].why()
