#!/usr/bin/env python3
"""Build the merge_pages kernel series, boot it under QEMU and run the tests.

One command does everything (see README.md):

    kernel-syscall/run-tests.sh [--config debug|plain] [--bench]

Steps, each cached under $PAGESHARE_CACHE/kernel (default
~/.cache/pageshare/kernel), outside the git clone:

1. source: Debian's linux-source-6.12 tarball (apt package; if the host's
   apt cannot install it, a private apt configuration under the cache
   downloads it from trixie; /etc/apt is never touched).  Unpacked once into
   a git repository ("base" tag) keyed by the tarball's sha256.
2. series: patches/*.patch are applied with `git am` on a detached "base"
   checkout, so `git format-patch` can regenerate them (see `devtree`).
3. kernel: `make tinyconfig` + config/base.config + config/<config>.config,
   olddefconfig, every requested option verified, then bzImage.  The image is
   cached by a hash of (source, series, config fragments); a warm run does not
   call make at all.  The build directory is kept per config, so a changed
   series rebuilds incrementally.
4. tests: the series' selftests (merge_page_tests) and the kernel's own KSM
   selftests, plus our benchmark, built with gcc -static against the uapi
   headers of that very build; an initramfs with Debian's busybox-static.
5. boot: qemu-system-x86_64 -accel tcg, run the tests, print TAP, scan the
   kernel log for WARN/BUG/lockdep/KASAN/KFENCE reports (any one fails the
   run), exit with the tests' status.

Only the Python standard library is used.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import random
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
PATCHES = HERE / "patches"
CONFIGS = HERE / "config"
GUEST = HERE / "tests"
LIBDIR = HERE / "lib"
UAPI = HERE / "include"
REPO = HERE.parent
# The analyzer's standard-library-only helpers: the cache root and the Debian
# mirror and private apt configuration, shared with the analyzer and build.py.
sys.path.insert(0, str(REPO / "analyzer"))
from pageshare import cache, debian  # noqa: E402

SRC_PACKAGE = "linux-source-6.12"
SRC_TARBALL = Path("/usr/src/linux-source-6.12.tar.xz")
# Bump when the way a kernel is configured or built changes, so that cached
# images built the old way are not reused.
BUILD_RECIPE = "3"

# Author of the series (and of its cover letter).
AUTHOR = ("Pageshare Developers", "dev@pageshare.example")
GIT_ID = ["-c", "user.name=pageshare ktest", "-c", "user.email=ktest@pageshare.invalid",
          "-c", "advice.detachedHead=false", "-c", "gc.auto=0"]

# Kernel log reports that fail a run.  Matched against every line of the
# serial console and of the dmesg dump taken at the end.
BAD_PATTERNS = [
    r"WARNING: CPU: \d+ PID: \d+",
    r"WARNING: .* at ",
    r"\bBUG: ",
    r"kernel BUG at",
    r"Oops: ",
    r"general protection fault",
    r"possible circular locking dependency",
    r"inconsistent lock state",
    r"possible recursive locking",
    r"lockdep: ",
    r"INFO: trying to register non-static key",
    r"suspicious RCU usage",
    r"BUG: KASAN: ",
    r"BUG: KFENCE: ",
    r"UBSAN: ",
    r"Kernel panic",
    r"page dumped because",
    r"bad page state",
    r"list_add corruption",
    r"list_del corruption",
    r"page_table_check",
    r"hung_task",
    r"blocked for more than",
    r"RIP: ",
    # A stack dumped without WARN/BUG: dump_stack() callers such as the
    # fault path's "FAULT_FLAG_ALLOW_RETRY missing" (a user fault taken
    # where it must not be, issue 14's item 4), OOM reports, sysrq.
    r"Call Trace:",
    r"FAULT_FLAG_ALLOW_RETRY missing",
]
BAD_RE = re.compile("|".join(f"(?:{p})" for p in BAD_PATTERNS), re.IGNORECASE)


class KtestError(Exception):
    """A failure with a message that says what to do."""


def log(msg: str) -> None:
    print(f"ktest: {msg}", flush=True)


def cache_root() -> Path:
    return cache.cache_dir("kernel")


def run(cmd: list[str], *, cwd: Path | None = None, env: dict[str, str] | None = None,
        capture: bool = False, check: bool = True,
        logfile: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run a command; with logfile, append its output there instead of the terminal."""
    if logfile is not None:
        with open(logfile, "a") as f:
            f.write(f"\n$ {shlex.join(cmd)}\n")
            f.flush()
            p = subprocess.run(cmd, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT, text=True)
    else:
        p = subprocess.run(cmd, cwd=cwd, env=env, text=True,
                           capture_output=capture)
    if check and p.returncode != 0:
        tail = ""
        if logfile is not None:
            tail = "\n".join(logfile.read_text(errors="replace").splitlines()[-40:])
        elif capture:
            tail = (p.stdout or "")[-2000:] + (p.stderr or "")[-2000:]
        raise KtestError(f"command failed ({p.returncode}): {shlex.join(cmd)}\n{tail}")
    return p


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def nice_prefix() -> list[str]:
    return ["nice", "-n", "10"]


def jobs() -> str:
    return os.environ.get("KTEST_JOBS", str(os.cpu_count() or 2))


# --------------------------------------------------------------------------
# 1. source
# --------------------------------------------------------------------------

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
        run(["apt-get", "install", "-y", "-q", SRC_PACKAGE], capture=True,
            env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
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
    repo: Path      # git repository used for `git am` (its work tree is scratch)
    tree: Path      # git worktree the kernel is built from (O= builds)

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
        run(["git", *GIT_ID, "commit", "-q", "-m",
             f"Linux {ver} (Debian {SRC_PACKAGE})"], cwd=repo)
        run(["git", "tag", "base"], cwd=repo)
        run(["git", *GIT_ID, "worktree", "add", "-q", "--detach", str(tree), "base"], cwd=repo)
        (base / ".ready").write_text(ver + "\n")
    return Source(key, repo, tree)


# --------------------------------------------------------------------------
# 2. series
# --------------------------------------------------------------------------

def series_files() -> list[Path]:
    return sorted(p for p in PATCHES.glob("*.patch") if not p.name.startswith("0000-"))


def series_hash(patches: list[Path]) -> str:
    h = hashlib.sha256()
    for p in patches:
        h.update(p.name.encode() + b"\0")
        h.update(p.read_bytes())
    return h.hexdigest()


def apply_series(src: Source, patches: list[Path]) -> list[str]:
    """git am the series on top of base; return the commit after each patch."""
    memo = src.repo.parent / "series-commits.json"
    data: dict[str, list[str]] = json.loads(memo.read_text()) if memo.exists() else {}
    key = series_hash(patches)
    commits = data.get(key)
    if commits and all(run(["git", "cat-file", "-e", c + "^{commit}"], cwd=src.repo,
                           check=False, capture=True).returncode == 0 for c in commits):
        return commits
    run(["git", *GIT_ID, "am", "--abort"], cwd=src.repo, check=False, capture=True)
    run(["git", *GIT_ID, "checkout", "-q", "-f", "--detach", "base"], cwd=src.repo)
    commits = []
    for p in patches:
        r = run(["git", *GIT_ID, "am", "-q", "--keep-cr", str(p)], cwd=src.repo,
                check=False, capture=True)
        if r.returncode != 0:
            run(["git", *GIT_ID, "am", "--abort"], cwd=src.repo, check=False, capture=True)
            raise KtestError(f"{p.name} does not apply:\n{r.stdout}{r.stderr}")
        commits.append(run(["git", "rev-parse", "HEAD"], cwd=src.repo, capture=True).stdout.strip())
    if not commits:
        commits = [run(["git", "rev-parse", "base"], cwd=src.repo, capture=True).stdout.strip()]
    data[key] = commits
    memo.write_text(json.dumps(data, indent=1))
    return commits


def checkout_tree(src: Source, commit: str) -> None:
    """Point the build tree at commit.  git touches only files that differ,
    so an incremental build recompiles only what the change affects."""
    run(["git", *GIT_ID, "checkout", "-q", "-f", "--detach", commit], cwd=src.tree)
    run(["git", "clean", "-q", "-f", "-d"], cwd=src.tree)


# --------------------------------------------------------------------------
# 3. kernel
# --------------------------------------------------------------------------

def config_fragments(config: str) -> list[Path]:
    # the booted guest's kernel is not a test kernel: tinyconfig + its own
    if config == GUEST_CONFIG:
        frags = [CONFIGS / "guest.config"]
    elif config == BENCH_GUEST_CONFIG:
        frags = [CONFIGS / "guest.config", CONFIGS / "guest-bench.config"]
    else:
        frags = [CONFIGS / "base.config", CONFIGS / f"{config}.config"]
    for f in frags:
        if not f.exists():
            raise KtestError(f"no config fragment {f}")
    return frags


def parse_fragment(path: Path) -> dict[str, str]:
    want: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        m = re.match(r"^(CONFIG_\w+)=(.*)$", line)
        if m:
            want[m.group(1)] = m.group(2)
        m = re.match(r"^# (CONFIG_\w+) is not set$", line)
        if m:
            want[m.group(1)] = "n"
    return want


def tree_id(src: Source, commit: str) -> str:
    return run(["git", "rev-parse", f"{commit}^{{tree}}"], cwd=src.repo,
               capture=True).stdout.strip()


def image_key(src: Source, commit: str, config: str) -> str:
    """Hash of what the kernel is built from: the source tree after the series
    (so a reworded commit message does not cause a rebuild), the config
    fragments and the build recipe."""
    h = hashlib.sha256()
    h.update(f"recipe={BUILD_RECIPE}\nsource={src.key}\nconfig={config}\n".encode())
    h.update(tree_id(src, commit).encode())
    for f in config_fragments(config):
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def make(src: Source, build: Path, *targets: str, logfile: Path,
         extra: list[str] | None = None) -> None:
    cmd = [*nice_prefix(), "make", "-C", str(src.tree), f"O={build}", "ARCH=x86_64",
           f"-j{jobs()}", *(extra or []), *targets]
    run(cmd, logfile=logfile)


def configure(src: Source, build: Path, config: str, logfile: Path) -> None:
    frags = config_fragments(config)
    make(src, build, "tinyconfig", logfile=logfile)
    run([str(src.tree / "scripts/kconfig/merge_config.sh"), "-m", "-O", str(build),
         str(build / ".config"), *map(str, frags)], cwd=build, logfile=logfile)
    make(src, build, "olddefconfig", logfile=logfile)
    have: dict[str, str] = {}
    for line in (build / ".config").read_text().splitlines():
        m = re.match(r"^(CONFIG_\w+)=(.*)$", line)
        if m:
            have[m.group(1)] = m.group(2)
    bad = []
    for f in frags:
        for k, v in parse_fragment(f).items():
            got = have.get(k, "n")
            if got != v:
                bad.append(f"{k}={v} (got {got}) from {f.name}")
    if bad:
        raise KtestError("config options did not stick (missing dependency?):\n  "
                         + "\n  ".join(bad))


def build_kernel(src: Source, commit: str, config: str, outdir: Path, logfile: Path) -> float:
    """Configure and build bzImage + uapi headers at commit; return seconds spent."""
    t0 = time.monotonic()
    build = cache_root() / "build" / f"{src.key}-{config}"
    build.mkdir(parents=True, exist_ok=True)
    checkout_tree(src, commit)
    configure(src, build, config, logfile)
    make(src, build, "bzImage", logfile=logfile)
    hdr = outdir / "headers"
    if hdr.exists():
        shutil.rmtree(hdr)
    make(src, build, "headers_install", logfile=logfile, extra=[f"INSTALL_HDR_PATH={hdr}"])
    shutil.copy2(build / "arch/x86/boot/bzImage", outdir / "bzImage")
    shutil.copy2(build / ".config", outdir / "config")
    shutil.copy2(build / "System.map", outdir / "System.map")
    return time.monotonic() - t0


def ensure_kernel(src: Source, patches: list[Path], config: str) -> Path:
    commits = apply_series(src, patches)
    key = image_key(src, commits[-1], config)
    outdir = cache_root() / "images" / f"{config}-{key}"
    meta = outdir / "meta.json"
    if meta.exists() and (outdir / "bzImage").exists():
        m = json.loads(meta.read_text())
        log(f"kernel {config}: cached {outdir} (built in {m['build_seconds']:.0f} s "
            f"on {m['built_at']}); no rebuild")
        return outdir
    tmp = outdir.with_name(outdir.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    logfile = tmp / "build.log"
    log(f"kernel {config}: building {len(patches)} patches on {src.key} (log: {outdir}/build.log)")
    secs = build_kernel(src, commits[-1], config, tmp, logfile)
    (tmp / "meta.json").write_text(json.dumps({
        "build_seconds": secs, "built_at": time.strftime("%Y-%m-%d %H:%M:%S"),
        "source": src.key, "series": [p.name for p in patches], "commit": commits[-1],
        "config": config, "jobs": jobs()}, indent=1))
    if outdir.exists():
        shutil.rmtree(outdir)
    tmp.rename(outdir)
    log(f"kernel {config}: built in {secs:.0f} s -> {outdir}/bzImage")
    return outdir


# --------------------------------------------------------------------------
# 4. tests and initramfs
# --------------------------------------------------------------------------

def ensure_busybox(root: Path) -> Path:
    """Debian's busybox-static, downloaded (not installed: it conflicts with busybox)."""
    bb = sorted((root / "busybox").glob("*/bin/busybox"))
    if bb:
        return bb[-1]
    d = root / "busybox" / "dl"
    d.mkdir(parents=True, exist_ok=True)
    if not sorted(d.glob("busybox-static_*.deb")):
        log("downloading Debian's busybox-static")
        p = run(["apt-get", "download", "busybox-static"], cwd=d, capture=True, check=False)
        if p.returncode != 0:
            PrivateApt(root / "apt").download("busybox-static", d)
    deb = sorted(d.glob("busybox-static_*.deb"))[-1]
    ver = run(["dpkg-deb", "-f", str(deb), "Version"], capture=True).stdout.strip()
    out = root / "busybox" / re.sub(r"[^0-9A-Za-z.+-]", "_", ver)
    run(["dpkg-deb", "-x", str(deb), str(out)])
    return out / "bin/busybox"


@dataclass
class GuestTest:
    name: str
    argv: list[str]
    timeout: int
    configs: tuple[str, ...] = ("debug", "plain")
    needs: str = ""          # binary that must have been built
    pre: str = ""            # shell commands run before it (after the KSM reset)
    payload: bool = False    # needs the filter payload (QEMU, server, image) in the initramfs


NO_SMART_SCAN = "echo 0 > /sys/kernel/mm/ksm/smart_scan"


def guest_tests(config: str, bench: bool) -> list[GuestTest]:
    """The tests /init runs, in order."""
    t = [
        GuestTest("merge_page_tests", ["/tests/merge_page_tests"], 1800, needs="merge_page_tests"),
        GuestTest("merge_page_stress", ["/tests/merge_page_stress", "-t", "60"], 600,
                  needs="merge_page_stress"),
        GuestTest("ksm_functional_tests", ["/tests/ksm_functional_tests"], 900),
        GuestTest("ksm_tests -M -p 10", ["/tests/ksm_tests", "-M", "-p", "10"], 600),
        GuestTest("ksm_tests -U", ["/tests/ksm_tests", "-U"], 600),
        GuestTest("ksm_tests -Z -p 10 -z 0",
                  ["/tests/ksm_tests", "-Z", "-p", "10", "-z", "0"], 600),
        GuestTest("ksm_tests -Z -p 10 -z 1",
                  ["/tests/ksm_tests", "-Z", "-p", "10", "-z", "1"], 600),
        # With smart_scan on, these fail in about 6 of 10 runs on this TCG VM
        # even when nothing calls merge_page(): the two full scans they wait
        # for are not always enough once smart scan skips their pages.
        GuestTest("ksm_tests -N -m 1", ["/tests/ksm_tests", "-N", "-m", "1"], 600,
                  pre=NO_SMART_SCAN),
        GuestTest("ksm_tests -N -m 0", ["/tests/ksm_tests", "-N", "-m", "0"], 600,
                  pre=NO_SMART_SCAN),
        GuestTest("ksm_tests -H -s 100", ["/tests/ksm_tests", "-H", "-s", "100"], 900),
        # The patched QEMU's pageshare filter in merge mode with the real
        # pageshare-server: needs the payload (build_filter_payload()).
        GuestTest(FILTER_TEST, ["/tests/pageshare_filter_test", PAYLOAD_DIR], 1800,
                  needs="pageshare_filter_test", payload=True),
    ]
    if bench:
        t = [GuestTest("merge_bench", ["/tests/merge_bench"], 1800, needs="merge_bench")]
    return [x for x in t if config in x.configs]


def build_tests(src: Source, commit: str, kdir: Path, outdir: Path, logfile: Path) -> list[str]:
    """Static test binaries against this build's uapi headers.  Returns names built."""
    checkout_tree(src, commit)
    mm = src.tree / "tools/testing/selftests/mm"
    hdr = kdir / "headers/include"
    cflags = ["-static", "-O2", "-Wall", "-g", "-U_FORTIFY_SOURCE", "-I", str(src.tree),
              "-isystem", str(hdr), "-isystem", str(src.tree / "tools/include/uapi"),
              "-I", str(mm)]
    built = []

    def cc(name: str, files: list[Path], libs: Sequence[str] = (),
           extra: Sequence[str] = ()) -> None:
        run(["gcc", *cflags, *extra, "-o", str(outdir / name), *map(str, files), *libs,
             "-lpthread"],
            logfile=logfile)
        built.append(name)

    vm_util = [mm / "vm_util.c"]
    cc("ksm_functional_tests", [mm / "ksm_functional_tests.c", *vm_util])
    cc("ksm_tests", [mm / "ksm_tests.c", *vm_util, mm / "thp_settings.c"], ["-lnuma"])
    if (mm / "merge_page_tests.c").exists():
        cc("merge_page_tests", [mm / "merge_page_tests.c", *vm_util], ["-lnuma"])
    # Project-side programs use the project's uapi header (-I is searched
    # before -isystem), as the page server and QEMU will, and being ours
    # they build without warnings.
    lib = [LIBDIR / "merge_page.c"]
    inc = ["-Werror", "-I", str(LIBDIR), "-I", str(UAPI / "uapi")]
    if (GUEST / "merge_page_stress.c").exists():
        cc("merge_page_stress", [GUEST / "merge_page_stress.c", *lib], extra=inc)
    if (GUEST / "merge_bench.c").exists():
        cc("merge_bench", [GUEST / "merge_bench.c", *lib], extra=inc)
    if (GUEST / "pageshare_filter_test.c").exists():
        cc("pageshare_filter_test", [GUEST / "pageshare_filter_test.c"],
           extra=["-Werror", "-I", str(REPO / "page-server/client")])
    if (GUEST / "e2e_sampler.c").exists():
        # bench/e2e_vs_ksm.py's sampler (not a test; built with them)
        cc("e2e_sampler", [GUEST / "e2e_sampler.c"], extra=["-Werror", "-Wextra"])
    # Throwaway experiments (not committed): tests/debug_*.c, run with --shell.
    for f in sorted(GUEST.glob("debug_*.c")):
        cc(f.stem, [f, *lib, mm / "vm_util.c"], extra=inc)
    return built


def check_uapi_header(src: Source, commit: str) -> None:
    """The project's uapi header must start with the series' one, byte for byte."""
    ours = (UAPI / "uapi/linux/ksm.h").read_text()
    r = run(["git", "show", f"{commit}:include/uapi/linux/ksm.h"], cwd=src.repo,
            capture=True, check=False)
    if r.returncode != 0:
        log("uapi check: the series has no include/uapi/linux/ksm.h yet")
        return
    if not ours.startswith(r.stdout):
        raise KtestError("kernel-syscall/include/uapi/linux/ksm.h does not start with the "
                         "series' include/uapi/linux/ksm.h; copy it over and keep the additions")
    log("uapi check: kernel-syscall/include/uapi/linux/ksm.h matches the series")


# --------------------------------------------------------------------------
# 4b. the pageshare filter payload (QEMU + page server + image)
# --------------------------------------------------------------------------

FILTER_TEST = "pageshare_filter_merge"
GUEST_CONFIG = "guest"           # config/guest.config: the booted guest's kernel
BENCH_GUEST_CONFIG = "guest-bench"  # + config/guest-bench.config: bench/e2e_vs_ksm.py's
PAYLOAD_DIR = "/pageshare"
# Bump when the payload's layout or content recipe changes.
PAYLOAD_RECIPE = "3"
PAYLOAD_IMAGE_MIB = 8
PAYLOAD_SEED = 20261121
QEMU_BINARIES = ["qemu-system-x86_64", "qemu-img", "qemu-storage-daemon"]
QEMU_FIRMWARE = ["bios-256k.bin", "kvmvapic.bin",   # what -M pc -nodefaults loads
                 "linuxboot_dma.bin"]              # and -kernel (the booted guest)


# The booted guest of the test (a guest kernel reading through the filter in
# merge mode, nested under TCG): a small kernel of its own (config/guest.config:
# Debian's generic kernel took over 7 minutes to boot nested) and an init that
# reads the disk, checks what it read, writes a block and reads it back.
GUEST_READ_BLOCKS = 1024         # the listed part of the payload image (blocks 0-1023)
GUEST_WRITE_BLOCK = 5            # a listed block the guest overwrites with zeros
GUEST_INIT = r"""#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev
n=0; while [ ! -b /dev/vda ] && [ $n -lt 300 ]; do sleep 0.1; n=$((n+1)); done
up() { cut -d' ' -f1 /proc/uptime; }
# keep the disk open: the last close of a block device drops its page cache
exec 3</dev/vda
echo "GUEST-BOOTED $(up)"
# phase 1: the first half of the listed blocks, into the page cache
dd if=/dev/vda of=/dev/null bs=4096 count=__HALF__ 2>/dev/null
echo "GUEST-PHASE1 $(up)"
# the test restarts the page server now; it says go with a keypress
read -r -t 600 go
# phase 2: everything, then a checksum of what the guest holds
dd if=/dev/vda of=/dev/null bs=4096 count=__BLOCKS__ 2>/dev/null
sum=$(dd if=/dev/vda bs=4096 count=__BLOCKS__ 2>/dev/null | sha256sum)
echo "GUEST-SHA256 ${sum%% *}"
echo "GUEST-PHASE2 $(up)"
read -r -t 600 go
# a write into a merged block, then the block read back from the disk
dd if=/dev/zero of=/dev/vda bs=4096 seek=__WBLOCK__ count=1 conv=fsync 2>/dev/null
echo 3 > /proc/sys/vm/drop_caches
sum=$(dd if=/dev/vda bs=4096 skip=__WBLOCK__ count=1 2>/dev/null | sha256sum)
echo "GUEST-WROTE ${sum%% *}"
read -r -t 600 go
echo "GUEST-DONE $(up)"
poweroff -f
"""


def build_guest_initramfs(root: Path, busybox: Path) -> Path:
    """The booted guest's initramfs: busybox and GUEST_INIT."""
    init = (GUEST_INIT.replace("__HALF__", str(GUEST_READ_BLOCKS // 2))
            .replace("__BLOCKS__", str(GUEST_READ_BLOCKS))
            .replace("__WBLOCK__", str(GUEST_WRITE_BLOCK)))
    with tempfile.TemporaryDirectory(prefix="ktest-guest-") as td:
        top = Path(td)
        for d in ("bin", "dev", "proc", "sys"):
            (top / d).mkdir(parents=True)
        shutil.copy2(busybox, top / "bin/busybox")
        (top / "init").write_text(init)
        (top / "init").chmod(0o755)
        files = subprocess.run(["find", ".", "-print0"], cwd=top, capture_output=True,
                               check=True).stdout
        cpio = subprocess.run(["cpio", "--null", "-o", "-H", "newc", "--quiet",
                               "--owner=0:0"], cwd=top, input=files, capture_output=True,
                              check=True).stdout
        out = root / "guest-initramfs.cpio.gz"
        out.write_bytes(subprocess.run(["gzip", "-1"], input=cpio, capture_output=True,
                                       check=True).stdout)
    return out


def build_patched_qemu() -> Path:
    """qemu-patches/build.py (cached there; a warm run takes well under a second)."""
    log("QEMU with the pageshare series: qemu-patches/build.py")
    p = subprocess.run([sys.executable, str(REPO / "qemu-patches/build.py")],
                       stdout=subprocess.PIPE, text=True)
    lines = p.stdout.strip().splitlines()
    if p.returncode != 0 or not lines:
        raise KtestError(f"qemu-patches/build.py failed ({p.returncode}); the "
                         f"{FILTER_TEST} test needs the patched QEMU (see qemu-patches/README.md)")
    out = Path(lines[-1])
    for b in QEMU_BINARIES:
        if not (out / "bin" / b).exists():
            raise KtestError(f"qemu-patches/build.py printed {out}, which has no bin/{b}")
    return out


def build_page_server() -> Path:
    """cargo build --release of page-server/, into the tests' target directory."""
    cargo = shutil.which("cargo") or next(
        (str(c) for c in [Path.home() / ".cargo/bin/cargo"] if c.exists()), None)
    if cargo is None:
        raise KtestError(f"cargo is not installed (scripts/install-deps.sh); the {FILTER_TEST} "
                         "test needs pageshare-server")
    target = cache.cache_root() / "cargo-target"
    env = {**os.environ, "CARGO_TARGET_DIR": str(target),
           "PATH": f"{Path(cargo).parent}:{os.environ.get('PATH', '')}"}
    log("pageshare-server: cargo build --release")
    run([*nice_prefix(), cargo, "build", "--release", "--locked", "--quiet"],
        cwd=REPO / "page-server", env=env, capture=True)
    return target / "release/pageshare-server"


def shared_libs(binary: Path) -> list[Path]:
    """Every shared object binary loads (ldd on the host), the loader included."""
    p = run(["ldd", str(binary)], capture=True)
    libs = []
    for line in p.stdout.splitlines():
        m = re.search(r"(?:=>\s*)?(/\S+)\s+\(0x", line)
        if m:
            libs.append(Path(m.group(1)))
        elif "not found" in line:
            raise KtestError(f"{binary}: {line.strip()}")
    return libs


def write_pcsl(image: bytes, blocks: list[int], name: str) -> str:
    """A pcsl v1 list (lists/README.md) of the given 4 KiB blocks of image,
    written by the analyzer's own serialiser (standard library only too)."""
    from pageshare import sectorlist

    sl = sectorlist.SectorList(
        image=sectorlist.ImageIdentity(len(image), hashlib.sha256(image).hexdigest(), name),
        blocks={b * 8: sectorlist.block_hash(image[b * 4096:(b + 1) * 4096]) for b in blocks},
        generator="ktest.py", created="2026-01-01T00:00:00Z",
        criteria="every block < 1024 except each eighth (ktest payload)")
    return sectorlist.dumps(sl)


SERVER_TOML = f"""# pageshare-server in the ktest VM (the {FILTER_TEST} test)
socket_dir = "/tmp/pageshare/run"
cache_dir = "/tmp/pageshare/cache"
metrics_listen = ""
host_name = "ktest"
qemu_storage_daemon = "{PAYLOAD_DIR}/bin/qemu-storage-daemon"

[[image]]
name = "base"
path = "{PAYLOAD_DIR}/base.raw"
format = "raw"
list_file = "{PAYLOAD_DIR}/base.pcsl"
"""

# A second server for the stalled-client case: its own sockets and cache, a
# list the test rewrites under /tmp, and a 1 s switch timeout, so that a
# client that hears nothing is given up on (its blocks released) at once.
STALL_SERVER_TOML = f"""# the {FILTER_TEST} test's stalled-client case
socket_dir = "/tmp/pageshare/run-stall"
cache_dir = "/tmp/pageshare/cache-stall"
metrics_listen = ""
host_name = "ktest-stall"
qemu_storage_daemon = "{PAYLOAD_DIR}/bin/qemu-storage-daemon"

[limits]
client_switch_timeout_secs = 1

[[image]]
name = "base"
path = "{PAYLOAD_DIR}/base.raw"
format = "raw"
list_file = "/tmp/pageshare/stall.pcsl"
"""


def build_filter_payload(root: Path, busybox: Path, guest_kernel: Path) -> Path:
    """A gzip'd cpio with the patched QEMU, pageshare-server, their shared
    libraries (at their host paths), firmware, a random raw base image, its
    list and a server config, all under PAYLOAD_DIR.  Appended to the
    initramfs (the kernel unpacks concatenated archives); cached by content."""
    qemu = build_patched_qemu()
    server = build_page_server()
    bins = [qemu / "bin" / b for b in QEMU_BINARIES] + [server]
    firmware = []
    for fw in QEMU_FIRMWARE:
        f = (qemu / "share/qemu" / fw).resolve()
        if not f.is_file():
            raise KtestError(f"firmware {fw} not found in {qemu}/share/qemu (seabios package)")
        firmware.append((fw, f))
    libs: dict[Path, Path] = {}
    for b in bins:
        for lib in shared_libs(b):
            libs[lib] = lib.resolve()
    h = hashlib.sha256(
        f"recipe={PAYLOAD_RECIPE} mib={PAYLOAD_IMAGE_MIB} seed={PAYLOAD_SEED}\n".encode())
    h.update(SERVER_TOML.encode())
    h.update(STALL_SERVER_TOML.encode())
    h.update(GUEST_INIT.encode())
    for f in [*bins, *(f for _, f in firmware), *sorted(libs.values()), busybox,
              guest_kernel]:
        st = f.stat()
        h.update(f"{f}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    out = root / "payload" / f"filter-{h.hexdigest()[:16]}.cpio.gz"
    if out.exists():
        log(f"filter payload: cached {out}")
        return out
    t0 = time.monotonic()
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ktest-payload-") as td:
        top = Path(td)
        pd = top / PAYLOAD_DIR.lstrip("/")
        (pd / "bin").mkdir(parents=True)
        (pd / "share/qemu").mkdir(parents=True)
        for b in bins:
            # Stripped copies: the initramfs is unpacked into guest RAM.
            run(["strip", "-o", str(pd / "bin" / b.name), str(b)])
        for name, f in firmware:
            shutil.copy2(f, pd / "share/qemu" / name)
        for lib, real in libs.items():
            dst = top / str(lib).lstrip("/")
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(real, dst)
        image = random.Random(PAYLOAD_SEED).randbytes(PAYLOAD_IMAGE_MIB << 20)
        (pd / "base.raw").write_bytes(image)
        (pd / "guest").mkdir()
        initrd = build_guest_initramfs(top, busybox)
        shutil.copy2(guest_kernel, pd / "guest/vmlinuz")
        shutil.move(str(initrd), pd / "guest/initramfs.cpio.gz")
        head = image[:GUEST_READ_BLOCKS * 4096]
        (pd / "guest/expect").write_text(
            f"sha256 {hashlib.sha256(head).hexdigest()}\n"
            f"zero {hashlib.sha256(bytes(4096)).hexdigest()}\n")
        blocks = [b for b in range(min(1024, len(image) // 4096)) if b % 8 != 7]
        (pd / "base.pcsl").write_text(write_pcsl(image, blocks, "base.raw"))
        (pd / "base-kept.pcsl").write_text(write_pcsl(image, blocks[::4], "base.raw"))
        (pd / "server.toml").write_text(SERVER_TOML)
        (pd / "server-stall.toml").write_text(STALL_SERVER_TOML)
        files = subprocess.run(["find", ".", "-print0"], cwd=top, capture_output=True,
                               check=True).stdout
        cpio = subprocess.run(["cpio", "--null", "-o", "-H", "newc", "--quiet", "--owner=0:0"],
                              cwd=top, input=files, capture_output=True, check=True).stdout
        tmp = out.with_suffix(".tmp")
        tmp.write_bytes(subprocess.run(["gzip", "-1"], input=cpio, capture_output=True,
                                       check=True).stdout)
        tmp.rename(out)
    log(f"filter payload: built {out} ({out.stat().st_size >> 20} MiB) "
        f"in {time.monotonic() - t0:.0f} s")
    old = sorted(out.parent.glob("filter-*.cpio.gz"), key=lambda f: f.stat().st_mtime)[:-3]
    for f in old:
        f.unlink()
    return out


INIT = r"""#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin:/sbin:/tests
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev 2>/dev/null
mount -t tmpfs tmp /tmp
mount -t debugfs none /sys/kernel/debug
mount -t cgroup2 none /sys/fs/cgroup
mkdir -p /dev/pts /dev/shm /mnt/huge
mount -t tmpfs shm /dev/shm
mount -t hugetlbfs none /mnt/huge
# swap on zram so reclaim tests have somewhere to go
if [ -e /sys/block/zram0 ]; then
  echo 768M > /sys/block/zram0/disksize && mkswap /dev/zram0 >/dev/null && swapon /dev/zram0
fi
echo 32 > /proc/sys/vm/nr_hugepages 2>/dev/null
echo "KTEST-BOOTED $(uname -r) mem=$(grep MemTotal /proc/meminfo | tr -s ' ')"
cat /proc/swaps
n=0
while read -r name tmo cmd; do
  n=$((n+1))
  name=$(echo "$name" | tr '+' ' ')
  # Each test starts from KSM's boot defaults, whatever the last one left.
  k=/sys/kernel/mm/ksm
  echo 0 > $k/run; echo 100 > $k/pages_to_scan; echo 20 > $k/sleep_millisecs
  echo 0 > $k/use_zero_pages; echo 1 > $k/smart_scan
  echo "KTEST-BEGIN $n $name"
  timeout "$tmo" $cmd
  rc=$?
  echo "KTEST-END $n rc=$rc"
done < /tests/list
echo "KTEST-DMESG-BEGIN"
dmesg
echo "KTEST-DMESG-END"
echo "KTEST-DONE"
sync
# No ACPI in this kernel: reboot, which QEMU's -no-reboot turns into an exit.
reboot -f
"""


def build_initramfs(busybox: Path, testdir: Path, tests: list[GuestTest], out: Path,
                    payload: Path | None = None) -> None:
    with tempfile.TemporaryDirectory(prefix="ktest-initramfs-") as td:
        root = Path(td)
        for d in ("bin", "sbin", "proc", "sys", "dev", "tmp", "tests", "etc", "root", "mnt"):
            (root / d).mkdir()
        shutil.copy2(busybox, root / "bin/busybox")
        (root / "init").write_text(INIT)
        (root / "init").chmod(0o755)
        (root / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/sh\n"
                                         "nobody:x:65534:65534:nobody:/:/bin/sh\n")
        (root / "etc/group").write_text("root:x:0:\nnogroup:x:65534:\n")
        for f in testdir.iterdir():
            shutil.copy2(f, root / "tests" / f.name)
        lines = []
        for i, t in enumerate(tests):
            # One script per test: the list stays one word per field.
            script = root / "tests" / f"run-{i}.sh"
            script.write_text("#!/bin/sh\n" + (t.pre + "\n" if t.pre else "") +
                              "exec " + shlex.join(t.argv) + "\n")
            script.chmod(0o755)
            lines.append(f"{t.name.replace(' ', '+')} {t.timeout} /tests/run-{i}.sh")
        (root / "tests/list").write_text("\n".join(lines) + "\n")
        files = subprocess.run(["find", ".", "-print0"], cwd=root, capture_output=True,
                               check=True).stdout
        cpio = subprocess.run(["cpio", "--null", "-o", "-H", "newc", "--quiet", "--owner=0:0"],
                              cwd=root, input=files, capture_output=True, check=True).stdout
        data = subprocess.run(["gzip", "-1"], input=cpio, capture_output=True, check=True).stdout
        # The kernel unpacks concatenated archives, so the big cached payload
        # is appended as it is.
        out.write_bytes(data + (payload.read_bytes() if payload else b""))


# --------------------------------------------------------------------------
# 5. boot and report
# --------------------------------------------------------------------------

@dataclass
class Result:
    name: str
    rc: int | None
    output: list[str]


def boot(kdir: Path, initramfs: Path, runlog: Path, timeout: int,
         extra_append: str = "", mem: str = "2G",
         show: Callable[[str], bool] | None = None) -> list[str]:
    """Boot the kernel with the initramfs under TCG; return its serial lines.
    Lines for which show() is true are echoed (default: KTEST- markers, TAP
    results and kernel reports)."""
    append = ("console=ttyS0 panic=-1 loglevel=5 log_buf_len=8M numa=fake=2 "
              "transparent_hugepage=madvise " + extra_append).strip()
    cmd = ["qemu-system-x86_64", "-accel", "tcg", "-cpu", "max", "-m", mem, "-smp", "2",
           "-kernel", str(kdir / "bzImage"), "-initrd", str(initramfs),
           "-append", append, "-nographic", "-no-reboot", "-monitor", "none"]
    log(f"booting: {shlex.join(cmd)}")
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    with open(runlog, "w") as lf:
        p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, errors="replace", bufsize=1)
        assert p.stdout is not None
        import selectors
        sel = selectors.DefaultSelector()
        sel.register(p.stdout, selectors.EVENT_READ)
        in_dmesg = False
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                p.kill()
                if not any(x.startswith("KTEST-DONE") for x in lines):
                    lines.append("KTEST-TIMEOUT")
                    lf.write("KTEST-TIMEOUT\n")
                break
            if not sel.select(timeout=min(left, 5)):
                if p.poll() is not None:
                    break
                continue
            chunk = p.stdout.readline()
            if not chunk:
                break
            line = chunk.rstrip("\r\n")
            lf.write(line + "\n")
            lf.flush()
            lines.append(line)
            if line.startswith("KTEST-DONE"):
                # Give the guest a moment to reboot (QEMU exits), then stop it.
                deadline = min(deadline, time.monotonic() + 10)
            if line.startswith("KTEST-DMESG-BEGIN"):
                in_dmesg = True
            elif line.startswith("KTEST-DMESG-END"):
                in_dmesg = False
            elif not in_dmesg and (show(line) if show else (
                    line.startswith("KTEST-") or re.match(r"^\s*(not )?ok \d+", line)
                    or line.startswith("# Totals") or BAD_RE.search(line))):
                print(f"  | {line}", flush=True)
        if p.poll() is None:
            p.kill()
        p.wait(timeout=30)
    return lines


def parse_results(lines: list[str], tests: list[GuestTest]) -> tuple[list[Result], list[str], bool]:
    results: dict[int, Result] = {}
    cur: Result | None = None
    bad: list[str] = []
    done = False
    for line in lines:
        m = re.match(r"^KTEST-BEGIN (\d+) (.*)$", line)
        if m:
            cur = Result(m.group(2), None, [])
            results[int(m.group(1))] = cur
            continue
        m = re.match(r"^KTEST-END (\d+) rc=(\d+)$", line)
        if m and int(m.group(1)) in results:
            results[int(m.group(1))].rc = int(m.group(2))
            cur = None
            continue
        if line.startswith("KTEST-DONE"):
            done = True
        if BAD_RE.search(line) and line not in bad:
            bad.append(line)
        if cur is not None:
            cur.output.append(line)
    out = []
    for i, t in enumerate(tests, 1):
        out.append(results.get(i, Result(t.name, None, ["(did not run)"])))
    return out, bad, done


def cmd_run(args: argparse.Namespace) -> int:
    t_start = time.monotonic()
    root = cache_root()
    patches = series_files()
    src = ensure_source(root)
    with src.locked():
        kdir = ensure_kernel(src, patches, args.config)
        commits = apply_series(src, patches)
    check_uapi_header(src, commits[-1])

    # Tests: cached by (kernel image, test sources).
    th = hashlib.sha256(kdir.name.encode())
    for d in (GUEST, LIBDIR):
        for f in sorted(d.glob("*.[ch]")):
            th.update(f.name.encode() + f.read_bytes())
    th.update((REPO / "page-server/client/pageshare_table.h").read_bytes())
    th.update(Path(__file__).read_bytes())
    testdir = root / "tests" / th.hexdigest()[:16]
    if not (testdir / ".ready").exists():
        if testdir.exists():
            shutil.rmtree(testdir)
        testdir.mkdir(parents=True)
        tlog = testdir.with_suffix(".log")
        tlog.write_text("")
        log(f"building static test binaries (log: {tlog})")
        with src.locked():
            build_tests(src, commits[-1], kdir, testdir, tlog)
        (testdir / ".ready").write_text("")
    built = {f.name for f in testdir.iterdir() if not f.name.startswith(".")}
    tests = [t for t in guest_tests(args.config, args.bench) if not t.needs or t.needs in built]
    if args.only:
        tests = [t for t in tests if re.search(args.only, t.name)]
    if args.shell:
        # A debugging aid: one shell command as the only "test".
        tests = [GuestTest("shell", ["/bin/sh", "-c", args.shell], 1800)]
    missing = [t.name for t in guest_tests(args.config, args.bench)
               if t.needs and t.needs not in built]
    for m in missing:
        log(f"not built (source missing in this series): {m}")

    busybox = ensure_busybox(root)
    # Missing prerequisites of the filter test (QEMU build, cargo) fail the
    # run here, with a message; the test is never skipped silently.
    payload = None
    if any(t.payload for t in tests):
        with src.locked():
            guest = ensure_kernel(src, patches, GUEST_CONFIG) / "bzImage"
        payload = build_filter_payload(root, busybox, guest)
    # The pid keeps two runs started in the same second apart (CI's and a
    # developer's, sharing the cache: seen as FileExistsError).
    rundir = root / "runs" / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    rundir.mkdir(parents=True)
    initramfs = rundir / "initramfs.cpio.gz"
    build_initramfs(busybox, testdir, tests, initramfs, payload)
    prep = time.monotonic() - t_start
    log(f"prepared in {prep:.0f} s; run directory {rundir}")

    t_boot = time.monotonic()
    timeout = sum(t.timeout for t in tests) + 300
    if args.kernel:
        kdir = rundir / "kernel"
        kdir.mkdir()
        shutil.copy2(args.kernel, kdir / "bzImage")
    lines = boot(kdir, initramfs, rundir / "serial.log", timeout, args.append)
    results, bad, done = parse_results(lines, tests)
    vm_secs = time.monotonic() - t_boot

    print(f"TAP version 13\n1..{len(results)}")
    failed = 0
    for i, r in enumerate(results, 1):
        tap = "ok" if r.rc in (0, 4) else "not ok"
        directive = " # SKIP" if r.rc == 4 else ""
        if tap != "ok":
            failed += 1
        print(f"{tap} {i} {r.name}{directive}"
              + (f" (rc={r.rc})" if r.rc not in (0, 4) else ""))
        if tap != "ok" or args.verbose:
            for line in r.output[-60:]:
                print(f"#   {line}")
        else:
            for line in r.output:
                if re.match(r"^\s*(not ok|ok \d+ .*# SKIP|# Totals|# SKIP)", line):
                    print(f"#   {line}")
    if bad:
        print("# kernel log reports (these fail the run):")
        for line in bad[:50]:
            print(f"#   {line}")
    if not done:
        print("# the guest did not finish (crash, hang or timeout); see "
              + str(rundir / "serial.log"))
    if args.bench:
        table = extract_between(lines, "BENCH-TABLE-BEGIN", "BENCH-TABLE-END")
        if table:
            (rundir / "bench.md").write_text("\n".join(table) + "\n")
            print("\n".join(table))
            log(f"benchmark table saved to {rundir / 'bench.md'}")
    status = 0 if (failed == 0 and not bad and done) else 1
    log(f"{len(results) - failed}/{len(results)} tests passed, {len(bad)} kernel reports, "
        f"guest {'finished' if done else 'DID NOT FINISH'}; VM {vm_secs:.0f} s, total "
        f"{time.monotonic() - t_start:.0f} s; serial log {rundir / 'serial.log'}")
    return status


def extract_between(lines: list[str], begin: str, end: str) -> list[str]:
    out: list[str] = []
    inside = False
    for line in lines:
        if line.startswith(begin):
            inside = True
            continue
        if line.startswith(end):
            inside = False
            continue
        if inside:
            out.append(line)
    return out


SCAN_SAMPLES_BAD = [
    "[   12.345678] WARNING: CPU: 1 PID: 97 at mm/ksm.c:3301 map_destination+0x1a/0x2b0",
    "[    3.1] ------------[ cut here ]------------ kernel BUG at mm/ksm.c:1004!",
    "[    5.0] WARNING: possible circular locking dependency detected",
    "[    5.0] WARNING: inconsistent lock state",
    "[    7.2] BUG: KASAN: slab-use-after-free in remove_rmap_item_from_tree+0x4c/0x1e0",
    "[    7.2] BUG: KFENCE: out-of-bounds read in stable_tree_append+0x10/0x90",
    "[    9.9] BUG: Bad page state in process merge_page_tests  pfn:1234",
    "[    9.9] list_add corruption. prev->next should be next (ffff888), but was 0",
    "[    9.9] Oops: general protection fault, probably for non-canonical address",
    "[   99.0] INFO: task ksmd:40 blocked for more than 120 seconds.",
    "[   41.5] FAULT_FLAG_ALLOW_RETRY missing 881",
    "[   41.5] Call Trace:",
]
SCAN_SAMPLES_GOOD = [
    "[    0.000000] Lock dependency validator: Copyright (c) 2006 Red Hat, Inc., Ingo Molnar",
    "[    0.000000] rcu: 	RCU lockdep checking is enabled.",
    "[    0.000000] kasan: KernelAddressSanitizer initialized",
    "[    0.000000] kfence: initialized - using 2097152 bytes for 255 objects",
    "ok 3 basic: dst zero page",
    "# Totals: pass:27 fail:0 xfail:0 xpass:0 skip:0 error:0",
]


def cmd_selfcheck(args: argparse.Namespace) -> int:
    """Check that the kernel log scan flags real reports and passes boot noise."""
    bad = [x for x in SCAN_SAMPLES_BAD if not BAD_RE.search(x)]
    good = [x for x in SCAN_SAMPLES_GOOD if BAD_RE.search(x)]
    for x in bad:
        print(f"not flagged: {x}")
    for x in good:
        print(f"flagged wrongly: {x}")
    log(f"log scan: {len(SCAN_SAMPLES_BAD) - len(bad)}/{len(SCAN_SAMPLES_BAD)} reports flagged, "
        f"{len(SCAN_SAMPLES_GOOD) - len(good)}/{len(SCAN_SAMPLES_GOOD)} benign lines passed")
    return 1 if bad or good else 0


def cmd_build(args: argparse.Namespace) -> int:
    src = ensure_source(cache_root())
    with src.locked():
        ensure_kernel(src, series_files(), args.config)
    return 0


def cmd_check_series(args: argparse.Namespace) -> int:
    """Apply the patches one by one; build each (incrementally) and checkpatch each."""
    root = cache_root()
    src = ensure_source(root)
    with src.locked():
        return check_series_locked(args, root, src)


def check_series_locked(args: argparse.Namespace, root: Path, src: Source) -> int:
    # Its own worktree: checking out patch after patch in the shared build
    # tree would touch files and make the next ordinary build recompile them.
    check_tree = src.repo.parent / "check-tree"
    if not check_tree.exists():
        run(["git", *GIT_ID, "worktree", "add", "-q", "--detach", str(check_tree), "base"],
            cwd=src.repo)
    src = Source(src.key, src.repo, check_tree)
    patches = series_files()
    commits = apply_series(src, patches)
    check_uapi_header(src, commits[-1])
    checkdir = root / "check"
    checkdir.mkdir(exist_ok=True)
    logfile = checkdir / f"check-series-{time.strftime('%Y%m%d-%H%M%S')}.log"
    ok = True
    cover = PATCHES / "0000-cover-letter.patch"
    if not args.no_checkpatch:
        checkout_tree(src, commits[-1])
        for p in ([cover] if cover.exists() else []) + patches:
            # spdxcheck.py needs python3-ply and python3-git: the system python.
            env = {**os.environ, "PATH": "/usr/bin:" + os.environ.get("PATH", "")}
            r = run([str(src.tree / "scripts/checkpatch.pl"), "--strict", str(p)],
                    cwd=src.tree, capture=True, check=False, env=env)
            summary = [ln for ln in r.stdout.splitlines() if ln.startswith("total:")]
            log(f"checkpatch --strict {p.name}: {summary[-1] if summary else r.stdout[-200:]}")
            if r.returncode != 0 and maintainers_hint_only(src, p, r.stdout):
                log(f"  {p.name}: the only finding is the MAINTAINERS hint for a new file, "
                    "and get_maintainer.pl already maps every new file: accepted")
            elif r.returncode != 0:
                ok = False
                print(r.stdout)
    if args.no_build:
        return 0 if ok else 1
    build = root / "build" / f"{src.key}-check-{args.config}"
    build.mkdir(parents=True, exist_ok=True)
    for p, c in zip(patches, commits, strict=True):
        t0 = time.monotonic()
        checkout_tree(src, c)
        try:
            configure(src, build, args.config, logfile)
            make(src, build, "bzImage", logfile=logfile, extra=["W=1"] if args.w1 else [])
            shutil.copy2(build / "arch/x86/boot/bzImage", checkdir / f"bzImage-{p.name[:4]}")
            warn = [ln for ln in logfile.read_text(errors="replace").splitlines()
                    if re.search(r"(warning|error):", ln)
                    and re.search(r"mm/ksm\.c|mm/madvise\.c|sys_ni\.c", ln)]
            log(f"build after {p.name}: ok in {time.monotonic() - t0:.0f} s" +
                (f", {len(warn)} warnings in our files" if warn else ""))
        except KtestError as e:
            ok = False
            log(f"build after {p.name}: FAILED\n{e}")
            break
    log(f"log: {logfile}")
    return 0 if ok else 1


def maintainers_hint_only(src: Source, patch: Path, out: str) -> bool:
    """checkpatch warns "does MAINTAINERS need updating?" for any added file.
    That is a false positive when MAINTAINERS already covers the file."""
    findings = [ln for ln in out.splitlines() if re.match(r"^(ERROR|WARNING|CHECK):", ln)]
    if not findings or any("MAINTAINERS need updating" not in ln for ln in findings):
        return False
    text = patch.read_text()
    added = re.findall(r"^diff --git a/\S+ b/(\S+)\nnew file mode", text, re.M)
    for f in added:
        r = run([str(src.tree / "scripts/get_maintainer.pl"), "--nogit", "--nogit-fallback",
                 "--norolestats", "-f", f], cwd=src.tree, capture=True, check=False)
        if r.returncode != 0 or "@" not in r.stdout:
            return False
    return bool(added)


def cmd_devtree(args: argparse.Namespace) -> int:
    """A git worktree with the series applied as commits, for editing.

    Edit, commit (or commit --amend / rebase -i), then `ktest.py export`
    regenerates patches/ with git format-patch."""
    root = cache_root()
    src = ensure_source(root)
    dev = root / "dev"
    with src.locked():
        commits = apply_series(src, series_files())
    if not dev.exists():
        run(["git", *GIT_ID, "worktree", "add", "-q", "-B", "series", str(dev), commits[-1]],
            cwd=src.repo)
    log(f"dev tree: {dev} (branch 'series' of {src.repo}; base is tag 'base')")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    root = cache_root()
    dev = root / "dev"
    if not dev.exists():
        raise KtestError("no dev tree; run `ktest.py devtree` first")
    blurb = (HERE / "cover-letter.txt").read_text().rstrip("\n").split("\n", 1)
    subject, body = blurb[0], blurb[1].strip("\n") if len(blurb) > 1 else ""
    with tempfile.TemporaryDirectory() as td:
        # A fixed abbreviation: git's default grows with the repository's
        # object count, which would rewrite every index line on export.
        run(["git", *GIT_ID, "-c", f"user.name={AUTHOR[0]}", "-c", f"user.email={AUTHOR[1]}",
             "-c", "core.abbrev=9", "format-patch", "-q", "--no-signature", "--zero-commit",
             "--cover-letter", "--base=base", "-o", td, "base..series"], cwd=dev)
        for old in PATCHES.glob("*.patch"):
            old.unlink()
        for f in sorted(Path(td).glob("*.patch")):
            text = f.read_text()
            if f.name.startswith("0000-"):
                text = text.replace("*** SUBJECT HERE ***", subject)
                text = text.replace("*** BLURB HERE ***", body)
            (PATCHES / f.name).write_text(text)
    log(f"exported {len(series_files())} patches and a cover letter to {PATCHES}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="build (cached), boot, run the tests")
    r.add_argument("--config", choices=["debug", "plain"], default=None,
                   help="kernel config (default: debug; plain with --bench)")
    r.add_argument("--bench", action="store_true", help="run the benchmark instead of the tests")
    r.add_argument("--only", help="regex: run only the tests whose name matches")
    r.add_argument("--append", default="", help="extra kernel command line")
    r.add_argument("--shell", help="run this shell command in the guest instead of the tests")
    r.add_argument("--kernel",
                   help="boot this bzImage instead (tests still built against the series)")
    r.add_argument("-v", "--verbose", action="store_true",
                   help="print the output of passing tests too")
    b = sub.add_parser("build", help="build (or find cached) the kernel only")
    b.add_argument("--config", choices=["debug", "plain"], default="debug")
    c = sub.add_parser("check-series", help="build and checkpatch each patch")
    c.add_argument("--config", choices=["debug", "plain"], default="plain")
    c.add_argument("--no-build", action="store_true")
    c.add_argument("--no-checkpatch", action="store_true")
    c.add_argument("--w1", action="store_true", help="build with W=1")
    sub.add_parser("devtree", help="make a git worktree with the series for editing")
    sub.add_parser("export", help="git format-patch the dev tree back into patches/")
    sub.add_parser("selfcheck", help="check the kernel log scanner on sample lines")
    args = ap.parse_args()
    if args.cmd == "run" and args.config is None:
        args.config = "plain" if args.bench else "debug"
    try:
        return {"run": cmd_run, "build": cmd_build, "check-series": cmd_check_series,
                "devtree": cmd_devtree, "export": cmd_export,
                "selfcheck": cmd_selfcheck}[args.cmd](args)
    except KtestError as e:
        print(f"ktest: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
