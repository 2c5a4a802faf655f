"""`pageshare list show|verify`: inspect a sector list, or check it against an image."""

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from .diskimage import image_content_sha256, open_raw
from .errors import RaisingArgumentParser, UsageError, UserError, print_error
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
    return parser


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


def cli_main(argv: list[str]) -> int:
    """``pageshare list ...``; argv excludes "pageshare list"."""
    parser = _build_parser()
    try:
        args = parser.parse_args(argv)
    except UsageError as e:
        print_error(f"{e} (see 'pageshare list --help')")
        return 2
    except SystemExit as e:  # --help
        return e.code if isinstance(e.code, int) else 0
    try:
        result: int = args.func(args)
        return result
    except ListFormatError as e:
        print_error(str(e))
        return 2
    except UserError as e:
        print_error(e.message, e.hint)
        return 2
    except OSError as e:
        where = f"{e.filename}: " if e.filename else ""
        print(f"error: {where}{e.strerror or e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(cli_main(sys.argv[1:]))
