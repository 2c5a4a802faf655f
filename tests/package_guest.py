"""A golden image booted with systemd as PID 1 (TCG here) from a qcow2
overlay, driven through a small shell agent on a virtio-serial port
(booted, Agent), with a read-only second disk made from a directory
(payload_disk); the package built by packaging/debs.py (build_deb) and a
flat apt repository with what the image lacks to install it (guest_repo);
and waiting until the pageshare-server in the guest serves a list, read as a
client does (serving, PERL_CLIENT).  Used by test_server_package_guest.py
and test_qemu_package_guest.py.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from page_server_helpers import make_list, nonzero_blocks, raw_copy, wait_for
from pageshare import golden
from pageshare.analysis.vm import QEMU, choose_accel, console_args
from pageshare.analysis.workload import Markers
from pageshare.cache import cache_dir, locked
from pageshare.debian import PrivateApt, sources
from pageshare.image.image_inspect import inspect_image
from pageshare.lists import sectorlist
from pageshare_tools.qemu_guest import boot_args, make_overlay, start_qemu

REPO = Path(__file__).resolve().parents[1]
DEBS = REPO / "packaging" / "debs.py"
PORT = "org.pageshare.agent"
UNIT = "pageshare-server.service"


def build_deb(package: str = "pageshare-server") -> Path:
    p = subprocess.run(
        [sys.executable, str(DEBS), "--json", package], capture_output=True, text=True, timeout=3600
    )
    assert p.returncode == 0, f"packaging/debs.py failed:\n{p.stdout}\n{p.stderr[-4000:]}"
    deb = Path(json.loads(p.stdout)["built"][package])
    lintian = (deb.parent / "lintian.txt").read_text()
    assert not re.search(r"^[EW]: ", lintian, re.M), lintian
    return deb


def image_dpkg_status(img: golden.GoldenImage, tmp: Path) -> str:
    """The golden image's /var/lib/dpkg/status (its ext4 root at the
    manifest's offset)."""
    raw = raw_copy(img.path, tmp / "image.raw")
    out = tmp / "status"
    offset = int(img.manifest["root_start_sector"]) * 512
    subprocess.run(
        ["debugfs", "-R", f"dump /var/lib/dpkg/status {out}", f"{raw}?offset={offset}"],
        check=True,
        capture_output=True,
    )
    text = out.read_text()
    raw.unlink()
    assert "Package: systemd\n" in text, "no dpkg status in the image"
    return text


def guest_repo(
    img: golden.GoldenImage, suite: str, deb: Path, tmp: Path, also: tuple[str, ...] = ()
) -> Path:
    """A flat apt repository (debs + Packages) with what the image lacks to
    install ``deb`` (and ``also``: more .debs or Debian packages, resolved
    together with it), cached by the image and the packages' Depends.  apt
    resolves them on the host the way it will in the guest: ``apt-get
    install --download-only ./the.deb`` against the image's own dpkg status,
    with its suite's archive only (a private apt configuration in the
    cache; the host's is not touched)."""

    def depends_of(d: str) -> str:
        return subprocess.run(
            ["dpkg-deb", "-f", d, "Depends", "Pre-Depends"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout

    depends = depends_of(str(deb))
    extra = [depends_of(a) if a.endswith(".deb") else a for a in also]
    key = hashlib.sha256(
        json.dumps([img.manifest["sha256"], suite, depends, *extra]).encode()
    ).hexdigest()
    repo = cache_dir("guest-repos") / f"{img.variant}-{key[:16]}"
    if (repo / "Packages").exists():
        return repo
    with locked(Path(str(repo) + ".lock")):  # another worker may be making it
        if (repo / "Packages").exists():
            return repo
        _make_guest_repo(img, deb, also, suite, tmp, repo)
    return repo


def _make_guest_repo(
    img: golden.GoldenImage, deb: Path, also: tuple[str, ...], suite: str, tmp: Path, repo: Path
) -> None:
    apt = PrivateApt(cache_dir(f"apt-{suite}"), sources([suite]))
    status = tmp / "status"
    status.write_text(image_dpkg_status(img, tmp))
    staging = Path(str(repo) + ".tmp")
    # The image's installed packages, and the downloads into staging.
    guest = ["-o", f"Dir::State::status={status}", "-o", f"Dir::Cache::archives={staging}"]
    error = ""
    for attempt in range(2):
        # Downloaded into an empty directory: exactly what the image lacks.
        shutil.rmtree(staging, ignore_errors=True)
        (staging / "partial").mkdir(parents=True)
        # Stale lists name versions the mirror has dropped: update and retry.
        if attempt or not any((apt.root / "lists").glob("*Packages*")):
            subprocess.run(
                apt.command("apt-get", *guest, "update", "-qq"), check=True, capture_output=True
            )
        d = subprocess.run(
            apt.command(
                "apt-get",
                *guest,
                "install",
                "-qq",
                "--download-only",
                "-y",
                "--no-install-recommends",
                str(deb),
                *also,
            ),
            capture_output=True,
            text=True,
        )
        error = d.stdout + d.stderr
        if d.returncode == 0:
            break
    else:
        pytest.fail(f"cannot download what {deb.name} needs on {suite}:\n{error}")
    (staging / "partial").rmdir()
    (staging / "lock").unlink(missing_ok=True)
    # The server alone needs a qemu-storage-daemon: Debian's, from
    # qemu-system-common on Debian 12, qemu-utils on 13.
    if deb.name.startswith("pageshare-server_") and not also:
        assert any(staging.glob("qemu-*.deb")), list(staging.iterdir())
    packages = subprocess.run(
        ["dpkg-scanpackages", "-m", "."], cwd=staging, check=True, capture_output=True, text=True
    ).stdout
    (staging / "Packages").write_text(packages)
    staging.rename(repo)


PERL_CLIENT = r"""
# Connect to an image socket and print the first TABLE: what a client gets.
use strict; use IO::Socket::UNIX;
my $s = IO::Socket::UNIX->new(Type => SOCK_STREAM(), Peer => $ARGV[0]) or die "connect: $!\n";
$SIG{ALRM} = sub { die "no TABLE within 60 s\n" }; alarm 60;
sub get { my ($n) = @_; my $b = '';
  while (length($b) < $n) { my $r = sysread($s, $b, $n - length($b), length($b));
    die "connection closed\n" unless $r; } return $b; }
while (1) {
  my ($type, $len) = unpack("VV", get(8)); my $p = $len ? get($len) : '';
  if ($type == 1) {
    my ($ver, $flags, $gen, $entries) = unpack("VVQ<Q<", $p);
    my $pid = unpack("V", substr($p, 72, 4));
    print "TABLE version=$ver flags=$flags generation=$gen entries=$entries pid=$pid\n";
    exit 0;
  }
  print "message type=$type\n";
}
"""

AGENT = """#!/bin/sh
# pageshare test agent: runs what the host sends on a virtio-serial port.
# Request: "<id> <base64 command>"; reply: "BEGIN <id>", the base64 of the
# command's output, "END <id> <exit status>".
exec >/dev/ttyS0 2>&1
systemctl is-system-running --wait >/dev/null 2>&1
port=/dev/virtio-ports/{port}
i=0
while [ ! -e $port ] && [ $i -lt 100 ]; do modprobe virtio_console; sleep 0.2; i=$((i+1)); done
echo {marker} state=$(systemctl is-system-running)
while true; do
  # One open of the port (a virtio port has one opener); read returns
  # end-of-file while the host side is not connected.
  exec 3<>$port
  while IFS= read -r line <&3; do
    id=${{line%% *}}
    out=$(bash -c "$(printf '%s' "${{line#* }}" | base64 -d)" 2>&1 </dev/null)
    rc=$?
    printf 'BEGIN %s\\n%s\\nEND %s %s\\n' "$id" "$(printf '%s' "$out" | base64 -w0)" "$id" "$rc" >&3
  done
  exec 3<&-
  sleep 0.2
done
"""


class Agent:
    def __init__(self, path: Path, proc: subprocess.Popen[bytes], serial: Path) -> None:
        self.proc, self.serial = proc, serial
        deadline = time.monotonic() + 30
        while True:
            try:
                self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self.sock.connect(str(path))
                break
            except OSError:
                self.sock.close()
                assert time.monotonic() < deadline, "QEMU's agent socket never appeared"
                time.sleep(0.2)
        self.buf = b""
        self.n = 0

    def serial_text(self) -> str:
        return self.serial.read_text(errors="replace") if self.serial.exists() else ""

    def _line(self, deadline: float) -> str:
        while b"\n" not in self.buf:
            assert self.proc.poll() is None, "QEMU exited:\n" + self.serial_text()[-3000:]
            left = deadline - time.monotonic()
            assert left > 0, "the guest agent did not answer:\n" + self.serial_text()[-3000:]
            self.sock.settimeout(min(left, 1.0))
            try:
                chunk = self.sock.recv(65536)
            except TimeoutError:
                continue
            assert chunk, "the agent socket closed"
            self.buf += chunk
        line, _, self.buf = self.buf.partition(b"\n")
        return line.decode()

    def run(self, command: str, timeout: float = 120) -> tuple[int, str]:
        self.n += 1
        ident = str(self.n)
        self.sock.sendall(f"{ident} {base64.b64encode(command.encode()).decode()}\n".encode())
        deadline = time.monotonic() + timeout
        while self._line(deadline) != f"BEGIN {ident}":
            pass
        out = base64.b64decode(self._line(deadline)).decode(errors="replace")
        end = self._line(deadline).split()
        assert end[:2] == ["END", ident], end
        return int(end[2]), out

    def ok(self, command: str, timeout: float = 120) -> str:
        rc, out = self.run(command, timeout)
        assert rc == 0, f"guest: {command!r} exited {rc}:\n{out}"
        return out


def wait_until(what: str, pred: Any, timeout: float, interval: float = 1.0) -> Any:
    """wait_for with the argument order of these tests, polling once a second."""
    return wait_for(pred, timeout, what, interval)


# apt in the guest: the payload disk's repository (mounted on /mnt) as its
# only source list, dpkg without fsync.
APT = (
    "-o Dir::Etc::SourceList=/etc/apt/pageshare-test.list "
    "-o Dir::Etc::SourceParts=/nonexistent -o Dpkg::Options::=--force-unsafe-io"
)
USE_REPO = (
    "echo 'deb [trusted=yes] file:/mnt/repo ./' > /etc/apt/pageshare-test.list && "
    f"apt-get {APT} update -q"
)
INSTALL = (
    f"cd /mnt && DEBIAN_FRONTEND=noninteractive apt-get {APT} install -y --no-install-recommends"
)


def payload_dir(tmp_path: Path, repo: Path, debs: tuple[Path, ...]) -> Path:
    """tmp_path/payload: the guest repository (guest_repo) in repo/ and the
    packages DEBS beside it, for payload_disk."""
    payload = tmp_path / "payload"
    (payload / "repo").mkdir(parents=True)
    for f in repo.iterdir():
        shutil.copy2(f, payload / "repo" / f.name)
    for deb in debs:
        shutil.copy2(deb, payload / deb.name)
    return payload


def served_image(payload: Path, data: bytes) -> sectorlist.ImageIdentity:
    """DATA written as the payload's image test.raw, and its identity."""
    (payload / "test.raw").write_bytes(data)
    return sectorlist.ImageIdentity(len(data), hashlib.sha256(data).hexdigest(), "test.raw")


def payload_list(
    payload: Path, ident: sectorlist.ImageIdentity, release: str, stride: int
) -> sectorlist.SectorList:
    """RELEASE/test.pcsl in the payload: every STRIDE-th non-zero block of
    test.raw (100000 at the most)."""
    (payload / release).mkdir()
    return make_list(
        ident,
        nonzero_blocks(payload / "test.raw", 100_000, stride=stride),
        payload / release / "test.pcsl",
    )


def serve_payload_image(lists: str, owner: str | None = None) -> str:
    """Shell that copies the payload's test.raw and its list release v1
    (payload_list) under LISTS, the image owned by OWNER (user and group)
    if given, and writes /etc/pageshare/server.toml serving them."""
    chown = f"chown {owner}:{owner} {lists}/images/test.raw && " if owner else ""
    return (
        f"mkdir -p {lists}/images && cp /mnt/test.raw {lists}/images/ && "
        f"{chown}cp -r /mnt/v1 {lists}/ && "
        "cat > /etc/pageshare/server.toml <<'EOF'\n"
        "[[image]]\n"
        'name = "test"\n'
        f'path = "{lists}/images/test.raw"\n'
        'format = "raw"\n'
        f'list_file = "{lists}/v1/test.pcsl"\n'
        "EOF\n"
    )


def payload_disk(payload: Path, disk: Path) -> Path:
    """An ext4 image of the directory ``payload``, sized by its contents."""
    size = sum(f.stat().st_size for f in payload.rglob("*") if f.is_file())
    with open(disk, "wb") as fh:
        fh.truncate((size * 5 // 4 + (16 << 20)) // 4096 * 4096)
    subprocess.run(
        ["mkfs.ext4", "-q", "-F", "-L", "payload", "-d", str(payload), str(disk)], check=True
    )
    return disk


@contextlib.contextmanager
def booted(img: golden.GoldenImage, disk: Path, tmp_path: Path) -> Iterator[Agent]:
    """The golden image booted with systemd (TCG here) from a qcow2 overlay,
    ``disk`` as its read-only second disk (/dev/vdb), and the agent once
    it answers; the guest is killed on the way out."""
    insp = inspect_image(img.path, "qcow2", int(img.manifest["virtual_size"]))
    ovl = make_overlay(img.path, tmp_path / "ovl.qcow2")
    markers = Markers.new()
    agent_script = tmp_path / "agent.sh"
    agent_script.write_text(AGENT.format(port=PORT, marker=markers.booted))
    accel, _ = choose_accel("auto", insp.kernel)
    serial, agent_sock, qlog = tmp_path / "serial.log", tmp_path / "agent.sock", tmp_path / "q.log"
    cmd = [
        QEMU,
        "-machine",
        f"q35,accel={accel},mem-merge=off",
        *console_args(accel, serial),
        "-drive",
        f"file={ovl},format=qcow2,if=virtio,discard=unmap",
        "-drive",
        f"file={disk},format=raw,if=virtio,readonly=on",
        "-device",
        "virtio-serial-pci",
        "-chardev",
        f"socket,id=agent,path={agent_sock},server=on,wait=off",
        "-device",
        f"virtserialport,chardev=agent,name={PORT}",
        *boot_args(insp, agent_script),
    ]
    proc = start_qemu(cmd, qlog)
    try:
        g = Agent(agent_sock, proc, serial)
        wait_until("the guest agent", lambda: markers.booted in g.serial_text(), 600)
        yield g
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def serving(g: Agent, generation: int, blocks: int) -> dict[str, Any]:
    """Wait until the server publishes ``generation`` with ``blocks``, then
    connect to its image socket as a client does and read the TABLE."""

    def ready() -> dict[str, Any] | None:
        rc, out = g.run("pageshare-server status --json")
        if rc != 0:
            return None
        (img,) = [i for i in json.loads(out)["images"] if i["name"] == "test"]
        return img if img["generation"] == generation and not img["loading"] else None

    try:
        st: dict[str, Any] = wait_until(f"generation {generation}", ready, 180)
    except AssertionError as e:
        _, out = g.run(
            "pageshare-server status --json; systemctl status --no-pager "
            f"{UNIT}; journalctl -u {UNIT} --no-pager -n 40 -o cat"
        )
        raise AssertionError(f"{e}\nin the guest:\n{out}") from None
    assert st["state"] == "serving" and st["blocks"] == blocks, st
    table = g.ok("perl /mnt/client.pl /run/pageshare/test.sock")
    m = re.search(r"TABLE version=2 flags=(\d+) generation=(\d+) entries=(\d+) pid=(\d+)", table)
    assert m, table
    assert (int(m.group(2)), int(m.group(3))) == (generation, blocks), table
    st["pid_table"] = int(m.group(4))
    return st
