"""Live migration of a booted golden-image guest between two qemu-system
processes on this host (shared storage: the same overlay file): the rig,
base, guest workload and migration steps of test_migration.py and
test_migration_compat.py.  (No tests here.)

The guest (workload over fw_cfg, pageshare.analysis.workload) hashes a set of
binaries and libraries after dropping its caches (phase "before"), reads
the first WARM_MIB of its disk (listed: RAM the filter fills, when there is
one), then runs a writer that keeps dirtying pages (/dev/shm) and prints
heartbeats while the host migrates it, until the host writes GO2 into the
first sector of a small second disk (vdb, polled with O_DIRECT reads; the
same file on both sides); then it drops its caches and hashes the files
again (phase "after", on the destination's serial log).  Every hash must
equal the image's.

Each guest of a Rig may be of another QEMU build (QemuBuild; the base's
unless told) and its own -blockdev graph; the devices (virtio-blk-pci
disk0 on node "ovl", disk1 on the signal disk) and the machine type
(Rig.machine) are the same on both sides, as a migration needs.

Here: Base and make_base (the module fixtures' body), refs_supported,
Vm, Rig and make_rig, workload (WARM, WRITER, GO_TEST), plain_graph,
heartbeats, and the steps start_migration, wait_migration, migrated,
finish and failed_before_switchover.  What only one test module checks
stays in it: test_migration.py has the block-refs checks (refs_checks,
server_heard_fills, bad_streams, record_bytes, ...), test_migration_compat.py
the stock build, its workload with the "cached" phase and its steps.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
from pageshare import golden
from pageshare.analysis.vm import choose_accel
from pageshare.analysis.workload import Markers, Workload, script
from pageshare.host.qmp import QMP
from pageshare.image.image_inspect import Inspection, inspect_image
from pageshare.lists import sectorlist
from pageshare_tools.qemu_guest import (
    kill_qemu,
    make_overlay,
    make_signal_disk,
    signal_disk_blockdev,
    start_qemu,
)
from qemu_helpers import QemuBuild, guest_cmd, serial_until

REFS = "block-refs"  # the series' migration capability
# max-bandwidth (bytes/s): the 300 MB of the guest's non-zero RAM take
# 5 s, long enough for its writer to dirty pages that must be sent again
BANDWIDTH = 64 << 20
MIGRATION_TIMEOUT = 480.0

# The guest's writer: 512 KiB of new bytes in /dev/shm every half second
# (few enough that the bytes a migration sends vary by little more than
# that from run to run), a heartbeat each time, until the host writes GO2
# into vdb.
GO_TEST = '[ "$(dd if=/dev/vdb bs=512 count=1 iflag=direct 2>/dev/null | head -c 3)" = "GO2" ]'
WRITER = (
    "i=0; echo writer-start; until " + GO_TEST + "; do i=$((i+1)); "
    "dd if=/dev/urandom of=/dev/shm/dirty bs=64K count=8 conv=notrunc status=none; "
    "echo heartbeat-$i; sleep 0.5; done; echo writer-end-$i"
)
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
    disk's first WARM_MIB (LISTED.blocks).  Q: the (patched) QEMU whose
    qemu-img makes the overlays and that guests run on unless told."""

    q: QemuBuild
    image: Path
    raw: Path
    sha: str
    insp: Inspection
    listed: ListedFiles
    lst: Path
    accel: str


def make_base(d: Path, q: QemuBuild) -> Base:
    """The Base of the small golden image, its files in directory D."""
    image = golden.build_image("small").path
    raw = raw_copy(image, d / "small.raw")
    insp = inspect_image(image, "qcow2", raw.stat().st_size)
    files = regular_files(raw)
    assert len(files) >= 6, files
    want = {f: file_sha256(raw, f, d) for f in files}
    blocks = {s: h for s, h in nonzero_blocks(raw, 1 << 20).items() if s * 512 < WARM_MIB << 20}
    blocks.update({b * 8: h for b, h in nonzero_file_blocks(raw, files).items()})
    sha = content_sha256(raw)
    lst = d / "small.pcsl"
    make_list(sectorlist.ImageIdentity(raw.stat().st_size, sha, image.name), blocks, lst)
    accel, _ = choose_accel("auto", insp.kernel)
    return Base(q, image, raw, sha, insp, ListedFiles(files, want, blocks), lst, accel)


def migration_capabilities(q: QemuBuild) -> list[str]:
    """The migration capabilities this QEMU knows (query-migrate-capabilities)."""
    lines = [
        {"execute": "qmp_capabilities"},
        {"execute": "query-migrate-capabilities"},
        {"execute": "quit"},
    ]
    p = subprocess.run(
        [q.qemu_system, "-M", "none", "-nodefaults", "-display", "none", "-qmp", "stdio"],
        input="".join(json.dumps(x) + "\n" for x in lines),
        capture_output=True,
        text=True,
        timeout=60,
    )
    for line in p.stdout.splitlines():
        msg = json.loads(line)
        if isinstance(msg.get("return"), list):
            return [str(c["capability"]) for c in msg["return"]]
    raise AssertionError(f"no query-migrate-capabilities reply:\n{p.stdout}\n{p.stderr}")


def refs_supported(q: QemuBuild) -> bool:
    """Does this QEMU know the block-refs migration capability?"""
    return REFS in migration_capabilities(q)


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
        self.qmp.command(
            "migrate-set-capabilities", capabilities=[{"capability": REFS, "state": True}]
        )

    def exit_code(self, timeout: float = 60) -> int:
        """QEMU's exit code, once it exits (which it must, within TIMEOUT)."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.name} still runs:\n{self.log_text()[-2000:]}") from None

    def kill(self) -> None:
        kill_qemu(self.proc, self.qmp)


@dataclass
class Rig:
    """What a test starts (guests, page servers), killed by the fixture on
    every way out of the test.  MACHINE: every guest's machine type."""

    tmp: Path
    base: Base
    workload: Path
    go: Path
    markers: Markers
    machine: str = "q35"
    vms: list[Vm] = field(default_factory=list)
    servers: list[Server] = field(default_factory=list)

    def server(self, name: str, image: Path, lst: Path) -> Server:
        s = Server(self.tmp / f"server-{name}", [ImageSpec("small", image, list_file=lst)])
        self.servers.append(s)
        s.start()
        s.wait_generation("small", 1)
        return s

    def overlay(self) -> Path:
        return make_overlay(self.base.image, self.tmp / "ovl.qcow2", self.base.q.qemu_img)

    def vm(self, name: str, graph: Sequence[str], *extra: str, q: QemuBuild | None = None) -> Vm:
        """A guest of GRAPH (the -blockdev arguments of the overlay "ovl"
        and what is under it), the signal disk added, on QEMU build Q (the
        base's unless given); EXTRA: more QEMU arguments (-incoming ...)."""
        b = self.base
        serial, qmp, log = (self.tmp / f"{name}.{x}" for x in ("serial", "qmp", "log"))
        disks = [
            *graph,
            *signal_disk_blockdev(self.go),
            "-device",
            "virtio-blk-pci,drive=ovl,id=disk0",
            "-device",
            "virtio-blk-pci,drive=go,id=disk1",
        ]
        cmd = [
            *guest_cmd(
                q or b.q,
                b.insp,
                b.accel,
                serial=serial,
                qmp=qmp,
                workload=self.workload,
                disks=disks,
                machine=self.machine,
            ),
            *extra,
        ]
        proc = start_qemu(cmd, log)
        try:
            qm = QMP(qmp, timeout=30)
        except Exception:
            proc.kill()
            proc.wait()
            raise AssertionError(
                f"{name}: no QMP (rc {proc.returncode}):\n"
                + log.read_text(errors="replace")[-3000:]
            ) from None
        vm = Vm(name, proc, serial, log, qm)
        self.vms.append(vm)
        return vm

    def signal(self, word: bytes) -> None:
        signal_guest(self.go, word)

    def close(self) -> None:
        for vm in self.vms:
            vm.kill()
        for s in self.servers:
            s.stop(signal.SIGKILL)


def make_rig(tmp: Path, base: Base, command: str, *, machine: str = "q35") -> Rig:
    markers = Markers.new()
    wl = tmp / "workload.sh"
    wl.write_text(script(Workload(command), markers))
    go = make_signal_disk(tmp / "go.raw")
    return Rig(tmp, base, wl, go, markers, machine)


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
    management stack starts before `pageshare attach`, and what a QEMU
    without the series runs)."""
    nodes = [
        {"driver": "file", "node-name": "base-file", "filename": str(image), "read-only": True},
        {"driver": "qcow2", "node-name": "base", "file": "base-file", "read-only": True},
        {"driver": "file", "node-name": "ovl-file", "filename": str(ovl)},
        {"driver": "qcow2", "node-name": "ovl", "file": "ovl-file", "backing": "base"},
    ]
    return [a for n in nodes for a in ("-blockdev", json.dumps(n))]


def heartbeats(text: str) -> list[int]:
    return [int(n) for n in re.findall(r"^heartbeat-(\d+)\s*$", text, re.M)]


# --------------------------------------------------------------------------- migration


def wait_migration(
    src: Vm,
    during: Callable[[dict[str, Any]], None] | None = None,
    timeout: float = MIGRATION_TIMEOUT,
) -> dict[str, Any]:
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


def start_migration(
    src: Vm,
    dst: Vm,
    uri: str,
    *,
    refs: bool,
    dst_refs: bool | None = None,
    bandwidth: int = BANDWIDTH,
) -> None:
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
    assert info["status"] == "completed", (
        f"{info}\ndestination:\n{dst.log_text()[-3000:]}\nsource:\n{src.log_text()[-3000:]}"
    )
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
