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

Only the Python standard library and the project's own packages are used (run it
with .venv/bin/python, where scripts/install-deps.sh installs them).
"""

from __future__ import annotations

import argparse
import sys

# The code is in the tooling package (tools/pageshare_tools/ktestlib/, whose
# __init__.py says which module holds what; a run starts at commands.py
# cmd_run()); this file is the command line.
from pageshare_tools.ktestlib import COMMANDS, KtestError, exit_on_sigterm


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
    exit_on_sigterm()
    if args.cmd == "run" and args.config is None:
        args.config = "plain" if args.bench else "debug"
    try:
        return COMMANDS[args.cmd](args)
    except KtestError as e:
        print(f"ktest: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
