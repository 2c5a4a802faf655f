"""A pageshare QEMU migrates to and from a QEMU without the series.

"Stock" is qemu-patches/build.py --stock: the same Debian source package
(Debian's patches applied), the same configuration and the same work tree,
without the series; not Debian's binary package.  Both sides run the same
machine type, pinned (MACHINE), and the same devices; the block graphs
differ: the pageshare side has the filter (node "ps", copy mode, a page
server) between the overlay and the base, the stock side the overlay
straight over the base (migration_helpers.plain_graph).  The rig, the
base and the migration steps are migration_helpers', shared with
test_migration.py; here are the stock build's fixture, the workload with
its "cached" phase and the steps only these tests take.

The guest (migration_helpers) hashes its files after dropping its caches
("before": their pages in its page cache, on a pageshare source RAM the
filter filled), reads the first WARM_MIB of its disk, runs a writer that
dirties pages while it migrates, then, on the destination, hashes the files
again without dropping caches ("cached": the page cache that migrated) and
after dropping them ("after": read through the destination's graph).
Every hash must equal the image's, and the writer must go on where it was.

With the capability block-refs on the pageshare source, the stock
destination cannot read the stream: the migration fails, the source's
guest runs on and then migrates to the stock QEMU with the capability off.
(The other direction cannot be tried: the stock QEMU has no such
capability to turn on.)
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from guest_phases import hashes, phase
from migration_helpers import (
    REFS,
    WARM,
    WRITER,
    Base,
    Rig,
    Vm,
    finish,
    heartbeats,
    make_base,
    make_rig,
    migrated,
    migration_capabilities,
    plain_graph,
    start_migration,
    wait_migration,
)
from pageshare.host.qmp import QMPError
from qemu_helpers import QemuBuild, blockdev_args, ps_stats, qemu_build

assert os.geteuid() == 0, "copy mode reads the page server's memory: run as root"

pytestmark = pytest.mark.vm

# The machine type of both sides, named: "q35" is each build's newest
# pc-q35-*, the same here only because both are 10.0.
MACHINE = "pc-q35-10.0"


def compat_workload(files: list[str]) -> str:
    """The phases of migration_helpers.workload ("before", WARM, the
    writer), then FILES hashed from the page cache ("cached", no
    drop_caches: 1 GiB of guest RAM holds them and WARM_MIB) and from disk
    ("after")."""
    cached = "; ".join(["echo cached-begin", *(f"sha256sum {f}" for f in files), "echo cached-end"])
    return "; ".join([phase(files, "before"), WARM, WRITER, cached, phase(files, "after")])


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def stock() -> QemuBuild:
    """The stock build, checked to be the patched build's source and
    configuration without the series."""
    patched, st = qemu_build(), qemu_build(stock=True)
    pi, si = patched.info, st.info
    assert si.get("stock") is True and si["series"] == [], (
        f"{st.dir} is not a build without the series: {si}"
    )
    for k in ("version", "configure"):
        assert si[k] == pi[k], f"stock and patched builds differ in {k}: {si[k]} vs {pi[k]}"
    # Each build has a work tree of its own; the stock commit is the
    # patched commit with the series taken off.
    series = pi["series"]
    assert isinstance(series, list) and series, f"{patched.dir} has no series: {pi}"
    base = subprocess.run(
        ["git", "-C", f"{pi['work']}/src", "rev-parse", f"{pi['commit']}~{len(series)}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert si["commit"] == base, (
        f"the stock build is at {si['commit']}, not the patched build's base {base}"
    )
    assert REFS in migration_capabilities(patched), f"{patched.dir} has no {REFS!r}"
    assert REFS not in migration_capabilities(st), f"the stock build {st.dir} knows {REFS!r}"
    for q in (patched, st):
        p = subprocess.run(
            [q.qemu_system, "-machine", "help"], capture_output=True, text=True, timeout=60
        )
        assert MACHINE in p.stdout.split(), f"{q.qemu_system} has no machine {MACHINE}"
    return st


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Base:
    return make_base(tmp_path_factory.mktemp("migration-compat-base"), qemu_build())


@pytest.fixture
def rig(tmp_path: Path, base: Base, qemu_guard: None) -> Iterator[Callable[[], Rig]]:
    made: list[Rig] = []

    def make() -> Rig:
        made.append(make_rig(tmp_path, base, compat_workload(base.listed.files), machine=MACHINE))
        return made[-1]

    try:
        yield make
    finally:
        for r in made:
            r.close()


# --------------------------------------------------------------------------- steps


def booted(r: Rig, vm: Vm) -> None:
    """VM's guest hashed its files right and its writer runs."""
    text = vm.serial_until("writer-start")
    assert hashes(text, "before") == r.base.listed.want, f"{vm.name}: wrong files at boot"


def migrate_live(src: Vm, dst: Vm, uri: str) -> tuple[dict[str, Any], int]:
    """Migrate (block-refs off) while the guest's writer runs; the
    migration completes, the writer ran during it.  Returns query-migrate's
    last answer and the writer's last heartbeat on the source."""
    first = max(heartbeats(src.text()), default=0)
    t0 = time.monotonic()
    start_migration(src, dst, uri, refs=False)
    info = wait_migration(src)
    took = time.monotonic() - t0
    migrated(src, dst, info)
    last = max(heartbeats(src.text()), default=0)
    print(f"{src.name} -> {dst.name}: {took:.1f} s, {json.dumps(info)}")
    assert last > first, (
        f"the guest's writer did not run during the migration (heartbeat {first} -> {last})"
    )
    assert info["ram"]["dirty-sync-count"] >= 2, info
    return info, last


def went_on(r: Rig, dst: Vm, last_src: int) -> None:
    """On the destination the same guest goes on (its writer counts on
    from the source's last heartbeat), and its files hash right from the
    page cache that migrated and from disk."""
    text = finish(r, dst, "after")
    beats = heartbeats(text)
    assert beats and max(beats) > last_src, (
        f"{dst.name}: the writer did not go on from heartbeat {last_src}: {beats}"
    )
    assert hashes(text, "cached") == r.base.listed.want, (
        f"{dst.name}: the files' pages in the migrated page cache are wrong"
    )


def no_refs(info: dict[str, Any], *stats: dict[str, int]) -> None:
    """Nothing went as a block reference."""
    assert info["ram"].get("block-ref-pages", 0) == 0, info
    for s in stats:
        moved = {k: v for k, v in s.items() if k.startswith("migration-refs-") and v}
        assert not moved, f"block references with {REFS} off: {moved}"


# --------------------------------------------------------------------------- the tests


def test_stock_to_pageshare(
    tmp_path: Path, base: Base, stock: QemuBuild, rig: Callable[[], Rig]
) -> None:
    """Stock QEMU (overlay over the base) -> pageshare QEMU with the filter
    under the overlay and a page server: the guest goes on with the right
    bytes, and the destination's filter serves its reads afterwards."""
    r = rig()
    server = r.server("a", base.image, base.lst)
    ovl = r.overlay()
    src = r.vm("src-stock", plain_graph(base.image, ovl), q=stock)
    booted(r, src)
    dst = r.vm(
        "dst-pageshare",
        blockdev_args(base.image, ovl, server.sock("small"), mode="copy"),
        "-incoming",
        "defer",
    )
    info, last = migrate_live(src, dst, f"unix:{tmp_path / 'mig.sock'}")
    went_on(r, dst, last)
    dst_ps = ps_stats(dst.qmp)
    print(f"destination filter: {dst_ps}")
    assert dst_ps["connected"] == 1 and dst_ps["merged"] > 0, (
        f"the destination's filter did not serve the guest's reads after the migration: {dst_ps}"
    )
    no_refs(info, dst_ps)


def test_pageshare_to_stock(
    tmp_path: Path, base: Base, stock: QemuBuild, rig: Callable[[], Rig]
) -> None:
    """Pageshare QEMU (the filter filled guest RAM before the migration) ->
    stock QEMU (overlay over the base): the guest goes on with the right
    bytes."""
    r = rig()
    server = r.server("a", base.image, base.lst)
    ovl = r.overlay()
    src = r.vm("src-pageshare", blockdev_args(base.image, ovl, server.sock("small"), mode="copy"))
    booted(r, src)
    src_ps = ps_stats(src.qmp)
    assert src_ps["merged"] > 0, f"the source's filter filled no guest RAM: {src_ps}"
    dst = r.vm("dst-stock", plain_graph(base.image, ovl), "-incoming", "defer", q=stock)
    info, last = migrate_live(src, dst, f"unix:{tmp_path / 'mig.sock'}")
    src_ps = ps_stats(src.qmp)
    print(f"source filter: {src_ps}")
    no_refs(info, src_ps)
    went_on(r, dst, last)


def test_refs_to_stock_fails_cleanly(
    tmp_path: Path, base: Base, stock: QemuBuild, rig: Callable[[], Rig]
) -> None:
    """block-refs on the pageshare source: the stock destination, which has
    no such capability, refuses the stream and exits; the source's guest
    runs on untouched, and then migrates to a new stock destination with
    block-refs off."""
    r = rig()
    server = r.server("a", base.image, base.lst)
    ovl = r.overlay()
    src = r.vm("src-pageshare", blockdev_args(base.image, ovl, server.sock("small"), mode="copy"))
    booted(r, src)
    dst = r.vm("dst-stock", plain_graph(base.image, ovl), "-incoming", "defer", q=stock)
    with pytest.raises(QMPError) as refused:
        dst.set_refs()
    print(f"the stock QEMU on {REFS}: {refused.value}")
    assert REFS in str(refused.value), refused.value

    start_migration(src, dst, f"unix:{tmp_path / 'mig.sock'}", refs=True, dst_refs=False)
    info = wait_migration(src)
    rc = dst.exit_code()
    err = dst.log_text()
    print(f"source: {json.dumps(info)}\nstock destination (rc {rc}):\n{err[-2000:]}")
    assert info["status"] == "failed", (
        f"a migration with {REFS} to a stock QEMU did not fail: {info}\n{err[-2000:]}"
    )
    assert rc != 0, f"the stock destination exited with 0:\n{err}"
    # QEMU 10.0's savevm.c, loading the source's configuration section
    assert f"Received unknown capability {REFS}" in err, (
        f"the stock destination did not say it does not know {REFS}:\n{err}"
    )
    src.wait_status("running")
    beats = max(heartbeats(src.text()), default=0)
    deadline = time.monotonic() + 60
    while max(heartbeats(src.text()), default=0) <= beats:
        assert time.monotonic() < deadline, (
            f"the source's guest does not run on after the failed migration:\n{src.text()[-2000:]}"
        )
        time.sleep(1)
    # (references the source sent before it saw the destination go are
    # counted, and were never loaded)
    failed_ps = ps_stats(src.qmp)
    print(f"source filter after the failed migration: {failed_ps}")

    # the same source, block-refs off again, to a new stock QEMU
    src.qmp.command("migrate-set-capabilities", capabilities=[{"capability": REFS, "state": False}])
    dst2 = r.vm("dst2-stock", plain_graph(base.image, ovl), "-incoming", "defer", q=stock)
    info2, last = migrate_live(src, dst2, f"unix:{tmp_path / 'mig2.sock'}")
    src_ps = ps_stats(src.qmp)
    assert info2["ram"].get("block-ref-pages", 0) == 0, info2
    assert src_ps["migration-refs-sent"] == failed_ps["migration-refs-sent"], (
        f"block references with {REFS} off: {failed_ps} -> {src_ps}"
    )
    went_on(r, dst2, last)
