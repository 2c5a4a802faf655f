#!/usr/bin/env python3
"""The server's feedback under a flood of distinct blocks (issue 22: "a
summary message and the server's memory stay bounded with 10^6 distinct hot
blocks").

Makes a sparse raw image of --gib GiB (enough 4 KiB blocks for the flood),
serves it with a small list and a throwaway Redis, and has one client send
READS for --blocks distinct blocks.  Prints how long the server took to
count them, how many it kept and evicted (feedback.max_blocks, default
1,048,576), its RSS before and after, its own estimate of the tally's
memory, the published hash's size, and status round trips meanwhile.

    sudo .venv/bin/python page-server/bench/bench_feedback.py [--blocks 1200000] [--json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis
from pageshare.lists import sectorlist
from pageshare_tools import pageshare_client as psc
from pageshare_tools.server_process import (
    ImageSpec,
    Redis,
    Server,
    content_sha256,
    free_port,
    make_list,
    rss_bytes,
    wait_for,
)

REPO = Path(__file__).resolve().parents[2]


def sparse_image(path: Path, size: int) -> sectorlist.ImageIdentity:
    """A raw image of `size` bytes: 1 MiB of random bytes, then a hole."""
    with open(path, "wb") as f:
        f.truncate(size)
        f.write(random.Random(1).randbytes(1 << 20))
    return sectorlist.ImageIdentity(size, content_sha256(path), path.name)


def run(d: Path, gib: int, nblocks: int) -> dict[str, Any]:
    raw = d / "flood.raw"
    ident = sparse_image(raw, gib << 30)
    image_blocks = ident.virtual_size // 4096
    if nblocks + 256 > image_blocks:
        raise SystemExit(f"--blocks {nblocks} needs more than {gib} GiB")
    listed: dict[int, str] = {}
    with open(raw, "rb") as f:
        for b in range(0, 256, 4):
            f.seek(b * 4096)
            listed[b * 8] = hashlib.sha256(f.read(4096)).hexdigest()
    make_list(ident, listed, d / "flood.pcsl")
    rd = Redis(free_port(), d / "redis")
    rd.start()
    s = Server(
        d / "server",
        [ImageSpec("flood", raw, d / "flood.pcsl", fmt="raw")],
        rd.url,
        "bench",
        extra="[feedback]\ninterval_secs = 2",
    )
    try:
        s.start()
        s.wait_generation("flood", 1, 900)
        assert s.proc is not None
        rss0 = rss_bytes(s.proc.pid)
        with psc.PageshareClient(s.sock("flood")) as c:
            m = c.recv()
            assert isinstance(m, psc.TableMsg)
            c.switched(m.generation)
            t0 = time.monotonic()
            for i in range(0, nblocks, psc.READS_MAX_ENTRIES):
                end = min(i + psc.READS_MAX_ENTRIES, nblocks)
                c.reads(m.generation, [(256 + b, 1) for b in range(i, end)])
            wait_for(
                lambda: s.image("flood")["feedback"]["counters"]["accepted_blocks"] >= nblocks,
                600,
                "the flood counted",
            )
            counted = time.monotonic() - t0
            fb = s.image("flood")["feedback"]
            rss1 = rss_bytes(s.proc.pid)
            t1 = time.time()
            wait_for(
                lambda: s.image("flood")["feedback"]["publish"]["last_publish"] > t1,
                60,
                "a publish",
            )
            t2 = time.monotonic()
            for _ in range(100):
                s.status()
            status_ms = (time.monotonic() - t2) * 10
        key = f"pageshare:feedback:{ident.virtual_size}-{ident.content_sha256}:bench"
        stored = redis.Redis.from_url(rd.url).hget(key, "blocks")
        assert isinstance(stored, bytes)
        return {
            "blocks_sent": nblocks,
            "seconds_to_count": round(counted, 2),
            "blocks_kept": fb["blocks"],
            "blocks_evicted": fb["evicted_blocks"],
            "tally_estimate_mib": round(fb["memory_bytes"] / (1 << 20), 1),
            "rss_before_mib": round(rss0 / (1 << 20), 1),
            "rss_after_mib": round(rss1 / (1 << 20), 1),
            "published_blocks_mib": round(len(stored) / (1 << 20), 1),
            "status_round_trip_ms": round(status_ms, 2),
        }
    finally:
        s.stop(signal.SIGKILL)
        rd.stop(signal.SIGKILL)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=1_200_000)
    ap.add_argument("--gib", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="pageshare-bench-feedback-") as tmp:
        r = run(Path(tmp), args.gib, args.blocks)
    if args.json:
        print(json.dumps(r))
    else:
        for k, v in r.items():
            print(f"{k:24} {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
