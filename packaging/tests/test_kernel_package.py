"""The patched kernel's Debian package, installed by apt into a clean root and booted.

Run by `make kernel-package-test` (not by `make test`: a cold build of the
package takes about 40 minutes on 2 cores, two thirds of the hour a cold
`make test` is meant to fit in; see packaging/kernel_deb.py).  From
outside, as an operator would check a new host kernel:

- the .deb holds the kernel, its modules and the maintainer scripts, under
  a release that does not collide with Debian's kernels;
- apt installs it (`apt-get install ./<deb>`) into a fresh Debian 13 root
  that mmdebstrap made, and its postinst has initramfs-tools make the
  initrd;
- that root, as a disk, boots the installed kernel and initrd under TCG to
  systemd's multi-user target, where a unit loads modules, reads the
  series' KSM counters in sysfs and runs the series' own kselftest
  (merge_page_tests, built against the same tree), reporting on the serial
  console; every test passes and the counters moved;
- a BIOS disk with Debian 13's own GRUB (grub-pc, grub-install and
  update-grub run in the libguestfs appliance) and a Debian kernel that
  10_linux lists first (trixie-backports' cloud kernel) boots, with no
  -kernel, the pageshare kernel: pageshare-host's grub.d file made it
  GRUB's default;
- under Secure Boot (OVMF with Microsoft's keys, Debian's shim and signed
  GRUB), docs/install.md's steps boot it: the image signed with sbsign,
  the certificate in shim's MOK list; the kernel comes up locked down,
  loads the package's signed modules and rejects an unsigned one, and the
  unsigned image, or the signed one without the MOK entry, stops in GRUB.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

# packaging/ is on pytest's path (pythonpath in pyproject.toml)
import kernel_deb
import pytest
from pageshare import debian, golden
from pageshare_tools import ktestlib as ktest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]

ROOT_UUID = "0c7e5d3a-9b14-4f62-8a2e-5d1c7b9f3e40"
DONE = "PAGESHARE-KPKG-DONE"
# Runs at boot and reports on the serial console, then powers the guest off.
CHECK_SCRIPT = f"""#!/bin/sh
exec > /dev/ttyS0 2>&1
echo "uname: $(uname -r)"
modprobe virtio_net && echo "modprobe virtio_net: ok"
for f in /sys/kernel/mm/ksm/merge_page_*; do echo "before $(basename $f) $(cat $f)"; done
# Swap, so that the selftest's swapped-out case runs too.
dd if=/dev/zero of=/swapfile bs=1M count=256 status=none && chmod 600 /swapfile &&
    mkswap -q /swapfile && swapon /swapfile && echo "swap: on"
echo 32 > /proc/sys/vm/nr_hugepages     # for the hugetlb case
echo 1 > /sys/kernel/mm/ksm/run
/usr/local/lib/pageshare-test/merge_page_tests
rc=$?
for f in /sys/kernel/mm/ksm/merge_page_*; do echo "after $(basename $f) $(cat $f)"; done
echo "{DONE} rc=$rc"
systemctl --no-block poweroff
"""
CHECK_UNIT = """[Unit]
Description=pageshare kernel package check
After=multi-user.target

[Service]
Type=oneshot
ExecStart=/usr/local/lib/pageshare-test/check.sh

[Install]
WantedBy=multi-user.target
"""


@pytest.fixture(scope="module")
def package() -> dict[str, object]:
    return kernel_deb.build()


def deb(package: dict[str, object], which: str) -> Path:
    return Path(str(package["dir"])) / str(package[which])


def test_the_deb_holds_the_kernel_its_modules_and_scripts(package: dict[str, object]) -> None:
    release = str(package["release"])
    assert release.endswith("-pageshare-cloud-amd64"), release
    image = deb(package, "image")
    fields = subprocess.run(
        ["dpkg-deb", "-f", str(image), "Package", "Version", "Depends"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert f"Package: linux-image-{release}" in fields
    assert f"Version: {package['version']}" in fields and "+pageshare" in fields
    listing = subprocess.run(
        ["dpkg-deb", "-c", str(image)], capture_output=True, text=True, check=True
    ).stdout
    for path in (
        f"./boot/vmlinuz-{release}",
        f"./boot/config-{release}",
        f"/modules/{release}/kernel/drivers/block/virtio_blk.ko",
        f"/modules/{release}/kernel/fs/fat/vfat.ko",
    ):
        assert path in listing, path
    modules = sum(
        1 for line in listing.splitlines() if line.endswith(".ko") or line.endswith(".ko.xz")
    )
    assert modules > 1000, f"{modules} modules: not Debian's full cloud configuration"
    control = subprocess.run(
        ["dpkg-deb", "-I", str(image)], capture_output=True, text=True, check=True
    ).stdout
    assert "postinst" in control and "postrm" in control


def test_modules_are_signed_by_the_kept_key_and_no_private_key_is_shipped(
    package: dict[str, object], tmp_path: Path
) -> None:
    """The modules carry the signature of the key kernel_deb kept (the one an
    operator enrolls for Secure Boot), the shipped .config names it by the
    build-relative path every build uses, and neither package holds a
    private key."""
    release = str(package["release"])
    for which in ("image", "headers"):
        out = tmp_path / which
        subprocess.run(["dpkg-deb", "-x", str(deb(package, which)), str(out)], check=True)
        found = subprocess.run(
            ["grep", "-rlI", "PRIVATE KEY-----", str(out)], capture_output=True, text=True
        ).stdout
        assert not found, f"a private key in the {which} package: {found}"
    config = (tmp_path / "image/boot" / f"config-{release}").read_text()
    assert f'CONFIG_MODULE_SIG_KEY="{kernel_deb.SIGNING_KEY_IN_BUILD}"' in config
    key = kernel_deb.signing_key(kernel_deb.pkg_root(), None)
    assert kernel_deb.cert_sha256(key) == package["signing_cert_sha256"]
    # A PKCS#7 module signature names its signer by issuer and serial number:
    # modinfo shows the signer's CN and the serial as sig_key.
    cert = subprocess.run(
        [
            "openssl",
            "x509",
            "-in",
            str(key),
            "-noout",
            "-serial",
            "-subject",
            "-nameopt",
            "RFC2253",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    serial = re.search(r"^serial=(\w+)$", cert, re.M)
    cn = re.search(r"^subject=.*CN=([^,\n]+)", cert, re.M)
    assert serial and cn, cert
    module = next((tmp_path / "image").glob(f"**/modules/{release}/kernel/fs/fat/vfat.ko*"))
    signer, sig_key = (
        subprocess.run(
            ["modinfo", "-F", field, str(module)], capture_output=True, text=True, check=True
        ).stdout.strip()
        for field in ("signer", "sig_key")
    )
    assert signer == cn.group(1), (signer, cert)
    assert sig_key.replace(":", "").lower() == serial.group(1).lower(), (sig_key, cert)


def boot_until(args: list[str], serial: Path, done: str, timeout: float, exits: bool = True) -> str:
    """A TCG guest (q35, -cpu max, no display, no reboot) with ARGS and its
    serial console in SERIAL, until the console shows DONE and QEMU exits
    (it powers off; not waited for unless EXITS), or TIMEOUT seconds pass;
    killed if still running.  Returns the console's text."""
    qemu = subprocess.Popen(
        [
            "qemu-system-x86_64",
            "-machine",
            "q35,accel=tcg",
            "-cpu",
            "max,la57=off",
            "-nodefaults",
            "-display",
            "none",
            "-no-reboot",
            "-serial",
            f"file:{serial}",
            *args,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and qemu.poll() is None:
            if serial.exists() and done in serial.read_text(errors="replace"):
                if exits:
                    qemu.wait(timeout=120)
                break
            time.sleep(3)
    finally:
        if qemu.poll() is None:
            qemu.kill()
            qemu.wait()
    return serial.read_text(errors="replace") if serial.exists() else ""


def _test_binaries(out: Path) -> Path:
    """merge_page_tests, built static by ktest against the series' uapi headers."""
    out.mkdir(parents=True, exist_ok=True)
    root = ktest.cache_root()
    src = ktest.ensure_source(root)
    patches = ktest.series_files()
    with src.locked():
        commits = ktest.apply_series(src, patches)
        kdir = ktest.ensure_kernel(src, patches, "plain")
        built = ktest.build_tests(src, commits[-1], kdir, out, out / "build.log")
    assert "merge_page_tests" in built
    return out / "merge_page_tests"


@pytest.fixture(scope="module")
def installed_root(
    package: dict[str, object], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Path]:
    work = tmp_path_factory.mktemp("kpkg")
    rootdir = work / "root"
    image = deb(package, "image")
    # A fresh Debian 13 system, then the operator's `apt install ./<deb>` in it.
    proc = subprocess.run(
        [
            "mmdebstrap",
            "--mode=root",
            "--variant=required",
            "--include=systemd-sysv,udev,kmod,initramfs-tools",
            f"--customize-hook=copy-in {image} /tmp",
            f'--customize-hook=chroot "$1" apt-get install -y /tmp/{image.name}',
            f'--customize-hook=rm "$1/tmp/{image.name}"',
            "trixie",
            str(rootdir),
            *debian.sources(["trixie"]),
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    yield rootdir
    shutil.rmtree(rootdir, ignore_errors=True)


def test_apt_installs_it_and_its_postinst_makes_the_initrd(
    package: dict[str, object], installed_root: Path
) -> None:
    release = str(package["release"])
    status = (installed_root / "var/lib/dpkg/status").read_text()
    block = next(b for b in status.split("\n\n") if f"Package: linux-image-{release}\n" in b)
    assert "Status: install ok installed" in block
    assert (installed_root / f"boot/vmlinuz-{release}").is_file()
    initrd = installed_root / f"boot/initrd.img-{release}"
    assert initrd.is_file() and initrd.stat().st_size > 1 << 20, "no initrd: postinst hooks"
    assert (installed_root / f"lib/modules/{release}/modules.dep").stat().st_size > 0
    config = (installed_root / f"boot/config-{release}").read_text()
    assert "CONFIG_KSM=y" in config and 'CONFIG_LOCALVERSION="-pageshare-cloud-amd64"' in config


def test_boots_and_runs_the_series_selftest(
    package: dict[str, object], installed_root: Path, tmp_path: Path
) -> None:
    release = str(package["release"])
    tests = installed_root / "usr/local/lib/pageshare-test"
    tests.mkdir(parents=True)
    shutil.copy2(_test_binaries(tmp_path / "bin"), tests / "merge_page_tests")
    (tests / "check.sh").write_text(CHECK_SCRIPT)
    (tests / "check.sh").chmod(0o755)
    (installed_root / "etc/systemd/system/pageshare-kpkg-check.service").write_text(CHECK_UNIT)
    wants = installed_root / "etc/systemd/system/multi-user.target.wants"
    wants.mkdir(parents=True, exist_ok=True)
    (wants / "pageshare-kpkg-check.service").symlink_to(
        "/etc/systemd/system/pageshare-kpkg-check.service"
    )
    # The report goes to ttyS0: no getty there, whose vhangup() would cut it off.
    (installed_root / "etc/systemd/system/serial-getty@ttyS0.service").symlink_to("/dev/null")
    (installed_root / "etc/fstab").write_text(f"UUID={ROOT_UUID}\t/\text4\tdefaults\t0\t1\n")
    (installed_root / "etc/hostname").write_text("pageshare-kpkg\n")
    kernel, initrd = tmp_path / "vmlinuz", tmp_path / "initrd.img"
    shutil.copyfile(installed_root / f"boot/vmlinuz-{release}", kernel)
    shutil.copyfile(installed_root / f"boot/initrd.img-{release}", initrd)
    disk = tmp_path / "disk.raw"
    golden._make_ext4(installed_root, disk, 2 << 30, ROOT_UUID)
    log = boot_until(
        [
            "-m",
            "2048",
            "-smp",
            "2",
            # two NUMA nodes, for the selftest's migration case
            "-object",
            "memory-backend-ram,id=m0,size=1G",
            "-numa",
            "node,memdev=m0,cpus=0",
            "-object",
            "memory-backend-ram,id=m1,size=1G",
            "-numa",
            "node,memdev=m1,cpus=1",
            "-kernel",
            str(kernel),
            "-initrd",
            str(initrd),
            "-append",
            f"console=ttyS0 root=UUID={ROOT_UUID} ro",
            "-drive",
            f"file={disk},if=virtio,format=raw",
            "-netdev",
            "user,id=n0",
            "-device",
            "virtio-net-pci,netdev=n0",
        ],
        tmp_path / "serial.log",
        DONE,
        1500,
    )
    assert f"Linux version {release}" in log, log[-3000:]
    assert f"uname: {release}" in log, log[-3000:]
    assert "modprobe virtio_net: ok" in log and "swap: on" in log
    m = re.search(rf"{DONE} rc=(\d+)", log)
    assert m and m.group(1) == "0", log[-6000:]
    tap = re.search(r"# Totals: pass:(\d+) fail:(\d+) xfail:\d+ xpass:\d+ skip:(\d+)", log)
    assert tap and int(tap.group(1)) > 30 and tap.group(2) == "0", log[-6000:]
    # One case needs the kernel's gup_test, a test-only facility Debian's
    # configuration leaves out: that skip, and only that one, is expected.
    skips = re.findall(r"^ok \d+ # SKIP (.*)$", log, re.M)
    # Debian's configuration has no CONFIG_GUP_TEST, which the two cases
    # that pin pages long-term need; the tests' own kernels run them.
    assert sorted(skips) == [
        "long-term pinned dst: EBUSY (no gup_test)",
        "merge_pages: pinned page in a run (no gup_test)",
    ], skips
    config = (installed_root / f"boot/config-{release}").read_text()
    assert "# CONFIG_GUP_TEST is not set" in config
    before = dict(re.findall(r"^before (merge_page_\w+) (\d+)", log, re.M))
    after = dict(re.findall(r"^after (merge_page_\w+) (\d+)", log, re.M))
    assert set(before) >= {"merge_page_merged", "merge_page_failed", "merge_page_sources"}
    assert int(after["merge_page_merged"]) > int(before["merge_page_merged"])
    print(json.dumps({k: package[k] for k in ("release", "version", "build_seconds")}))


GRUB_ROOT_UUID = "5b0d9a62-3f7e-4c1a-9d28-7e6f0a4c2b91"
GRUB_DONE = "PAGESHARE-GRUB-DONE"
# 10_linux's menu, GRUB's own output and the kernels' consoles on ttyS0.
GRUB_SETTINGS = """GRUB_DEFAULT=0
GRUB_TIMEOUT=1
GRUB_DISTRIBUTOR="Debian"
GRUB_CMDLINE_LINUX_DEFAULT=""
GRUB_CMDLINE_LINUX="console=ttyS0"
GRUB_TERMINAL=serial
GRUB_SERIAL_COMMAND="serial --unit=0 --speed=115200"
GRUB_DISABLE_OS_PROBER=true
"""
GRUB_CHECK_SCRIPT = f"""#!/bin/sh
exec > /dev/ttyS0 2>&1
echo "uname: $(uname -r)"
ls /sys/kernel/mm/ksm/merge_page_merged >/dev/null 2>&1 && echo "series: yes"
echo "{GRUB_DONE}"
systemctl --no-block poweroff
"""


def one_partition_disk(fs: Path, disk: Path, label: str, kind: str) -> None:
    """DISK: a partition table (sfdisk's LABEL, "dos" or "gpt") with one
    partition of type KIND at 1 MiB holding the file system image FS, which
    is removed.  1 MiB after it for a GPT's backup header."""
    size = fs.stat().st_size
    with disk.open("wb") as f:
        f.truncate(size + (2 << 20))
    subprocess.run(
        ["sfdisk", "-q", "--no-reread", "--no-tell-kernel", str(disk)],
        input=f"label: {label}\nstart=2048, size={size // 512}, {kind}\n",
        text=True,
        check=True,
    )
    golden._copy_sparse(fs, disk, 1 << 20)
    fs.unlink()


def grub_entries(cfg: str) -> list[str]:
    """The kernels of grub.cfg's menu entries, in its order."""
    return re.findall(r"^\s*linux\s+/boot/vmlinuz-(\S+)", cfg, re.M)


def test_grub_boots_it_over_a_newer_debian_kernel(
    package: dict[str, object], tmp_path: Path
) -> None:
    """A BIOS disk whose own GRUB (Debian 13's grub-pc, installed with
    grub-install, its menu written by update-grub) boots with no -kernel:
    beside the pageshare kernel is a Debian kernel that 10_linux lists first
    (trixie-backports' cloud kernel, a later release), so GRUB_DEFAULT=0
    would boot Debian's; pageshare-host's grub.d file makes the pageshare
    kernel the default, and GRUB boots it."""
    from pageshare.golden.host import appliance

    release = str(package["release"])
    image = deb(package, "image")
    snippet = REPO / "packaging/pageshare-host/grub.d/pageshare-kernel.cfg"
    rootdir = tmp_path / "root"
    check = tmp_path / "check.sh"
    check.write_text(GRUB_CHECK_SCRIPT)
    unit = tmp_path / "check.service"
    unit.write_text(CHECK_UNIT.replace("/usr/local/lib/pageshare-test/check.sh", "/check.sh"))
    settings = tmp_path / "grub"
    settings.write_text(GRUB_SETTINGS)
    backports = f"deb {debian.MIRROR} trixie-backports main"
    proc = subprocess.run(
        [
            "mmdebstrap",
            "--mode=root",
            "--variant=required",
            "--include=systemd-sysv,udev,kmod,initramfs-tools,grub-pc",
            # the operator's install of the pageshare kernel and of pageshare-host's file
            f"--customize-hook=copy-in {image} /tmp",
            f'--customize-hook=chroot "$1" apt-get install -y /tmp/{image.name}',
            f'--customize-hook=rm "$1/tmp/{image.name}"',
            '--customize-hook=mkdir -p "$1/etc/default/grub.d"',
            f'--customize-hook=cp {snippet} "$1/etc/default/grub.d/pageshare-kernel.cfg"',
            # then a Debian kernel that sorts first
            '--customize-hook=chroot "$1" apt-get install -y -t trixie-backports '
            "linux-image-cloud-amd64",
            f'--customize-hook=cp {settings} "$1/etc/default/grub"',
            f'--customize-hook=cp {check} "$1/check.sh"',
            f'--customize-hook=cp {unit} "$1/etc/systemd/system/pageshare-grub-check.service"',
            '--customize-hook=chroot "$1" systemctl enable pageshare-grub-check.service',
            '--customize-hook=chroot "$1" systemctl mask serial-getty@ttyS0.service',
            "trixie",
            str(rootdir),
            *debian.sources(["trixie"]),
            backports,
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    (rootdir / "check.sh").chmod(0o755)
    (rootdir / "etc/fstab").write_text(f"UUID={GRUB_ROOT_UUID}\t/\text4\tdefaults\t0\t1\n")
    debian_kernels = [
        p.name.removeprefix("vmlinuz-")
        for p in (rootdir / "boot").glob("vmlinuz-*")
        if "-pageshare-" not in p.name
    ]
    assert len(debian_kernels) == 1, debian_kernels

    # One MBR partition at 1 MiB (GRUB's core image goes in the gap before it).
    fs, disk = tmp_path / "root.ext4", tmp_path / "disk.raw"
    golden._make_ext4(rootdir, fs, 3 << 30, GRUB_ROOT_UUID)
    shutil.rmtree(rootdir)
    one_partition_disk(fs, disk, "dos", "type=83, bootable")
    with appliance(disk) as g:
        g.mount("/dev/sda1", "/")
        g.command(["grub-install", "--target=i386-pc", "/dev/sda"])
        mkconfig = g.sh("update-grub 2>&1")
        cfg = g.cat("/boot/grub/grub.cfg")
    print(mkconfig)
    assert "pageshare: GRUB_DEFAULT=" in mkconfig and release in mkconfig, mkconfig
    entries = grub_entries(cfg)
    # The test means something only if Debian's kernel comes first.
    assert entries and entries[0] == debian_kernels[0], entries
    assert release in entries, entries
    # 00_header's default: the literal one, not "${next_entry}" (grub-reboot's).
    defaults = [d for d in re.findall(r'^\s*set default="([^"]*)"', cfg, re.M) if "$" not in d]
    assert len(defaults) == 1, defaults
    assert f"gnulinux-{release}-advanced-{GRUB_ROOT_UUID}" in defaults[0], defaults

    # No -kernel: SeaBIOS, then the disk's GRUB.
    log = boot_until(
        ["-m", "1024", "-drive", f"file={disk},if=virtio,format=raw"],
        tmp_path / "serial.log",
        GRUB_DONE,
        900,
    )
    # GRUB's own words on the serial line, then the kernel's, then the unit's.
    assert f"Booting `Debian GNU/Linux, with Linux {release}'" in log, log[-3000:]
    assert f"Loading Linux {release}" in log, log[-3000:]
    assert f"uname: {release}" in log and "series: yes" in log, log[-3000:]
    print(json.dumps({"grub_entries": entries, "booted": release}))


SB_ROOT_UUID = "8e3f1c52-6a0d-4b7e-9f13-2c5d8a7b4e06"
SB_DONE = "PAGESHARE-SB-DONE"
# shim's GUID: the owner of MokList entries (shim's lib/guid.c, SHIM_LOCK_GUID)
SHIM_LOCK_GUID = "605dab50-e046-4300-abb6-3dd810dd8b23"
OVMF = Path("/usr/share/OVMF")
MODULE_SIG_MAGIC = b"~Module signature appended~\n"
SB_CHECK_SCRIPT = f"""#!/bin/sh
exec > /dev/ttyS0 2>&1
echo "uname: $(uname -r)"
echo "sb-state: $(mokutil --sb-state 2>&1)"
echo "lockdown: $(cat /sys/kernel/security/lockdown)"
mokutil --list-enrolled 2>&1 | grep 'Subject:' | sed 's/^ */mok: /'
modprobe dummy && echo "signed module: loaded" && rmmod dummy
if insmod /root/dummy-unsigned.ko 2>/tmp/insmod.err; then
    echo "unsigned module: loaded"
else
    echo "unsigned module: refused: $(cat /tmp/insmod.err)"
fi
dmesg | grep -iE 'secure ?boot|lockdown|X.509|rejected' | sed 's/^/dmesg: /'
echo "{SB_DONE}"
systemctl --no-block poweroff
"""


def without_module_signature(ko: bytes) -> bytes:
    """A module's bytes with its appended signature cut off (the signature,
    then struct module_signature, 12 bytes ending in the signature's length,
    big-endian, then the magic string)."""
    assert ko.endswith(MODULE_SIG_MAGIC), "the module is not signed"
    end = len(ko) - len(MODULE_SIG_MAGIC)
    sig_len = int.from_bytes(ko[end - 4 : end], "big")
    return ko[: end - 12 - sig_len]


def esp_disk(tree: Path, disk: Path) -> None:
    """DISK: a GPT with one EFI system partition (64 MiB, at 1 MiB) holding TREE."""
    from pageshare.golden.filesystems import _make_vfat

    fs = disk.with_suffix(".vfat")
    _make_vfat(tree, fs, 64 << 20, "5EC0-B007", "ESP")
    one_partition_disk(fs, disk, "gpt", "type=U")


def sb_grub_cfg(kernel: str) -> str:
    """What Debian's signed GRUB reads first: $prefix/grub.cfg, its prefix
    /EFI/debian on the disk it started from (no menu: the one kernel)."""
    return (
        "serial --unit=0 --speed=115200\nterminal_input serial console\n"
        "terminal_output serial console\n"
        f"search --no-floppy --fs-uuid --set=root {SB_ROOT_UUID}\n"
        f"echo 'Loading Linux {kernel} ...'\n"
        f"linux /boot/vmlinuz-{kernel} root=UUID={SB_ROOT_UUID} ro console=ttyS0\n"
        f"initrd /boot/initrd.img-{kernel.removesuffix('.unsigned')}\nboot\n"
    )


def test_secure_boot_boots_the_kernel_signed_as_docs_install_says(
    package: dict[str, object], tmp_path: Path
) -> None:
    """docs/install.md's Secure Boot steps, followed: the image signed with
    `sbsign` by the key the modules are signed with, its certificate in
    shim's MOK list; OVMF with Secure Boot on (Microsoft's keys, which sign
    Debian's shim), shim and Debian's signed GRUB from the ESP's removable
    path.  The kernel boots, locked down, loads a module the package signed
    and refuses one whose signature was cut off; the same disk with the
    unsigned image stops in GRUB.  What MokManager does at the boot after
    `mokutil --import` (write the certificate into MokList once a person
    confirms it) is done to the firmware's variables with virt-fw-vars."""
    release = str(package["release"])
    image = deb(package, "image")
    key = kernel_deb.signing_key(kernel_deb.pkg_root(), None)
    assert kernel_deb.cert_sha256(key) == package["signing_cert_sha256"]
    crt = tmp_path / "sb.crt"
    subprocess.run(["openssl", "x509", "-in", str(key), "-out", str(crt)], check=True)
    check = tmp_path / "check.sh"
    check.write_text(SB_CHECK_SCRIPT)
    unit = tmp_path / "check.service"
    unit.write_text(CHECK_UNIT.replace("/usr/local/lib/pageshare-test/check.sh", "/check.sh"))
    rootdir = tmp_path / "root"
    vmlinuz = f"/boot/vmlinuz-{release}"
    proc = subprocess.run(
        [
            "mmdebstrap",
            "--mode=root",
            "--variant=required",
            "--include=systemd-sysv,udev,kmod,initramfs-tools,mokutil,sbsigntool,"
            "shim-signed,grub-efi-amd64-signed",
            f"--customize-hook=copy-in {image} /tmp",
            f'--customize-hook=chroot "$1" apt-get install -y /tmp/{image.name}',
            f'--customize-hook=rm "$1/tmp/{image.name}"',
            # docs/install.md: after every install of the kernel package, sign its image
            f'--customize-hook=cp "$1{vmlinuz}" "$1{vmlinuz}.unsigned"',
            f"--customize-hook=copy-in {key} {crt} /root",
            f'--customize-hook=chroot "$1" sbsign --key /root/{key.name} --cert /root/{crt.name}'
            f" --output {vmlinuz} {vmlinuz}",
            f'--customize-hook=chroot "$1" sbverify --cert /root/{crt.name} {vmlinuz}',
            f'--customize-hook=rm "$1/root/{key.name}" "$1/root/{crt.name}"',
            f'--customize-hook=cp {check} "$1/check.sh"',
            f'--customize-hook=cp {unit} "$1/etc/systemd/system/pageshare-sb-check.service"',
            '--customize-hook=chroot "$1" systemctl enable pageshare-sb-check.service',
            '--customize-hook=chroot "$1" systemctl mask serial-getty@ttyS0.service',
            "trixie",
            str(rootdir),
            *debian.sources(["trixie"]),
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert not list((rootdir / "root").glob("*.pem")), "the private key stayed in the root"
    (rootdir / "check.sh").chmod(0o755)
    (rootdir / "etc/fstab").write_text(f"UUID={SB_ROOT_UUID}\t/\text4\tdefaults\t0\t1\n")
    dummy = next(rootdir.glob(f"lib/modules/{release}/kernel/drivers/net/dummy.ko.xz"))
    signed = subprocess.run(["xz", "-dc", str(dummy)], capture_output=True, check=True).stdout
    (rootdir / "root/dummy-unsigned.ko").write_bytes(without_module_signature(signed))
    # the ESP, as Debian's grub-install --removable lays it out with shim
    esp = tmp_path / "esp"
    (esp / "EFI/BOOT").mkdir(parents=True)
    (esp / "EFI/debian").mkdir(parents=True)
    shutil.copyfile(rootdir / "usr/lib/shim/shimx64.efi.signed", esp / "EFI/BOOT/BOOTX64.EFI")
    shutil.copyfile(
        rootdir / "usr/lib/grub/x86_64-efi-signed/grubx64.efi.signed",
        esp / "EFI/BOOT/grubx64.efi",
    )
    (esp / "EFI/debian/grub.cfg").write_text(sb_grub_cfg(release))
    esp_signed = tmp_path / "esp-signed.raw"
    esp_disk(esp, esp_signed)
    (esp / "EFI/debian/grub.cfg").write_text(sb_grub_cfg(f"{release}.unsigned"))
    esp_unsigned = tmp_path / "esp-unsigned.raw"
    esp_disk(esp, esp_unsigned)
    root = tmp_path / "root.ext4"
    golden._make_ext4(rootdir, root, 3 << 30, SB_ROOT_UUID)
    shutil.rmtree(rootdir)

    # the firmware's variables: Microsoft's keys, Secure Boot on, and the
    # certificate in MokList as MokManager leaves it
    vars_fd = tmp_path / "OVMF_VARS.fd"
    tool = Path(sys.executable).parent / "virt-fw-vars"
    subprocess.run(
        [
            str(tool),
            "--input",
            str(OVMF / "OVMF_VARS_4M.ms.fd"),
            "--output",
            str(vars_fd),
            "--add-mok",
            SHIM_LOCK_GUID,
            str(crt),
        ],
        check=True,
        capture_output=True,
    )

    def firmware(esp_disk_path: Path, root_opts: str, nvram: Path = vars_fd) -> list[str]:
        return [
            "-machine",
            "smm=on",
            "-global",
            "driver=cfi.pflash01,property=secure,value=on",
            "-drive",
            f"if=pflash,format=raw,unit=0,readonly=on,file={OVMF / 'OVMF_CODE_4M.secboot.fd'}",
            "-drive",
            f"if=pflash,format=raw,unit=1,file={nvram}",
            "-m",
            "1024",
            "-drive",
            f"file={esp_disk_path},if=virtio,format=raw",
            "-drive",
            f"file={root},if=virtio,format=raw{root_opts}",
        ]

    log = boot_until(firmware(esp_signed, ""), tmp_path / "serial.log", SB_DONE, 1200)
    assert f"uname: {release}" in log, log[-4000:]
    assert "sb-state: SecureBoot enabled" in log, log[-4000:]
    assert "lockdown: none [integrity] confidentiality" in log, log[-4000:]
    # shim copied MokList to MokListRT (after its own vendor certificate),
    # which mokutil reads and the kernel loads its certificates from
    cn = "pageshare kernel module signing key"
    mok = [m.strip() for m in re.findall(r"^mok: .*CN ?= ?([^,/\n]+)", log, re.M)]
    assert cn in mok, log[-4000:]
    loaded = re.search(rf"UEFI:MokListRT.*\n[^\n]*integrity: Loaded X.509 cert '{cn}: ", log)
    assert loaded, log[-4000:]
    assert "signed module: loaded" in log, log[-4000:]
    # Debian's lockdown enforces module signatures: an unsigned one is rejected
    assert "unsigned module: refused" in log and "Key was rejected by service" in log, log[-4000:]
    assert "Loading of unsigned module is rejected" in log, log[-4000:]

    # The same chain refuses the image as the package ships it.
    log = boot_until(
        firmware(esp_unsigned, ",snapshot=on"),
        tmp_path / "serial-unsigned.log",
        "bad shim signature",
        600,
        exits=False,
    )
    assert f"Loading Linux {release}.unsigned" in log, log[-4000:]
    assert "bad shim signature" in log, log[-4000:]
    assert "EFI stub" not in log and "Linux version" not in log, log[-4000:]

    # The signed image, but its certificate not enrolled: refused too, so
    # the MOK entry is what let it boot.
    no_mok = tmp_path / "OVMF_VARS-no-mok.fd"
    shutil.copyfile(OVMF / "OVMF_VARS_4M.ms.fd", no_mok)
    log = boot_until(
        firmware(esp_signed, ",snapshot=on", no_mok),
        tmp_path / "serial-no-mok.log",
        "bad shim signature",
        600,
        exits=False,
    )
    assert f"Loading Linux {release} ..." in log, log[-4000:]
    assert "bad shim signature" in log, log[-4000:]
    assert "EFI stub" not in log and "Linux version" not in log, log[-4000:]
    print(json.dumps({"secure_boot": "enabled", "booted": release}))
