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
adjustments and this recipe; a warm run finds ``<key>/meta.json``.  The
build runs in its own git worktree and build directory beside it, so a
rebuild after a series change recompiles only what changed, and ktest's
source tree is locked only while the series is applied (not for the build).

A cold build takes about an hour on 2 cores (docs/benchmarks.md), which is
why it is not part of ``make test``: ``make kernel-package`` builds it and
``make kernel-package-test`` installs it into a golden image and boots it.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import shutil
import subprocess
import sys
import time
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
RECIPE = "2"  # bump when the build below changes what it makes
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


def package_key(src: ktest.Source, head: str, config: Path) -> str:
    h = hashlib.sha256()
    h.update(f"recipe={RECIPE}\nrevision={PACKAGE_REVISION}\nsource={src.key}\n".encode())
    h.update(ktest.tree_id(src, head).encode())
    h.update(hashlib.sha256(config.read_bytes()).hexdigest().encode())
    h.update(repr(ADJUSTMENTS).encode())
    return h.hexdigest()[:16]


def configure(tree: Path, build: Path, config: Path, logfile: Path) -> None:
    build.mkdir(parents=True, exist_ok=True)
    with (build / ".config").open("wb") as f:
        subprocess.run(["xz", "-dc", str(config)], stdout=f, check=True)
    cmd = [str(tree / "scripts/config"), "--file", str(build / ".config")]
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
        for k, v in (*ADJUSTMENTS, *REQUIRED)
        if have.get(k, "n") != v and not (v == '""' and k not in have)
    ]
    if bad:
        raise KernelDebError("configuration options did not stick: " + ", ".join(bad))


def make(
    tree: Path, build: Path, *targets: str, logfile: Path, extra: tuple[str, ...] = ()
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
    ktest.run(["git", "clean", "-q", "-f", "-d"], cwd=tree)


def _found(outdir: Path) -> dict[str, object] | None:
    meta = outdir / "meta.json"
    if not meta.exists():
        return None
    m: dict[str, object] = json.loads(meta.read_text())
    if all((outdir / str(m[k])).exists() for k in ("image", "headers")):
        return {**m, "dir": str(outdir)}
    return None


def build(force: bool = False, config_only: bool = False) -> dict[str, object]:
    root = ktest.cache_root()
    src = ktest.ensure_source(root)
    version = (src.repo.parent / ".ready").read_text().strip()
    patches = ktest.series_files()
    with src.locked():
        commits = ktest.apply_series(src, patches)
    head = commits[-1]
    config = ensure_config(root, version)
    key = package_key(src, head, config)
    outdir = pkg_root() / key
    found = _found(outdir)
    if found and not force and not config_only:
        log(f"cached: {outdir}")
        return found
    work = pkg_root() / f"work-{src.key}"
    work.mkdir(parents=True, exist_ok=True)
    with open(work / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        tree, build_dir = work / "tree", work / "build"
        logfile = work / "build.log"
        logfile.write_text("")
        checkout(src, tree, head)
        configure(tree, build_dir, config, logfile)
        if config_only:
            log(f"configured: {build_dir}/.config")
            return {"config": str(build_dir / ".config")}
        for old in work.glob("*.deb"):
            old.unlink()
        pkgversion = f"{version}+pageshare{PACKAGE_REVISION}"
        log(
            f"make bindeb-pkg ({len(patches)} patches on Debian's {version}, "
            f"{FLAVOUR} configuration; about an hour on 2 cores; log: {logfile})"
        )
        t0 = time.monotonic()
        # LOCALVERSION= (set, if empty): setlocalversion would otherwise
        # append "+" to the release, the tree being a git checkout that is
        # not at a tag.  The release's suffix is CONFIG_LOCALVERSION's.
        env_extra = (
            "LOCALVERSION=",
            f"KDEB_PKGVERSION={pkgversion}",
            "KDEB_SOURCENAME=linux-pageshare",
            "KBUILD_BUILD_USER=pageshare",
            "KBUILD_BUILD_HOST=pageshare",
        )
        make(tree, build_dir, "bindeb-pkg", logfile=logfile, extra=env_extra)
        seconds = time.monotonic() - t0
        release = (build_dir / "include/config/kernel.release").read_text().strip()
        debs = {d.name: d for d in work.glob("*.deb")}
        image = next((n for n in debs if n.startswith(f"linux-image-{release}_")), None)
        headers = next((n for n in debs if n.startswith(f"linux-headers-{release}_")), None)
        if not image or not headers:
            raise KernelDebError(
                f"bindeb-pkg made {sorted(debs)}, not linux-image-{release} "
                f"and linux-headers-{release}; see {logfile}"
            )
        tmp = outdir.with_name(outdir.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for name in (image, headers):
            shutil.move(str(debs[name]), tmp / name)
        for rest in work.glob("*.deb"):
            rest.unlink()
        shutil.copyfile(logfile, tmp / "build.log")
        meta = {
            "image": image,
            "headers": headers,
            "release": release,
            "version": pkgversion,
            "source": version,
            "commit": head,
            "series": [p.name for p in patches],
            "config": CONFIG_NAME,
            "build_seconds": round(seconds),
            "jobs": ktest.jobs(),
            "built_at": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
        shutil.rmtree(outdir, ignore_errors=True)
        tmp.rename(outdir)
    log(f"built in {seconds:.0f} s: {outdir / image}")
    return {**meta, "dir": str(outdir)}


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
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    try:
        result = build(force=args.force, config_only=args.config_only)
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
