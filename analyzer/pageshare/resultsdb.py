"""The analyzer's results database (SQLite).

One database per installation collects every run: which image, how the VMs
were set up, the KSM time series, every merged guest frame with its
classification and verdict, and the blocks that went into lists.  The
schema is documented in docs/results-db.md; notebooks/ read it with pandas.
SCHEMA_VERSION is stored in PRAGMA user_version; an older database is
migrated by creating what is missing (the tables gain columns), except that
version 2 re-keys `file` by file system (see _rekey_file).
"""

import sqlite3
from pathlib import Path

# 2: file systems of the image (filesystem), fs_uuid on file, guest_page, listed_block.
SCHEMA_VERSION = 2

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
"""


# Columns added after a table was first released: CREATE TABLE IF NOT EXISTS
# leaves an existing table as it is, so connect() adds these when missing.
ADDED_COLUMNS = (("analysis", "introspector", "TEXT"), ("guest_page", "fs_uuid", "TEXT"),
                 ("listed_block", "fs_uuid", "TEXT"))


def _rekey_file(db: sqlite3.Connection) -> None:
    """Version 1's `file` was keyed by (analysis, inode), which two file
    systems of one image can share; SQLite cannot change a primary key in
    place, so the table is copied into the version 2 layout (its old rows
    belong to the root, fs_uuid '')."""
    have = {row[1] for row in db.execute("PRAGMA table_info(file)")}
    if "fs_uuid" in have:
        return
    db.execute("ALTER TABLE file RENAME TO file_v1")
    db.executescript(SCHEMA)            # creates the new file table
    db.execute("INSERT INTO file (analysis_id, ino, path) SELECT analysis_id, ino, path "
               "FROM file_v1")
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
