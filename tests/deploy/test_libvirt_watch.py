"""VMs that libvirt starts get the filter at every start, with nobody typing
a command: Debian's libvirtd (in a mount namespace of its own,
see libvirt_host.py), a domain XML as an operator writes it (a qcow2
overlay of the small golden image, the patched QEMU as <emulator>), `virsh
start`, and `pageshare libvirt-watch` listening to libvirt's events.

Checked from outside: the watcher attaches the filter when the domain
starts, through libvirt (libvirtd holds the QMP socket), and reports how
much the guest read before; the guest then hashes listed files, each equal
to the image's, with the filter copying listed blocks into its RAM (copy
mode: this host's kernel has no merge_pages); a domain whose base the
server does not serve is left running, with a line that says why; a second
start is attached again; a restarted watcher finds the running domains
already attached; SIGTERM ends the watcher.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from guest_phases import hashes, list_files, phase, signal_guest, wait_for
from libvirt_host import (
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
from pageshare.image.image_inspect import inspect_image
from pageshare_tools.qemu_guest import make_overlay, make_signal_disk
from qemu_helpers import qemu_build

REPO = Path(__file__).resolve().parents[2]
# capability(7) numbers of the names the server's unit keeps
CAP_NUMBERS = {"CAP_DAC_READ_SEARCH": 2}


def unit_caps() -> set[int]:
    """The capabilities pageshare-server.service leaves the server (root)."""
    unit = (REPO / "page-server" / "pageshare-server.service").read_text()
    (line,) = [ln for ln in unit.splitlines() if ln.startswith("CapabilityBoundingSet=")]
    return {CAP_NUMBERS[c] for c in line.split("=", 1)[1].split()}


def qemu_caps(domain: str) -> set[int]:
    """The effective capabilities of a domain's QEMU.  libvirt (Debian 12's
    9.0) leaves a QEMU run as root all of root's, despite qemu.conf's
    clear_emulator_capabilities (on by default): so a root QEMU covers the
    unit's server, and the kernel lets it read the server's memory
    (docs/install.md, "QEMU's user")."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        if f"guest={domain}".encode() in (a.split(b",")[0] for a in argv):
            (eff,) = [ln.split()[1] for ln in status.splitlines() if ln.startswith("CapEff:")]
            return {b for b in range(64) if int(eff, 16) >> b & 1}
    raise AssertionError(f"no QEMU of {domain}")


pytestmark = pytest.mark.vm


def test_libvirt_domains_get_the_filter_at_every_start(tmp_path: Path) -> None:
    q = qemu_build()
    image = golden.build_image("small").path
    raw = raw_copy(image, tmp_path / "small.raw")
    insp = inspect_image(image, "qcow2", raw.stat().st_size)
    lst = tmp_path / "small.pcsl"
    listed = list_files(image, raw, lst, tmp_path)

    # the guest: boot, wait for GO, hash the listed files, power off
    markers = Markers.new()
    wl = tmp_path / "workload.sh"
    wl.write_text(
        script(
            Workload("; ".join([wait_for("GO"), phase(listed.files, "attached"), "sleep 2"])),
            markers,
        )
    )
    ovl, go = tmp_path / "ovl.qcow2", tmp_path / "go.raw"
    make_overlay(image, ovl)
    make_signal_disk(go)
    serial = tmp_path / "serial.log"
    boot = direct_boot(insp)
    guest = domain_xml(
        "ps-guest",
        q.qemu_system,
        [disk(ovl, "qcow2", "vda"), disk(go, "raw", "vdb")],
        serial,
        boot,
        wl,
    )
    # a VM over a base nobody serves: it never boots anything (no OS on it)
    other_base, other_ovl = tmp_path / "other.raw", tmp_path / "other.qcow2"
    other_base.write_bytes(os.urandom(1 << 20) * 16)
    subprocess.run(
        [
            "qemu-img",
            "create",
            "-q",
            "-f",
            "qcow2",
            "-b",
            str(other_base),
            "-F",
            "raw",
            str(other_ovl),
        ],
        check=True,
    )
    other = domain_xml(
        "ps-other", q.qemu_system, [disk(other_ovl, "qcow2", "vda")], tmp_path / "other-serial.log"
    )

    server = Server(tmp_path / "server", [ImageSpec("small", image, list_file=lst)])
    lv = PrivateLibvirtd(tmp_path / "libvirt")
    watchers: list[subprocess.Popen[bytes]] = []
    out, err = tmp_path / "watch.jsonl", tmp_path / "watch.err"
    watch_args = ("--control", str(server.control), "--mode", "copy")
    log = WatchLog(out)
    server.start()
    try:
        server.wait_generation("small", 1)
        lv.start()
        for name, xml in (("ps-guest", guest), ("ps-other", other)):
            (tmp_path / f"{name}.xml").write_text(xml)
            lv.virsh("define", str(tmp_path / f"{name}.xml"))
        watchers.append(start_watcher(lv.uri, out, err, *watch_args))

        def boot_and_check(after: int) -> int:
            serial.unlink(missing_ok=True)
            signal_guest(go, bytes(8))
            lv.virsh("start", "ps-guest")
            after, r = log.wait("ps-guest", "started", after)
            assert r["ok"], r
            (d,) = r["drives"]  # vdb's raw image has no base
            assert d["result"] == "attached" and d["method"] == "blockdev-reopen", d
            assert d["overlay"].startswith("libvirt-"), d  # libvirt's own node names
            assert d["reads_before"]["rd_operations"] >= 0, d
            # the filter sits in the running domain, seen through libvirt
            assert filter_stats(lv, "ps-guest", d["filter"])["connected"]
            assert unit_caps() <= qemu_caps("ps-guest"), "QEMU cannot read the unit's server"
            signal_guest(go, b"GO")
            deadline = time.monotonic() + 600
            text = ""
            while "attached-end" not in text:
                assert time.monotonic() < deadline, text[-3000:] + lv.domain_log("ps-guest")
                assert "Kernel panic" not in text, text[-3000:]
                time.sleep(1)
                text = serial.read_text(errors="replace") if serial.exists() else ""
            assert hashes(text, "attached") == listed.want
            st = filter_stats(lv, "ps-guest", d["filter"])
            print(f"reads before attach: {d['reads_before']}; filter: {st}")
            assert st["merged"] > len(listed.blocks) // 2, st  # copied into guest RAM
            assert st["fallback-unproven"] == 0 and not st["base-changed"], st
            return after

        after = boot_and_check(0)

        lv.virsh("start", "ps-other")
        _, r = log.wait("ps-other", "started")
        assert not r["ok"] and r["drives"][0]["result"] == "skipped", r
        assert r["drives"][0]["error"]["kind"] == "not-served", r
        assert lv.virsh("domstate", "ps-other").stdout.strip() == "running"

        # every start, not only the first
        lv.virsh("destroy", "ps-guest")
        after = boot_and_check(after)

        # a restarted watcher finds the running domains: attached, or not served
        watchers[0].send_signal(signal.SIGTERM)
        assert watchers[0].wait(30) == 0, err.read_text()
        n = len(log.records())
        watchers.append(start_watcher(lv.uri, out, err, *watch_args))
        _, r = log.wait("ps-guest", "running", n)
        assert r["ok"] and r["drives"][0]["result"] == "already-attached", r
        _, r = log.wait("ps-other", "running", n)
        assert r["drives"][0]["result"] == "skipped", r
        assert lv.virsh("domstate", "ps-other").stdout.strip() == "running"
        watchers[1].send_signal(signal.SIGTERM)
        assert watchers[1].wait(30) == 0, err.read_text()
        assert "Traceback" not in err.read_text(), err.read_text()
    finally:
        for w in watchers:
            if w.poll() is None:
                w.kill()
                w.wait()
        lv.stop()
        server.stop(signal.SIGKILL)
