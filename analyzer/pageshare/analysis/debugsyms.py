"""Debug symbols (a DWARF vmlinux) for the guest's exact kernel build.

crash needs the vmlinux of the very build the guest runs.  Debian ships it as
linux-image-<version>-dbg (~300 MB .deb, ~600 MB vmlinux).  We download the
package with a private apt configuration kept in the cache, so the host's
own apt sources are never modified, while Debian 12 and 13 guests can both
be served from one host; extract only vmlinux; and cache it by build-id.
The build-id is checked against the guest's VMCOREINFO before use: a
vmlinux of a different build gives plausible-looking garbage.
"""

import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

from .. import debian
from ..cache import cache_dir, locked
from ..errors import UserError

DEBIAN_SUITES = ("bookworm", "trixie")
LogFn = Callable[[str], None]


def build_id(vmlinux: Path) -> str:
    out = subprocess.run(["readelf", "-n", str(vmlinux)], capture_output=True, text=True)
    m = re.search(r"Build ID: ([0-9a-f]+)", out.stdout)
    if not m:
        raise UserError(f"{vmlinux}: no GNU build-id note", "give the vmlinux of a Debian kernel")
    return m.group(1)


def has_debug_info(vmlinux: Path) -> bool:
    out = subprocess.run(["readelf", "-S", "-W", str(vmlinux)], capture_output=True, text=True)
    return ".debug_info" in out.stdout


class AptCache:
    """apt-get with its own sources, lists and archives under the cache dir."""

    def __init__(self) -> None:
        self.apt = debian.PrivateApt(cache_dir("apt"), debian.sources(DEBIAN_SUITES))
        self.root = self.apt.root

    def update(self) -> None:
        p = subprocess.run(
            self.apt.command("apt-get", "update", "-qq"), capture_output=True, text=True
        )
        if p.returncode != 0:
            raise UserError(
                f"apt-get update for debug symbols failed: {p.stderr.strip()[-300:]}",
                "check access to the Debian mirror, or pass --vmlinux",
            )

    def download(self, package: str, dest: Path) -> Path:
        p = subprocess.run(
            self.apt.command("apt-get", "download", package),
            cwd=dest,
            capture_output=True,
            text=True,
        )
        if p.returncode != 0:
            raise LookupError(p.stderr.strip()[-300:])
        debs = sorted(dest.glob(f"{package}_*.deb"))
        if not debs:
            raise LookupError(f"apt-get download {package} produced no .deb")
        return debs[-1]


def find_vmlinux(kernel_version: str, want_build_id: str | None, log: LogFn | None = None) -> Path:
    """A cached or freshly downloaded vmlinux for this kernel version."""
    root = cache_dir("vmlinux")
    if want_build_id:
        cached = root / want_build_id / "vmlinux"
        if cached.exists():
            return cached
    by_version = root / "by-version" / kernel_version
    if by_version.exists() and not want_build_id:
        return by_version.resolve()
    # One download a kernel version at a time (make test's two workers).
    with locked(root / f".lock-{kernel_version}"):
        if want_build_id and (root / want_build_id / "vmlinux").exists():
            return root / want_build_id / "vmlinux"
        if by_version.exists() and not want_build_id:
            return by_version.resolve()
        return _download_vmlinux(root, by_version, kernel_version, want_build_id, log)


def _download_vmlinux(
    root: Path,
    by_version: Path,
    kernel_version: str,
    want_build_id: str | None,
    log: LogFn | None,
) -> Path:
    package = f"linux-image-{kernel_version}-dbg"
    apt = AptCache()
    if log:
        log(f"fetching {package} (about 300 MB, first time only)")
    apt.update()
    with tempfile.TemporaryDirectory(prefix="pageshare-dbg-", dir=root) as tmp:
        try:
            deb = apt.download(package, Path(tmp))
        except LookupError as e:
            raise UserError(
                f"no debug symbols for guest kernel {kernel_version}: package "
                f"{package} is not in Debian's archive ({e})",
                "pass --vmlinux PATH with the guest kernel's DWARF vmlinux "
                "(Debian drops old -dbg packages when a kernel is superseded)",
            ) from None
        member = f"./usr/lib/debug/boot/vmlinux-{kernel_version}"
        if log:
            log(f"extracting vmlinux-{kernel_version} from {deb.name}")
        tar = subprocess.Popen(["dpkg-deb", "--fsys-tarfile", str(deb)], stdout=subprocess.PIPE)
        subprocess.run(["tar", "-x", "-C", tmp, member], stdin=tar.stdout, check=True)
        if tar.wait() != 0:
            raise UserError(f"{deb.name}: dpkg-deb failed", "delete the cache and retry")
        extracted = Path(tmp) / member
        bid = build_id(extracted)
        final = root / bid / "vmlinux"
        final.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(extracted), final)
        deb.unlink()
    by_version.parent.mkdir(parents=True, exist_ok=True)
    by_version.unlink(missing_ok=True)
    by_version.symlink_to(final)
    if want_build_id and bid != want_build_id:
        raise UserError(
            f"the archive's {package} has build-id {bid}, the guest runs {want_build_id}",
            "the guest kernel was rebuilt or patched: pass --vmlinux with its own debug vmlinux",
        )
    return final


def check_vmlinux(vmlinux: Path, want_build_id: str | None) -> str:
    """Validates a vmlinux (user-supplied or cached) and returns its build-id."""
    if not vmlinux.is_file():
        raise UserError(f"--vmlinux {vmlinux}: no such file", "give the DWARF vmlinux path")
    if not has_debug_info(vmlinux):
        raise UserError(
            f"{vmlinux} has no DWARF debug info",
            "use the vmlinux from the linux-image-<version>-dbg package, not /boot/vmlinuz",
        )
    bid = build_id(vmlinux)
    if want_build_id and bid != want_build_id:
        raise UserError(
            f"{vmlinux} has build-id {bid} but the guest kernel is {want_build_id}",
            "give the debug vmlinux of the exact kernel build the image boots",
        )
    return bid
