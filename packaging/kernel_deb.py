#!/usr/bin/env python3
"""Build the patched kernel as a Debian host kernel package, cached by its inputs.

    packaging/kernel_deb.py            # build it, or find it built; prints the .debs
    packaging/kernel_deb.py --json     # {"ok": true, "image": ..., "headers": ..., ...}
    packaging/kernel_deb.py --config-only   # write and check .config, no build

What is built:

- the source: Debian's linux-source-6.12 with the merge_pages series
  (kernel-syscall/patches), unpacked and patched by kernel-syscall/ktest.py
  exactly as the tests' kernels are;
- the configuration: Debian's own for its cloud kernel
  (``config.amd64_none_cloud-amd64`` from ``linux-config-6.12`` of the same
  version: the full distribution configuration, about 1,100 modules, not
  the tests' tinyconfig), changed only where a build outside Debian's
  packaging must (``ADJUSTMENTS``): Debian's trusted and revocation key
  files live in its source package, not in linux-source, so module signing
  uses a key made at build time (the kernel's default); the DWARF debug
  info is left out (Debian ships it in a separate -dbg package; the
  analyzer needs the guests' debug info, not the host's); the release gets
  ``-pageshare-cloud-amd64``, so it installs beside Debian's kernels;
- the packaging: the kernel's own ``make bindeb-pkg``:
  ``linux-image-<release>`` (kernel, modules, System.map, config, and
  maintainer scripts that run /etc/kernel/postinst.d: initramfs-tools makes
  the initrd, update-grub adds the boot entry, which pageshare-host's
  /etc/default/grub.d/pageshare-kernel.cfg makes the default: this package
  cannot ship that file, since two releases installed side by side would
  both own it) and
  ``linux-headers-<release>``, version ``<Debian's>+pageshare<N>``
  (``PACKAGE_REVISION``: bump it when the series changes in a way the key
  does not show).

The result lands in ``$PAGESHARE_CACHE/packages/linux-image/<key>/``, where
key hashes the source, the patched tree, the configuration, the
adjustments, the module signing certificate and this recipe; a warm run
finds ``<key>/meta.json``.

Made to be reproducible by its inputs: two builds of the same inputs
should give the same bytes in both .debs, and ``--check-reproducible``
checks that (it builds once more from scratch in another directory and
compares; docs/benchmarks.md has its last result).  What would otherwise
differ is fixed by the inputs: the build time (uname -v, the changelog,
the files' times) is the newest ``Date:`` of the series' patches; user,
host and maintainer are constants (the build number is the package's
revision); and the modules are signed with a
kept key, not one made at each build: ``--signing-key`` (or
``$PAGESHARE_KERNEL_SIGNING_KEY``), a PEM file with the private key and
its certificate (the one to enroll for Secure Boot, docs/install.md), else
one made once and kept in the cache (``signing/signing_key.pem``).  The
private key is not in either package.  The
build runs in its own git worktree, with its build directory inside, so a
rebuild after a series change recompiles only what changed, and ktest's
source tree is locked only while the series is applied (not for the build).

A cold build takes about 40 minutes on 2 cores (docs/benchmarks.md), which is
why it is not part of ``make test``: ``make kernel-package`` builds it and
``make kernel-package-test`` installs it into a golden image and boots it.
"""

from __future__ import annotations

import argparse
import contextlib
import email.utils
import fcntl
import filecmp
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from pageshare.cache import cache_root
from pageshare_tools import ktestlib as ktest

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

CONFIG_PACKAGE = "linux-config-6.12"
CONFIG_NAME = "config.amd64_none_cloud-amd64.xz"
FLAVOUR = "cloud-amd64"
LOCALVERSION = f"-pageshare-{FLAVOUR}"
PACKAGE_REVISION = 1
RECIPE = "4"  # bump when the build below changes what it makes
SIGNING_KEY_ENV = "PAGESHARE_KERNEL_SIGNING_KEY"
# Where the build finds the key, relative to its build directory: the same
# string in every build's .config (which the package ships), and not the
# kernel's default certs/signing_key.pem, which its Makefile would replace
# with a new key.
SIGNING_KEY_IN_BUILD = "pageshare-signing/signing_key.pem"
# The build directory, inside the source tree: the kernel's Makefile then
# names the tree "..", not by its absolute path, which would otherwise land
# in the headers package (the -fverbose-asm comments of
# scripts/mod/devicetable-offsets.s, which no prefix map rewrites), and
# the package would depend on where it was built.
BUILD_DIR_IN_TREE = "pageshare-build"
DEB_OUTPUTS = (".deb", ".buildinfo", ".changes")
# The same in every build, whoever and wherever builds.
BUILDER = "pageshare"
MAINTAINER_EMAIL = "pageshare@localhost"
# (option, value) set on Debian's configuration; "n" unsets.
ADJUSTMENTS = (
    ("CONFIG_SYSTEM_TRUSTED_KEYS", '""'),
    ("CONFIG_SYSTEM_REVOCATION_KEYS", '""'),
    ("CONFIG_DEBUG_INFO_DWARF5", "n"),
    ("CONFIG_DEBUG_INFO_DWARF_TOOLCHAIN_DEFAULT", "n"),
    ("CONFIG_DEBUG_INFO_BTF", "n"),
    ("CONFIG_DEBUG_INFO_NONE", "y"),
    ("CONFIG_LOCALVERSION", f'"{LOCALVERSION}"'),
)
# What the series needs and Debian's configuration must keep (checked after olddefconfig).
REQUIRED = (("CONFIG_KSM", "y"), ("CONFIG_MODULE_SIG", "y"), ("CONFIG_BLK_DEV_INITRD", "y"))


class KernelDebError(Exception):
    """The kernel package could not be built; the message says what to do."""


def log(msg: str) -> None:
    print(f"[kernel-deb] {msg}", file=sys.stderr, flush=True)


def pkg_root() -> Path:
    return cache_root() / "packages" / "linux-image"


def ensure_config(root: Path, version: str) -> Path:
    """Debian's cloud-amd64 configuration of the source's very version."""
    installed = Path("/usr/src") / CONFIG_PACKAGE / CONFIG_NAME
    if installed.exists() and ktest.host_package_version(CONFIG_PACKAGE) == version:
        return installed
    out = root / "config" / version / CONFIG_NAME
    if out.exists():
        return out
    log(f"downloading {CONFIG_PACKAGE} {version} with a private apt configuration")
    pkgdir = root / "config" / version / "deb"
    pkgdir.mkdir(parents=True, exist_ok=True)
    apt = ktest.PrivateApt(root / "apt")
    ktest.run(apt.command("apt-get", "update", "-qq"), capture=True)
    ktest.run(
        apt.command("apt-get", "download", f"{CONFIG_PACKAGE}={version}"), cwd=pkgdir, capture=True
    )
    deb = next(pkgdir.glob(f"{CONFIG_PACKAGE}_*.deb"), None)
    if deb is None:
        raise KernelDebError(
            f"apt-get download {CONFIG_PACKAGE}={version} gave no .deb; "
            f"the source {version} needs its configuration package of the "
            "same version from Debian's archive"
        )
    unpacked = pkgdir / "x"
    ktest.run(["dpkg-deb", "-x", str(deb), str(unpacked)])
    shutil.copyfile(unpacked / "usr/src" / CONFIG_PACKAGE / CONFIG_NAME, out)
    shutil.rmtree(unpacked)
    return out


def read_config(path: Path) -> dict[str, str]:
    have: dict[str, str] = {}
    for line in path.read_text().splitlines():
        if line.startswith("CONFIG_") and "=" in line:
            k, v = line.split("=", 1)
            have[k] = v
        elif line.startswith("# CONFIG_") and line.endswith(" is not set"):
            have[line[2 : -len(" is not set")]] = "n"
    return have


def package_key(src: ktest.Source, head: str, config: Path, cert_sha256: str) -> str:
    h = hashlib.sha256()
    h.update(f"recipe={RECIPE}\nrevision={PACKAGE_REVISION}\nsource={src.key}\n".encode())
    h.update(ktest.tree_id(src, head).encode())
    h.update(hashlib.sha256(config.read_bytes()).hexdigest().encode())
    h.update(repr(ADJUSTMENTS).encode())
    h.update(f"signing-cert={cert_sha256}\n".encode())
    return h.hexdigest()[:16]


def build_epoch(patches: list[Path]) -> int:
    """The newest ``Date:`` of the series' patches, as seconds since the
    epoch: the build's time, fixed by its inputs."""
    dates = []
    for p in patches:
        for line in p.read_text(errors="replace").splitlines():
            if line.startswith("Date: "):
                dates.append(email.utils.parsedate_to_datetime(line[6:]).timestamp())
                break
            if not line:  # the end of the mail header
                break
    if not dates:
        raise KernelDebError(
            f"none of the series' {len(patches)} patches has a Date: header "
            "(git format-patch writes one); the build's time is taken from them"
        )
    return int(max(dates))


def signing_key(root: Path, given: Path | None) -> Path:
    """The PEM file the modules are signed with: the operator's (given, else
    $PAGESHARE_KERNEL_SIGNING_KEY), else one made once and kept in the
    cache, so that a rebuild signs alike."""
    if given is None and os.environ.get(SIGNING_KEY_ENV):
        given = Path(os.environ[SIGNING_KEY_ENV])
    if given is not None:
        text = given.read_text(errors="replace") if given.is_file() else ""
        if "PRIVATE KEY-----" not in text or "BEGIN CERTIFICATE-----" not in text:
            raise KernelDebError(
                f"signing key {given}: not a PEM file with both a private key and its "
                "certificate; make one with `openssl req -new -nodes -utf8 -sha256 "
                "-days 36500 -batch -x509 -subj '/CN=my kernel key/' -outform PEM "
                "-out key.pem -keyout key.pem` (or concatenate your key and certificate)"
            )
        return given
    kept = root / "signing" / "signing_key.pem"
    if not kept.exists():
        kept.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        log(f"making the module signing key, kept for later builds: {kept}")
        fd, name = tempfile.mkstemp(dir=kept.parent, suffix=".tmp")  # mode 0600
        os.close(fd)
        tmp = Path(name)
        try:
            ktest.run(
                [
                    "openssl", "req", "-new", "-nodes", "-utf8", "-sha256", "-days", "36500",
                    "-batch", "-x509", "-newkey", "rsa:4096",
                    "-subj", "/CN=pageshare kernel module signing key/",
                    "-addext", "basicConstraints=critical,CA:FALSE",
                    "-addext", "keyUsage=digitalSignature",
                    "-addext", "extendedKeyUsage=codeSigning",
                    "-outform", "PEM", "-out", str(tmp), "-keyout", str(tmp),
                ],
                capture=True,
            )  # fmt: skip
            tmp.chmod(0o600)
            # link, not rename: of two builds making a key at once, the first
            # one's stays and both sign with it
            with contextlib.suppress(FileExistsError):
                os.link(tmp, kept)
        finally:
            tmp.unlink(missing_ok=True)
    return kept


def cert_sha256(key: Path) -> str:
    """The SHA-256 fingerprint of the key's certificate (DER), as mokutil
    and `openssl x509 -fingerprint -sha256` show it, lower case, no colons."""
    der = subprocess.run(
        ["openssl", "x509", "-in", str(key), "-outform", "DER"], check=True, capture_output=True
    ).stdout
    return hashlib.sha256(der).hexdigest()


def configure(tree: Path, build: Path, config: Path, key: Path, logfile: Path) -> None:
    build.mkdir(parents=True, exist_ok=True)
    with (build / ".config").open("wb") as f:
        subprocess.run(["xz", "-dc", str(config)], stdout=f, check=True)
    in_build = build / SIGNING_KEY_IN_BUILD
    in_build.parent.mkdir(mode=0o700, exist_ok=True)
    shutil.copyfile(key, in_build)
    in_build.chmod(0o600)
    cmd = [str(tree / "scripts/config"), "--file", str(build / ".config")]
    cmd += ["--set-str", "MODULE_SIG_KEY", SIGNING_KEY_IN_BUILD]
    for option, value in ADJUSTMENTS:
        name = option.removeprefix("CONFIG_")
        if value == "n":
            cmd += ["--disable", name]
        elif value == "y":
            cmd += ["--enable", name]
        else:
            cmd += ["--set-str", name, value.strip('"')]
    ktest.run(cmd, logfile=logfile)
    make(tree, build, "olddefconfig", logfile=logfile)
    have = read_config(build / ".config")
    # An empty string option whose dependency is off is simply absent.
    bad = [
        f"{k}={v} (got {have.get(k, 'n')})"
        for k, v in (
            *ADJUSTMENTS,
            *REQUIRED,
            ("CONFIG_MODULE_SIG_KEY", f'"{SIGNING_KEY_IN_BUILD}"'),
        )
        if have.get(k, "n") != v and not (v == '""' and k not in have)
    ]
    if bad:
        raise KernelDebError("configuration options did not stick: " + ", ".join(bad))


def make(
    tree: Path,
    build: Path,
    *targets: str,
    logfile: Path,
    extra: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> None:
    ktest.run(
        [
            *ktest.nice_prefix(),
            "make",
            "-C",
            str(tree),
            f"O={build}",
            "ARCH=x86_64",
            f"-j{ktest.jobs()}",
            *extra,
            *targets,
        ],
        logfile=logfile,
        env=env,
    )


# 6.12's scripts/package/mkdebian dates the changelog (which dpkg installs
# as changelog.Debian.gz) with a bare `date -R`, which ignores
# SOURCE_DATE_EPOCH.  This `date`, first on the build's PATH, answers that
# one call with SOURCE_DATE_EPOCH's time and passes every other call on.
DATE_SHIM = """#!/bin/sh
if [ "$*" = "-R" ] && [ -n "${SOURCE_DATE_EPOCH:-}" ]; then
    exec /bin/date -R -d "@$SOURCE_DATE_EPOCH"
fi
exec /bin/date "$@"
"""


def build_env(inp: Inputs, work: Path) -> dict[str, str]:
    """The environment that makes the .debs' bytes depend on the inputs
    alone: the time in uname -v and the headers archive
    (KBUILD_BUILD_TIMESTAMP), the files' times in the .debs (dpkg-deb clamps
    them to SOURCE_DATE_EPOCH) and the changelog's date (DATE_SHIM), all the
    series' time; the user, host and maintainer (else the builder's
    names) and the changelog's distribution (else the build machine's
    codename).  The build number in uname -v needs nothing: bindeb-pkg's
    debian/rules sets KBUILD_BUILD_VERSION to the package's revision."""
    bindir = work / "bin"
    bindir.mkdir(exist_ok=True)
    (bindir / "date").write_text(DATE_SHIM)
    (bindir / "date").chmod(0o755)
    return dict(
        os.environ,
        PATH=f"{bindir}:{os.environ.get('PATH', '/usr/bin:/bin')}",
        KBUILD_BUILD_TIMESTAMP=email.utils.formatdate(inp.epoch, usegmt=True),
        KBUILD_BUILD_USER=BUILDER,
        KBUILD_BUILD_HOST=BUILDER,
        SOURCE_DATE_EPOCH=str(inp.epoch),
        DEBEMAIL=MAINTAINER_EMAIL,
        DEBFULLNAME=BUILDER,
        KDEB_CHANGELOG_DIST="unstable",
        TZ="UTC",  # `date -R` writes the local time
    )


def checkout(src: ktest.Source, tree: Path, head: str) -> None:
    """A worktree of ktest's repository at head, for this build alone."""
    if not (tree / ".git").exists():
        if tree.exists():
            shutil.rmtree(tree)
        ktest.run(["git", "worktree", "prune"], cwd=src.repo)
        ktest.run(
            ["git", *ktest.GIT_ID, "worktree", "add", "-q", "--detach", str(tree), head],
            cwd=src.repo,
        )
        return
    ktest.run(["git", *ktest.GIT_ID, "checkout", "-q", "-f", "--detach", head], cwd=tree)
    ktest.run(["git", "clean", "-q", "-f", "-d", "-e", f"/{BUILD_DIR_IN_TREE}/"], cwd=tree)


def _found(outdir: Path) -> dict[str, object] | None:
    meta = outdir / "meta.json"
    if not meta.exists():
        return None
    m: dict[str, object] = json.loads(meta.read_text())
    if all((outdir / str(m[k])).exists() for k in ("image", "headers")):
        return {**m, "dir": str(outdir)}
    return None


@dataclass
class Inputs:
    """Everything a build is made from; the package key hashes it."""

    src: ktest.Source
    version: str  # Debian's source version
    patches: list[Path]
    head: str  # the series' last commit in ktest's repository
    config: Path  # Debian's cloud-amd64 configuration, xz
    signing_key: Path
    cert_sha256: str
    epoch: int

    @property
    def key(self) -> str:
        return package_key(self.src, self.head, self.config, self.cert_sha256)


def inputs(signing_key_path: Path | None) -> Inputs:
    root = ktest.cache_root()
    src = ktest.ensure_source(root)
    version = (src.repo.parent / ".ready").read_text().strip()
    patches = ktest.series_files()
    with src.locked():
        commits = ktest.apply_series(src, patches)
    key = signing_key(pkg_root(), signing_key_path)
    return Inputs(
        src=src,
        version=version,
        patches=patches,
        head=commits[-1],
        config=ensure_config(root, version),
        signing_key=key,
        cert_sha256=cert_sha256(key),
        epoch=build_epoch(patches),
    )


def make_debs(inp: Inputs, work: Path, config_only: bool = False) -> dict[str, object]:
    """Configure and run bindeb-pkg in work/ (its tree, the build directory inside);
    return the image and headers .debs' paths (in work/) and what was built."""
    tree = work / "tree"
    build_dir = tree / BUILD_DIR_IN_TREE
    logfile = work / "build.log"
    logfile.write_text("")
    # recipe 3 and before built in work/build, beside the tree
    shutil.rmtree(work / "build", ignore_errors=True)
    checkout(inp.src, tree, inp.head)
    configure(tree, build_dir, inp.config, inp.signing_key, logfile)
    if config_only:
        log(f"configured: {build_dir}/.config")
        return {"config": str(build_dir / ".config")}

    # dpkg-buildpackage writes the .debs, .buildinfo and .changes in the
    # build directory's parent: the tree
    def outputs() -> list[Path]:
        return [f for d in (work, tree) for f in d.glob("*.*") if f.suffix in DEB_OUTPUTS]

    for old in outputs():
        old.unlink()
    pkgversion = f"{inp.version}+pageshare{PACKAGE_REVISION}"
    log(
        f"make bindeb-pkg ({len(inp.patches)} patches on Debian's {inp.version}, "
        f"{FLAVOUR} configuration; about 40 minutes on 2 cores; log: {logfile})"
    )
    t0 = time.monotonic()
    # LOCALVERSION= (set, if empty): setlocalversion would otherwise
    # append "+" to the release, the tree being a git checkout that is
    # not at a tag.  The release's suffix is CONFIG_LOCALVERSION's.
    # HOSTCFLAGS: objtool, which the headers package ships, is the one host
    # program built with -g; its DWARF names its source and build
    # directories, here relative to the tree.
    make_vars = (
        f"HOSTCFLAGS=-ffile-prefix-map={tree}/=",
        "LOCALVERSION=",
        f"KDEB_PKGVERSION={pkgversion}",
        "KDEB_SOURCENAME=linux-pageshare",
    )
    make(tree, build_dir, "bindeb-pkg", logfile=logfile, extra=make_vars, env=build_env(inp, work))
    seconds = time.monotonic() - t0
    release = (build_dir / "include/config/kernel.release").read_text().strip()
    debs = {d.name: d for d in tree.glob("*.deb")}
    image = next((n for n in debs if n.startswith(f"linux-image-{release}_")), None)
    headers = next((n for n in debs if n.startswith(f"linux-headers-{release}_")), None)
    if not image or not headers:
        raise KernelDebError(
            f"bindeb-pkg made {sorted(debs)}, not linux-image-{release} "
            f"and linux-headers-{release}; see {logfile}"
        )
    for name in (image, headers):
        debs[name].rename(work / name)
    for other in outputs():
        if other.parent == tree:
            other.unlink()
    return {
        "image": image,
        "headers": headers,
        "release": release,
        "version": pkgversion,
        "source": inp.version,
        "commit": inp.head,
        "series": [p.name for p in inp.patches],
        "config": CONFIG_NAME,
        "signing_cert_sha256": inp.cert_sha256,
        "build_epoch": inp.epoch,
        "build_seconds": round(seconds),
        "jobs": ktest.jobs(),
        "built_at": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def build(
    force: bool = False,
    config_only: bool = False,
    signing_key_path: Path | None = None,
    inp: Inputs | None = None,
) -> dict[str, object]:
    inp = inp or inputs(signing_key_path)
    outdir = pkg_root() / inp.key
    found = _found(outdir)
    if found and not force and not config_only:
        log(f"cached: {outdir}")
        return found
    work = pkg_root() / f"work-{inp.src.key}"
    work.mkdir(parents=True, exist_ok=True)
    with open(work / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        meta = make_debs(inp, work, config_only)
        if config_only:
            return meta
        tmp = outdir.with_name(outdir.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for which in ("image", "headers"):
            shutil.move(str(work / str(meta[which])), tmp / str(meta[which]))
        shutil.copyfile(work / "build.log", tmp / "build.log")
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
        shutil.rmtree(outdir, ignore_errors=True)
        tmp.rename(outdir)
    log(f"built in {meta['build_seconds']} s: {outdir / str(meta['image'])}")
    return {**meta, "dir": str(outdir)}


def differing_files(a: Path, b: Path) -> list[str]:
    """The paths whose bytes differ between two unpacked trees, or that only
    one of them has."""
    out: list[str] = []

    def walk(d: filecmp.dircmp[str], prefix: str) -> None:
        out.extend(f"{prefix}{n} (only in one)" for n in d.left_only + d.right_only)
        out.extend(f"{prefix}{n}" for n in d.funny_files)
        _, mismatch, errors = filecmp.cmpfiles(d.left, d.right, d.common_files, shallow=False)
        out.extend(f"{prefix}{n}" for n in mismatch + errors)
        for name, sub in d.subdirs.items():
            walk(sub, f"{prefix}{name}/")

    walk(filecmp.dircmp(a, b), "")
    return sorted(out)


@dataclass
class Reproduced:
    dir: str  # the cached package's directory
    second_build_seconds: int
    differ: dict[str, list[str]]  # "image"/"headers" -> files inside that differ

    @property
    def reproducible(self) -> bool:
        return not self.differ


def check_reproducible(signing_key_path: Path | None = None) -> Reproduced:
    """Build the package (or find it built), build it once more from an
    empty work directory at another path, and compare the .debs byte for
    byte; when they differ, name the files inside that differ."""
    inp = inputs(signing_key_path)
    first = build(inp=inp)
    work = pkg_root() / f"repro-{inp.key}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        second = make_debs(inp, work)
        differ: dict[str, list[str]] = {}
        for which in ("image", "headers"):
            a = Path(str(first["dir"])) / str(first[which])
            b = work / str(second[which])
            if a.name != b.name:
                differ[which] = [f"named {a.name} and {b.name}"]
            elif not filecmp.cmp(a, b, shallow=False):
                with tempfile.TemporaryDirectory(dir=work) as t:
                    ua, ub = Path(t) / "first", Path(t) / "second"
                    for deb, to in ((a, ua), (b, ub)):
                        ktest.run(["dpkg-deb", "-R", str(deb), str(to)])
                    differ[which] = differing_files(ua, ub) or ["the .deb (not its files)"]
        return Reproduced(str(first["dir"]), int(str(second["build_seconds"])), differ)
    finally:
        shutil.rmtree(work / "tree", ignore_errors=True)
        ktest.run(["git", "worktree", "prune"], cwd=inp.src.repo)
        shutil.rmtree(work, ignore_errors=True)


def report_reproducible(result: Reproduced, as_json: bool) -> int:
    if as_json:
        print(
            json.dumps(
                {
                    "ok": result.reproducible,
                    "dir": result.dir,
                    "second_build_seconds": result.second_build_seconds,
                    "differ": result.differ,
                }
            )
        )
    elif result.reproducible:
        print(f"reproducible: a second build from scratch gave the same bytes ({result.dir})")
    else:
        print("NOT reproducible; files that differ:", file=sys.stderr)
        for which, files in result.differ.items():
            for f in files[:40]:
                print(f"  {which}: {f}", file=sys.stderr)
    return 0 if result.reproducible else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--force", action="store_true", help="rebuild even if cached")
    ap.add_argument(
        "--config-only",
        action="store_true",
        help="write and check the configuration, build nothing",
    )
    ap.add_argument(
        "--signing-key",
        type=Path,
        metavar="PEM",
        help="sign the modules with this key (a PEM file holding the private key and "
        f"its certificate; default: ${SIGNING_KEY_ENV}, else a key made once and kept "
        "in the cache)",
    )
    ap.add_argument(
        "--check-reproducible",
        action="store_true",
        help="build (or find built), build again from scratch elsewhere and compare the "
        ".debs byte for byte; exits 1 if they differ, naming the files that do "
        "(twice the build time: about two hours cold on 2 cores)",
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    try:
        if args.check_reproducible:
            return report_reproducible(check_reproducible(args.signing_key), args.json)
        else:
            result = build(
                force=args.force, config_only=args.config_only, signing_key_path=args.signing_key
            )
    except (KernelDebError, ktest.KtestError) as e:
        if args.json:
            print(json.dumps({"ok": False, "error": str(e)}))
        else:
            print(f"kernel-deb: error: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"ok": True, **result}))
    elif "image" in result:
        print(Path(str(result["dir"])) / str(result["image"]))
        print(Path(str(result["dir"])) / str(result["headers"]))
    else:
        print(result["config"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
