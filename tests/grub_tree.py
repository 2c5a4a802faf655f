"""Debian's own grub-mkconfig, run on a fake /boot: what update-grub would
write there, for the tests of pageshare-host's GRUB snippet
(packaging/pageshare-host/grub.d/pageshare-kernel.cfg) and of host check's
kernel finding.

grub_common(suite) is Debian's grub-common package of that suite (bookworm:
GRUB 2.06, trixie: 2.12) from the archive, unpacked once into the cache
(apt-get download with a private apt configuration, as the package tests
fetch what they need).  GrubTree lays out a scratch tree with its scripts,
unchanged but for where they are installed:

- grub-mkconfig, grub-mkconfig_lib, /etc/grub.d/00_header and 10_linux get
  the tree's directories for prefix, exec_prefix, datarootdir and
  sysconfdir (the values configure wrote into them), so grub-mkconfig
  sources the tree's /etc/default/grub and /etc/default/grub.d/*.cfg and
  runs the tree's grub.d, and calls the tree's grub-probe;
- 10_linux's kernel list reads the tree's boot/ instead of /boot (the one
  other path it names), and the snippet is pointed there by
  PAGESHARE_GRUB_BOOT, the variable it reads for the tests;
- grub-probe, grub-mkrelpath and grub-editenv are stubs: grub-probe answers
  for a root device of the test's choosing (its device name, file system
  UUID, file system and abstraction: LVM, btrfs...), grub-mkrelpath gives a
  path as seen from the tree's root, grub-editenv lists the tree's
  boot/grub/grubenv.

Everything else (the order grub-mkconfig works in, how 10_linux sorts the
kernels, forms its submenu and entry ids from grub_get_device_id, and how
00_header writes `set default`) is Debian's code as update-grub runs it.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from pageshare.cache import cache_dir
from pageshare.debian import PrivateApt, sources

REPO = Path(__file__).resolve().parents[1]
SNIPPET = REPO / "packaging" / "pageshare-host" / "grub.d" / "pageshare-kernel.cfg"
SUITES = ("bookworm", "trixie")
ROOT_UUID = "0f3c2a51-7d4e-4b8a-9c61-2e5f8a9d4b17"


def grub_common(suite: str) -> Path:
    """Debian's grub-common of suite, unpacked (cached: the first one fetched)."""
    base = cache_dir("grub-common") / suite
    done = sorted(base.glob("grub-common_*/root/usr/sbin/grub-mkconfig"))
    if done:
        return done[-1].parents[2]
    apt = PrivateApt(cache_dir(f"apt-{suite}"), sources([suite]))
    staging = base / "download"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    error = ""
    for attempt in range(2):
        # Stale lists name versions the mirror has dropped: update and retry.
        if attempt or not any((apt.root / "lists").glob("*Packages*")):
            subprocess.run(apt.command("apt-get", "update", "-qq"), check=True, capture_output=True)
        p = subprocess.run(
            apt.command("apt-get", "download", "-qq", "grub-common"),
            cwd=staging,
            capture_output=True,
            text=True,
        )
        error = p.stdout + p.stderr
        if p.returncode == 0:
            break
    else:
        pytest.fail(f"cannot download {suite}'s grub-common:\n{error}")
    deb = next(staging.glob("grub-common_*.deb"))
    root = base / deb.stem / "root"
    tmp = root.with_name("root.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["dpkg-deb", "-x", str(deb), str(tmp)], check=True)
    tmp.rename(root)
    shutil.rmtree(staging)
    return root


def _relocate(text: str, fs: Path, names: tuple[str, ...], what: str) -> str:
    """The configure-time directories of a GRUB script, moved into fs."""
    for name, value in (
        ("prefix", "/usr"),
        ("exec_prefix", "/usr"),
        ("datarootdir", "/usr/share"),
        ("sysconfdir", "/etc"),
    ):
        if name not in names:
            continue
        text, n = re.subn(rf'^{name}="{value}"$', f'{name}="{fs}{value}"', text, flags=re.M)
        assert n, f"{what}: no {name}={value} line"
    return text


@dataclass
class RootDevice:
    """What grub-probe says about / (and /boot, on the same file system)."""

    device: str = "/dev/vda1"
    uuid: str = ROOT_UUID  # "": grub-probe finds no file system UUID
    fs: str = "ext2"  # grub-probe's name for ext2/3/4
    abstraction: str = ""  # "lvm" for a logical volume


GRUB_PROBE = """#!/bin/sh
# grub-probe for the tests: [--device DEV] --target=T|-t T [PATH]
target=
while [ $# -gt 0 ]; do
	case $1 in
	--target=*) target=${1#--target=} ;;
	-t | --target) shift; target=$1 ;;
	esac
	shift
done
case $target in
device) echo @DEVICE@ ;;
fs_uuid) [ -n @UUID@ ] || exit 1; echo @UUID@ ;;
fs) echo @FS@ ;;
abstraction) echo @ABSTRACTION@ ;;
partmap) echo gpt ;;
compatibility_hint) echo hd0,gpt1 ;;
hints_string) echo ;;
*) exit 1 ;;
esac
"""


# Debian's /etc/default/grub as grub2-common installs it (its settings;
# GRUB_DISTRIBUTOR is what its `lsb_release -i -s || echo Debian` gives).
DEFAULT_GRUB = """\
GRUB_DEFAULT=0
GRUB_TIMEOUT=5
GRUB_DISTRIBUTOR=Debian
GRUB_CMDLINE_LINUX_DEFAULT="quiet"
GRUB_CMDLINE_LINUX=""
"""


class GrubTree:
    """A scratch root with one suite's grub-mkconfig, a fake /boot and
    /etc/default (Debian's /etc/default/grub; remove() deletes it all).

    The root is a directory in /tmp without a '-' in its path: GRUB 2.06's
    version_test_gt strips a kernel path up to its first '-' before it
    compares versions ("/boot/vmlinuz-" on a real /boot), so a '-' before
    vmlinuz would change the order 10_linux lists the kernels in.
    """

    def __init__(self, common: Path, device: RootDevice | None = None) -> None:
        root = Path(tempfile.mkdtemp(prefix="grubtree", dir="/tmp"))
        assert "-" not in str(root), root
        self.fs = root
        self.boot = root / "boot"
        self.default = root / "etc" / "default" / "grub"
        self.grub_d = root / "etc" / "default" / "grub.d"
        for rel in ("boot/grub", "etc/default/grub.d", "etc/grub.d", "usr/sbin", "usr/bin"):
            (root / rel).mkdir(parents=True, exist_ok=True)
        (root / "usr/share/grub").mkdir(parents=True, exist_ok=True)
        mkconfig = (common / "usr/sbin/grub-mkconfig").read_text()
        self._write(
            "usr/sbin/grub-mkconfig",
            _relocate(
                mkconfig,
                root,
                ("prefix", "exec_prefix", "datarootdir", "sysconfdir"),
                "grub-mkconfig",
            ),
        )
        lib = (common / "usr/share/grub/grub-mkconfig_lib").read_text()
        self._write(
            "usr/share/grub/grub-mkconfig_lib",
            _relocate(lib, root, ("prefix", "exec_prefix", "datarootdir"), "grub-mkconfig_lib"),
        )
        header = (common / "etc/grub.d/00_header").read_text()
        self._write(
            "etc/grub.d/00_header",
            _relocate(header, root, ("prefix", "exec_prefix", "datarootdir"), "00_header"),
        )
        linux = _relocate(
            (common / "etc/grub.d/10_linux").read_text(),
            root,
            ("prefix", "exec_prefix", "datarootdir"),
            "10_linux",
        )
        # The kernels it lists: `for i in /boot/vmlinuz-* /vmlinuz-* ...` lines.
        lines = linux.splitlines(keepends=True)
        moved = 0
        for i, line in enumerate(lines):
            if re.match(r"\s*for i in /boot/vmlinuz-\*", line):
                lines[i] = (
                    line.replace(" /boot/", f" {root}/boot/")
                    .replace(" /vmlinuz-", f" {root}/vmlinuz-")
                    .replace(" /vmlinux-", f" {root}/vmlinux-")
                )
                moved += 1
        assert moved, "10_linux: no `for i in /boot/vmlinuz-*` line"
        self._write("etc/grub.d/10_linux", "".join(lines))
        self.set_device(device or RootDevice())
        self.default.write_text(DEFAULT_GRUB)
        q = shlex.quote(str(root))
        self._write(
            "usr/bin/grub-mkrelpath",
            f'#!/bin/sh\np=$1\ncase $p in {q}/*) p=${{p#{q}}} ;; esac\necho "$p"\n',
        )
        env = shlex.quote(str(self.boot / "grub/grubenv"))
        self._write(
            "usr/bin/grub-editenv",
            f"#!/bin/sh\n[ ! -f {env} ] || grep -v '^#' {env}\n",
        )

    def remove(self) -> None:
        shutil.rmtree(self.fs, ignore_errors=True)

    def _write(self, rel: str, text: str) -> None:
        f = self.fs / rel
        f.write_text(text)
        f.chmod(0o755)

    def set_device(self, d: RootDevice) -> None:
        text = GRUB_PROBE
        for key, value in (
            ("DEVICE", d.device),
            ("UUID", d.uuid),
            ("FS", d.fs),
            ("ABSTRACTION", d.abstraction),
        ):
            text = text.replace(f"@{key}@", shlex.quote(value) if value else "''")
        self._write("usr/sbin/grub-probe", text)

    def kernels(self, *releases: str) -> None:
        """Installed kernels, as their packages leave them in /boot."""
        for r in releases:
            (self.boot / f"vmlinuz-{r}").write_bytes(b"not really a kernel\n")
            (self.boot / f"initrd.img-{r}").write_bytes(b"not really an initrd\n")
            (self.boot / f"config-{r}").write_text("CONFIG_KSM=y\n")

    def install_snippet(self) -> Path:
        """pageshare-host's file, where the package installs it."""
        f = self.grub_d / SNIPPET.name
        f.write_text(SNIPPET.read_text())
        return f

    def mkconfig(self) -> tuple[str, str]:
        """grub-mkconfig's output (grub.cfg) and its messages; written to
        boot/grub/grub.cfg as update-grub would."""
        p = subprocess.run(
            ["sh", str(self.fs / "usr/sbin/grub-mkconfig")],
            capture_output=True,
            text=True,
            timeout=120,
            env={
                "PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
                "LANG": "C",
                "EUID": "0",  # grub-mkconfig's check for root
                "PAGESHARE_GRUB_BOOT": str(self.boot),
            },
        )
        assert p.returncode == 0, p.stderr
        (self.boot / "grub/grub.cfg").write_text(p.stdout)
        return p.stdout, p.stderr
