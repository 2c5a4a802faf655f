"""Runs page-server's Rust unit tests (incl. the bounded parser and framing
fuzzers), so `make test` covers them (clippy runs in `make lint`)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from page_server_helpers import PAGE_SERVER, TARGET, cargo

pytestmark = pytest.mark.build


def run_cargo(*args: str) -> subprocess.CompletedProcess[str]:
    c = cargo()
    if c is None:
        pytest.fail("cargo is not installed: run scripts/install-deps.sh")
    env = dict(os.environ, CARGO_TARGET_DIR=str(TARGET))
    env["PATH"] = f"{Path(c).parent}:{env.get('PATH', '')}"
    return subprocess.run(
        ["nice", "-n", "10", c, *args],
        cwd=PAGE_SERVER,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )


def test_cargo_test() -> None:
    p = run_cargo("test", "--release", "--locked")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "fuzz_list_parser ... ok" in p.stdout and "fuzz_framing ... ok" in p.stdout
