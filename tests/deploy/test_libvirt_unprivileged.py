"""QEMU as Debian's libvirt runs it by default: the unprivileged libvirt-qemu user.

libvirtd (tests/libvirt_host.py) with Debian's qemu.conf defaults: QEMU runs
as libvirt's own user and group, and the DAC security driver chowns each
domain's images to them at start.  The filter reads the page server's
memory (process_vm_readv in copy mode, merge_pages in merge mode), which
the kernel allows only to the server's own user and group (or root), so
the server runs as QEMU's user and group with no capability (the kernel
also wants the reader's capabilities to cover the target's): what
page-server/examples/unprivileged-qemu.conf, a drop-in for its unit, does.
Everything the domain touches lives in a directory QEMU's user can reach,
as /var/lib/libvirt/images is on a host.

Checked from outside, in the order a host runs things (the server first,
then `virsh start`, then the filter attached through libvirt): QEMU really
runs unprivileged; the guest reads every listed file with the image's bytes
and the filter copies listed blocks into its RAM; `pageshare detach
--libvirt` takes the filter out again and the guest reads the same bytes
from disk.  Then the same domain
with the server run as root (its sockets opened to everyone, so QEMU can
connect): `pageshare host check` warns that the guest may not read the
server, QEMU says so once in its log with what to do, and reads every block
from disk with the right bytes.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from guest_phases import hashes, list_files, phase, signal_guest, wait_for
from libvirt_host import QEMU_CONF_UNPRIVILEGED, PrivateLibvirtd, disk, domain_xml, filter_stats
from page_server_helpers import ImageSpec, Server, raw_copy
from pageshare import golden
from pageshare.analysis.workload import Markers, Workload, kernel_cmdline, script
from pageshare.image.image_inspect import inspect_image
from pageshare_tools.qemu_guest import make_overlay, make_signal_disk
from qemu_helpers import qemu_build

pytestmark = pytest.mark.vm

REPO = Path(__file__).resolve().parents[2]
DOMAIN = "ps-unpriv"


@pytest.fixture
def world_dir() -> Iterator[Path]:
    """A directory QEMU's user can reach (tmp_path is under root's 0700 tree)."""
    d = Path(tempfile.mkdtemp(prefix="pageshare-unpriv-", dir="/var/tmp"))
    d.chmod(0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def dac_label(lv: PrivateLibvirtd) -> tuple[int, int]:
    """uid and gid libvirt runs QEMU as (its DAC base label, `+uid:+gid`)."""
    caps = lv.virsh("capabilities").stdout
    m = re.search(
        r"<model>dac</model>.*?<baselabel type='qemu'>\+(\d+):\+(\d+)</baselabel>", caps, re.S
    )
    assert m, caps
    return int(m.group(1)), int(m.group(2))


def qemu_creds(name: str) -> tuple[int, int]:
    pid = subprocess.run(
        ["pgrep", "-f", f"guest={name}"], capture_output=True, text=True, check=True
    ).stdout.split()[0]
    status = Path(f"/proc/{pid}/status").read_text()
    uid = int(re.search(r"^Uid:\s+(\d+)", status, re.M).group(1))  # type: ignore[union-attr]
    gid = int(re.search(r"^Gid:\s+(\d+)", status, re.M).group(1))  # type: ignore[union-attr]
    return uid, gid


def pageshare(*args: str) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(REPO / "analyzer"))
    p = subprocess.run(
        [sys.executable, "-m", "pageshare.cli", *args, "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    r: dict[str, Any] = json.loads(p.stdout)
    return r


def attach(lv: PrivateLibvirtd, control: Path) -> dict[str, Any]:
    return pageshare(
        "attach",
        "--libvirt",
        DOMAIN,
        "--connect",
        lv.uri,
        "--control",
        str(control),
        "--mode",
        "copy",
    )


def detach(lv: PrivateLibvirtd) -> dict[str, Any]:
    return pageshare("detach", "--libvirt", DOMAIN, "--connect", lv.uri)


def host_check_refusals(control: Path) -> list[dict[str, Any]]:
    """`pageshare host check`'s findings that a guest may not read the server."""
    env = dict(os.environ, PYTHONPATH=str(REPO / "analyzer"))
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "pageshare.cli",
            "host",
            "check",
            "--json",
            "--control",
            str(control),
            "--skip",
            "kernel",
            "--skip",
            "ksm",
            "--skip",
            "qemu",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    findings: list[dict[str, Any]] = json.loads(p.stdout)["findings"]
    return [f for f in findings if "may not read pageshare-server's memory" in f["what"]]


def test_an_unprivileged_qemu_reads_from_a_server_of_its_own_user(
    tmp_path: Path, world_dir: Path
) -> None:
    w = world_dir
    q = qemu_build()
    # The patched QEMU where QEMU's user can execute it (an install would
    # put it in /usr/lib/pageshare-qemu).
    qemu_dir = w / "qemu"
    shutil.copytree(q.dir, qemu_dir, symlinks=True)
    emulator = qemu_dir / "bin" / "qemu-system-x86_64"
    golden_image = golden.build_image("small").path
    image = w / "small.qcow2"
    subprocess.run(["cp", "--sparse=always", str(golden_image), str(image)], check=True)
    raw = raw_copy(image, tmp_path / "small.raw")
    insp = inspect_image(golden_image, "qcow2", raw.stat().st_size)
    lst = w / "small.pcsl"
    listed = list_files(image, raw, lst, tmp_path)
    boot = {
        "kernel": str(shutil.copy2(insp.kernel, w / "vmlinuz")),
        "cmdline": kernel_cmdline(insp.info.root_uuid),
    }
    if insp.initrd:
        boot["initrd"] = str(shutil.copy2(insp.initrd, w / "initrd.img"))

    markers = Markers.new()
    wl = w / "workload.sh"
    wl.write_text(
        script(
            Workload(
                "; ".join(
                    [
                        wait_for("GO"),
                        phase(listed.files, "run"),
                        wait_for("G2"),
                        phase(listed.files, "after"),
                        "sleep 2",
                    ]
                )
            ),
            markers,
        )
    )
    ovl, go, serial = w / "ovl.qcow2", w / "go.raw", w / "serial.log"
    lv = PrivateLibvirtd(tmp_path / "libvirt", qemu_conf=QEMU_CONF_UNPRIVILEGED)
    servers: list[Server] = []
    refusals: list[list[dict[str, Any]]] = []

    def run_guest(server: Server) -> tuple[dict[str, Any], dict[str, Any]]:
        """Start the domain, attach the filter, let the guest hash the files."""
        ovl.unlink(missing_ok=True)
        make_overlay(image, ovl)
        make_signal_disk(go)
        serial.write_text("")
        xml = domain_xml(
            DOMAIN,
            str(emulator),
            [disk(ovl, "qcow2", "vda"), disk(go, "raw", "vdb")],
            serial,
            boot,
            wl,
        )
        (tmp_path / "domain.xml").write_text(xml)
        lv.virsh("create", str(tmp_path / "domain.xml"))
        assert qemu_creds(DOMAIN) == uid_gid, "QEMU does not run as libvirt's user"
        r = attach(lv, server.control)
        (d,) = r["drives"]
        assert d["result"] == "attached", r
        refusals.append(host_check_refusals(server.control))

        def until(marker: str) -> str:
            deadline = time.monotonic() + 600
            text = ""
            while marker not in text:
                assert time.monotonic() < deadline, text[-3000:] + lv.domain_log(DOMAIN)
                assert "Kernel panic" not in text, text[-3000:]
                time.sleep(1)
                text = serial.read_text(errors="replace")
            return text

        signal_guest(go, b"GO")
        assert hashes(until("run-end"), "run") == listed.want
        st = filter_stats(lv, DOMAIN, d["filter"])
        # Before a migration to a host without pageshare: the filter goes,
        # through libvirt, and the guest reads its base from disk again.
        r = detach(lv)
        (dd,) = r["drives"]
        assert dd["result"] == "detached" and dd["stats"]["merged"] >= st["merged"], r
        signal_guest(go, b"G2")
        assert hashes(until("after-end"), "after") == listed.want
        log = lv.domain_log(DOMAIN)
        lv.virsh("destroy", DOMAIN)
        return st, {"log": log}

    try:
        lv.start()
        uid_gid = dac_label(lv)
        assert uid_gid[0] != 0, "libvirt's default QEMU user is root here"

        # The server as QEMU's user and group, started before any VM.
        server = Server(w / "server", [ImageSpec("small", image, list_file=lst)], run_as=uid_gid)
        servers.append(server)
        server.start()
        server.wait_generation("small", 1)
        st, _ = run_guest(server)
        print(f"unprivileged QEMU, server of its user: {st}")
        assert st["merged"] > len(listed.blocks) // 2, st  # copied into guest RAM
        assert st["fallback-merge-failed"] == 0 and st["last-merge-errno"] == 0, st
        assert st["fallback-unproven"] == 0 and not st["base-changed"], st
        assert refusals[-1] == [], refusals  # host check: this guest may read it
        server.stop()

        # The server as root: QEMU may connect (0666) but not read its memory.
        root_server = Server(
            w / "server-root",
            [ImageSpec("small", image, list_file=lst)],
            extra='socket_mode = "0666"',
        )
        servers.append(root_server)
        root_server.start()
        root_server.wait_generation("small", 1)
        os.chmod(root_server.dir, 0o755)
        os.chmod(root_server.dir / "run", 0o755)
        st, info = run_guest(root_server)
        print(f"unprivileged QEMU, root server: {st}")
        assert st["connected"] and st["merged"] == 0, st
        assert st["fallback-merge-failed"] > 0 and st["last-merge-errno"] == errno.EPERM, st
        assert info["log"].count("may not read the page server's memory") == 1, info["log"]
        assert f"this QEMU (uid {uid_gid[0]}, gid {uid_gid[1]})" in info["log"]
        assert "run pageshare-server as QEMU's user and group" in info["log"]
        (finding,) = refusals[-1]  # host check says so before any read
        assert finding["severity"] == "warning", finding
        assert (
            f"QEMU runs as uid {uid_gid[0]} gid {uid_gid[1]}, the server as uid 0 gid 0"
            in finding["what"]
        ), finding
        assert "unprivileged-qemu.conf" in finding["fix"], finding
    finally:
        lv.stop()
        for s in servers:
            s.stop(signal.SIGKILL)
