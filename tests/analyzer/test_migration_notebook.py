"""notebooks/migration.ipynb run headless on each recorded run of
bench/migration_bench.py (bench/results/migration-*/).

The real notebook is executed in ipykernel's own kernel for this
interpreter (a private kernel directory, IPC sockets: no TCP port), as
tests/kernel/test_e2e_bench.py does for notebooks/e2e_vs_ksm.ipynb.  A
reader must see no error, the run's name, its three figures (saved as PNG
and shown), and medians that agree with the run's own summary.md; the
committed notebook carries no outputs.
"""

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("pandas")
pytest.importorskip("matplotlib")

import nbformat
from notebook_helpers import (
    cell_errors,
    execute,
    png_size,
    read_nb,
    shown_images,
    stream_text,
)

REPO = Path(__file__).resolve().parents[2]
NOTEBOOK = REPO / "notebooks/migration.ipynb"
RUNS = sorted(p.parent for p in (REPO / "bench/results").glob("migration-*/results.json"))
FIGURES = ["wire_time", "downtime_cpu", "references"]


def _execute(run: Path, figures: Path) -> Any:
    return execute(
        NOTEBOOK,
        {"PAGESHARE_MIGRATION_RESULTS": str(run), "PAGESHARE_FIGURES": str(figures)},
        "migration-kernel-",
    )


def _summary_rows(run: Path) -> dict[str, list[str]]:
    """summary.md's table: configuration -> its cells, as written."""
    rows = {}
    for line in (run / "summary.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) > 10 and cells[1].isdigit():
            rows[cells[0]] = cells
    return rows


def test_a_run_is_recorded() -> None:
    assert RUNS, "no recorded run under bench/results/migration-*/"


@pytest.mark.parametrize("run", RUNS, ids=[r.name for r in RUNS])
def test_notebook_plots_the_recorded_run(run: Path, tmp_path: Path) -> None:
    nb = _execute(run, tmp_path)
    assert cell_errors(nb) == []
    assert run.name in stream_text(nb, "setup")

    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        f"migration_{f}.png" for f in FIGURES
    )
    for name in FIGURES:
        data = (tmp_path / f"migration_{name}.png").read_bytes()
        width, height = png_size(data, name)
        assert width >= 400 and height >= 200, (name, width, height)
    assert len(shown_images(nb)) == len(FIGURES)

    # the medians table: the same numbers as summary.md, to summary.md's precision
    expected = _summary_rows(run)
    assert expected, f"{run / 'summary.md'} has no table"
    printed = {
        line.split()[0]: line.split()[1:]
        for line in stream_text(nb, "table").splitlines()[1:]
        if line.strip()
    }
    assert set(printed) == set(expected)
    for config, cells in expected.items():
        for got, want in zip(printed[config], cells[1:10], strict=True):
            decimals = len(want.partition(".")[2])
            assert abs(float(got) - float(want)) <= 0.5 * 10**-decimals + 1e-9, (
                config,
                printed[config],
                cells,
            )


def test_committed_notebook_has_no_outputs() -> None:
    nb = read_nb(NOTEBOOK)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, cell.get("id")
