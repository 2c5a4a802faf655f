"""The analyzer's results database (SQLite).

One database per installation collects every run: which image, how the VMs
were set up, the KSM time series, every merged guest frame with its
classification and verdict, and the blocks that went into lists.  The
schema is documented in docs/results-db.md; notebooks/ read it with pandas.
SCHEMA_VERSION is stored in PRAGMA user_version; an older database is
migrated by creating what is missing (the tables gain columns), except that
version 2 re-keys `file` by file system (see _rekey_file).  The statements
that write an analysis (analyze.py's) are here too, below the schema.
"""

import json
import sqlite3
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

from ..image.fslayout import MappedFs, SkippedFs
from ..image.image_inspect import ImageInfo
from .hostmap import MergeClass
from .ksm import Convergence, Sample
from .mapping import norm_uuid

# 2: file systems of the image (filesystem), fs_uuid on file, guest_page, listed_block.
# 3: list refinements from the fleet's feedback (refinement, refined_block).
SCHEMA_VERSION = 3

SCHEMA = """
CREATE TABLE IF NOT EXISTS image (
    id INTEGER PRIMARY KEY,
    path TEXT NOT NULL,
    format TEXT NOT NULL,
    virtual_size INTEGER NOT NULL,
    content_sha256 TEXT NOT NULL,
    distro TEXT, product TEXT, kernel_version TEXT,
    root_partition INTEGER, root_start_sector INTEGER, root_uuid TEXT, block_size INTEGER,
    UNIQUE (content_sha256, virtual_size)
);
CREATE TABLE IF NOT EXISTS analysis (
    id INTEGER PRIMARY KEY,
    image_id INTEGER NOT NULL REFERENCES image(id),
    started_at TEXT NOT NULL,
    finished_at TEXT,
    status TEXT NOT NULL,            -- running / ok / failed
    tool_version TEXT, host_kernel TEXT, qemu_version TEXT, crash_version TEXT,
    accel TEXT, accel_reason TEXT, ram_mib INTEGER,
    runs INTEGER, min_runs INTEGER, workload TEXT, settle_s REAL,
    vmlinux_build_id TEXT, list_path TEXT, listed_blocks INTEGER, error TEXT,
    introspector TEXT                -- crash or drgn (auto/... until a run has chosen)
);
CREATE TABLE IF NOT EXISTS run (
    id INTEGER PRIMARY KEY,
    analysis_id INTEGER NOT NULL REFERENCES analysis(id),
    seq INTEGER NOT NULL,            -- 1..N within the analysis
    ksm_converged INTEGER, ksm_seconds REAL, ksm_full_scans INTEGER,
    ksm_params_json TEXT, guest_kernel TEXT, guest_build_id TEXT
);
CREATE TABLE IF NOT EXISTS vm (
    run_id INTEGER NOT NULL REFERENCES run(id),
    vm TEXT NOT NULL,
    pid INTEGER, boot_seconds REAL, present_pages INTEGER,
    cross_pages INTEGER, intra_pages INTEGER, zero_pages INTEGER,
    PRIMARY KEY (run_id, vm)
);
CREATE TABLE IF NOT EXISTS ksm_sample (
    run_id INTEGER NOT NULL REFERENCES run(id),
    t REAL NOT NULL,
    full_scans INTEGER, pages_shared INTEGER, pages_sharing INTEGER, pages_unshared INTEGER,
    pages_volatile INTEGER, ksm_zero_pages INTEGER, pages_scanned INTEGER,
    general_profit INTEGER,
    PRIMARY KEY (run_id, t)
);
CREATE TABLE IF NOT EXISTS phase (
    analysis_id INTEGER NOT NULL REFERENCES analysis(id),
    name TEXT NOT NULL,
    seconds REAL NOT NULL,
    PRIMARY KEY (analysis_id, name)
);
-- Inode numbers are per file system: a separate /boot has an inode 12 too.
CREATE TABLE IF NOT EXISTS file (
    analysis_id INTEGER NOT NULL REFERENCES analysis(id),
    ino INTEGER NOT NULL,
    path TEXT,                       -- in the guest, e.g. /boot/vmlinuz-6.1.0-56-cloud-amd64
    fs_uuid TEXT NOT NULL DEFAULT '',  -- '' in rows of databases before version 2 (root)
    PRIMARY KEY (analysis_id, fs_uuid, ino)
);
-- Every file system the image's /etc/fstab mounts, mapped or not (and why).
CREATE TABLE IF NOT EXISTS filesystem (
    analysis_id INTEGER NOT NULL REFERENCES analysis(id),
    mountpoint TEXT NOT NULL,
    device TEXT, fstype TEXT, uuid TEXT, start_sector INTEGER, block_size INTEGER,
    mapped INTEGER NOT NULL,
    reason TEXT,                     -- why it is not mapped
    PRIMARY KEY (analysis_id, mountpoint)
);
-- Every KSM-merged guest frame (merge: cross = shared with the other VM,
-- intra = merged but not with the other VM, zero = mapped to the zero page)
-- and what the guest used it for.
CREATE TABLE IF NOT EXISTS guest_page (
    run_id INTEGER NOT NULL REFERENCES run(id),
    vm TEXT NOT NULL,
    gpfn INTEGER NOT NULL,
    host_pfn INTEGER,
    merge TEXT NOT NULL CHECK (merge IN ('cross', 'intra', 'zero')),
    kind TEXT,                       -- pagescan kind: file, bdev, anon, slab, nomapping, ...
    category TEXT NOT NULL,          -- listed, page-cache, anon, zero, kernel
    ino INTEGER, page_index INTEGER, state TEXT,
    sector INTEGER,                  -- base-image sector, when it mapped
    verdict TEXT,                    -- stable, or why not: dirty, hole, mismatch, zero, ...
    fs_uuid TEXT,                    -- of a file page's file system (hex, no dashes)
    PRIMARY KEY (run_id, vm, gpfn)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS guest_page_sector ON guest_page(sector);
-- The blocks of the list an analysis wrote, with where they came from.
CREATE TABLE IF NOT EXISTS listed_block (
    analysis_id INTEGER NOT NULL REFERENCES analysis(id),
    sector INTEGER NOT NULL,
    sha256 TEXT NOT NULL,
    ino INTEGER, file_offset INTEGER, kind TEXT,
    runs_seen INTEGER NOT NULL, both_vms INTEGER NOT NULL,
    fs_uuid TEXT,                    -- of a file block's file system (hex, no dashes)
    PRIMARY KEY (analysis_id, sector)
) WITHOUT ROWID;
-- Each `pageshare list refine`: the list it started from, the fleet's
-- summaries it read, its thresholds, and the list generation it wrote.
CREATE TABLE IF NOT EXISTS refinement (
    id INTEGER PRIMARY KEY,
    image_id INTEGER NOT NULL REFERENCES image(id),
    started_at TEXT NOT NULL,
    finished_at TEXT,
    status TEXT NOT NULL,            -- running / ok / failed
    tool_version TEXT,
    parent_path TEXT, parent_digest TEXT, parent_generation INTEGER,
    parent_revision INTEGER,         -- the Redis publish revision it was fetched at, or NULL
    parent_blocks INTEGER,
    min_guests INTEGER NOT NULL, min_hosts INTEGER NOT NULL,
    drop_unread INTEGER NOT NULL,    -- 1: listed blocks no guest read were to be dropped
    window_s REAL, window_start REAL, -- the unread window (unix seconds), when drop_unread
    drop_refused TEXT,               -- why no block was dropped although asked, or NULL
    hosts_used INTEGER, hosts_json TEXT,        -- [{host, since, updated, guests, blocks}]
    hosts_failed INTEGER, failures_json TEXT,   -- [{host, key, error}]: summaries not used
    reported_unlisted INTEGER,       -- distinct unlisted blocks any host reported
    reported_listed INTEGER,         -- distinct listed blocks some guest read
    guest_reads_listed INTEGER,      -- sum over hosts and blocks of guests, listed blocks
    guest_reads_unlisted INTEGER,    -- the same for unlisted blocks
    added INTEGER, dropped INTEGER,
    rejected_json TEXT,              -- {reason: blocks} of unlisted blocks not added
    dropped_json TEXT,               -- {reason: blocks} of listed blocks dropped
    generation INTEGER, list_path TEXT, list_digest TEXT, listed_blocks INTEGER,
    error TEXT
);
-- The blocks a refinement added to or dropped from the list, and why.
CREATE TABLE IF NOT EXISTS refined_block (
    refinement_id INTEGER NOT NULL REFERENCES refinement(id),
    sector INTEGER NOT NULL,
    action TEXT NOT NULL CHECK (action IN ('added', 'dropped')),
    reason TEXT NOT NULL,            -- added: read-by-fleet; dropped: unread, bytes-differ
    guests INTEGER, hosts INTEGER, reads INTEGER,  -- what the fleet read of it (dropped: 0 if
                                     -- unread; NULL in rows written before they were kept)
    sha256 TEXT,                     -- the block's hash in the new list (added)
    PRIMARY KEY (refinement_id, sector)
) WITHOUT ROWID;
"""


# Columns added after a table was first released: CREATE TABLE IF NOT EXISTS
# leaves an existing table as it is, so connect() adds these when missing.
ADDED_COLUMNS = (
    ("analysis", "introspector", "TEXT"),
    ("guest_page", "fs_uuid", "TEXT"),
    ("listed_block", "fs_uuid", "TEXT"),
)


def _rekey_file(db: sqlite3.Connection) -> None:
    """Version 1's `file` was keyed by (analysis, inode), which two file
    systems of one image can share; SQLite cannot change a primary key in
    place, so the table is copied into the version 2 layout (its old rows
    belong to the root, fs_uuid '')."""
    have = {row[1] for row in db.execute("PRAGMA table_info(file)")}
    if "fs_uuid" in have:
        return
    db.execute("ALTER TABLE file RENAME TO file_v1")
    db.executescript(SCHEMA)  # creates the new file table
    db.execute(
        "INSERT INTO file (analysis_id, ino, path) SELECT analysis_id, ino, path FROM file_v1"
    )
    db.execute("DROP TABLE file_v1")


def connect(path: Path) -> sqlite3.Connection:
    path.parent.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(path, timeout=30)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA foreign_keys=ON")
    db.executescript(SCHEMA)
    _rekey_file(db)
    for table, column, decl in ADDED_COLUMNS:
        have = {row[1] for row in db.execute(f"PRAGMA table_info({table})")}
        if column not in have:
            db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {decl}")
    db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
    db.commit()
    return db


# Writing an analysis.  analyze.py decides what to record and when to commit
# (a run's rows become visible together); these functions only hold the SQL,
# so that the statements sit next to the schema they must match.

# The ksm_sample columns after run_id and t, in table order: the KSM counters
# each sample records (a counter the host kernel lacks is NULL).
KSM_SAMPLE_KEYS = (
    "full_scans",
    "pages_shared",
    "pages_sharing",
    "pages_unshared",
    "pages_volatile",
    "ksm_zero_pages",
    "pages_scanned",
    "general_profit",
)


class GuestPage(NamedTuple):
    """A guest_page row without its run_id: one KSM-merged frame of a VM."""

    vm: str
    gpfn: int
    host_pfn: int | None
    merge: str
    kind: str | None
    category: str
    ino: int | None
    page_index: int | None
    state: str | None
    sector: int | None
    verdict: str | None
    fs_uuid: str | None


class ListedBlock(NamedTuple):
    """A listed_block row without its analysis_id: one block of the list written."""

    sector: int
    sha256: str
    ino: int | None
    file_offset: int
    kind: str
    runs_seen: int
    both_vms: int
    fs_uuid: str | None


def record_image(
    db: sqlite3.Connection, path: Path, fmt: str, vsize: int, content: str, info: ImageInfo
) -> int:
    """The image's id: the same bytes are one row wherever the file is (the
    row keeps the latest path)."""
    db.execute(
        "INSERT INTO image (path, format, virtual_size, content_sha256, distro, product, "
        "kernel_version, root_partition, root_start_sector, root_uuid, block_size) "
        "VALUES (?,?,?,?,?,?,?,?,?,?,?) ON CONFLICT (content_sha256, virtual_size) "
        "DO UPDATE SET path=excluded.path",
        (
            str(path.resolve()),
            fmt,
            vsize,
            content,
            info.distro,
            info.product,
            info.kernel_version,
            info.root_partition,
            info.root_start_sector,
            info.root_uuid,
            info.block_size,
        ),
    )
    row = db.execute(
        "SELECT id FROM image WHERE content_sha256=? AND virtual_size=?", (content, vsize)
    ).fetchone()
    return int(row[0])


def start_analysis(
    db: sqlite3.Connection,
    image_id: int,
    *,
    started_at: str,
    tool_version: str,
    host_kernel: str,
    qemu_version: str,
    crash_version: str | None,
    accel: str,
    accel_reason: str,
    ram_mib: int,
    runs: int,
    min_runs: int,
    workload: str,
    settle_s: float,
    introspector: str,
) -> int:
    """A new analysis row, status running (until finish_ or fail_analysis); its id."""
    cur = db.execute(
        "INSERT INTO analysis (image_id, started_at, status, tool_version, host_kernel, "
        "qemu_version, crash_version, accel, accel_reason, ram_mib, runs, min_runs, "
        "workload, settle_s, introspector) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
        (
            image_id,
            started_at,
            "running",
            tool_version,
            host_kernel,
            qemu_version,
            crash_version,
            accel,
            accel_reason,
            ram_mib,
            runs,
            min_runs,
            workload,
            settle_s,
            introspector,
        ),
    )
    return int(cur.lastrowid or 0)


def record_filesystems(
    db: sqlite3.Connection,
    analysis_id: int,
    mapped: Iterable[MappedFs],
    skipped: Iterable[SkippedFs],
) -> None:
    """Every file system of the image: the mapped ones (UUID as the page cache
    names it), and the skipped ones with why."""
    rows: list[tuple[Any, ...]] = [
        (
            analysis_id,
            f.mountpoint,
            f.device,
            f.fstype,
            norm_uuid(f.uuid),
            f.start_sector,
            f.block_size,
            1,
            None,
        )
        for f in mapped
    ]
    rows += [
        (analysis_id, f.mountpoint, f.device, f.fstype, None, None, None, 0, f.reason)
        for f in skipped
    ]
    db.executemany("INSERT INTO filesystem VALUES (?,?,?,?,?,?,?,?,?)", rows)


def set_introspector(db: sqlite3.Connection, analysis_id: int, introspector: str) -> None:
    """The backend a run used, replacing the one requested (auto, ...)."""
    db.execute("UPDATE analysis SET introspector=? WHERE id=?", (introspector, analysis_id))


def record_list(
    db: sqlite3.Connection, analysis_id: int, list_path: Path, listed_blocks: int
) -> None:
    """The list the analysis wrote; the guest kernel's build-id is the first run's."""
    db.execute(
        "UPDATE analysis SET vmlinux_build_id=(SELECT guest_build_id FROM run WHERE "
        "analysis_id=? LIMIT 1), list_path=?, listed_blocks=? WHERE id=?",
        (analysis_id, str(list_path.resolve()), listed_blocks, analysis_id),
    )


def finish_analysis(
    db: sqlite3.Connection, analysis_id: int, finished_at: str, phases: Mapping[str, float]
) -> None:
    """Status ok, and the seconds each phase took (summed over the runs)."""
    db.execute(
        "UPDATE analysis SET status='ok', finished_at=? WHERE id=?", (finished_at, analysis_id)
    )
    db.executemany(
        "INSERT OR REPLACE INTO phase VALUES (?,?,?)",
        [(analysis_id, k, v) for k, v in phases.items()],
    )


def fail_analysis(db: sqlite3.Connection, analysis_id: int, finished_at: str, error: str) -> None:
    """Status failed, with the error (cut to 2000 characters)."""
    db.execute(
        "UPDATE analysis SET status='failed', finished_at=?, error=? WHERE id=?",
        (finished_at, error[:2000], analysis_id),
    )


def start_run(db: sqlite3.Connection, analysis_id: int, seq: int) -> int:
    """A new run row (the rest is filled in as the run goes); its id."""
    cur = db.execute("INSERT INTO run (analysis_id, seq) VALUES (?,?)", (analysis_id, seq))
    return int(cur.lastrowid or 0)


def record_ksm_run(
    db: sqlite3.Connection, run_id: int, conv: Convergence, params: Mapping[str, str]
) -> None:
    """How KSM converged in the run, and the settings the analyzer gave it."""
    db.execute(
        "UPDATE run SET ksm_converged=?, ksm_seconds=?, ksm_full_scans=?, "
        "ksm_params_json=? WHERE id=?",
        (int(conv.converged), conv.seconds, conv.full_scans, json.dumps(params), run_id),
    )


def record_guest_kernel(db: sqlite3.Connection, run_id: int, osrelease: str, build_id: str) -> None:
    """The guest kernel as the run's dump names it (VMCOREINFO)."""
    db.execute(
        "UPDATE run SET guest_kernel=?, guest_build_id=? WHERE id=?", (osrelease, build_id, run_id)
    )


def record_vm(
    db: sqlite3.Connection, run_id: int, vm: str, pid: int, boot_seconds: float, merged: MergeClass
) -> None:
    """One guest of a run: its QEMU, its boot time and how much of it KSM merged."""
    db.execute(
        "INSERT INTO vm VALUES (?,?,?,?,?,?,?,?)",
        (
            run_id,
            vm,
            pid,
            boot_seconds,
            merged.present,
            len(merged.cross),
            len(merged.intra),
            len(merged.zero),
        ),
    )


def record_ksm_samples(db: sqlite3.Connection, run_id: int, samples: Iterable[Sample]) -> None:
    """The run's KSM counter samples, t rounded to the millisecond (the key)."""
    for s in samples:
        db.execute(
            "INSERT OR REPLACE INTO ksm_sample VALUES (?,?,?,?,?,?,?,?,?,?)",
            (run_id, round(s.t, 3), *(s.values.get(k) for k in KSM_SAMPLE_KEYS)),
        )


def record_guest_pages(db: sqlite3.Connection, run_id: int, pages: Iterable[GuestPage]) -> None:
    db.executemany(
        "INSERT INTO guest_page VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)", [(run_id, *p) for p in pages]
    )


def record_files(
    db: sqlite3.Connection, analysis_id: int, paths: Iterable[tuple[str, int, str | None]]
) -> None:
    """(fs_uuid, inode, guest path or None) of each file with listed blocks."""
    db.executemany(
        "INSERT OR REPLACE INTO file (analysis_id, fs_uuid, ino, path) VALUES (?,?,?,?)",
        [(analysis_id, *p) for p in paths],
    )


def record_listed_blocks(
    db: sqlite3.Connection, analysis_id: int, blocks: Iterable[ListedBlock]
) -> None:
    db.executemany(
        "INSERT OR REPLACE INTO listed_block VALUES (?,?,?,?,?,?,?,?,?)",
        [(analysis_id, *b) for b in blocks],
    )


# Recording a refinement (`pageshare list refine`, refine.py).


class RefinedBlock(NamedTuple):
    """A refined_block row without its refinement_id."""

    sector: int
    action: str
    reason: str
    guests: int | None
    hosts: int | None
    reads: int | None
    sha256: str | None


def start_refinement(
    db: sqlite3.Connection,
    image_id: int,
    *,
    started_at: str,
    tool_version: str,
    parent_path: str,
    parent_digest: str,
    parent_generation: int,
    parent_revision: int | None,
    parent_blocks: int,
    min_guests: int,
    min_hosts: int,
    drop_unread: bool,
    window_s: float | None,
    window_start: float | None,
) -> int:
    """A new refinement row, status running (until finish_ or fail_refinement); its id."""
    cur = db.execute(
        "INSERT INTO refinement (image_id, started_at, status, tool_version, parent_path, "
        "parent_digest, parent_generation, parent_revision, parent_blocks, min_guests, "
        "min_hosts, drop_unread, window_s, window_start) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
        (
            image_id,
            started_at,
            "running",
            tool_version,
            parent_path,
            parent_digest,
            parent_generation,
            parent_revision,
            parent_blocks,
            min_guests,
            min_hosts,
            int(drop_unread),
            window_s,
            window_start,
        ),
    )
    return int(cur.lastrowid or 0)


def finish_refinement(
    db: sqlite3.Connection,
    refinement_id: int,
    *,
    finished_at: str,
    hosts: list[dict[str, Any]],
    failures: list[dict[str, str]],
    reported_unlisted: int,
    reported_listed: int,
    guest_reads_listed: int,
    guest_reads_unlisted: int,
    rejected: Mapping[str, int],
    dropped: Mapping[str, int],
    drop_refused: str | None,
    generation: int,
    list_path: Path,
    list_digest: str,
    listed_blocks: int,
    blocks: Iterable[RefinedBlock],
) -> None:
    """What the refinement read and wrote, and each block it added or dropped."""
    rows = list(blocks)
    db.execute(
        "UPDATE refinement SET finished_at=?, status='ok', drop_refused=?, hosts_used=?, "
        "hosts_json=?, hosts_failed=?, failures_json=?, reported_unlisted=?, "
        "reported_listed=?, guest_reads_listed=?, guest_reads_unlisted=?, added=?, dropped=?, "
        "rejected_json=?, dropped_json=?, generation=?, list_path=?, list_digest=?, "
        "listed_blocks=? WHERE id=?",
        (
            finished_at,
            drop_refused,
            len(hosts),
            json.dumps(hosts),
            len(failures),
            json.dumps(failures),
            reported_unlisted,
            reported_listed,
            guest_reads_listed,
            guest_reads_unlisted,
            sum(1 for r in rows if r.action == "added"),
            sum(1 for r in rows if r.action == "dropped"),
            json.dumps(dict(rejected)),
            json.dumps(dict(dropped)),
            generation,
            str(list_path.resolve()),
            list_digest,
            listed_blocks,
            refinement_id,
        ),
    )
    db.executemany(
        "INSERT INTO refined_block VALUES (?,?,?,?,?,?,?,?)", [(refinement_id, *r) for r in rows]
    )


def fail_refinement(
    db: sqlite3.Connection, refinement_id: int, finished_at: str, error: str
) -> None:
    db.execute(
        "UPDATE refinement SET finished_at=?, status='failed', error=? WHERE id=?",
        (finished_at, error, refinement_id),
    )
