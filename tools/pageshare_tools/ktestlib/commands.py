"""The subcommands: run (build, boot, TAP report), build, check-series,
devtree, export and selfcheck (COMMANDS).  ktest.py's main() parses the
command line and calls one of them."""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from .boot import BAD_RE, boot, extract_between, parse_results
from .common import GIT_ID, GUEST, HERE, LIBDIR, PATCHES, REPO, KtestError, cache_root, log, run
from .guest import (
    GuestTest,
    build_initramfs,
    build_tests,
    check_uapi_header,
    ensure_busybox,
    guest_tests,
)
from .kernel import GUEST_CONFIG, configure, ensure_kernel, make, selftests_id
from .payload import build_filter_payload
from .series import AUTHOR, apply_series, checkout_tree, series_files
from .source import Source, ensure_source


def binaries_key(src: Source, commit: str, kdir: Path) -> str:
    """The static test binaries' cache key: the kernel image they run on,
    the series' selftests in the tree (tools/testing/, which the image's
    key leaves out), ktest's own test sources, the table header they
    include, and the driver's code (ktest.py and ktestlib/)."""
    th = hashlib.sha256(kdir.name.encode())
    th.update(selftests_id(src, commit).encode())
    for d in (GUEST, LIBDIR):
        for f in sorted(d.glob("*.[ch]")):
            th.update(f.name.encode() + f.read_bytes())
    th.update((REPO / "page-server/client/pageshare_table.h").read_bytes())
    for f in [HERE / "ktest.py", *sorted(Path(__file__).parent.glob("*.py"))]:
        th.update(f.read_bytes())
    return th.hexdigest()[:16]


def cmd_run(args: argparse.Namespace) -> int:
    t_start = time.monotonic()
    root = cache_root()
    patches = series_files()
    src = ensure_source(root)
    with src.locked():
        kdir = ensure_kernel(src, patches, args.config)
        commits = apply_series(src, patches)
    check_uapi_header(src, commits[-1])

    testdir = root / "tests" / binaries_key(src, commits[-1], kdir)
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
    missing = [
        t.name for t in guest_tests(args.config, args.bench) if t.needs and t.needs not in built
    ]
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
        print(f"{tap} {i} {r.name}{directive}" + (f" (rc={r.rc})" if r.rc not in (0, 4) else ""))
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
        print(
            "# the guest did not finish (crash, hang or timeout); see " + str(rundir / "serial.log")
        )
    if args.bench:
        table = extract_between(lines, "BENCH-TABLE-BEGIN", "BENCH-TABLE-END")
        if table:
            (rundir / "bench.md").write_text("\n".join(table) + "\n")
            print("\n".join(table))
            log(f"benchmark table saved to {rundir / 'bench.md'}")
    # where the VM's time went, for whoever wants the suite faster
    log("times (s): " + ", ".join(f"{r.name} {r.secs}" for r in results if r.secs is not None))
    status = 0 if (failed == 0 and not bad and done) else 1
    log(
        f"{len(results) - failed}/{len(results)} tests passed, {len(bad)} kernel reports, "
        f"guest {'finished' if done else 'DID NOT FINISH'}; VM {vm_secs:.0f} s, total "
        f"{time.monotonic() - t_start:.0f} s; serial log {rundir / 'serial.log'}"
    )
    return status


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
    log(
        f"log scan: {len(SCAN_SAMPLES_BAD) - len(bad)}/{len(SCAN_SAMPLES_BAD)} reports flagged, "
        f"{len(SCAN_SAMPLES_GOOD) - len(good)}/{len(SCAN_SAMPLES_GOOD)} benign lines passed"
    )
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
        run(
            ["git", *GIT_ID, "worktree", "add", "-q", "--detach", str(check_tree), "base"],
            cwd=src.repo,
        )
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
            r = run(
                [str(src.tree / "scripts/checkpatch.pl"), "--strict", str(p)],
                cwd=src.tree,
                capture=True,
                check=False,
                env=env,
            )
            summary = [ln for ln in r.stdout.splitlines() if ln.startswith("total:")]
            log(f"checkpatch --strict {p.name}: {summary[-1] if summary else r.stdout[-200:]}")
            if r.returncode != 0 and maintainers_hint_only(src, p, r.stdout):
                log(
                    f"  {p.name}: the only finding is the MAINTAINERS hint for a new file, "
                    "and get_maintainer.pl already maps every new file: accepted"
                )
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
            warn = [
                ln
                for ln in logfile.read_text(errors="replace").splitlines()
                if re.search(r"(warning|error):", ln)
                and re.search(r"mm/ksm\.c|mm/madvise\.c|sys_ni\.c", ln)
            ]
            log(
                f"build after {p.name}: ok in {time.monotonic() - t0:.0f} s"
                + (f", {len(warn)} warnings in our files" if warn else "")
            )
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
        r = run(
            [
                str(src.tree / "scripts/get_maintainer.pl"),
                "--nogit",
                "--nogit-fallback",
                "--norolestats",
                "-f",
                f,
            ],
            cwd=src.tree,
            capture=True,
            check=False,
        )
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
        run(
            ["git", *GIT_ID, "worktree", "add", "-q", "-B", "series", str(dev), commits[-1]],
            cwd=src.repo,
        )
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
        # The histogram diff: the default (Myers) showed patch 4's new
        # functions in mm/ksm.c as a rewrite of 200 lines of upstream code.
        run(
            [
                "git",
                *GIT_ID,
                "-c",
                f"user.name={AUTHOR[0]}",
                "-c",
                f"user.email={AUTHOR[1]}",
                "-c",
                "core.abbrev=9",
                "format-patch",
                "-q",
                "--no-signature",
                "--zero-commit",
                "--diff-algorithm=histogram",
                "--cover-letter",
                "--base=base",
                "-o",
                td,
                "base..series",
            ],
            cwd=dev,
        )
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


# By the name ktest.py's command line gives each.
COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "run": cmd_run,
    "build": cmd_build,
    "check-series": cmd_check_series,
    "devtree": cmd_devtree,
    "export": cmd_export,
    "selfcheck": cmd_selfcheck,
}
