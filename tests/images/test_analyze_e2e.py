"""analyze-image end to end: real paired guests under TCG, real host KSM, real crash.

These assert properties of the result, not counts: every listed block is
byte-identical to the base image and non-zero, blocks of files every boot
reads are listed, the results DB is complete, and the host is left as it was.
"""

import sqlite3
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import Analysis, ksm_settings, qemu_pids, run_analyze
from listed_blocks import every_listed_block_is_the_images, list_verifies
from listed_file_bytes import every_listed_block_is_its_files_page
from pageshare import golden
from pageshare.analysis.ksm import host_lock
from pageshare.image.ext4map import file_sectors
from pageshare.lists import sectorlist

pytestmark = pytest.mark.vm

WORKLOAD = "python3 -c 'import json, email.parser' && nginx -t"
ALWAYS_READ = (
    "/usr/lib/systemd/systemd",
    "/usr/lib/x86_64-linux-gnu/libc.so.6",
    "/usr/lib/x86_64-linux-gnu/systemd/libsystemd-shared-252.so",
)


def raw_copy(image: Path, tmp: Path) -> Path:
    raw = tmp / "base.raw"
    subprocess.run(["qemu-img", "convert", "-O", "raw", str(image), str(raw)], check=True)
    return raw


@pytest.fixture(scope="module", params=["demo", "small"])
def analysed(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Path, Analysis, Path]]:
    variant = request.param
    image = golden.build_image(variant).path
    tmp = tmp_path_factory.mktemp(f"e2e-{variant}")
    with host_lock():
        before_ksm = ksm_settings()
    # The demo runs a workload in both guests: python3 is read only by it.
    extra = ["--runs", "2", "--workload", WORKLOAD] if variant == "demo" else ["--runs", "1"]
    result = run_analyze(tmp, "--json", "--settle", "10", *extra, str(image))
    assert result.rc == 0, result.stderr
    # The host is left as found: KSM settings, no QEMU, no work files.
    with host_lock():
        assert ksm_settings() == before_ksm
    assert qemu_pids(str(tmp)) == set()
    assert list(result.workdir.iterdir()) == []
    yield variant, image, result, raw_copy(image, tmp)


def load_list(result: Analysis) -> sectorlist.SectorList:
    path = Path(str(result.json()["list_path"]))
    return sectorlist.read(path)


def test_every_listed_block_matches_the_base_image(
    analysed: tuple[str, Path, Analysis, Path],
) -> None:
    _, _image, result, raw = analysed
    every_listed_block_is_the_images(str(result.json()["list_path"]), raw)


def test_files_every_boot_reads_are_listed(analysed: tuple[str, Path, Analysis, Path]) -> None:
    variant, _image, result, raw = analysed
    sl = load_list(result)
    manifest = golden.build_image(variant).manifest
    start = int(manifest["root_start_sector"])
    for path in ALWAYS_READ:
        sectors = set(file_sectors(raw, start * 512, path, start, 4096))
        assert sectors, f"{path} not found in the image"
        assert sectors & set(sl.blocks), f"no block of {path} is listed"


def test_workload_files_are_listed(analysed: tuple[str, Path, Analysis, Path]) -> None:
    variant, _, result, raw = analysed
    if variant != "demo":
        return  # the small image runs no workload; nothing to check there
    sl = load_list(result)
    start = 262144
    sectors = set(file_sectors(raw, start * 512, "/usr/bin/python3.11", start, 4096))
    assert sectors & set(sl.blocks), "python3, read only by the workload, is not listed"
    db = sqlite3.connect(result.db)
    (workload,) = db.execute(
        "SELECT workload FROM analysis WHERE id=?", (result.json()["analysis_id"],)
    ).fetchone()
    assert workload == WORKLOAD


def test_notebook_runs_on_the_real_results(
    analysed: tuple[str, Path, Analysis, Path], tmp_path: Path
) -> None:
    from pageshare.analysis.notebook import run_notebook

    _, _, result, _ = analysed
    figures = tmp_path / "fig"
    figures.mkdir()
    run_notebook(result.db, int(str(result.json()["analysis_id"])), tmp_path / "out.ipynb", figures)
    pngs = sorted(figures.glob("*.png"))
    assert len(pngs) >= 4
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)


def test_results_db_is_complete(analysed: tuple[str, Path, Analysis, Path]) -> None:
    _variant, _, result, _ = analysed
    summary = result.json()
    db = sqlite3.connect(result.db)
    status, listed, runs = db.execute(
        "SELECT status, listed_blocks, runs FROM analysis WHERE id=?", (summary["analysis_id"],)
    ).fetchone()
    assert status == "ok" and listed == summary["listed_blocks"]
    (n_runs,) = db.execute(
        "SELECT count(*) FROM run WHERE analysis_id=?", (summary["analysis_id"],)
    ).fetchone()
    assert n_runs == runs
    (samples,) = db.execute("SELECT count(*) FROM ksm_sample").fetchone()
    assert samples >= 3
    # Every listed block came from a cross-merged, verified page-cache frame.
    (bad,) = db.execute(
        "SELECT count(*) FROM listed_block lb WHERE NOT EXISTS (SELECT 1 FROM guest_page g "
        "JOIN run r ON r.id = g.run_id WHERE r.analysis_id = lb.analysis_id AND "
        "g.sector = lb.sector AND g.merge = 'cross' AND g.verdict = 'stable')"
    ).fetchone()
    assert bad == 0
    (paths,) = db.execute("SELECT count(*) FROM file WHERE path LIKE '/usr/%'").fetchone()
    assert paths > 0
    # The breakdown adds up to the merged frames recorded.
    breakdown = summary["breakdown_pages"]
    assert isinstance(breakdown, dict)
    total = sum(int(v) for v in breakdown.values())
    (frames,) = db.execute("SELECT count(*) FROM guest_page").fetchone()
    assert total == frames
    assert 0 < float(summary["coverage"]) <= 1  # type: ignore[arg-type]


def test_list_show_cli(analysed: tuple[str, Path, Analysis, Path]) -> None:
    _, image, result, _ = analysed
    path = str(result.json()["list_path"])
    list_verifies(path, image)


def test_every_listed_block_is_its_files_page(
    analysed: tuple[str, Path, Analysis, Path], tmp_path: Path
) -> None:
    """By e2fsprogs' own reading of each recorded (inode, offset), not the analyzer's map."""
    _, _, result, raw = analysed
    every_listed_block_is_its_files_page(result.db, result.json(), raw, tmp_path)
