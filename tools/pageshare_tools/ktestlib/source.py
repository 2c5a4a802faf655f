"""1. source: Debian's linux-source-6.12 tarball (the host's apt, or a private
apt configuration under the cache) unpacked into a throwaway git repository
with a build worktree (Source)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from pageshare import debian

from .common import GIT_ID, KtestError, log, run, sha256_file

SRC_PACKAGE = "linux-source-6.12"
SRC_TARBALL = Path("/usr/src/linux-source-6.12.tar.xz")


class PrivateApt(debian.PrivateApt):
    """apt-get with its own sources and state under the cache (bookworm + trixie)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root, debian.sources(("bookworm", "trixie")))

    def download(self, package: str, dest: Path) -> Path:
        run(self.command("apt-get", "update", "-qq"), capture=True)
        dest.mkdir(parents=True, exist_ok=True)
        run(self.command("apt-get", "download", package), cwd=dest, capture=True)
        debs = sorted(dest.glob(f"{package}_*.deb"))
        if not debs:
            raise KtestError(f"apt-get download {package} produced no .deb in {dest}")
        return debs[-1]


def host_package_version(package: str) -> str | None:
    p = run(["dpkg-query", "-W", "-f", "${Status} ${Version}", package], capture=True, check=False)
    if p.returncode == 0 and p.stdout.startswith("install ok installed"):
        return p.stdout.split()[-1]
    return None


def apt_candidate(package: str) -> str | None:
    p = run(["apt-cache", "policy", package], capture=True, check=False)
    m = re.search(r"Candidate:\s*(\S+)", p.stdout)
    if m and m.group(1) != "(none)":
        return m.group(1)
    return None


def ensure_source_tarball(root: Path) -> tuple[Path, str]:
    """Return (tarball, version) of Debian's linux-source-6.12."""
    ver = host_package_version(SRC_PACKAGE)
    if ver and SRC_TARBALL.exists():
        return SRC_TARBALL, ver
    if apt_candidate(SRC_PACKAGE) and os.geteuid() == 0:
        log(f"installing {SRC_PACKAGE} with apt-get (the host's apt has it)")
        run(
            ["apt-get", "install", "-y", "-q", SRC_PACKAGE],
            capture=True,
            env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
        )
        ver = host_package_version(SRC_PACKAGE)
        if ver and SRC_TARBALL.exists():
            return SRC_TARBALL, ver
    # Private download (bookworm-security or trixie); nothing on the host changes.
    pkgdir = root / "pkg"
    debs = sorted(pkgdir.glob(f"{SRC_PACKAGE}_*.deb"))
    if not debs:
        log(f"downloading {SRC_PACKAGE} with a private apt configuration under {root / 'apt'}")
        debs = [PrivateApt(root / "apt").download(SRC_PACKAGE, pkgdir)]
    deb = debs[-1]
    ver = run(["dpkg-deb", "-f", str(deb), "Version"], capture=True).stdout.strip()
    out = pkgdir / f"x-{ver}"
    tarball = out / "usr/src/linux-source-6.12.tar.xz"
    if not tarball.exists():
        run(["dpkg-deb", "-x", str(deb), str(out)])
    return tarball, ver


def source_key(root: Path, tarball: Path, ver: str) -> str:
    st = tarball.stat()
    memo = root / "tarball-sha256.json"
    data: dict[str, str] = json.loads(memo.read_text()) if memo.exists() else {}
    ident = f"{tarball}:{st.st_size}:{int(st.st_mtime)}"
    if ident not in data:
        data[ident] = sha256_file(tarball)
        memo.write_text(json.dumps(data, indent=1))
    safe = re.sub(r"[^0-9A-Za-z.+-]", "_", ver)
    return f"{safe}-{data[ident][:12]}"


@dataclass
class Source:
    key: str
    repo: Path  # git repository used for `git am` (its work tree is scratch)
    tree: Path  # git worktree the kernel is built from (O= builds)

    @contextlib.contextmanager
    def locked(self):  # type: ignore[no-untyped-def]
        """Exclusive use of the repository and the build tree: two ktest runs
        (say a plain build and a debug test run) must not check out
        different commits under each other's make."""
        with open(self.repo.parent / ".lock", "w") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                log("waiting for another ktest run to finish with the source tree")
                fcntl.flock(f, fcntl.LOCK_EX)
            yield


def ensure_source(root: Path) -> Source:
    tarball, ver = ensure_source_tarball(root)
    key = source_key(root, tarball, ver)
    base = root / "src" / key
    repo = base / "repo"
    tree = base / "tree"
    if not (base / ".ready").exists():
        if base.exists():
            shutil.rmtree(base)
        base.mkdir(parents=True)
        log(f"unpacking {tarball} ({ver}) into {repo}")
        tmp = base / "unpack"
        tmp.mkdir()
        run(["tar", "-xf", str(tarball), "-C", str(tmp)])
        (subdir,) = list(tmp.iterdir())
        subdir.rename(repo)
        tmp.rmdir()
        log("making the throwaway git repository (one commit, tag 'base')")
        run(["git", "init", "-q"], cwd=repo)
        run(["git", *GIT_ID, "add", "-A", "-f"], cwd=repo)
        run(["git", *GIT_ID, "commit", "-q", "-m", f"Linux {ver} (Debian {SRC_PACKAGE})"], cwd=repo)
        run(["git", "tag", "base"], cwd=repo)
        run(["git", *GIT_ID, "worktree", "add", "-q", "--detach", str(tree), "base"], cwd=repo)
        (base / ".ready").write_text(ver + "\n")
    return Source(key, repo, tree)
