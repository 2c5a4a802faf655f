"""pageshare-qemu's Debian package, installed in a booted golden image.

The package (``packaging/debs.py pageshare-qemu``: the patched QEMU under
/usr/lib/pageshare-qemu) and pageshare-server's are built on the host;
a golden image boots with systemd (TCG here) with a second, read-only disk
holding both .debs, a flat apt repository with what the image lacks for
them (resolved and downloaded on the host for the image's own dpkg
status, as in ``test_server_package_guest``), a 16 MiB image and a list
for it.  The guest has no network.  The host drives it through the same
shell agent and checks what an operator would see:

- ``apt-get install ./pageshare-qemu_*.deb`` resolves its Depends from the
  repository; every file it installs is under /usr/lib/pageshare-qemu or
  named pageshare-qemu, none in Debian's QEMU paths; its links to SeaBIOS
  and iPXE resolve for this suite; the binaries run (QEMU 10.0, the
  ``pageshare`` driver in qemu-img's formats and in qemu-system's
  ``-blockdev``; ``-L help`` names its own data directories);

and on Debian 12 (the small image) also:

- the installed qemu-system-x86_64 boots SeaBIOS with a virtio NIC (iPXE's
  ROM) and a kernel (the linuxboot_dma option ROM) to "Booting from ROM";
- pageshare-server's package installs with pageshare-qemu satisfying its
  qemu-storage-daemon dependency (no Debian QEMU package comes with it),
  starts, says it reads images with pageshare-qemu's qemu-storage-daemon,
  and serves; the installed qemu-system-x86_64 opens the filter on the
  served image, gets the server's table and serves reads from it
  (``mode=copy``: the guest kernel lacks merge_pages);
- Debian's own QEMU (qemu-system-x86, qemu-utils: 7.2) installs beside it,
  runs and boots the same way, lacks the driver, and ``dpkg --verify``
  finds all of Debian's QEMU files intact; pageshare-server now prefers
  Debian's qemu-storage-daemon (PATH);
- ``apt-get remove pageshare-qemu`` leaves pageshare-server installed (its
  dependency is satisfied by Debian's qemu-system-common), removes
  /usr/lib/pageshare-qemu entirely, and Debian's QEMU still verifies and
  runs.

On Debian 13 (trixie) the binaries built on Debian 12 install (its
libglib2.0-0t64 provides libglib2.0-0) and run; the rest is the same code
and is left to the Debian 12 run (about 3.5 minutes here; Debian 13's
about 1.5).
"""

from __future__ import annotations

import json
import random
import re
import time
from pathlib import Path
from typing import Any

import pytest
from package_guest import (
    APT,
    INSTALL,
    PERL_CLIENT,
    USE_REPO,
    Agent,
    booted,
    build_deb,
    guest_repo,
    payload_dir,
    payload_disk,
    payload_list,
    serve_payload_image,
    served_image,
    serving,
    wait_until,
)
from pageshare import golden

pytestmark = pytest.mark.build

# Golden image variant -> (Debian suite, whether the Debian 12 steps run).
VARIANTS = {"small": ("bookworm", True), "trixie": ("trixie", False)}
LIB = "/usr/lib/pageshare-qemu"
LISTS = "/var/lib/pageshare"
DEBIAN_QEMU = ("qemu-system-x86", "qemu-utils")

# QMP over a Unix socket from the guest's shell: qmp_capabilities, then each
# command; prints each reply line (events skipped) for the host to parse.
QMP_CLIENT = r"""
use strict; use IO::Socket::UNIX;
my $s = IO::Socket::UNIX->new(Type => SOCK_STREAM(), Peer => shift @ARGV) or die "connect: $!\n";
$SIG{ALRM} = sub { die "no QMP reply within 60 s\n" }; alarm 60;
my $greeting = <$s>;
for my $cmd ('{"execute":"qmp_capabilities"}', @ARGV) {
  print $s "$cmd\n";
  while (my $line = <$s>) {
    next if $line =~ /^\{"timestamp"/;
    print $line unless $cmd =~ /qmp_capabilities/;
    last;
  }
}
"""

# SeaBIOS's debug port shows how far the firmware got; "Booting from ROM"
# is the linuxboot_dma option ROM taking over, after iPXE's ROM for the NIC
# was loaded (QEMU refuses to start when a NIC's ROM file is missing).
BOOT_PROBE = (
    "rm -f /tmp/sb.log; K=$(ls /boot/vmlinuz-* | head -1); "
    "{qemu} -M q35 -accel tcg -m 256 -nodefaults -display none -no-reboot "
    "-chardev file,id=dbg,path=/tmp/sb.log -device isa-debugcon,iobase=0x402,chardev=dbg "
    "-netdev hubport,id=n0,hubid=0 -device virtio-net-pci,netdev=n0 "
    "-kernel $K -append console=ttyS0 -serial none -daemonize -pidfile /tmp/sb.pid && "
    "for i in $(seq 240); do grep -aq 'Booting from ROM' /tmp/sb.log && break; sleep 0.5; done; "
    "kill $(cat /tmp/sb.pid); grep -a 'SeaBIOS (version\\|Booting from ROM' /tmp/sb.log"
)


@pytest.mark.vm
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_qemu_package_installs_beside_debian_qemu(variant: str, tmp_path: Path) -> None:
    suite, full = VARIANTS[variant]
    t0 = time.monotonic()
    times: dict[str, float] = {}

    def lap(name: str) -> None:
        times[name] = round(time.monotonic() - t0 - sum(times.values()), 1)

    qemu_deb = build_deb("pageshare-qemu")
    server_deb = build_deb("pageshare-server")
    img = golden.build_image(variant)
    repo = guest_repo(
        img, suite, qemu_deb, tmp_path, also=(str(server_deb), *(DEBIAN_QEMU if full else ()))
    )
    lap("build")

    payload = payload_dir(tmp_path, repo, (qemu_deb, server_deb))
    ident = served_image(payload, random.Random(13).randbytes(16 << 20))
    n1 = len(payload_list(payload, ident, "v1", 3).blocks)
    (payload / "client.pl").write_text(PERL_CLIENT)
    (payload / "qmp.pl").write_text(QMP_CLIENT)
    disk = payload_disk(payload, tmp_path / "payload.ext4")
    with booted(img, disk, tmp_path) as g:
        lap("boot")
        run_checks(g, qemu_deb.name, server_deb.name, n1, full, lap)
    print(f"phases (s): {times}")


def run_checks(g: Agent, qemu_deb: str, server_deb: str, n1: int, full: bool, lap: Any) -> None:
    g.ok("mount -o ro /dev/vdb /mnt && " + USE_REPO)

    # --- pageshare-qemu, from the repository, as an operator would.
    out = g.ok(f"{INSTALL} ./{qemu_deb}", timeout=600)
    assert "Setting up pageshare-qemu" in out, out
    lap("install-qemu")
    files = g.ok("dpkg -L pageshare-qemu").split()
    ours = re.compile(
        rf"^(/\.|/usr|/usr/(bin|lib|share|share/doc|share/man|share/man/man1)|"
        rf"{LIB}(/.*)?|/usr/bin/pageshare-qemu-[\w-]+|"
        r"/usr/share/doc/pageshare-qemu(/.*)?|"
        r"/usr/share/man/man1/pageshare-qemu[\w-]*\.1\.gz)$"
    )
    assert [f for f in files if not ours.match(f)] == [], files
    assert f"{LIB}/bin/qemu-system-x86_64" in files
    # No Debian QEMU came with it, and nothing is in its paths.
    installed = g.ok("dpkg-query -W -f='${db:Status-Abbrev} ${Package}\\n' 'qemu*' || true")
    assert not re.search(r"^ii", installed, re.M), installed
    assert g.run("ls /usr/bin/qemu-* 2>&1")[0] != 0
    # Every firmware link resolves, except iPXE's for the other suite.
    links = g.ok(
        f"cd {LIB}/share && for l in qemu/* qemu-firmware/*; do "
        '[ -L $l ] && echo "$l $(readlink -f $l) $([ -e $l ] && echo ok)"; '
        "done"
    ).splitlines()
    resolved = {line.split()[0]: line.endswith(" ok") for line in links}
    assert resolved["qemu/bios-256k.bin"] and resolved["qemu/vgabios-stdvga.bin"], links
    ipxe = {d: resolved[f"{d}/efi-virtio.rom"] for d in ("qemu", "qemu-firmware")}
    assert ipxe == (
        {"qemu": True, "qemu-firmware": False} if full else {"qemu": False, "qemu-firmware": True}
    ), links
    dangling = [k for k, ok in resolved.items() if not ok]
    assert all(
        k.endswith(".rom") and k.startswith("qemu-firmware/" if full else "qemu/") for k in dangling
    ), dangling

    # The binaries run, have the driver, and look in their own data directories.
    version = g.ok("pageshare-qemu-img --version")
    assert re.search(r"qemu-img version 10\.0\.\d+", version), version
    for b in ("qemu-io", "qemu-nbd", "qemu-storage-daemon", "qemu-system-x86_64"):
        assert "10.0." in g.ok(f"{LIB}/bin/{b} --version"), b
    formats = g.ok("pageshare-qemu-img --help | sed -n '/^Supported image formats:/,/^See /p'")
    assert "pageshare" in formats.split(), formats
    assert has_driver(g, f"{LIB}/bin/qemu-system-x86_64")
    assert g.ok(f"{LIB}/bin/qemu-system-x86_64 -L help").split() == [
        f"{LIB}/bin/../share/qemu-firmware",
        f"{LIB}/bin/../share/qemu",
    ]
    lap("qemu-checks")
    if not full:
        return
    boot = g.ok(BOOT_PROBE.format(qemu="pageshare-qemu-system-x86_64"), timeout=300)
    assert "SeaBIOS (version" in boot and "Booting from ROM" in boot, boot
    lap("boot-probe")

    # --- pageshare-server: its qemu-storage-daemon dependency is pageshare-qemu.
    out = g.ok(f"{INSTALL} ./{server_deb}", timeout=600)
    assert "Setting up pageshare-server" in out, out
    assert not re.search(r"^Setting up qemu-", out, re.M), out
    assert g.run("command -v qemu-storage-daemon")[0] != 0
    g.ok(serve_payload_image(LISTS))
    checked = g.ok("pageshare-server check-config /etc/pageshare/server.toml")
    assert f"images are read with {LIB}/bin/qemu-storage-daemon" in checked, checked
    g.ok("systemctl start pageshare-server", timeout=120)
    serving(g, 1, n1)
    journal = g.ok("journalctl -u pageshare-server --no-pager -o cat")
    assert f"images are read with {LIB}/bin/qemu-storage-daemon" in journal, journal
    lap("server")

    # The installed QEMU reads the served image through the filter, with the
    # installed server's table (copy mode: this kernel lacks merge_pages).
    node = {
        "driver": "pageshare",
        "node-name": "ps",
        "read-only": True,
        "mode": "copy",
        "x-any-buffer": True,
        "server": "/run/pageshare/test.sock",
        "file": {"driver": "file", "filename": f"{LISTS}/images/test.raw", "read-only": True},
    }
    g.ok(
        f"{LIB}/bin/qemu-system-x86_64 -M none -nodefaults -display none -daemonize "
        "-pidfile /run/psq.pid -qmp unix:/run/psq.qmp,server=on,wait=off "
        f"-blockdev '{json.dumps(node)}'",
        timeout=120,
    )
    try:
        wait_until("the filter's table", lambda: stats(g).get("generation") == 1, 120, 1)
        qmp(
            g,
            {
                "execute": "human-monitor-command",
                "arguments": {"command-line": 'qemu-io ps "read 0 4M"'},
            },
        )
        st = stats(g)
        assert st["connected"] and st["table-entries"] == n1, st
        assert st["hits"] > 0 and st["merged"] == st["hits"], st
        assert st["fallback-unproven"] == 0 and st["fallback-no-table"] == 0, st
    finally:
        g.run("kill $(cat /run/psq.pid)")
    lap("filter")

    # --- Debian's own QEMU beside it.
    pkgs = " ".join(DEBIAN_QEMU)
    out = g.ok(f"{INSTALL} {pkgs}", timeout=900)
    assert "Setting up qemu-system-x86" in out, out
    lap("install-debian-qemu")
    debian = g.ok("qemu-system-x86_64 --version && qemu-img --version")
    assert re.search(r"QEMU emulator version 7\.2", debian), debian
    assert not has_driver(g, "/usr/bin/qemu-system-x86_64")
    assert has_driver(g, f"{LIB}/bin/qemu-system-x86_64")
    for qemu in ("qemu-system-x86_64", "pageshare-qemu-system-x86_64"):
        boot = g.ok(BOOT_PROBE.format(qemu=qemu), timeout=300)
        assert "Booting from ROM" in boot, (qemu, boot)
    verify = "dpkg --verify qemu-system-x86 qemu-system-common qemu-system-data qemu-utils"
    assert g.ok(f"{verify} pageshare-qemu").strip() == ""
    # The server now finds Debian's qemu-storage-daemon first, on PATH.
    checked = g.ok("pageshare-server check-config /etc/pageshare/server.toml")
    assert "images are read with /usr/bin/qemu-storage-daemon" in checked, checked
    lap("debian-qemu")

    # --- removing pageshare-qemu keeps the server (Debian's qemu-system-common
    # satisfies it now) and Debian's QEMU, and leaves nothing behind.
    out = g.ok(
        f"DEBIAN_FRONTEND=noninteractive apt-get {APT} remove -y pageshare-qemu", timeout=300
    )
    assert "Removing pageshare-qemu" in out and "pageshare-server" not in out, out
    assert g.run(f"ls {LIB} 2>&1")[0] != 0
    assert g.ok(verify).strip() == ""
    assert "7.2" in g.ok("qemu-img --version")
    assert g.ok("dpkg-query -W -f='${Status}' pageshare-server") == "install ok installed"
    lap("remove")


def qmp(g: Agent, *commands: dict[str, Any]) -> list[dict[str, Any]]:
    args = " ".join("'" + json.dumps(c) + "'" for c in commands)
    out = g.ok(f"perl /mnt/qmp.pl /run/psq.qmp {args}")
    replies = [json.loads(line) for line in out.splitlines() if line.strip()]
    assert all("return" in r for r in replies), replies
    return replies


def stats(g: Agent) -> dict[str, Any]:
    (reply,) = qmp(g, {"execute": "query-blockstats", "arguments": {"query-nodes": True}})
    (node,) = [n for n in reply["return"] if n.get("node-name") == "ps"]
    result: dict[str, Any] = node.get("driver-specific", {})
    return result


def has_driver(g: Agent, qemu: str) -> bool:
    """Whether ``qemu`` knows -blockdev driver=pageshare: the patched one
    wants the filter's options, any other refuses the driver name."""
    rc, out = g.run(
        f"{qemu} -M none -nodefaults -display none -S -blockdev driver=pageshare,node-name=ps"
    )
    assert rc != 0, out
    if "does not accept value 'pageshare'" in out:
        return False
    assert "Parameter 'file' is missing" in out, out
    return True
