"""The feedback loop's server side (issue 22): clients report what their
guest read (READS, LISTED_READ), the server sums it per image and publishes
`<prefix>:feedback:<image key>:<host>` to a real redis-server.

Guests are real processes (a guest is one QEMU process: pid and start
time), each a Python reference client in a child process.  Checked: the
hash decodes to exactly what was sent; bad input is counted and ignored and
the client stays connected; a server killed and restarted continues from
Redis; Redis down disturbs no client and is logged once; a flood of
distinct blocks stays within feedback.max_blocks and keeps the blocks
several guests read."""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import struct
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from page_server_helpers import (
    ImageSpec,
    Server,
    check_published,
    make_list,
    nonzero_blocks,
    psc,
    redis_server,
    server_binary,
    wait_for,
)
from pageshare.lists import feedback as refine_feedback
from pageshare.lists import sectorlist

pytestmark = pytest.mark.build

assert os.geteuid() == 0, "the page-server tests read /proc/PID/mem: run them as root"

NO_GEN = psc.NO_GENERATION
RECORD = struct.Struct("<QIII")

# A child process: one guest.  It opens each connection of its plan, takes
# the TABLE, switches to it, sends its reports and closes (the server reads
# everything before the end of the stream).
GUEST = r"""
import json, sys
from pageshare_tools import pageshare_client as psc
conns = []
for conn in json.loads(sys.argv[1]):
    c = psc.PageshareClient(conn["sock"])
    m = c.recv()
    assert isinstance(m, psc.TableMsg), m
    c.switched(m.generation)
    for kind, gen, data in conn["msgs"]:
        if kind == "reads":
            c.reads(gen, [(b, n) for b, n in data])
        else:
            c.listed_read(gen, data)
    conns.append(c)
for c in conns:
    c.close()
"""

Records = dict[int, tuple[int, int, int]]


def guest(plan: list[dict[str, Any]]) -> None:
    """Run one guest process to its end."""
    p = subprocess.run(
        [sys.executable, "-c", GUEST, json.dumps(plan)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0, p.stderr


def decode(blocks: bytes) -> Records:
    """The `blocks` field: block -> (guests, reads, flags), checked sorted."""
    assert len(blocks) % RECORD.size == 0
    out: Records = {}
    last = -1
    for block, guests, reads, flags in RECORD.iter_unpack(blocks):
        assert block > last, "records sorted by block, no duplicates"
        last = block
        out[block] = (guests, reads, flags)
    return out


def feedback(s: Server, name: str) -> dict[str, Any]:
    fb: dict[str, Any] = s.image(name)["feedback"]
    return fb


def published(rc: redis.Redis, key: str, host: str) -> dict[str, bytes]:
    raw: dict[bytes, bytes] = rc.hgetall(f"pageshare:feedback:{key}:{host}")  # type: ignore[assignment]
    return {k.decode(): v for k, v in raw.items()}


def wait_published(s: Server, name: str, after: float, timeout: float = 20) -> dict[str, Any]:
    """The image's feedback status once a publish newer than `after` is done."""

    def done() -> dict[str, Any] | None:
        fb = feedback(s, name)
        return fb if fb["publish"]["last_publish"] > after else None

    result: dict[str, Any] = wait_for(done, timeout, f"a feedback publish of {name}")
    return result


def wait_counted(s: Server, name: str, accepted: int) -> None:
    wait_for(
        lambda: feedback(s, name)["counters"]["accepted_blocks"] >= accepted,
        20,
        f"{accepted} reported blocks counted",
    )
    assert feedback(s, name)["counters"]["accepted_blocks"] == accepted


@pytest.fixture
def image(tmp_path: Path) -> Iterator[tuple[Path, sectorlist.SectorList, str]]:
    """A raw 8 MiB image of random bytes (2048 blocks) and a list of 100 of
    its blocks; yields the image, the list file's list and its Redis key."""
    d = tmp_path / "images"
    d.mkdir()
    data = random.Random(22).randbytes(8 << 20)
    raw = d / "x.raw"
    raw.write_bytes(data)
    ident = sectorlist.ImageIdentity(len(data), hashlib.sha256(data).hexdigest(), raw.name)
    sl = make_list(ident, nonzero_blocks(raw, 100, stride=7), tmp_path / "x.pcsl")
    yield raw, sl, f"{ident.virtual_size}-{ident.content_sha256}"


def server(
    tmp_path: Path,
    raw: Path,
    url: str,
    host: str = "hostA",
    feedback_cfg: str = "interval_secs = 1",
) -> Server:
    s = Server(
        tmp_path / host,
        [ImageSpec("x", raw, tmp_path / "x.pcsl", fmt="raw")],
        url,
        host,
        extra=f"[feedback]\n{feedback_cfg}",
    )
    s.start()
    s.wait_generation("x", 1, 60)
    return s


def test_feedback_reaches_redis_and_survives_restarts_and_outages(
    tmp_path: Path, image: tuple[Path, sectorlist.SectorList, str]
) -> None:
    raw, sl, key = image
    listed = sorted(s // 8 for s in sl.blocks)
    unlisted = sorted(set(range(2048)) - set(listed))
    l1, l2, not_listed = listed[3], listed[50], unlisted[7]
    u1, u2, u3 = unlisted[0], unlisted[100], unlisted[-1]
    with redis_server(tmp_path) as rd:
        rc = redis.Redis.from_url(rd.url)
        s = server(tmp_path, raw, rd.url)
        try:
            sock = str(s.sock("x"))
            # Guest 1: two connections (one QEMU, two disks on the same
            # base: one guest), deltas of u2 in two messages.
            guest(
                [
                    {
                        "sock": sock,
                        "msgs": [["reads", 1, [[u1, 3], [u2, 1]]], ["listed", 1, [l1, l2]]],
                    },
                    {"sock": sock, "msgs": [["reads", 1, [[u1, 1], [u2, 2]]]]},
                ]
            )
            # Guest 2: counted without a table, then with one.
            guest(
                [
                    {
                        "sock": sock,
                        "msgs": [["reads", NO_GEN, [[u1, 2], [u3, 5]]], ["listed", 1, [l1]]],
                    }
                ]
            )
            wait_counted(s, "x", 9)
            fb = wait_published(s, "x", time.time())
            want: Records = {
                u1: (2, 6, 0),
                u2: (1, 3, 0),
                u3: (1, 5, 0),
                l1: (2, 2, 1),
                l2: (1, 1, 1),
            }
            h = published(rc, key, "hostA")
            assert decode(h["blocks"]) == want
            assert (h["host"], h["image"], h["version"], h["guests"]) == (
                b"hostA",
                key.encode(),
                b"1",
                b"2",
            )
            since = int(h["since"])
            assert since <= int(h["updated"]) <= time.time() + 1
            assert rc.smembers(f"pageshare:feedback:{key}:hosts") == {b"hostA"}
            # What `pageshare list refine` reads of it: the same.
            hs = refine_feedback.decode(rc.hgetall(f"pageshare:feedback:{key}:hostA"), key, "hostA")
            assert {b: (g, r, f) for b, g, r, f in hs.records()} == want
            assert (hs.guests, hs.since) == (2, since)
            assert (fb["blocks"], fb["guests"], fb["read_back"]) == (
                5,
                2,
                "nothing published before",
            )

            # Bad input from this process: counted, ignored, still connected.
            with psc.PageshareClient(sock) as c:
                m = c.recv()
                assert isinstance(m, psc.TableMsg)
                c.switched(1)
                c.reads(1, [(2048, 1), (2**64 - 1, 7)])  # outside the image
                c.listed_read(1, [not_listed])  # not listed in generation 1
                c.listed_read(NO_GEN, [l1])  # listed, but no table
                c.reads(99, [(u1, 1)])  # a generation never published
                head = struct.pack("<QII", 1, 255, 0)
                c.send_raw(psc.MSG_READS, head + bytes(16 * 255)[:4080])  # 255 entries
                c.send_raw(psc.MSG_READS, struct.pack("<QII", 1, 2, 0) + bytes(24))  # short
                c.send_raw(psc.MSG_LISTED_READ, b"\x01" * 7)  # no header
                # Many valid (empty) reports are not "unknown messages".
                for _ in range(150):
                    c.reads(1, [])
                c.stats(1, 1, 1, 0, 0, 0)

                def counters() -> dict[str, int] | None:
                    k: dict[str, int] = feedback(s, "x")["counters"]
                    return k if k["reads_messages"] >= 157 else None

                k = wait_for(counters, 20, "the bad reports")
                assert (k["rejected_messages"], k["rejected_blocks"]) == (5, 3), k

                def still_connected() -> bool:
                    me = [x for x in s.image("x")["client_list"] if x["pid"] == os.getpid()]
                    return bool(me) and me[0]["stats"]["lookups"] == 1

                wait_for(still_connected, 10, "the client's STATS on the same connection")
            fb = wait_published(s, "x", time.time())
            assert decode(published(rc, key, "hostA")["blocks"]) == want
            assert fb["guests"] == 2, "a report with nothing accepted adds no guest"
            assert "reported 2 block(s) outside the image (2048 blocks)" in s.log_text()
            metrics = (
                urllib.request.urlopen(f"http://127.0.0.1:{s.metrics_port}/metrics", timeout=5)
                .read()
                .decode()
            )
            assert 'pageshare_feedback_rejected_messages_total{image="x"} 5' in metrics
            assert 'pageshare_feedback_blocks{image="x"} 5' in metrics
            st = subprocess.run(
                [str(server_binary()), "status", "--socket", str(s.control)],
                capture_output=True,
                text=True,
                timeout=30,
            )
            assert "feedback: 5 blocks from 2 guests" in st.stdout, st.stdout

            # Killed outright and restarted: the accumulation continues from
            # Redis (guest ids are not published: a guest seen before and
            # after counts twice, which guest 3 is not).
            s.stop(signal.SIGKILL)
            s.control.unlink()  # left behind by the killed server
            s.start()
            s.wait_generation("x", 1, 60)
            wait_for(lambda: feedback(s, "x")["continued"], 20, "the read-back")
            assert feedback(s, "x")["read_back"] == (
                f"continued from 5 blocks, 2 guests since {since}"
            )
            guest([{"sock": sock, "msgs": [["reads", 1, [[u1, 1]]]]}])
            wait_counted(s, "x", 1)
            wait_published(s, "x", time.time())
            h = published(rc, key, "hostA")
            want[u1] = (3, 7, 0)
            assert decode(h["blocks"]) == want
            assert (int(h["since"]), h["guests"]) == (since, b"3")

            # Redis down: clients are served as before, the failure is
            # logged once, and the next publish after it has everything.
            rd.stop(signal.SIGKILL)
            failures = feedback(s, "x")["publish"]["failures"]
            wait_for(
                lambda: feedback(s, "x")["publish"]["failures"] >= failures + 3,
                20,
                "publishes to fail",
            )
            for _ in range(3):
                with psc.PageshareClient(sock, timeout=2) as c:
                    m = c.recv()
                    assert isinstance(m, psc.TableMsg) and m.generation == 1
                    check_published(m, sl)
                    c.switched(1)
                    c.reads(1, [(u2, 1)])
                    c.stats(1, 5, 5, 0, 0, 0)
                    c.fds.remove(m.pidfd)
                    os.close(m.pidfd)
            wait_counted(s, "x", 4)
            assert s.alive() and s.image("x")["state"] == "serving"
            assert s.log_text().count("feedback of image x not published") == 1, s.log_text()
            assert "connection refused" in feedback(s, "x")["publish"]["last_error"].lower()
            rd.start()
            fb = wait_published(s, "x", time.time(), 30)
            assert "feedback published again" in s.log_text()
            want[u2] = (2, 6, 0)  # this process, the fourth guest
            assert decode(published(rc, key, "hostA")["blocks"]) == want
            assert fb["guests"] == 4 and fb["publish"]["last_error"] == ""

            # A clean stop publishes what the last interval counted.
            guest([{"sock": sock, "msgs": [["reads", 1, [[u3, 1]]]]}])
            wait_counted(s, "x", 5)
            s.stop()
            want[u3] = (2, 6, 0)
            assert decode(published(rc, key, "hostA")["blocks"]) == want
        finally:
            s.stop(signal.SIGKILL)


def test_garbage_in_redis_and_a_flood_of_distinct_blocks(
    tmp_path: Path, image: tuple[Path, sectorlist.SectorList, str]
) -> None:
    """Another host's hash under our name, or garbage, is not continued
    from (said, then replaced); a flood of distinct blocks from one guest
    stays within feedback.max_blocks and evicts its own kind, not the
    blocks two guests read."""
    raw, sl, key = image
    listed = {s // 8 for s in sl.blocks}
    real = [b for b in range(0, 2048, 97) if b not in listed][:10]
    with redis_server(tmp_path) as rd:
        rc = redis.Redis.from_url(rd.url)
        hkey = f"pageshare:feedback:{key}:hostB"
        rc.hset(
            hkey,
            mapping={
                "host": "hostB",
                "image": key,
                "since": "1",
                "updated": "2",
                "guests": "1",
                "version": "1",
                "blocks": b"\x00" * 19,
            },
        )
        s = server(tmp_path, raw, rd.url, "hostB", "interval_secs = 1\nmax_blocks = 300")
        try:
            wait_for(lambda: feedback(s, "x")["continued"], 20, "the read-back")
            assert feedback(s, "x")["read_back"].startswith("refused: blocks is 19 bytes")
            assert "cannot be continued from" in s.log_text()
            sock = str(s.sock("x"))
            for _ in range(2):
                guest([{"sock": sock, "msgs": [["reads", 1, [[b, 2] for b in real]]]}])
            flood = [[b, 1000] for b in range(2048) if b not in listed]
            guest([{"sock": sock, "msgs": [["reads", 1, flood]]}])
            wait_counted(s, "x", 20 + len(flood))
            fb = wait_published(s, "x", time.time())
            assert fb["blocks"] <= 300 and fb["evicted_blocks"] >= len(flood) - 300, fb
            got = decode(published(rc, key, "hostB")["blocks"])
            assert len(got) <= 300
            for b in real:
                assert got[b] == (3, 1004, 0), "the blocks two guests read stay, exact"
            assert all(v[0] == 1 and v[1] == 1000 for b, v in got.items() if b not in real)
            assert published(rc, key, "hostB")["guests"] == b"3"
        finally:
            s.stop(signal.SIGKILL)


def test_redis_down_at_start_overwrites_nothing(
    tmp_path: Path, image: tuple[Path, sectorlist.SectorList, str]
) -> None:
    """A server that starts while Redis is down counts, publishes nothing
    until it could read its earlier summary back, then continues from it:
    the first publish holds the earlier counts and the new ones."""
    raw, sl, key = image
    listed = {s // 8 for s in sl.blocks}
    a, b = [x for x in range(2048) if x not in listed][:2]
    with redis_server(tmp_path) as rd:
        rc = redis.Redis.from_url(rd.url)
        earlier = RECORD.pack(a, 4, 40, 0) + RECORD.pack(b, 1, 1, 0)
        rc.hset(
            f"pageshare:feedback:{key}:hostC",
            mapping={
                "host": "hostC",
                "image": key,
                "since": "1000",
                "updated": "2000",
                "guests": "5",
                "version": "1",
                "blocks": earlier,
            },
        )
        rd.stop()  # appendonly: the hash is there when it comes back
        s = server(tmp_path, raw, rd.url, "hostC")
        try:
            guest([{"sock": str(s.sock("x")), "msgs": [["reads", 1, [[a, 2]]]]}])
            wait_counted(s, "x", 1)
            wait_for(lambda: feedback(s, "x")["publish"]["failures"] >= 3, 20, "failures")
            fb = feedback(s, "x")
            assert not fb["continued"] and fb["read_back"] == "pending"
            assert fb["publish"]["publishes"] == 0
            rd.start()
            fb = wait_published(s, "x", 0, 30)
            assert fb["read_back"] == "continued from 2 blocks, 5 guests since 1000"
            h = published(rc, key, "hostC")
            assert decode(h["blocks"]) == {a: (5, 42, 0), b: (1, 1, 0)}
            assert (h["since"], h["guests"]) == (b"1000", b"6")
        finally:
            s.stop(signal.SIGKILL)
