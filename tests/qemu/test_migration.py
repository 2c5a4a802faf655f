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

The guest (workload over fw_cfg, pageshare.workload) hashes a set of
binaries and libraries after dropping its caches (phase "before", on the
source's serial log), reads the first 128 MiB of its disk (listed: RAM the
filter fills), then runs a writer that keeps dirtying pages
(/dev/shm) and prints heartbeats while the host migrates it, until the
host writes GO2 into the first sector of a small second disk (vdb, polled
with O_DIRECT reads; the same file on both sides); then it drops its caches
and hashes the files again (phase "after", on the destination's serial
log).  Every hash must equal the image's.

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

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from guest_phases import (
    ListedFiles,
    file_sha256,
    hashes,
    nonzero_file_blocks,
    phase,
    regular_files,
    signal_guest,
    wait_for,
)
from page_server_helpers import (
    ImageSpec,
    Server,
    content_sha256,
    make_list,
    nonzero_blocks,
    raw_copy,
)
from pageshare import golden, sectorlist
from pageshare.image_inspect import Inspection, inspect_image
from pageshare.qmp import QMP
from pageshare.vm import _child_setup, choose_accel
from pageshare.workload import Markers, Workload, script
from qemu_helpers import QemuBuild, blockdev_args, guest_cmd, ps_stats, qemu_build, serial_until

assert os.geteuid() == 0, "copy mode reads the page server's memory: run as root"

pytestmark = pytest.mark.vm

REPO = Path(__file__).resolve().parents[2]
REFS = "block-refs"                  # the migration capability under test
# max-bandwidth (bytes/s): the 300 MB of the guest's non-zero RAM take
# 5 s, long enough for its writer to dirty pages that must be sent again
BANDWIDTH = 64 << 20
SLOW = 32 << 20                      # ... a migration that must still run when the server dies
MIGRATION_TIMEOUT = 480.0
# transferred bytes per (test, refs), to compare the two when both ran
TRANSFERRED: dict[tuple[str, bool], int] = {}

# The guest's writer: 512 KiB of new bytes in /dev/shm every half second
# (few enough that the bytes a migration sends vary by little more than
# that from run to run), a heartbeat each time, until the host writes GO2
# into vdb.
GO_TEST = ('[ "$(dd if=/dev/vdb bs=512 count=1 iflag=direct 2>/dev/null | head -c 3)" '
           '= "GO2" ]')
WRITER = ("i=0; echo writer-start; until " + GO_TEST + "; do i=$((i+1)); "
          "dd if=/dev/urandom of=/dev/shm/dirty bs=64K count=8 conv=notrunc status=none; "
          "echo heartbeat-$i; sleep 0.5; done; echo writer-end-$i")
# Before it migrates, the guest also reads the first WARM_MIB of its disk
# (buffered: into its page cache), every non-zero block of which is
# listed: some 100 MB of guest RAM filled by the filter, that block-refs
# sends as references, far more than the bytes a migration sends vary by
# from run to run (some 20 MB: the guest's own activity, the writer).
WARM_MIB = 128
WARM = f"dd if=/dev/vda of=/dev/null bs=1M count={WARM_MIB} status=none; echo warm-done"


# --------------------------------------------------------------------------- the base


@dataclass(frozen=True)
class Base:
    """The small golden image, its raw copy, content sha256, kernel and
    its list (LST): every non-zero block of the hashed files and of the
    disk's first WARM_MIB (LISTED.blocks)."""

    q: QemuBuild
    image: Path
    raw: Path
    sha: str
    insp: Inspection
    listed: ListedFiles
    lst: Path
    accel: str


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Base:
    q = qemu_build()
    d = tmp_path_factory.mktemp("migration-base")
    image = golden.build_image("small").path
    raw = raw_copy(image, d / "small.raw")
    insp = inspect_image(image, "qcow2", raw.stat().st_size)
    files = regular_files(raw)
    assert len(files) >= 6, files
    want = {f: file_sha256(raw, f, d) for f in files}
    blocks = {s: h for s, h in nonzero_blocks(raw, 1 << 20).items()
              if s * 512 < WARM_MIB << 20}
    blocks.update({b * 8: h for b, h in nonzero_file_blocks(raw, files).items()})
    sha = content_sha256(raw)
    lst = d / "small.pcsl"
    make_list(sectorlist.ImageIdentity(raw.stat().st_size, sha, image.name), blocks, lst)
    accel, _ = choose_accel("auto", insp.kernel)
    return Base(q, image, raw, sha, insp, ListedFiles(files, want, blocks), lst, accel)


def refs_supported(q: QemuBuild) -> bool:
    """Does this QEMU know the block-refs migration capability?"""
    lines = [{"execute": "qmp_capabilities"}, {"execute": "query-migrate-capabilities"},
             {"execute": "quit"}]
    p = subprocess.run([q.qemu_system, "-M", "none", "-nodefaults", "-display", "none",
                        "-qmp", "stdio"], input="".join(json.dumps(x) + "\n" for x in lines),
                       capture_output=True, text=True, timeout=60)
    for line in p.stdout.splitlines():
        msg = json.loads(line)
        if isinstance(msg.get("return"), list):
            return any(c.get("capability") == REFS for c in msg["return"])
    raise AssertionError(f"no query-migrate-capabilities reply:\n{p.stdout}\n{p.stderr}")


def require_refs(q: QemuBuild) -> None:
    if not refs_supported(q):
        pytest.fail(f"this QEMU ({q.dir}) has no {REFS!r} migration capability")


# --------------------------------------------------------------------------- the guests


@dataclass
class Vm:
    """One qemu-system process of the guest: its serial log, QEMU's own
    output (stderr: error messages), a QMP socket for the test."""

    name: str
    proc: subprocess.Popen[bytes]
    serial: Path
    log: Path
    qmp: QMP

    def serial_until(self, marker: str, timeout: float = 300) -> str:
        return serial_until(self.proc, self.serial, self.log, marker, timeout)

    def text(self) -> str:
        return self.serial.read_text(errors="replace") if self.serial.exists() else ""

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def status(self) -> str:
        st: str = self.qmp.command("query-status")["status"]
        return st

    def wait_status(self, want: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while (st := self.status()) != want:
            assert time.monotonic() < deadline, f"{self.name}: status {st}, not {want}"
            time.sleep(0.5)

    def set_refs(self) -> None:
        self.qmp.command("migrate-set-capabilities",
                         capabilities=[{"capability": REFS, "state": True}])

    def exit_code(self, timeout: float = 60) -> int:
        """QEMU's exit code, once it exits (which it must, within TIMEOUT)."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.name} still runs:\n{self.log_text()[-2000:]}") from None

    def kill(self) -> None:
        with contextlib.suppress(Exception):
            self.qmp.close()
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@dataclass
class Rig:
    """What a test starts (guests, page servers), killed by the fixture on
    every way out of the test."""

    tmp: Path
    base: Base
    workload: Path
    go: Path
    markers: Markers
    vms: list[Vm] = field(default_factory=list)
    servers: list[Server] = field(default_factory=list)

    def server(self, name: str, image: Path, lst: Path) -> Server:
        s = Server(self.tmp / f"server-{name}", [ImageSpec("small", image, list_file=lst)])
        self.servers.append(s)
        s.start()
        s.wait_generation("small", 1)
        return s

    def overlay(self) -> Path:
        ovl = self.tmp / "ovl.qcow2"
        subprocess.run([self.base.q.qemu_img, "create", "-q", "-f", "qcow2", "-b",
                        str(self.base.image), "-F", "qcow2", str(ovl)], check=True)
        return ovl

    def vm(self, name: str, graph: Sequence[str], *extra: str) -> Vm:
        """A guest of GRAPH (the -blockdev arguments of the overlay "ovl"
        and what is under it), the signal disk added; EXTRA: more QEMU
        arguments (-incoming ...)."""
        b = self.base
        serial, qmp, log = (self.tmp / f"{name}.{x}" for x in ("serial", "qmp", "log"))
        go = [{"driver": "file", "node-name": "go-file", "filename": str(self.go)},
              {"driver": "raw", "node-name": "go", "file": "go-file"}]
        disks = [*graph, *(a for n in go for a in ("-blockdev", json.dumps(n))),
                 "-device", "virtio-blk-pci,drive=ovl,id=disk0",
                 "-device", "virtio-blk-pci,drive=go,id=disk1"]
        cmd = [*guest_cmd(b.q, b.insp, b.accel, serial=serial, qmp=qmp,
                          workload=self.workload, disks=disks), *extra]
        with open(log, "wb") as lf:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=lf, stderr=lf,
                                    preexec_fn=_child_setup, start_new_session=True)
        try:
            q = QMP(qmp, timeout=30)
        except Exception:
            proc.kill()
            proc.wait()
            raise AssertionError(f"{name}: no QMP (rc {proc.returncode}):\n"
                                 + log.read_text(errors="replace")[-3000:]) from None
        vm = Vm(name, proc, serial, log, q)
        self.vms.append(vm)
        return vm

    def signal(self, word: bytes) -> None:
        signal_guest(self.go, word)

    def close(self) -> None:
        for vm in self.vms:
            vm.kill()
        for s in self.servers:
            s.stop(signal.SIGKILL)


def make_rig(tmp: Path, base: Base, command: str) -> Rig:
    markers = Markers.new()
    wl = tmp / "workload.sh"
    wl.write_text(script(Workload(command), markers))
    go = tmp / "go.raw"
    go.write_bytes(bytes(1 << 20))
    return Rig(tmp, base, wl, go, markers)


@pytest.fixture
def rig(tmp_path: Path, base: Base, host_guard: None) -> Iterator[Callable[[str], Rig]]:
    made: list[Rig] = []

    def make(command: str) -> Rig:
        made.append(make_rig(tmp_path, base, command))
        return made[-1]

    try:
        yield make
    finally:
        for r in made:
            r.close()


def workload(files: list[str], *, attach: bool = False) -> str:
    """Hash FILES ("before"); with ATTACH wait for GO1 and hash them again
    ("attached"); read the disk's first WARM_MIB; run the writer until GO2,
    then hash them ("after")."""
    steps = [phase(files, "before")]
    if attach:
        steps += [wait_for("GO1"), phase(files, "attached")]
    steps += [WARM, WRITER, phase(files, "after")]
    return "; ".join(steps)


def plain_graph(image: Path, ovl: Path) -> list[str]:
    """overlay "ovl" over the qcow2 base "base", no filter (what a
    management stack starts before `pageshare attach`)."""
    nodes = [
        {"driver": "file", "node-name": "base-file", "filename": str(image), "read-only": True},
        {"driver": "qcow2", "node-name": "base", "file": "base-file", "read-only": True},
        {"driver": "file", "node-name": "ovl-file", "filename": str(ovl)},
        {"driver": "qcow2", "node-name": "ovl", "file": "ovl-file", "backing": "base"},
    ]
    return [a for n in nodes for a in ("-blockdev", json.dumps(n))]


def node_stats(qmp: QMP, node: str) -> dict[str, int]:
    """A pageshare node's counters (ps_stats for any node name)."""
    for s in qmp.command("query-blockstats", **{"query-nodes": True}):
        if s.get("node-name") == node:
            ds = s.get("driver-specific") or {}
            assert ds.get("driver") == "pageshare", s
            return {k: int(v) for k, v in ds.items() if k != "driver"}
    raise AssertionError(f"no stats for node {node}")


def heartbeats(text: str) -> list[int]:
    return [int(n) for n in re.findall(r"^heartbeat-(\d+)\s*$", text, re.M)]


# --------------------------------------------------------------------------- migration


def wait_migration(src: Vm, during: Callable[[dict[str, Any]], None] | None = None,
                   timeout: float = MIGRATION_TIMEOUT) -> dict[str, Any]:
    """query-migrate on the source until the migration ends; DURING sees
    every intermediate answer."""
    deadline = time.monotonic() + timeout
    while True:
        info: dict[str, Any] = src.qmp.command("query-migrate")
        if info.get("status") in ("completed", "failed", "cancelled"):
            return info
        assert time.monotonic() < deadline, f"migration still {info} after {timeout} s"
        if during:
            during(info)
        time.sleep(0.5)


def start_migration(src: Vm, dst: Vm, uri: str, *, refs: bool, dst_refs: bool | None = None,
                    bandwidth: int = BANDWIDTH) -> None:
    if refs:
        src.set_refs()
    if refs if dst_refs is None else dst_refs:
        dst.set_refs()
    src.qmp.command("migrate-set-parameters", **{"max-bandwidth": bandwidth})
    dst.qmp.command("migrate-incoming", uri=uri)
    src.qmp.command("migrate", uri=uri)


def migrated(src: Vm, dst: Vm, info: dict[str, Any]) -> None:
    """The migration completed: the source is paused for good, the guest
    runs on the destination."""
    assert info["status"] == "completed", \
        f"{info}\ndestination:\n{dst.log_text()[-3000:]}\nsource:\n{src.log_text()[-3000:]}"
    assert src.status() == "postmigrate"
    dst.wait_status("running")


def finish(rig: Rig, vm: Vm, after: str) -> str:
    """Once the guest's writer goes on on VM (a heartbeat in its serial
    log), let it stop and hash the files again; its serial log, whose AFTER
    phase must hold the image's hashes."""
    deadline = time.monotonic() + 120
    while not heartbeats(vm.text()):
        assert vm.proc.poll() is None, vm.log_text()[-3000:]
        assert time.monotonic() < deadline, f"{vm.name}: no heartbeat:\n{vm.text()[-3000:]}"
        time.sleep(0.5)
    rig.signal(b"GO2")
    text = vm.serial_until(rig.markers.ready)
    assert hashes(text, after) == rig.base.listed.want
    assert f"{rig.markers.ready} rc=0" in text
    return text


def refs_checks(src_info: dict[str, Any], src_ps: dict[str, int], dst_ps: dict[str, int],
                *, dst_has_server: bool = True) -> None:
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
        heard = [{k: c["stats"][f"migration_refs_{k}"] for k in FILLS}
                 for c in img["client_list"] if c["pid"] == dst.proc.pid]
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
        m = re.search(rf'^pageshare_client_migration_refs_{k}_total{{image="small"}} (\S+)$',
                      text, re.M)
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
    print(f"{test} refs={refs}: transferred {info['ram']['transferred']}, "
          f"total time {info.get('total-time')} ms, downtime {info.get('downtime')} ms")
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
def test_migrate_with_filter_attached(tmp_path: Path, base: Base, rig: Callable[[str], Rig],
                                      variant: str) -> None:
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
            vm.qmp.command("migrate-set-capabilities",
                           capabilities=[{"capability": c, "state": True} for c in caps])
        if params:
            vm.qmp.command("migrate-set-parameters", **params)
    first = max(heartbeats(src.text()), default=0)
    t0 = time.monotonic()
    start_migration(src, dst, f"unix:{tmp_path / 'mig.sock'}", refs=refs)
    info = wait_migration(src)
    took = time.monotonic() - t0
    migrated(src, dst, info)
    src_ps, dst_ps = ps_stats(src.qmp), ps_stats(dst.qmp)
    print(f"migration: {took:.1f} s, {json.dumps(info)}\nsource filter: {src_ps}\n"
          f"destination filter after switchover: {dst_ps}")
    last_src = max(heartbeats(src.text()), default=0)
    assert last_src > first, "the guest's writer did not run during the migration"

    text = finish(r, dst, "after")
    beats = heartbeats(text)
    assert beats and max(beats) >= last_src, (beats, last_src)   # the same guest, going on
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
            cmds.append({"execute": "migrate-set-capabilities", "arguments": {
                "capabilities": [{"capability": c, "state": True} for c in pair]}})
    cmds.append({"execute": "quit"})
    p = subprocess.run([q.qemu_system, "-M", "none", "-nodefaults", "-display", "none",
                        "-qmp", "stdio"], input="".join(json.dumps(c) + "\n" for c in cmds),
                       capture_output=True, text=True, timeout=60)
    errors = [json.loads(ln)["error"]["desc"] for ln in p.stdout.splitlines()
              if '"error"' in ln]
    assert len(errors) == 6, p.stdout
    for other, err in zip(("postcopy-ram", "background-snapshot", "mapped-ram"),
                          errors[::2], strict=True):
        assert REFS in err and other in err, err


@pytest.mark.parametrize("refs", [False, True], ids=["plain", "refs"])
def test_migrate_after_pageshare_attach(tmp_path: Path, base: Base, rig: Callable[[str], Rig],
                                        refs: bool) -> None:
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
    src = r.vm("src", plain_graph(base.image, ovl),
               "-qmp", f"unix:{op_qmp},server=on,wait=off")
    text = src.serial_until("before-end")
    assert hashes(text, "before") == base.listed.want

    env = dict(os.environ, PYTHONPATH=str(REPO / "analyzer"))
    p = subprocess.run([str(REPO / ".venv/bin/python"), "-m", "pageshare.cli", "attach",
                        str(op_qmp), "--control", str(server.control), "--mode", "copy",
                        "--json"], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    (d,) = [x for x in json.loads(p.stdout)["drives"] if x["drive"] == "disk0"]
    assert d["result"] == "attached" and d["overlay"] == "ovl", d
    node = d["filter"]
    r.signal(b"GO1")
    text = src.serial_until("writer-start")
    assert hashes(text, "attached") == base.listed.want
    src_before = node_stats(src.qmp, node)
    assert src_before["merged"] > 0, src_before

    dst = r.vm("dst", blockdev_args(base.image, ovl, server.sock("small"), mode="copy"),
               "-incoming", "defer")
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


def failed_before_switchover(r: Rig, src: Vm, dst: Vm, info: dict[str, Any]) -> str:
    """The migration failed: the guest still runs on the source, which is
    as good as before (it writes on and hashes right); the destination
    exited with an error.  Returns the destination's output."""
    assert info["status"] == "failed", info
    src.wait_status("running")
    rc = dst.exit_code()
    err = dst.log_text()
    print(f"source: {json.dumps(info)}\ndestination (rc {rc}):\n{err[-2000:]}")
    assert rc != 0, err
    beats = max(heartbeats(src.text()))
    deadline = time.monotonic() + 60
    while max(heartbeats(src.text())) <= beats:
        assert time.monotonic() < deadline, "the source guest does not run on"
        time.sleep(1)
    finish(r, src, "after")
    return err


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


def test_destination_with_another_base(tmp_path: Path, base: Base,
                                       rig: Callable[[str], Rig]) -> None:
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
    subprocess.run([base.q.qemu_img, "convert", "-O", "qcow2", str(other_raw), str(other)],
                   check=True)
    other_lst = tmp_path / "other.pcsl"
    make_list(sectorlist.ImageIdentity(other_raw.stat().st_size, other_sha, other.name),
              base.listed.blocks, other_lst)
    other_raw.unlink()

    r = rig(workload(base.listed.files))
    server = r.server("a", base.image, base.lst)
    server_b = r.server("b", other, other_lst)
    ovl = r.overlay()
    src = r.vm("src", blockdev_args(base.image, ovl, server.sock("small"), mode="copy"))
    src.serial_until("writer-start")
    dst = r.vm("dst", blockdev_args(other, ovl, server_b.sock("small"), mode="copy"),
               "-incoming", "defer")
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
def test_destination_without_page_server(tmp_path: Path, base: Base,
                                         rig: Callable[[str], Rig], refs: bool) -> None:
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
    dst = r.vm("dst", blockdev_args(base.image, ovl, nowhere, mode="copy",
                                    **{"image-sha256": base.sha}), "-incoming", "defer")
    start_migration(src, dst, f"unix:{tmp_path / 'mig.sock'}", refs=refs)
    info = wait_migration(src)
    migrated(src, dst, info)
    src_ps = ps_stats(src.qmp)
    finish(r, dst, "after")
    dst_ps = ps_stats(dst.qmp)
    print(f"migration: {json.dumps(info)}\nsource filter: {src_ps}\n"
          f"destination filter: {dst_ps}")
    assert dst_ps["connected"] == 0 and dst_ps["merged"] == 0, dst_ps
    if refs:
        assert dst_ps["migration-refs-read"] > 0, dst_ps
        refs_checks(info, src_ps, dst_ps, dst_has_server=False)


@pytest.mark.parametrize("refs", [False, True], ids=["plain", "refs"])
def test_source_page_server_killed_mid_migration(tmp_path: Path, base: Base,
                                                 rig: Callable[[str], Rig],
                                                 refs: bool) -> None:
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
    dst = r.vm("dst", blockdev_args(base.image, ovl, server_b.sock("small"), mode="copy"),
               "-incoming", "defer")
    killed: list[dict[str, Any]] = []

    def kill_server(info: dict[str, Any]) -> None:
        # with refs: once some pages went as references, so that the
        # migration has both kinds; without: after 16 MiB
        ram = info.get("ram", {})
        due = ram.get("block-ref-pages", 0) >= 2000 if refs else \
            ram.get("transferred", 0) > 16 << 20
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
def test_destination_page_server_killed_mid_migration(tmp_path: Path, base: Base,
                                                      rig: Callable[[str], Rig],
                                                      refs: bool) -> None:
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
    dst = r.vm("dst", blockdev_args(base.image, ovl, server_b.sock("small"), mode="copy"),
               "-incoming", "defer")
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
def test_migrate_to_file_and_load(tmp_path: Path, base: Base, rig: Callable[[str], Rig],
                                  refs: bool) -> None:
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
    print(f"migration to {state} ({state.stat().st_size} bytes): {json.dumps(info)}\n"
          f"source filter: {src_ps}")
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
        return (o + REF_RECORD <= len(data)
                and int.from_bytes(data[o:o + 8], "big") & 0xfff == 0x120
                and int.from_bytes(data[o + 8:o + 12], "big") == 0
                and int.from_bytes(data[o + 12:o + 20], "big") < nblocks)
    found = []
    o = data.find(b"\x01\x20\x00\x00\x00\x00")   # low header bytes + index 0
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
    beyond[o + 12:o + 20] = (nblocks + 5).to_bytes(8, "big")
    other = bytearray(data)
    other[o + 8:o + 12] = (7).to_bytes(4, "big")
    cases = {
        "beyond-the-image": (bytes(beyond), f"refers to block {nblocks + 5} of disk image"),
        "unnamed-image": (bytes(other), "refers to disk image 7; the stream named 1"),
        "cut-short": (data[:o + 14], "load of migration failed"),
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
