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
import sys
from pathlib import Path

# The code is in ktestlib/ next to this file (ktestlib/__init__.py says which
# module holds what; a run starts at ktestlib/commands.py cmd_run()).  This
# file is the command line and, for the code that imports ktest
# (packaging/kernel_deb.py, bench/e2e_vs_ksm.py), every name it had when it
# was one file.  Its directory goes on sys.path for ktestlib also when it is
# loaded by its path (bench/e2e_vs_ksm.py) rather than run or imported.
HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from ktestlib.boot import (  # noqa: E402
    BAD_PATTERNS,
    BAD_RE,
    Result,
    boot,
    extract_between,
    parse_results,
)
from ktestlib.commands import (  # noqa: E402
    SCAN_SAMPLES_BAD,
    SCAN_SAMPLES_GOOD,
    check_series_locked,
    cmd_build,
    cmd_check_series,
    cmd_devtree,
    cmd_export,
    cmd_run,
    cmd_selfcheck,
    maintainers_hint_only,
)
from ktestlib.common import (  # noqa: E402
    CONFIGS,
    GIT_ID,
    GUEST,
    LIBDIR,
    PATCHES,
    REPO,
    UAPI,
    KtestError,
    cache_root,
    jobs,
    log,
    nice_prefix,
    run,
    sha256_file,
)
from ktestlib.guest import (  # noqa: E402
    INIT,
    NO_SMART_SCAN,
    GuestTest,
    build_initramfs,
    build_tests,
    check_uapi_header,
    ensure_busybox,
    guest_tests,
    sampler_argv,
)
from ktestlib.kernel import (  # noqa: E402
    BENCH_GUEST_CONFIG,
    BUILD_RECIPE,
    GUEST_CONFIG,
    build_kernel,
    config_fragments,
    configure,
    ensure_kernel,
    image_key,
    make,
    parse_fragment,
    tree_id,
)
from ktestlib.payload import (  # noqa: E402
    FILTER_TEST,
    GUEST_INIT,
    GUEST_READ_BLOCKS,
    GUEST_WRITE_BLOCK,
    PAYLOAD_DIR,
    PAYLOAD_IMAGE_MIB,
    PAYLOAD_RECIPE,
    PAYLOAD_SEED,
    QEMU_BINARIES,
    QEMU_FIRMWARE,
    SERVER_TOML,
    STALL_SERVER_TOML,
    build_filter_payload,
    build_guest_initramfs,
    build_page_server,
    build_patched_qemu,
    shared_libs,
    write_pcsl,
)
from ktestlib.series import (  # noqa: E402
    AUTHOR,
    apply_series,
    checkout_tree,
    series_files,
    series_hash,
)
from ktestlib.source import (  # noqa: E402
    SRC_PACKAGE,
    SRC_TARBALL,
    PrivateApt,
    Source,
    apt_candidate,
    ensure_source,
    ensure_source_tarball,
    host_package_version,
    source_key,
)

__all__ = [
    "AUTHOR",
    "BAD_PATTERNS",
    "BAD_RE",
    "BENCH_GUEST_CONFIG",
    "BUILD_RECIPE",
    "CONFIGS",
    "FILTER_TEST",
    "GIT_ID",
    "GUEST",
    "GUEST_CONFIG",
    "GUEST_INIT",
    "GUEST_READ_BLOCKS",
    "GUEST_WRITE_BLOCK",
    "HERE",
    "INIT",
    "LIBDIR",
    "NO_SMART_SCAN",
    "PATCHES",
    "PAYLOAD_DIR",
    "PAYLOAD_IMAGE_MIB",
    "PAYLOAD_RECIPE",
    "PAYLOAD_SEED",
    "QEMU_BINARIES",
    "QEMU_FIRMWARE",
    "REPO",
    "SCAN_SAMPLES_BAD",
    "SCAN_SAMPLES_GOOD",
    "SERVER_TOML",
    "SRC_PACKAGE",
    "SRC_TARBALL",
    "STALL_SERVER_TOML",
    "UAPI",
    "GuestTest",
    "KtestError",
    "PrivateApt",
    "Result",
    "Source",
    "apply_series",
    "apt_candidate",
    "boot",
    "build_filter_payload",
    "build_guest_initramfs",
    "build_initramfs",
    "build_kernel",
    "build_page_server",
    "build_patched_qemu",
    "build_tests",
    "cache_root",
    "check_series_locked",
    "check_uapi_header",
    "checkout_tree",
    "cmd_build",
    "cmd_check_series",
    "cmd_devtree",
    "cmd_export",
    "cmd_run",
    "cmd_selfcheck",
    "config_fragments",
    "configure",
    "ensure_busybox",
    "ensure_kernel",
    "ensure_source",
    "ensure_source_tarball",
    "extract_between",
    "guest_tests",
    "host_package_version",
    "image_key",
    "jobs",
    "log",
    "main",
    "maintainers_hint_only",
    "make",
    "nice_prefix",
    "parse_fragment",
    "parse_results",
    "run",
    "sampler_argv",
    "series_files",
    "series_hash",
    "sha256_file",
    "shared_libs",
    "source_key",
    "tree_id",
    "write_pcsl",
]


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="build (cached), boot, run the tests")
    r.add_argument(
        "--config",
        choices=["debug", "plain"],
        default=None,
        help="kernel config (default: debug; plain with --bench)",
    )
    r.add_argument("--bench", action="store_true", help="run the benchmark instead of the tests")
    r.add_argument("--only", help="regex: run only the tests whose name matches")
    r.add_argument("--append", default="", help="extra kernel command line")
    r.add_argument("--shell", help="run this shell command in the guest instead of the tests")
    r.add_argument(
        "--kernel", help="boot this bzImage instead (tests still built against the series)"
    )
    r.add_argument(
        "-v", "--verbose", action="store_true", help="print the output of passing tests too"
    )
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
        return {
            "run": cmd_run,
            "build": cmd_build,
            "check-series": cmd_check_series,
            "devtree": cmd_devtree,
            "export": cmd_export,
            "selfcheck": cmd_selfcheck,
        }[args.cmd](args)
    except KtestError as e:
        print(f"ktest: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
