"""`pageshare attach` and `detach` on a booted guest, as an operator would
use them on a VM that a management stack started: the small golden image
boots (its own kernel, TCG here) from a qcow2 overlay over the base, all
-blockdev JSON on the command line with no pageshare node.  The guest hashes
a set of binaries and libraries three times, each time after dropping its
caches: before attach (from disk), while attached (listed blocks copied
into guest RAM by the filter, copy mode: what runs on a stock kernel) and
after detach (from disk again).  Every hash must equal the image's.  The
host tells the guest to go on by writing into a small second disk that the
guest polls with O_DIRECT reads.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from guest_phases import file_blocks, hashes, list_files, phase, signal_guest, wait_for
from page_server_helpers import ImageSpec, Server, raw_copy
from pageshare import golden
from pageshare.analysis.vm import choose_accel
from pageshare.analysis.workload import Markers, Workload, script
from pageshare.host.qmp import QMP
from pageshare.image.image_inspect import inspect_image
from pageshare_tools.qemu_guest import (
    make_overlay,
    make_signal_disk,
    signal_disk_blockdev,
    start_qemu,
)
from qemu_helpers import guest_cmd, qemu_build, serial_until

pytestmark = pytest.mark.build

assert os.geteuid() == 0, "copy mode reads the page server's memory: run as root"

REPO = Path(__file__).resolve().parents[2]


def pageshare(*args: str) -> tuple[int, dict[str, Any]]:
    env = dict(os.environ, PYTHONPATH=str(REPO / "analyzer"))
    p = subprocess.run(
        [sys.executable, "-m", "pageshare.cli", *args, "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert "Traceback" not in p.stderr, p.stderr
    data: dict[str, Any] = json.loads(p.stdout)
    assert data["exit_code"] == p.returncode
    return p.returncode, data


@pytest.mark.vm
def test_attach_and_detach_a_booted_guest(tmp_path: Path) -> None:
    q = qemu_build()
    image = golden.build_image("small").path
    raw = raw_copy(image, tmp_path / "small.raw")
    insp = inspect_image(image, "qcow2", raw.stat().st_size)
    lst = tmp_path / "small.pcsl"
    listed = list_files(image, raw, lst, tmp_path)
    files, want, blocks = listed.files, listed.want, listed.blocks

    server = Server(tmp_path / "server", [ImageSpec("small", image, list_file=lst)])
    server.start()
    proc = None
    try:
        server.wait_generation("small", 1)
        ovl = tmp_path / "ovl.qcow2"
        make_overlay(image, ovl)
        signal_disk = make_signal_disk(tmp_path / "go.raw")

        markers = Markers.new()
        command = "; ".join(
            [
                phase(files, "before"),
                wait_for("GO1"),
                phase(files, "attached"),
                wait_for("GO2"),
                phase(files, "detached"),
            ]
        )
        wl = tmp_path / "workload.sh"
        wl.write_text(script(Workload(command), markers))
        accel, _ = choose_accel("auto", insp.kernel)
        serial = tmp_path / "serial.log"
        qmp_path, test_qmp = tmp_path / "vm.qmp", tmp_path / "test.qmp"
        nodes = [
            {"driver": "file", "node-name": "base-file", "filename": str(image), "read-only": True},
            {"driver": "qcow2", "node-name": "base", "file": "base-file", "read-only": True},
            {"driver": "file", "node-name": "ovl-file", "filename": str(ovl)},
            {
                "driver": "qcow2",
                "node-name": "ovl",
                "file": "ovl-file",
                "backing": "base",
                "discard": "unmap",
            },
        ]
        cmd = guest_cmd(
            q,
            insp,
            accel,
            serial=serial,
            qmp=qmp_path,
            more_qmp=[test_qmp],
            workload=wl,
            disks=[
                *(a for n in nodes for a in ("-blockdev", json.dumps(n))),
                *signal_disk_blockdev(signal_disk),
                "-device",
                "virtio-blk-pci,drive=ovl,id=disk0",
                "-device",
                "virtio-blk-pci,drive=go,id=disk1",
            ],
        )
        qlog = tmp_path / "qemu.log"
        proc = start_qemu(cmd, qlog)
        qmp = QMP(test_qmp, timeout=30)

        def go(word: bytes) -> None:
            signal_guest(signal_disk, word)

        text = serial_until(proc, serial, qlog, "before-end")
        assert hashes(text, "before") == want

        rc, data = pageshare(
            "attach", str(qmp_path), "--control", str(server.control), "--mode", "copy"
        )
        assert rc == 0, data
        by = {d["drive"]: d for d in data["drives"]}
        assert set(by) == {"disk0"}, data  # the signal disk has no base
        d = by["disk0"]
        assert d["result"] == "attached" and d["overlay"] == "ovl" and d["base"] == "base", d
        assert d["method"] == "blockdev-reopen", d  # its -blockdev JSON is on the cmdline
        # the boot and the first hashes went to disk, through the guest's device
        rb = d["reads_before"]
        assert rb["devices"] == ["disk0"] and rb["rd_operations"] > 100, rb
        assert rb["rd_bytes"] >= sum(len(file_blocks(raw, f)) for f in files) * 4096, rb
        st0 = d["stats"]
        assert st0["connected"] and st0["table-entries"] == len(blocks), st0
        assert st0["merged"] == 0, st0

        go(b"GO1")
        text = serial_until(proc, serial, qlog, "attached-end")
        assert hashes(text, "attached") == want
        st = {
            s["node-name"]: s.get("driver-specific")
            for s in qmp.command("query-blockstats", **{"query-nodes": True})
            if s.get("node-name")
        }
        ps = st[d["filter"]]
        assert ps is not None
        print(f"reads before attach: {rb}; filter while attached: {ps}")
        # the guest's reads of the files put listed blocks into its RAM
        assert ps["merged"] > len(blocks) // 2, ps
        assert ps["fallback-not-guest-ram"] < ps["merged"] // 10, ps
        assert ps["fallback-unproven"] == 0 and not ps["base-changed"], ps

        rc, data = pageshare("detach", str(qmp_path))
        assert rc == 0, data
        (dd,) = [x for x in data["drives"] if x["drive"] == "disk0"]
        assert dd["result"] == "detached" and dd["stats"]["merged"] >= ps["merged"], dd
        names = [n["node-name"] for n in qmp.command("query-named-block-nodes", flat=True)]
        assert d["filter"] not in names

        go(b"GO2")
        text = serial_until(proc, serial, qlog, markers.ready)
        assert hashes(text, "detached") == want
        assert f"{markers.ready} rc=0" in text
        qmp.command("quit")
        proc.wait(30)
    finally:
        if proc and proc.poll() is None:
            proc.kill()
            proc.wait()
        server.stop(signal.SIGKILL)
