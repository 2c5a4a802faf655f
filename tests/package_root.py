"""A clean Debian root with the pageshare package (the analyzer, with
pageshare-host, on which it depends) installed by apt, for tests that run
the installed package instead of the checkout.

The root is made by mmdebstrap (variant apt: Debian's essential and apt
packages and nothing else) from the Debian mirror, and the package is
installed into it with `apt-get install ./pageshare_*.deb`, which resolves
its dependencies from the archive (pageshare-host from its .deb), as on a
fresh host.
Commands run chrooted, with /proc, /sys and /dev, and the host directories a
test names mounted at the same paths (a dump, a database), in a mount
namespace of their own: nothing stays mounted when they end.
"""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import debs
from pageshare import debian
from pageshare.cache import cache_dir, locked

REPO = Path(__file__).resolve().parents[1]


def built_deb(package: str) -> Path:
    """A .deb of this checkout (built, or from the cache)."""
    path: Path = debs.deb_of(debs.build(debs.PACKAGES[package], REPO))
    return path


def pageshare_deb() -> Path:
    """The pageshare .deb (the analyzer) of this checkout."""
    return built_deb("pageshare")


def pageshare_debs() -> tuple[Path, Path]:
    """pageshare-host's and the analyzer's .debs: the analyzer depends on the host tools."""
    return built_deb("pageshare-host"), pageshare_deb()


class Root:
    def __init__(self, path: Path, suite: str) -> None:
        self.path, self.suite = path, suite

    def run(
        self, command: str, binds: tuple[Path, ...] = (), timeout: float = 600
    ) -> subprocess.CompletedProcess[str]:
        """COMMAND (shell) chrooted into the root."""
        mounts = [f"mount --rbind /{d} {self.path}/{d}" for d in ("proc", "sys", "dev")]
        for b in binds:
            mounts.append(f"mkdir -p {self.path}{b} && mount --bind {b} {self.path}{b}")
        script = "; ".join(
            [
                "set -e",
                "mount --make-rprivate /",
                *mounts,
                f"exec chroot {self.path} /bin/sh -c {shlex.quote(command)}",
            ]
        )
        return subprocess.run(
            ["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, timeout=timeout
        )


# The package's recommendations the tests use.  Not all of them: supermin
# (libguestfs) recommends a kernel, which a host has and whose initramfs
# would take minutes to build here.
RECOMMENDS = (
    "crash",
    "python3-libvirt",
    "python3-pandas",
    "python3-matplotlib",
    "python3-nbclient",
    "python3-nbformat",
    "python3-ipykernel",
)


def install_root(suite: str, debs: tuple[Path, ...], dest: Path) -> Root:
    """A fresh SUITE root at DEST with DEBS installed by apt, with RECOMMENDS.
    Downloaded packages are kept in the cache and put into the root's
    archive directory first, so that only what changed is fetched again."""
    archives = cache_dir("package-roots") / suite
    archives.mkdir(parents=True, exist_ok=True)
    cmd = [
        "mmdebstrap",
        "--mode=root",
        "--variant=apt",
        "--quiet",
        "--skip=download/empty",
        '--setup-hook=mkdir -p "$1"/var/cache/apt/archives/',
        f"--setup-hook=sync-in {archives} /var/cache/apt/archives/",
        f"--customize-hook=copy-in {' '.join(map(str, debs))} /tmp",
        '--customize-hook=chroot "$1" env DEBIAN_FRONTEND=noninteractive '
        "apt-get install -y -q --no-install-recommends "
        + " ".join([*(f"/tmp/{d.name}" for d in debs), *RECOMMENDS]),
        f"--customize-hook=sync-out /var/cache/apt/archives {archives}",
        suite,
        str(dest),
        *debian.sources([suite]),
    ]
    # One mmdebstrap a suite at a time: each copies the shared archives in
    # and out, and two at once would read each other's half-written files.
    with locked(archives.with_name(f".lock-{suite}")):
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=1500)
    if p.returncode != 0:
        raise AssertionError(
            f"installing {' '.join(d.name for d in debs)} into a fresh "
            f"{suite} root failed:\n" + (p.stdout + p.stderr)[-4000:]
        )
    return Root(dest, suite)
