"""page-server end to end: real daemon processes, real qemu-storage-daemon,
real sockets.  A client that speaks PROTOCOL.md checks every published
address in the server's memory (/proc/PID/mem, root)."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import json
import os
import random
import shutil
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from page_server_helpers import (
    PAGE_SERVER,
    ImageSpec,
    Server,
    check_published,
    content_sha256,
    make_list,
    nonzero_blocks,
    psc,
    raw_copy,
    rss_bytes,
    server_binary,
    wait_for,
)
from pageshare import golden
from pageshare.lists import sectorlist
from qemu_helpers import SEED_VERDICTS

pytestmark = pytest.mark.build

# Root is required (the client reads /proc/PID/mem); fail loudly rather than skip.
assert os.geteuid() == 0, "the page-server tests read /proc/PID/mem: run them as root"


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    """16 MiB of random data as raw and as a *compressed* qcow2."""
    d = tmp_path_factory.mktemp("synthetic")
    raw = d / "img.raw"
    rnd = random.Random(4)
    data = bytearray(rnd.randbytes(16 << 20))
    data[4 << 20 : 6 << 20] = bytes(2 << 20)  # a hole
    raw.write_bytes(bytes(data))
    qcow = d / "img.qcow2"
    subprocess.run(["qemu-img", "convert", "-c", "-O", "qcow2", str(raw), str(qcow)], check=True)
    return raw, qcow, hashlib.sha256(data).hexdigest()


def synthetic_list(
    raw: Path, sha: str, path: Path, every: int = 3, limit: int = 10_000
) -> sectorlist.SectorList:
    blocks = nonzero_blocks(raw, limit, stride=every)
    ident = sectorlist.ImageIdentity(raw.stat().st_size, sha, "img.qcow2")
    return make_list(ident, blocks, path)


@pytest.fixture
def server_factory(tmp_path: Path) -> Iterator[list[Server]]:
    servers: list[Server] = []
    yield servers
    for s in servers:
        s.stop()


def start(servers: list[Server], d: Path, images: list[ImageSpec], **kw: object) -> Server:
    s = Server(d, images, **kw)  # type: ignore[arg-type]
    servers.append(s)
    s.start()
    return s


def first_table(sock: Path, timeout: float = 60) -> tuple[psc.PageshareClient, psc.TableMsg]:
    c = psc.PageshareClient(sock, timeout=timeout)
    deadline = time.monotonic() + timeout
    while True:
        m = c.recv()
        if isinstance(m, psc.TableMsg):
            return c, m
        assert isinstance(m, psc.NoTableMsg), m
        assert m.reason in ("loading", "no-list"), m
        assert time.monotonic() < deadline


# --------------------------------------------------------------------------- golden image


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    image = golden.build_image("small").path
    raw = raw_copy(image, tmp_path_factory.mktemp("small") / "small.raw")
    return image, raw, content_sha256(raw)


def test_serves_exactly_the_listed_bytes_of_a_golden_image(
    small: tuple[Path, Path, str], tmp_path: Path, server_factory: list[Server]
) -> None:
    image, raw, sha = small
    blocks = nonzero_blocks(raw, 6000, stride=5)
    sl = make_list(
        sectorlist.ImageIdentity(raw.stat().st_size, sha, image.name),
        blocks,
        tmp_path / "small.pcsl",
    )
    s = start(
        server_factory, tmp_path / "srv", [ImageSpec("small", image, tmp_path / "small.pcsl")]
    )
    c, msg = first_table(s.sock("small"))
    with c:
        check_published(msg, sl)
        assert msg.generation == 1
        # TABLE v2: the proof of identity is this very file, unchanged.
        assert msg.version == 2 and msg.format_name == "qcow2" and msg.proves(image)
        # pidfd of the server, sealed table
        assert os.readlink(f"/proc/self/fd/{msg.pidfd}") == "anon_inode:[pidfd]"
        st = s.image("small")
        assert st["state"] == "serving" and st["blocks"] == len(blocks)
        assert st["identity"]["content_sha256"] == sha
        # Memory: the blocks, the table and a few MiB of process.
        listed = len(blocks) * 4096
        rss = rss_bytes(msg.server_pid)
        assert listed <= rss < listed + 24 * (1 << 20), (rss, listed)
        # Client stats reach status and metrics: from a client without the
        # migration counters (48 bytes: they are 0) ...
        c.stats(msg.generation, 100, 60, 0, 3, 40)
        wait_for(lambda: s.image("small")["client_stats"]["lookups"] == 100, 5, "stats")
        assert s.image("small")["client_stats"]["migration_refs_copied"] == 0

        def metrics(want: str) -> str | None:
            t = s.metrics()
            return t if want in t else None

        text = wait_for(
            lambda: metrics('pageshare_client_lookups_total{image="small"} 100'), 5, "metrics"
        )
        assert f'pageshare_image_blocks{{image="small"}} {len(blocks)}' in text
        # ... and from one with them (96 bytes); the latest STATS counts.
        c.stats(msg.generation, 110, 60, 0, 3, 50, migration_refs=[5, 1, 0, 700, 12, 0])
        wait_for(lambda: s.image("small")["client_stats"]["lookups"] == 110, 5, "stats")
        got = s.image("small")["client_stats"]
        assert [
            got[f"migration_refs_{k}"]
            for k in ("sent", "refused", "merged", "copied", "read", "failed")
        ] == [5, 1, 0, 700, 12, 0]
        text = wait_for(
            lambda: metrics('pageshare_client_migration_refs_copied_total{image="small"} 700'),
            5,
            "metrics",
        )
        assert 'pageshare_client_migration_refs_read_total{image="small"} 12' in text
        # A STATS of another length is a protocol error.
        bad, _ = first_table(s.sock("small"))
        with bad:
            bad.sock.sendall(psc.frame(psc.MSG_STATS, bytes(56)))
            bye = bad.recv()
            assert isinstance(bye, psc.ByeMsg) and "STATS of 56 bytes" in bye.text, bye
    # The content hash is cached: a restart does not read the whole image again.
    s.stop()
    s.start()
    s.wait_generation("small", 1, 60)
    assert "content sha256 of" not in s.log_text().split("stopping")[-1]


# --------------------------------------------------------------------------- reload


def test_hot_reload_switch_and_release(
    synthetic: tuple[Path, Path, str], tmp_path: Path, server_factory: list[Server]
) -> None:
    raw, qcow, sha = synthetic
    lst = tmp_path / "l.pcsl"
    sl1 = synthetic_list(raw, sha, lst, every=2)
    s = start(
        server_factory,
        tmp_path / "srv",
        [ImageSpec("img", qcow, lst)],
        extra="[limits]\nclient_switch_timeout_secs = 3",
    )
    a, m1 = first_table(s.sock("img"))
    b, _ = first_table(s.sock("img"))
    check_published(m1, sl1)
    # "auto" detected qcow2; the stamp is the qcow2 file's, not a raw copy's.
    assert m1.format_name == "qcow2" and m1.proves(qcow) and not m1.proves(raw)
    assert m1.file is not None and m1.file.size == qcow.stat().st_size != m1.virtual_size
    assert abs(m1.published_at - time.time()) < 120
    loaded1 = s.status()["memory"]["loaded_blocks"]
    assert loaded1 == len(sl1.blocks)
    # New list: half the blocks plus new ones.
    keep = dict(list(sl1.blocks.items())[: len(sl1.blocks) // 2])
    extra = nonzero_blocks(raw, 300, stride=2, start=1 << 20 | 4096)
    sl2 = make_list(sl1.image, {**keep, **extra}, lst, generator="v2")
    m2 = a.recv()
    assert isinstance(m2, psc.TableMsg) and m2.generation == 2
    check_published(m2, sl2)
    # Old generation kept while a and b may still use it.
    st = s.image("img")
    assert st["live_generations"] == [1, 2] and st["clients_waiting_to_switch"] == 2
    check_published(m1, sl1)  # old addresses still hold the right bytes
    a.switched(2)
    # b never switches: disconnected after the timeout, then generation 1 is freed.
    bye = b.recv()
    while isinstance(bye, psc.TableMsg):
        bye = b.recv()
    assert isinstance(bye, psc.ByeMsg) and "acknowledge" in bye.text
    wait_for(lambda: s.image("img")["live_generations"] == [2], 10, "generation 1 released")
    assert s.status()["memory"]["loaded_blocks"] == len(sl2.blocks)
    # Blocks in both generations kept their address; dropped ones fault
    # (PROT_NONE): a stalled client copying them gets EFAULT, never zeros
    # and never another block's bytes.
    for sector in keep:
        assert m1.table.lookup(sector // 8) == m2.table.lookup(sector // 8)
    gone = [x for x in sl1.blocks if x not in sl2.blocks][:50]
    assert gone
    for sector in gone:
        addr = m1.table.lookup(sector // 8)
        assert addr is not None
        with pytest.raises(OSError) as e:
            psc.copy_server_memory(m1.server_pid, addr, 4096)
        assert e.value.errno == errno.EFAULT, e.value
    # A block never listed faults too; a kept one reads its bytes.
    never = next(b for b in range(4096) if b * 8 not in sl1.blocks and b * 8 not in sl2.blocks)
    base = m2.table.arena[0]
    with pytest.raises(OSError):
        psc.copy_server_memory(m2.server_pid, base + never * 4096, 4096)
    sector, digest = next(iter(keep.items()))
    data = psc.copy_server_memory(m2.server_pid, m2.table.lookup(sector // 8) or 0, 4096)
    assert hashlib.sha256(data).hexdigest() == digest
    log = s.log_text()
    assert "generation 2" in log and "reused" in log
    a.close()
    b.close()


# --------------------------------------------------------------------------- bad input


def test_missing_image_is_named_and_the_others_served(
    synthetic: tuple[Path, Path, str], tmp_path: Path, server_factory: list[Server]
) -> None:
    """An [[image]] whose path does not exist (a typo, a volume not
    mounted yet) is an error of that image alone: the server starts, serves
    its other images, says which path and why, tells that image's clients
    there is no table (their reads go to disk), and retries it."""
    raw, qcow, sha = synthetic
    missing = tmp_path / "not-there" / "golden.qcow2"
    lst, other = tmp_path / "l.pcsl", tmp_path / "o.pcsl"
    synthetic_list(raw, sha, lst)
    synthetic_list(raw, sha, other)
    s = start(
        server_factory,
        tmp_path / "srv",
        [ImageSpec("missing", missing, lst), ImageSpec("good", qcow, other)],
    )
    s.wait_generation("good", 1, 60)
    wait_for(lambda: s.image("missing")["state"] == "error", 60, "the missing image's error")
    st = s.image("missing")
    assert str(missing) in st["last_error"] and "No such file" in st["last_error"], st
    assert "retrying in" in st["message"], st
    assert isinstance(psc.PageshareClient(s.sock("missing")).recv(), psc.NoTableMsg)
    assert isinstance(psc.PageshareClient(s.sock("good")).recv(), psc.TableMsg)
    assert s.alive()


def test_image_on_fuse_is_refused_and_the_others_served(
    synthetic: tuple[Path, Path, str], tmp_path: Path, server_factory: list[Server]
) -> None:
    """An image on a FUSE file system (bindfs here; NFS, SMB, Ceph and the
    like are refused the same way) can change without this host's kernel
    moving its ctime, so no stamp of it proves anything: the server refuses
    to serve it, says why and what to do, and serves its other images."""
    raw, qcow, sha = synthetic
    below, mnt = tmp_path / "below", tmp_path / "fuse"
    below.mkdir()
    mnt.mkdir()
    shutil.copy(qcow, below / "img.qcow2")
    subprocess.run(["bindfs", "--no-allow-other", str(below), str(mnt)], check=True)
    try:
        assert (
            subprocess.run(
                ["stat", "-f", "-c", "%t", str(mnt)], capture_output=True, text=True
            ).stdout.strip()
            == "65735546"
        )  # FUSE_SUPER_MAGIC
        on_fuse = tmp_path / "fuse.pcsl"
        local = tmp_path / "local.pcsl"
        synthetic_list(raw, sha, on_fuse)
        synthetic_list(raw, sha, local)
        s = start(
            server_factory,
            tmp_path / "srv",
            [ImageSpec("fuse", mnt / "img.qcow2", on_fuse), ImageSpec("local", qcow, local)],
        )
        s.wait_generation("local", 1, 60)
        wait_for(lambda: s.image("fuse")["state"] == "error", 60, "the FUSE image's refusal")
        err = s.image("fuse")["last_error"]
        assert "is on FUSE" in err and "copy it to a local file system" in err, err
        m = psc.PageshareClient(s.sock("fuse")).recv()
        assert isinstance(m, psc.NoTableMsg), m
        assert isinstance(psc.PageshareClient(s.sock("local")).recv(), psc.TableMsg)
        assert s.alive()
    finally:
        for s in server_factory:
            s.stop()
        subprocess.run(["fusermount", "-u", str(mnt)], check=True)


def test_bad_lists_are_refused_and_the_old_generation_kept(
    synthetic: tuple[Path, Path, str], tmp_path: Path, server_factory: list[Server]
) -> None:
    raw, qcow, sha = synthetic
    lst = tmp_path / "l.pcsl"
    good = lst.with_suffix(".good")
    lst.write_text("# pcsl v1\ngarbage\n")
    s = start(server_factory, tmp_path / "srv", [ImageSpec("img", qcow, lst)])
    wait_for(lambda: s.image("img")["state"] == "refused", 60, "refusal")
    c = psc.PageshareClient(s.sock("img"))
    m = c.recv()
    assert isinstance(m, psc.NoTableMsg) and m.reason == "refused" and "line 2" in m.text
    sl = synthetic_list(raw, sha, good)
    os.replace(good, lst)
    m = c.recv()
    assert isinstance(m, psc.TableMsg) and m.generation == 1
    text = lst.read_text()
    lines = text.split("\n")
    sep = lines.index("---")
    body_line = lines[sep + 5]
    sector, digest = body_line.split(" ")
    wrong = "0" * 64 if digest != "0" * 64 else "1" * 64

    bad_cases = {
        # corrupted body: digest catches it
        "edited": text.replace(body_line, f"{sector} {wrong}"),
        "truncated": text[: len(text) // 2],
        "crlf": text.replace("\n", "\r\n"),
        "other image": text.replace(sha, "ab" * 32),
        "other size": text.replace(
            f"image-virtual-size: {raw.stat().st_size}",
            f"image-virtual-size: {raw.stat().st_size + 4096}",
        ),
        "empty": "",
        "binary": "\x00\udcff" * 100,
    }
    # A well-formed list (valid digest) whose block hash is wrong: only the
    # per-block check against the image can catch it.
    blocks = dict(sl.blocks)
    blocks[int(sector)] = wrong
    forged = sectorlist.dumps(sectorlist.SectorList(image=sl.image, blocks=blocks))
    bad_cases["forged hash of a loaded block"] = forged
    unlisted = next(x for x in nonzero_blocks(raw, 100) if x not in sl.blocks)
    forged_new = sectorlist.dumps(
        sectorlist.SectorList(image=sl.image, blocks={**sl.blocks, unlisted: wrong})
    )
    bad_cases["forged hash of a new block"] = forged_new
    for n, (name, content) in enumerate(bad_cases.items()):
        tmp = lst.with_suffix(".tmp")
        tmp.write_bytes(content.encode("utf-8", "surrogateescape"))
        os.replace(tmp, lst)
        wait_for(lambda n=n: s.image("img")["loads_failed"] >= 2 + n, 30, f"refusal of {name}")
        st = s.image("img")
        assert st["generation"] == 1 and st["state"] == "serving", (name, st)
        assert s.alive()
    log = s.log_text()
    assert "list body does not match list-digest" in log
    assert "is for another image" in log
    assert "(verified earlier)" in log  # forged hash of a block already loaded
    assert "in the image, the list says" in log  # forged hash of a block read now
    # Never published anything but generation 1, whose bytes are still right.
    check_published(m, sl)
    assert s.status()["memory"]["loaded_blocks"] == len(sl.blocks)
    c.close()


def test_changed_base_image_is_withdrawn(
    synthetic: tuple[Path, Path, str], tmp_path: Path, server_factory: list[Server]
) -> None:
    raw, _, sha = synthetic
    img = tmp_path / "base.raw"
    shutil.copyfile(raw, img)
    lst = tmp_path / "l.pcsl"
    sl = synthetic_list(raw, sha, lst)
    s = start(server_factory, tmp_path / "srv", [ImageSpec("img", img, lst, fmt="raw")])
    c, m = first_table(s.sock("img"))
    check_published(m, sl)
    assert m.format_name == "raw" and m.proves(img)
    with open(img, "rb") as fd:
        assert m.proves(fd.fileno())
    # The server waited for the fresh copy's ctime to be 2 s old.
    assert m.file is not None and m.published_at * 1e9 - m.file.ctime_ns >= 2e9
    assert "changed less than 2 s ago; waiting before verifying it" in s.log_text()
    # Someone writes into the base image (one listed block changes).
    sector = sorted(sl.blocks)[10]
    with open(img, "r+b") as f:
        f.seek(sector * 512)
        f.write(b"\x55" * 4096)
    assert not m.proves(img), "a client's fstat() check catches the write"
    nt = c.recv()
    assert isinstance(nt, psc.NoTableMsg) and nt.reason == "image-changed", nt
    wait_for(
        lambda: not s.image("img")["loading"] and s.image("img")["state"] != "withdrawn",
        60,
        "reload after the change",
    )
    st = s.image("img")
    assert st["generation"] is None and st["state"] == "refused", st
    assert "is for another image" in st["last_error"]
    # The image disappears: still running, still nothing published.
    img.unlink()
    wait_for(
        lambda: (
            "unreadable" in s.image("img")["message"] or "cannot" in s.image("img")["last_error"]
        ),
        30,
        "unreadable image reported",
    )
    assert s.alive() and s.image("img")["generation"] is None
    # The right image comes back: served again, as a new generation.
    shutil.copyfile(raw, img)
    m2 = c.recv()
    while not isinstance(m2, psc.TableMsg):
        m2 = c.recv()
    assert m2.generation == 2
    check_published(m2, sl)
    assert m2.proves(img) and m2.file != m.file
    c.close()


def test_image_written_through_a_hard_link_is_withdrawn_at_once(
    synthetic: tuple[Path, Path, str], tmp_path: Path, server_factory: list[Server]
) -> None:
    """The server watches the image's inode, not only its directory: a write
    through a hard link in a directory it does not watch withdraws the table
    within a second, and the re-load publishes the file's new stamp."""
    raw, _, sha = synthetic
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    img = tmp_path / "a" / "base.raw"
    alias = tmp_path / "b" / "alias.raw"
    shutil.copyfile(raw, img)
    os.link(img, alias)  # before the server starts: linking changes the ctime too
    lst = tmp_path / "l.pcsl"
    sl = synthetic_list(raw, sha, lst)
    s = start(server_factory, tmp_path / "srv", [ImageSpec("img", img, lst, fmt="raw")])
    c, m1 = first_table(s.sock("img"))
    check_published(m1, sl)
    assert m1.proves(img) and m1.proves(alias)
    ino = img.stat().st_ino

    def withdrawn_within_1s(change: str, said: str) -> None:
        c.sock.settimeout(1.0)
        nt = c.recv()  # TimeoutError if the server did not notice
        assert isinstance(nt, psc.NoTableMsg) and nt.reason == "image-changed", (change, nt)
        assert f"{said} (inode {ino})" in nt.text, nt.text
        st = s.image("img")
        assert st["generation"] is None, (change, st)
        assert st["state"] in ("withdrawn", "loading") or st["loading"], (change, st)

    def reloaded(gen: int, old: psc.TableMsg) -> psc.TableMsg:
        c.sock.settimeout(60)
        m = c.recv()
        while not isinstance(m, psc.TableMsg):
            m = c.recv()
        assert m.generation == gen
        assert m.file is not None and old.file is not None
        assert m.file != old.file and m.file.ino == ino and m.proves(img) and m.proves(alias)
        assert not old.proves(img)
        check_published(m, sl)
        c.switched(gen)
        return m

    # Rewrite a listed block with its own bytes, through the other directory:
    # same content (so the list still applies), new mtime and ctime.
    sector = sorted(sl.blocks)[10]
    with open(raw, "rb") as f:
        f.seek(sector * 512)
        same = f.read(4096)
    with open(alias, "r+b") as w:
        w.seek(sector * 512)
        w.write(same)
        w.flush()
        withdrawn_within_1s("write", "was modified")
    assert f"image {img} was modified (inode {ino}): table withdrawn" in s.log_text()
    m2 = reloaded(2, m1)
    # An attribute change through the link (IN_ATTRIB) withdraws it as well.
    os.chmod(alias, 0o600)
    # The server says which it was: an operator reads "modified" as a write.
    withdrawn_within_1s("chmod", "had its owner, mode, times or extended attributes changed")
    reloaded(3, m2)
    c.close()


def test_metadata_change_reverified_without_reading_the_blocks_again(
    synthetic: tuple[Path, Path, str], tmp_path: Path, server_factory: list[Server]
) -> None:
    """A chmod, a new hard link and a touch -d of the base (its bytes
    unchanged) each withdraw the table at once; the server verifies the file
    again (its whole content hash) and publishes the next generation with
    the new stamp, reusing every loaded block (kept while it verifies: none
    is read again).  What its clients say in STATS (base-changed, then
    sharing) is in status, per client and per image."""
    raw, _, sha = synthetic
    img = tmp_path / "base.raw"
    shutil.copyfile(raw, img)
    lst = tmp_path / "l.pcsl"
    sl = synthetic_list(raw, sha, lst)
    s = start(server_factory, tmp_path / "srv", [ImageSpec("img", img, lst, fmt="raw")])
    c, m = first_table(s.sock("img"))
    check_published(m, sl)
    refs = [0] * 6

    def stats(state: str, gen: int) -> None:
        c.stats(gen, 10, 8, 8, 0, 2, refs, proof=(5, state))

    def said(state: str) -> bool:
        st = s.image("img")
        return bool(st["clients_proof"][state] == 1 and st["client_list"][0]["proof"] == state)

    stats("sharing", m.generation)
    wait_for(lambda: said("sharing"), 10, "status shows the client sharing")
    assert s.image("img")["client_stats"]["fallback_unproven"] == 5
    loaded = s.image("img")["arena_loaded_blocks"]
    assert loaded == len(sl.blocks)
    ino = img.stat().st_ino

    def change(what: str, gen: int, do: object) -> psc.TableMsg:
        nonlocal m
        assert callable(do)
        do()
        assert not m.proves(img), what
        nt = c.recv()
        assert isinstance(nt, psc.NoTableMsg) and nt.reason == "image-changed", (what, nt)
        assert f"(inode {ino}): table withdrawn until it is verified again" in nt.text, nt.text
        c.switched(psc.NO_GENERATION)
        stats("base-changed", psc.NO_GENERATION)
        # While it verifies (it waits 2 s for the new ctime first), the
        # image says so, and so do its clients.
        wait_for(lambda: said("base-changed"), 10, f"{what}: the client is base-changed")
        st = s.image("img")
        assert st["reverifying"] is not None and st["reverifying"]["generation"] == gen - 1, st
        assert st["arena_loaded_blocks"] == loaded, "kept while it verifies"
        m2 = c.recv()
        assert isinstance(m2, psc.TableMsg) and m2.generation == gen, (what, m2)
        assert m2.proves(img) and m2.file != m.file, what
        check_published(m2, sl)
        c.switched(gen)
        stats("sharing", gen)
        wait_for(lambda: said("sharing"), 10, f"{what}: sharing again")
        st = s.image("img")
        assert st["reverifying"] is None, st
        assert st["last_load"]["read_blocks"] == 0, st["last_load"]
        assert st["last_load"]["reused_blocks"] == len(sl.blocks), st["last_load"]
        assert st["arena_loaded_blocks"] == loaded
        m = m2
        return m2

    change("chmod", 2, lambda: os.chmod(img, 0o640))
    change("link", 3, lambda: os.link(img, tmp_path / "another-name.raw"))
    # touch -d: mtime set back to what it was; only the ctime tells.
    before = img.stat()
    change("touch -d", 4, lambda: os.utime(img, ns=(before.st_atime_ns, before.st_mtime_ns)))
    assert m.file is not None and m.file.mtime_ns == before.st_mtime_ns
    log = s.log_text()
    assert log.count("only the file's metadata changed") == 3, log
    assert "read and verified" in log
    c.close()


def test_hostile_clients_do_not_hurt_the_server(
    synthetic: tuple[Path, Path, str], tmp_path: Path, server_factory: list[Server]
) -> None:
    raw, qcow, sha = synthetic
    lst = tmp_path / "l.pcsl"
    sl = synthetic_list(raw, sha, lst, every=7)
    s = start(
        server_factory,
        tmp_path / "srv",
        [ImageSpec("img", qcow, lst)],
        extra="[limits]\nmax_clients = 40",
    )
    good, m = first_table(s.sock("img"))
    path = str(s.sock("img"))

    def raw_conn() -> socket.socket:
        x = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        x.settimeout(5)
        x.connect(path)
        return x

    rnd = random.Random(7)
    # Bounded socket fuzz: random frames, random bytes, huge lengths, fds.
    for i in range(300):
        x = raw_conn()
        try:
            kind = rnd.choice([0, 1, 16, 17, 32, 99, 2**32 - 1])
            payload = rnd.randbytes(rnd.randrange(0, 64))
            frames = [
                struct.pack("<II", kind, len(payload)) + payload,
                rnd.randbytes(rnd.randrange(1, 200)),
                struct.pack("<II", 17, 1 << 30),
                struct.pack("<II", 16, 8) + struct.pack("<Q", 12345),
            ]
            data = rnd.choice(frames)
            if i % 25 == 0:
                socket.send_fds(x, [data or b"x"], [os.open("/dev/null", os.O_RDONLY)])
            else:
                x.sendall(data)
        except OSError:
            pass
        finally:
            x.close()
    # Control socket garbage too.
    for _ in range(50):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as x:
            x.connect(str(s.control))
            with contextlib.suppress(OSError):  # the server may hang up first
                x.sendall(rnd.randbytes(rnd.randrange(1, 100)))
    # Clients that connect and never read, up to the limit and beyond.
    idle = [raw_conn() for _ in range(45)]
    assert s.alive()
    for x in idle:
        x.close()

    def idle_gone() -> bool:
        try:
            return bool(s.status()["clients"] == 1)
        except AssertionError:  # BYE: the control connection hit max_clients too
            return False

    wait_for(idle_gone, 10, "idle clients gone")
    # A client that floods STATS without reading replies is fine; garbage ends it.
    bad = psc.PageshareClient(s.sock("img"))
    assert isinstance(bad.recv(), psc.TableMsg)
    bad.sock.sendall(struct.pack("<II", 16, 8) + struct.pack("<Q", 999))  # never sent gen
    assert isinstance(bad.recv(), psc.ByeMsg)
    bad.close()
    # Still serving the honest client, correctly; no fd leak in the server.
    check_published(m, sl)
    new, m2 = first_table(s.sock("img"))
    check_published(m2, sl)
    nfds = len(os.listdir(f"/proc/{m.server_pid}/fd"))
    assert nfds < 40, nfds
    st = s.status()
    assert st["clients"] == 2
    good.close()
    new.close()


# --------------------------------------------------------------------------- ops


def test_sd_notify_ready_and_watchdog(
    synthetic: tuple[Path, Path, str], tmp_path: Path, server_factory: list[Server]
) -> None:
    raw, qcow, sha = synthetic
    lst = tmp_path / "l.pcsl"
    synthetic_list(raw, sha, lst, every=50)
    ns = tmp_path / "notify.sock"
    rx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    rx.bind(str(ns))
    rx.settimeout(10)
    s = start(
        server_factory,
        tmp_path / "srv",
        [ImageSpec("img", qcow, lst)],
        env={"NOTIFY_SOCKET": str(ns), "WATCHDOG_USEC": "400000"},
    )
    got: list[str] = []
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not (
        any("READY=1" in g for g in got) and sum("WATCHDOG=1" in g for g in got) >= 3
    ):
        got.append(rx.recv(4096).decode())
    assert any("READY=1" in g for g in got), got
    assert sum("WATCHDOG=1" in g for g in got) >= 3, got
    s.stop()
    rx.settimeout(2)
    rest = []
    try:
        while True:
            rest.append(rx.recv(4096).decode())
    except TimeoutError:
        pass
    assert any("STOPPING=1" in g for g in rest)
    rx.close()


def test_status_command_and_degraded_mode_match_the_kernel(
    synthetic: tuple[Path, Path, str], tmp_path: Path, server_factory: list[Server]
) -> None:
    raw, qcow, sha = synthetic
    lst = tmp_path / "l.pcsl"
    synthetic_list(raw, sha, lst, every=50)
    s = start(server_factory, tmp_path / "srv", [ImageSpec("img", qcow, lst)])
    s.wait_generation("img", 1, 60)
    # What the kernel says about MADV_ALLOWMERGED (26), probed independently.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    p = libc.mmap(None, 4096, 1, 0x22, -1, 0)
    supported = libc.madvise(p, 4096, 26) == 0
    st = s.status()
    assert st["degraded"] is (not supported)
    out = subprocess.run(
        [str(server_binary()), "status", "--config", str(s.config)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "image img: serving" in out
    assert ("DEGRADED" in out) is (not supported)
    if not supported:
        assert "MADV_ALLOWMERGED" in s.log_text() and "DEGRADED MODE" in s.log_text()
        c, m = first_table(s.sock("img"))
        assert m.degraded
        c.close()
    r = subprocess.run(
        [str(server_binary()), "reload", "img", "--config", str(s.config)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0 and '"ok":true' in r.stdout
    s.wait_generation("img", 2, 60)


def test_systemd_unit_verifies(tmp_path: Path) -> None:
    if shutil.which("systemd-analyze") is None:
        pytest.fail("systemd-analyze is not installed (apt: systemd)")
    unit = (PAGE_SERVER / "pageshare-server.service").read_text()
    assert "Type=notify" in unit and "WatchdogSec=" in unit
    for opt in (
        "ProtectSystem=strict",
        "PrivateTmp=yes",
        "NoNewPrivileges=yes",
        "ProtectHome=yes",
        "RuntimeDirectory=pageshare",
        "CacheDirectory=",
    ):
        assert opt in unit
    # The package installs the binary here (packaging/debs.py), and nothing
    # else does; tests/deploy/test_server_package_guest.py verifies the installed unit.
    assert "ExecStart=/usr/bin/pageshare-server run " in unit
    assert "ConditionPathExists=/etc/pageshare/server.toml" in unit
    # systemd-analyze checks that ExecStart exists: point it at the build.
    local = unit.replace("/usr/bin/pageshare-server", str(server_binary()))
    assert "/usr/bin/pageshare-server" not in local
    good = tmp_path / "pageshare-server.service"
    good.write_text(local)
    p = subprocess.run(["systemd-analyze", "verify", str(good)], capture_output=True, text=True)
    assert p.returncode == 0 and p.stderr.strip() == "", p.stderr
    # The check can fail: a typo in a directive is reported.
    bad = tmp_path / "bad" / "pageshare-server.service"
    bad.parent.mkdir()
    bad.write_text(local.replace("ProtectSystem=strict", "ProtectSystem=strickt"))
    p = subprocess.run(["systemd-analyze", "verify", str(bad)], capture_output=True, text=True)
    assert p.returncode != 0 or p.stderr.strip(), "a broken unit passed verification"
    # And the example config is valid.
    subprocess.run(
        [str(server_binary()), "check-config", str(PAGE_SERVER / "server.example.toml")],
        check=True,
        capture_output=True,
    )


def test_c_table_reader(
    synthetic: tuple[Path, Path, str], tmp_path: Path, server_factory: list[Server]
) -> None:
    """client/pageshare_table.h builds with -Wall -Werror and reads the live
    server's table exactly like the Python client."""
    raw, qcow, sha = synthetic
    lst = tmp_path / "l.pcsl"
    sl = synthetic_list(raw, sha, lst, every=3)
    s = start(server_factory, tmp_path / "srv", [ImageSpec("img", qcow, lst)])
    s.wait_generation("img", 1, 60)
    exe = tmp_path / "bench_lookup"
    subprocess.run(
        [
            "cc",
            "-std=c11",
            "-O2",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-o",
            str(exe),
            str(PAGE_SERVER / "client" / "bench_lookup.c"),
        ],
        check=True,
    )
    out = subprocess.run(
        [str(exe), str(s.sock("img")), "100000", str(qcow)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert r["entries"] == len(sl.blocks) and r["generation"] == 1
    assert r["random_found"] > 0 and r["hit_ns"] > 0
    st = qcow.stat()
    assert (r["image_format"], r["file_ino"], r["file_ctime_ns"]) == (2, st.st_ino, st.st_ctime_ns)
    # pst_msg_check_file() refuses another file.
    out = subprocess.run(
        [str(exe), str(s.sock("img")), "1000", str(raw)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode != 0 and "not the file the server verified" in out.stderr


def test_c_table_reader_refuses_malformed_tables(tmp_path: Path) -> None:
    """pageshare_table.h judges every table the QEMU filter's fuzz seeds
    hold as the filter does, and its lookups are bounded: a header that
    claims fewer entries than its buckets hold (every bucket taken) made
    pst_lookup() spin forever; check_table's alarm() kills that."""
    seeds = tmp_path / "seeds"
    subprocess.run(
        [
            sys.executable,
            str(PAGE_SERVER.parent / "qemu-patches" / "fuzz" / "make_seeds.py"),
            str(seeds),
        ],
        check=True,
    )
    exe = tmp_path / "check_table"
    subprocess.run(
        [
            "cc",
            "-std=c11",
            "-O2",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-o",
            str(exe),
            str(PAGE_SERVER / "client" / "check_table.c"),
        ],
        check=True,
    )
    paths = sorted(seeds.glob("seed-*.bin"))
    out = subprocess.run([str(exe), *map(str, paths)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, (out.returncode, out.stdout, out.stderr)
    verdicts = dict(line.split(": ", 1) for line in out.stdout.splitlines())
    assert {Path(k).stem.removeprefix("seed-"): v for k, v in verdicts.items()} == SEED_VERDICTS, (
        out.stdout
    )
