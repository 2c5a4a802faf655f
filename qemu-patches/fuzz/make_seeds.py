#!/usr/bin/env python3
"""Seed corpus for table_fuzz: TABLE messages (version 2) and table memfds
as the page server makes them (page-server/PROTOCOL.md), valid ones of a
few sizes and the malformed shapes a broken server could send.

    make_seeds.py DIR      # writes DIR/seed-*.bin
"""

from __future__ import annotations

import random
import struct
import sys
from pathlib import Path

HASH_MULT = 0x9E3779B97F4A7C15
MASK64 = (1 << 64) - 1
MSG_SIZE = 136


def seed(
    blocks: list[int],
    image_blocks: int,
    *,
    lie: int = 0,
    full: bool = False,
    arena: int = 0x7F0000000000,
    bad_addr: bool = False,
) -> bytes:
    bits = 4
    while (1 << bits) < 2 * len(blocks):
        bits += 1
    n = 1 << bits
    buckets = [(0, 0)] * n
    for b in blocks:
        key = b + 1
        j = ((key * HASH_MULT) & MASK64) >> (64 - bits)
        while buckets[j][0]:
            j = (j + 1) & (n - 1)
        buckets[j] = (key, arena + 4096 * b + (8 if bad_addr else 0))
    if full:
        free = iter(b for b in range(image_blocks) if b not in set(blocks))
        buckets = [(k, a) if k else ((b := next(free)) + 1, arena + 4096 * b) for k, a in buckets]
    size = image_blocks * 4096
    sha = bytes(range(32))
    entries = len(blocks) - lie
    header = struct.pack(
        "<8sIIQQ32sQQIIQIIQQQ",
        b"PSTABLE1",
        1,
        128,
        1,
        size,
        sha,
        entries,
        n,
        bits,
        4096,
        128,
        4242,
        0,
        arena,
        size,
        0,
    )
    table = header + b"".join(struct.pack("<QQ", k, a) for k, a in buckets)
    msg = struct.pack(
        "<IIQQQQ32sIIdIIQQQqq",
        2,
        0,
        1,
        entries,
        len(table),
        size,
        sha,
        4242,
        2,
        0.0,
        1,
        0,
        2049,
        1234,
        size,
        10**18,
        10**18,
    )
    assert len(msg) == MSG_SIZE
    return msg + table


def main() -> int:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(1)
    seeds = {
        "empty": seed([], 64),
        "one": seed([5], 64),
        "dense": seed(list(range(0, 40)), 80),
        "random": seed(sorted(rng.sample(range(4096), 700)), 4096),
        "lie": seed(list(range(0, 8)), 64, lie=4),
        "full": seed(list(range(0, 8)), 64, full=True),
        "bad-addr": seed([1, 2, 3], 64, bad_addr=True),
    }
    for name, data in seeds.items():
        (out / f"seed-{name}.bin").write_bytes(data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
