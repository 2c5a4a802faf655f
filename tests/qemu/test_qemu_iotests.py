"""QEMU's iotests for the pageshare filter (patch 4 of qemu-patches) and a
few neighbouring qcow2 tests, run by qemu-patches/run-iotests.py against
the patched build."""

from __future__ import annotations

import subprocess
import sys

import pytest
from qemu_helpers import REPO, qemu_build

pytestmark = pytest.mark.build


def test_iotests_pass() -> None:
    qemu_build()  # build (cached) first, so that a build failure reads as one
    p = subprocess.run(
        [sys.executable, str(REPO / "qemu-patches" / "run-iotests.py")],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-6000:]
    assert "pageshare" in out and "Passed all" in out, out[-3000:]
    assert "Not run" not in out, out[-3000:]
