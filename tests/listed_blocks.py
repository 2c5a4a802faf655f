"""What an analysis' list must hold against the image it names, on every
image layout: each listed block is that image's 4 KiB at its sector (the
sha256 the list gives, not zeros, page aligned) inside the file systems
the analysis mapped, the list's identity is this exact image, and the
CLI's `list verify` agrees.  The ext layouts also check each block against
its file's own bytes (listed_file_bytes.py)."""

from __future__ import annotations

import hashlib
import subprocess
from collections.abc import Sequence
from pathlib import Path

from pageshare.image import diskimage
from pageshare.lists import sectorlist

REPO = Path(__file__).resolve().parents[1]


def every_listed_block_is_the_images(
    list_path: Path | str,
    raw: Path,
    inside: Sequence[range] = (),
    where: str = "the mapped file systems",
) -> sectorlist.SectorList:
    """Reads the list at ``list_path`` and checks it against ``raw`` (the
    image as a raw file); with ``inside``, every listed page lies in one of
    those sector ranges (``where`` names them).  Returns the list."""
    sl = sectorlist.read(Path(list_path))
    assert sl.blocks, "the list is empty"
    with raw.open("rb") as f:
        for sector, digest in sl.blocks.items():
            f.seek(sector * 512)
            data = f.read(4096)
            assert hashlib.sha256(data).hexdigest() == digest, f"sector {sector}"
            assert any(data), f"zero block listed at sector {sector}"
            assert sector % 8 == 0, f"sector {sector} is not 4 KiB aligned"
            if inside:
                assert any(sector in r and sector + 7 in r for r in inside), (
                    f"sector {sector} outside {where}"
                )
    # The list names this exact image.
    assert sl.image.virtual_size == raw.stat().st_size
    read_at, size = diskimage.raw_file_reader(raw)
    assert sl.image.content_sha256 == diskimage.image_content_sha256(read_at, size)
    return sl


def list_verifies(list_path: Path | str, image: Path) -> None:
    """`pageshare list verify LIST --image IMAGE` (the CLI, from the
    checkout) exits 0."""
    out = subprocess.run(
        ["python3", "-m", "pageshare.cli", "list", "verify", str(list_path), "--image", str(image)],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(REPO / "analyzer"), "PATH": "/usr/bin:/bin:/usr/sbin:/sbin"},
    )
    assert out.returncode == 0, out.stdout + out.stderr
