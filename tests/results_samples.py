"""A small results database with synthetic rows whose numbers are known:
two analyses that succeeded (the newer with two runs, the older with one)
and one that failed, each run's guest pages by VM and category, KSM
samples, listed blocks by file and phase times, written with
resultsdb.connect().  make_results_db() writes it; the constants say what
is in it, so that a test can work out what a reader of the notebook must
see.  Used by test_notebook.py and test_pageshare_package.py.
"""

import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pageshare.analysis import resultsdb

PAGE = 4096
CATEGORIES = ["listed", "page-cache", "anon", "kernel", "zero"]

# Analysis #2 (the newest 'ok' one): merged frames per run, VM and category.
PAGES: dict[tuple[int, str], dict[str, int]] = {
    (1, "A"): {"listed": 512, "page-cache": 256, "anon": 128, "kernel": 1024, "zero": 768},
    (1, "B"): {"listed": 512, "page-cache": 128, "anon": 256, "kernel": 1280, "zero": 512},
    (2, "A"): {"listed": 256, "page-cache": 256, "anon": 128, "kernel": 1024, "zero": 256},
    (2, "B"): {"listed": 768, "page-cache": 384, "anon": 0, "kernel": 768, "zero": 1024},
}
# Verdicts of the page-cache frames, handed out in this order per (run, vm).
VERDICT_CYCLE = ["metadata", "metadata", "hole", "dirty", "mismatch", "intra-only", None]
# Listed blocks of analysis #2 by file: (ino, path, kind, blocks).
LISTED_FILES = [
    (12, "/usr/lib/x86_64-linux-gnu/libc.so.6", "file", 300),
    (13, "/usr/bin/systemctl", "file", 200),
    (14, "/usr/lib/udev/hwdb.bin", "file", 100),
    (None, None, "bdev", 60),  # file system metadata: "(metadata)"
    (15, None, "file", 40),  # no path resolved: "(inode 15)"
]
PHASES = [
    ("inspect", 0.4),
    ("boot", 31.5),
    ("ksm", 20.25),
    ("dump", 6.5),
    ("introspect", 12.75),
    ("map-verify", 0.6),
    ("write-list", 0.1),
]
# Analysis #1 (older, also 'ok'): one run, so a wrong pick changes every number.
OLD_PAGES: dict[tuple[int, str], dict[str, int]] = {
    (1, "A"): {"listed": 64, "page-cache": 0, "anon": 0, "kernel": 128, "zero": 64},
    (1, "B"): {"listed": 64, "page-cache": 0, "anon": 0, "kernel": 192, "zero": 0},
}


# Named, since later schema versions add columns (fs_uuid) after these.
GUEST_PAGE_COLUMNS = (
    "run_id, vm, gpfn, host_pfn, merge, kind, category, ino, page_index, state, sector, verdict"
)
LISTED_COLUMNS = "analysis_id, sector, sha256, ino, file_offset, kind, runs_seen, both_vms"


def _insert_analysis(
    db: sqlite3.Connection,
    image_id: int,
    started: str,
    status: str,
    pages: dict[tuple[int, str], dict[str, int]],
) -> int:
    runs = sorted({run for run, _ in pages})
    cur = db.execute(
        "INSERT INTO analysis (image_id, started_at, finished_at, status, tool_version, "
        "host_kernel, qemu_version, crash_version, accel, accel_reason, ram_mib, runs, "
        "min_runs, workload, settle_s, list_path, listed_blocks) "
        "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
        (
            image_id,
            started,
            started.replace("T10", "T11"),
            status,
            "0.1.0",
            "6.1.0-test",
            "QEMU emulator version 7.2.22",
            "crash 8.0.2",
            "kvm",
            "probe boot worked",
            1024,
            len(runs),
            len(runs),
            "boot to multi-user",
            20.0,
            "/tmp/lists/test.pcsl",
            700,
        ),
    )
    analysis_id = cur.lastrowid
    assert analysis_id is not None
    for seq in runs:
        cur = db.execute(
            "INSERT INTO run (analysis_id, seq, ksm_converged, ksm_seconds, ksm_full_scans, "
            "ksm_params_json, guest_kernel, guest_build_id) VALUES (?,?,?,?,?,?,?,?)",
            (
                analysis_id,
                seq,
                1,
                12.0 + seq,
                4,
                json.dumps({"pages_to_scan": "20000"}),
                "6.1.0-56-cloud-amd64",
                "ab" * 20,
            ),
        )
        run_id = cur.lastrowid
        assert run_id is not None
        for vm in ("A", "B"):
            counts = pages[(seq, vm)]
            db.execute(
                "INSERT INTO vm VALUES (?,?,?,?,?,?,?,?)",
                (
                    run_id,
                    vm,
                    1000 + seq,
                    25.0 + seq,
                    100_000,
                    sum(counts.values()) - counts["zero"],
                    10,
                    counts["zero"],
                ),
            )
            db.executemany(
                f"INSERT INTO guest_page ({GUEST_PAGE_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
                list(_guest_rows(run_id, vm, counts)),
            )
        # KSM converging: shared pages grow, then level off.
        for k in range(8):
            t = 1.5 * k
            sharing = min(k, 5) * 800 * seq
            db.execute(
                "INSERT INTO ksm_sample VALUES (?,?,?,?,?,?,?,?,?,?)",
                (
                    run_id,
                    t,
                    k,
                    sharing // 2,
                    sharing,
                    20_000 - sharing,
                    10,
                    min(k, 5) * 150,
                    k * 20_000,
                    sharing * PAGE,
                ),
            )
    return analysis_id


def _guest_rows(run_id: int, vm: str, counts: dict[str, int]) -> Iterator[tuple[Any, ...]]:
    gpfn = 0
    verdicts = 0
    for cat in CATEGORIES:
        for i in range(counts[cat]):
            gpfn += 1
            host_pfn = 500_000 + gpfn
            if cat == "zero":
                yield (run_id, vm, gpfn, None, "zero", None, "zero", None, None, None, None, "zero")
            elif cat == "listed":
                yield (
                    run_id,
                    vm,
                    gpfn,
                    host_pfn,
                    "cross",
                    "file",
                    cat,
                    12,
                    i,
                    "U---",
                    126_000 + 8 * i,
                    "stable",
                )
            elif cat == "page-cache":
                verdict = VERDICT_CYCLE[verdicts % len(VERDICT_CYCLE)]
                verdicts += 1
                kind = {"metadata": "bdev", None: "shmem"}.get(verdict, "file")
                merge = "intra" if verdict == "intra-only" else "cross"
                yield (run_id, vm, gpfn, host_pfn, merge, kind, cat, 13, i, "UD--", None, verdict)
            elif cat == "anon":
                yield (
                    run_id,
                    vm,
                    gpfn,
                    host_pfn,
                    "cross",
                    "anon",
                    cat,
                    None,
                    None,
                    None,
                    None,
                    None,
                )
            else:
                yield (
                    run_id,
                    vm,
                    gpfn,
                    host_pfn,
                    "cross",
                    "slab" if i % 2 else None,
                    cat,
                    None,
                    None,
                    None,
                    None,
                    None,
                )


def make_results_db(path: Path) -> Path:
    """A results database with two analyses that succeeded and one that failed."""
    db = resultsdb.connect(path)
    cur = db.execute(
        "INSERT INTO image (path, format, virtual_size, content_sha256, distro, product, "
        "kernel_version, root_partition, root_start_sector, root_uuid, block_size) "
        "VALUES (?,?,?,?,?,?,?,?,?,?,?)",
        (
            "/images/base.qcow2",
            "qcow2",
            2 << 30,
            "97" * 32,
            "debian",
            "12.15",
            "6.1.0-56-cloud-amd64",
            1,
            262_144,
            "059a5ac6-84ce-4b8f-88bf-106cefac840b",
            4096,
        ),
    )
    image_id = cur.lastrowid
    assert image_id is not None
    old = _insert_analysis(db, image_id, "2026-11-20T10:00:00Z", "ok", OLD_PAGES)
    new = _insert_analysis(db, image_id, "2026-11-21T10:00:00Z", "ok", PAGES)
    # The newest analysis failed: the notebook must skip it by default.
    db.execute(
        "INSERT INTO analysis (image_id, started_at, status, error) VALUES (?,?,?,?)",
        (image_id, "2026-11-22T10:00:00Z", "failed", "SystemExit: 143"),
    )
    assert (old, new) == (1, 2)

    sector = 300_000
    for ino, path_, kind, n in LISTED_FILES:
        if ino is not None and path_ is not None:
            db.execute(
                "INSERT INTO file (analysis_id, ino, path) VALUES (?,?,?)", (new, ino, path_)
            )
        for k in range(n):
            sector += 8
            db.execute(
                f"INSERT INTO listed_block ({LISTED_COLUMNS}) VALUES (?,?,?,?,?,?,?,?)",
                (new, sector, f"{sector:064x}", ino, k * PAGE if ino else None, kind, 2, 1),
            )
    db.execute(
        "INSERT INTO file (analysis_id, ino, path) VALUES (?,?,?)",
        (old, 99, "/etc/old-analysis-only"),
    )
    db.execute(
        f"INSERT INTO listed_block ({LISTED_COLUMNS}) VALUES (?,?,?,?,?,?,?,?)",
        (old, 8, "0" * 64, 99, 0, "file", 1, 1),
    )
    db.executemany("INSERT INTO phase VALUES (?,?,?)", [(new, n, s) for n, s in PHASES])
    db.executemany("INSERT INTO phase VALUES (?,?,?)", [(old, "boot", 999.0)])
    db.commit()
    db.close()
    return path
