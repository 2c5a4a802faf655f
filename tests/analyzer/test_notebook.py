"""Tests for notebooks/analysis.ipynb run headless by pageshare.analysis.notebook.

The tests build a small results database with resultsdb.connect() and
synthetic rows whose numbers are known (results_samples.py), execute the
real notebook on it in a real ipykernel kernel, and check what a reader
would see: no errors, the figures as PNG files, and the breakdown, file and
verdict tables with the MiB and frame counts that follow from the rows.
"""

import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("pandas")
pytest.importorskip("matplotlib")

import nbformat
from notebook_helpers import cell_errors, png_size, read_nb, shown_images
from pageshare.analysis.notebook import run_notebook
from results_samples import (
    CATEGORIES,
    LISTED_FILES,
    PAGE,
    PAGES,
    PHASES,
    VERDICT_CYCLE,
    make_results_db,
)

MIB = 2**20
FIGURES = ["breakdown", "ksm", "phases", "top_files", "verdicts"]


def _expected_verdicts() -> Counter[str]:
    out: Counter[str] = Counter()
    for counts in PAGES.values():
        for k in range(counts["page-cache"]):
            out[VERDICT_CYCLE[k % len(VERDICT_CYCLE)] or "(none)"] += 1
    return out


@pytest.fixture(scope="module")
def results_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_results_db(tmp_path_factory.mktemp("db") / "results.sqlite")


@pytest.fixture(scope="module")
def executed(results_db: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    out = tmp_path_factory.mktemp("out")
    figures = out / "figures"
    path = run_notebook(results_db, None, out / "executed.ipynb", figures, timeout=120)
    assert path == (out / "executed.ipynb").resolve()
    return read_nb(path), figures


def _cell(nb: Any, cell_id: str) -> Any:
    cells = [c for c in nb.cells if c.get("id") == cell_id]
    assert len(cells) == 1, f"notebook has no single cell {cell_id!r}"
    return cells[0]


def _text(cell: Any) -> str:
    """All text a code cell showed: streams and the text/plain of non-image displays."""
    parts = []
    for out in cell.outputs:
        if out.output_type == "stream":
            parts.append(out.text)
        elif out.output_type in ("display_data", "execute_result") and "image/png" not in out.data:
            parts.append(out.data.get("text/plain", "") + "\n")
    return "".join(parts)


def _table_rows(text: str, labels: list[str]) -> dict[str, list[float]]:
    """The numbers on each line of a printed table that starts with one of labels."""
    rows = {}
    for line in text.splitlines():
        line = line.strip()
        for label in labels:
            rest = line[len(label) :]
            if line.startswith(label) and (not rest or rest[0] == " "):
                rows[label] = [float(x) for x in rest.split()]
    return rows


def _mib(pages: float) -> float:
    return pages * PAGE / MIB


def test_notebook_runs_without_errors(executed: tuple[Any, Path]) -> None:
    nb, _ = executed
    assert cell_errors(nb) == []
    assert all(c.get("execution_count") for c in nb.cells if c.cell_type == "code")
    setup = _text(_cell(nb, "setup"))
    assert "analysis: #2" in setup  # newest 'ok', not the failed #3
    assert f"python:   {sys.executable}" in setup  # kernel runs in this interpreter
    assert nb.metadata["pageshare"]["analysis_id"] is None


def test_figures_are_saved_as_png(executed: tuple[Any, Path]) -> None:
    nb, figures = executed
    assert sorted(p.name for p in figures.iterdir()) == sorted(f"{f}.png" for f in FIGURES)
    for name in FIGURES:
        data = (figures / f"{name}.png").read_bytes()
        width, height = png_size(data, name)
        assert width >= 400 and height >= 200, (name, width, height)
        assert len(data) > 5000, name
    assert len(shown_images(nb)) == len(FIGURES)


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
        [a_all, all_total - a_all, all_total, 100.0], abs=0.02
    )
    # Spot check against hand arithmetic: listed = (512+256)/2 and (512+768)/2 pages.
    assert rows["listed"][:3] == [1.5, 2.5, 4.0]


def test_top_files_and_verdicts(executed: tuple[Any, Path]) -> None:
    nb, _ = executed
    files = _text(_cell(nb, "files"))
    labels = [p or ("(metadata)" if k == "bdev" else f"(inode {i})") for i, p, k, _ in LISTED_FILES]
    order = [files.index(label) for label in labels]
    assert order == sorted(order), files  # by listed MiB, largest first
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
    assert order == sorted(order), phases  # pipeline order
    rows = _table_rows(phases, [name for name, _ in PHASES])
    assert rows == {name: [pytest.approx(round(s, 2))] for name, s in PHASES}


def test_explicit_analysis_without_figures(results_db: Path, tmp_path: Path) -> None:
    out = run_notebook(results_db, 1, tmp_path / "old.ipynb", None)
    nb = read_nb(out)
    assert "analysis: #1" in _text(_cell(nb, "setup"))
    rows = _table_rows(_text(_cell(nb, "breakdown")), [*CATEGORIES, "all merged"])
    assert rows["listed"][:3] == [0.25, 0.25, 0.5]
    assert rows["all merged"][:3] == [1.0, 1.0, 2.0]
    assert "no unlisted page-cache frames" in _text(_cell(nb, "verdicts"))
    assert list(tmp_path.iterdir()) == [tmp_path / "old.ipynb"]  # no figures saved


def test_failure_names_the_cell_and_error(results_db: Path, tmp_path: Path) -> None:
    with pytest.raises(
        RuntimeError,
        match=r"cell 1 \(setup\) failed: LookupError: .*"
        r"no analysis with id 42",
    ):
        run_notebook(results_db, 42, tmp_path / "bad.ipynb", None)
    assert (tmp_path / "bad.ipynb").is_file()  # partly executed, for debugging
    with pytest.raises(RuntimeError, match="results database not found"):
        run_notebook(tmp_path / "missing.sqlite", None, tmp_path / "x.ipynb", None)


def test_committed_notebook_has_no_outputs() -> None:
    from pageshare.analysis.notebook import NOTEBOOK

    nb = read_nb(NOTEBOOK)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, cell.get("id")
