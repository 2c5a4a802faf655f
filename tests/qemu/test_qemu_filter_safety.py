"""Safety first: a guest never reads bytes that its disk chain does not hold.

Each test below is a way an operator (or a hostile neighbour) can get the
filter and the page server to disagree about the base image, run with the
real patched QEMU (qemu-system-x86_64 -M none, reads with HMP qemu-io into
QEMU's own buffers: copy mode, x-any-buffer) and a real pageshare-server.
Every listed block is read through the VM's chain and checked against the
bytes that chain holds.

The two base images A and B have the same size, and every 4 KiB block of
each is filled with one byte that differs between A and B (and from the
bytes written in place later), so one wrong block is one failed pattern
check.  A control test shows that the same setup does serve (merge) when
server and VM agree, so "nothing merged" elsewhere means refused, not
broken.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from page_server_helpers import ImageSpec, Server, make_list, psc, wait_for
from pageshare.host.qmp import QMP, QMPError
from pageshare.lists import sectorlist
from qemu_helpers import QemuBuild, qemu_build

pytestmark = pytest.mark.build

assert os.geteuid() == 0, "copy mode reads the page server's memory: run as root"

BLOCKS = 8192  # 32 MiB images
LISTED = list(range(0, 1024, 2))  # 512 listed blocks
NEW = 0xFE  # bytes written in place (no pattern uses it)


def pattern(kind: str, block: int) -> int:
    """The byte that fills ``block`` of image ``kind`` (A and B always differ)."""
    return 1 + (block + (0 if kind == "A" else 100)) % 251


def make_image(path: Path, kind: str) -> Path:
    with open(path, "wb") as f:
        for b in range(BLOCKS):
            f.write(bytes([pattern(kind, b)]) * 4096)
    return path


def make_list_for(raw: Path, dest: Path, blocks: list[int]) -> None:
    data = raw.read_bytes()
    ident = sectorlist.ImageIdentity(len(data), hashlib.sha256(data).hexdigest(), raw.name)
    make_list(
        ident,
        {b * 8: hashlib.sha256(data[b * 4096 : (b + 1) * 4096]).hexdigest() for b in blocks},
        dest,
    )


@dataclass
class Images:
    dir: Path
    a: Path
    b: Path


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Images:
    d = tmp_path_factory.mktemp("safety")
    return Images(d, make_image(d / "a.raw", "A"), make_image(d / "b.raw", "B"))


class Vm:
    """The patched QEMU with no machine: a block graph driven over QMP.
    HMP's qemu-io prints to QEMU's stdout (line-buffered here, into a
    file), not into the monitor's reply."""

    def __init__(self, q: QemuBuild, tmp: Path, name: str) -> None:
        self.tmp, self.name = tmp, name
        self.qmp_path = tmp / f"{name}.qmp"
        self.stderr_path = tmp / f"{name}.stderr"
        self.stdout_path = tmp / f"{name}.stdout"
        with open(self.stderr_path, "wb") as err, open(self.stdout_path, "wb") as out:
            self.proc = subprocess.Popen(
                [
                    "stdbuf",
                    "-oL",
                    q.qemu_system,
                    "-M",
                    "none",
                    "-nodefaults",
                    "-display",
                    "none",
                    "-qmp",
                    f"unix:{self.qmp_path},server=on,wait=off",
                ],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
            )
        self.qmp = QMP(self.qmp_path, timeout=30)
        self.out_pos = 0

    def add_chain(self, base: Path, sock: Path, fmt: str = "raw", protocol: str = "file") -> None:
        """overlay (qcow2, empty) <- pageshare (copy mode) <- base, as
        qemu-patches/README.md shows, with node names ovl, ps, base.
        ``protocol`` is the base's protocol driver (``host_device`` for a
        block device)."""
        ovl = self.tmp / f"{self.name}-ovl.qcow2"
        subprocess.run(
            ["qemu-img", "create", "-q", "-f", "qcow2", "-b", str(base), "-F", fmt, str(ovl)],
            check=True,
        )
        self.blockdev_add(
            {"driver": protocol, "node-name": "base-file", "filename": str(base), "read-only": True}
        )
        self.blockdev_add(
            {"driver": fmt, "node-name": "base", "file": "base-file", "read-only": True}
        )
        self.blockdev_add(
            {
                "driver": "pageshare",
                "node-name": "ps",
                "file": "base",
                "server": str(sock),
                "mode": "copy",
                "x-any-buffer": True,
                "reconnect-delay": 1,
                "read-only": True,
            }
        )
        self.blockdev_add({"driver": "file", "node-name": "ovl-file", "filename": str(ovl)})
        self.blockdev_add(
            {"driver": "qcow2", "node-name": "ovl", "file": "ovl-file", "backing": "ps"}
        )

    def blockdev_add(self, args: dict[str, Any]) -> None:
        self.qmp.command("blockdev-add", None, **args)

    def hmp(self, line: str) -> str:
        return self.qmp.hmp(line)

    def qemu_io(self, cmd: str) -> str:
        """One qemu-io command on the overlay; what it printed."""
        self.hmp(f'qemu-io ovl "{cmd}"')
        with open(self.stdout_path, "rb") as f:
            f.seek(self.out_pos)
            out = f.read()
        self.out_pos += len(out)
        return out.decode(errors="replace")

    def read_ok(self, block: int, want: int) -> bool:
        out = self.qemu_io(f"read -P {want} {block * 4096} 4096")
        assert "read 4096/4096 bytes" in out, out
        return "Pattern verification failed" not in out

    def wrong_blocks(self, want: dict[int, int]) -> list[int]:
        """Read every block of ``want`` (block -> fill byte) through the
        chain; the blocks whose bytes were not what the chain holds."""
        return [b for b, pat in want.items() if not self.read_ok(b, pat)]

    def stats(self) -> dict[str, Any]:
        for s in self.qmp.command("query-blockstats", None, **{"query-nodes": True}):
            if s.get("node-name") == "ps":
                d: dict[str, Any] = s["driver-specific"]
                return d
        raise AssertionError("no statistics for node ps")

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def vms(tmp_path: Path) -> Iterator[list[Vm]]:
    made: list[Vm] = []
    try:
        yield made
    finally:
        for vm in made:
            vm.close()


@pytest.fixture
def servers() -> Iterator[list[Server]]:
    made: list[Server] = []
    try:
        yield made
    finally:
        for s in made:
            if s.proc:  # a test may have left it stopped
                with contextlib.suppress(ProcessLookupError):
                    os.kill(s.proc.pid, signal.SIGCONT)
            s.stop(signal.SIGKILL)


def start_server(
    servers: list[Server], d: Path, name: str, path: Path, lst: Path, extra: str = ""
) -> Server:
    s = Server(d, [ImageSpec(name, path, list_file=lst, fmt="raw")], extra=extra)
    servers.append(s)
    s.start()
    s.wait_generation(name, 1)
    return s


def new_vm(
    vms: list[Vm],
    tmp: Path,
    name: str,
    base: Path,
    sock: Path,
    fmt: str = "raw",
    protocol: str = "file",
) -> Vm:
    vm = Vm(qemu_build(), tmp, name)
    vms.append(vm)
    vm.add_chain(base, sock, fmt, protocol)
    return vm


def expect(kind: str) -> dict[int, int]:
    return {b: pattern(kind, b) for b in LISTED}


def test_control_the_same_file_is_served(
    images: Images, tmp_path: Path, vms: list[Vm], servers: list[Server]
) -> None:
    lst = tmp_path / "a.pcsl"
    make_list_for(images.a, lst, LISTED)
    srv = start_server(servers, tmp_path / "srv", "img", images.a, lst)
    vm = new_vm(vms, tmp_path, "vm", images.a, srv.sock("img"))
    assert vm.wrong_blocks(expect("A")) == []
    st = vm.stats()
    assert st["merged"] == len(LISTED), st
    assert st["fallback-unproven"] == 0 and not st["base-changed"], st


def test_wrong_socket_same_size(
    images: Images, tmp_path: Path, vms: list[Vm], servers: list[Server]
) -> None:
    """A VM over B pointed at the server of A (same virtual size, no
    image-sha256, as the README's first example): B's bytes, nothing merged."""
    lst = tmp_path / "a.pcsl"
    make_list_for(images.a, lst, LISTED)
    srv = start_server(servers, tmp_path / "srv", "img", images.a, lst)
    vm = new_vm(vms, tmp_path, "vm", images.b, srv.sock("img"))
    assert vm.wrong_blocks(expect("B")) == []
    st = vm.stats()
    assert st["connected"] and st["generation"] == 1, st
    assert st["merged"] == 0 and st["fallback-unproven"] >= len(LISTED), st
    err = vm.stderr()
    assert "not using its table" in err and "another file" in err, err
    assert err.count("not using its table") == 1, err  # one warning, not one per read
    assert "Point 'server' at the socket" in err, err  # and what to do about it


def test_images_swapped_on_restart(
    images: Images, tmp_path: Path, vms: list[Vm], servers: list[Server]
) -> None:
    """Two servers restart with their images swapped: each VM's socket now
    serves the other image."""
    la, lb = tmp_path / "a.pcsl", tmp_path / "b.pcsl"
    make_list_for(images.a, la, LISTED)
    make_list_for(images.b, lb, LISTED)
    sx = start_server(servers, tmp_path / "x", "img", images.a, la)
    sy = start_server(servers, tmp_path / "y", "img", images.b, lb)
    vma = new_vm(vms, tmp_path, "vma", images.a, sx.sock("img"))
    vmb = new_vm(vms, tmp_path, "vmb", images.b, sy.sock("img"))
    assert vma.wrong_blocks(expect("A")) == [] and vmb.wrong_blocks(expect("B")) == []
    merged = (vma.stats()["merged"], vmb.stats()["merged"])
    assert merged == (len(LISTED), len(LISTED))

    for s in (sx, sy):
        s.stop(signal.SIGKILL)
        for sock in (s.dir / "run").glob("*.sock"):
            sock.unlink()
    sx.images = [ImageSpec("img", images.b, list_file=lb, fmt="raw")]
    sy.images = [ImageSpec("img", images.a, list_file=la, fmt="raw")]
    for s in (sx, sy):
        s.start()
        s.wait_generation("img", 1)
    for vm in (vma, vmb):
        wait_for(
            lambda vm=vm: vm.stats()["connected"] and vm.stats().get("generation"),
            30,
            f"{vm.name} reconnected",
        )
    for _ in range(2):
        assert vma.wrong_blocks(expect("A")) == []
        assert vmb.wrong_blocks(expect("B")) == []
    assert (vma.stats()["merged"], vmb.stats()["merged"]) == merged
    assert vma.stats()["fallback-unproven"] >= len(LISTED)


def test_base_replaced_by_rename_while_in_use(
    images: Images, tmp_path: Path, vms: list[Vm], servers: list[Server]
) -> None:
    """The base is replaced by rename and a list for the new file is
    published while a VM still has the old file open."""
    path = tmp_path / "golden.raw"
    path.write_bytes(images.a.read_bytes())
    lst = tmp_path / "golden.pcsl"
    make_list_for(path, lst, LISTED)
    srv = start_server(servers, tmp_path / "srv", "img", path, lst)
    old = new_vm(vms, tmp_path, "old", path, srv.sock("img"))
    assert old.wrong_blocks(expect("A")) == []
    assert old.stats()["merged"] == len(LISTED)

    tmp = tmp_path / "golden.raw.new"
    tmp.write_bytes(images.b.read_bytes())
    tmp.rename(path)
    make_list_for(path, lst, LISTED)
    srv.wait_generation("img", 2)
    wait_for(lambda: old.stats().get("generation") == 2, 30, "the VM got generation 2")
    assert old.wrong_blocks(expect("A")) == []  # its file is still A
    st = old.stats()
    assert st["merged"] == len(LISTED) and st["fallback-unproven"] >= len(LISTED), st
    # A VM started now opens the new file, which the server verified: served.
    new = new_vm(vms, tmp_path, "new", path, srv.sock("img"))
    assert new.wrong_blocks(expect("B")) == []
    assert new.stats()["merged"] == len(LISTED)


class HoldingProxy:
    """A Unix socket between one filter and its page server that forwards
    whole protocol messages (8-byte header, payload, and the descriptors
    sent with them, PROTOCOL.md) and can hold back everything the server
    sends.  The filter then keeps using the table it has while the server,
    hearing nothing back, gives up on it and releases that table's blocks:
    a client that missed the switch for as long as the test wants, with no
    race between QEMU's threads (SIGSTOP leaves the order to the
    scheduler)."""

    def __init__(self, path: Path, server: Path) -> None:
        self.path, self.server = path, server
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(path))
        self.listener.listen(4)
        self.release = threading.Event()
        self.release.set()
        self.socks: list[socket.socket] = [self.listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, held: bool) -> None:
        try:
            while (got := psc.recv_frame(src)) is not None:
                kind, payload, fds = got
                if held:
                    self.release.wait()  # a message read before hold is held too
                socket.send_fds(dst, [psc.frame(kind, payload)], fds)
                for fd in fds:
                    os.close(fd)
        except (OSError, EOFError):
            pass
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                client, _ = self.listener.accept()
                upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                upstream.connect(str(self.server))
                self.socks += [client, upstream]
                threading.Thread(
                    target=self._pump, args=(client, upstream, False), daemon=True
                ).start()
                threading.Thread(
                    target=self._pump, args=(upstream, client, True), daemon=True
                ).start()

    def close(self) -> None:
        self.release.set()
        for s in self.socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()


def test_stalled_client_never_reads_released_pages(
    images: Images, tmp_path: Path, vms: list[Vm], servers: list[Server]
) -> None:
    """A client that misses client_switch_timeout_secs while the server
    reloads a smaller list: the server says BYE and releases the old
    blocks, but the client has not heard it and still reads with the old
    table.  Released pages must fault (the copy fails and the block is read
    from disk), never read as zeros or as anything else."""
    lst = tmp_path / "a.pcsl"
    make_list_for(images.a, lst, LISTED)
    srv = start_server(
        servers,
        tmp_path / "srv",
        "img",
        images.a,
        lst,
        extra="[limits]\nclient_switch_timeout_secs = 1",
    )
    proxy = HoldingProxy(tmp_path / "proxy.sock", srv.sock("img"))
    try:
        vm = new_vm(vms, tmp_path, "vm", images.a, proxy.path)
        assert vm.wrong_blocks(expect("A")) == []
        assert vm.stats()["merged"] == len(LISTED)

        kept = LISTED[::4]
        released = [b for b in LISTED if b not in kept]
        proxy.release.clear()  # the filter hears nothing from now on
        make_list_for(images.a, lst, kept)
        srv.wait_generation("img", 2)
        wait_for(
            lambda: "did not acknowledge" in srv.log_text(),
            30,
            "the server gives up on the silent client and releases generation 1",
        )
        time.sleep(1.0)
        st = vm.stats()
        assert st["connected"] and st["generation"] == 1, st
        want = {b: pattern("A", b) for b in released}
        assert vm.wrong_blocks(want) == [], "a released block read wrong bytes"
        after = vm.stats()
        # every released block was looked up in the old table and its copy
        # failed: read from disk, not counted as merged
        assert after["merged"] == st["merged"], after
        assert after["fallback-merge-failed"] - st["fallback-merge-failed"] == len(released), after
        assert after["last-merge-errno"] != 0, after

        proxy.release.set()  # the filter hears TABLE 2 and BYE, reconnects

        def reconnected() -> bool:
            # a new connection: TABLE 2 arrives on the old one too, just
            # before its BYE, and reads in between go to disk
            now = vm.stats()
            return bool(
                now["connected"]
                and now.get("generation") == 2
                and now["connects"] > after["connects"]
            )

        wait_for(reconnected, 30, "the filter reconnects and gets generation 2")
        assert vm.wrong_blocks(expect("A")) == []
        assert vm.stats()["merged"] == after["merged"] + len(kept)
    finally:
        proxy.close()


def test_base_overwritten_in_place(
    images: Images, tmp_path: Path, vms: list[Vm], servers: list[Server]
) -> None:
    """The base is written in place under a running VM.  The server is
    stopped (SIGSTOP) so that it cannot withdraw the table: the filter alone
    must notice the change before it serves a changed block."""
    path = tmp_path / "golden.raw"
    path.write_bytes(images.a.read_bytes())
    lst = tmp_path / "golden.pcsl"
    make_list_for(path, lst, LISTED)
    srv = start_server(servers, tmp_path / "srv", "img", path, lst)
    vm = new_vm(vms, tmp_path, "vm", path, srv.sock("img"))
    assert vm.wrong_blocks(expect("A")) == []
    assert vm.stats()["merged"] == len(LISTED)

    assert srv.proc is not None
    os.kill(srv.proc.pid, signal.SIGSTOP)
    want = expect("A")
    fd = os.open(path, os.O_WRONLY)
    try:
        for b in LISTED[:40]:
            os.pwrite(fd, bytes([NEW]) * 4096, b * 4096)
            want[b] = NEW
            assert vm.read_ok(b, NEW), f"block {b}: the old bytes after an in-place write"
    finally:
        os.close(fd)
        os.kill(srv.proc.pid, signal.SIGCONT)
    assert vm.wrong_blocks(want) == []
    st = vm.stats()
    assert st["base-changed"] and st["merged"] == len(LISTED), st
    assert "changed while this VM uses it" in vm.stderr()


def test_base_rewritten_through_a_hard_link(
    images: Images, tmp_path: Path, vms: list[Vm], servers: list[Server]
) -> None:
    """The same file rewritten through a hard link in another directory:
    the server notices (its watch is on the inode) and the VM reads the new
    bytes."""
    path = tmp_path / "golden.raw"
    path.write_bytes(images.a.read_bytes())
    lst = tmp_path / "golden.pcsl"
    make_list_for(path, lst, LISTED)
    srv = start_server(servers, tmp_path / "srv", "img", path, lst)
    vm = new_vm(vms, tmp_path, "vm", path, srv.sock("img"))
    assert vm.wrong_blocks(expect("A")) == []
    other = tmp_path / "elsewhere"
    other.mkdir()
    link = other / "link.raw"
    os.link(path, link)
    want = expect("A")
    with open(link, "r+b") as f:
        for b in LISTED[:16]:
            f.seek(b * 4096)
            f.write(bytes([NEW]) * 4096)
            want[b] = NEW
    wait_for(lambda: srv.image("img")["state"] != "serving", 5, "the server withdraws the table")
    assert vm.wrong_blocks(want) == []


def test_metadata_changes_share_again_and_a_write_does_not(
    images: Images, tmp_path: Path, vms: list[Vm], servers: list[Server]
) -> None:
    """A chmod, a chown (libvirt's DAC driver at a domain's start), a new
    hard link and a touch -d that puts the mtime back, each with the base's
    bytes unchanged: the filter sees the new ctime after a merge and reads
    from disk (base-changed), the server verifies the file again and
    publishes its new stamp, and the VM merges again within seconds.  The
    server is stopped (SIGSTOP) during each change so that the filter
    notices first, as a busy guest does.  Then a real write: read from disk
    for good, and the server and host check say which VM does not share
    and why.  Every listed block is checked against the chain throughout."""
    from pageshare.host import hostcheck

    path = tmp_path / "golden.raw"
    path.write_bytes(images.a.read_bytes())
    lst = tmp_path / "golden.pcsl"
    make_list_for(path, lst, LISTED)
    srv = start_server(servers, tmp_path / "srv", "img", path, lst)
    vm = new_vm(vms, tmp_path, "vm", path, srv.sock("img"))
    want = expect("A")
    assert vm.wrong_blocks(want) == []
    assert vm.stats()["merged"] == len(LISTED)
    assert srv.proc is not None
    stamp = path.stat()
    gen = 1

    def while_stopped(change: Any) -> None:
        """The change, and a read that notices it, with the server stopped."""
        assert srv.proc is not None
        os.kill(srv.proc.pid, signal.SIGSTOP)
        try:
            change()
            assert vm.read_ok(LISTED[0], want[LISTED[0]])
            assert vm.stats()["base-changed"]
        finally:
            os.kill(srv.proc.pid, signal.SIGCONT)

    def client_proof(state: str) -> bool:
        img = srv.image("img")
        return bool(img["client_list"] and img["client_list"][0]["proof"] == state)

    resumed: dict[str, float] = {}
    changes = [
        ("chmod", lambda: os.chmod(path, 0o640)),
        ("chown", lambda: os.chown(path, 64055, 64055)),
        ("link", lambda: os.link(path, tmp_path / "golden-link.raw")),
        ("touch -d", lambda: os.utime(path, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))),
    ]
    for what, change in changes:
        while_stopped(change)
        t0 = time.monotonic()
        gen += 1
        before = vm.stats()["merged"]
        probe = LISTED[1]

        def merging(before: int = before, probe: int = probe) -> bool:
            assert vm.read_ok(probe, want[probe])
            return bool(vm.stats()["merged"] > before)

        wait_for(merging, 30, f"{what}: the VM merges again")
        resumed[what] = time.monotonic() - t0
        st = vm.stats()
        assert not st["base-changed"] and st["generation"] == gen, (what, st)
        assert vm.wrong_blocks(want) == [], what
        assert "only the file's metadata changed" in srv.log_text(), what
    assert path.stat().st_mtime_ns == stamp.st_mtime_ns  # touch -d put it back
    print("merging again after", {k: round(v, 1) for k, v in resumed.items()}, "s")
    assert max(resumed.values()) < 15, resumed
    err = vm.stderr()
    assert err.count("changed while this VM uses it") == len(changes), err
    assert err.count("verified the base image") == len(changes), err
    wait_for(lambda: client_proof("sharing"), 15, "its STATS says it shares")

    # A real write: the server withdraws the table and refuses the list
    # (the content hash is another), the filter reads from disk for good.
    def write() -> None:
        fd = os.open(path, os.O_WRONLY)
        try:
            os.pwrite(fd, bytes([NEW]) * 4096, LISTED[0] * 4096)
        finally:
            os.close(fd)
        want[LISTED[0]] = NEW

    while_stopped(write)
    wait_for(lambda: srv.image("img")["state"] == "refused", 30, "the list is refused")
    before = vm.stats()["merged"]
    assert vm.wrong_blocks(want) == []
    st = vm.stats()
    assert st["merged"] == before and st["base-changed"], st
    wait_for(lambda: client_proof("base-changed"), 15, "its STATS says base-changed")
    img = srv.image("img")
    assert img["clients_proof"]["base-changed"] == 1, img
    # the metrics text is rendered from the status every 0.5 s
    wait_for(
        lambda: (
            'pageshare_image_clients_by_proof{image="img",proof="base-changed"} 1' in srv.metrics()
        ),
        5,
        "the metrics count it",
    )
    findings = list(hostcheck.check_server(srv.control))
    said = [f for f in findings if "do not share its pages" in f.what]
    assert len(said) == 1 and "base-changed" in said[0].what, findings
    assert str(vm.proc.pid) in said[0].what and "restart those VMs" in said[0].fix, said


def test_overlay_opened_without_backing_is_refused(
    images: Images, tmp_path: Path, vms: list[Vm], servers: list[Server]
) -> None:
    """A qcow2 overlay opened with "backing": null directly under the
    filter is not the base: refused at open."""
    lst = tmp_path / "a.pcsl"
    make_list_for(images.a, lst, LISTED)
    srv = start_server(servers, tmp_path / "srv", "img", images.a, lst)
    ovl = tmp_path / "mid.qcow2"
    subprocess.run(
        ["qemu-img", "create", "-q", "-f", "qcow2", "-b", str(images.a), "-F", "raw", str(ovl)],
        check=True,
    )
    vm = Vm(qemu_build(), tmp_path, "vm")
    vms.append(vm)
    vm.blockdev_add(
        {"driver": "file", "node-name": "mid-file", "filename": str(ovl), "read-only": True}
    )
    vm.blockdev_add(
        {
            "driver": "qcow2",
            "node-name": "mid",
            "file": "mid-file",
            "backing": None,
            "read-only": True,
        }
    )
    with pytest.raises(QMPError, match="opened without it"):
        vm.blockdev_add(
            {
                "driver": "pageshare",
                "node-name": "ps",
                "file": "mid",
                "server": str(srv.sock("img")),
                "mode": "copy",
                "read-only": True,
            }
        )


def assert_read_from_disk(vm: Vm, want: dict[int, int], why: str) -> None:
    """Every block of ``want`` right, none of them merged, all counted as
    unproven, and one warning that says why and what would work (no other
    server could prove such a base, so not "point 'server' elsewhere")."""
    assert vm.wrong_blocks(want) == []
    st = vm.stats()
    assert st["connected"] and st["generation"] == 1, st
    assert st["merged"] == 0 and st["fallback-unproven"] >= len(want), st
    err = vm.stderr()
    assert err.count("not using its table") == 1 and why in err, err
    assert "Only a raw or qcow2 base that is a regular local file" in err, err
    assert "Point 'server'" not in err, err


@pytest.fixture
def loop_device(images: Images) -> Iterator[Path]:
    dev = subprocess.run(
        ["losetup", "--find", "--show", "--read-only", str(images.a)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    try:
        yield Path(dev)
    finally:
        subprocess.run(["losetup", "--detach", dev], check=False)


def test_block_device_base_reads_from_disk(
    images: Images, tmp_path: Path, vms: list[Vm], servers: list[Server], loop_device: Path
) -> None:
    """The base is a block device (host_device over a loop device of the
    very file the server verified).  A write to a block device moves no
    stamp the filter could see, so it is never proven: read from disk."""
    lst = tmp_path / "a.pcsl"
    make_list_for(images.a, lst, LISTED)
    srv = start_server(servers, tmp_path / "srv", "img", images.a, lst)
    vm = new_vm(vms, tmp_path, "vm", loop_device, srv.sock("img"), protocol="host_device")
    assert_read_from_disk(vm, expect("A"), "not a local file")


def test_qcow2_with_external_data_file_reads_from_disk(
    images: Images, tmp_path: Path, vms: list[Vm], servers: list[Server]
) -> None:
    """A qcow2 base whose data sits in an external raw file: the server
    verifies it (qemu-storage-daemon reads both files), but the data file can
    change without the qcow2 file's stamp moving, so the filter has no proof
    for it and reads from disk."""
    data = tmp_path / "a-data.raw"
    base = tmp_path / "a-ext.qcow2"
    subprocess.run(
        [
            "qemu-img",
            "convert",
            "-q",
            "-f",
            "raw",
            "-O",
            "qcow2",
            "-o",
            f"data_file={data},data_file_raw=on",
            str(images.a),
            str(base),
        ],
        check=True,
    )
    lst = tmp_path / "a.pcsl"
    make_list_for(images.a, lst, LISTED)
    srv = Server(tmp_path / "srv", [ImageSpec("img", base, list_file=lst, fmt="qcow2")])
    servers.append(srv)
    srv.start()
    srv.wait_generation("img", 1)
    vm = new_vm(vms, tmp_path, "vm", base, srv.sock("img"), fmt="qcow2")
    assert_read_from_disk(vm, expect("A"), "external data file")
