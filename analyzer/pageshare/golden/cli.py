"""The command line: ``python -m pageshare.golden`` (also ``pageshare image build``).

Builds the variants' images, or finds them cached, and prints where they are.
"""

from __future__ import annotations

import argparse
import json
import sys

from pageshare.errors import UserError, print_error

from .build import build_image
from .layout import GIB
from .spec import _spec
from .variants import VARIANTS


def _parser() -> argparse.ArgumentParser:
    lines = []
    for name in VARIANTS:
        spec = _spec(name)
        lines.append(
            f"  {name}: Debian {spec.suite} ({spec.mmdebstrap_variant}), {spec.layout}, "
            f"{spec.virtual_size // GIB} GiB, plus {' '.join(spec.packages)}"
        )
    variants = "\n".join(lines)
    return argparse.ArgumentParser(
        prog="python -m pageshare.golden",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Build the Debian golden images (plain qcow2) that analysed guests are cloned\n"
            "from, with mmdebstrap and mkfs.ext4 -d (needs root, no mounting).\n\n"
            f"Variants:\n{variants}\n\n"
            "Images are cached in $PAGESHARE_CACHE/images (default ~/.cache/pageshare/images)\n"
            "as <variant>-<key>/base.qcow2 + manifest.json, keyed by a hash of the variant's\n"
            "spec and the builder version; a cached image is reused unless --force.\n"
            "Prints the image path, or with --json one JSON object per image per line."
        ),
    )


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    parser.add_argument("--variant", choices=[*VARIANTS, "all"], default="demo")
    parser.add_argument("--force", action="store_true", help="rebuild even if cached")
    parser.add_argument("--json", action="store_true", help="print path and manifest as JSON")
    args = parser.parse_args(argv)
    names = list(VARIANTS) if args.variant == "all" else [args.variant]
    try:
        for name in names:
            image = build_image(name, force=args.force)
            if args.json:
                record = {"variant": name, "path": str(image.path), "manifest": image.manifest}
                print(json.dumps(record), flush=True)
            else:
                print(image.path, flush=True)
    except UserError as e:
        print_error(e.message, e.hint)
        return e.exit_code
    except KeyboardInterrupt:
        print("error: interrupted; temporary files were removed", file=sys.stderr)
        return 130
    return 0
