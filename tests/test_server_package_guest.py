"""pageshare-server's Debian package under a real systemd (issue 12).

The package is built with ``packaging/debs.py`` (cached), then a golden
image boots (the small one, Debian 12, with every step below; trixie,
Debian 13, without the watchdog and upgrade steps) with its own kernel and
systemd as PID 1 (TCG here) from a qcow2 overlay, with a second, read-only
disk holding the .deb, a flat apt repository with what the package needs
that the image lacks (the package with qemu-storage-daemon and its
libraries, resolved and downloaded on the host for the image's own dpkg
status), a 16 MiB image for the server to serve and two
lists for it.  The guest has no network: ``apt-get install
./pageshare-server_*.deb`` resolves the dependencies from that repository,
as it would from Debian's archive on a host.

The host drives the guest through a small shell agent on a virtio-serial
port (delivered by fw_cfg, like the analysis workloads) and checks from
outside what an operator would: the package installs enabled but starts
nothing until /etc/pageshare/server.toml exists; ``systemd-analyze
verify`` of the installed unit passes; ``systemctl start`` returns once the
server sent READY=1 and it then serves the first list; ``systemctl reload``
switches to a new list the server's inotify did not see (the list's
directory is a symlink switched to a new release); under the unit's
hardening the server runs with only CAP_DAC_READ_SEARCH, no new privileges,
a seccomp filter and its own mount namespace, and still loads, serves and
answers on the metrics endpoint; a server stopped with SIGSTOP is killed
by the watchdog (WatchdogSec=30s) and restarted, a SIGKILLed one is
restarted, and each new server serves again; an upgrade (a reinstall)
restarts it and keeps the operator's configuration; the journal says all of
this; purging removes the package and keeps the operator's configuration.
The guest kernel lacks merge_pages, so the server runs in degraded mode.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import random
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
from page_server_helpers import make_list, nonzero_blocks, raw_copy
from pageshare import golden, sectorlist
from pageshare.cache import cache_dir
from pageshare.debian import PrivateApt, sources
from pageshare.image_inspect import inspect_image
from pageshare.vm import QEMU, _child_setup, choose_accel
from pageshare.workload import FW_CFG_NAME, Markers, kernel_cmdline

REPO = Path(__file__).resolve().parents[1]
DEBS = REPO / "packaging" / "debs.py"
PORT = "org.pageshare.agent"
UNIT = "pageshare-server.service"
# Golden image variant -> (Debian suite, whether the slow steps run there).
# Debian 12 runs everything; Debian 13 the install, start, reload, crash
# restart, journal and purge (the watchdog's 30 s and the upgrade once is
# enough).
VARIANTS = {"small": ("bookworm", True), "trixie": ("trixie", False)}
LISTS = "/var/lib/pageshare"

assert os.geteuid() == 0, "boots a guest and builds a package: run as root"


# --------------------------------------------------------------------------- host side


def build_deb(package: str = "pageshare-server") -> Path:
    p = subprocess.run([sys.executable, str(DEBS), "--json", package],
                       capture_output=True, text=True, timeout=3600)
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
    subprocess.run(["debugfs", "-R", f"dump /var/lib/dpkg/status {out}",
                    f"{raw}?offset={offset}"], check=True, capture_output=True)
    text = out.read_text()
    raw.unlink()
    assert "Package: systemd\n" in text, "no dpkg status in the image"
    return text


def guest_repo(img: golden.GoldenImage, suite: str, deb: Path, tmp: Path,
               also: tuple[str, ...] = ()) -> Path:
    """A flat apt repository (debs + Packages) with what the image lacks to
    install ``deb`` (and ``also``: more .debs or Debian packages, resolved
    together with it), cached by the image and the packages' Depends.  apt
    resolves them on the host the way it will in the guest: ``apt-get
    install --download-only ./the.deb`` against the image's own dpkg status,
    with its suite's archive only (a private apt configuration in the
    cache; the host's is not touched)."""
    def depends_of(d: str) -> str:
        return subprocess.run(["dpkg-deb", "-f", d, "Depends", "Pre-Depends"], check=True,
                              capture_output=True, text=True).stdout
    depends = depends_of(str(deb))
    extra = [depends_of(a) if a.endswith(".deb") else a for a in also]
    key = hashlib.sha256(json.dumps([img.manifest["sha256"], suite, depends, *extra]).encode()
                         ).hexdigest()
    repo = cache_dir("guest-repos") / f"{img.variant}-{key[:16]}"
    if (repo / "Packages").exists():
        return repo
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
            subprocess.run(apt.command("apt-get", *guest, "update", "-qq"), check=True,
                           capture_output=True)
        d = subprocess.run(apt.command("apt-get", *guest, "install", "-qq", "--download-only",
                                       "-y", "--no-install-recommends", str(deb), *also),
                           capture_output=True, text=True)
        error = d.stdout + d.stderr
        if d.returncode == 0:
            break
    else:
        pytest.fail(f"cannot download what {deb.name} needs on {suite}:\n{error}")
    (staging / "partial").rmdir()
    (staging / "lock").unlink(missing_ok=True)
    # qemu-storage-daemon: qemu-system-common on Debian 12, qemu-utils on 13.
    assert also or any(staging.glob("qemu-*.deb")), list(staging.iterdir())
    packages = subprocess.run(["dpkg-scanpackages", "-m", "."], cwd=staging, check=True,
                              capture_output=True, text=True).stdout
    (staging / "Packages").write_text(packages)
    staging.rename(repo)
    return repo


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
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = pred()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}; last: {last!r}")


def payload_disk(payload: Path, disk: Path) -> Path:
    """An ext4 image of the directory ``payload``, sized by its contents."""
    size = sum(f.stat().st_size for f in payload.rglob("*") if f.is_file())
    with open(disk, "wb") as fh:
        fh.truncate((size * 5 // 4 + (16 << 20)) // 4096 * 4096)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-L", "payload", "-d", str(payload), str(disk)],
                   check=True)
    return disk


@contextlib.contextmanager
def booted(img: golden.GoldenImage, disk: Path, tmp_path: Path) -> Iterator[Agent]:
    """The golden image booted with systemd (TCG here) from a qcow2 overlay,
    ``disk`` as its read-only second disk (/dev/vdb), and the agent once
    it answers; the guest is killed on the way out."""
    insp = inspect_image(img.path, "qcow2", int(img.manifest["virtual_size"]))
    ovl = tmp_path / "ovl.qcow2"
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-b", str(img.path), "-F",
                    "qcow2", str(ovl)], check=True)
    markers = Markers.new()
    agent_script = tmp_path / "agent.sh"
    agent_script.write_text(AGENT.format(port=PORT, marker=markers.booted))
    accel, _ = choose_accel("auto", insp.kernel)
    serial, agent_sock, qlog = tmp_path / "serial.log", tmp_path / "agent.sock", tmp_path / "q.log"
    cmd = [QEMU, "-machine", f"q35,accel={accel}", "-m", "1024M", "-smp", "1",
           "-cpu", "host" if accel == "kvm" else "max,la57=off",
           "-nodefaults", "-display", "none", "-vga", "none", "-no-reboot",
           "-serial", f"file:{serial}",
           "-drive", f"file={ovl},format=qcow2,if=virtio,discard=unmap",
           "-drive", f"file={disk},format=raw,if=virtio,readonly=on",
           "-device", "virtio-serial-pci",
           "-chardev", f"socket,id=agent,path={agent_sock},server=on,wait=off",
           "-device", f"virtserialport,chardev=agent,name={PORT}",
           "-kernel", str(insp.kernel), "-append", kernel_cmdline(insp.info.root_uuid),
           "-fw_cfg", f"name={FW_CFG_NAME},file={agent_script}"]
    if insp.initrd:
        cmd += ["-initrd", str(insp.initrd)]
    with open(qlog, "wb") as lf:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=lf, stderr=lf,
                                preexec_fn=_child_setup, start_new_session=True)
    try:
        g = Agent(agent_sock, proc, serial)
        wait_until("the guest agent", lambda: markers.booted in g.serial_text(), 600)
        yield g
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


# --------------------------------------------------------------------------- the test


@pytest.mark.vm
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_server_package_under_systemd(variant: str, tmp_path: Path) -> None:
    suite, full = VARIANTS[variant]
    t0 = time.monotonic()
    times: dict[str, float] = {}

    def lap(name: str) -> None:
        times[name] = round(time.monotonic() - t0 - sum(times.values()), 1)

    deb = build_deb()
    img = golden.build_image(variant)
    repo = guest_repo(img, suite, deb, tmp_path)
    lap("build")

    # The payload disk: the package, the repository, an image and two lists.
    payload = tmp_path / "payload"
    (payload / "repo").mkdir(parents=True)
    for f in repo.iterdir():
        shutil.copy2(f, payload / "repo" / f.name)
    shutil.copy2(deb, payload / deb.name)
    rnd = random.Random(12)
    data = bytearray(rnd.randbytes(16 << 20))
    data[4 << 20:6 << 20] = bytes(2 << 20)
    served = payload / "test.raw"
    served.write_bytes(bytes(data))
    ident = sectorlist.ImageIdentity(len(data), hashlib.sha256(data).hexdigest(), "test.raw")
    lists = {}
    for release, stride in (("v1", 3), ("v2", 5)):
        (payload / release).mkdir()
        lists[release] = make_list(ident, nonzero_blocks(served, 100_000, stride=stride),
                                   payload / release / "test.pcsl")
    n1, n2 = len(lists["v1"].blocks), len(lists["v2"].blocks)
    assert n1 != n2
    (payload / "client.pl").write_text(PERL_CLIENT)
    disk = payload_disk(payload, tmp_path / "payload.ext4")
    with booted(img, disk, tmp_path) as g:
        lap("boot")
        run_checks(g, deb.name, n1, n2, full, lap)
    print(f"phases (s): {times}")


def run_checks(g: Agent, deb: str, n1: int, n2: int, full: bool, lap: Any) -> None:
    # --- install, as an operator would: apt resolves the Depends from a repository.
    g.ok("mount -o ro /dev/vdb /mnt")
    apt = ("-o Dir::Etc::SourceList=/etc/apt/pageshare-test.list "
           "-o Dir::Etc::SourceParts=/nonexistent -o Dpkg::Options::=--force-unsafe-io")
    g.ok("echo 'deb [trusted=yes] file:/mnt/repo ./' > /etc/apt/pageshare-test.list && "
         f"apt-get {apt} update -q")
    out = g.ok(f"cd /mnt && DEBIAN_FRONTEND=noninteractive apt-get {apt} install -y "
               f"--no-install-recommends ./{deb}", timeout=900)
    assert "Setting up pageshare-server" in out, out
    assert g.ok("command -v qemu-storage-daemon").strip() == "/usr/bin/qemu-storage-daemon"
    lap("install")

    # Installed: enabled, but nothing runs until /etc/pageshare/server.toml exists.
    assert g.ok("systemctl is-enabled pageshare-server").strip() == "enabled"
    rc, state = g.run("systemctl is-active pageshare-server")
    assert rc != 0 and state.strip() == "inactive", state
    shown = g.ok(f"systemctl show {UNIT} -p ConditionResult -p ExecMainPID -p FragmentPath")
    assert "ConditionResult=no" in shown and "ExecMainPID=0" in shown, shown
    # /lib on Debian 12; Debian 13's systemd finds it through /lib -> usr/lib
    assert re.search(r"^FragmentPath=(/usr)?/lib/systemd/system/pageshare-server.service$",
                     shown, re.M), shown
    assert "pageshare-serve" not in g.ok("cat /proc/[0-9]*/comm 2>/dev/null; true"), \
        "the server runs without a configuration"
    assert g.ok("dpkg-query -W -f='${Conffiles}' pageshare-server").split()[0] == \
        "/etc/pageshare/server.example.toml"
    assert g.ok("test ! -e /etc/pageshare/server.toml && ls /etc/pageshare").split() == \
        ["server.example.toml"]
    assert "ExecStart=/usr/bin/pageshare-server run" in g.ok(f"systemctl cat {UNIT}")
    # The installed unit verifies (this includes its ExecStart binary).
    rc, out = g.run(f"systemd-analyze verify /lib/systemd/system/{UNIT}")
    assert rc == 0 and out.strip() == "", out
    g.ok("pageshare-server check-config /etc/pageshare/server.example.toml")
    lap("installed-state")

    # --- configure: an image, two list releases, "current" -> v1.
    g.ok(f"mkdir -p {LISTS}/images {LISTS}/releases && "
         f"cp /mnt/test.raw {LISTS}/images/ && cp -r /mnt/v1 /mnt/v2 {LISTS}/releases/ && "
         f"ln -s releases/v1 {LISTS}/current && "
         "cat > /etc/pageshare/server.toml <<'EOF'\n"
         "# server.example.toml's defaults, its metrics listener, and one image.\n"
         'metrics_listen = "127.0.0.1:9477"\n'
         "[[image]]\n"
         'name = "test"\n'
         f'path = "{LISTS}/images/test.raw"\n'
         'format = "raw"\n'
         f'list_file = "{LISTS}/current/test.pcsl"\n'
         "EOF\n"
         "pageshare-server check-config /etc/pageshare/server.toml")

    # --- start: systemctl returns once the server sent READY=1.
    g.ok("systemctl start pageshare-server", timeout=120)
    show = props(g)
    assert show["ActiveState"] == "active" and show["SubState"] == "running", show
    assert show["Type"] == "notify" and show["WatchdogUSec"] == "30s", show
    pid1 = int(show["MainPID"])
    assert pid1 > 0
    st = serving(g, 1, n1)
    lap("start")
    assert st["pid_table"] == pid1, st

    # Hardening: what the unit asked for is what the process has, and it works.
    s = g.ok(f"cat /proc/{pid1}/status")
    fields = dict(re.findall(r"^(\w+):\s*(.*)$", s, re.M))
    assert int(fields["CapBnd"], 16) == 1 << 2, fields["CapBnd"]   # CAP_DAC_READ_SEARCH
    assert int(fields["CapEff"], 16) & ~(1 << 2) == 0, fields["CapEff"]
    assert fields["NoNewPrivs"] == "1" and fields["Seccomp"] == "2", fields
    assert g.ok(f"readlink /proc/{pid1}/ns/mnt") != g.ok("readlink /proc/1/ns/mnt")
    # ProtectSystem=strict: /usr is read-only in its namespace.
    rc, out = g.run(f"nsenter -t {pid1} -m touch /usr/pageshare-probe")
    assert rc != 0 and "Read-only file system" in out, out
    exposure = g.ok(f"systemd-analyze security {UNIT} --no-pager | tail -1")
    print(f"systemd-analyze security: {exposure.strip()}")
    m = re.search(r"exposure level for \S+: (\d+\.\d+)", exposure)
    assert m and float(m.group(1)) <= 5.0, exposure

    # Metrics answer on the default listener.
    metrics = g.ok("exec 5<>/dev/tcp/127.0.0.1/9477 && "
                   "printf 'GET /metrics HTTP/1.0\\r\\nHost: localhost\\r\\n\\r\\n' >&5 && "
                   "timeout 10 cat <&5")
    assert metrics.startswith("HTTP/1.") and " 200 " in metrics.splitlines()[0], metrics[:500]
    assert re.search(r"^pageshare_\w+", metrics, re.M), metrics[:2000]
    degraded = re.search(r"^pageshare_degraded (\d)", metrics, re.M)
    assert degraded, metrics[:2000]

    # --- reload: "current" now names release v2.  The server watches the
    # directory the symlink pointed to, so only a reload notices.
    g.ok(f"ln -sfn releases/v2 {LISTS}/current.new && mv -T {LISTS}/current.new {LISTS}/current")
    time.sleep(3)
    st = status(g)
    assert st["generation"] == 1 and st["blocks"] == n1, st
    g.ok("systemctl reload pageshare-server")
    st = serving(g, 2, n2)
    assert st["pid_table"] == pid1 and int(props(g)["MainPID"]) == pid1
    lap("reload")

    # --- a broken configuration (an operator's typo): `systemctl reload`
    # fails and the journal says which file and line; the running server
    # never re-reads its configuration, so it keeps serving generation 2.
    g.ok("cp /etc/pageshare/server.toml /root/server.toml.good && "
         "printf 'socket_dir = [\\n' >> /etc/pageshare/server.toml")
    rc, out = g.run("systemctl reload pageshare-server")
    assert rc != 0, out
    img = [i for i in json.loads(g.ok("pageshare-server status --json --socket "
                                      "/run/pageshare/control.sock"))["images"]
           if i["name"] == "test"]
    assert img and img[0]["generation"] == 2 and img[0]["blocks"] == n2, img
    show = props(g)
    assert show["ActiveState"] == "active" and int(show["MainPID"]) == pid1, show
    typo = g.ok(f"journalctl -u {UNIT} --no-pager -o cat -t pageshare-server")
    assert re.search(r"error: /etc/pageshare/server.toml: TOML parse error at line \d+", typo), \
        typo[-2000:]
    g.ok("cp /root/server.toml.good /etc/pageshare/server.toml")
    lap("broken-config reload")

    # What the journal must say, in order: systemd's messages, and each
    # server process's own.
    said = [
        # installed, not configured (systemd 252's and 257's words)
        r"skipped(,| because of an) unmet condition check \(?ConditionPathExists="
        r"/etc/pageshare/server.toml",
        STARTED,
        r"^Reloading (pageshare-server.service - )?pageshare page server",
        r"^Reloaded (pageshare-server.service - )?pageshare page server",
        r"^Reloading (pageshare-server.service - )?pageshare page server",
        r"Control process exited, code=exited, status=2",
        r"^Reload failed for (pageshare-server.service - )?pageshare page server",
    ]
    loading = rf"^image test: loading file {LISTS}/current/test.pcsl"
    restarted = [rf"{loading} \(start-up\)", rf"^image test: published generation 1: {n2} "]
    own = {pid1: [rf"{loading} \(start-up\)", rf"^image test: published generation 1: {n1} ",
                  rf"{loading} \(reload requested\)",
                  rf"^image test: published generation 2: {n2} "]}
    pid, restarts = pid1, 0

    if full:
        # --- watchdog: a hung server (SIGSTOP) is killed and restarted.
        g.ok(f"kill -STOP {pid}")
        old, pid = pid, wait_until("a restart after the watchdog", lambda: new_pid(g, pid1),
                                   120, 2)
        st = serving(g, 1, n2)
        assert st["pid_table"] == pid, st
        restarts += 1
        said += [r"Watchdog timeout \(limit 30s\)!",
                 rf"Killing process {old} \(pageshare-serve\) with signal SIGABRT",
                 r"Main process exited, code=(killed|dumped), status=6/ABRT",
                 r"Failed with result 'watchdog'",
                 rf"Scheduled restart job, restart counter is at {restarts}\.", STARTED]
        own[pid] = restarted
        lap("watchdog")

    # --- SIGKILL: restarted, serves again.
    g.ok(f"kill -KILL {pid}")
    old = pid
    pid = wait_until("a restart after SIGKILL", lambda: new_pid(g, old), 60, 1)
    st = serving(g, 1, n2)
    assert st["pid_table"] == pid, st
    restarts += 1
    show = props(g)
    assert int(show["NRestarts"]) == restarts, show
    said += [r"Main process exited, code=killed, status=9/KILL",
             r"Failed with result 'signal'",
             rf"Scheduled restart job, restart counter is at {restarts}\.", STARTED]
    own[pid] = restarted
    lap("sigkill")

    if full:
        # --- an upgrade (the same version again) restarts the running server
        # and leaves the operator's configuration alone.
        conf = g.ok("sha256sum /etc/pageshare/server.toml")
        out = g.ok(f"cd /mnt && DEBIAN_FRONTEND=noninteractive apt-get {apt} install -y "
                   f"--reinstall ./{deb}", timeout=300)
        assert "Setting up pageshare-server" in out, out
        old = pid
        pid = wait_until("the restart after the upgrade", lambda: new_pid(g, old), 60, 1)
        st = serving(g, 1, n2)
        assert st["pid_table"] == pid, st
        assert g.ok("sha256sum /etc/pageshare/server.toml") == conf
        said += [r"^Stopping (pageshare-server.service - )?pageshare page server", STARTED]
        own[pid] = restarted
        lap("upgrade")

    # --- the journal says what happened.
    entries = [json.loads(line) for line in
               g.ok(f"journalctl -u {UNIT} --no-pager -o json").splitlines() if line]
    assert_in_order("\n".join(str(e["MESSAGE"]) for e in entries
                              if e.get("SYSLOG_IDENTIFIER") == "systemd"), said)
    for pid, lines in own.items():
        mine = [e for e in entries if e.get("SYSLOG_IDENTIFIER") == "pageshare-server"
                and int(e.get("_PID", 0)) == pid]
        text = "\n".join(str(e["MESSAGE"]) for e in mine)
        assert_in_order(text, lines)
        assert re.search("^listening: control /run/pageshare/control.sock, 1 image socket",
                         text, re.M), text
        # The guest kernel lacks merge_pages: said at warning priority, and in the metrics.
        prio = [e["PRIORITY"] for e in mine if str(e["MESSAGE"]).startswith("DEGRADED MODE")]
        assert prio == (["4"] if degraded.group(1) == "1" else []), (prio, text)

    # --- stop, then purge: gone, the operator's configuration stays.
    g.ok("systemctl stop pageshare-server")
    assert props(g)["Result"] == "success"
    g.ok("DEBIAN_FRONTEND=noninteractive apt-get -o Dpkg::Options::=--force-unsafe-io "
         "purge -y pageshare-server")
    assert g.ok("ls /etc/pageshare").split() == ["server.toml"]
    after = g.ok(f"ls /var/cache/pageshare-server /lib/systemd/system/{UNIT} 2>&1; true")
    assert after.count("No such file or directory") == 2, after
    assert UNIT not in g.ok("ls /etc/systemd/system/multi-user.target.wants")
    lap("stop-purge")


STARTED = r"^Started (pageshare-server.service - )?pageshare page server"


def assert_in_order(text: str, patterns: list[str]) -> None:
    at = 0
    for pat in patterns:
        m = re.compile(pat, re.M).search(text, at)
        assert m, f"/{pat}/ not found after offset {at} of:\n{text}"
        at = m.end()


def props(g: Agent) -> dict[str, str]:
    out = g.ok(f"systemctl show {UNIT} -p ActiveState -p SubState -p MainPID -p Type "
               "-p WatchdogUSec -p NRestarts -p Result -p StatusText")
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def status(g: Agent) -> dict[str, Any]:
    data = json.loads(g.ok("pageshare-server status --json"))
    (img,) = [i for i in data["images"] if i["name"] == "test"]
    result: dict[str, Any] = img
    return result


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
        _, out = g.run("pageshare-server status --json; systemctl status --no-pager "
                       f"{UNIT}; journalctl -u {UNIT} --no-pager -n 40 -o cat")
        raise AssertionError(f"{e}\nin the guest:\n{out}") from None
    assert st["state"] == "serving" and st["blocks"] == blocks, st
    table = g.ok("perl /mnt/client.pl /run/pageshare/test.sock")
    m = re.search(r"TABLE version=2 flags=(\d+) generation=(\d+) entries=(\d+) pid=(\d+)", table)
    assert m, table
    assert (int(m.group(2)), int(m.group(3))) == (generation, blocks), table
    st["pid_table"] = int(m.group(4))
    return st


def new_pid(g: Agent, old: int) -> int | None:
    p = props(g)
    pid = int(p["MainPID"])
    return pid if p["ActiveState"] == "active" and pid not in (0, old) else None
