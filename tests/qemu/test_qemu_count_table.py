"""The filter's read-count tables, checked outside QEMU.

qemu-patches/count_test.py compiles qemu-patches/fuzz/count_test.c around
the filter's own block/pageshare-count.c (from the patched tree build.py
built) and runs it: 40 random streams against exact counts (every reported
count a lower bound at most N/k below the truth, every block read more
than N/k times reported, exact when nothing was replaced, the heap and its
index consistent), then threads counting at once (reads either counted
exactly or counted as lost).  Its cost figures are printed, not asserted
(docs/benchmarks.md).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from qemu_helpers import REPO, qemu_build

pytestmark = pytest.mark.build


def test_the_filter_count_tables_keep_their_bounds() -> None:
    qemu_build()
    p = subprocess.run(
        [sys.executable, str(REPO / "qemu-patches" / "count_test.py")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert "invariants hold" in p.stdout, p.stdout
    threads = [line for line in p.stdout.splitlines() if "threads counting at once" in line]
    assert len(threads) >= 2 and all("the rest counted exactly" in t for t in threads), p.stdout
