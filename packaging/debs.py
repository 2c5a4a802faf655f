#!/usr/bin/env python3
"""Build pageshare's Debian packages, cached by a hash of their inputs.

    packaging/debs.py                    # every package; prints each .deb's path
    packaging/debs.py pageshare-server   # just that one
    packaging/debs.py pageshare-qemu     # the patched QEMU (builds it first if needed)
    packaging/debs.py --json pageshare-server
    packaging/debs.py --force --check pageshare-server   # rebuild, run cargo test too

Packages (``--list``):

- ``pageshare-host``: the host tools, for every hypervisor: ``/usr/bin/pageshare``
  (host check, attach/detach, libvirt-watch, libvirt-hook) with only their
  modules (``HOST_MODULES``: the package's ``cli``, ``errors`` and the ``host``
  subpackage, standard library only: the build runs each
  command's ``--help`` from that tree and refuses an import of drgn,
  libguestfs or redis) in ``/usr/lib/pageshare/python``, manual page made by
  help2man from ``--help``, and ``pageshare-libvirt-watch.service``,
  enabled but run only where libvirtd and python3-libvirt are installed,
  the libvirt qemu hook ``/etc/libvirt/hooks/qemu.d/pageshare`` (the filter
  on a live migration's destination; the postinst reloads a running
  libvirtd, which looks for hooks only when it starts or reloads), their
  configuration ``/etc/pageshare/libvirt.toml`` (every key commented out:
  the defaults) and the AppArmor parts the operator includes in libvirt's
  profiles: ``/etc/apparmor.d/abstractions/pageshare-qemu`` (libvirt's
  QEMU: pageshare-qemu and the page server's sockets) and
  ``/etc/apparmor.d/abstractions/pageshare-libvirtd`` (libvirtd: executing
  pageshare-qemu); the grub-mkconfig snippet
  ``/etc/default/grub.d/pageshare-kernel.cfg``, which makes the newest
  pageshare kernel GRUB's default entry at every update-grub (the postinst
  runs update-grub where one is installed; ``make kernel-package``'s
  linux-image packages cannot ship it: two releases installed side by side
  would both own the file); and the operator's guide, ``docs/install.md``, beside
  the README in ``/usr/share/doc/pageshare-host``.  Architecture all,
  Depends python3 only.
- ``pageshare``: the analyzer, for the machine that analyzes images:
  ``analyze-image`` (a link to pageshare-host's ``/usr/bin/pageshare``,
  on which it depends, same version), the analyzer's modules (every module
  but the host tools') beside the host tools' in ``python/``, and drgn,
  redis and async-timeout from PyPI wheels pinned by hash in
  ``packaging/pageshare/requirements.txt``, one copy per Python version in
  ``python3.11/`` and ``python3.13/``, since drgn is compiled and Debian
  12's python3-drgn cannot read 6.12 kernels), the crash extension
  ``pagescan.so`` built at package build time with the crash version it was
  built for (``datafiles.py`` refuses it under another crash), the results
  notebooks in ``/usr/share/pageshare/notebooks`` (``pageshare report``) and
  analyze-image's manual page.  The wheels are downloaded before the build
  (into the source tree's ``vendor/``, pip's cache in the package cache),
  so dpkg-buildpackage runs offline.  Both packages' versions are
  ``pageshare.__version__`` (checked).
- ``pageshare-server``: ``/usr/bin/pageshare-server``, its systemd unit
  (``page-server/pageshare-server.service``, enabled on install but with
  ``ConditionPathExists=/etc/pageshare/server.toml``, so nothing runs until
  the operator writes the configuration), the example configuration as the
  conffile ``/etc/pageshare/server.example.toml``, the host settings KSM
  ``run`` = 1 and khugepaged ``max_ptes_shared`` = 0 at boot
  (``/usr/lib/tmpfiles.d/pageshare-server.conf``), a manual page and the
  README and protocol in ``/usr/share/doc/pageshare-server``.  The service
  runs as root with the capability bounding set the unit names
  (``CAP_DAC_READ_SEARCH``): no system user is created.  Its
  qemu-storage-daemon: Debian's (``qemu-utils`` on Debian 13,
  ``qemu-system-common`` on 12) or ``pageshare-qemu``'s.
- ``pageshare-qemu``: the patched QEMU of ``qemu-patches/build.py`` (run
  first; its binaries and its work tree are this package's inputs, outside
  the checkout) under its own prefix, ``/usr/lib/pageshare-qemu``:
  ``bin/`` holds qemu-system-x86_64, qemu-img, qemu-io, qemu-nbd and
  qemu-storage-daemon (stripped; symbols stay in the build cache),
  ``share/qemu`` (where the relocatable build looks, next to ``bin/``) the
  x86 option ROMs built from the same QEMU source and links to Debian's
  SeaBIOS and iPXE (``Depends: seabios, ipxe-qemu``; iPXE's ROMs are in
  ``/usr/lib/ipxe/qemu`` on Debian 12 and ``/usr/share/qemu`` on 13, so
  ``share/qemu-firmware``, which QEMU searches too, links the latter), and
  ``/usr/bin/pageshare-qemu-*`` link to the binaries.  No file of Debian's
  QEMU packages is replaced, diverted or written, so it installs beside
  ``qemu-system-x86``/``qemu-utils`` (or without them) and VMs use it only
  where an operator names it: a libvirt domain's
  ``<emulator>/usr/lib/pageshare-qemu/bin/qemu-system-x86_64</emulator>``,
  or a script's command.  Its version is Debian's QEMU version with
  ``+pageshare<N>`` (``debian/changelog``'s revision: bump it when the
  series changes), so a rebuild on a newer Debian QEMU upgrades hosts.
  Built on Debian 12 against its libc, GLib, pixman, zlib and zstd, it also
  installs and runs on Debian 13, whose ``libglib2.0-0t64`` provides
  ``libglib2.0-0``.

How a package is built: its source tree is assembled in a scratch
directory from the checkout (``--source``, default the checkout this
script is in) plus ``packaging/<package>/debian/``, and built with
``dpkg-buildpackage -b`` (debhelper compat 13); then ``lintian`` must report
no error and no warning (justified exceptions live in the package's
``debian/*.lintian-overrides``), and the .deb's contents are checked (the
unit's ExecStart binary, the conffile).  The result is stored in
``${PAGESHARE_CACHE:-~/.cache/pageshare}/packages/<package>/<key>/`` with the
build and lintian logs, where key hashes every input file, this script and
the versions of the tools (rustc, cargo, dpkg-dev, debhelper, lintian) and,
for a package with inputs outside the checkout (``pageshare-qemu``), those
files.  A
warm run finds ``<key>/stamp`` and prints the cached path.  Nothing is
written to the checkout.

Rust comes from the cargo on PATH or ``~/.cargo/bin`` (Debian 12's cargo is
too old for the crates in Cargo.lock); its target directory is kept in the
cache, so a rebuild after a source change compiles only what changed.
"""

from __future__ import annotations

import argparse
import fcntl
import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

from pageshare import cache
from pageshare.cli import HOST_PACKAGE, HOST_TOP_MODULES
from pageshare_tools.cargo import cargo

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

CACHE = cache.cache_root() / "packages"
# What pageshare-host ships of the Python package (paths under pageshare/):
# the top-level modules its command needs, and the host subpackage whole.
HOST_MODULES = (
    *(f"{m}.py" for m in HOST_TOP_MODULES),
    *sorted(
        f"{HOST_PACKAGE}/{f.name}"
        for f in (REPO / "analyzer" / "pageshare" / HOST_PACKAGE).glob("*.py")
    ),
)
# Bump when the way packages are built changes in a way the inputs do not show.
BUILDER_VERSION = 1
TOOLS = ["dpkg-dev", "debhelper", "lintian"]


class BuildError(Exception):
    """A package could not be built; the message says what to do."""


@dataclass(frozen=True)
class Package:
    name: str
    # Files and directories of the checkout that go into the source tree
    # (relative to the checkout), and where they go in it.
    sources: dict[str, str]
    # Extra checks of the built .deb (paths relative to the package root).
    must_contain: tuple[str, ...]
    conffiles: tuple[str, ...]
    needs_cargo: bool
    # Called with the assembled source tree before dpkg-buildpackage.
    prepare: Callable[[Path], None] | None = None
    # Inputs from outside the checkout, found from it (the checkout's path
    # -> {path in the source tree: file}); hashed into the key like sources.
    external: Callable[[Path], dict[str, Path]] | None = None
    # Debian packages the build uses beyond TOOLS, whose versions go into the key.
    tools: tuple[str, ...] = ()
    # Paths (regular expressions, relative to the package root) the .deb must not hold.
    forbidden: tuple[str, ...] = ()
    # The checkout's pageshare/__init__.py whose __version__ the changelog must give.
    python_init: str | None = None

    def source_of(self, dest: str) -> str:
        """The checkout path that becomes ``dest`` in the source tree."""
        return next(r for r, d in self.sources.items() if d == dest)


def _server_prepare(tree: Path) -> None:
    # One unit file, in page-server/: dh_installsystemd installs and enables
    # debian/<package>.service.
    shutil.copy2(tree / "pageshare-server.service", tree / "debian" / "pageshare-server.service")


# The Python versions the pageshare package vendors its PyPI dependencies
# for (debian/rules installs one copy each): Debian 12's and Debian 13's.
VENDOR_PYTHONS = ("3.11", "3.13")
WHEEL_PLATFORM = "manylinux_2_28_x86_64"


def _host_prepare(tree: Path) -> None:
    shutil.copy2(
        tree / "pageshare-libvirt-watch.service",
        tree / "debian" / "pageshare-host.pageshare-libvirt-watch.service",
    )


def _pageshare_prepare(tree: Path) -> None:
    # pageshare-host installs these modules and the host subpackage;
    # debian/rules leaves them out.
    (tree / "debian" / "host-modules").write_text(
        "".join(f"{m}\n" for m in (*(f"{m}.py" for m in HOST_TOP_MODULES), HOST_PACKAGE))
    )
    # The wheels of vendor/requirements.txt, hash-checked by pip, for each
    # Python version: the build itself runs offline.
    wheels = tree / "vendor" / "wheels"
    env = dict(os.environ, PIP_CACHE_DIR=str(CACHE / "pip"))
    for version in VENDOR_PYTHONS:
        p = subprocess.run(
            [
                "/usr/bin/python3",
                "-m",
                "pip",
                "download",
                "--quiet",
                "--no-deps",
                "--require-hashes",
                "-r",
                str(tree / "vendor" / "requirements.txt"),
                "--dest",
                str(wheels),
                "--only-binary=:all:",
                "--python-version",
                version,
                "--implementation",
                "cp",
                "--platform",
                WHEEL_PLATFORM,
            ],
            capture_output=True,
            text=True,
            env=env,
        )
        if p.returncode != 0:
            raise BuildError(
                f"downloading the vendored wheels for Python {version} failed "
                f"(is PyPI reachable?):\n{p.stdout}{p.stderr}"
            )


# pageshare-qemu: the files of qemu-patches/build.py's output it packages,
# and the x86 option ROMs' sources from the same QEMU tree (debian/rules
# builds them).
QEMU_BINARIES = ("qemu-system-x86_64", "qemu-img", "qemu-io", "qemu-nbd", "qemu-storage-daemon")
OPTIONROM_SOURCES = (
    "pc-bios/optionrom",
    "include/hw/xen/start_info.h",
    "include/standard-headers/linux/qemu_fw_cfg.h",
    "include/standard-headers/linux/types.h",
    "scripts/signrom.py",
)


@functools.cache
def qemu_build(source: Path) -> Path:
    """The patched QEMU's directory (bin/, info.json) from the checkout's
    qemu-patches/build.py, which builds it if needed (7-11 min cold)."""
    script = source / "qemu-patches" / "build.py"
    log(f"{script} (the patched QEMU; cached)")
    p = subprocess.run([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    if p.returncode != 0:
        raise BuildError(f"{script} failed ({p.returncode}); its messages are above")
    return Path(p.stdout.strip().splitlines()[-1])


def _qemu_external(source: Path) -> dict[str, Path]:
    out = qemu_build(source)
    info = json.loads((out / "info.json").read_text())
    files = {f"qemu/bin/{b}": out / "bin" / b for b in QEMU_BINARIES}
    files["qemu/info.json"] = out / "info.json"
    tree = Path(info["work"]) / "src"
    for rel in OPTIONROM_SOURCES:
        p = tree / rel
        for f in sorted(p.iterdir()) if p.is_dir() else [p]:
            if not f.is_file():
                raise BuildError(
                    f"{f}: missing from the QEMU work tree (run "
                    "qemu-patches/build.py --worktree to restore it)"
                )
            files[f"optionrom/{f.relative_to(tree)}"] = f
    return files


def _qemu_prepare(tree: Path) -> None:
    # The version: debian/changelog says "10.0+pageshareN" (the series is for
    # QEMU 10.0; N the packaging revision); the built QEMU's exact Debian
    # version (epoch dropped, "-" made ".") replaces the "10.0".
    qemu = str(json.loads((tree / "qemu" / "info.json").read_text())["version"])
    exact = qemu.split(":", 1)[-1].replace("-", ".")
    changelog = tree / "debian" / "changelog"
    text = changelog.read_text()
    m = re.match(r"pageshare-qemu \((10\.0)\+pageshare\d+\)", text)
    if not m or not exact.startswith(m.group(1) + "."):
        raise BuildError(
            f"{changelog}: its first line must say 10.0+pageshare<N>, and the "
            f"patched QEMU must be 10.0.x (it is {qemu})"
        )
    changelog.write_text(text[: m.start(1)] + exact + text[m.end(1) :])


MODULES = "usr/lib/pageshare/python/pageshare"
HOST_FILES = (
    "usr/bin/pageshare",
    *(f"{MODULES}/{m}" for m in HOST_MODULES),
    "lib/systemd/system/pageshare-libvirt-watch.service",
    "etc/libvirt/hooks/qemu.d/pageshare",
    "etc/pageshare/libvirt.toml",
    "etc/apparmor.d/abstractions/pageshare-qemu",
    "etc/apparmor.d/abstractions/pageshare-libvirtd",
    "etc/default/grub.d/pageshare-kernel.cfg",
    "usr/share/man/man1/pageshare.1.gz",
)
_HOST_MODULES_RE = "|".join(re.escape(m) for m in (*HOST_MODULES, HOST_PACKAGE))

PACKAGES: dict[str, Package] = {
    "pageshare-host": Package(
        name="pageshare-host",
        sources={
            **{f"analyzer/pageshare/{m}.py": f"python/pageshare/{m}.py" for m in HOST_TOP_MODULES},
            f"analyzer/pageshare/{HOST_PACKAGE}": f"python/pageshare/{HOST_PACKAGE}",
            "analyzer/pageshare-libvirt-watch.service": "pageshare-libvirt-watch.service",
            "analyzer/pageshare-libvirt-hook": "pageshare-libvirt-hook",
            "analyzer/libvirt.toml": "libvirt.toml",
            "analyzer/pageshare-qemu.apparmor": "pageshare-qemu.apparmor",
            "analyzer/pageshare-libvirtd.apparmor": "pageshare-libvirtd.apparmor",
            "packaging/pageshare-host/bin/pageshare": "bin/pageshare",
            "packaging/pageshare-host/grub.d/pageshare-kernel.cfg": "pageshare-kernel.cfg",
            "README.md": "README.md",
            "docs/install.md": "install.md",
            "packaging/pageshare-host/debian": "debian",
        },
        must_contain=(
            *HOST_FILES,
            "usr/share/doc/pageshare-host/install.md",
            "usr/share/doc/pageshare-host/copyright",
        ),
        conffiles=(
            "/etc/libvirt/hooks/qemu.d/pageshare",
            "/etc/pageshare/libvirt.toml",
            "/etc/apparmor.d/abstractions/pageshare-qemu",
            "/etc/apparmor.d/abstractions/pageshare-libvirtd",
            "/etc/default/grub.d/pageshare-kernel.cfg",
        ),
        needs_cargo=False,
        prepare=_host_prepare,
        tools=("help2man", "python3"),
        # nothing of the analyzer: only the host tools' modules, no vendored
        # PyPI packages, no crash extension, no analyze-image
        forbidden=(
            rf"^{MODULES}/(?!({_HOST_MODULES_RE})$).+",
            r"^usr/lib/pageshare/python3\.",
            r"pagescan",
            r"analyze-image",
        ),
        python_init="analyzer/pageshare/__init__.py",
    ),
    "pageshare": Package(
        name="pageshare",
        sources={
            "analyzer/pageshare": "analyzer/pageshare",
            "crash-ext/pagescan.c": "crash-ext/pagescan.c",
            "crash-ext/Makefile": "crash-ext/Makefile",
            "notebooks/analysis.ipynb": "notebooks/analysis.ipynb",
            "notebooks/refinements.ipynb": "notebooks/refinements.ipynb",
            "packaging/pageshare/requirements.txt": "vendor/requirements.txt",
            "README.md": "README.md",
            "packaging/pageshare/debian": "debian",
        },
        must_contain=(
            "usr/bin/analyze-image",
            f"{MODULES}/analysis/analyze.py",
            f"{MODULES}/lists/listcli.py",
            "usr/lib/pageshare/pagescan.so",
            "usr/lib/pageshare/pagescan.crash-version",
            *(f"usr/lib/pageshare/python{v}/drgn/__init__.py" for v in VENDOR_PYTHONS),
            *(f"usr/lib/pageshare/python{v}/redis/__init__.py" for v in VENDOR_PYTHONS),
            "usr/share/pageshare/notebooks/analysis.ipynb",
            "usr/share/pageshare/notebooks/refinements.ipynb",
            "usr/share/man/man1/analyze-image.1.gz",
            "usr/share/doc/pageshare/copyright",
        ),
        conffiles=(),
        needs_cargo=False,
        prepare=_pageshare_prepare,
        tools=("crash", "help2man", "python3-pip", "gcc"),
        # pageshare-host's files stay pageshare-host's
        forbidden=tuple(f"^{re.escape(f)}$" for f in HOST_FILES),
        python_init="analyzer/pageshare/__init__.py",
    ),
    "pageshare-server": Package(
        name="pageshare-server",
        sources={
            "page-server/Cargo.toml": "Cargo.toml",
            "page-server/Cargo.lock": "Cargo.lock",
            "page-server/src": "src",
            "page-server/README.md": "README.md",
            "page-server/PROTOCOL.md": "PROTOCOL.md",
            "page-server/server.example.toml": "server.example.toml",
            "page-server/pageshare-server.service": "pageshare-server.service",
            "page-server/examples": "examples",
            "packaging/pageshare-server/debian": "debian",
        },
        must_contain=(
            "usr/bin/pageshare-server",
            "usr/share/doc/pageshare-server/examples/unprivileged-qemu.conf",
            "lib/systemd/system/pageshare-server.service",
            "usr/lib/tmpfiles.d/pageshare-server.conf",
            "etc/pageshare/server.example.toml",
            "usr/share/man/man8/pageshare-server.8.gz",
            "usr/share/doc/pageshare-server/README.md",
            "usr/share/doc/pageshare-server/copyright",
        ),
        conffiles=("/etc/pageshare/server.example.toml",),
        needs_cargo=True,
        prepare=_server_prepare,
    ),
    "pageshare-qemu": Package(
        name="pageshare-qemu",
        sources={
            "qemu-patches/README.md": "README.md",
            "packaging/pageshare-qemu/debian": "debian",
        },
        must_contain=(
            *(f"usr/lib/pageshare-qemu/bin/{b}" for b in QEMU_BINARIES),
            *(f"usr/bin/pageshare-{b}" for b in QEMU_BINARIES),
            *(
                f"usr/lib/pageshare-qemu/share/qemu/{r}.bin"
                for r in (
                    "linuxboot",
                    "linuxboot_dma",
                    "multiboot",
                    "multiboot_dma",
                    "kvmvapic",
                    "pvh",
                    "bios-256k",
                    "vgabios-stdvga",
                )
            ),
            "usr/lib/pageshare-qemu/share/qemu/efi-virtio.rom",
            "usr/lib/pageshare-qemu/share/qemu-firmware/efi-virtio.rom",
            "usr/share/man/man1/pageshare-qemu.1.gz",
            "usr/share/doc/pageshare-qemu/README.Debian",
            "usr/share/doc/pageshare-qemu/copyright",
        ),
        conffiles=(),
        needs_cargo=False,
        prepare=_qemu_prepare,
        external=_qemu_external,
    ),
}


# --------------------------------------------------------------------------- helpers


def log(msg: str) -> None:
    print(f"[debs] {msg}", file=sys.stderr, flush=True)


def _out(cmd: list[str]) -> str:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unavailable: {e}"
    return (p.stdout or p.stderr).strip()


def tool_versions(pkg: Package) -> dict[str, str]:
    v = {t: _out(["dpkg-query", "-W", "-f=${Version}", t]) for t in (*TOOLS, *pkg.tools)}
    if pkg.needs_cargo:
        c = cargo() or "cargo"
        v["cargo"] = _out([c, "--version"])
        v["rustc"] = _out([str(Path(c).with_name("rustc")), "--version"])
    return v


def _files(root: Path, rel: str) -> Iterator[Path]:
    p = root / rel
    if p.is_dir():
        for f in sorted(p.rglob("*")):
            if f.is_file() and "__pycache__" not in f.parts:
                yield f
    elif p.is_file():
        yield p
    else:
        raise BuildError(f"{p}: missing (is --source a pageshare checkout?)")


class Inputs(TypedDict):
    """What a package's cache key is a hash of."""

    builder_version: int
    package: str
    script: str
    files: dict[str, str]
    tools: dict[str, str]


def inputs_key(pkg: Package, source: Path) -> tuple[str, Inputs]:
    files: dict[str, str] = {}
    for rel in pkg.sources:
        for f in _files(source, rel):
            st = f.stat()
            files[str(f.relative_to(source))] = (
                f"{hashlib.sha256(f.read_bytes()).hexdigest()}:{st.st_mode & 0o111:o}"
            )
    for dest, f in (pkg.external(source) if pkg.external else {}).items():
        files[f"external:{dest}"] = (
            f"{hashlib.sha256(f.read_bytes()).hexdigest()}:{f.stat().st_mode & 0o111:o}"
        )
    inputs: Inputs = {
        "builder_version": BUILDER_VERSION,
        "package": pkg.name,
        "script": hashlib.sha256(Path(__file__).read_bytes()).hexdigest(),
        "files": files,
        "tools": tool_versions(pkg),
    }
    blob = json.dumps(inputs, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16], inputs


def changelog_version(debian: Path) -> str:
    first = (debian / "changelog").read_text().splitlines()[0]
    m = re.match(r"^\S+ \(([^)]+)\)", first)
    if not m:
        raise BuildError(f"{debian}/changelog: no version in its first line")
    return m.group(1)


def cargo_version(toml: Path) -> str:
    m = re.search(r'^version\s*=\s*"([^"]+)"', toml.read_text(), re.M)
    if not m:
        raise BuildError(f"{toml}: no version")
    return m.group(1)


def python_version(init: Path) -> str:
    m = re.search(r'^__version__\s*=\s*"([^"]+)"', init.read_text(), re.M)
    if not m:
        raise BuildError(f"{init}: no __version__")
    return m.group(1)


def preflight(pkg: Package) -> None:
    missing = [
        t for t in ("dpkg-buildpackage", "dh", "lintian", "dpkg-deb") if shutil.which(t) is None
    ]
    if missing:
        raise BuildError(
            f"missing tools: {' '.join(missing)}; install the Debian packages "
            "dpkg-dev, debhelper and lintian (scripts/install-deps.sh does)"
        )
    if pkg.needs_cargo and cargo() is None:
        raise BuildError(
            "cargo not found; install Rust >= 1.80 with rustup "
            "(Debian 12's cargo is too old), then rerun"
        )


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


# --------------------------------------------------------------------------- checks of the result


def deb_paths(deb: Path) -> set[str]:
    p = subprocess.run(["dpkg-deb", "--fsys-tarfile", str(deb)], capture_output=True, check=True)
    t = subprocess.run(["tar", "-t"], input=p.stdout, capture_output=True, check=True)
    return {line.decode().removeprefix("./").rstrip("/") for line in t.stdout.splitlines()}


def deb_member(deb: Path, member: str) -> str:
    """A file of the package's data, as text."""
    p = subprocess.run(["dpkg-deb", "--fsys-tarfile", str(deb)], capture_output=True, check=True)
    t = subprocess.run(
        ["tar", "-xO", f"./{member}"], input=p.stdout, capture_output=True, check=True
    )
    return t.stdout.decode()


def deb_control_file(deb: Path, name: str) -> str:
    with tempfile.TemporaryDirectory() as d:
        subprocess.run(["dpkg-deb", "-e", str(deb), d], check=True)
        f = Path(d) / name
        return f.read_text() if f.exists() else ""


def check_deb(pkg: Package, deb: Path) -> None:
    paths = deb_paths(deb)
    missing = [m for m in pkg.must_contain if m not in paths]
    if missing:
        raise BuildError(f"{deb.name} lacks {', '.join(missing)}")
    extra = sorted(p for p in paths for pat in pkg.forbidden if re.search(pat, p))
    if extra:
        raise BuildError(f"{deb.name} holds what it must not: {', '.join(extra)}")
    conffiles = set(deb_control_file(deb, "conffiles").split())
    if not set(pkg.conffiles) <= conffiles:
        raise BuildError(
            f"{deb.name}: conffiles are {sorted(conffiles)}, expected {list(pkg.conffiles)}"
        )
    for unit in (p for p in paths if p.endswith(".service") and "/systemd/system/" in p):
        text = deb_member(deb, unit)
        for m in re.finditer(r"^Exec\w+=[-@:+!]*(\S+)", text, re.M):
            if m.group(1).lstrip("/") not in paths:
                raise BuildError(
                    f"{deb.name}: {unit} runs {m.group(1)}, which the package does not install"
                )


# --------------------------------------------------------------------------- build


def assemble(pkg: Package, source: Path, tree: Path) -> None:
    tree.mkdir(parents=True)
    for rel, dest in pkg.sources.items():
        src = source / rel
        if src.is_dir():
            shutil.copytree(src, tree / dest, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            (tree / dest).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, tree / dest)
    for dest, f in (pkg.external(source) if pkg.external else {}).items():
        (tree / dest).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(f, tree / dest)
    if pkg.prepare:
        pkg.prepare(tree)


def build(pkg: Package, source: Path, *, force: bool = False, check: bool = False) -> Path:
    """The package's cache directory (with the .deb), built if needed."""
    preflight(pkg)
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / ".lock", "w") as lockf:
        fcntl.flock(lockf, fcntl.LOCK_EX)
        key, inputs = inputs_key(pkg, source)
        out = CACHE / pkg.name / key
        if (out / "stamp").exists() and not force:
            return out
        debian = source / pkg.source_of("debian")
        version = changelog_version(debian)
        if pkg.needs_cargo:
            toml = source / pkg.source_of("Cargo.toml")
            if cargo_version(toml) != version.split("-")[0]:
                raise BuildError(
                    f"{toml} says version {cargo_version(toml)}, "
                    f"{debian}/changelog {version}: add a changelog entry"
                )
        if pkg.python_init:
            init = source / pkg.python_init
            if python_version(init) != version:
                raise BuildError(
                    f"{init} says __version__ {python_version(init)}, "
                    f"{debian}/changelog {version}: add a changelog entry"
                )
        start = time.monotonic()
        work = Path(tempfile.mkdtemp(prefix=f".work-{pkg.name}-", dir=CACHE))
        try:
            tree = work / f"{pkg.name}-{version.split('-')[0]}"
            assemble(pkg, source, tree)
            version = changelog_version(tree / "debian")  # prepare() may set it
            env = dict(os.environ, DEB_BUILD_OPTIONS="" if check else "nocheck")
            if pkg.needs_cargo:
                c = cargo()
                assert c is not None
                env["PATH"] = f"{Path(c).parent}:{env.get('PATH', '')}"
                # Its own target directory: dpkg-buildpackage builds from a
                # copy of the source with Debian's build flags.
                env["CARGO_TARGET_DIR"] = str(CACHE / "cargo-target")
            build_log = work / "build.log"
            log(f"{pkg.name} {version}: dpkg-buildpackage in {tree} (log: {build_log})")
            with open(build_log, "wb") as lf:
                p = subprocess.run(
                    ["nice", "-n", "10", "dpkg-buildpackage", "-b", "-us", "-uc"],
                    cwd=tree,
                    env=env,
                    stdout=lf,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                )
            if p.returncode != 0:
                raise BuildError(f"dpkg-buildpackage failed ({p.returncode}):\n{_tail(build_log)}")
            changes = sorted(work.glob(f"{pkg.name}_*.changes"))
            debs = sorted(work.glob(f"{pkg.name}_*.deb"))
            if len(changes) != 1 or len(debs) != 1:
                raise BuildError(
                    f"expected one .changes and one .deb in {work}, found "
                    f"{[c.name for c in changes + debs]}"
                )
            lint = subprocess.run(
                ["lintian", "--fail-on", "error,warning", "--info", str(changes[0])],
                capture_output=True,
                text=True,
            )
            (work / "lintian.txt").write_text(lint.stdout + lint.stderr)
            if lint.returncode != 0:
                raise BuildError(
                    f"lintian found problems in {pkg.name}:\n{lint.stdout}{lint.stderr}"
                )
            check_deb(pkg, debs[0])
            staged = work / "result"
            staged.mkdir()
            for f in [
                *work.glob(f"{pkg.name}*_*.*deb"),
                *work.glob(f"{pkg.name}_*.buildinfo"),
                *changes,
                build_log,
                work / "lintian.txt",
            ]:
                shutil.move(str(f), staged / f.name)
            manifest = {
                "package": pkg.name,
                "version": version,
                "key": key,
                "deb": debs[0].name,
                "build_seconds": round(time.monotonic() - start, 1),
                "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "inputs": inputs,
            }
            (staged / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
            (staged / "stamp").write_text(key + "\n")
            if out.exists():
                shutil.rmtree(out)
            out.parent.mkdir(parents=True, exist_ok=True)
            staged.rename(out)
            log(f"{pkg.name}: {out / debs[0].name} ({manifest['build_seconds']} s)")
            return out
        finally:
            shutil.rmtree(work, ignore_errors=True)


def deb_of(out: Path) -> Path:
    manifest = json.loads((out / "manifest.json").read_text())
    return out / str(manifest["deb"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="Build pageshare's Debian packages (cached by their inputs under "
        "$PAGESHARE_CACHE/packages) and print each .deb's path.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Packages: " + ", ".join(PACKAGES),
    )
    ap.add_argument(
        "packages", nargs="*", metavar="PACKAGE", help="packages to build (default: all)"
    )
    ap.add_argument(
        "--source",
        type=Path,
        default=REPO,
        help="the pageshare checkout to build from (default: %(default)s)",
    )
    ap.add_argument("--force", action="store_true", help="rebuild even if cached")
    ap.add_argument(
        "--check",
        action="store_true",
        help="run the package's own tests while building (cargo test)",
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--list", action="store_true", help="list the packages and exit")
    args = ap.parse_args(argv)
    if args.list:
        print("\n".join(PACKAGES))
        return 0
    names = args.packages or list(PACKAGES)
    unknown = [n for n in names if n not in PACKAGES]
    if unknown:
        ap.error(f"unknown package(s) {', '.join(unknown)}; choose from {', '.join(PACKAGES)}")
    results: dict[str, str] = {}
    try:
        for n in names:
            results[n] = str(
                deb_of(
                    build(PACKAGES[n], args.source.resolve(), force=args.force, check=args.check)
                )
            )
    except BuildError as e:
        if args.json:
            print(json.dumps({"ok": False, "error": str(e), "built": results}))
        else:
            print(f"debs: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"ok": True, "built": results}))
    else:
        print("\n".join(results.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
