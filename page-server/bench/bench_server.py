#!/usr/bin/env python3
"""Page-server measurements for docs/benchmarks.md.

Builds a ~100 MiB list from the demo golden image's non-zero blocks, then:
cold start (content hash not cached) and warm start to the first published
generation, preload throughput (read through qemu-storage-daemon + sha256 +
copy), memory per listed block, and C table lookups (client/bench_lookup.c).

    sudo .venv/bin/python page-server/bench/bench_server.py [--mib 100] [--json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pageshare import golden
from pageshare.lists import sectorlist
from pageshare_tools.server_process import (
    CACHE,
    ImageSpec,
    Server,
    content_sha256,
    make_list,
    nonzero_blocks,
    raw_copy,
    rss_bytes,
    server_binary,
)

REPO = Path(__file__).resolve().parents[2]


def anon_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


def start_to_published(s: Server, name: str) -> tuple[float, dict[str, object]]:
    t0 = time.monotonic()
    s.start()
    img = s.wait_generation(name, 1, 900)
    return time.monotonic() - t0, img


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=100)
    ap.add_argument("--variant", default="demo")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    image = golden.build_image(args.variant).path
    work = CACHE / "bench-page-server"
    work.mkdir(parents=True, exist_ok=True)
    raw = raw_copy(image, work / f"{args.variant}.raw")
    sha = content_sha256(raw)
    n = args.mib * 256
    blocks = nonzero_blocks(raw, n)
    ident = sectorlist.ImageIdentity(raw.stat().st_size, sha, image.name)
    res: dict[str, object] = {
        "image": str(image),
        "virtual_size": raw.stat().st_size,
        "blocks": len(blocks),
        "list_mib": len(blocks) * 4096 / 2**20,
    }
    server_binary()
    with tempfile.TemporaryDirectory(prefix="bench-ps-") as td:
        d = Path(td)
        lst = d / "list.pcsl"
        make_list(ident, blocks, lst, "bench")
        one = d / "one.pcsl"
        make_list(ident, dict(list(blocks.items())[:1]), one, "bench")
        # Baseline: the same server with a 1-block list.
        base = Server(d / "base", [ImageSpec("demo", image, one)])
        _, _ = start_to_published(base, "demo")
        assert base.proc is not None
        base_anon = anon_bytes(base.proc.pid)
        base.stop()
        s = Server(d / "srv", [ImageSpec("demo", image, lst)])
        cold, img = start_to_published(s, "demo")
        ll = img["last_load"]
        assert isinstance(ll, dict)
        res["cold_start_s"] = cold
        res["preload_s"] = ll["read_seconds"]
        res["preload_mib_per_s"] = ll["read_mib_per_s"]
        assert s.proc is not None
        pid = s.proc.pid
        res["rss_mib"] = rss_bytes(pid) / 2**20
        anon = anon_bytes(pid)
        res["anon_overhead_bytes_per_block"] = (anon - base_anon - 4096 * (len(blocks) - 1)) / len(
            blocks
        )
        res["table_bytes"] = img["table_bytes"]
        res["table_bytes_per_block"] = int(str(img["table_bytes"])) / len(blocks)
        s.stop()
        warm, _ = start_to_published(s, "demo")
        res["warm_start_s"] = warm
        # C lookups against the live server.
        exe = d / "bench_lookup"
        subprocess.run(
            [
                "cc",
                "-O2",
                "-Wall",
                "-Wextra",
                "-Werror",
                "-o",
                str(exe),
                str(REPO / "page-server" / "client" / "bench_lookup.c"),
            ],
            check=True,
        )
        out = subprocess.run(
            [str(exe), str(s.sock("demo"))], capture_output=True, text=True, check=True
        ).stdout
        res["lookup"] = json.loads(out)
        s.stop()
        # The same amount of blocks scattered (every 8th non-zero block):
        # shorter runs, more NBD requests.
        scattered = nonzero_blocks(raw, n, stride=8)
        lst2 = d / "scattered.pcsl"
        make_list(ident, scattered, lst2, "bench")
        s2 = Server(d / "srv2", [ImageSpec("demo", image, lst2)])
        _, img2 = start_to_published(s2, "demo")
        ll2 = img2["last_load"]
        assert isinstance(ll2, dict)
        res["scattered_preload_s"] = ll2["read_seconds"]
        res["scattered_preload_mib_per_s"] = ll2["read_mib_per_s"]
        s2.stop()
    if args.json:
        print(json.dumps(res, indent=1))
    else:
        for k, v in res.items():
            print(f"{k}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
