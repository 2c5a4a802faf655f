#!/usr/bin/env python3
"""Build QEMU 10.0 (Debian trixie's source package) with the pageshare series.

    qemu-patches/build.py            # prints the directory holding bin/
    qemu-patches/build.py --print-env  # QEMU_IMG=... lines for tests
    qemu-patches/build.py --stock    # the same source and configuration, no series
    qemu-patches/build.py --iotests [TEST ...]

Steps, each resumable (a step's result is made under a temporary name and
renamed, or marked by a stamp written last; all of it under one lock):

1. source: ``apt-get source --download-only qemu=<version>`` with a private
   apt configuration (deb-src lines for trixie, trixie-updates and
   trixie-security, lists and archives under the cache; /etc/apt is never
   read or written), then ``dpkg-source -x``, which applies Debian's
   patches.  The tree becomes the single commit of a git repository: the
   base the series is applied to.
2. series: ``git am`` of ``qemu-patches/0*.patch`` (the cover letter
   excluded) in a throwaway clone of the base.  With ``--stock`` there is
   no series: the commit built is the base itself.
3. build: one long-lived work tree per source version and configuration is
   moved to the series commit with ``git checkout`` (only files that differ
   are rewritten, so ninja rebuilds only what a new series changed),
   configured once (small build: x86_64-softmmu + tools, default features
   off) and built with ninja for the five binaries the tests and iotests
   need.  ``--stock`` has a work tree of its own at the base commit: the
   series changes the QAPI schema, whose generated headers most of QEMU
   includes, so sharing one tree cost a near-full rebuild to the base and
   another back to the series (about 5 minutes each way on 2 cores, against
   about 4 for a whole build).
4. install: the binaries are copied to ``<cache>/qemu/<key>/bin`` where key
   hashes the source version, the configuration and the series (an empty
   one for ``--stock``, so the stock build has a key of its own).  A warm
   run finds ``<key>/stamp`` and does nothing else.

``--stock`` is what the migration compatibility test runs against (a
pageshare QEMU migrating to and from a QEMU without the series): the same
Debian source, patches and configuration, so the series is the only
difference; it is not Debian's binary package (other configuration).

Cache: ``${PAGESHARE_CACHE:-~/.cache/pageshare}/qemu``.  Nothing is written
to the git tree this script lives in.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# The cache root and the Debian mirror and private apt configuration, shared
# with the analyzer and ktest.py.
from pageshare import cache, debian

HERE = Path(__file__).resolve().parent

CACHE = cache.cache_root() / "qemu"
# The series was written and checked against this upstream release; Debian
# revisions of it (security updates) are taken as they come.
UPSTREAM = "10.0"
DEFAULT_VERSION = os.environ.get("PAGESHARE_QEMU_VERSION", "")  # "" = newest 1:10.0.*

# Debian packages needed to build (checked with dpkg-query, installed if root).
BUILD_DEPS = [
    "gcc",
    "make",
    "ninja-build",
    "pkg-config",
    "python3-venv",
    "dpkg-dev",
    "git",
    "flex",
    "bison",
    "libglib2.0-dev",
    "libpixman-1-dev",
    "zlib1g-dev",
    "libzstd-dev",
    "xz-utils",
    # firmware for qemu-system (the +ds source has no blobs): Debian's
    "seabios",
    "qemu-system-data",
]
FIRMWARE_DIRS = ["/usr/share/seabios", "/usr/share/qemu", "/usr/lib/ipxe/qemu"]
PIP_DEPS = ["meson>=1.5,<1.9", "pycotap>=1.1.0"]

# The note's "smaller build": one system target plus the tools, every
# optional feature off except the few a test needs; default devices are
# kept (the --without-default-devices configuration is not tested upstream
# for x86_64), but only the binaries below are built.
CONFIGURE = [
    "--target-list=x86_64-softmmu",
    "--without-default-features",
    "--enable-tools",
    "--enable-kvm",
    "--enable-tcg",
    "--enable-pixman",
    "--disable-docs",
    "--disable-user",
    "--disable-guest-agent",
    "--disable-plugins",
    "--disable-rust",
    "--disable-download",
    "--disable-qom-cast-debug",
    "--audio-drv-list=",
    "--enable-trace-backends=log",
    "--disable-install-blobs",
    # multifd's zstd compression, what operators migrate with on slow links
    "--enable-zstd",
]
TARGETS = [
    "qemu-img",
    "qemu-io",
    "qemu-nbd",
    "storage-daemon/qemu-storage-daemon",
    "qemu-system-x86_64",
]
BINARIES = ["qemu-img", "qemu-io", "qemu-nbd", "qemu-storage-daemon", "qemu-system-x86_64"]
GIT_ID = [
    "-c",
    "user.name=pageshare build",
    "-c",
    "user.email=build@pageshare.invalid",
    "-c",
    "commit.gpgsign=false",
]
BASE_DATE = "2025-01-01T00:00:00Z"


def log(msg: str) -> None:
    print(f"[build.py {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    p: subprocess.CompletedProcess[str] = subprocess.run(cmd, check=True, text=True, **kw)
    return p


def nice() -> list[str]:
    return ["nice", "-n", "10"]


# --------------------------------------------------------------------------- apt


class PrivateApt(debian.PrivateApt):
    """apt-get with its own sources (deb-src only), lists and archives."""

    def __init__(self, root: Path) -> None:
        super().__init__(root, debian.sources(["trixie"], kind="deb-src"), sandbox_root=True)

    def update(self) -> None:
        log("apt-get update (private deb-src configuration for trixie)")
        run(self.command("apt-get", "update", "-qq"))
        (self.root / "updated").write_text(str(time.time()))

    def versions(self) -> list[str]:
        p = subprocess.run(
            self.command("apt-cache", "showsrc", "qemu"), capture_output=True, text=True
        )
        out = []
        pkg = None
        for line in p.stdout.splitlines():
            if line.startswith("Package: "):
                pkg = line.split()[1]
            elif line.startswith("Version: ") and pkg == "qemu":
                out.append(line.split()[1])
        return out

    def source(self, version: str, dest: Path) -> Path:
        dest.mkdir(parents=True, exist_ok=True)
        run(
            self.command("apt-get", "source", "--download-only", "-qq", f"qemu={version}"),
            cwd=dest,
            stdout=subprocess.DEVNULL,
        )
        dscs = list(dest.glob("qemu_*.dsc"))
        if len(dscs) != 1:
            raise SystemExit(f"apt-get source left {dscs} in {dest}")
        return dscs[0]


def newest(versions: list[str]) -> str:
    def key(v: str) -> tuple[int, ...]:
        # good enough for 1:10.0.N+ds-R+deb13uM; dpkg decides ties below
        return tuple(int(x) for x in __import__("re").findall(r"\d+", v))

    want = [v for v in versions if v.split(":", 1)[-1].startswith(UPSTREAM + ".")]
    if not want:
        raise SystemExit(f"no qemu {UPSTREAM}.x source in trixie's index: {versions}")
    return sorted(want, key=key)[-1]


def resolve_version(apt: PrivateApt, requested: str, refresh: bool) -> str:
    if refresh or not (apt.root / "updated").exists():
        apt.update()
    if requested:
        return requested
    vs = apt.versions()
    if not vs:
        apt.update()
        vs = apt.versions()
    return newest(vs)


# --------------------------------------------------------------------------- steps


def ensure_deps() -> None:
    missing = []
    for pkg in BUILD_DEPS:
        p = subprocess.run(
            ["dpkg-query", "-W", "-f=${Status}", pkg], capture_output=True, text=True
        )
        if "install ok installed" not in p.stdout:
            missing.append(pkg)
    if not missing:
        return
    if os.geteuid() != 0:
        raise SystemExit(f"missing build dependencies: {' '.join(missing)} (apt-get install them)")
    log(f"installing {' '.join(missing)}")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing], env=env)


def ensure_pyvenv() -> Path:
    """A venv with meson >= 1.5 (Debian 12 has 1.0); QEMU's configure makes
    its own venv on top of the Python it is given and finds meson there."""
    venv = CACHE / "pyvenv"
    stamp = venv / ".pageshare-ok"
    want = json.dumps(PIP_DEPS)
    if stamp.exists() and stamp.read_text() == want:
        return venv / "bin" / "python3"
    log("creating the Python venv for meson")
    shutil.rmtree(venv, ignore_errors=True)
    run(
        [
            sys.executable if sys.prefix == sys.base_prefix else "/usr/bin/python3",
            "-m",
            "venv",
            str(venv),
        ]
    )
    run([str(venv / "bin/pip"), "install", "-q", "--disable-pip-version-check", *PIP_DEPS])
    stamp.write_text(want)
    return venv / "bin" / "python3"


def ensure_base(apt: PrivateApt, version: str) -> Path:
    """The source package, extracted with Debian's patches, as a git repo
    with one commit.  Returns the repo path."""
    root = CACHE / "src" / version.replace(":", "_")
    repo = root / "git"
    if (repo / ".pageshare-ok").exists():
        return repo
    dl = root / "dl"
    dsc = next(iter(dl.glob("qemu_*.dsc")), None) if dl.exists() else None
    if dsc is None or not all((dl / f).exists() for f in _dsc_files(dsc)):
        log(f"downloading the qemu {version} source package")
        dsc = apt.source(version, dl)
    tmp = root / "git.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    log(f"dpkg-source -x {dsc.name} (applies Debian's patches)")
    run(["dpkg-source", "--no-check", "-x", str(dsc), str(tmp)], stdout=subprocess.DEVNULL)
    # The .pc directory is quilt's bookkeeping, not source.
    shutil.rmtree(tmp / ".pc", ignore_errors=True)
    log("committing the tree as the base of the series")
    run(["git", "init", "-q", str(tmp)])
    run(["git", *GIT_ID, "-C", str(tmp), "add", "-A", "-f"])
    env = dict(os.environ, GIT_AUTHOR_DATE=BASE_DATE, GIT_COMMITTER_DATE=BASE_DATE)
    run(
        [
            "git",
            *GIT_ID,
            "-C",
            str(tmp),
            "commit",
            "-q",
            "-m",
            f"QEMU {version} (Debian source package, Debian patches applied)",
        ],
        env=env,
    )
    run(["git", "-C", str(tmp), "tag", "base"])
    (tmp / ".pageshare-ok").write_text(version)
    shutil.rmtree(repo, ignore_errors=True)
    tmp.rename(repo)
    return repo


def _dsc_files(dsc: Path) -> list[str]:
    out, on = [], False
    for line in dsc.read_text(errors="replace").splitlines():
        if line.startswith("Files:"):
            on = True
            continue
        if on:
            if not line.startswith(" "):
                break
            out.append(line.split()[-1])
    return out


def series_dir() -> Path:
    """qemu-patches/, or $PAGESHARE_QEMU_SERIES (to build another series,
    e.g. a deliberately broken one that the tests must catch)."""
    return Path(os.environ.get("PAGESHARE_QEMU_SERIES", HERE))


def series() -> list[Path]:
    return sorted(p for p in series_dir().glob("0*.patch") if not p.name.startswith("0000-"))


def key_for(version: str, patches: list[Path]) -> str:
    h = hashlib.sha256()
    h.update(version.encode() + b"\0")
    h.update(json.dumps([CONFIGURE, TARGETS, PIP_DEPS]).encode() + b"\0")
    for p in patches:
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def apply_series(base: Path, patches: list[Path], key: str) -> str:
    """git am the series in a throwaway clone; returns the commit id (the
    objects are fetched into the base repo, so the clone can go).  No
    patches (the stock build): the base commit."""
    if not patches:
        return run(
            ["git", "-C", str(base), "rev-parse", "base^{commit}"], capture_output=True
        ).stdout.strip()
    ref = f"refs/series/{key}"
    p = subprocess.run(
        ["git", "-C", str(base), "rev-parse", "-q", "--verify", ref], capture_output=True, text=True
    )
    if p.returncode == 0:
        return p.stdout.strip()
    scratch = CACHE / "tmp" / f"am-{key}"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.parent.mkdir(parents=True, exist_ok=True)
    run(["git", "clone", "-q", "--shared", "--no-checkout", str(base), str(scratch)])
    run(["git", "-C", str(scratch), "checkout", "-q", "--detach", "base"])
    if patches:
        log(f"git am {len(patches)} patches")
        env = dict(os.environ, GIT_COMMITTER_DATE=BASE_DATE)
        r = subprocess.run(
            ["git", *GIT_ID, "-C", str(scratch), "am", "-q", "--keep-cr", *map(str, patches)],
            env=env,
            capture_output=True,
            text=True,
        )
        if r.returncode != 0:
            raise SystemExit(f"the series does not apply:\n{r.stdout}{r.stderr}")
    commit = run(
        ["git", "-C", str(scratch), "rev-parse", "HEAD"], capture_output=True
    ).stdout.strip()
    run(["git", "-C", str(base), "fetch", "-q", str(scratch), f"+{commit}:{ref}"])
    shutil.rmtree(scratch, ignore_errors=True)
    return commit


def configure_hash() -> str:
    return hashlib.sha256(json.dumps([CONFIGURE, PIP_DEPS]).encode()).hexdigest()[:12]


def build(
    base: Path, version: str, commit: str, python: Path, jobs: int, stock: bool = False
) -> Path:
    """Move the work tree (the stock build's own with ``stock``) to
    ``commit`` and build.  Returns the work dir."""
    work = CACHE / (
        f"work-{version.replace(':', '_')}-{configure_hash()}" + ("-stock" if stock else "")
    )
    src, bld = work / "src", work / "build"
    if not (src / ".git").exists():
        shutil.rmtree(src, ignore_errors=True)
        work.mkdir(parents=True, exist_ok=True)
        run(["git", "clone", "-q", "--shared", "--no-checkout", str(base), str(src)])
    run(["git", "-C", str(src), "fetch", "-q", str(base), commit])
    # Only files that differ from the current checkout are rewritten.
    run(["git", "-C", str(src), "checkout", "-q", "-f", "--detach", commit])
    run(["git", "-C", str(src), "clean", "-q", "-fdx", "-e", "/build"])
    cfg_stamp = bld / ".pageshare-configured"
    want_cfg = json.dumps([CONFIGURE, str(python)])
    if not (
        cfg_stamp.exists() and cfg_stamp.read_text() == want_cfg and (bld / "build.ninja").exists()
    ):
        log("configuring")
        shutil.rmtree(bld, ignore_errors=True)
        bld.mkdir(parents=True)
        r = subprocess.run(
            [*nice(), str(src / "configure"), f"--python={python}", *CONFIGURE],
            cwd=bld,
            capture_output=True,
            text=True,
        )
        (work / "configure.log").write_text(r.stdout + r.stderr)
        if r.returncode != 0:
            raise SystemExit(
                f"configure failed (see {work / 'configure.log'}):\n{(r.stdout + r.stderr)[-3000:]}"
            )
        cfg_stamp.write_text(want_cfg)
    log(f"ninja -j{jobs} {' '.join(TARGETS)} (log: {work / 'ninja.log'})")
    t0 = time.monotonic()
    with open(work / "ninja.log", "w") as f:
        nj = subprocess.run(
            [*nice(), "ninja", "-C", str(bld), f"-j{jobs}", *TARGETS],
            stdout=f,
            stderr=subprocess.STDOUT,
        )
    if nj.returncode != 0:
        tail = (work / "ninja.log").read_text(errors="replace")[-4000:]
        raise SystemExit(f"build failed (see {work / 'ninja.log'}):\n{tail}")
    log(f"ninja finished in {time.monotonic() - t0:.0f} s")
    return work


def install(work: Path, out: Path, version: str, commit: str, patches: list[Path]) -> None:
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "bin").mkdir(parents=True)
    bld = work / "build"
    for t, b in zip(TARGETS, BINARIES, strict=True):
        shutil.copy2(bld / t, tmp / "bin" / b)
    # Firmware: the +ds source ships no blobs, so link Debian's where the
    # binaries look for data (<bindir>/../share/qemu, relocatable install).
    fw = tmp / "share" / "qemu"
    fw.mkdir(parents=True)
    for d in FIRMWARE_DIRS:
        for f in sorted(Path(d).glob("*")) if Path(d).is_dir() else []:
            if not (fw / f.name).exists():
                (fw / f.name).symlink_to(f)
    info = {
        "version": version,
        "commit": commit,
        "work": str(work),
        "series": [p.name for p in patches],
        "stock": not patches,
        "configure": CONFIGURE,
        "built": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    (tmp / "info.json").write_text(json.dumps(info, indent=1) + "\n")
    (tmp / "stamp").write_text(commit + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def ensure_built(
    version: str = DEFAULT_VERSION,
    refresh: bool = False,
    jobs: int | None = None,
    stock: bool = False,
) -> Path:
    """The install directory of the build (the series, or with STOCK none:
    the base commit alone), built first unless a stamped one is there."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / ".lock", "w") as lockf:
        fcntl.flock(lockf, fcntl.LOCK_EX)
        apt = PrivateApt(CACHE / "apt")
        patches = [] if stock else series()
        # Warm path: the newest source we already built this series for.
        if not refresh and not version:
            for info in sorted(
                CACHE.glob("*/info.json"), key=lambda p: p.stat().st_mtime, reverse=True
            ):
                d = json.loads(info.read_text())
                if (
                    key_for(d["version"], patches) == info.parent.name
                    and (info.parent / "stamp").exists()
                ):
                    return info.parent
        version = resolve_version(apt, version, refresh)
        key = key_for(version, patches)
        out = CACHE / key
        if (out / "stamp").exists():
            return out
        t0 = time.monotonic()
        if stock:
            log(f"stock build: qemu {version} without the series")
        ensure_deps()
        python = ensure_pyvenv()
        base = ensure_base(apt, version)
        commit = apply_series(base, patches, key)
        work = build(base, version, commit, python, jobs or os.cpu_count() or 2, stock)
        install(work, out, version, commit, patches)
        log(f"built {out} in {time.monotonic() - t0:.0f} s")
        return out


def worktree_for(out: Path) -> Path:
    """The work tree (source + build dir) of a build, moved back to its
    commit if another series was built since (for the iotests)."""
    info = json.loads((out / "info.json").read_text())
    work = Path(info["work"])
    head = run(
        ["git", "-C", str(work / "src"), "rev-parse", "HEAD"], capture_output=True
    ).stdout.strip()
    if head != info["commit"]:
        with open(CACHE / ".lock", "w") as lockf:
            fcntl.flock(lockf, fcntl.LOCK_EX)
            base = ensure_base(PrivateApt(CACHE / "apt"), info["version"])
            build(
                base,
                info["version"],
                info["commit"],
                ensure_pyvenv(),
                os.cpu_count() or 2,
                bool(info.get("stock")),
            )
    return work


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--qemu-version",
        default=DEFAULT_VERSION,
        help="Debian version of the qemu source package (default: newest 1:10.0.*)",
    )
    ap.add_argument(
        "--refresh",
        action="store_true",
        help="apt-get update the private index and re-resolve the version",
    )
    ap.add_argument("-j", "--jobs", type=int)
    ap.add_argument(
        "--stock",
        action="store_true",
        help="build the same source and configuration without the series "
        "(the base commit; its own key, in the same work tree)",
    )
    ap.add_argument(
        "--print-env",
        action="store_true",
        help="print QEMU_*=path lines (shell syntax) instead of the directory",
    )
    ap.add_argument(
        "--worktree", action="store_true", help="print the source/build work tree of this build"
    )
    a = ap.parse_args()
    out = ensure_built(a.qemu_version, a.refresh, a.jobs, stock=a.stock)
    if a.print_env:
        b = out / "bin"
        for var, name in [
            ("QEMU_IMG", "qemu-img"),
            ("QEMU_IO", "qemu-io"),
            ("QEMU_NBD", "qemu-nbd"),
            ("QSD", "qemu-storage-daemon"),
            ("QEMU_SYSTEM", "qemu-system-x86_64"),
        ]:
            print(f"{var}={b / name}")
    elif a.worktree:
        print(worktree_for(out))
    else:
        print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
