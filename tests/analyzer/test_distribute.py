"""pageshare list publish/fetch/ls and fleet against a real redis-server."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import redis
from page_server_helpers import free_port, redis_server
from pageshare.cli import main
from pageshare.lists import distribute, sectorlist


def a_list(path: Path, seed: int, n: int = 5, name: str = "golden.qcow2") -> sectorlist.SectorList:
    ident = sectorlist.ImageIdentity(1 << 30, hashlib.sha256(b"%d" % seed).hexdigest(), name)
    blocks = {8 * (i + 1): hashlib.sha256(b"%d-%d" % (seed, i)).hexdigest() for i in range(n)}
    sl = sectorlist.SectorList(
        image=ident,
        blocks=blocks,
        generator="analyze-image 0.1.0",
        created="2026-11-21T12:00:00Z",
        runs="3 runs",
    )
    sectorlist.write(sl, path)
    return sl


def test_publish_fetch_ls(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with redis_server(tmp_path) as rd:
        store = distribute.Store(rd.url)
        sl = a_list(tmp_path / "a.pcsl", 1, name="debian12.qcow2")
        a_list(tmp_path / "b.pcsl", 2, n=3, name="trixie.qcow2")
        meta = distribute.publish(store, tmp_path / "a.pcsl", publisher="ci@test")
        assert meta["revision"] == 1 and meta["count"] == "5"
        assert distribute.publish(store, tmp_path / "a.pcsl")["revision"] == 2
        assert main(["list", "publish", str(tmp_path / "b.pcsl"), "--redis", rd.url]) == 0
        assert "3 blocks" in capsys.readouterr().out
        key = distribute.image_key(sl.image)
        # fetch by full key, by sha prefix, by image name: byte-identical, validated
        for ref in (key, sl.image.content_sha256[:10], "debian12"):
            out = tmp_path / f"fetched-{len(ref)}.pcsl"
            path, got = distribute.fetch(store, ref, out)
            assert path.read_bytes() == (tmp_path / "a.pcsl").read_bytes()
            assert got.blocks == sl.blocks
        with pytest.raises(distribute.DistributeError, match="no list in Redis"):
            distribute.fetch(store, "nosuchimage")
        assert (
            main(["list", "fetch", "debian12", "-o", str(tmp_path / "c.pcsl"), "--redis", rd.url])
            == 0
        )
        assert "wrote" in capsys.readouterr().out
        assert main(["list", "ls", "--json", "--redis", rd.url]) == 0
        images = json.loads(capsys.readouterr().out)
        assert {i["meta"]["image-name"] for i in images} == {"debian12.qcow2", "trixie.qcow2"}
        a = next(i for i in images if i["image_key"] == key)
        assert a["meta"]["published-by"] and a["meta"]["generator"] == "analyze-image 0.1.0"
        assert a["meta"]["revision"] == "2" and a["hosts"] == []
        assert main(["list", "ls", "--redis", rd.url]) == 0
        assert "served by: no host" in capsys.readouterr().out

        # A bad list is refused before anything is written.
        bad = tmp_path / "bad.pcsl"
        bad.write_text((tmp_path / "a.pcsl").read_text().replace("count: 5", "count: 6"))
        assert main(["list", "publish", str(bad), "--redis", rd.url]) == 2
        assert "truncated" in capsys.readouterr().err
        assert distribute.publish(store, tmp_path / "a.pcsl")["revision"] == 3

        # Garbage in Redis: fetch refuses it, ls and fleet tolerate it.
        r = redis.Redis.from_url(rd.url)
        r.set(f"pageshare:list:{key}", b"\xffnot a list")
        with pytest.raises(distribute.DistributeError, match="not a valid pcsl"):
            distribute.fetch(store, key)
        r.sadd("pageshare:images", "junk-key")
        r.sadd("pageshare:hosts", "h1", "h2")
        r.hset(
            "pageshare:host:h1", mapping={"status": json.dumps({"images": "nope"}), "updated": "1"}
        )
        r.hset("pageshare:host:h2", mapping={"status": "[1,2]"})
        assert main(["list", "ls", "--redis", rd.url]) == 0
        assert "junk-key" in capsys.readouterr().out
        assert main(["fleet", "--json", "--redis", rd.url]) == 0
        hosts = {h["host"]: h for h in json.loads(capsys.readouterr().out)}
        assert hosts["h1"]["stale"] and hosts["h1"]["images"] == []
        assert "unreadable status" in hosts["h2"]["error"]


def test_redis_down_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a_list(tmp_path / "a.pcsl", 1)
    url = f"redis://127.0.0.1:{free_port()}/0"
    assert main(["list", "publish", str(tmp_path / "a.pcsl"), "--redis", url]) == 2
    err = capsys.readouterr().err
    assert "cannot reach Redis" in err and "hint:" in err
    assert main(["list", "ls", "--redis", "nonsense://x"]) == 2
