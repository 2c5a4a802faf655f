"""pytest glue for the page-server tests: the server process, Redis and list
helpers live in tools/pageshare_tools/server_process.py (shared with the
benchmarks); here are what only tests need.  (No tests here.)"""

from __future__ import annotations

import contextlib
import hashlib
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from pageshare.lists import sectorlist
from pageshare_tools import pageshare_client as psc
from pageshare_tools.cargo import cargo
from pageshare_tools.server_process import (
    CACHE,
    TARGET,
    HarnessError,
    ImageSpec,
    Redis,
    Server,
    content_sha256,
    free_port,
    make_list,
    nonzero_blocks,
    raw_copy,
    rss_bytes,
    wait_for,
)
from pageshare_tools.server_process import server_binary as _server_binary

REPO = Path(__file__).resolve().parents[1]
PAGE_SERVER = REPO / "page-server"

__all__ = [
    "CACHE",
    "TARGET",
    "ImageSpec",
    "Redis",
    "Server",
    "cargo",
    "check_published",
    "content_sha256",
    "free_port",
    "make_list",
    "nonzero_blocks",
    "psc",
    "raw_copy",
    "redis_server",
    "rss_bytes",
    "server_binary",
    "wait_for",
]


def server_binary(profile: str = "release") -> Path:
    """The built daemon; a test fails (not errors) where it cannot be built."""
    try:
        return _server_binary(profile)
    except HarnessError as e:
        pytest.fail(str(e))


@contextlib.contextmanager
def redis_server(tmp: Path) -> Iterator[Redis]:
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed (scripts/install-deps.sh)")
    r = Redis(free_port(), tmp / "redis")
    r.start()
    try:
        yield r
    finally:
        r.stop(signal.SIGKILL)


def check_published(msg: psc.TableMsg, sl: sectorlist.SectorList) -> None:
    """Every listed block is in the table and the server's memory at its
    address holds exactly the listed bytes, readable the way a client
    copies it (process_vm_readv); nothing else is in the table."""
    assert msg.entries == len(sl.blocks)
    assert msg.virtual_size == sl.image.virtual_size
    assert msg.content_sha256 == sl.image.content_sha256
    listed = {s // 8 for s in sl.blocks}
    assert {b for b, _ in msg.table.items()} == listed
    for sector, digest in sl.blocks.items():
        addr = msg.table.lookup(sector // 8)
        assert addr is not None, f"sector {sector} missing"
        data = psc.copy_server_memory(msg.server_pid, addr, 4096)
        assert hashlib.sha256(data).hexdigest() == digest, f"wrong bytes for sector {sector}"
