"""pageshare-server's Debian package under a real systemd.

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
nothing until /etc/pageshare/server.toml exists; it sets KSM's run = 1 and
khugepaged's max_ptes_shared = 0 at install and at boot (tmpfiles.d), and
an operator's /etc/tmpfiles.d copy overrides them; ``systemd-analyze
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

import json
import os
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
    UNIT,
    USE_REPO,
    Agent,
    booted,
    build_deb,
    guest_repo,
    payload_dir,
    payload_disk,
    payload_list,
    served_image,
    serving,
    wait_until,
)
from pageshare import golden

pytestmark = pytest.mark.build

# Golden image variant -> (Debian suite, whether the slow steps run there).
# Debian 12 runs everything; Debian 13 the install, start, reload, crash
# restart, journal and purge (the watchdog's 30 s and the upgrade once is
# enough).
VARIANTS = {"small": ("bookworm", True), "trixie": ("trixie", False)}
LISTS = "/var/lib/pageshare"

assert os.geteuid() == 0, "boots a guest and builds a package: run as root"


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
    payload = payload_dir(tmp_path, repo, (deb,))
    rnd = random.Random(12)
    data = bytearray(rnd.randbytes(16 << 20))
    data[4 << 20 : 6 << 20] = bytes(2 << 20)
    ident = served_image(payload, bytes(data))
    lists = {
        release: payload_list(payload, ident, release, stride)
        for release, stride in (("v1", 3), ("v2", 5))
    }
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
    g.ok(USE_REPO)
    out = g.ok(f"{INSTALL} ./{deb}", timeout=900)
    assert "Setting up pageshare-server" in out, out
    assert g.ok("command -v qemu-storage-daemon").strip() == "/usr/bin/qemu-storage-daemon"
    lap("install")

    # Host settings: applied at install, and again at every boot by
    # systemd-tmpfiles-setup.service, whose command runs here instead of a
    # reboot (the unit refuses a manual start).
    ksm_run = "/sys/kernel/mm/ksm/run"
    ptes = "/sys/kernel/mm/transparent_hugepage/khugepaged/max_ptes_shared"
    assert g.ok("test -f /usr/lib/tmpfiles.d/pageshare-server.conf && echo y").strip() == "y"
    assert g.ok(f"cat {ksm_run} {ptes}").split() == ["1", "0"]
    g.ok(f"echo 0 > {ksm_run} && echo 256 > {ptes}")
    assert g.ok(f"cat {ksm_run} {ptes}").split() == ["0", "256"]
    setup = g.ok("systemctl show -p ExecStart --value systemd-tmpfiles-setup.service")
    boot_cmd = re.search(r"argv\[\]=(systemd-tmpfiles [^;]*--create[^;]*?) ;", setup)
    assert boot_cmd, setup
    g.ok(boot_cmd.group(1))
    assert g.ok(f"cat {ksm_run} {ptes}").split() == ["1", "0"]
    # An operator's copy in /etc replaces the package's.
    g.ok(
        "sed 's/max_ptes_shared - - - - 0/max_ptes_shared - - - - 7/' "
        "/usr/lib/tmpfiles.d/pageshare-server.conf > /etc/tmpfiles.d/pageshare-server.conf && "
        "systemd-tmpfiles --create pageshare-server.conf && "
        "rm /etc/tmpfiles.d/pageshare-server.conf"
    )
    assert g.ok(f"cat {ptes}").strip() == "7"
    g.ok("systemd-tmpfiles --create pageshare-server.conf")
    assert g.ok(f"cat {ptes}").strip() == "0"

    # Installed: enabled, but nothing runs until /etc/pageshare/server.toml exists.
    assert g.ok("systemctl is-enabled pageshare-server").strip() == "enabled"
    rc, state = g.run("systemctl is-active pageshare-server")
    assert rc != 0 and state.strip() == "inactive", state
    shown = g.ok(f"systemctl show {UNIT} -p ConditionResult -p ExecMainPID -p FragmentPath")
    assert "ConditionResult=no" in shown and "ExecMainPID=0" in shown, shown
    # /lib on Debian 12; Debian 13's systemd finds it through /lib -> usr/lib
    assert re.search(
        r"^FragmentPath=(/usr)?/lib/systemd/system/pageshare-server.service$", shown, re.M
    ), shown
    assert "pageshare-serve" not in g.ok("cat /proc/[0-9]*/comm 2>/dev/null; true"), (
        "the server runs without a configuration"
    )
    assert (
        g.ok("dpkg-query -W -f='${Conffiles}' pageshare-server").split()[0]
        == "/etc/pageshare/server.example.toml"
    )
    assert g.ok("test ! -e /etc/pageshare/server.toml && ls /etc/pageshare").split() == [
        "server.example.toml"
    ]
    assert "ExecStart=/usr/bin/pageshare-server run" in g.ok(f"systemctl cat {UNIT}")
    # The installed unit verifies (this includes its ExecStart binary).
    rc, out = g.run(f"systemd-analyze verify /lib/systemd/system/{UNIT}")
    assert rc == 0 and out.strip() == "", out
    g.ok("pageshare-server check-config /etc/pageshare/server.example.toml")
    lap("installed-state")

    # --- configure: an image, two list releases, "current" -> v1.
    g.ok(
        f"mkdir -p {LISTS}/images {LISTS}/releases && "
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
        "pageshare-server check-config /etc/pageshare/server.toml"
    )

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
    assert int(fields["CapBnd"], 16) == 1 << 2, fields["CapBnd"]  # CAP_DAC_READ_SEARCH
    assert int(fields["CapEff"], 16) & ~(1 << 2) == 0, fields["CapEff"]
    assert fields["NoNewPrivs"] == "1" and fields["Seccomp"] == "2", fields
    assert g.ok(f"readlink /proc/{pid1}/ns/mnt") != g.ok("readlink /proc/1/ns/mnt")
    # ProtectSystem=strict: /usr is read-only in its namespace.
    rc, out = g.run(f"nsenter -t {pid1} -m touch /usr/pageshare-probe")
    assert rc != 0 and "Read-only file system" in out, out
    exposure = g.ok(f"systemd-analyze security {UNIT} --no-pager | tail -1")
    print(f"systemd-analyze security: {exposure.strip()}")
    m = re.search(r"exposure level for \S+: (\d+\.\d+)", exposure)
    assert m and float(m.group(1)) < 4.0, exposure

    # Metrics answer on the default listener.
    metrics = g.ok(
        "exec 5<>/dev/tcp/127.0.0.1/9477 && "
        "printf 'GET /metrics HTTP/1.0\\r\\nHost: localhost\\r\\n\\r\\n' >&5 && "
        "timeout 10 cat <&5"
    )
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
    g.ok(
        "cp /etc/pageshare/server.toml /root/server.toml.good && "
        "printf 'socket_dir = [\\n' >> /etc/pageshare/server.toml"
    )
    rc, out = g.run("systemctl reload pageshare-server")
    assert rc != 0, out
    img = [
        i
        for i in json.loads(
            g.ok("pageshare-server status --json --socket /run/pageshare/control.sock")
        )["images"]
        if i["name"] == "test"
    ]
    assert img and img[0]["generation"] == 2 and img[0]["blocks"] == n2, img
    show = props(g)
    assert show["ActiveState"] == "active" and int(show["MainPID"]) == pid1, show
    typo = g.ok(f"journalctl -u {UNIT} --no-pager -o cat -t pageshare-server")
    assert re.search(r"error: /etc/pageshare/server.toml: TOML parse error at line \d+", typo), (
        typo[-2000:]
    )
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
    own = {
        pid1: [
            rf"{loading} \(start-up\)",
            rf"^image test: published generation 1: {n1} ",
            rf"{loading} \(reload requested\)",
            rf"^image test: published generation 2: {n2} ",
        ]
    }
    pid, restarts = pid1, 0

    if full:
        # --- watchdog: a hung server (SIGSTOP) is killed and restarted.
        g.ok(f"kill -STOP {pid}")
        old, pid = pid, wait_until("a restart after the watchdog", lambda: new_pid(g, pid1), 120, 2)
        st = serving(g, 1, n2)
        assert st["pid_table"] == pid, st
        restarts += 1
        said += [
            r"Watchdog timeout \(limit 30s\)!",
            rf"Killing process {old} \(pageshare-serve\) with signal SIGABRT",
            r"Main process exited, code=(killed|dumped), status=6/ABRT",
            r"Failed with result 'watchdog'",
            rf"Scheduled restart job, restart counter is at {restarts}\.",
            STARTED,
        ]
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
    said += [
        r"Main process exited, code=killed, status=9/KILL",
        r"Failed with result 'signal'",
        rf"Scheduled restart job, restart counter is at {restarts}\.",
        STARTED,
    ]
    own[pid] = restarted
    lap("sigkill")

    if full:
        # --- an upgrade (the same version again) restarts the running server
        # and leaves the operator's configuration alone.
        conf = g.ok("sha256sum /etc/pageshare/server.toml")
        out = g.ok(
            f"cd /mnt && DEBIAN_FRONTEND=noninteractive apt-get {APT} install -y "
            f"--reinstall ./{deb}",
            timeout=300,
        )
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
    entries = [
        json.loads(line)
        for line in g.ok(f"journalctl -u {UNIT} --no-pager -o json").splitlines()
        if line
    ]
    assert_in_order(
        "\n".join(str(e["MESSAGE"]) for e in entries if e.get("SYSLOG_IDENTIFIER") == "systemd"),
        said,
    )
    for pid, lines in own.items():
        mine = [
            e
            for e in entries
            if e.get("SYSLOG_IDENTIFIER") == "pageshare-server" and int(e.get("_PID", 0)) == pid
        ]
        text = "\n".join(str(e["MESSAGE"]) for e in mine)
        assert_in_order(text, lines)
        assert re.search(
            "^listening: control /run/pageshare/control.sock, 1 image socket", text, re.M
        ), text
        # The guest kernel lacks merge_pages: said at warning priority, and in the metrics.
        prio = [e["PRIORITY"] for e in mine if str(e["MESSAGE"]).startswith("DEGRADED MODE")]
        assert prio == (["4"] if degraded.group(1) == "1" else []), (prio, text)

    # --- stop, then purge: gone, the operator's configuration stays.
    g.ok("systemctl stop pageshare-server")
    assert props(g)["Result"] == "success"
    g.ok(
        "DEBIAN_FRONTEND=noninteractive apt-get -o Dpkg::Options::=--force-unsafe-io "
        "purge -y pageshare-server"
    )
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
    out = g.ok(
        f"systemctl show {UNIT} -p ActiveState -p SubState -p MainPID -p Type "
        "-p WatchdogUSec -p NRestarts -p Result -p StatusText"
    )
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def status(g: Agent) -> dict[str, Any]:
    data = json.loads(g.ok("pageshare-server status --json"))
    (img,) = [i for i in data["images"] if i["name"] == "test"]
    result: dict[str, Any] = img
    return result


def new_pid(g: Agent, old: int) -> int | None:
    p = props(g)
    pid = int(p["MainPID"])
    return pid if p["ActiveState"] == "active" and pid not in (0, old) else None
