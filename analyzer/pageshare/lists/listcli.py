"""`pageshare list show|verify|refine`: inspect a sector list, check it against an image,
or refine it from what the fleet's guests read (refine.py)."""

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from ..errors import (
    RaisingArgumentParser,
    UsageError,
    UserError,
    print_error,
    print_json_error,
)
from ..image.diskimage import image_content_sha256, open_raw
from .refine import DEFAULT_MIN_GUESTS, DEFAULT_MIN_HOSTS, DEFAULT_WINDOW
from .sectorlist import (
    BLOCK_SIZE,
    FORMAT_VERSION,
    HASH_NAME,
    SECTOR_SIZE,
    ListFormatError,
    SectorList,
    extents_runs,
    format_human,
    read,
    verify_against_image,
)

_DESCRIPTION = """\
Inspect and check pcsl v1 sector lists.

A sector list names the 4 KiB blocks of one golden (base) image that guests
keep unchanged in their page caches, so a page server can preload them.  It is
UTF-8 text: a header of 'key: value' lines (image virtual size, image content
sha256, count, list-digest = sha256 of the body, ...), a '---' line, then one
'<sector> <sha256 of the 4 KiB block>' line per block, sectors in 512-byte
units, sorted.  The full format is described in lists/README.md.
"""


def _build_parser() -> argparse.ArgumentParser:
    parser = RaisingArgumentParser(
        prog="pageshare list",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Exit status: 0 success/match, 1 list does not match the image, 2 error.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    show = sub.add_parser(
        "show",
        help="summarise a list: image, block count, size, digest, contiguous runs",
        description="Validate a sector list and summarise it: the image it belongs to, "
        "the number of blocks and MiB, the list digest and the contiguous runs of blocks "
        "(first 50 unless --all).  Format: lists/README.md.",
    )
    show.add_argument("file", metavar="FILE", help="a .pcsl sector list")
    show.add_argument("--all", action="store_true", help="list every contiguous run")
    show.add_argument(
        "--json",
        action="store_true",
        help="print JSON for scripts: header fields, count, bytes and all runs as "
        "[start_sector, n_blocks] pairs",
    )
    show.set_defaults(func=_cmd_show)

    verify = sub.add_parser(
        "verify",
        help="check a list against an image (size, content sha256, every block hash)",
        description="Check that a sector list belongs to an image: the image's virtual "
        "size and content sha256 must match the list header, and every listed 4 KiB "
        "block must hash to its listed sha256.  Prints a one-line verdict; exit 0 if "
        "everything matches, 1 if not, 2 on errors.  qcow2 images are converted to a "
        "temporary raw file with 'qemu-img convert' first (needs qemu-img and free "
        "space for the raw image's data).  Format: lists/README.md.",
    )
    verify.add_argument("file", metavar="FILE", help="a .pcsl sector list")
    verify.add_argument(
        "--image", required=True, metavar="IMG", help="the base image: raw or qcow2"
    )
    verify.add_argument(
        "--no-content-hash",
        action="store_true",
        help="skip the image content sha256 (it reads the whole virtual disk); the "
        "size and every listed block are still checked",
    )
    verify.add_argument(
        "--tmpdir",
        metavar="DIR",
        help="where to put the temporary raw conversion of a qcow2 image "
        "(default: the system temporary directory)",
    )
    verify.add_argument("--json", action="store_true", help="print the result as JSON")
    verify.set_defaults(func=_cmd_verify)
    _add_refine(sub)
    return parser


_REFINE_DESCRIPTION = f"""\
Write the next generation of an image's list from what the fleet's guests
really read.  Page servers publish, per host, which base blocks their guests
read (Redis: <prefix>:feedback:<image key>:<host>).  refine sums them over the
hosts and adds an unlisted block when

  - at least --min-guests distinct guests (default {DEFAULT_MIN_GUESTS}), summed over
    the hosts, on at least --min-hosts hosts (default {DEFAULT_MIN_HOSTS}) read it,
  - it lies inside the image and is one whole 4 KiB page of a regular file of
    the image, as analyze-image maps files to blocks (ext2/3/4, XFS, btrfs;
    not metadata, directories, free space or anything outside the mapped file
    systems),
  - and it is not all zeros.

Its hash is computed from the image's bytes, and the written list is read back
and checked against the image block by block, so it never holds a block whose
bytes differ from the image.  With --drop-unread, listed blocks that no guest
on any host read during --window are dropped (frees preloaded memory), but only
when every host's summary covers the whole window and is fresh; otherwise
nothing is dropped and refine says why.

Why a block needs several guests on several hosts: a list is published to
every host, so a block one tenant alone reads must not enter it, or the list
would tell other tenants what that tenant reads.  Page servers count guests
(QEMU processes), not tenants; nobody here knows tenants.  So the thresholds
guarantee: every added block was read by at least N guest processes (a guest
counted again after its server restarted, or on each host it migrated to)
spread over at least M hosts (so one host's guests alone never add a block).
They do NOT guarantee N tenants: one tenant running N VMs over M hosts passes.
Set --min-guests above the most VMs of this image one tenant runs, and
--min-hosts above the most hosts one tenant spans, where tenants share an
image.  The defaults ({DEFAULT_MIN_GUESTS} guests, {DEFAULT_MIN_HOSTS} hosts) are the least that
keeps a single guest and a single host out; a shared fleet wants more.

The list it refines is the one published in Redis for the image, or --list
FILE.  The new list is generation N+1 (header x-generation; analyze-image's
lists are generation 1) with x-parent-list-digest naming the list it refines;
it is written to --output or <lists-dir>/<image>-<sha>.gen<N+1>.pcsl.  Publish
it with 'pageshare list publish' (or --publish).  Each refinement is recorded
in the results database (tables refinement, refined_block); 'pageshare report
--refinements' plots each generation's blocks and coverage.
"""

_REFINE_EPILOG = """\
examples:
  pageshare list refine golden.qcow2
      refine the list published in Redis, default thresholds
  pageshare list refine golden.qcow2 --min-guests 20 --min-hosts 5 --publish
      a fleet where one tenant runs up to 19 VMs of the image on up to 4 hosts
  pageshare list refine golden.qcow2 --list lists/golden-0d85f5af1e0d.pcsl \\
      --drop-unread --window 3d -o lists/golden.next.pcsl
      also drop listed blocks no guest read in the last 3 days
  pageshare list refine golden.qcow2 --json | jq '.added, .rejected'

Exit status: 0 a list was written, 2 error (with --json: {"ok": false, "error": ...}).
"""


def _duration(text: str) -> float:
    m = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)([smhd]?)", text.strip())
    if not m:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a duration: use e.g. 3600, 90m, 12h or 7d"
        )
    return float(m[1]) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[m[2]]


def _add_refine(sub: Any) -> None:
    from .distribute import add_redis_arguments

    r = sub.add_parser(
        "refine",
        help="the next list generation from the blocks the fleet's guests read",
        description=_REFINE_DESCRIPTION,
        epilog=_REFINE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    r.add_argument("image", metavar="IMAGE", type=Path, help="the base image (qcow2 or raw)")
    r.add_argument(
        "--list",
        dest="list_path",
        metavar="FILE",
        type=Path,
        help="the list to refine (default: the one published in Redis for IMAGE)",
    )
    r.add_argument(
        "--min-guests",
        type=int,
        default=DEFAULT_MIN_GUESTS,
        metavar="N",
        help=f"distinct guests, summed over hosts, that must have read a block "
        f"(default {DEFAULT_MIN_GUESTS})",
    )
    r.add_argument(
        "--min-hosts",
        type=int,
        default=DEFAULT_MIN_HOSTS,
        metavar="M",
        help=f"hosts on which a guest must have read it (default {DEFAULT_MIN_HOSTS})",
    )
    r.add_argument(
        "--drop-unread",
        action="store_true",
        help="also drop listed blocks no guest read during --window",
    )
    r.add_argument(
        "--window",
        type=_duration,
        default=DEFAULT_WINDOW,
        metavar="DURATION",
        help="the unread window for --drop-unread: seconds, or 90m, 12h, 7d "
        "(default 7d); every host's summary must cover it",
    )
    r.add_argument("-o", "--output", type=Path, metavar="FILE", help="the list to write")
    r.add_argument(
        "--lists-dir",
        type=Path,
        default=Path("lists"),
        metavar="DIR",
        help="where the list goes without --output (default ./lists)",
    )
    r.add_argument(
        "--db",
        type=Path,
        metavar="PATH",
        help="results database (default $PAGESHARE_DB or ~/.local/share/pageshare/results.sqlite)",
    )
    r.add_argument(
        "--publish",
        action="store_true",
        help="publish the new list too (as 'pageshare list publish' does)",
    )
    add_redis_arguments(r)
    r.add_argument(
        "--json",
        action="store_true",
        help="print the result (or the error) as one JSON object on stdout",
    )
    r.set_defaults(func=_cmd_refine)


def _cmd_refine(args: argparse.Namespace) -> int:
    from ..progress import Progress
    from .distribute import Store
    from .refine import RefineOptions, format_result, refine

    opts = RefineOptions(
        image=args.image,
        store=Store(args.redis, args.prefix),
        list_path=args.list_path,
        min_guests=args.min_guests,
        min_hosts=args.min_hosts,
        drop_unread=args.drop_unread,
        window_s=args.window,
        output=args.output,
        lists_dir=args.lists_dir,
        publish=args.publish,
    )
    if args.db:
        opts.db = args.db
    result = refine(opts, Progress("pageshare list refine"))
    print(json.dumps(result.to_json(), indent=2) if args.json else format_result(result))
    return 0


def _header_dict(sl: SectorList) -> dict[str, Any]:
    header: dict[str, Any] = {
        "image-virtual-size": sl.image.virtual_size,
        "image-content-sha256": sl.image.content_sha256,
        "image-name": sl.image.name,
        "block-size": BLOCK_SIZE,
        "sector-size": SECTOR_SIZE,
        "hash": HASH_NAME,
        "count": len(sl.blocks),
        "list-digest": sl.digest(),
        "generator": sl.generator,
        "created": sl.created,
        "criteria": sl.criteria,
        "runs": sl.runs,
    }
    header.update(sl.extra)
    return header


def _cmd_show(args: argparse.Namespace) -> int:
    path = Path(args.file)
    sl = read(path)
    if args.json:
        runs = extents_runs(sl.sorted_sectors())
        out = {
            "file": str(path),
            "format": f"pcsl v{FORMAT_VERSION}",
            "header": _header_dict(sl),
            "count": len(sl.blocks),
            "bytes": sl.total_bytes(),
            "run_count": len(runs),
            "runs": [[start, n] for start, n in runs],
        }
        print(json.dumps(out, indent=2))
    else:
        print(format_human(sl, limit=None if args.all else 50))
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    list_path = Path(args.file)
    image_path = Path(args.image)
    sl = read(list_path)
    with open_raw(image_path, args.tmpdir) as (raw, fmt):
        size_ok = raw.size == sl.image.virtual_size
        content: str | None = None
        if not args.no_content_hash:
            content = image_content_sha256(raw.read_at, raw.size)
        bad = verify_against_image(sl, lambda sector: raw.read_at(sector * SECTOR_SIZE, BLOCK_SIZE))
    content_ok = None if content is None else content == sl.image.content_sha256
    ok = size_ok and content_ok is not False and not bad

    problems = []
    if not size_ok:
        problems.append(f"virtual size {raw.size} != {sl.image.virtual_size} in the list")
    if content_ok is False:
        problems.append("content sha256 differs (list is for another image, or it changed)")
    if bad:
        first = ", ".join(str(s) for s in bad[:5]) + (", ..." if len(bad) > 5 else "")
        problems.append(f"{len(bad)} of {len(sl.blocks)} blocks differ (sectors {first})")

    if args.json:
        print(
            json.dumps(
                {
                    "ok": ok,
                    "list": str(list_path),
                    "image": str(image_path),
                    "image_format": fmt,
                    "virtual_size": {
                        "list": sl.image.virtual_size,
                        "image": raw.size,
                        "ok": size_ok,
                    },
                    "content_sha256": {
                        "list": sl.image.content_sha256,
                        "image": content,
                        "ok": content_ok,  # null: not checked (--no-content-hash)
                    },
                    "blocks": len(sl.blocks),
                    "bad_sectors": bad,
                },
                indent=2,
            )
        )
    elif ok:
        checked = "size, every block" + (
            " and content sha256" if content_ok else "; content sha256 not checked"
        )
        print(
            f"OK: {list_path} matches {image_path} ({fmt}; {len(sl.blocks)} blocks, "
            f"{sl.total_bytes() / (1 << 20):.2f} MiB; {checked})"
        )
    else:
        print(f"MISMATCH: {list_path} vs {image_path} ({fmt}): " + "; ".join(problems))
    return 0 if ok else 1


def main(argv: list[str]) -> int:
    """``pageshare list ...``; argv excludes "pageshare list"."""
    parser = _build_parser()
    as_json = argv[:1] == ["refine"] and "--json" in argv

    def fail(kind: str, message: str, hint: str = "") -> int:
        if as_json:
            print_json_error(kind, message, hint, indent=2)
        print_error(message, hint)
        return 2

    try:
        args = parser.parse_args(argv)
    except UsageError as e:
        return fail("usage", f"{e} (see 'pageshare list {argv[0] if argv else ''} --help')")
    except SystemExit as e:  # --help
        return e.code if isinstance(e.code, int) else 0
    try:
        result: int = args.func(args)
        return result
    except ListFormatError as e:
        return fail("bad-list", str(e))
    except UserError as e:
        return fail(e.kind, e.message, e.hint)
    except KeyboardInterrupt:
        return fail("interrupted", "interrupted")
    except OSError as e:
        where = f"{e.filename}: " if e.filename else ""
        return fail("user-error", f"{where}{e.strerror or e}")
    except (RuntimeError, ValueError) as e:
        if not as_json:
            raise
        return fail("internal", f"{type(e).__name__}: {e}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
