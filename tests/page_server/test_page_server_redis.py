"""A small fleet: several page servers ("hosts") subscribed to one real
redis-server.  Publish, hot reload, Redis killed and restarted, servers
killed and restarted, garbage in Redis."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from page_server_helpers import (
    REPO,
    ImageSpec,
    Redis,
    Server,
    check_published,
    free_port,
    make_list,
    nonzero_blocks,
    psc,
    redis_server,
    wait_for,
)
from pageshare.lists import distribute, sectorlist

pytestmark = pytest.mark.build

# Root is required (the client reads /proc/PID/mem); fail loudly rather than skip.
assert os.geteuid() == 0, "the page-server tests read /proc/PID/mem: run them as root"


def image(d: Path, seed: int) -> tuple[Path, Path, sectorlist.ImageIdentity]:
    d.mkdir(parents=True, exist_ok=True)
    data = random.Random(seed).randbytes(8 << 20)
    raw = d / f"img{seed}.raw"
    raw.write_bytes(data)
    qcow = d / f"img{seed}.qcow2"
    subprocess.run(["qemu-img", "convert", "-c", "-O", "qcow2", str(raw), str(qcow)], check=True)
    return (
        raw,
        qcow,
        sectorlist.ImageIdentity(len(data), hashlib.sha256(data).hexdigest(), qcow.name),
    )


def cli(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PAGESHARE_REDIS=url, PYTHONPATH=str(REPO / "analyzer"))
    return subprocess.run(
        [sys.executable, "-m", "pageshare.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


@pytest.fixture
def fleet_servers() -> Iterator[list[Server]]:
    servers: list[Server] = []
    yield servers
    for s in servers:
        s.stop(signal.SIGKILL)


def table_of(s: Server, name: str, gen: int) -> psc.TableMsg:
    with psc.PageshareClient(s.sock(name)) as c:
        m = c.recv()
        assert isinstance(m, psc.TableMsg) and m.generation == gen, m
        c.fds.remove(m.pidfd)  # keep the table mapped after close
        return m


def test_fleet_through_redis(tmp_path: Path, fleet_servers: list[Server]) -> None:
    raw_x, qcow_x, id_x = image(tmp_path / "images", 1)
    raw_y, qcow_y, id_y = image(tmp_path / "images", 2)
    lists = tmp_path / "lists"
    lists.mkdir()
    x1 = make_list(id_x, nonzero_blocks(raw_x, 400, stride=3), lists / "x1.pcsl", "analyze v1")
    x2 = make_list(id_x, nonzero_blocks(raw_x, 500, stride=2), lists / "x2.pcsl", "analyze v2")
    y1 = make_list(id_y, nonzero_blocks(raw_y, 300, stride=4), lists / "y1.pcsl")

    with redis_server(tmp_path) as rd:
        a = Server(tmp_path / "a", [ImageSpec("x", qcow_x, list_redis="auto")], rd.url, "hostA")
        b = Server(tmp_path / "b", [ImageSpec("x", qcow_x, list_redis="auto")], rd.url, "hostB")
        c = Server(
            tmp_path / "c",
            [ImageSpec("y", qcow_y, list_redis="auto"), ImageSpec("x", qcow_x, list_redis="auto")],
            rd.url,
            "hostC",
        )
        for s in (a, b, c):
            fleet_servers.append(s)
            s.start()
        for s in (a, b):
            wait_for(lambda s=s: s.image("x")["state"] == "no-list", 60, "waiting for a list")

        # Publish: every server of that image loads it, the others do not.
        r = cli(rd.url, "list", "publish", str(lists / "x1.pcsl"))
        assert r.returncode == 0, r.stderr
        assert "3 page server(s) listening" in r.stdout
        for s in (a, b, c):
            s.wait_generation("x", 1, 60)
            check_published(table_of(s, "x", 1), x1)
        assert c.image("y")["generation"] is None
        assert cli(rd.url, "list", "publish", str(lists / "y1.pcsl")).returncode == 0
        c.wait_generation("y", 1, 60)
        check_published(table_of(c, "y", 1), y1)

        # The fleet view: who serves what, from the hosts' own reports.
        def ls() -> list[dict[str, object]]:
            out = cli(rd.url, "list", "ls", "--json")
            assert out.returncode == 0, out.stderr
            data: list[dict[str, object]] = json.loads(out.stdout)
            return data

        def served() -> dict[str, set[str]] | None:
            d = {
                str(i["image_key"]): {
                    str(h["host"])
                    for h in i["hosts"]  # type: ignore[attr-defined]
                    if h["current"]
                }
                for i in ls()
            }
            want = {
                distribute.image_key(id_x): {"hostA", "hostB", "hostC"},
                distribute.image_key(id_y): {"hostC"},
            }
            return d if d == want else None

        wait_for(served, 20, "ls to show every host")
        meta = next(i for i in ls() if i["image_key"] == distribute.image_key(id_x))["meta"]
        assert meta["generator"] == "analyze v1" and meta["count"] == "400"  # type: ignore[index]
        assert "@" in meta["published-by"]  # type: ignore[index]
        fl = cli(rd.url, "fleet")
        assert fl.returncode == 0 and "hostA" in fl.stdout and "hostC" in fl.stdout

        # A connected client follows a hot reload pushed through Redis.
        watcher = psc.PageshareClient(b.sock("x"))
        assert isinstance(watcher.recv(), psc.TableMsg)

        # Redis dies: everyone keeps serving, and says so.
        rd.stop(signal.SIGKILL)
        for s in (a, b, c):
            wait_for(lambda s=s: s.status()["redis"]["connected"] is False, 20, "disconnect")
            assert s.image("x")["generation"] == 1
        check_published(table_of(b, "x", 1), x1)
        assert "still serving the current lists" in b.log_text()
        # A server restarted while Redis is down serves its last good list.
        a.stop()
        a.start()
        a.wait_generation("x", 1, 60)
        check_published(table_of(a, "x", 1), x1)
        assert not a.status()["redis"]["connected"]
        down = cli(rd.url, "list", "ls")
        assert down.returncode == 2 and "cannot reach Redis" in down.stderr

        # Redis comes back (its data persisted): reconnect, then a new list.
        rd.start()
        for s in (a, b, c):
            wait_for(lambda s=s: s.status()["redis"]["connected"], 30, "reconnect")
        assert cli(rd.url, "list", "publish", str(lists / "x2.pcsl")).returncode == 0
        for s in (a, b, c):
            s.wait_generation("x", 2, 60)
            check_published(table_of(s, "x", 2), x2)
        m = watcher.recv()
        assert isinstance(m, psc.TableMsg) and m.generation == 2
        check_published(m, x2)
        watcher.switched(2)

        # Garbage in Redis: refused, logged, nothing else changes.
        rc = redis.Redis.from_url(rd.url)
        key_x = f"pageshare:list:{distribute.image_key(id_x)}"
        before = {s.host: s.image("x")["loads_failed"] for s in (a, b, c)}
        for junk in (
            b"\xff\xfe garbage",
            sectorlist.dumps(y1).encode(),
            (lists / "x1.pcsl").read_bytes()[:-40],
        ):
            rc.set(key_x, junk)
            rc.publish("pageshare:events", distribute.image_key(id_x))
            for s in (a, b, c):
                wait_for(
                    lambda s=s: s.image("x")["loads_failed"] > before[s.host], 30, "garbage refused"
                )
                before[s.host] = s.image("x")["loads_failed"]
                st = s.image("x")
                assert st["generation"] == 2 and st["state"] == "serving", st
        # A key of the wrong type must not break the watcher's session.
        rc.delete(key_x)
        rc.hset(key_x, "x", "y")
        rc.publish("pageshare:events", distribute.image_key(id_x))
        wait_for(lambda: "is not a string" in a.log_text(), 10, "wrong type reported")
        time.sleep(1.5)
        assert a.status()["redis"]["connected"] and a.status()["redis"]["connects"] == 1
        assert "is for another image" in a.log_text()
        check_published(table_of(a, "x", 2), x2)
        rc.hset("pageshare:host:bogus", mapping={"status": "{not json", "updated": "x"})
        rc.sadd("pageshare:hosts", "bogus")

        def fleet_now() -> dict[str, dict[str, object]] | None:
            fl = cli(rd.url, "fleet", "--json")
            assert fl.returncode == 0, fl.stderr
            hosts = {h["host"]: h for h in json.loads(fl.stdout)}
            # Servers push every stats_interval_secs (1 s here).
            return hosts if hosts["hostA"]["images"][0]["generation"] == 2 else None

        hosts = wait_for(fleet_now, 10, "fleet view of generation 2")
        assert hosts["bogus"]["error"].startswith("unreadable status")

        # A server killed outright shows up as stale in the fleet view.
        b.stop(signal.SIGKILL)
        store = distribute.Store(rd.url)
        later = {h["host"]: h for h in distribute.fleet(store, now=time.time() + 120)}
        assert later["hostB"]["stale"]
        assert all(s.alive() for s in (a, c))
        watcher.close()
        shutil.rmtree(tmp_path / "images")


def test_redis_down_at_the_first_start(tmp_path: Path, fleet_servers: list[Server]) -> None:
    """A host's first start with its Redis not up yet (no list cached): the
    server starts anyway, serves its file-listed image, says it waits for
    Redis, tells the Redis image's clients there is no table (their reads go
    to disk); once Redis is up and the list published, it serves that too."""
    raw_x, qcow_x, id_x = image(tmp_path / "images", 3)
    raw_y, qcow_y, id_y = image(tmp_path / "images", 4)
    lists = tmp_path / "lists"
    lists.mkdir()
    x1 = make_list(id_x, nonzero_blocks(raw_x, 200, stride=3), lists / "x1.pcsl")
    y1 = make_list(id_y, nonzero_blocks(raw_y, 200, stride=3), lists / "y1.pcsl")
    rd = Redis(free_port(), tmp_path / "redis")  # not started yet
    s = Server(
        tmp_path / "a",
        [ImageSpec("x", qcow_x, list_redis="auto"), ImageSpec("y", qcow_y, lists / "y1.pcsl")],
        rd.url,
        "hostA",
    )
    fleet_servers.append(s)
    try:
        s.start()
        s.wait_generation("y", 1, 60)
        check_published(table_of(s, "y", 1), y1)
        wait_for(lambda: s.image("x")["state"] == "no-list", 60, "the Redis image to wait")
        assert s.status()["redis"]["connected"] is False
        assert "waiting for Redis" in s.image("x")["message"], s.image("x")
        with psc.PageshareClient(s.sock("x")) as c:
            assert isinstance(c.recv(), psc.NoTableMsg)
        assert s.alive()

        rd.start()
        wait_for(lambda: s.status()["redis"]["connected"], 30, "the server to reach Redis")
        r = cli(rd.url, "list", "publish", str(lists / "x1.pcsl"))
        assert r.returncode == 0, r.stderr
        s.wait_generation("x", 1, 60)
        check_published(table_of(s, "x", 1), x1)
        assert s.image("y")["generation"] == 1
    finally:
        rd.stop(signal.SIGKILL)
