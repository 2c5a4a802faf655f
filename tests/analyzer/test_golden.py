"""Golden image builder: cache key and geometry (fast), real images (vm)."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pageshare import golden
from pageshare.errors import UserError
from pageshare.golden import cli as golden_cli
from pageshare.golden import spec as golden_spec

# --- fast unit tests --------------------------------------------------------


def test_key_is_stable_and_differs_between_variants() -> None:
    assert golden.image_key("demo") == golden.image_key("demo")
    assert golden.image_key("demo") != golden.image_key("small")
    assert len(golden.image_key("small")) == 16


def test_key_changes_with_spec(monkeypatch: pytest.MonkeyPatch) -> None:
    before = golden.image_key("small")
    changed = dict(golden.VARIANTS["small"])
    changed["packages"] = [*golden._spec("small").packages, "less"]
    monkeypatch.setitem(golden.VARIANTS, "small", changed)
    assert golden.image_key("small") != before
    monkeypatch.undo()
    assert golden.image_key("small") == before


def test_key_changes_with_builder_version(monkeypatch: pytest.MonkeyPatch) -> None:
    before = golden.image_key("demo")
    # Patched where image_key reads it: the package only re-exports the value.
    monkeypatch.setattr(golden_spec, "BUILDER_VERSION", golden.BUILDER_VERSION + 1)
    assert golden.image_key("demo") != before


def test_unknown_variant_is_a_user_error() -> None:
    with pytest.raises(UserError, match="unknown golden image variant"):
        golden.image_key("nope")
    with pytest.raises(UserError):
        golden.build_image("nope")


def test_variant_specs_are_well_formed() -> None:
    for name in golden.VARIANTS:
        spec = golden._spec(name)
        assert spec.suite in ("bookworm", "trixie")
        # Every apt source is of the variant's own release (no mixed suites).
        assert all(src.split()[2].split("-")[0] == spec.suite for src in spec.sources)
        assert {"linux-image-cloud-amd64", "systemd-sysv", "udev"} <= set(spec.packages)
        assert str(uuid.UUID(spec.fs_uuid)) == spec.fs_uuid
    demo = golden._spec("demo")
    assert {"openssh-server", "nginx", "python3"} <= set(demo.packages)
    assert demo.disk_guid is not None
    assert set(demo.partition_guids) == {"1", "14", "15"}
    all_ids = [demo.fs_uuid, demo.disk_guid, *demo.partition_guids.values()]
    assert len(set(all_ids)) == len(all_ids)


def test_trixie_variant_is_small_packages_on_demo_layout() -> None:
    trixie, small = golden._spec("trixie"), golden._spec("small")
    assert trixie.suite == "trixie"
    assert [s.split()[2] for s in trixie.sources] == ["trixie", "trixie-updates", "trixie-security"]
    assert trixie.packages == small.packages
    assert trixie.mmdebstrap_variant == small.mmdebstrap_variant
    g = golden.geometry("trixie")
    assert (g.layout, g.root_partition, g.root_start_sector) == ("gpt", 1, 262144)
    assert trixie.disk_guid is not None and set(trixie.partition_guids) == {"1", "14", "15"}
    # No UUID or GUID is shared with another variant: clones of different
    # golden images must not look like the same disk or file system.
    ids = [
        (v, i)
        for v in golden.VARIANTS
        for i in (
            golden._spec(v).fs_uuid,
            golden._spec(v).disk_guid,
            golden._spec(v).boot_fs_uuid,
            *golden._spec(v).partition_guids.values(),
        )
        if i
    ]
    assert len({i for _, i in ids}) == len(ids)


def test_libvirt_variants_are_small_and_trixie_with_libvirt() -> None:
    small = golden._spec("small")
    for name, suite in (("libvirt", "bookworm"), ("libvirt-trixie", "trixie")):
        spec = golden._spec(name)
        assert (spec.suite, spec.mmdebstrap_variant) == (suite, small.mmdebstrap_variant)
        assert spec.packages[: len(small.packages)] == small.packages
        assert set(spec.packages) - set(small.packages) == {
            "libvirt-daemon-system",
            "python3-libvirt",
            "apparmor",
        }
        assert golden.geometry(name).layout == "whole-disk"


def test_bootsplit_variant_is_small_packages_with_a_separate_boot() -> None:
    spec, small = golden._spec("bootsplit"), golden._spec("small")
    assert (spec.packages, spec.mmdebstrap_variant, spec.suite) == (
        small.packages,
        small.mmdebstrap_variant,
        small.suite,
    )
    assert spec.boot_fs_uuid and str(uuid.UUID(spec.boot_fs_uuid)) == spec.boot_fs_uuid
    assert set(spec.partition_guids) == {"1", "2", "14", "15"}
    g = golden.geometry("bootsplit")
    assert g.layout == "gpt-bootsplit"
    # /boot (128 MiB) where the root starts in "gpt", the root right after it;
    # both 4 KiB-aligned on the disk, so pages of both can be listed.
    assert (g.boot_partition, g.boot_start_sector, g.boot_end_sector) == (2, 262144, 524287)
    assert (g.root_partition, g.root_start_sector) == (1, 524288)
    assert g.boot_fs_bytes == (g.boot_end_sector - g.boot_start_sector + 1) * 512
    assert g.root_start_sector % 8 == 0 and g.boot_start_sector % 8 == 0
    assert g.root_end_sector == g.virtual_size // 512 - 34
    # The other variants have no /boot partition (and their cache keys did not move).
    assert all(golden.geometry(v).boot_partition is None for v in ("small", "demo", "trixie"))
    assert all("boot_fs_uuid" not in golden.VARIANTS[v] for v in ("small", "demo", "trixie"))


def test_lvm_variant_is_small_packages_with_lvm2_on_a_pv_partition() -> None:
    spec, small = golden._spec("lvm"), golden._spec("small")
    assert spec.packages == [*small.packages, "lvm2"]  # the initrd activates the VG
    g = golden.geometry("lvm")
    assert (g.layout, g.root_partition, g.root_start_sector) == ("gpt-lvm", 1, 262144)
    # The LV (the file system) fits in the PV partition after LVM's own metadata.
    assert g.fs_bytes == golden.LVM_ROOT_BYTES
    assert g.fs_bytes + (1 << 20) <= (g.root_end_sector - g.root_start_sector + 1) * 512


def test_xfs_variant_is_small_packages_with_an_xfs_root() -> None:
    spec, small = golden._spec("xfs"), golden._spec("small")
    assert spec.root_fstype == "xfs" and small.root_fstype == "ext4"
    assert spec.packages == [*small.packages, "xfsprogs"]  # fsck.xfs for the initrd
    assert golden.geometry("xfs") == golden.geometry("trixie")
    assert "FSTYPE=xfs" in golden._root_fstype_hook("xfs")


def test_btrfs_variant_is_small_packages_with_the_root_in_a_btrfs_subvolume(tmp_path: Path) -> None:
    spec, small = golden._spec("btrfs"), golden._spec("small")
    assert (spec.root_fstype, spec.root_subvol) == ("btrfs", "@rootfs")
    assert spec.packages == [*small.packages, "btrfs-progs"]  # btrfs device scan in the initrd
    assert golden.geometry("btrfs") == golden.geometry("trixie")
    assert spec.compressed_files and all(f.startswith("/usr/") for f in spec.compressed_files)
    # The other variants' specs have no btrfs fields (and their cache keys did not move).
    assert all("root_subvol" not in golden.VARIANTS[v] for v in golden.VARIANTS if v != "btrfs")
    assert golden._spec("xfs").root_subvol == "" and golden._spec("xfs").compressed_files == ()
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc/shadow").write_text("root:*:19000:0:99999:7:::\n")
    golden._customize(tmp_path, spec)
    assert (tmp_path / "etc/fstab").read_text() == (
        f"UUID={spec.fs_uuid}\t/\tbtrfs\tdefaults,subvol=@rootfs\t0\t0\n"
    )


def test_mbr_variant_is_small_packages_on_debian_installers_bios_layout(tmp_path: Path) -> None:
    spec, small = golden._spec("mbr"), golden._spec("small")
    assert (spec.packages, spec.mmdebstrap_variant, spec.suite) == (
        small.packages,
        small.mmdebstrap_variant,
        small.suite,
    )
    g = golden.geometry("mbr")
    # As fdisk -l shows a fresh BIOS install: root 1 (2048 to a MiB boundary),
    # extended 2 from two sectors before logical 5 (swap) to the end of the disk.
    assert (g.layout, g.root_partition, g.root_start_sector, g.root_end_sector) == (
        "mbr",
        1,
        2048,
        3930111,
    )
    assert (g.extended_partition, g.extended_start_sector) == (2, 3932158)
    assert (g.swap_partition, g.swap_start_sector, g.swap_end_sector) == (5, 3932160, 4194303)
    assert g.fs_bytes == (g.root_end_sector - 2048 + 1) * 512 and g.fs_bytes % 4096 == 0
    assert spec.disk_guid == "0x5a3c9e17" and spec.partition_guids == {}
    assert spec.swap_uuid and str(uuid.UUID(spec.swap_uuid)) == spec.swap_uuid
    # The other variants have no swap (and their cache keys did not move).
    assert all(golden.geometry(v).swap_partition is None for v in golden.VARIANTS if v != "mbr")
    assert all("swap_uuid" not in golden.VARIANTS[v] for v in golden.VARIANTS if v != "mbr")
    assert golden._required_tools(spec).keys() >= {"sfdisk", "mkswap"}
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc/shadow").write_text("root:*:19000:0:99999:7:::\n")
    golden._customize(tmp_path, spec)
    assert (tmp_path / "etc/fstab").read_text() == (
        f"UUID={spec.fs_uuid}\t/\text4\trw,discard,errors=remount-ro\t0\t1\n"
        f"UUID={spec.swap_uuid}\tnone\tswap\tsw\t0\t0\n"
    )


def test_small1k_variant_is_small_with_1k_blocks() -> None:
    spec, small = golden._spec("small1k"), golden._spec("small")
    assert (spec.fs_block, small.fs_block) == (1024, 4096)
    assert spec.packages == small.packages and spec.layout == small.layout
    assert golden.geometry("small1k") == golden.geometry("small")


def test_gpt_geometry_matches_debian_cloud_layout() -> None:
    g = golden.geometry("demo")
    assert g.layout == "gpt"
    assert g.virtual_size == 3 * 1024**3
    assert (g.root_partition, g.root_start_sector) == (1, 262144)
    total = g.virtual_size // 512
    assert g.root_end_sector == total - 34  # last usable LBA with a 128-entry GPT
    part_bytes = (g.root_end_sector - g.root_start_sector + 1) * 512
    assert g.fs_bytes % 4096 == 0
    assert part_bytes - 4096 < g.fs_bytes <= part_bytes
    assert golden.GPT_BIOS_BOOT == (14, 2048, 8191)
    assert golden.GPT_ESP == (15, 8192, 262143)


def test_whole_disk_geometry() -> None:
    g = golden.geometry("small")
    assert g.layout == "whole-disk"
    assert g.root_partition is None
    assert g.root_start_sector == 0
    assert g.fs_bytes == g.virtual_size == 2 * 1024**3


def test_cached_image_needs_manifest_with_current_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PAGESHARE_CACHE", str(tmp_path))
    assert golden.cached_image("small") is None
    d = tmp_path / "images" / f"small-{golden.image_key('small')}"
    d.mkdir(parents=True)
    (d / "base.qcow2").write_bytes(b"")
    (d / "manifest.json").write_text(json.dumps({"key": "stale"}))
    assert golden.cached_image("small") is None
    (d / "manifest.json").write_text(json.dumps({"key": golden.image_key("small")}))
    image = golden.cached_image("small")
    assert image is not None and image.path == d / "base.qcow2"
    assert golden.build_image("small") == image  # cached: no root, no tools needed


def test_copy_sparse_keeps_data_and_holes(tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    with src.open("wb") as f:
        f.truncate(16 << 20)
        f.write(b"head")
        f.seek(9 << 20)
        f.write(b"x" * 5000)
    with dst.open("wb") as f:
        f.truncate(64 << 20)
    golden._copy_sparse(src, dst, 1 << 20)
    data = dst.read_bytes()
    assert data[1 << 20 : (1 << 20) + 4] == b"head"
    assert data[(10 << 20) : (10 << 20) + 5000] == b"x" * 5000
    assert data.count(0) == len(data) - 4 - 5000
    assert dst.stat().st_blocks * 512 < 4 << 20


def test_mountinfo_unescape() -> None:
    assert golden._unescape_mountinfo(r"/a\040b\011c") == "/a b\tc"


def test_main_reports_user_errors(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def fail(variant: str, **_: Any) -> golden.GoldenImage:
        raise UserError("building a golden image needs root", "run as root")

    monkeypatch.setattr(golden_cli, "build_image", fail)  # where main looks it up
    assert golden.main(["--variant", "small"]) == 2
    err = capsys.readouterr().err
    assert "error: building a golden image needs root" in err
    assert "hint: run as root" in err


# --- real images --------------------------------------------------------------


def _image(variant: str) -> golden.GoldenImage:
    cached = golden.cached_image(variant)
    if cached is not None:
        return cached
    if os.geteuid() != 0 or shutil.which("mmdebstrap") is None:
        pytest.skip(f"{variant} image not built and cannot build it here (needs root)")
    return golden.build_image(variant)


@pytest.fixture(scope="module", params=["small", "demo", "trixie"])
def image(request: pytest.FixtureRequest) -> golden.GoldenImage:
    return _image(str(request.param))


@pytest.fixture(scope="module")
def raw_disk(image: golden.GoldenImage, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    raw = tmp_path_factory.mktemp(image.variant) / "disk.raw"
    subprocess.run(
        ["qemu-img", "convert", "-f", "qcow2", "-O", "raw", str(image.path), str(raw)], check=True
    )
    yield raw
    raw.unlink()


def _fs_spec(raw: Path, manifest: dict[str, Any]) -> str:
    offset = int(manifest["root_start_sector"]) * 512
    return f"{raw}?offset={offset}" if offset else str(raw)


def _debugfs(fs: str, request: str) -> str:
    proc = subprocess.run(["debugfs", "-R", request, fs], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout + proc.stderr


def _exists(fs: str, path: str) -> bool:
    return "File not found" not in _debugfs(fs, f"stat {path}")


def _gpt_partitions(raw: Path) -> tuple[uuid.UUID, dict[int, tuple[uuid.UUID, int, int]]]:
    with raw.open("rb") as f:
        f.seek(512)
        header = f.read(92)
        assert header[:8] == b"EFI PART"
        disk_guid = uuid.UUID(bytes_le=header[56:72])
        entries_lba, count, size = struct.unpack_from("<QII", header, 72)
        f.seek(entries_lba * 512)
        table = f.read(count * size)
    parts = {}
    for i in range(count):
        entry = table[i * size : (i + 1) * size]
        if entry[:16] == bytes(16):
            continue
        first, last = struct.unpack_from("<QQ", entry, 32)
        parts[i + 1] = (uuid.UUID(bytes_le=entry[16:32]), first, last)
    return disk_guid, parts


@pytest.mark.vm
def test_qcow2_header_and_size(image: golden.GoldenImage) -> None:
    info = json.loads(
        subprocess.run(
            ["qemu-img", "info", "--output=json", str(image.path)],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    )
    assert info["format"] == "qcow2"
    assert info["virtual-size"] == image.manifest["virtual_size"]
    assert info["virtual-size"] == golden.geometry(image.variant).virtual_size
    assert info["cluster-size"] == 65536
    assert "backing-filename" not in info
    assert image.manifest["sha256"] == golden._sha256(image.path)


@pytest.mark.vm
def test_partition_layout(image: golden.GoldenImage, raw_disk: Path) -> None:
    spec = golden._spec(image.variant)
    if image.manifest["layout"] == "whole-disk":
        assert image.manifest["root_partition"] is None
        with raw_disk.open("rb") as f:
            f.seek(512)
            assert f.read(8) != b"EFI PART"
        return
    disk_guid, parts = _gpt_partitions(raw_disk)
    assert str(disk_guid) == spec.disk_guid
    assert sorted(parts) == [1, 14, 15]
    guid, first, last = parts[1]
    assert (first, last) == (262144, golden.geometry(image.variant).root_end_sector)
    assert str(guid) == spec.partition_guids["1"]
    assert parts[14][1:] == (2048, 8191)
    assert parts[15][1:] == (8192, 262143)


@pytest.mark.vm
def test_root_filesystem_contents(image: golden.GoldenImage, raw_disk: Path) -> None:
    m = image.manifest
    fs = _fs_spec(raw_disk, m)
    stats = _debugfs(fs, "stats")
    assert f"Filesystem UUID:          {m['fs_uuid']}" in stats
    assert "Block size:               4096" in stats
    kernel = m["kernel_version"]
    assert kernel.endswith("-cloud-amd64")
    for path in (
        "/usr/lib/systemd/systemd",
        "/usr/lib/x86_64-linux-gnu/libc.so.6",
        f"/boot/vmlinuz-{kernel}",
        f"/boot/initrd.img-{kernel}",
    ):
        assert _exists(fs, path), path
    assert _exists(fs, "/usr/sbin/nginx") == (image.variant == "demo")
    assert _debugfs(fs, "cat /etc/fstab").count(f"UUID={m['fs_uuid']}\t/\text4") == 1
    assert "pageshare-golden" in _debugfs(fs, "cat /etc/hostname")
    assert "root:!" in _debugfs(fs, "cat /etc/shadow")
    assert "Size: 0" in _debugfs(fs, "stat /etc/machine-id")
    assert not _exists(fs, "/etc/resolv.conf")
    if image.variant == "demo":
        wants = _debugfs(fs, "ls /etc/systemd/system/multi-user.target.wants")
        assert "nginx.service" in wants and "ssh.service" in wants
        assert "ssh_host_" not in _debugfs(fs, "ls /etc/ssh")


def _boot_to_login(variant: str, tmp_path: Path) -> str:
    """Direct kernel boot under TCG, on a throwaway overlay; returns the serial log
    once it shows a login prompt (or whatever it showed when the time ran out)."""
    if shutil.which("qemu-system-x86_64") is None:
        pytest.skip("qemu-system-x86_64 not installed")
    image = _image(variant)
    m = image.manifest
    raw = tmp_path / "disk.raw"
    subprocess.run(["qemu-img", "convert", "-O", "raw", str(image.path), str(raw)], check=True)
    fs = _fs_spec(raw, m)
    kernel, initrd = tmp_path / "vmlinuz", tmp_path / "initrd.img"
    _debugfs(fs, f"dump /boot/vmlinuz-{m['kernel_version']} {kernel}")
    _debugfs(fs, f"dump /boot/initrd.img-{m['kernel_version']} {initrd}")
    raw.unlink()
    overlay, serial = tmp_path / "overlay.qcow2", tmp_path / "serial.log"
    subprocess.run(
        ["qemu-img", "create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", str(image.path),
         str(overlay)],
        check=True,
    )  # fmt: skip
    return _run_until_login(
        [
            "-kernel",
            str(kernel),
            "-initrd",
            str(initrd),
            "-append",
            f"console=ttyS0 root=UUID={m['fs_uuid']} ro",
            "-drive",
            f"file={overlay},if=virtio,format=qcow2",
        ],
        serial,
        300,
    )


def _run_until_login(args: list[str], serial: Path, timeout: float) -> str:
    """A 1 GiB TCG guest with ARGS and its serial console in SERIAL, killed once
    that shows a login prompt; returns the console's text then (or at the end
    of TIMEOUT seconds, or when QEMU exited)."""
    qemu = subprocess.Popen(
        [
            "qemu-system-x86_64",
            "-machine",
            "q35,accel=tcg",
            "-cpu",
            "max,la57=off",
            "-m",
            "1024",
            "-smp",
            "1",
            "-nodefaults",
            "-display",
            "none",
            "-serial",
            f"file:{serial}",
            *args,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    log = ""
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and qemu.poll() is None:
            log = serial.read_text(errors="replace") if serial.exists() else ""
            if "login:" in log:
                break
            time.sleep(2)
    finally:
        qemu.kill()
        qemu.wait()
    return log


@pytest.mark.vm
def test_bootsplit_has_its_kernel_only_on_the_boot_partition(tmp_path: Path) -> None:
    image = _image("bootsplit")
    m, geo, spec = image.manifest, golden.geometry("bootsplit"), golden._spec("bootsplit")
    raw = tmp_path / "disk.raw"
    subprocess.run(["qemu-img", "convert", "-O", "raw", str(image.path), str(raw)], check=True)
    disk_guid, parts = _gpt_partitions(raw)
    assert str(disk_guid) == spec.disk_guid and sorted(parts) == [1, 2, 14, 15]
    assert parts[1][1:] == (geo.root_start_sector, geo.root_end_sector)
    assert parts[2][1:] == (geo.boot_start_sector, geo.boot_end_sector)
    assert str(parts[2][0]) == spec.partition_guids["2"]
    assert (m["boot_partition"], m["boot_start_sector"], m["boot_fs_uuid"]) == (
        2,
        262144,
        spec.boot_fs_uuid,
    )
    root, boot = (
        f"{raw}?offset={geo.root_start_sector * 512}",
        f"{raw}?offset={geo.boot_start_sector * 512}",
    )
    assert f"Filesystem UUID:          {spec.boot_fs_uuid}" in _debugfs(boot, "stats")
    assert "Filesystem volume name:   boot" in _debugfs(boot, "stats")
    kernel = m["kernel_version"]
    for name in (f"vmlinuz-{kernel}", f"initrd.img-{kernel}", f"config-{kernel}"):
        assert _exists(boot, f"/{name}"), name
        assert not _exists(root, f"/boot/{name}"), name  # only the mount point is left
    assert _exists(root, "/boot") and _exists(root, "/usr/lib/systemd/systemd")
    fstab = _debugfs(root, "cat /etc/fstab")
    assert f"UUID={m['fs_uuid']}\t/\text4" in fstab
    assert f"UUID={spec.boot_fs_uuid}\t/boot\text4\tdefaults\t0\t2" in fstab


def test_efi_variant_geometry_is_a_uefi_installers() -> None:
    spec, g = golden._spec("efi"), golden.geometry("efi")
    assert spec.suite == "trixie" and g.layout == "gpt-efi"
    assert [(p.mountpoint, p.partition) for p in g.placed] == [
        ("/boot/efi", 1),
        ("/boot", 2),
        ("/", 3),
        ("/var", 4),
    ]
    assert g.placed[0].start_sector == 2048
    for a, b in zip(g.placed, g.placed[1:], strict=False):
        assert b.start_sector == a.end_sector + 1 and b.start_sector % 2048 == 0
    assert g.placed[-1].end_sector <= g.virtual_size // 512 - 34
    assert (g.root_partition, g.root_start_sector) == (3, g.at("/").start_sector)
    assert g.fs_bytes == (g.root_end_sector - g.root_start_sector + 1) * 512
    assert (g.boot_partition, g.boot_start_sector) == (2, g.at("/boot").start_sector)
    assert [f.fstype for f in spec.filesystems] == ["vfat", "ext2", "ext4", "ext3"]


@pytest.mark.vm
def test_efi_image_has_its_file_systems_where_the_fstab_says(tmp_path: Path) -> None:
    image = _image("efi")
    m, geo, spec = image.manifest, golden.geometry("efi"), golden._spec("efi")
    raw = tmp_path / "disk.raw"
    subprocess.run(["qemu-img", "convert", "-O", "raw", str(image.path), str(raw)], check=True)
    disk_guid, parts = _gpt_partitions(raw)
    assert str(disk_guid) == spec.disk_guid and sorted(parts) == [1, 2, 3, 4]
    for p in geo.placed:
        assert parts[p.partition][1:] == (p.start_sector, p.end_sector), p
        assert str(parts[p.partition][0]) == spec.partition_guids[str(p.partition)]
    assert m["filesystems"][2] == {
        "mountpoint": "/",
        "partition": 3,
        "start_sector": geo.root_start_sector,
        "end_sector": geo.root_end_sector,
    }

    def at(mp: str) -> str:
        return f"{raw}?offset={geo.at(mp).start_sector * 512}"

    kernel = m["kernel_version"]
    root, boot, var = at("/"), at("/boot"), at("/var")
    # /boot is ext2 and /var ext3: no extents, so their files use indirect block maps.
    for fs, fs_uuid, journal in (
        (boot, spec.filesystems[1].uuid, False),
        (var, spec.filesystems[3].uuid, True),
    ):
        stats = _debugfs(fs, "stats")
        assert f"Filesystem UUID:          {fs_uuid}" in stats
        assert " extent" not in stats.split("Filesystem features:")[1].splitlines()[0]
        assert ("has_journal" in stats) == journal
    assert "EXTENTS:" not in _debugfs(boot, f"stat /vmlinuz-{kernel}")
    assert "(IND):" in _debugfs(boot, f"stat /vmlinuz-{kernel}")
    for name in (
        f"vmlinuz-{kernel}",
        f"initrd.img-{kernel}",
        "grub/grub.cfg",
        "grub/x86_64-efi/linux.mod",
    ):
        assert _exists(boot, f"/{name}"), name
    assert not _exists(root, f"/boot/vmlinuz-{kernel}") and _exists(boot, "/efi")
    grub_cfg = _debugfs(boot, "cat /grub/grub.cfg")
    assert f"linux\t/vmlinuz-{kernel} root=UUID={m['fs_uuid']} ro" in grub_cfg
    assert f"search --no-floppy --fs-uuid --set=root {spec.filesystems[1].uuid}" in grub_cfg
    assert _exists(var, "/lib/dpkg/status") and not _exists(root, "/var/lib/dpkg/status")
    fstab = _debugfs(root, "cat /etc/fstab")
    assert f"UUID={spec.filesystems[0].uuid}\t/boot/efi\tvfat\tumask=0077\t0\t1" in fstab
    assert f"UUID={spec.filesystems[3].uuid}\t/var\text3\tdefaults\t0\t2" in fstab
    # The ESP is FAT32 with GRUB at Debian's path and the removable-media path.
    esp = f"{raw}@@{geo.at('/boot/efi').start_sector * 512}"
    listing = subprocess.run(
        ["mdir", "-i", esp, "-/", "::/EFI"],
        capture_output=True,
        text=True,
        env={**os.environ, "MTOOLS_SKIP_CHECK": "1"},
    )
    assert listing.returncode == 0, listing.stderr
    assert "grubx64  efi" in listing.stdout and "BOOTX64  EFI" in listing.stdout, listing.stdout
    blkid = subprocess.run(
        [
            "blkid",
            "-p",
            "-O",
            str(geo.at("/boot/efi").start_sector * 512),
            "-o",
            "export",
            str(raw),
        ],
        capture_output=True,
        text=True,
    ).stdout
    assert f"UUID={spec.filesystems[0].uuid}" in blkid and "VERSION=FAT32" in blkid, blkid


@pytest.mark.vm
def test_efi_boots_with_uefi_firmware_and_grub_to_login(tmp_path: Path) -> None:
    """No direct kernel boot: OVMF finds EFI/BOOT/BOOTX64.EFI on the ESP, GRUB
    finds /boot by its UUID, reads grub.cfg and boots the kernel, and the
    system mounts /boot, /boot/efi and /var from its fstab."""
    image = _image("efi")
    kernel = image.manifest["kernel_version"]
    overlay, serial = tmp_path / "overlay.qcow2", tmp_path / "serial.log"
    vars_copy = tmp_path / "OVMF_VARS.fd"
    shutil.copyfile("/usr/share/OVMF/OVMF_VARS_4M.fd", vars_copy)
    subprocess.run(
        [
            "qemu-img",
            "create",
            "-q",
            "-f",
            "qcow2",
            "-F",
            "qcow2",
            "-b",
            str(image.path),
            str(overlay),
        ],
        check=True,
    )
    log = _run_until_login(
        [
            "-drive",
            "if=pflash,format=raw,unit=0,readonly=on,file=/usr/share/OVMF/OVMF_CODE_4M.fd",
            "-drive",
            f"if=pflash,format=raw,unit=1,file={vars_copy}",
            "-drive",
            f"file={overlay},if=virtio,format=qcow2",
        ],
        serial,
        420,
    )
    assert "pageshare-golden login:" in log, log[-3000:]
    # GRUB passed BOOT_IMAGE=, the path it loaded the kernel from on /boot.
    assert f"Command line: BOOT_IMAGE=/vmlinuz-{kernel} root=UUID=" in log, log[:5000]
    assert f"Linux version {kernel}" in log
    assert "[FAILED]" not in log, log


@pytest.mark.vm
def test_lvm_root_is_a_linear_lv_on_partition_1(tmp_path: Path) -> None:
    from pageshare.image import lvm

    image = _image("lvm")
    m, geo = image.manifest, golden.geometry("lvm")
    raw = tmp_path / "disk.raw"
    subprocess.run(["qemu-img", "convert", "-O", "raw", str(image.path), str(raw)], check=True)
    _, parts = _gpt_partitions(raw)
    assert sorted(parts) == [1, 14, 15]
    assert parts[1][1:] == (geo.root_start_sector, geo.root_end_sector)
    part = geo.root_start_sector * 512
    with raw.open("rb") as f:
        label = lvm.read_label(lambda at, size: os.pread(f.fileno(), size, part + at))
    assert label is not None
    name, vg = lvm.volume_group(label.metadata)
    assert name == golden.LVM_VG and list(vg["logical_volumes"]) == [golden.LVM_LV]
    segs, why = lvm.lv_segments(
        vg, golden.LVM_LV, {label.uuid: geo.root_start_sector + label.pe_start // 512}
    )
    assert why == "" and len(segs) == 1
    assert segs[0].disk_start == m["root_fs_start_sector"]
    assert segs[0].sectors * 512 == golden.LVM_ROOT_BYTES
    fs = f"{raw}?offset={segs[0].disk_start * 512}"
    assert f"Filesystem UUID:          {m['fs_uuid']}" in _debugfs(fs, "stats")
    assert "/dev/mapper/vg0-root\t/\text4" in _debugfs(fs, "cat /etc/fstab")
    assert _exists(fs, f"/boot/vmlinuz-{m['kernel_version']}") and _exists(fs, "/usr/sbin/lvm")


@pytest.mark.vm
def test_xfs_root_partition(tmp_path: Path) -> None:
    from pageshare.image.ext4map import fs_image

    image = _image("xfs")
    m, geo = image.manifest, golden.geometry("xfs")
    raw = tmp_path / "disk.raw"
    subprocess.run(["qemu-img", "convert", "-O", "raw", str(image.path), str(raw)], check=True)
    _, parts = _gpt_partitions(raw)
    assert parts[1][1:] == (geo.root_start_sector, geo.root_end_sector)
    root, _ = fs_image(
        raw,
        ((0, geo.root_end_sector - geo.root_start_sector + 1, geo.root_start_sector),),
        tmp_path / "root.xfs",
        copy=True,
    )
    raw.unlink()

    def xfs_db(*cmds: str) -> str:
        args = [a for c in cmds for a in ("-c", c)]
        return subprocess.run(
            ["xfs_db", "-r", *args, str(root)], capture_output=True, text=True, check=True
        ).stdout

    assert f"uuid = {m['fs_uuid']}" in xfs_db("sb 0", "print uuid")
    assert 'fname = "root' in xfs_db("sb 0", "print fname")
    # The tree came through whole: /tmp keeps its sticky bit, the kernel is in /boot.
    assert "core.mode = 041777" in xfs_db("path /tmp", "print core.mode")  # dir, 1777
    assert "current inode number" in xfs_db(f"path /boot/vmlinuz-{m['kernel_version']}", "inode")


@pytest.mark.vm
def test_btrfs_root_is_subvolume_rootfs_of_a_one_device_btrfs(tmp_path: Path) -> None:
    import guestfs  # Debian's python3-guestfs, as image_inspect uses it
    from pageshare.image import btrfsmap
    from pageshare.image.ext4map import fs_image

    image = _image("btrfs")
    m, geo = image.manifest, golden.geometry("btrfs")
    raw = tmp_path / "disk.raw"
    subprocess.run(["qemu-img", "convert", "-O", "raw", str(image.path), str(raw)], check=True)
    _, parts = _gpt_partitions(raw)
    assert parts[1][1:] == (geo.root_start_sector, geo.root_end_sector)
    root, _ = fs_image(
        raw,
        ((0, geo.root_end_sector - geo.root_start_sector + 1, geo.root_start_sector),),
        tmp_path / "root.btrfs",
        copy=True,
    )
    raw.unlink()
    sb = btrfsmap.superblock(root)
    assert (sb["fsid"], sb["num_devices"], sb["sectorsize"]) == (m["fs_uuid"], "1", "4096")
    _, default, paths = btrfsmap.read_subvolumes(root)
    assert default == btrfsmap.FS_TREE and sorted(paths.values()) == ["", "@rootfs"]
    g = guestfs.GuestFS(python_return_dict=True)
    try:
        g.set_backend_settings(["force_tcg"])
        g.add_drive_opts(str(root), format="raw", readonly=1)
        g.launch()
        g.mount_ro("btrfsvol:/dev/sda/@rootfs", "/")
        assert "subvol=@rootfs" in g.cat("/etc/fstab")
        assert g.is_file(f"/boot/vmlinuz-{m['kernel_version']}")
        assert g.is_file("/usr/bin/btrfs")
        assert oct(g.statns("/tmp")["st_mode"]) == "0o41777"  # the tar kept the sticky bit
        ino = g.statns(golden._spec("btrfs").compressed_files[0])["st_ino"]
    finally:
        g.close()
    tree = next(t for t, p in paths.items() if p == "@rootfs")
    _, skipped = btrfsmap.read_extents(root, [ino], tree)
    assert skipped.compressed_extents > 0 and skipped.inodes == {ino}


@pytest.mark.vm
def test_small1k_root_has_1k_blocks(tmp_path: Path) -> None:
    image = _image("small1k")
    raw = tmp_path / "disk.raw"
    subprocess.run(["qemu-img", "convert", "-O", "raw", str(image.path), str(raw)], check=True)
    stats = _debugfs(str(raw), "stats")
    assert "Block size:               1024" in stats
    assert f"Filesystem UUID:          {image.manifest['fs_uuid']}" in stats
    assert _exists(str(raw), f"/boot/vmlinuz-{image.manifest['kernel_version']}")


@pytest.mark.vm
def test_demo_boots_to_login_prompt(tmp_path: Path) -> None:
    log = _boot_to_login("demo", tmp_path)
    assert "login:" in log, log[-3000:]
    assert "pageshare-golden login:" in log
    assert "[FAILED]" not in log, log
    assert "nginx" in log


@pytest.mark.vm
def test_trixie_boots_to_login_prompt(tmp_path: Path) -> None:
    log = _boot_to_login("trixie", tmp_path)
    assert "login:" in log, log[-3000:]
    assert "pageshare-golden login:" in log
    assert "[FAILED]" not in log, log
    # It really is Debian 13 on its 6.12 kernel, the case crash 8.0.x cannot read.
    kernel = _image("trixie").manifest["kernel_version"]
    assert kernel.startswith("6.12.") and kernel.endswith("-cloud-amd64")
    assert f"Linux version {kernel}" in log
    assert "Debian GNU/Linux 13" in log
