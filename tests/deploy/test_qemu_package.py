"""The pageshare-qemu package (packaging/debs.py): its inputs from outside
the checkout count in the cache key, its version follows the QEMU it
packages, and the built .deb (the real one: the patched QEMU is built
first if needed) is lintian-clean and holds what it should, all of it
under its own prefix, clear of every path of Debian's QEMU packages.
Installing and running it: tests/deploy/test_qemu_package_guest.py."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path, PurePosixPath

import debs
import pytest
from pageshare.host import hostcheck

pytestmark = pytest.mark.build

REPO = Path(__file__).resolve().parents[2]
LIB = "usr/lib/pageshare-qemu"
BINARIES = ["qemu-system-x86_64", "qemu-img", "qemu-io", "qemu-nbd", "qemu-storage-daemon"]
ROMS = [
    "linuxboot.bin",
    "linuxboot_dma.bin",
    "multiboot.bin",
    "multiboot_dma.bin",
    "kvmvapic.bin",
    "pvh.bin",
]


def test_key_follows_the_qemu_build(tmp_path: Path) -> None:
    """Files from outside the checkout (the patched QEMU's binaries) are
    inputs like the checkout's own."""
    qemu = tmp_path / "qemu"
    (qemu / "bin").mkdir(parents=True)
    for b in BINARIES:
        (qemu / "bin" / b).write_text(b)
    pkg = dataclasses.replace(
        debs.PACKAGES["pageshare-qemu"],
        external=lambda source: {f"qemu/bin/{b}": qemu / "bin" / b for b in BINARIES},
    )
    key, inputs = debs.inputs_key(pkg, REPO)
    assert "external:qemu/bin/qemu-system-x86_64" in inputs["files"]
    assert "packaging/pageshare-qemu/debian/rules" in inputs["files"]
    (qemu / "bin" / "qemu-storage-daemon").write_text("rebuilt")
    assert debs.inputs_key(pkg, REPO)[0] != key


def test_version_is_debian_qemus_with_the_revision(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    shutil.copytree(REPO / "packaging/pageshare-qemu/debian", tree / "debian")
    (tree / "qemu").mkdir()
    info = tree / "qemu" / "info.json"
    info.write_text(json.dumps({"version": "1:10.0.13+ds-0+deb13u2"}))
    debs._qemu_prepare(tree)
    assert re.fullmatch(
        r"10\.0\.13\+ds\.0\+deb13u2\+pageshare\d+", debs.changelog_version(tree / "debian")
    )
    # A newer Debian revision or upstream release sorts higher: hosts upgrade.
    older = "10.0.13+ds.0+deb13u1+pageshare1"
    newer = debs.changelog_version(tree / "debian")
    assert subprocess.run(["dpkg", "--compare-versions", newer, "gt", older]).returncode == 0
    shutil.copy2(REPO / "packaging/pageshare-qemu/debian/changelog", tree / "debian")
    info.write_text(json.dumps({"version": "1:10.1.0+ds-1"}))
    with pytest.raises(debs.BuildError, match=r"must be 10\.0\.x"):
        debs._qemu_prepare(tree)


def test_pageshare_server_accepts_pageshare_qemu() -> None:
    control = (REPO / "packaging/pageshare-server/debian/control").read_text()
    depends = re.search(r"^Depends: (.*)$", control, re.M)
    assert depends
    (qsd,) = [d for d in depends.group(1).split(", ") if "qemu" in d]
    assert [a.split()[0] for a in qsd.split(" | ")] == [
        "qemu-utils",
        "qemu-system-common",
        "pageshare-qemu",
    ]


@pytest.fixture(scope="module")
def built() -> Path:
    """The real .deb (cached; builds the patched QEMU first if needed)."""
    p = subprocess.run(
        [sys.executable, str(REPO / "packaging/debs.py"), "--json", "pageshare-qemu"],
        capture_output=True,
        text=True,
        timeout=3600,
    )
    assert p.returncode == 0, f"{p.stdout}\n{p.stderr[-4000:]}"
    return Path(json.loads(p.stdout)["built"]["pageshare-qemu"])


def test_deb_is_lintian_clean(built: Path) -> None:
    text = (built.parent / "lintian.txt").read_text()
    assert not re.search(r"^[EW]: ", text, re.M), text
    # And lintian says so again on the .deb alone.
    p = subprocess.run(
        ["lintian", "--fail-on", "error,warning", str(built)], capture_output=True, text=True
    )
    assert p.returncode == 0, p.stdout + p.stderr


def deb_entries(deb: Path) -> dict[str, str]:
    """Path -> "file", "dir" or "-> target" (symlinks)."""
    p = subprocess.run(["dpkg-deb", "-c", str(deb)], check=True, capture_output=True, text=True)
    out = {}
    for line in p.stdout.splitlines():
        mode, rest = line[0], line.split(None, 5)[5]
        path, _, target = rest.partition(" -> ")
        path = path.removeprefix("./").rstrip("/")
        if path:
            out[path] = {"d": "dir", "-": "file", "l": f"-> {target}"}[mode]
    return out


def test_deb_contents(built: Path, tmp_path: Path) -> None:
    entries = deb_entries(built)
    own = re.compile(
        rf"^(usr|usr/(bin|lib|share|share/doc|share/man|share/man/man1)|"
        rf"{LIB}(/.*)?|usr/bin/pageshare-qemu-[\w-]+|"
        r"usr/share/doc/pageshare-qemu(/.*)?|"
        r"usr/share/man/man1/pageshare-qemu[\w-]*\.1\.gz)$"
    )
    assert [p for p in entries if not own.match(p)] == []
    files = {p for p, kind in entries.items() if kind == "file"}
    assert {f"{LIB}/bin/{b}" for b in BINARIES} | {f"{LIB}/share/qemu/{r}" for r in ROMS} <= files

    # Links: the commands, the manual pages, SeaBIOS and iPXE for both suites.
    def target(path: str) -> str:
        link = entries[path].removeprefix("-> ")
        return os.path.normpath(PurePosixPath("/" + path).parent / link)

    links = {p: target(p) for p, kind in entries.items() if kind.startswith("->")}
    for b in BINARIES:
        assert links.pop(f"usr/bin/pageshare-{b}") == f"/{LIB}/bin/{b}"
        assert (
            links.pop(f"usr/share/man/man1/pageshare-{b}.1.gz")
            == "/usr/share/man/man1/pageshare-qemu.1.gz"
        )
    firmware = {
        PurePosixPath(p).name: t for p, t in links.items() if p.startswith(f"{LIB}/share/qemu/")
    }
    assert firmware["bios-256k.bin"] == "/usr/share/seabios/bios-256k.bin"
    assert firmware["efi-virtio.rom"] == "/usr/lib/ipxe/qemu/efi-virtio.rom"  # Debian 12
    assert (
        links[f"{LIB}/share/qemu-firmware/efi-virtio.rom"] == "/usr/share/qemu/efi-virtio.rom"
    )  # Debian 13
    assert all(
        t.startswith(("/usr/share/seabios/", "/usr/lib/ipxe/qemu/", "/usr/share/qemu/"))
        for p, t in links.items()
        if p.startswith(f"{LIB}/share/")
    ), links
    # Where this host has SeaBIOS and Debian 12's iPXE, every such link resolves.
    for name, t in firmware.items():
        if Path(t).parent.is_dir():
            assert Path(t).exists(), (name, t)

    # What is installed: stripped binaries, option ROMs with their signature.
    root = tmp_path / "root"
    subprocess.run(["dpkg-deb", "-x", str(built), str(root)], check=True)
    for b in BINARIES:
        kind = subprocess.run(
            ["file", "-b", str(root / LIB / "bin" / b)], check=True, capture_output=True, text=True
        ).stdout
        assert "ELF 64-bit" in kind and ", stripped" in kind, (b, kind)
    for r in ROMS:
        rom = (root / LIB / "share/qemu" / r).read_bytes()
        assert rom[:2] == b"\x55\xaa" and len(rom) % 512 == 0 and sum(rom) % 256 == 0, r
    # The installed binary says which QEMU it is, and has the filter.
    assert (
        "pageshare"
        in subprocess.run(
            [str(root / LIB / "bin/qemu-img"), "--help"], capture_output=True, text=True
        ).stdout
    )


def test_no_path_of_debian_qemu(built: Path) -> None:
    """Nothing the package installs is a path of Debian's QEMU packages (those
    installed on this Debian 12 host), so it installs beside them."""
    debian = subprocess.run(
        [
            "dpkg-query",
            "-L",
            "qemu-system-x86",
            "qemu-system-common",
            "qemu-system-data",
            "qemu-utils",
        ],
        capture_output=True,
        text=True,
    )
    if debian.returncode != 0:
        pytest.skip("Debian's QEMU packages are not installed here")
    theirs = {p.lstrip("/") for p in debian.stdout.split()}
    ours = {p for p, kind in deb_entries(built).items() if kind != "dir"}
    assert ours & theirs == set()
    control = subprocess.run(
        [
            "dpkg-deb",
            "-f",
            str(built),
            "Depends",
            "Conflicts",
            "Replaces",
            "Breaks",
            "Provides",
            "Version",
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert not re.search(r"^(Conflicts|Replaces|Breaks|Provides):", control, re.M), control
    depends = re.search(r"^Depends: (.*)$", control, re.M)
    assert depends
    names = {d.split()[0] for d in depends.group(1).split(", ")}
    assert {"seabios", "ipxe-qemu", "libglib2.0-0", "libpixman-1-0"} <= names
    assert not {n for n in names if n.startswith("qemu")}, names
    assert re.search(r"^Version: 10\.0\.\d+\S*\+pageshare\d+$", control, re.M), control


def test_host_check_finds_the_packaged_qemu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`pageshare host check` looks in pageshare-qemu's bin/ as well as on PATH."""
    assert Path(f"/{LIB}/bin") == hostcheck.PACKAGE_QEMU_BIN
    package_bin = tmp_path / "bin"
    package_bin.mkdir()
    for b in BINARIES:
        (package_bin / b).write_text("#!/bin/sh\n")
        (package_bin / b).chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    found = hostcheck.qemu_binaries([], package_bin=package_bin)
    assert found == [str(package_bin / "qemu-img"), str(package_bin / "qemu-system-x86_64")]
    assert hostcheck.qemu_binaries([], use_path=False, package_bin=package_bin) == []
