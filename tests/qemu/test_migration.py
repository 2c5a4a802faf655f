"""Live migration of a booted guest with the pageshare filter in its graph.

Two qemu-system processes on this host, the way a same-host migration with
shared storage runs: the source boots the small golden image from a qcow2
overlay whose backing child is the pageshare filter (node "ps", copy mode:
process_vm_readv from the page server, what runs on a stock kernel) over
the base; the destination is started with the same machine and the same
-blockdev graph (the same overlay file: shared storage) plus `-incoming
defer`, its own serial log and QMP socket, then `migrate-incoming` on a
Unix socket URI, then `migrate` on the source, and query-migrate until it
ends.

The rig, the base, the guest's workload (hash its files "before", read
128 MiB of listed disk, a writer dirtying pages during the migration, hash
them again "after" on the destination: every hash must equal the image's)
and the migration steps are migration_helpers', shared with
test_migration_compat.py; here are the fixtures and what only these tests
check: the block-refs counters on both sides (refs_checks), what the
destination's page server hears of them (server_heard_fills), the bytes
sent with and without refs (record_bytes), and bad streams (bad_streams).

`refs`: with True both sides get the `block-refs` migration capability
(pages that hold base-image blocks travel as references that the
destination resolves from its own page server or base); those cases fail
at once on a QEMU without it.  The bad cases check that a migration with
refs fails cleanly (capability on one side only, another base on the
destination) or degrades to sending pages (no page server on the
destination, the source's killed mid-migration), and that a migration to a
file loads in a new QEMU.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from guest_phases import ListedFiles, hashes
from migration_helpers import (
    BANDWIDTH,
    REFS,
    Base,
    Rig,
    Vm,
    failed_before_switchover,
    finish,
    heartbeats,
    make_base,
    make_rig,
    migrated,
    plain_graph,
    refs_supported,
    start_migration,
    wait_migration,
    workload,
)
from page_server_helpers import Server, content_sha256, make_list
from pageshare.host.qmp import QMP
from pageshare.lists import sectorlist
from qemu_helpers import QemuBuild, blockdev_args, flat_stats, ps_stats, qemu_build

assert os.geteuid() == 0, "copy mode reads the page server's memory: run as root"

pytestmark = pytest.mark.vm

REPO = Path(__file__).resolve().parents[2]
# max-bandwidth (bytes/s) of a migration that must still run when a page
# server dies (migration_helpers.BANDWIDTH: of the others)
SLOW = 32 << 20
# transferred bytes per (test, refs), to compare the two when both ran
TRANSFERRED: dict[tuple[str, bool], int] = {}


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Base:
    q = qemu_build()
    return make_base(tmp_path_factory.mktemp("migration-base"), q)


def require_refs(q: QemuBuild) -> None:
    if not refs_supported(q):
        pytest.fail(f"this QEMU ({q.dir}) has no {REFS!r} migration capability")


@pytest.fixture
def rig(tmp_path: Path, base: Base, qemu_guard: None) -> Iterator[Callable[[str], Rig]]:
    made: list[Rig] = []

    def make(command: str) -> Rig:
        made.append(make_rig(tmp_path, base, command))
        return made[-1]

    try:
        yield make
    finally:
        for r in made:
            r.close()


# --------------------------------------------------------------------------- checks


def node_stats(qmp: QMP, node: str) -> dict[str, int]:
    """A pageshare node's counters (ps_stats for any node name)."""
    for s in qmp.command("query-blockstats", **{"query-nodes": True}):
        if s.get("node-name") == node:
            ds = s.get("driver-specific") or {}
            assert ds.get("driver") == "pageshare", s
            return flat_stats(ds)
    raise AssertionError(f"no stats for node {node}")


def refs_checks(
    src_info: dict[str, Any],
    src_ps: dict[str, int],
    dst_ps: dict[str, int],
    *,
    dst_has_server: bool = True,
) -> None:
    """What a migration with block-refs must show on both sides: every
    reference the source sent was filled on the destination, copied from
    its page server (copy mode: none merged) or read from its base."""
    assert src_info["ram"]["block-ref-pages"] > 0, src_info
    assert src_ps["migration-refs-sent"] > 0, src_ps
    received = dst_ps["migration-refs-copied"] + dst_ps["migration-refs-read"]
    assert received == src_ps["migration-refs-sent"], (src_ps, dst_ps)
    assert dst_ps["migration-refs-merged"] == 0, dst_ps
    assert dst_ps["migration-refs-failed"] == 0, dst_ps
    if not dst_has_server:
        assert dst_ps["migration-refs-copied"] == 0, dst_ps


# The filter's migration-refs-* that a destination's page server hears of
# (STATS): how the references were filled.
FILLS = ("merged", "copied", "read", "failed")


def server_heard_fills(server: Server, dst: Vm, dst_ps: dict[str, int]) -> None:
    """The destination filter's next STATS (every 5 s) tells its page server
    how it filled the references: in the server's status the client that is
    the destination QEMU has the filter's migration-refs-merged/-copied/
    -read/-failed, and the image's Prometheus counters (every client of the
    image, those gone too) match the status' sums for the image."""
    want = {k: dst_ps[f"migration-refs-{k}"] for k in FILLS}
    deadline = time.monotonic() + 20
    while True:
        img = server.image("small")
        heard = [
            {k: c["stats"][f"migration_refs_{k}"] for k in FILLS}
            for c in img["client_list"]
            if c["pid"] == dst.proc.pid
        ]
        if heard == [want]:
            break
        assert time.monotonic() < deadline, f"the server heard {heard}, not {want}: {img}"
        time.sleep(0.5)
    totals = {k: img["client_stats"][f"migration_refs_{k}"] for k in FILLS}
    assert all(totals[k] >= want[k] for k in FILLS), (totals, want)
    while (got := metric_counters(server.metrics(), FILLS)) != totals:
        assert time.monotonic() < deadline + 5, f"metrics {got}, status {totals}"
        time.sleep(0.5)


def metric_counters(text: str, fills: Sequence[str]) -> dict[str, int]:
    """pageshare_client_migration_refs_<fill>_total of image "small" in
    Prometheus text."""
    got = {}
    for k in fills:
        m = re.search(
            rf'^pageshare_client_migration_refs_{k}_total{{image="small"}} (\S+)$', text, re.M
        )
        assert m, f"no migration_refs_{k} in the metrics:\n{text}"
        got[k] = int(float(m.group(1)))
    return got


def record_bytes(test: str, refs: bool, info: dict[str, Any]) -> None:
    """Keep the bytes the migration sent; with both parametrizations run in
    this session, refs must have sent fewer.  Loosely: without refs the
    migrations here sent 195-250 MB, varying by some 20 MB from run to run
    (the guest's own activity, its writer), while about 120 MB of its RAM
    are pages the filter filled (WARM, the files)."""
    TRANSFERRED[(test, refs)] = info["ram"]["transferred"]
    print(
        f"{test} refs={refs}: transferred {info['ram']['transferred']}, "
        f"total time {info.get('total-time')} ms, downtime {info.get('downtime')} ms"
    )
    if (test, True) in TRANSFERRED and (test, False) in TRANSFERRED:
        with_refs, without = TRANSFERRED[(test, True)], TRANSFERRED[(test, False)]
        print(f"{test}: transferred with refs {with_refs}, without {without}")
        assert with_refs < without, f"refs sent {with_refs} bytes, no refs {without}"


# --------------------------------------------------------------------------- the tests


# QEMU features used together with block-refs: capabilities and parameters
# set on both sides (references go on the main channel beside multifd's,
# and keep xbzrle's cache right)
WITH: dict[str, tuple[list[str], dict[str, Any]]] = {
    "plain": ([], {}),
    "refs": ([], {}),
    "refs-multifd": (["multifd"], {"multifd-channels": 2, "multifd-compression": "zstd"}),
    "refs-xbzrle": (["xbzrle"], {"xbzrle-cache-size": 64 << 20}),
}


@pytest.mark.parametrize("variant", list(WITH))
def test_migrate_with_filter_attached(
    tmp_path: Path, base: Base, rig: Callable[[str], Rig], variant: str
) -> None:
    """The filter in both graphs from the start; the guest dirties pages
    while it migrates and goes on on the destination, whose filter serves
    its reads of the files after the migration.  With block-refs alone and
    together with multifd (zstd) and with xbzrle."""
    refs = variant != "plain"
    if refs:
        require_refs(base.q)
    r = rig(workload(base.listed.files))
    server = r.server("a", base.image, base.lst)
    ovl = r.overlay()
    graph = blockdev_args(base.image, ovl, server.sock("small"), mode="copy")
    src = r.vm("src", graph)
    text = src.serial_until("writer-start")
    assert hashes(text, "before") == base.listed.want
    src_before = ps_stats(src.qmp)
    assert src_before["merged"] > 0, src_before

    dst = r.vm("dst", graph, "-incoming", "defer")
    caps, params = WITH[variant]
    for vm in (src, dst):
        if caps:
            vm.qmp.command(
                "migrate-set-capabilities",
                capabilities=[{"capability": c, "state": True} for c in caps],
            )
        if params:
            vm.qmp.command("migrate-set-parameters", **params)
    first = max(heartbeats(src.text()), default=0)
    t0 = time.monotonic()
    start_migration(src, dst, f"unix:{tmp_path / 'mig.sock'}", refs=refs)
    info = wait_migration(src)
    took = time.monotonic() - t0
    migrated(src, dst, info)
    src_ps, dst_ps = ps_stats(src.qmp), ps_stats(dst.qmp)
    print(
        f"migration: {took:.1f} s, {json.dumps(info)}\nsource filter: {src_ps}\n"
        f"destination filter after switchover: {dst_ps}"
    )
    last_src = max(heartbeats(src.text()), default=0)
    assert last_src > first, "the guest's writer did not run during the migration"

    text = finish(r, dst, "after")
    beats = heartbeats(text)
    assert beats and max(beats) >= last_src, (beats, last_src)  # the same guest, going on
    dst_ps = ps_stats(dst.qmp)
    print(f"destination filter at the end: {dst_ps}")
    # the guest's reads after the migration: listed blocks copied on the destination
    assert dst_ps["merged"] > 0 and dst_ps["connected"] == 1, dst_ps
    if refs:
        refs_checks(info, src_ps, dst_ps)
        server_heard_fills(server, dst, dst_ps)
    if "multifd" in caps:
        assert info["ram"]["multifd-bytes"] > 0, info
    if "xbzrle" in caps:
        assert "xbzrle-cache" in info, info
    if variant in ("plain", "refs"):
        record_bytes("filter-attached", refs, info)


def test_refs_refused_with_features_that_place_pages() -> None:
    """Postcopy, background snapshots and mapped-ram put pages in place by
    their contents: QEMU refuses each together with block-refs, in either
    order, and says which."""
    q = qemu_build()
    require_refs(q)
    cmds: list[dict[str, Any]] = [{"execute": "qmp_capabilities"}]
    for other in ("postcopy-ram", "background-snapshot", "mapped-ram"):
        for pair in ((REFS, other), (other, REFS)):
            cmds.append(
                {
                    "execute": "migrate-set-capabilities",
                    "arguments": {"capabilities": [{"capability": c, "state": True} for c in pair]},
                }
            )
    cmds.append({"execute": "quit"})
    p = subprocess.run(
        [q.qemu_system, "-M", "none", "-nodefaults", "-display", "none", "-qmp", "stdio"],
        input="".join(json.dumps(c) + "\n" for c in cmds),
        capture_output=True,
        text=True,
        timeout=60,
    )
    errors = [json.loads(ln)["error"]["desc"] for ln in p.stdout.splitlines() if '"error"' in ln]
    assert len(errors) == 6, p.stdout
    for other, err in zip(
        ("postcopy-ram", "background-snapshot", "mapped-ram"), errors[::2], strict=True
    ):
        assert REFS in err and other in err, err


@pytest.mark.parametrize("refs", [False, True], ids=["plain", "refs"])
def test_migrate_after_pageshare_attach(
    tmp_path: Path, base: Base, rig: Callable[[str], Rig], refs: bool
) -> None:
    """The source starts without the filter and gets it from `pageshare
    attach` (blockdev-add + blockdev-reopen over QMP); the guest reads its
    files through it, then migrates to a destination with the filter in its
    -blockdev graph."""
    if refs:
        require_refs(base.q)
    r = rig(workload(base.listed.files, attach=True))
    server = r.server("a", base.image, base.lst)
    ovl = r.overlay()
    op_qmp = tmp_path / "src-operator.qmp"
    src = r.vm("src", plain_graph(base.image, ovl), "-qmp", f"unix:{op_qmp},server=on,wait=off")
    text = src.serial_until("before-end")
    assert hashes(text, "before") == base.listed.want

    env = dict(os.environ, PYTHONPATH=str(REPO / "analyzer"))
    p = subprocess.run(
        [
            str(REPO / ".venv/bin/python"),
            "-m",
            "pageshare.cli",
            "attach",
            str(op_qmp),
            "--control",
            str(server.control),
            "--mode",
            "copy",
            "--json",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    (d,) = [x for x in json.loads(p.stdout)["drives"] if x["drive"] == "disk0"]
    assert d["result"] == "attached" and d["overlay"] == "ovl", d
    node = d["filter"]
    r.signal(b"GO1")
    text = src.serial_until("writer-start")
    assert hashes(text, "attached") == base.listed.want
    src_before = node_stats(src.qmp, node)
    assert src_before["merged"] > 0, src_before

    dst = r.vm(
        "dst",
        blockdev_args(base.image, ovl, server.sock("small"), mode="copy"),
        "-incoming",
        "defer",
    )
    start_migration(src, dst, f"unix:{tmp_path / 'mig.sock'}", refs=refs)
    info = wait_migration(src)
    migrated(src, dst, info)
    src_ps = node_stats(src.qmp, node)
    print(f"migration: {json.dumps(info)}\nsource filter ({node}): {src_ps}")

    finish(r, dst, "after")
    dst_ps = ps_stats(dst.qmp)
    print(f"destination filter: {dst_ps}")
    assert dst_ps["merged"] > 0, dst_ps
    if refs:
        refs_checks(info, src_ps, dst_ps)
        server_heard_fills(server, dst, dst_ps)
    record_bytes("pageshare-attach", refs, info)


def test_refs_on_the_source_only(tmp_path: Path, base: Base, rig: Callable[[str], Rig]) -> None:
    """block-refs on the source, not on the destination: the destination
    refuses the stream, naming the capability; the source runs on."""
    require_refs(base.q)
    r = rig(workload(base.listed.files))
    server = r.server("a", base.image, base.lst)
    graph = blockdev_args(base.image, r.overlay(), server.sock("small"), mode="copy")
    src = r.vm("src", graph)
    src.serial_until("writer-start")
    dst = r.vm("dst", graph, "-incoming", "defer")
    start_migration(src, dst, f"unix:{tmp_path / 'mig.sock'}", refs=True, dst_refs=False)
    err = failed_before_switchover(r, src, dst, wait_migration(src))
    assert REFS in err, err


def test_destination_with_another_base(
    tmp_path: Path, base: Base, rig: Callable[[str], Rig]
) -> None:
    """The destination's base is another image of the same size (one
    unlisted block differs), served by a page server of its own: the
    destination refuses the references before switchover, naming both
    images' content sha256; the source runs on."""
    require_refs(base.q)
    other_raw = tmp_path / "other.raw"
    subprocess.run(["cp", "--sparse=always", str(base.raw), str(other_raw)], check=True)
    block = unlisted_nonzero_block(base.raw, base.listed)
    with open(other_raw, "r+b") as f:
        f.seek(block * 4096)
        byte = f.read(1)
        f.seek(block * 4096)
        f.write(bytes([byte[0] ^ 0xFF]))
    other_sha = content_sha256(other_raw)
    assert other_sha != base.sha
    other = tmp_path / "other.qcow2"
    subprocess.run(
        [base.q.qemu_img, "convert", "-O", "qcow2", str(other_raw), str(other)], check=True
    )
    other_lst = tmp_path / "other.pcsl"
    make_list(
        sectorlist.ImageIdentity(other_raw.stat().st_size, other_sha, other.name),
        base.listed.blocks,
        other_lst,
    )
    other_raw.unlink()

    r = rig(workload(base.listed.files))
    server = r.server("a", base.image, base.lst)
    server_b = r.server("b", other, other_lst)
    ovl = r.overlay()
    src = r.vm("src", blockdev_args(base.image, ovl, server.sock("small"), mode="copy"))
    src.serial_until("writer-start")
    dst = r.vm(
        "dst", blockdev_args(other, ovl, server_b.sock("small"), mode="copy"), "-incoming", "defer"
    )
    start_migration(src, dst, f"unix:{tmp_path / 'mig.sock'}", refs=True)
    err = failed_before_switchover(r, src, dst, wait_migration(src))
    assert base.sha in err and other_sha in err, err


def unlisted_nonzero_block(raw: Path, listed: ListedFiles) -> int:
    """A non-zero 4 KiB block of the image that no hashed file uses, in the
    middle of the data (not a superblock)."""
    zero = bytes(4096)
    taken = {s // 8 for s in listed.blocks}
    with open(raw, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        off = os.lseek(f.fileno(), size // 4, os.SEEK_DATA) // 4096 * 4096
        while True:
            f.seek(off)
            data = f.read(4096)
            if data != zero and off // 4096 not in taken:
                return off // 4096
            off += 4096
            assert off < size, "no unlisted non-zero block"


@pytest.mark.parametrize("refs", [False, True], ids=["plain", "refs"])
def test_destination_without_page_server(
    tmp_path: Path, base: Base, rig: Callable[[str], Rig], refs: bool
) -> None:
    """The destination's filter names a socket nobody listens on (and the
    base's content sha256): the migration completes, the references are
    read from the destination's base, the guest's files are right."""
    if refs:
        require_refs(base.q)
    r = rig(workload(base.listed.files))
    server = r.server("a", base.image, base.lst)
    ovl = r.overlay()
    src = r.vm("src", blockdev_args(base.image, ovl, server.sock("small"), mode="copy"))
    src.serial_until("writer-start")
    nowhere = tmp_path / "nowhere.sock"
    dst = r.vm(
        "dst",
        blockdev_args(base.image, ovl, nowhere, mode="copy", **{"image-sha256": base.sha}),
        "-incoming",
        "defer",
    )
    start_migration(src, dst, f"unix:{tmp_path / 'mig.sock'}", refs=refs)
    info = wait_migration(src)
    migrated(src, dst, info)
    src_ps = ps_stats(src.qmp)
    finish(r, dst, "after")
    dst_ps = ps_stats(dst.qmp)
    print(f"migration: {json.dumps(info)}\nsource filter: {src_ps}\ndestination filter: {dst_ps}")
    assert dst_ps["connected"] == 0 and dst_ps["merged"] == 0, dst_ps
    if refs:
        assert dst_ps["migration-refs-read"] > 0, dst_ps
        refs_checks(info, src_ps, dst_ps, dst_has_server=False)


@pytest.mark.parametrize("refs", [False, True], ids=["plain", "refs"])
def test_source_page_server_killed_mid_migration(
    tmp_path: Path, base: Base, rig: Callable[[str], Rig], refs: bool
) -> None:
    """Each side has a page server of its own (two hosts); the source's is
    killed (SIGKILL) while the migration runs, slowed down so that it is
    still running then: the migration completes (what the source can no
    longer vouch for is sent in full) and the guest's files are right."""
    if refs:
        require_refs(base.q)
    r = rig(workload(base.listed.files))
    server = r.server("a", base.image, base.lst)
    server_b = r.server("b", base.image, base.lst)
    ovl = r.overlay()
    src = r.vm("src", blockdev_args(base.image, ovl, server.sock("small"), mode="copy"))
    src.serial_until("writer-start")
    dst = r.vm(
        "dst",
        blockdev_args(base.image, ovl, server_b.sock("small"), mode="copy"),
        "-incoming",
        "defer",
    )
    killed: list[dict[str, Any]] = []

    def kill_server(info: dict[str, Any]) -> None:
        # with refs: once some pages went as references, so that the
        # migration has both kinds; without: after 16 MiB
        ram = info.get("ram", {})
        due = (
            ram.get("block-ref-pages", 0) >= 2000 if refs else ram.get("transferred", 0) > 16 << 20
        )
        if not killed and info.get("status") == "active" and due:
            server.stop(signal.SIGKILL)
            killed.append(info)

    start_migration(src, dst, f"unix:{tmp_path / 'mig.sock'}", refs=refs, bandwidth=SLOW)
    info = wait_migration(src, kill_server)
    assert killed, f"the migration ended before the server was killed: {info}"
    print(f"server killed at {json.dumps(killed[0])}\nmigration: {json.dumps(info)}")
    migrated(src, dst, info)
    src_ps = ps_stats(src.qmp)
    assert src_ps["connected"] == 0, src_ps
    finish(r, dst, "after")
    dst_ps = ps_stats(dst.qmp)
    print(f"source filter: {src_ps}\ndestination filter: {dst_ps}")
    assert dst_ps["merged"] > 0, dst_ps
    if refs:
        # pages the source could no longer check against its server's copy
        refs_checks(info, src_ps, dst_ps)
        assert src_ps["migration-refs-refused"] > 0, src_ps
        server_heard_fills(server_b, dst, dst_ps)


@pytest.mark.parametrize("refs", [False, True], ids=["plain", "refs"])
def test_destination_page_server_killed_mid_migration(
    tmp_path: Path, base: Base, rig: Callable[[str], Rig], refs: bool
) -> None:
    """Each side has a page server of its own (two hosts); the destination's
    is killed (SIGKILL) while the migration runs, slowed down so that it is
    still running then: with refs once the destination filled 1000
    references from it, without after 16 MiB.  Asserted: the migration
    completes; the guest's files hash right on the destination, whose
    filter is no longer connected and read them from its base
    (fallback-no-table); with refs, every reference the source sent was
    filled on the destination and none failed, some copied from its server
    before the kill and some read from its base after it."""
    if refs:
        require_refs(base.q)
    r = rig(workload(base.listed.files))
    server = r.server("a", base.image, base.lst)
    server_b = r.server("b", base.image, base.lst)
    ovl = r.overlay()
    src = r.vm("src", blockdev_args(base.image, ovl, server.sock("small"), mode="copy"))
    src.serial_until("writer-start")
    dst = r.vm(
        "dst",
        blockdev_args(base.image, ovl, server_b.sock("small"), mode="copy"),
        "-incoming",
        "defer",
    )
    killed: list[dict[str, Any]] = []

    def kill_server(info: dict[str, Any]) -> None:
        if killed or info.get("status") != "active":
            return
        if refs:
            # the incoming side answers QMP while it loads the stream
            due = ps_stats(dst.qmp)["migration-refs-copied"] >= 1000
        else:
            due = info.get("ram", {}).get("transferred", 0) > 16 << 20
        if due:
            server_b.stop(signal.SIGKILL)
            killed.append({"source": info, "destination filter": ps_stats(dst.qmp)})

    start_migration(src, dst, f"unix:{tmp_path / 'mig.sock'}", refs=refs, bandwidth=SLOW)
    info = wait_migration(src, kill_server)
    assert killed, f"the migration ended before the server was killed: {info}"
    print(f"server killed at {json.dumps(killed[0])}\nmigration: {json.dumps(info)}")
    migrated(src, dst, info)
    src_ps = ps_stats(src.qmp)
    finish(r, dst, "after")
    dst_ps = ps_stats(dst.qmp)
    print(f"source filter: {src_ps}\ndestination filter: {dst_ps}")
    assert dst_ps["connected"] == 0 and dst_ps["fallback-no-table"] > 0, dst_ps
    if refs:
        refs_checks(info, src_ps, dst_ps)
        assert dst_ps["migration-refs-copied"] >= 1000, dst_ps
        assert dst_ps["migration-refs-read"] > 0, dst_ps


@pytest.mark.parametrize("refs", [False, True], ids=["plain", "refs"])
def test_migrate_to_file_and_load(
    tmp_path: Path, base: Base, rig: Callable[[str], Rig], refs: bool
) -> None:
    """`migrate` to a file: the source ends paused; a new QEMU with the same
    graph loads the file (`-incoming file:PATH`; with refs `-incoming defer`
    and migrate-incoming, since the capability must be set before the
    stream is read) and the guest goes on there."""
    if refs:
        require_refs(base.q)
    r = rig(workload(base.listed.files))
    server = r.server("a", base.image, base.lst)
    graph = blockdev_args(base.image, r.overlay(), server.sock("small"), mode="copy")
    src = r.vm("src", graph)
    src.serial_until("writer-start")
    state = tmp_path / "guest.mig"
    if refs:
        src.set_refs()
    src.qmp.command("migrate-set-parameters", **{"max-bandwidth": BANDWIDTH})
    src.qmp.command("migrate", uri=f"file:{state}")
    info = wait_migration(src)
    assert info["status"] == "completed", f"{info}\n{src.log_text()[-3000:]}"
    assert src.status() == "postmigrate"
    src_ps = ps_stats(src.qmp)
    print(
        f"migration to {state} ({state.stat().st_size} bytes): {json.dumps(info)}\n"
        f"source filter: {src_ps}"
    )
    src.qmp.command("quit")
    assert src.exit_code() == 0

    if refs:
        bad_streams(r, graph, state, base.raw.stat().st_size // 4096)
        dst = r.vm("dst", graph, "-incoming", "defer")
        dst.set_refs()
        dst.qmp.command("migrate-incoming", uri=f"file:{state}")
    else:
        dst = r.vm("dst", graph, "-incoming", f"file:{state}")
    dst.wait_status("running", timeout=300)
    finish(r, dst, "after")
    dst_ps = ps_stats(dst.qmp)
    print(f"destination filter: {dst_ps}")
    assert dst_ps["merged"] > 0, dst_ps
    if refs:
        refs_checks(info, src_ps, dst_ps)
        server_heard_fills(server, dst, dst_ps)


# A page sent as a reference: its header (page offset | RAM_SAVE_FLAG_BLOCK_REF
# 0x100 | RAM_SAVE_FLAG_CONTINUE 0x20: same RAMBlock as the page before), the
# be32 index of its image in the stream's table, the be64 block.
REF_RECORD = 8 + 4 + 8


def ref_records(data: bytes, nblocks: int) -> list[int]:
    """Offsets of reference records in a migration stream: runs of at least
    three back to back, each a CONTINUE header with the BLOCK_REF flag,
    image 0 and a block of the image (a run of page data that looks like
    that is practically impossible)."""

    def looks(o: int) -> bool:
        return (
            o + REF_RECORD <= len(data)
            and int.from_bytes(data[o : o + 8], "big") & 0xFFF == 0x120
            and int.from_bytes(data[o + 8 : o + 12], "big") == 0
            and int.from_bytes(data[o + 12 : o + 20], "big") < nblocks
        )

    found = []
    o = data.find(b"\x01\x20\x00\x00\x00\x00")  # low header bytes + index 0
    while o >= 0:
        start = o - 6
        if start >= 0 and all(looks(start + k * REF_RECORD) for k in range(3)):
            found.append(start)
        o = data.find(b"\x01\x20\x00\x00\x00\x00", o + 1)
    return found


def bad_streams(r: Rig, graph: Sequence[str], state: Path, nblocks: int) -> None:
    """A stream with a reference out of the image, one to an image the
    stream did not name, and one cut in the middle of a reference: QEMU
    loading each exits with an error that says what is wrong, and loads
    nothing into a running guest."""
    data = state.read_bytes()
    refs = ref_records(data, nblocks)
    assert len(refs) > 100, f"found {len(refs)} reference records in {state}"
    o = refs[len(refs) // 2]
    beyond = bytearray(data)
    beyond[o + 12 : o + 20] = (nblocks + 5).to_bytes(8, "big")
    other = bytearray(data)
    other[o + 8 : o + 12] = (7).to_bytes(4, "big")
    cases = {
        "beyond-the-image": (bytes(beyond), f"refers to block {nblocks + 5} of disk image"),
        "unnamed-image": (bytes(other), "refers to disk image 7; the stream named 1"),
        "cut-short": (data[: o + 14], "load of migration failed"),
    }
    for name, (stream, want) in cases.items():
        path = state.with_name(f"{name}.mig")
        path.write_bytes(stream)
        vm = r.vm(f"load-{name}", graph, "-incoming", "defer")
        vm.set_refs()
        vm.qmp.command("migrate-incoming", uri=f"file:{path}")
        rc = vm.exit_code(timeout=120)
        out = vm.log_text()
        print(f"{name}: exit {rc}: {out.strip()[-400:]}")
        assert rc != 0, out
        assert want in out, out
        path.unlink()
