"""Tests for notebooks/analysis.ipynb run headless by pageshare.notebook.

The tests build a small results database with resultsdb.connect() and
synthetic rows whose numbers are known, execute the real notebook on it in a
real ipykernel kernel, and check what a reader would see: no errors, the
figures as PNG files, and the breakdown, file and verdict tables with the
MiB and frame counts that follow from the rows.
"""

import json
import sqlite3
import struct
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("pandas")
pytest.importorskip("matplotlib")

import nbformat
from pageshare import resultsdb
from pageshare.notebook import run_notebook

PAGE = 4096
MIB = 2**20
CATEGORIES = ["listed", "page-cache", "anon", "kernel", "zero"]
FIGURES = ["breakdown", "ksm", "phases", "top_files", "verdicts"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

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
    (None, None, "bdev", 60),                   # file system metadata: "(metadata)"
    (15, None, "file", 40),                      # no path resolved: "(inode 15)"
]
PHASES = [("inspect", 0.4), ("boot", 31.5), ("ksm", 20.25), ("dump", 6.5),
          ("introspect", 12.75), ("map-verify", 0.6), ("write-list", 0.1)]
# Analysis #1 (older, also 'ok'): one run, so a wrong pick changes every number.
OLD_PAGES: dict[tuple[int, str], dict[str, int]] = {
    (1, "A"): {"listed": 64, "page-cache": 0, "anon": 0, "kernel": 128, "zero": 64},
    (1, "B"): {"listed": 64, "page-cache": 0, "anon": 0, "kernel": 192, "zero": 0},
}


# Named, since later schema versions add columns (fs_uuid) after these.
GUEST_PAGE_COLUMNS = ("run_id, vm, gpfn, host_pfn, merge, kind, category, ino, page_index, "
                      "state, sector, verdict")
LISTED_COLUMNS = "analysis_id, sector, sha256, ino, file_offset, kind, runs_seen, both_vms"


def _insert_analysis(db: sqlite3.Connection, image_id: int, started: str, status: str,
                     pages: dict[tuple[int, str], dict[str, int]]) -> int:
    runs = sorted({run for run, _ in pages})
    cur = db.execute(
        "INSERT INTO analysis (image_id, started_at, finished_at, status, tool_version, "
        "host_kernel, qemu_version, crash_version, accel, accel_reason, ram_mib, runs, "
        "min_runs, workload, settle_s, list_path, listed_blocks) "
        "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
        (image_id, started, started.replace("T10", "T11"), status, "0.1.0", "6.1.0-test",
         "QEMU emulator version 7.2.22", "crash 8.0.2", "kvm", "probe boot worked", 1024,
         len(runs), len(runs), "boot to multi-user", 20.0, "/tmp/lists/test.pcsl", 700))
    analysis_id = cur.lastrowid
    assert analysis_id is not None
    for seq in runs:
        cur = db.execute(
            "INSERT INTO run (analysis_id, seq, ksm_converged, ksm_seconds, ksm_full_scans, "
            "ksm_params_json, guest_kernel, guest_build_id) VALUES (?,?,?,?,?,?,?,?)",
            (analysis_id, seq, 1, 12.0 + seq, 4, json.dumps({"pages_to_scan": "20000"}),
             "6.1.0-56-cloud-amd64", "ab" * 20))
        run_id = cur.lastrowid
        assert run_id is not None
        for vm in ("A", "B"):
            counts = pages[(seq, vm)]
            db.execute("INSERT INTO vm VALUES (?,?,?,?,?,?,?,?)",
                       (run_id, vm, 1000 + seq, 25.0 + seq, 100_000,
                        sum(counts.values()) - counts["zero"], 10, counts["zero"]))
            db.executemany(f"INSERT INTO guest_page ({GUEST_PAGE_COLUMNS}) "
                           "VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
                           list(_guest_rows(run_id, vm, counts)))
        # KSM converging: shared pages grow, then level off.
        for k in range(8):
            t = 1.5 * k
            sharing = min(k, 5) * 800 * seq
            db.execute(
                "INSERT INTO ksm_sample VALUES (?,?,?,?,?,?,?,?,?,?)",
                (run_id, t, k, sharing // 2, sharing, 20_000 - sharing, 10,
                 min(k, 5) * 150, k * 20_000, sharing * PAGE))
    return analysis_id


def _guest_rows(run_id: int, vm: str, counts: dict[str, int]) -> Iterator[tuple[Any, ...]]:
    gpfn = 0
    verdicts = 0
    for cat in CATEGORIES:
        for i in range(counts[cat]):
            gpfn += 1
            host_pfn = 500_000 + gpfn
            if cat == "zero":
                yield (run_id, vm, gpfn, None, "zero", None, "zero", None, None, None, None,
                       "zero")
            elif cat == "listed":
                yield (run_id, vm, gpfn, host_pfn, "cross", "file", cat, 12, i, "U---",
                       126_000 + 8 * i, "stable")
            elif cat == "page-cache":
                verdict = VERDICT_CYCLE[verdicts % len(VERDICT_CYCLE)]
                verdicts += 1
                kind = {"metadata": "bdev", None: "shmem"}.get(verdict, "file")
                merge = "intra" if verdict == "intra-only" else "cross"
                yield (run_id, vm, gpfn, host_pfn, merge, kind, cat, 13, i, "UD--", None,
                       verdict)
            elif cat == "anon":
                yield (run_id, vm, gpfn, host_pfn, "cross", "anon", cat, None, None, None,
                       None, None)
            else:
                yield (run_id, vm, gpfn, host_pfn, "cross", "slab" if i % 2 else None, cat,
                       None, None, None, None, None)


def _expected_verdicts() -> Counter[str]:
    out: Counter[str] = Counter()
    for counts in PAGES.values():
        for k in range(counts["page-cache"]):
            out[VERDICT_CYCLE[k % len(VERDICT_CYCLE)] or "(none)"] += 1
    return out


@pytest.fixture(scope="module")
def results_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_results_db(tmp_path_factory.mktemp("db") / "results.sqlite")


def make_results_db(path: Path) -> Path:
    """A results database with two analyses that succeeded and one that failed."""
    db = resultsdb.connect(path)
    cur = db.execute(
        "INSERT INTO image (path, format, virtual_size, content_sha256, distro, product, "
        "kernel_version, root_partition, root_start_sector, root_uuid, block_size) "
        "VALUES (?,?,?,?,?,?,?,?,?,?,?)",
        ("/images/base.qcow2", "qcow2", 2 << 30, "97" * 32, "debian", "12.15",
         "6.1.0-56-cloud-amd64", 1, 262_144, "059a5ac6-84ce-4b8f-88bf-106cefac840b", 4096))
    image_id = cur.lastrowid
    assert image_id is not None
    old = _insert_analysis(db, image_id, "2026-11-20T10:00:00Z", "ok", OLD_PAGES)
    new = _insert_analysis(db, image_id, "2026-11-21T10:00:00Z", "ok", PAGES)
    # The newest analysis failed: the notebook must skip it by default.
    db.execute("INSERT INTO analysis (image_id, started_at, status, error) VALUES (?,?,?,?)",
               (image_id, "2026-11-22T10:00:00Z", "failed", "SystemExit: 143"))
    assert (old, new) == (1, 2)

    sector = 300_000
    for ino, path_, kind, n in LISTED_FILES:
        if ino is not None and path_ is not None:
            db.execute("INSERT INTO file (analysis_id, ino, path) VALUES (?,?,?)",
                       (new, ino, path_))
        for k in range(n):
            sector += 8
            db.execute(f"INSERT INTO listed_block ({LISTED_COLUMNS}) VALUES (?,?,?,?,?,?,?,?)",
                       (new, sector, f"{sector:064x}", ino, k * PAGE if ino else None, kind,
                        2, 1))
    db.execute("INSERT INTO file (analysis_id, ino, path) VALUES (?,?,?)",
               (old, 99, "/etc/old-analysis-only"))
    db.execute(f"INSERT INTO listed_block ({LISTED_COLUMNS}) VALUES (?,?,?,?,?,?,?,?)",
               (old, 8, "0" * 64, 99, 0, "file", 1, 1))
    db.executemany("INSERT INTO phase VALUES (?,?,?)", [(new, n, s) for n, s in PHASES])
    db.executemany("INSERT INTO phase VALUES (?,?,?)", [(old, "boot", 999.0)])
    db.commit()
    db.close()
    return path


@pytest.fixture(scope="module")
def executed(results_db: Path, tmp_path_factory: pytest.TempPathFactory
             ) -> tuple[Any, Path]:
    out = tmp_path_factory.mktemp("out")
    figures = out / "figures"
    path = run_notebook(results_db, None, out / "executed.ipynb", figures, timeout=120)
    assert path == (out / "executed.ipynb").resolve()
    return _read_nb(path), figures


def _cell(nb: Any, cell_id: str) -> Any:
    cells = [c for c in nb.cells if c.get("id") == cell_id]
    assert len(cells) == 1, f"notebook has no single cell {cell_id!r}"
    return cells[0]


def _read_nb(path: Path) -> Any:
    return nbformat.read(path, as_version=4)  # type: ignore[no-untyped-call]


def _text(cell: Any) -> str:
    """All text a code cell showed: streams and the text/plain of non-image displays."""
    parts = []
    for out in cell.outputs:
        if out.output_type == "stream":
            parts.append(out.text)
        elif (out.output_type in ("display_data", "execute_result")
              and "image/png" not in out.data):
            parts.append(out.data.get("text/plain", "") + "\n")
    return "".join(parts)


def _table_rows(text: str, labels: list[str]) -> dict[str, list[float]]:
    """The numbers on each line of a printed table that starts with one of labels."""
    rows = {}
    for line in text.splitlines():
        line = line.strip()
        for label in labels:
            rest = line[len(label):]
            if line.startswith(label) and (not rest or rest[0] == " "):
                rows[label] = [float(x) for x in rest.split()]
    return rows


def _mib(pages: float) -> float:
    return pages * PAGE / MIB


def test_notebook_runs_without_errors(executed: tuple[Any, Path]) -> None:
    nb, _ = executed
    errors = [(c.get("id"), o.get("ename"), o.get("evalue")) for c in nb.cells
              if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert errors == []
    assert all(c.get("execution_count") for c in nb.cells if c.cell_type == "code")
    setup = _text(_cell(nb, "setup"))
    assert "analysis: #2" in setup                      # newest 'ok', not the failed #3
    assert f"python:   {sys.executable}" in setup       # kernel runs in this interpreter
    assert nb.metadata["pageshare"]["analysis_id"] is None


def test_figures_are_saved_as_png(executed: tuple[Any, Path]) -> None:
    nb, figures = executed
    assert sorted(p.name for p in figures.iterdir()) == sorted(f"{f}.png" for f in FIGURES)
    for name in FIGURES:
        data = (figures / f"{name}.png").read_bytes()
        assert data[:8] == PNG_MAGIC, name
        assert data[12:16] == b"IHDR", name
        width, height = struct.unpack(">II", data[16:24])
        assert width >= 400 and height >= 200, (name, width, height)
        assert len(data) > 5000, name
    shown = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
             if "image/png" in o.get("data", {})]
    assert len(shown) == len(FIGURES)


def test_breakdown_table_has_the_mib_per_category(executed: tuple[Any, Path]) -> None:
    nb, _ = executed
    text = _text(_cell(nb, "breakdown"))
    assert "mean per run over 2 run(s)" in text
    rows = _table_rows(text, [*CATEGORIES, "all merged"])
    assert set(rows) == {*CATEGORIES, "all merged"}, text
    n_runs = 2
    all_total = _mib(sum(sum(c.values()) for c in PAGES.values())) / n_runs
    for cat in CATEGORIES:
        a = _mib(sum(PAGES[(r, "A")][cat] for r in (1, 2))) / n_runs
        b = _mib(sum(PAGES[(r, "B")][cat] for r in (1, 2))) / n_runs
        expected = [a, b, a + b, 100 * (a + b) / all_total]
        assert rows[cat] == pytest.approx(expected, abs=0.006), (cat, text)
    a_all = sum(rows[c][0] for c in CATEGORIES)
    assert rows["all merged"] == pytest.approx(
        [a_all, all_total - a_all, all_total, 100.0], abs=0.02)
    # Spot check against hand arithmetic: listed = (512+256)/2 and (512+768)/2 pages.
    assert rows["listed"][:3] == [1.5, 2.5, 4.0]


def test_top_files_and_verdicts(executed: tuple[Any, Path]) -> None:
    nb, _ = executed
    files = _text(_cell(nb, "files"))
    labels = [p or ("(metadata)" if k == "bdev" else f"(inode {i})")
              for i, p, k, _ in LISTED_FILES]
    order = [files.index(label) for label in labels]
    assert order == sorted(order), files                 # by listed MiB, largest first
    for label, (_, _, _, n) in zip(labels, LISTED_FILES, strict=True):
        line = next(x for x in files.splitlines() if label in x)
        assert line.split()[-2:] == [str(n), f"{_mib(n):.3f}"], line
    assert "/etc/old-analysis-only" not in files
    assert "5 file(s), 700 blocks = 2.73 MiB listed" in files

    verdicts = _text(_cell(nb, "verdicts"))
    expected = _expected_verdicts()
    rows = _table_rows(verdicts, list(expected))
    assert set(rows) == set(expected), verdicts
    for verdict, n in expected.items():
        assert rows[verdict][2:] == pytest.approx([n, _mib(n)], abs=0.006), verdict
        assert rows[verdict][0] + rows[verdict][1] == n

    phases = _text(_cell(nb, "phases"))
    order = [phases.index(f"{name} ") for name, _ in PHASES]
    assert order == sorted(order), phases                # pipeline order
    rows = _table_rows(phases, [name for name, _ in PHASES])
    assert rows == {name: [pytest.approx(round(s, 2))] for name, s in PHASES}


def test_explicit_analysis_without_figures(results_db: Path, tmp_path: Path) -> None:
    out = run_notebook(results_db, 1, tmp_path / "old.ipynb", None)
    nb = _read_nb(out)
    assert "analysis: #1" in _text(_cell(nb, "setup"))
    rows = _table_rows(_text(_cell(nb, "breakdown")), [*CATEGORIES, "all merged"])
    assert rows["listed"][:3] == [0.25, 0.25, 0.5]
    assert rows["all merged"][:3] == [1.0, 1.0, 2.0]
    assert "no unlisted page-cache frames" in _text(_cell(nb, "verdicts"))
    assert list(tmp_path.iterdir()) == [tmp_path / "old.ipynb"]   # no figures saved


def test_failure_names_the_cell_and_error(results_db: Path, tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=r"cell 1 \(setup\) failed: LookupError: .*"
                                           r"no analysis with id 42"):
        run_notebook(results_db, 42, tmp_path / "bad.ipynb", None)
    assert (tmp_path / "bad.ipynb").is_file()             # partly executed, for debugging
    with pytest.raises(RuntimeError, match="results database not found"):
        run_notebook(tmp_path / "missing.sqlite", None, tmp_path / "x.ipynb", None)


def test_committed_notebook_has_no_outputs() -> None:
    from pageshare.notebook import NOTEBOOK

    nb = _read_nb(NOTEBOOK)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, cell.get("id")
