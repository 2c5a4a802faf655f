"""`virsh migrate --live` of a libvirt domain whose filter `pageshare
libvirt-watch` attached, with nobody typing anything else: the libvirt hook
(analyzer/pageshare-libvirt-hook, as the pageshare package installs it in
/etc/libvirt/hooks/qemu.d/) puts the filter into the destination's QEMU
before the guest runs there, and block-refs is used when the source's
configuration says so.

Two of Debian's libvirtd (9.0) on this host, each in a mount namespace of
its own (libvirt_host.py: its own /etc/libvirt with the hook, /run/libvirt,
/var/lib/libvirt, /var/log/libvirt), each with its own host_uuid (libvirt
refuses to migrate to "the same host" otherwise) and migration ports, QEMU
as root without a security driver; one page server serves the small golden
image to both (copy mode: this host's kernel has no merge_pages), and the
domain's overlay is the same file on both sides (shared storage; --unsafe,
since libvirt cannot tell that a local file is shared).  Each host runs
libvirt-watch with its pageshare configuration (libvirt.toml, which the
hook reads too): host A with block_refs off, host B with it on.

The guest (a transient domain, `virsh create` on A) hashes listed files on
cue, once on each host, after dropping its caches: every hash must equal
the image's.  Checked:

1. on A, the watcher attaches the filter on the start event, sets
   block-refs off and marks the domain's metadata;
2. a migration to B whose hook cannot reach a page server is refused by
   the hook, with its reason in virsh's error; the guest runs on, on A;
3. A -> B (block-refs off): the hook attached the filter while B's QEMU was
   in "inmigrate" (its line in the domain's log), before the guest resumed
   (B's watcher, on RESUMED/MIGRATED, finds it already attached, and skipped
   STARTED/MIGRATED); A has no domain left, B runs it; B's filter serves
   the guest's reads there; B's watcher turns block-refs on (B's setting);
4. B -> A with block-refs: A's QEMU got `-global migration.block-refs=on`
   from the hook; every reference B's filter sent (read over the hook's
   private monitor on B the moment the migration completed, before libvirt
   ends that QEMU) was filled by A's filter (copied from the page server,
   or read from the base while the server verifies it again: each QEMU
   libvirt starts opens the base's file read-write for a moment, libvirt's
   auto-read-only, and the server withdraws its table until it has checked
   the image), which therefore existed when the RAM stream's setup section
   arrived; A's watcher turns block-refs off again (A's setting);
   Saved (`virsh save`) and restored there, the domain's QEMU gets none of
   the hook's arguments (a saved state flows in before any hook could add
   the filter) and the watcher attaches once it starts;
5. `pageshare detach --libvirt` on A turns block-refs off and removes the
   mark; the next migration to B is libvirt's own (the hook does nothing)
   and B's watcher attaches once the guest resumes there.
"""

from __future__ import annotations

import calendar
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from guest_phases import ListedFiles, hashes, list_files, phase, signal_guest, wait_for
from libvirt_host import (
    LIBVIRTD_CONF,
    QEMU_CONF,
    PrivateLibvirtd,
    WatchLog,
    direct_boot,
    disk,
    domain_xml,
    filter_stats,
    start_watcher,
)
from page_server_helpers import ImageSpec, Server, raw_copy
from pageshare import golden
from pageshare.analysis.workload import Markers, Workload, script
from pageshare.host.qmp import connect_unix
from pageshare.image.image_inspect import inspect_image
from pageshare_tools.qemu_guest import make_overlay, make_signal_disk
from qemu_helpers import qemu_build

pytestmark = pytest.mark.vm

REPO = Path(__file__).resolve().parents[2]
HOOK = REPO / "analyzer" / "pageshare-libvirt-hook"
DOMAIN = "ps-guest"
MIGRATION_TIMEOUT = 600
# each instance's range for the destination's incoming migration port
PORTS = {"a": 49300, "b": 49320}


@dataclass
class Host:
    """One private libvirtd, its pageshare configuration (libvirt.toml, for
    libvirt-watch and the hook) and its watcher."""

    name: str
    lv: PrivateLibvirtd
    conf: Path
    log: WatchLog
    err: Path
    watchers: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def configure(self, control: Path, block_refs: bool) -> None:
        self.conf.write_text(
            f'control = "{control}"\nmode = "copy"\n'
            f"block_refs = {'true' if block_refs else 'false'}\n"
        )

    def domain_log(self) -> str:
        return self.lv.domain_log(DOMAIN)

    def hook_lines(self) -> list[str]:
        return [ln for ln in self.domain_log().splitlines() if "pageshare libvirt-hook:" in ln]

    def domains(self) -> list[str]:
        return self.lv.virsh("list", "--all", "--name").stdout.split()

    def state(self) -> str:
        return self.lv.virsh("domstate", DOMAIN).stdout.strip()

    def dumpxml(self) -> str:
        return self.lv.virsh("dumpxml", DOMAIN).stdout


def install_hook(etc: Path, conf: Path) -> None:
    """The packaged hook, its pageshare the checkout's with this host's
    configuration (libvirtd runs hooks with a clean environment)."""
    etc.mkdir(parents=True, exist_ok=True)
    wrapper = etc / "pageshare-from-checkout"
    wrapper.write_text(
        f"#!/bin/sh\nexport PYTHONPATH={REPO / 'analyzer'}\n"
        f'cmd=$1; shift\nexec {sys.executable} -m pageshare.cli "$cmd" '
        f'--config {conf} "$@"\n'
    )
    wrapper.chmod(0o755)
    text = HOOK.read_text()
    assert "\nPAGESHARE=/usr/bin/pageshare\n" in text
    hook = etc / "hooks" / "qemu.d" / "pageshare"
    hook.parent.mkdir(parents=True)
    hook.write_text(text.replace("\nPAGESHARE=/usr/bin/pageshare\n", f"\nPAGESHARE={wrapper}\n"))
    hook.chmod(0o755)


def make_host(tmp: Path, name: str) -> Host:
    root = tmp / f"libvirt-{name}"
    conf = tmp / f"pageshare-{name}.toml"
    install_hook(root / "etc", conf)
    port = PORTS[name]
    lv = PrivateLibvirtd(
        root,
        QEMU_CONF + f"migration_port_min = {port}\nmigration_port_max = {port + 15}\n",
        LIBVIRTD_CONF + f'host_uuid = "{uuid.uuid4()}"\n',
    )
    return Host(name, lv, conf, WatchLog(tmp / f"watch-{name}.jsonl"), tmp / f"watch-{name}.err")


def migrate(src: Host, dst: Host) -> tuple[subprocess.CompletedProcess[str], float]:
    t0 = time.monotonic()
    p = subprocess.run(
        [
            "virsh",
            "-q",
            "-c",
            src.lv.uri,
            "migrate",
            "--live",
            "--p2p",
            "--unsafe",
            DOMAIN,
            dst.lv.uri.replace("qemu:///", "qemu+unix:///"),
            "--migrateuri",
            "tcp://127.0.0.1",
            "--listen-address",
            "127.0.0.1",
        ],
        capture_output=True,
        text=True,
        timeout=MIGRATION_TIMEOUT,
    )
    return p, time.monotonic() - t0


def serial_until(path: Path, marker: str, hosts: list[Host], timeout: float = 600) -> str:
    deadline = time.monotonic() + timeout
    text = ""
    while marker not in text:
        assert "Kernel panic" not in text, text[-3000:]
        assert time.monotonic() < deadline, f"no {marker}:\n{text[-3000:]}\n" + "\n".join(
            h.domain_log()[-2000:] for h in hosts
        )
        time.sleep(1)
        text = path.read_text(errors="replace") if path.exists() else ""
    return text


def hook_time(line: str) -> float:
    """The UTC time at the start of a line of the hook's, as epoch seconds."""
    m = re.match(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)\.(\d{3})\+0000: ", line)
    assert m, line
    return calendar.timegm(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1000


def qemu_cmdlines(uuid_: str) -> list[list[str]]:
    """The command lines of the QEMUs of this domain (-uuid) on this host."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            argv = (d / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if any(a == "-uuid" and argv[i + 1] == uuid_ for i, a in enumerate(argv[:-1])):
            out.append(argv)
    return out


def the_qemu(uuid_: str) -> list[str]:
    """The command line of the domain's QEMU once the migration's source
    has gone: a migration's destination, started with -incoming."""
    deadline = time.monotonic() + 60
    while len(found := qemu_cmdlines(uuid_)) != 1:
        assert time.monotonic() < deadline, found
        time.sleep(0.5)
    assert "-incoming" in found[0], found
    return found[0]


def check_arrival(dst: Host, src: Host, after: int, refs: bool) -> tuple[int, str]:
    """What every migration must leave behind: the domain runs on DST only,
    the hook attached the filter while DST's QEMU was still incoming, and
    that was before the guest resumed (DST's watcher found it attached and
    did nothing while libvirt held the domain).  Returns the watcher's
    record count and the filter's node name."""
    assert DOMAIN not in src.domains(), src.domains()
    assert dst.state() == "running"
    lines = dst.hook_lines()
    begin = [ln for ln in lines if "migrating in: its QEMU gets the monitor" in ln]
    assert begin and (" and block-refs on" in begin[-1]) == refs, lines
    done = [ln for ln in lines if re.search(r"migrating in: \S+ attached \(filter ", ln)]
    assert done, lines
    assert done[-1].endswith(f"before the guest runs here; block-refs {'on' if refs else 'off'}")
    n, note = dst.log.wait(DOMAIN, "started-migrated", after)
    assert note["action"] == "note", note
    n, r = dst.log.wait(DOMAIN, "resumed-migrated", n)
    assert r["ok"], r
    (d,) = r["drives"]
    assert d["result"] == "already-attached", d  # the hook's filter
    assert hook_time(done[-1]) < r["time"], (done[-1], r["time"])
    assert [x for x in dst.log.records()[after:] if x["event"] == "started"] == []
    m = re.search(r"attached \(filter (\S+?)[,)]", done[-1])
    assert m and m.group(1) == d["filter"], (done[-1], d)
    return n, d["filter"]


class MigrationWatch:
    """On the source of a migration, over the hook's private monitor: the
    migration's statistics and the filter's counters at the moment it
    completes.  libvirt ends the source's QEMU soon after that moment
    (Finish on the destination, then Confirm here), so the watch does not
    poll: it waits for QEMU's MIGRATION event and asks for both at once in
    one write, which QEMU answers before it reads another command.  (A
    poll every 20 ms lost that race in CI once: the QEMU had gone before
    the next query.)  The connection is made before the migration starts,
    so every MIGRATION event it sees is this migration's, not the incoming
    one that brought the guest here."""

    def __init__(self, sock: Path, node: str) -> None:
        self.node = node
        self.s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.s.settimeout(30)
        connect_unix(self.s, sock)
        self.buf = b""
        self.statuses: list[str] = []
        assert "QMP" in self.message(30), "no QMP greeting"
        self.execute(["qmp_capabilities"])
        # libvirt turns migration events on; turned on here too so that
        # the watch does not depend on it
        self.execute(
            ["migrate-set-capabilities"],
            capabilities=[{"capability": "events", "state": True}],
        )

    def message(self, timeout: float) -> dict[str, Any]:
        """The next message from QEMU; {} when none came within TIMEOUT."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return {}
            self.s.settimeout(left)
            try:
                chunk = self.s.recv(65536)
            except TimeoutError:
                return {}
            if not chunk:
                raise EOFError(f"QEMU closed its monitor; migration statuses seen: {self.statuses}")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        msg: dict[str, Any] = json.loads(line)
        return msg

    def execute(self, names: list[str], **args: Any) -> list[Any]:
        """Sends the commands NAMES in one write (ARGS go to the last) and
        returns their answers in order."""
        msgs: list[dict[str, Any]] = [{"execute": n} for n in names]
        if args:
            msgs[-1]["arguments"] = args
        self.s.sendall(b"".join(json.dumps(m).encode() + b"\n" for m in msgs))
        out: list[Any] = []
        while len(out) < len(names):
            msg = self.message(30)
            assert msg, f"QEMU did not answer {names} within 30 s"
            if "event" in msg:
                self.note(msg)
                continue
            assert "error" not in msg, (names, msg)
            out.append(msg["return"])
        return out

    def note(self, msg: dict[str, Any]) -> None:
        if msg["event"] == "MIGRATION":
            self.statuses.append(msg["data"]["status"])

    def watch(self, stop: list[bool]) -> dict[str, Any]:
        while not stop:
            msg = self.message(0.2)
            if msg.get("event") != "MIGRATION":
                continue
            self.note(msg)
            status = msg["data"]["status"]
            if status == "completed":
                info, stats = self.execute(
                    ["query-migrate", "query-blockstats"], **{"query-nodes": True}
                )
                for s in stats:
                    if s.get("node-name") == self.node:
                        return {"migrate": info, "filter": s["driver-specific"]}
                raise AssertionError(f"no node {self.node}")
            if status in ("failed", "cancelled"):
                return {"migrate": {"status": status}}
        return {"statuses": self.statuses}

    def close(self) -> None:
        self.s.close()


def test_virsh_migrate_live_puts_the_filter_in_place_first(
    tmp_path: Path, qemu_guard: None
) -> None:
    q = qemu_build()
    image = golden.build_image("small").path
    raw = raw_copy(image, tmp_path / "small.raw")
    insp = inspect_image(image, "qcow2", raw.stat().st_size)
    lst = tmp_path / "small.pcsl"
    listed: ListedFiles = list_files(image, raw, lst, tmp_path)

    markers = Markers.new()
    wl = tmp_path / "workload.sh"
    wl.write_text(
        script(
            Workload(
                "; ".join(
                    [
                        wait_for("GO1"),
                        phase(listed.files, "on-a"),
                        wait_for("GO2"),
                        phase(listed.files, "on-b"),
                        wait_for("GO3"),
                        phase(listed.files, "back-on-a"),
                        "sleep 1",
                    ]
                )
            ),
            markers,
        )
    )
    ovl, go = tmp_path / "ovl.qcow2", tmp_path / "go.raw"
    make_overlay(image, ovl)
    make_signal_disk(go)
    serial = tmp_path / "serial.log"
    boot = direct_boot(insp)
    xml = tmp_path / "guest.xml"
    xml.write_text(
        domain_xml(
            DOMAIN,
            q.qemu_system,
            [disk(ovl, "qcow2", "vda"), disk(go, "raw", "vdb")],
            serial,
            boot,
            wl,
            serial_append=True,
        )
    )

    server = Server(tmp_path / "server", [ImageSpec("small", image, list_file=lst)])
    a, b = make_host(tmp_path, "a"), make_host(tmp_path, "b")
    hosts = [a, b]
    a.configure(server.control, block_refs=False)
    b.configure(server.control, block_refs=True)
    server.start()
    try:
        server.wait_generation("small", 1)
        for h in hosts:
            h.lv.start()
            h.watchers.append(start_watcher(h.lv.uri, h.log.path, h.err, "--config", str(h.conf)))

        # 1. started on A: attached on the start event, block-refs off, marked
        a.lv.virsh("create", str(xml))
        dom_uuid = a.lv.virsh("domuuid", DOMAIN).stdout.strip()
        na, r = a.log.wait(DOMAIN, "started")
        assert r["ok"] and r["drives"][0]["result"] == "attached", r
        assert r["migration"] == {"block-refs": False}, r
        assert 'block-refs="off"' in a.dumpxml(), a.dumpxml()
        signal_guest(go, b"GO1")
        text = serial_until(serial, "on-a-end", hosts)
        assert hashes(text, "on-a") == listed.want
        st = filter_stats(a.lv, DOMAIN, r["drives"][0]["filter"])
        assert st["merged"] > 0, st

        # 2. B's hook finds no page server: the migration is refused, the
        # guest runs on on A
        b.configure(tmp_path / "nowhere.sock", block_refs=True)
        p, took = migrate(a, b)
        print(f"refused migration: rc {p.returncode} after {took:.1f} s: {p.stderr.strip()}")
        assert p.returncode != 0, p.stdout
        assert "no pageshare-server answers" in p.stderr, p.stderr
        assert "the guest keeps running on the source" in p.stderr, p.stderr
        assert a.state() == "running" and DOMAIN not in b.domains()
        b.configure(server.control, block_refs=True)

        # 3. A -> B, block-refs off (A's setting)
        nb = len(b.log.records())
        p, took = migrate(a, b)
        assert p.returncode == 0, p.stderr + b.domain_log()[-3000:]
        nb, node_b = check_arrival(b, a, nb, refs=False)
        argv = the_qemu(dom_uuid)
        assert "chardev=pageshare-qmp,mode=control" in argv, argv
        assert "migration.block-refs=on" not in argv, argv
        st_b = filter_stats(b.lv, DOMAIN, node_b)
        print(f"A -> B: {took:.1f} s; B's filter on arrival: {st_b}")
        assert st_b["migration-refs-copied"] + st_b["migration-refs-read"] == 0, st_b
        # B's watcher gave it B's setting for its next migration
        _, r = b.log.wait(DOMAIN, "resumed-migrated", nb - 1)
        assert r["migration"] == {"block-refs": True}, r
        assert 'block-refs="on"' in b.dumpxml(), b.dumpxml()
        signal_guest(go, b"GO2")
        text = serial_until(serial, "on-b-end", hosts)
        assert hashes(text, "on-b") == listed.want
        st_b = filter_stats(b.lv, DOMAIN, node_b)
        print(f"B's filter after the guest's reads there: {st_b}")
        assert st_b["merged"] > 0 and st_b["connected"], st_b  # it serves the guest
        assert st_b["fallback-unproven"] == 0 and not st_b["base-changed"], st_b

        # 4. B -> A with block-refs; B's counters over the hook's monitor
        sock_b = b.lv.root / "lib" / "qemu" / f"pageshare-{dom_uuid}.qmp"
        assert sock_b.exists(), sorted((b.lv.root / "lib" / "qemu").iterdir())
        na = len(a.log.records())
        stop: list[bool] = []
        seen: dict[str, Any] = {}
        watcher = MigrationWatch(sock_b, node_b)

        def watch() -> None:
            try:
                seen.update(watcher.watch(stop))
            except Exception as e:
                seen["error"] = f"{type(e).__name__}: {e}"

        t = threading.Thread(target=watch)
        t.start()
        try:
            p, took = migrate(b, a)
        finally:
            stop.append(True)
            t.join(60)
            watcher.close()
        assert p.returncode == 0, p.stderr + a.domain_log()[-3000:]
        na, node_a = check_arrival(a, b, na, refs=True)
        argv = the_qemu(dom_uuid)
        assert "migration.block-refs=on" in argv, argv
        assert "filter" in seen, seen
        sent, info = seen["filter"], seen["migrate"]
        st_a = filter_stats(a.lv, DOMAIN, node_a)
        print(
            f"B -> A: {took:.1f} s; source: {json.dumps(info)}\nB's filter: {sent}\n"
            f"A's filter on arrival: {st_a}"
        )
        assert info["ram"]["block-ref-pages"] > 0, info
        assert sent["migration-refs-sent"] > 0, sent
        received = st_a["migration-refs-copied"] + st_a["migration-refs-read"]
        assert received == sent["migration-refs-sent"], (sent, st_a)
        assert st_a["migration-refs-merged"] == 0 and st_a["migration-refs-failed"] == 0, st_a
        _, r = a.log.wait(DOMAIN, "resumed-migrated", na - 1)
        assert r["migration"] == {"block-refs": False}, r  # A's setting again
        assert 'block-refs="off"' in a.dumpxml(), a.dumpxml()
        signal_guest(go, b"GO3")
        text = serial_until(serial, markers.ready, hosts)
        assert hashes(text, "back-on-a") == listed.want
        assert f"{markers.ready} rc=0" in text
        st_a = filter_stats(a.lv, DOMAIN, node_a)
        print(f"A's filter at the end: {st_a}")
        assert st_a["merged"] > 0, st_a

        # 4b. saved and restored on A (block-refs off there): the hook takes
        # its arguments out of the restored QEMU, the watcher attaches again
        saved = tmp_path / "guest.save"
        a.lv.virsh("save", DOMAIN, str(saved))
        na = len(a.log.records())
        t0 = time.monotonic()
        a.lv.virsh("restore", str(saved))
        took = time.monotonic() - t0
        assert a.hook_lines()[-1].endswith(
            "restoring: pageshare's QEMU arguments removed "
            "(libvirt-watch attaches on the start event)"
        )
        argv = the_qemu(dom_uuid)
        assert not [x for x in argv if "pageshare-qmp" in x or "block-refs" in x], argv
        _, r = a.log.wait(DOMAIN, "started", na)
        assert r["ok"] and r["drives"][0]["result"] == "attached", r
        assert r["migration"] == {"block-refs": False}, r
        assert a.state() == "running"
        print(f"saved and restored on A: restore {took:.1f} s, attached after it")

        # 5. detached on A (block-refs on by hand first): block-refs off and
        # the mark gone; the next migration is libvirt's own, and B's watcher
        # attaches once the guest resumes there
        a.lv.virsh(
            "qemu-monitor-command",
            DOMAIN,
            json.dumps(
                {
                    "execute": "migrate-set-capabilities",
                    "arguments": {"capabilities": [{"capability": "block-refs", "state": True}]},
                }
            ),
        )
        p = subprocess.run(
            [
                sys.executable,
                "-m",
                "pageshare.cli",
                "detach",
                "--libvirt",
                DOMAIN,
                "--connect",
                a.lv.uri,
                "--json",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            env=dict(os.environ, PYTHONPATH=str(REPO / "analyzer")),
        )
        assert p.returncode == 0, p.stdout + p.stderr
        r = json.loads(p.stdout)
        assert r["drives"][0]["result"] == "detached" and r["block_refs"] == "turned off", r
        caps = json.loads(
            a.lv.virsh(
                "qemu-monitor-command",
                DOMAIN,
                json.dumps({"execute": "query-migrate-capabilities"}),
            ).stdout
        )["return"]
        assert {"capability": "block-refs", "state": False} in caps, caps
        assert "pageshare:filter" not in a.dumpxml(), a.dumpxml()
        nb, lines = len(b.log.records()), len(b.hook_lines())
        p, took = migrate(a, b)
        assert p.returncode == 0, p.stderr + b.domain_log()[-3000:]
        assert DOMAIN not in a.domains() and b.state() == "running"
        assert len(b.hook_lines()) == lines, b.hook_lines()  # nothing for the hook
        argv = the_qemu(dom_uuid)
        assert not [x for x in argv if "pageshare-qmp" in x or "block-refs" in x], argv
        _, r = b.log.wait(DOMAIN, "resumed-migrated", nb)
        assert r["ok"] and r["drives"][0]["result"] == "attached", r
        print(
            f"detached, A -> B: {took:.1f} s; attached on B once it resumed: "
            f"{r['drives'][0]['reads_before']}"
        )

        for h in hosts:
            h.watchers[0].send_signal(signal.SIGTERM)
            assert h.watchers[0].wait(30) == 0, h.err.read_text()
            assert "Traceback" not in h.err.read_text(), h.err.read_text()
    finally:
        for h in hosts:
            for w in h.watchers:
                if w.poll() is None:
                    w.kill()
                    w.wait()
        for h in hosts:
            with contextlib.suppress(Exception):
                h.lv.stop()
        server.stop(signal.SIGKILL)
