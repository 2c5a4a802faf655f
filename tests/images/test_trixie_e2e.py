"""analyze-image end to end on Debian 13 (kernel 6.12), which crash 8.0.x cannot open.

The same properties as test_analyze_e2e.py, on the trixie golden image:
every listed block is byte-identical to the base image and non-zero, blocks
of files every boot reads are listed, the host is left as found, and the
summary and the results DB say that drgn classified the frames.
"""

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import Analysis, analyze_cleanly
from listed_blocks import every_listed_block_is_the_images
from listed_file_bytes import every_listed_block_is_its_files_page
from pageshare import golden
from pageshare.image.ext4map import file_sectors
from pageshare.lists import sectorlist

pytestmark = pytest.mark.vm

# systemd 257 in trixie (252 in bookworm).
ALWAYS_READ = (
    "/usr/lib/systemd/systemd",
    "/usr/lib/x86_64-linux-gnu/libc.so.6",
    "/usr/lib/x86_64-linux-gnu/systemd/libsystemd-shared-257.so",
)


@pytest.fixture(scope="module")
def analysed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Analysis, Path]]:
    image = golden.build_image("trixie").path
    tmp = tmp_path_factory.mktemp("e2e-trixie")
    result, raw = analyze_cleanly(tmp, image)
    yield result, raw
    raw.unlink()


def test_drgn_classified_the_6_12_guest(analysed: tuple[Analysis, Path]) -> None:
    result, _ = analysed
    summary = result.json()
    assert summary["introspector"] == "drgn"
    reason = str(summary["introspector_reason"])
    assert reason.startswith("auto: guest kernel 6.12.") and "crash" in reason
    assert "classifying them with drgn" in result.stderr
    db = sqlite3.connect(result.db)
    (used,) = db.execute(
        "SELECT introspector FROM analysis WHERE id=?", (summary["analysis_id"],)
    ).fetchone()
    assert used == "drgn"
    (kernel,) = db.execute("SELECT guest_kernel FROM run").fetchone()
    assert kernel == golden.build_image("trixie").manifest["kernel_version"]
    # The records drgn wrote are the kinds pagescan defines, with page cache among them.
    kinds = {
        k for (k,) in db.execute("SELECT DISTINCT kind FROM guest_page WHERE kind IS NOT NULL")
    }
    assert "file" in kinds
    assert kinds <= {
        "file",
        "bdev",
        "shmem",
        "anon",
        "ksm",
        "movable",
        "slab",
        "nomapping",
        "badmapping",
        "nopage",
        "unreadable",
    }


def test_every_listed_block_matches_the_base_image(analysed: tuple[Analysis, Path]) -> None:
    result, raw = analysed
    start = golden.geometry("trixie").root_start_sector
    every_listed_block_is_the_images(
        str(result.json()["list_path"]),
        raw,
        [range(start, raw.stat().st_size // 512)],
        "the root partition",
    )


def test_files_every_boot_reads_are_listed(analysed: tuple[Analysis, Path]) -> None:
    result, raw = analysed
    sl = sectorlist.read(Path(str(result.json()["list_path"])))
    start = golden.geometry("trixie").root_start_sector
    for path in ALWAYS_READ:
        sectors = set(file_sectors(raw, start * 512, path, start, 4096))
        assert sectors, f"{path} not found in the image"
        assert sectors & set(sl.blocks), f"no block of {path} is listed"


def test_summary_adds_up(analysed: tuple[Analysis, Path]) -> None:
    result, _ = analysed
    summary = result.json()
    db = sqlite3.connect(result.db)
    status, listed = db.execute(
        "SELECT status, listed_blocks FROM analysis WHERE id=?", (summary["analysis_id"],)
    ).fetchone()
    assert status == "ok" and listed == summary["listed_blocks"]
    breakdown = summary["breakdown_pages"]
    assert isinstance(breakdown, dict)
    (frames,) = db.execute("SELECT count(*) FROM guest_page").fetchone()
    assert sum(int(v) for v in breakdown.values()) == frames
    assert 0 < float(summary["coverage"]) <= 1  # type: ignore[arg-type]


def test_every_listed_block_is_its_files_page(
    analysed: tuple[Analysis, Path], tmp_path: Path
) -> None:
    """By e2fsprogs' own reading of each recorded (inode, offset), not the analyzer's map."""
    result, raw = analysed
    every_listed_block_is_its_files_page(result.db, result.json(), raw, tmp_path)
