"""pageshare list refine: the fleet's feedback in a real redis-server, real images.

The summaries are written into Redis as a page server writes them
(feedback.encode, the contract's record layout), for three hosts and a
fourth whose summary does not parse.  The image is the small golden image
(its inspection is cached, nothing boots) for the checks of a whole
refinement; a tiny mkfs'd ext4 with a file block overwritten by zeros, its
inspection given by hand, for the zero rule.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from page_server_helpers import free_port, redis_server
from pageshare.cli import main
from pageshare.image.diskimage import image_content_sha256, raw_file_reader
from pageshare.image.ext4map import file_sectors
from pageshare.image.fslayout import MappedFs
from pageshare.image.image_inspect import ImageInfo, Inspection
from pageshare.lists import distribute, feedback, fileblocks, refine, sectorlist
from pageshare.progress import Progress
from refine_helpers import (
    PAGE,
    Image,
    check_against_image,
    parent_list,
    publish_summaries,
    raw_image,
)

# --------------------------------------------------------------------------- the format


def test_summary_round_trip_and_what_does_not_parse() -> None:
    key = "1024-" + "a" * 64
    h = feedback.encode("h1", key, 10, 20, 3, {9: (2, 5, 0), 4: (1, 1, feedback.FLAG_LISTED)})
    s = feedback.decode(h, key, "h1")
    assert list(s.records()) == [(4, 1, 1, 1), (9, 2, 5, 0)]
    assert (s.host, s.since, s.updated, s.guests, s.count) == ("h1", 10, 20, 3, 2)
    # as str, the way a decode_responses client would hand it (minus the blocks)
    bad: list[tuple[dict[str, bytes], str]] = [
        ({**h, "version": b"2"}, "version 2"),
        ({**h, "image": b"1024-" + b"b" * 64}, "another image"),
        ({**h, "host": b"h2"}, "stored under host"),
        ({**h, "blocks": h["blocks"][:-3]}, "not a multiple"),
        ({**h, "blocks": h["blocks"][20:] + h["blocks"][:20]}, "sorted"),
        ({**h, "blocks": h["blocks"][:20] * 2}, "each block once"),
        ({**h, "since": b"30"}, "after updated"),
        ({**h, "guests": b"-1"}, "decimal integer"),
        ({k: v for k, v in h.items() if k != "updated"}, "'updated' is missing"),
        ({}, "empty"),
    ]
    for raw, why in bad:
        with pytest.raises(feedback.SummaryFormatError, match=why):
            feedback.decode(raw, key, "h1")


def test_tally_counts_guests_over_hosts_and_hosts_with_a_guest() -> None:
    key = "1024-" + "a" * 64

    def summ(host: str, recs: dict[int, tuple[int, int, int]]) -> feedback.HostSummary:
        return feedback.decode(feedback.encode(host, key, 0, 1, 9, recs), key, host)

    t = refine.tally(
        [
            summ("a", {1: (1, 1, 0), 2: (3, 3, 0), 7: (1, 1, 1)}),
            summ("b", {1: (2, 2, 0), 3: (0, 4, 0), 8: (1, 1, 0)}),
        ],
        listed={7, 8, 9},
    )
    assert t.unlisted == {1: [3, 2, 3], 2: [3, 1, 3]}  # block 3: no guest, no host
    assert t.listed_read == {7: [1, 1, 1], 8: [1, 1, 1]}  # the flag is not what decides
    assert (t.guest_reads_listed, t.guest_reads_unlisted) == (2, 6)


# --------------------------------------------------------------------------- the small image


@pytest.fixture(scope="module")
def image(small_image: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Image]:
    img = raw_image(small_image, tmp_path_factory.mktemp("refine") / "small.raw")
    yield img
    img.raw.unlink()


def test_refine_thresholds_rejections_flood_garbage_drop_db(
    image: Image, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    libc = file_sectors(image.raw, 0, "/usr/lib/x86_64-linux-gnu/libc.so.6", 0, 4096)
    dash = file_sectors(image.raw, 0, "/usr/bin/dash", 0, 4096)
    root_dir = file_sectors(image.raw, 0, "/", 0, 4096)  # a directory's block
    listed = libc[:5]
    parent = parent_list(image, listed, tmp_path / "parent.pcsl")
    a1, a2 = libc[10], dash[3]  # 3 guests on 3 hosts / 2 + 1 on 2 hosts: added
    one_host = libc[11]  # 6 guests, all on h1: one host alone
    two_guests = libc[12]  # 1 + 1 guests on two hosts, N = 3
    one_guest = libc[13]  # the tenant alone
    superblock = 0  # file system metadata
    free = (image.vsize // PAGE - 10) * 8  # unallocated, at the file system's end
    outside = image.vsize // PAGE + 5  # a block number past the image
    b = {
        s: s // 8
        for s in (a1, a2, one_host, two_guests, one_guest, superblock, free, *root_dir[:1], *listed)
    }
    now = time.time()
    h1 = {
        b[a1]: (1, 4, 0),
        b[a2]: (2, 2, 0),
        b[one_host]: (6, 60, 0),
        b[two_guests]: (1, 1, 0),
        b[one_guest]: (1, 9, 0),
        b[superblock]: (3, 3, 0),
        b[root_dir[0]]: (3, 3, 0),
        b[free]: (3, 3, 0),
        outside: (3, 3, 0),
        b[listed[0]]: (1, 1, feedback.FLAG_LISTED),
    }
    h2 = {
        b[a1]: (1, 1, 0),
        b[a2]: (1, 1, 0),
        b[two_guests]: (1, 1, 0),
        b[superblock]: (1, 1, 0),
        b[root_dir[0]]: (1, 1, 0),
        b[free]: (1, 1, 0),
        outside: (1, 1, 0),
        b[listed[1]]: (2, 2, 0),
    }  # a listed block, unflagged: read
    # h3: one guest, and a flood of 200 000 distinct blocks nobody else read.
    flood = {blk: (1, 1, 0) for blk in range(100_000, 300_000)}
    h3 = {b[a1]: (1, 1, 0), **flood}
    with redis_server(tmp_path) as rd:
        publish_summaries(rd.url, image.key, {"h1": h1, "h2": h2, "h3": h3}, now - 10 * 86400, now)
        r = redis.Redis.from_url(rd.url)
        r.hset(
            f"pageshare:feedback:{image.key}:h4",
            mapping={
                "host": "h4",
                "image": image.key,
                "since": "1",
                "updated": "2",
                "guests": "1",
                "version": "1",
                "blocks": b"\x01" * 7,
            },
        )
        r.sadd(f"pageshare:feedback:{image.key}:hosts", "h4")
        db = tmp_path / "results.sqlite"
        out = tmp_path / "next.pcsl"
        t0 = time.monotonic()
        rc = main(
            [
                "list",
                "refine",
                str(image.path),
                "--list",
                str(tmp_path / "parent.pcsl"),
                "--min-guests",
                "3",
                "--min-hosts",
                "2",
                "--drop-unread",
                "--window",
                "7d",
                "-o",
                str(out),
                "--db",
                str(db),
                "--redis",
                rd.url,
                "--json",
            ]
        )
        cap = capsys.readouterr()
        assert rc == 0, cap.err
        res = json.loads(cap.out)
        assert time.monotonic() - t0 < 300
    assert res["ok"] and res["added"] == 2 and res["generation"] == 2
    assert res["rejected"] == {
        "below-min-hosts": 200_000 + 2,
        "below-min-guests": 1,
        "outside-image": 1,
        fileblocks.NOT_REGULAR: 3,
    }
    assert [f["host"] for f in res["failures"]] == ["h4"]
    assert "not a multiple" in res["failures"][0]["error"]
    assert sorted(h["host"] for h in res["hosts"]) == ["h1", "h2", "h3"]
    # Drop: the window is covered by h1..h3 but h4's summary is unreadable.
    assert res["dropped"] == 0 and "h4" in res["drop_unread"]["refused"]
    check_against_image(image, out, {*listed, a1, a2})
    assert main(["list", "verify", str(out), "--image", str(image.path)]) == 0
    assert "OK:" in capsys.readouterr().out
    sl = sectorlist.read(out)
    assert sl.extra["x-generation"] == "2"
    assert sl.extra["x-parent-list-digest"] == parent.digest()

    con = sqlite3.connect(db)
    row = con.execute(
        "SELECT status, min_guests, min_hosts, hosts_used, hosts_failed, added, "
        "dropped, generation, listed_blocks, list_digest, parent_digest, "
        "rejected_json, drop_unread, drop_refused FROM refinement"
    ).fetchall()
    assert len(row) == 1
    (status, n, m, used, failed, added, dropped, gen, count, digest, pdigest, rej, du, refused) = (
        row[0]
    )
    assert (status, n, m, used, failed, added, dropped, gen, count) == (
        "ok",
        3,
        2,
        3,
        1,
        2,
        0,
        2,
        7,
    )
    assert digest == sl.digest() and pdigest == parent.digest() and du == 1 and "h4" in refused
    assert json.loads(rej)["below-min-guests"] == 1
    blocks = con.execute(
        "SELECT sector, action, guests, hosts FROM refined_block ORDER BY sector"
    ).fetchall()
    assert blocks == sorted([(a1, "added", 3, 3), (a2, "added", 3, 2)])


def test_refine_from_redis_drop_unread_publish(
    image: Image, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    libc = file_sectors(image.raw, 0, "/usr/lib/x86_64-linux-gnu/libc.so.6", 0, 4096)
    listed, new = libc[20:26], libc[40]
    parent_list(image, listed, tmp_path / "parent.pcsl")
    now = time.time()
    read = {listed[0] // 8: (1, 1, feedback.FLAG_LISTED), new // 8: (2, 2, 0)}
    with redis_server(tmp_path) as rd:
        store = distribute.Store(rd.url)
        assert distribute.publish(store, tmp_path / "parent.pcsl")["revision"] == 1
        # h2 counts only since yesterday: a 7-day window is not covered.
        publish_summaries(rd.url, image.key, {"h1": read}, now - 30 * 86400, now)
        publish_summaries(rd.url, image.key, {"h2": read}, now - 86400, now)
        opts = refine.RefineOptions(
            image=image.path,
            store=store,
            db=tmp_path / "r.sqlite",
            lists_dir=tmp_path / "lists",
            drop_unread=True,
        )
        res = refine.refine(opts, Progress("test", quiet=True))
        assert res.added == 1 and res.dropped == 0 and res.parent["revision"] == 1
        assert "h2" in str(res.drop_unread["refused"])
        assert "since after the window began" in str(res.drop_unread["refused"])
        assert Path(res.list_path).name.endswith(".gen2.pcsl")
        # Both since a month: the 4 listed blocks no guest read go; published as revision 2.
        publish_summaries(rd.url, image.key, {"h2": read}, now - 30 * 86400, now)
        opts.publish, opts.output = True, tmp_path / "gen2.pcsl"
        res = refine.refine(opts, Progress("test", quiet=True))
        assert res.dropped == len(listed) - 1 and res.dropped_reasons == {"unread": 5}
        assert res.published is not None and res.published["revision"] == 2
        check_against_image(image, tmp_path / "gen2.pcsl", {listed[0], new})
        _, got = distribute.fetch(store, image.key, tmp_path / "fetched.pcsl")
        assert got.extra["x-generation"] == "2" and set(got.blocks) == {listed[0], new}
        # The next round refines generation 2 from Redis, and names it generation 3.
        opts.publish, opts.output, opts.drop_unread = False, tmp_path / "gen3.pcsl", False
        res = refine.refine(opts, Progress("test", quiet=True))
        assert res.generation == 3 and res.added == 0 and res.parent["revision"] == 2
        # The human summary says what was added and where it went.
        assert (
            main(
                [
                    "list",
                    "refine",
                    str(image.path),
                    "--redis",
                    rd.url,
                    "--db",
                    str(tmp_path / "r.sqlite"),
                    "-o",
                    str(tmp_path / "h.pcsl"),
                ]
            )
            == 0
        )
        text = capsys.readouterr().out
        assert "generation 3" in text and "added 0 block(s)" in text
        assert "publish it with: pageshare list publish" in text


def test_refine_redis_down_and_bad_input(
    image: Image, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    rc = main(["list", "refine", str(image.path), "--redis", url, "--json"])
    out = capsys.readouterr()
    assert rc == 2
    err = json.loads(out.out)
    assert err["ok"] is False and "cannot reach Redis" in err["error"]["message"]
    assert "redis-server" in err["error"]["hint"]
    assert "cannot reach Redis" in out.err
    # Thresholds that say nothing, and a window that is not one.
    assert main(["list", "refine", str(image.path), "--min-hosts", "0", "--json"]) == 2
    assert "at least 1" in json.loads(capsys.readouterr().out)["error"]["message"]
    assert main(["list", "refine", str(image.path), "--window", "soon", "--json"]) == 2
    assert json.loads(capsys.readouterr().out)["error"]["kind"] == "usage"
    with redis_server(tmp_path) as rd:
        # No feedback at all, and a list of another image.
        parent_list(image, [], tmp_path / "p.pcsl")
        assert (
            main(
                [
                    "list",
                    "refine",
                    str(image.path),
                    "--list",
                    str(tmp_path / "p.pcsl"),
                    "--redis",
                    rd.url,
                    "--db",
                    str(tmp_path / "r.sqlite"),
                    "--json",
                ]
            )
            == 2
        )
        err = json.loads(capsys.readouterr().out)["error"]
        assert "no host has published feedback" in err["message"]
        other = tmp_path / "other.pcsl"
        sectorlist.write(
            sectorlist.SectorList(image=sectorlist.ImageIdentity(image.vsize, "0" * 64), blocks={}),
            other,
        )
        assert (
            main(
                [
                    "list",
                    "refine",
                    str(image.path),
                    "--list",
                    str(other),
                    "--redis",
                    rd.url,
                    "--db",
                    str(tmp_path / "r.sqlite"),
                ]
            )
            == 2
        )
        assert "is for image" in capsys.readouterr().err


# --------------------------------------------------------------------------- the zero rule


def test_zero_blocks_of_a_file_are_not_added(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file block whose bytes are zeros (written so, not a hole) is not listed."""
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "data.bin").write_bytes(bytes(range(256)) * 16 * 4)  # 4 blocks
    img = tmp_path / "disk.raw"
    subprocess.run(["truncate", "-s", "64M", str(img)], check=True)
    subprocess.run(
        [
            "mkfs.ext4",
            "-q",
            "-F",
            "-b",
            "4096",
            "-U",
            "11111111-2222-3333-4444-555555555555",
            "-d",
            str(tree),
            str(img),
        ],
        check=True,
    )
    sectors = file_sectors(img, 0, "/data.bin", 0, 4096)
    assert len(sectors) == 4
    with open(img, "r+b") as f:  # the file's third block: zeros on disk
        f.seek(sectors[2] * 512)
        f.write(bytes(PAGE))
    info = ImageInfo(
        str(img),
        "raw",
        64 << 20,
        "debian",
        "12",
        12,
        0,
        "/dev/sda",
        0,
        0,
        "ext4",
        "11111111-2222-3333-4444-555555555555",
        4096,
        "",
        "6.1.0",
        "/vmlinuz",
        "",
        filesystems=(
            MappedFs(
                "/",
                "/dev/sda",
                0,
                0,
                "ext4",
                "11111111-2222-3333-4444-555555555555",
                4096,
                "",
                ((0, 131072, 0),),
            ),
        ),
    )
    monkeypatch.setattr(
        refine, "inspect_image", lambda *_a, **_k: Inspection(info, tmp_path / "vmlinuz", None)
    )
    read_at, size = raw_file_reader(img)
    key = f"{size}-{image_content_sha256(read_at, size)}"
    sectorlist.write(
        sectorlist.SectorList(image=sectorlist.ImageIdentity(size, key.split("-")[1]), blocks={}),
        tmp_path / "empty.pcsl",
    )
    with redis_server(tmp_path) as rd:
        recs = {s // 8: (2, 2, 0) for s in sectors}
        publish_summaries(rd.url, key, {"a": recs, "b": recs}, 0, time.time())
        res = refine.refine(
            refine.RefineOptions(
                image=img,
                store=distribute.Store(rd.url),
                list_path=tmp_path / "empty.pcsl",
                db=tmp_path / "r.sqlite",
                output=tmp_path / "out.pcsl",
            ),
            Progress("t", quiet=True),
        )
    assert res.added == 3 and res.rejected == {"zero": 1}
    got = sectorlist.read(tmp_path / "out.pcsl")
    assert set(got.blocks) == {sectors[0], sectors[1], sectors[3]}
