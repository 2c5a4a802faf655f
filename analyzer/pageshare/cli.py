"""Command-line entry points: `analyze-image` and `pageshare`.

`pageshare` is one tree of commands (COMMANDS): each names the module whose
main() it runs, imported only when it runs.  The host tools' commands
(HOST_COMMANDS, the host subpackage) and the analyzer's (ANALYZER_COMMANDS)
ship in two Debian packages; `pageshare --help` lists what is installed.
"""

import argparse
import importlib.util
import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

from . import __version__
from .errors import UserError, print_error, print_json_error

ANALYZE_EPILOG = """\
what it does:
  1. inspects the image (libguestfs): distribution, the file systems of its
     /etc/fstab (root, a separate /boot, ...) and where they sit on the disk, and
     the kernel and initrd its boot loader boots
  2. fetches the guest kernel's debug symbols (Debian linux-image-<ver>-dbg, cached)
  3. boots two guests A and B from fresh copy-on-write overlays of the image
     (direct kernel boot with the image's own kernel; KVM if a probe boot works,
     otherwise TCG), optionally runs --workload in both, then waits --settle s
  4. tunes host KSM, waits until a full scan finds nothing new, pauses the guests
  5. reads which guest frames KSM merged across A and B (pagemap, kpageflags),
     dumps guest memory and classifies those frames with crash + pagescan, or with
     drgn for guest kernels the installed crash cannot open (6.11+: Debian 13)
  6. maps clean page-cache pages to base-image sectors via the block map of
     each ext4 (debugfs) or XFS (xfs_db) file system and byte-verifies every
     block against the image
  7. writes the sector list (lists/, format in lists/README.md) and the results DB
Host KSM settings are saved first and restored on every exit path (also Ctrl-C);
guests, overlays and dumps are removed.  Needs root.

examples:
  analyze-image base.qcow2
  analyze-image --runs 3 --workload 'curl -s localhost >/dev/null; python3 -c pass' base.qcow2
  analyze-image --json base.qcow2 | jq .listed_blocks
"""


def analyze_parser(prog: str = "analyze-image") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Find the blocks of a golden VM image that guests keep, unchanged, in "
        "their page caches, and write them as a verified sector list.",
        epilog=ANALYZE_EPILOG,
    )
    p.add_argument(
        "image",
        type=Path,
        help="golden image (qcow2 or raw), Debian 12/13 on ext4 "
        "or XFS, on partitions or linear LVM volumes (a separate /boot, /usr, ... "
        "included)",
    )
    p.add_argument(
        "--runs",
        type=int,
        default=1,
        help="boot the pair N times; one run is a noisy sample (default 1)",
    )
    p.add_argument(
        "--min-runs",
        type=int,
        default=None,
        help="keep blocks seen in at least this many runs (default: a majority)",
    )
    p.add_argument(
        "--workload",
        default="",
        metavar="CMD",
        help="shell command run as root in both guests after boot, before KSM "
        "settles (e.g. start your services, run a warm-up request)",
    )
    p.add_argument(
        "--workload-file",
        type=Path,
        metavar="FILE",
        help="like --workload, with the commands read from a file",
    )
    p.add_argument(
        "--workload-timeout",
        type=float,
        default=600,
        help="seconds the workload may take (default 600)",
    )
    p.add_argument(
        "--settle",
        type=float,
        default=20,
        help="seconds to let the guests idle after boot/workload (default 20)",
    )
    p.add_argument(
        "--ram", type=int, default=1024, metavar="MIB", help="guest RAM in MiB (default 1024)"
    )
    p.add_argument(
        "--accel",
        choices=("auto", "kvm", "tcg"),
        default="auto",
        help="auto: KVM only if a probe boot works, else TCG (default)",
    )
    p.add_argument(
        "--introspector",
        choices=("auto", "crash", "drgn"),
        default="auto",
        help="what classifies guest frames: crash + pagescan, or drgn; auto: crash "
        "if it can open the guest kernel (before 6.11), else drgn (default)",
    )
    p.add_argument(
        "--vmlinux",
        type=Path,
        help="DWARF vmlinux of the guest kernel, instead of fetching Debian's -dbg",
    )
    p.add_argument(
        "--include-metadata",
        action="store_true",
        help="also list verified block-device cache pages (ext4 metadata); volatile",
    )
    p.add_argument(
        "--lists-dir",
        type=Path,
        default=Path("lists"),
        help="where the list goes (default ./lists)",
    )
    p.add_argument(
        "--db",
        type=Path,
        default=None,
        help="results database (default ~/.local/share/pageshare/results.sqlite)",
    )
    p.add_argument(
        "--boot-timeout",
        type=float,
        default=900,
        help="seconds a guest may take to boot (default 900; TCG is slow)",
    )
    p.add_argument(
        "--ksm-timeout",
        type=float,
        default=600,
        help="seconds to wait for KSM to converge (default 600)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print the summary as JSON on stdout; on failure, one error object "
        '({"ok": false, "error": {kind, message, hint}})',
    )
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    return p


def _wants_json(argv: list[str]) -> bool:
    """--json, also when the rest of the command line does not parse."""
    return "--json" in (argv[: argv.index("--")] if "--" in argv else argv)


def run_analyze(argv: list[str], prog: str = "analyze-image") -> int:
    from .analysis.analyze import Options, analyze, default_db, format_summary
    from .analysis.workload import Workload
    from .progress import Progress

    parser = analyze_parser(prog)
    if _wants_json(argv):
        usage_error = parser.error

        def error_as_json(message: str) -> NoReturn:
            print_json_error("usage", message, f"see {prog} --help", 2)
            usage_error(message)  # usage and message on stderr, exit 2, as without --json

        parser.error = error_as_json  # type: ignore[method-assign]
    args = parser.parse_args(argv)
    try:
        command = args.workload
        if args.workload_file:
            try:
                command = args.workload_file.read_text()
            except OSError as e:
                raise UserError(f"--workload-file: {e}", "give a readable shell script") from None
        opts = Options(
            image=args.image,
            lists_dir=args.lists_dir,
            db=args.db or default_db(),
            runs=args.runs,
            min_runs=args.min_runs,
            ram_mib=args.ram,
            accel=args.accel,
            workload=Workload(command, args.workload_timeout),
            settle=args.settle,
            boot_timeout=args.boot_timeout,
            ksm_timeout=args.ksm_timeout,
            vmlinux=args.vmlinux,
            include_metadata=args.include_metadata,
            introspector=args.introspector,
        )
        progress = Progress(quiet=args.quiet)
        summary = analyze(opts, progress)
    except UserError as e:
        print_error(e.message, e.hint, prog="analyze-image")
        if args.json:
            print_json_error(e.kind, e.message, e.hint, e.exit_code)
        return e.exit_code
    except KeyboardInterrupt:
        message = "interrupted; guests stopped, KSM settings restored"
        print(f"analyze-image: {message}", file=sys.stderr)
        if args.json:
            print_json_error("interrupted", message, "", 130)
        return 130
    except Exception as e:
        # Not the operator's fault: say what broke, keep the traceback one
        # environment variable away.
        if os.environ.get("PAGESHARE_DEBUG"):
            raise
        message = f"{type(e).__name__}: {e}"
        hint = (
            "rerun with PAGESHARE_DEBUG=1 for a traceback; guests were stopped and KSM "
            "settings restored"
        )
        print(f"analyze-image: internal error: {message}", file=sys.stderr)
        print(f"analyze-image: hint: {hint}", file=sys.stderr)
        if args.json:
            print_json_error("internal", message, hint, 1)
        return 1
    if args.json:
        json.dump({"ok": True, **summary.to_json()}, sys.stdout, indent=1)
        print()
    else:
        print(format_summary(summary))
    return 0


def analyze_image_main() -> int:
    return run_analyze(sys.argv[1:])


@dataclass(frozen=True)
class Command:
    """What a command (or subcommand) runs: FUNCTION of pageshare.MODULE (of
    this module when MODULE is ""), imported only when it runs, called with
    ARGV and then the rest of the command line, and with KWARGS."""

    module: str
    function: str = "main"
    argv: tuple[str, ...] = ()
    kwargs: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Group:
    """A command whose first argument may name one of its SUBCOMMANDS, run
    with what follows it.  Any other first argument, or none, goes with the
    rest to OTHERWISE, or, without it, gets USAGE (-h, --help, nothing) or
    an error."""

    subcommands: Mapping[str, Command]
    otherwise: Command | None = None
    usage: str = ""


# The host tools: what a hypervisor runs, the pageshare-host package.  Its
# tree holds the package's HOST_TOP_MODULES and the HOST_PACKAGE subpackage
# whole (packaging/debs.py ships them); their modules import nothing of the
# analyzer's (no drgn, libguestfs or redis).
HOST_TOP_MODULES = ("__init__", "cli", "errors")
HOST_PACKAGE = "host"
HOST_COMMANDS: dict[str, Command | Group] = {
    "host": Group(
        {"check": Command("host.hostcheck")},
        usage="pageshare host check [--json] [--control PATH] [--qemu PATH] ...",
    ),
    "attach": Command("host.attach", kwargs={"action": "attach"}),
    "detach": Command("host.attach", kwargs={"action": "detach"}),
    "libvirt-watch": Command("host.libvirt_watch"),
    "libvirt-hook": Command("host.libvirt_hook"),
}
HOST_USAGE = """\
  host check [--json]   what this host lacks to share pages (kernel, KSM, QEMU, server, guests)
  attach QMP [--json]   put the pageshare filter into a running QEMU's disks (over QMP)
  detach QMP [--json]   take it out again (e.g. before migrating to a host without pageshare)
  attach --libvirt DOMAIN    the same for a libvirt domain (through libvirtd)
  libvirt-watch         attach to every libvirt domain as it starts (a daemon)
  libvirt-hook ...      libvirt's qemu hook: the filter on a migration's destination
"""

# The analyzer's commands: the pageshare package, for the machine that
# analyzes images (it depends on pageshare-host and adds these).
ANALYZER_COMMANDS: dict[str, Command | Group] = {
    "analyze": Command("", "run_analyze", kwargs={"prog": "pageshare analyze"}),
    "list": Group(
        {name: Command("lists.distribute", argv=(name,)) for name in ("publish", "fetch", "ls")},
        otherwise=Command("lists.listcli"),
    ),
    "fleet": Command("lists.distribute", argv=("fleet",), kwargs={"prog": "pageshare"}),
    "image": Group({"build": Command("golden")}, otherwise=Command("golden")),
    "report": Command("analysis.notebook"),
}
ANALYZER_USAGE = """\
  analyze IMAGE ...     same as analyze-image (see pageshare analyze --help)
  list show|verify ...  inspect a sector list, or check it against an image
  list refine IMAGE ...  the next list generation from what the fleet's guests read
  list publish|fetch|ls ...  distribute lists to page servers through Redis
  fleet [--json]        what every page server reported to Redis
  image build ...       build the project's demo/small golden images (cached)
  report [--analysis ID]     run the results notebook headless on analyze-image's results
  report --refinements [--image IMAGE]  the same for an image's list generations
"""
NO_ANALYZER = """\
  analyze, list, fleet, image, report: the analyzer, in the pageshare package
  (for the machine that analyzes images), which is not installed here
"""

COMMANDS: dict[str, Command | Group] = {**HOST_COMMANDS, **ANALYZER_COMMANDS}


def analyzer_installed() -> bool:
    """Whether the analyzer's modules are here (the checkout, or the pageshare
    package beside pageshare-host)."""
    try:
        return (
            importlib.util.find_spec(f"{__package__ or 'pageshare'}.analysis.analyze") is not None
        )
    except ModuleNotFoundError:  # no analysis subpackage at all: pageshare-host alone
        return False


def usage() -> str:
    return (
        "usage: pageshare COMMAND [ARGS]\n\ncommands:\n"
        + HOST_USAGE
        + (ANALYZER_USAGE if analyzer_installed() else "\n" + NO_ANALYZER)
        + "\nRun `pageshare COMMAND --help` for details.\n"
    )


def call(command: Command, argv: list[str]) -> int:
    """Run COMMAND's function with the rest of the command line."""
    module = (
        importlib.import_module(f"{__package__ or 'pageshare'}.{command.module}")
        if command.module
        else sys.modules[__name__]
    )
    code: int = getattr(module, command.function)([*command.argv, *argv], **command.kwargs)
    return code


def run(name: str, node: Command | Group, argv: list[str]) -> int:
    """Run command NAME (a COMMANDS entry) with the rest of the command line."""
    if isinstance(node, Command):
        return call(node, argv)
    sub = node.subcommands.get(argv[0]) if argv else None
    if sub is not None:
        return call(sub, argv[1:])
    if node.otherwise is not None:
        return call(node.otherwise, argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: {node.usage}")
        return 0 if argv else 2
    print(
        f"pageshare {name}: unknown subcommand {argv[0]!r} (try: {', '.join(node.subcommands)})",
        file=sys.stderr,
    )
    return 2


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), end="")
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "--version":
        print(f"pageshare {__version__}")
        return 0
    if cmd in ANALYZER_COMMANDS and not analyzer_installed():
        print_error(
            f"`pageshare {cmd}` is part of the analyzer, which is not installed here "
            "(this host has the host tools, the pageshare-host package)",
            "install the pageshare package (apt install ./pageshare_*.deb) on the "
            "machine that analyzes images; it brings this command",
            prog="pageshare",
        )
        return 2
    node = COMMANDS.get(cmd)
    if node is None:
        print(f"pageshare: unknown command {cmd!r}\n{usage()}", file=sys.stderr, end="")
        return 2
    return run(cmd, node, rest)


if __name__ == "__main__":
    sys.exit(main())
