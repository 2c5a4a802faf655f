#!/usr/bin/env python3
"""Benchmark: analyze-image wall time per phase, list size, coverage.

Runs the real CLI on a golden image (default: the demo image, built if
needed) and prints a Markdown block for docs/benchmarks.md, including the
exact command line and the host facts that matter (accelerator, cores).

    sudo .venv/bin/python bench/analyze_image.py [--variant demo] [--runs 1] [IMAGE]
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pageshare import golden

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("image", nargs="?", type=Path)
    ap.add_argument("--variant", default="demo", choices=sorted(golden.VARIANTS))
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument(
        "extra", nargs=argparse.REMAINDER, help="further analyze-image options after --"
    )
    args = ap.parse_args()
    image = args.image or golden.build_image(args.variant).path
    with tempfile.TemporaryDirectory(prefix="pageshare-bench-") as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pageshare.cli",
            "analyze",
            "--json",
            "--quiet",
            "--runs",
            str(args.runs),
            "--lists-dir",
            tmp,
            "--db",
            f"{tmp}/r.sqlite",
            *[a for a in args.extra if a != "--"],
            str(image),
        ]
        t0 = time.monotonic()
        p = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            env=dict(os.environ, PYTHONPATH=str(REPO / "analyzer")),
        )
        wall = time.monotonic() - t0
    if p.returncode != 0:
        print(p.stderr, file=sys.stderr)
        return p.returncode
    s = json.loads(p.stdout)
    shown = " ".join(
        [
            "analyze-image",
            "--runs",
            str(args.runs),
            *[a for a in args.extra if a != "--"],
            image.name,
        ]
    )
    print(f"### analyze-image on `{image.parent.name}/{image.name}`\n")
    print(f"- command: `{shown}` (via `bench/analyze_image.py`)")
    print(f"- host: {os.cpu_count()} cores, {platform.release()}, accelerator {s['accel']}")
    print(f"- wall time: {wall:.1f} s")
    print(f"- listed: {s['listed_blocks']} blocks = {s['listed_mib']:.1f} MiB")
    print(f"- list covers {100 * s['coverage']:.1f} % of KSM-merged non-zero guest memory\n")
    print("| phase | seconds |\n|---|---:|")
    for k, v in s["phases"].items():
        print(f"| {k} | {v:.1f} |")
    total = sum(s["breakdown_pages"].values()) or 1
    print("\n| merged memory (both VMs) | MiB | share |\n|---|---:|---:|")
    for k, n in sorted(s["breakdown_pages"].items(), key=lambda kv: -kv[1]):
        print(f"| {k} | {n * 4 / 1024:.1f} | {100 * n / total:.1f} % |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
