"""The end-to-end benchmark's read feedback (--feedback; bench/feedback_round.py):
what the page server published in the pageshare host reaches `pageshare list
refine` byte for byte.

The driver's own feedback_dump (bench/e2e/driver.sh) runs against a real
Redis holding a summary as a page server writes it (feedback.encode), with
the real redis-cli; the benchmark parses its lines, writes feedback.json.gz,
and feedback_round.load_feedback puts it into another real Redis, where the
analyzer's reader (feedback.read_fleet, what refine reads) finds the same
records.
"""

from __future__ import annotations

import gzip
import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import e2e_vs_ksm as e2e
import feedback_round
import pytest
from pageshare.lists import distribute, feedback
from pageshare_tools.server_process import unix_redis

REPO = Path(__file__).resolve().parents[2]

IMAGE_KEY = "2147483648-" + "ab" * 32


@pytest.fixture
def redis_sock(tmp_path: Path) -> Iterator[Path]:
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed (scripts/install-deps.sh)")
    sock = tmp_path / f"redis-{len(list(tmp_path.iterdir()))}.sock"
    with unix_redis(sock):
        assert sock.exists(), "redis-server did not start"
        yield sock


def driver_dump(sock: Path, work: Path, cfg: str) -> list[str]:
    """driver.sh's rcli and feedback_dump, run as the driver runs them."""
    text = (REPO / "bench/e2e/driver.sh").read_text()
    rcli = re.search(r"^rcli\(\) \{.*\}$", text, re.M)
    dump = re.search(r"^feedback_dump\(\) \{\n.*?^\}$", text, re.M | re.S)
    assert rcli and dump
    bindir = work / "bin"
    bindir.mkdir()
    (bindir / "redis-cli").symlink_to(shutil.which("redis-cli") or "redis-cli")
    script = (
        f"P={work}\nW={work}\nRSOCK={sock}\ncfg={cfg}\nFEEDBACK=1\n"
        + rcli.group(0)
        + "\n"
        + dump.group(0)
        + "\nfeedback_dump\n"
    )
    return subprocess.run(
        ["sh", "-c", script], capture_output=True, text=True, check=True
    ).stdout.splitlines()


def test_feedback_reaches_refine_byte_for_byte(tmp_path: Path, redis_sock: Path) -> None:
    # every byte value in the records, and a record ending in a newline byte,
    # as binary data through redis-cli --raw and base64 must survive
    records = {b: (1 + b % 16, 3 * b + 1, b % 2) for b in range(0, 20000, 7)}
    records[10] = (10, 0x0A0A0A0A, 0)
    summary = feedback.encode("e2e-bench", IMAGE_KEY, 1000, 2000, 3, records)
    key = f"pageshare:feedback:{IMAGE_KEY}:e2e-bench"
    args = [a for f, v in summary.items() if f != "blocks" for a in (f, v.decode())]
    subprocess.run(
        ["redis-cli", "-s", str(redis_sock), "HSET", key, *args], check=True, capture_output=True
    )
    subprocess.run(
        ["redis-cli", "-s", str(redis_sock), "-x", "HSET", key, "blocks"],
        input=summary["blocks"],
        check=True,
        capture_output=True,
    )
    subprocess.run(
        [
            "redis-cli",
            "-s",
            str(redis_sock),
            "SADD",
            f"pageshare:feedback:{IMAGE_KEY}:hosts",
            "e2e-bench",
        ],
        check=True,
        capture_output=True,
    )
    work = tmp_path / "work"
    work.mkdir()
    lines = driver_dump(redis_sock, work, "pageshare")
    assert any(x.startswith("E2E-FBB pageshare ") for x in lines)

    fb = e2e.feedback_summaries(lines)
    got = fb["pageshare"][key]
    assert got["blocks"] == summary["blocks"]
    assert {f: v for f, v in got.items() if f != "blocks"} == {
        f: v.decode() for f, v in summary.items() if f != "blocks"
    }

    run = tmp_path / "round1"
    run.mkdir()
    e2e.write_feedback(run / "feedback.json.gz", fb)
    assert json.loads(gzip.decompress((run / "feedback.json.gz").read_bytes()))["pageshare"]

    # into a second, empty Redis, as feedback_round does before refining
    sock2 = tmp_path / "redis2.sock"
    with unix_redis(sock2):
        assert feedback_round.load_feedback(run, ["redis-cli", "-s", str(sock2)]) == [key]
        fleet = feedback.read_fleet(distribute.Store(f"unix://{sock2}"), IMAGE_KEY)
    assert not fleet.failures
    [host] = fleet.summaries
    assert host.host == "e2e-bench" and host.guests == 3
    assert {b: (g, r, f) for b, g, r, f in host.records()} == records


def test_a_run_without_feedback_has_none() -> None:
    assert e2e.feedback_summaries(["E2E-EV pageshare 1 begin filter=1"]) == {}
