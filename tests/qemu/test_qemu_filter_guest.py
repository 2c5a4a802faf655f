"""A booted guest reading through the pageshare filter.

The small golden image boots (its own kernel, TCG here) from a qcow2
overlay whose backing child is the pageshare filter over the base image,
all given as -blockdev JSON, the way the README shows.  Guest RAM is a
private anonymous memory-backend-ram, so virtio-blk reads land in buffers
the filter accepts as guest RAM (no x-any-buffer).  The filter runs in
copy mode (process_vm_readv from the page server), which is what runs on a
stock kernel.  The page server serves the first non-zero blocks of the
image plus every block of a set of binaries and libraries, and is killed
and restarted while the guest boots.  The guest then drops its caches,
hashes those files, and copies one (a write through the overlay); every
hash must equal the image's, and the filter's statistics must show that
it put listed blocks into guest RAM.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest
from guest_phases import file_sha256, nonzero_file_blocks, regular_files
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
from pageshare.image.image_inspect import inspect_image
from pageshare.lists import sectorlist
from pageshare_tools.qemu_guest import make_overlay, start_qemu
from qemu_helpers import blockdev_args, guest_cmd, ps_stats, qemu_build, serial_until

pytestmark = pytest.mark.build

assert os.geteuid() == 0, "copy mode reads the page server's memory: run as root"


def kernel_has_merge_pages() -> bool:
    """The kernel series' mark (its KSM counter).  The syscall number alone
    says nothing: from 6.13 on, 464 is getxattrat()."""
    return Path("/sys/kernel/mm/ksm/merge_page_merged").exists()


@pytest.mark.vm
@pytest.mark.parametrize("mode", ["copy", "merge"])
def test_booted_guest_reads_through_the_filter(tmp_path: Path, mode: str) -> None:
    """copy: the filter puts listed blocks into guest RAM (process_vm_readv).
    merge: the default mode; on a kernel without merge_pages the guest must
    read everything normally and nothing fails."""
    q = qemu_build()
    image = golden.build_image("small").path
    raw = raw_copy(image, tmp_path / "small.raw")
    sha = content_sha256(raw)
    insp = inspect_image(image, "qcow2", raw.stat().st_size)
    files = regular_files(raw)
    assert len(files) >= 6, files
    want = {f: file_sha256(raw, f, tmp_path) for f in files}

    # The list: the first 20000 non-zero blocks (file system metadata, early
    # files) and every block of the chosen files.
    blocks = nonzero_blocks(raw, 20000)
    blocks.update({b * 8: h for b, h in nonzero_file_blocks(raw, files).items()})
    lst = tmp_path / "small.pcsl"
    make_list(sectorlist.ImageIdentity(raw.stat().st_size, sha, image.name), blocks, lst)

    server = Server(tmp_path / "server", [ImageSpec("small", image, list_file=lst)])
    server.start()
    proc = None
    try:
        server.wait_generation("small", 1)
        sock = server.sock("small")
        ovl = tmp_path / "ovl.qcow2"
        make_overlay(image, ovl)

        markers = Markers.new()
        copy = "/root/bash.copy"
        command = "; ".join(
            [
                "echo 3 > /proc/sys/vm/drop_caches",
                *(f"sha256sum {f}" for f in files),
                f"cp /usr/bin/bash {copy}",
                "sync",
                "echo 3 > /proc/sys/vm/drop_caches",
                f"sha256sum {copy}",
            ]
        )
        wl = tmp_path / "workload.sh"
        wl.write_text(script(Workload(command), markers))
        accel, _ = choose_accel("auto", insp.kernel)
        serial = tmp_path / "serial.log"
        qmp_path = tmp_path / "qmp.sock"
        cmd = guest_cmd(
            q,
            insp,
            accel,
            serial=serial,
            qmp=qmp_path,
            workload=wl,
            disks=[
                *blockdev_args(image, ovl, sock, mode=mode, **{"reconnect-delay": 1}),
                "-device",
                "virtio-blk-pci,drive=ovl",
            ],
        )
        qlog = tmp_path / "qemu.log"
        proc = start_qemu(cmd, qlog)
        qmp = QMP(qmp_path, timeout=30)

        # Kill the server while the guest boots, and bring it back.
        def outage() -> None:
            time.sleep(6)
            server.stop(signal.SIGKILL)
            time.sleep(4)
            for s in (server.dir / "run").glob("*.sock"):
                s.unlink()
            server.start()

        t = threading.Thread(target=outage)
        t.start()
        text = serial_until(proc, serial, qlog, markers.ready)
        t.join()
        # The guest may be done before the restarted server publishes (a
        # quiet host boots it in seconds): the filter must still reconnect.
        deadline = time.monotonic() + 60
        while (st := ps_stats(qmp))["connects"] < 2 and time.monotonic() < deadline:
            time.sleep(0.5)
        qmp.command("quit")
        proc.wait(30)

        got = dict(
            (m.group(2), m.group(1)) for m in re.finditer(r"^([0-9a-f]{64})  (\S+)\s*$", text, re.M)
        )
        for f in files:
            assert got.get(f) == want[f], f"{f}: guest {got.get(f)} != image {want[f]}"
        assert got.get(copy) == want["/usr/bin/bash"], "copy written by the guest is wrong"
        assert f"{markers.ready} rc=0" in text

        print(f"filter statistics ({mode}): {st}")
        if mode == "merge" and not kernel_has_merge_pages():
            # ENOSYS at open: every listed block in guest RAM is read normally.
            assert st["merge-unsupported"] == 1, st
            assert st["merged"] == 0, st
            assert st["fallback-unsupported"] > 1000, st
            assert st["connects"] >= 2, st
            assert "no merge_pages" in qlog.read_text(errors="replace")
            return
        # The filter put listed blocks into guest RAM, through the outage.
        assert st["merged"] > 1000, st
        assert st["connects"] >= 2, st
        assert st["fallback-merge-failed"] <= st["merged"] // 20, st
        # Guest reads land in guest RAM: QEMU's own buffers (qcow2 COW on
        # the guest's writes) are the only listed reads that may not.
        assert st["fallback-not-guest-ram"] < st["merged"] // 10, st
    finally:
        if proc and proc.poll() is None:
            proc.kill()
            proc.wait()
        server.stop(signal.SIGKILL)


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__, "-s"])
