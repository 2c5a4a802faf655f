"""`pageshare host check`: what this host lacks to share pages.

Each check yields findings (severity ok / warning / error, what, why it
matters, what to do).  The exit status is the worst severity: 0 all ok,
1 warnings, 2 errors.  With --json every finding, including a check that
itself failed, is reported as JSON on stdout.

Checks: the merge_pages kernel series (its sysfs counters) and whether
GRUB's default entry boots a kernel with it (grub.cfg, grubenv), KSM in merge
mode, khugepaged leaving shared pages alone (max_ptes_shared = 0), QEMU
binaries with the pageshare block driver, a running pageshare-server with
its images published (over its control socket), the server's Redis,
running guests whose QEMU has no pageshare node, and, where AppArmor is on,
that libvirt's profiles include pageshare-host's parts and still compile:
its domains' (QEMU may run pageshare-qemu and reach the server) and
libvirtd's (it may run pageshare-qemu).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import shlex
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse
from xml.etree import ElementTree

from ..errors import parse_args_or_exit_code
from . import grubboot
from .qmp import QMP, QMPError, QMPStream, qmp_socket_of
from .server_control import (
    DEFAULT_CONTROL,
    UNREACHABLE,
    server_status,
    unreachable_reason,
)

KSM_DIR = Path("/sys/kernel/mm/ksm")
KHUGEPAGED_DIR = Path("/sys/kernel/mm/transparent_hugepage/khugepaged")
# Where the pageshare-server package keeps the two settings above at boot
# (packaging/pageshare-server/debian/pageshare-server.tmpfiles).
TMPFILES = Path("/usr/lib/tmpfiles.d/pageshare-server.conf")
APPARMOR_ENABLED = Path("/sys/module/apparmor/parameters/enabled")
APPARMOR_D = Path("/etc/apparmor.d")
SEVERITIES = {"ok": 0, "warning": 1, "error": 2}


@dataclass
class Finding:
    check: str
    severity: str  # ok | warning | error
    what: str
    why: str = ""
    fix: str = ""
    details: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------- kernel and KSM


def _read_grub(grub_cfg: Path, grubenv: Path) -> tuple[grubboot.GrubDefault | None, str]:
    """grub.cfg's default entry, or None and why not."""
    try:
        text = grub_cfg.read_text(errors="replace")
    except FileNotFoundError:
        return None, f"no {grub_cfg} (GRUB is not this host's boot loader?)"
    except OSError as e:
        return None, f"{grub_cfg} is not readable ({e.strerror})"
    try:
        env = grubenv.read_text(errors="replace")
    except OSError:
        env = ""
    return grubboot.grub_default(text, env), ""


def _grub_default_text(g: grubboot.GrubDefault) -> str:
    """What GRUB's default boots and why, in a few words."""
    boots = g.release or "no Linux kernel"
    how = g.source + (", which matches no entry, so GRUB takes the first" if g.fallback else "")
    text = f"{boots} (entry '{g.titles}'; {how})"
    if g.next_entry:
        text += f"; a grub-reboot choice boots once first (next_entry={g.next_entry})"
    return text


def _grub_fix(
    g: grubboot.GrubDefault,
    installed: list[str],
    boot: Path,
    grub_cfg: Path,
    snippet: Path,
) -> str:
    """How to make GRUB boot the newest pageshare kernel by default, for this host."""
    guide = '(docs/install.md, "Keeping it the default boot entry")'
    if not installed:
        return (
            f"{boot} holds no pageshare kernel (was its package removed?): `apt install` "
            "the linux-image-*-pageshare-cloud-amd64 .deb again; its postinst runs "
            f"update-grub {guide}"
        )
    newest = installed[-1]
    ident = grubboot.entry_for(g.menu, newest)
    if not ident:
        return (
            f"run `update-grub`: {grub_cfg} has no entry for {newest} yet; then "
            f"`pageshare host check` again {guide}"
        )
    if g.source.startswith("saved_entry"):
        return (
            "GRUB_DEFAULT=saved here, which pageshare-host's "
            f"{snippet.name} leaves alone: `grub-set-default '{ident}'`, then reboot {guide}"
        )
    if snippet.exists():
        stale = ""
        with contextlib.suppress(OSError):
            if snippet.stat().st_mtime > grub_cfg.stat().st_mtime:
                stale = f" ({grub_cfg} is older than {snippet})"
        return (
            f"run `update-grub`{stale}: pageshare-host's {snippet} makes the newest "
            "pageshare kernel the default when GRUB_DEFAULT is 0 or unset and "
            "PAGESHARE_GRUB_DEFAULT is not false (update-grub prints what it did); if "
            "you set GRUB_DEFAULT yourself, make it "
            f'"{ident}" in /etc/default/grub and run `update-grub`; then reboot {guide}'
        )
    return (
        f"pageshare-host's {snippet}, which makes the newest pageshare kernel the "
        "default at every update-grub, is missing: `apt install --reinstall -o "
        "Dpkg::Options::=--force-confmiss pageshare-host`, then `update-grub`; or set "
        f'GRUB_DEFAULT="{ident}" in /etc/default/grub and run `update-grub`; then '
        f"reboot {guide}"
    )


def check_kernel(
    ksm_dir: Path = KSM_DIR,
    boot: Path = grubboot.BOOT,
    grub_cfg: Path = grubboot.GRUB_CFG,
    grubenv: Path = grubboot.GRUBENV,
    snippet: Path = grubboot.SNIPPET,
    release: str | None = None,
) -> Iterator[Finding]:
    """The running kernel's series, and which kernel GRUB boots next by default
    (grub.cfg's default entry, resolved as GRUB does: pageshare.host.grubboot)."""
    rel = release or platform.release()
    counter = ksm_dir / "merge_page_merged"
    installed = grubboot.pageshare_kernels(boot)
    grub, no_grub = _read_grub(grub_cfg, grubenv)
    grub_details: dict[str, Any] = {"pageshare_kernels": installed}
    if grub is None:
        grub_details["grub"] = no_grub
    else:
        grub_details.update(
            grub_default=grub.spec,
            grub_default_source=grub.source,
            grub_default_release=grub.release,
            grub_default_fallback=grub.fallback,
        )
    if counter.exists():
        counters = {
            n: (ksm_dir / n).read_text().strip()
            for n in ("merge_page_merged", "merge_page_sources", "merge_page_failed")
            if (ksm_dir / n).exists()
        }
        what = f"kernel {rel} has the merge_pages series"
        if grub is not None and grubboot.is_pageshare(grub.release):
            what += "; GRUB's default entry boots " + (
                "it" if grub.release == rel else f"the pageshare kernel {grub.release}"
            )
        yield Finding("kernel", "ok", what, details={"release": rel, **counters, **grub_details})
        if grub is not None and not grubboot.is_pageshare(grub.release):
            yield Finding(
                "kernel",
                "warning",
                f"GRUB's default entry boots {grub.release or 'no Linux kernel'}, not a "
                "pageshare kernel: after a reboot this host runs without the merge_pages "
                "series",
                why=f"GRUB's default: {_grub_default_text(grub)}. update-grub lists kernels "
                "newest first and Debian's GRUB_DEFAULT=0 boots the first, so a Debian "
                "kernel of a later 6.12 patch level becomes the default when it is "
                "installed; after the reboot the filter reads every block from disk and "
                "guests share nothing",
                fix=_grub_fix(grub, installed, boot, grub_cfg, snippet),
                details={"release": rel, **grub_details},
            )
        return
    what = f"kernel {rel} lacks the merge_pages series ({counter} does not exist)"
    why = (
        "without merge_pages(2) the QEMU filter cannot map the server's pages into guest "
        "RAM: it finds no merge_pages(2) (ENOSYS) and reads every block from disk, as "
        "without the filter (fallback-unsupported), and guests share nothing at read time"
    )
    details = {"release": rel, "missing": str(counter), **grub_details}
    if not installed:
        yield Finding(
            "kernel",
            "error",
            what,
            why=why,
            fix="install and boot the series' kernel package: `make kernel-package` in a "
            "pageshare checkout builds linux-image-6.12.*-pageshare-cloud-amd64 from the "
            "patches in kernel-syscall/ (about an hour on 2 cores) and prints the paths of "
            "two .debs; `apt install` the first (linux-image-*; the second is its headers) "
            'and reboot into it (docs/install.md, "The patched kernel", also in '
            "/usr/share/doc/pageshare-host/); on 6.13+ the syscall numbers belong to other "
            "calls, so a stock kernel is never used",
            details=details,
        )
        return
    newest = installed[-1]
    if grub is None:
        what += f"; the pageshare kernel {newest} is installed in {boot} but not running"
        fix = (
            f"reboot into {newest}: {no_grub}, so choose it in your boot loader's menu "
            'and make it the default there (docs/install.md, "Keeping it the default '
            'boot entry")'
        )
    elif grubboot.is_pageshare(grub.release):
        what += (
            f"; the pageshare kernel {newest} is installed and GRUB's default entry boots "
            f"{'it' if grub.release == newest else grub.release}"
        )
        fix = (
            "reboot: this boot was not GRUB's default (another kernel chosen in GRUB's "
            "menu or by grub-reboot, or grub.cfg was written after it booted, as update-grub "
            "does when the kernel or pageshare-host is installed)"
        )
    else:
        what += (
            f"; the pageshare kernel {newest} is installed but GRUB's default entry boots "
            f"{_grub_default_text(grub)}"
        )
        fix = _grub_fix(grub, installed, boot, grub_cfg, snippet)
    yield Finding("kernel", "error", what, why=why, fix=fix, details=details)


def check_ksm(ksm_dir: Path = KSM_DIR) -> Iterator[Finding]:
    run = ksm_dir / "run"
    if not run.exists():
        yield Finding(
            "ksm",
            "error",
            f"KSM is not available ({run} does not exist)",
            why="merge_pages merges into KSM pages; without KSM nothing is shared",
            fix="boot a kernel with CONFIG_KSM=y (the kernel-syscall/ series has it)",
        )
        return
    value = run.read_text().strip()
    if value == "1":
        yield Finding("ksm", "ok", "KSM is in merge mode (run = 1)", details={"run": value})
        return
    yield Finding(
        "ksm",
        "error",
        f"KSM is not in merge mode ({run} = {value}, not 1)",
        why="merge_pages fails with EOPNOTSUPP unless ksmd runs in merge mode: the filter "
        "reads listed blocks from disk (QEMU warns once) and guests share no pages",
        fix=f"echo 1 > {run}; the pageshare-server package sets it at every boot "
        f"({TMPFILES}, which `systemd-tmpfiles --create {TMPFILES.name}` applies now); "
        "pages_to_scan may stay 0 if only merge_pages should merge",
        details={"run": value},
    )


def check_khugepaged(khugepaged_dir: Path = KHUGEPAGED_DIR) -> Iterator[Finding]:
    knob = khugepaged_dir / "max_ptes_shared"
    if not knob.exists():
        yield Finding(
            "khugepaged",
            "ok",
            "no khugepaged in this kernel (no transparent huge "
            "pages): nothing collapses merged pages",
            details={"max_ptes_shared": None},
        )
        return
    value = knob.read_text().strip()
    if value == "0":
        yield Finding(
            "khugepaged",
            "ok",
            "khugepaged never collapses shared pages (max_ptes_shared = 0)",
            details={"max_ptes_shared": 0},
        )
        return
    yield Finding(
        "khugepaged",
        "warning",
        f"khugepaged may unshare merged pages ({knob} = {value}, not 0)",
        why=f"khugepaged collapses a 2 MiB range of guest RAM (QEMU asks for huge pages "
        f"there) that holds up to {value} shared pages into a new huge page, copying "
        "them: the server's pages the filter merged become private copies again (the "
        "filter's booted-guest test: 65 of 448 after three scans), until ksmd merges "
        "them once more",
        fix=f"echo 0 > {knob}; the pageshare-server package sets it at every boot "
        f"({TMPFILES}, which `systemd-tmpfiles --create {TMPFILES.name}` applies now); "
        "guest RAM without shared pages still gets huge pages",
        details={"max_ptes_shared": int(value) if value.isdigit() else value},
    )


# --------------------------------------------------------------------------- QEMU binaries


def _has_driver_img(binary: str) -> bool | None:
    """qemu-img / qemu-io / qemu-nbd / qemu-storage-daemon: "Supported formats"."""
    try:
        p = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"Supported (?:image )?formats:\s*(.*?)(?:\n\s*\n|\Z)", p.stdout + p.stderr, re.S)
    if not m:
        return None
    return "pageshare" in m.group(1).split()


def _has_driver_system(binary: str, timeout: float = 60.0) -> bool | None:
    """qemu-system-*: is "pageshare" a BlockdevDriver in its QMP schema?

    The schema reply is read before QEMU is told to go: a "quit" sent with
    the request could end QEMU before it has flushed a reply larger than the
    pipe."""
    try:
        p = subprocess.Popen(
            [binary, "-M", "none", "-nodefaults", "-display", "none", "-S", "-qmp", "stdio"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
    except OSError:
        return None
    timer = threading.Timer(timeout, p.kill)
    timer.start()
    try:
        assert p.stdin is not None and p.stdout is not None
        schema = QMPStream(p.stdout, p.stdin).command("query-qmp-schema")
        if not isinstance(schema, list):
            return None
        return any(isinstance(e, dict) and "pageshare" in (e.get("values") or []) for e in schema)
    except (OSError, ValueError, QMPError):
        return None
    finally:
        timer.cancel()
        p.kill()
        p.wait()


def has_pageshare_driver(binary: str) -> bool | None:
    """True/False, or None if the binary could not be asked."""
    if Path(binary).name.startswith("qemu-system-"):
        return _has_driver_system(binary)
    return _has_driver_img(binary)


QEMU_NAMES = re.compile(r"^(qemu-system-[\w-]+|qemu-img)$")
# Where the pageshare-qemu package (packaging/debs.py) installs the patched QEMU.
PACKAGE_QEMU_BIN = Path("/usr/lib/pageshare-qemu/bin")


def qemu_binaries(
    extra: Iterable[str], use_path: bool = True, package_bin: Path = PACKAGE_QEMU_BIN
) -> list[str]:
    """qemu-system-* and qemu-img on PATH and in pageshare-qemu's bin/, plus
    each --qemu (a binary or a bin/ dir)."""
    found: list[str] = []
    seen: set[str] = set()

    def add(p: Path) -> None:
        try:
            real = str(p.resolve())
        except OSError:
            return
        if real not in seen and os.access(p, os.X_OK) and p.is_file():
            seen.add(real)
            found.append(str(p))

    for e in extra:
        p = Path(e)
        if p.is_dir():
            for c in sorted(p.iterdir()):
                if QEMU_NAMES.match(c.name):
                    add(c)
        else:
            add(p)
    if use_path:
        for d in [*os.environ.get("PATH", "").split(os.pathsep), str(package_bin)]:
            if d and Path(d).is_dir():
                for c in sorted(Path(d).iterdir()):
                    if QEMU_NAMES.match(c.name):
                        add(c)
    return found


def check_qemu(extra: list[str], use_path: bool = True) -> Iterator[Finding]:
    binaries = qemu_binaries(extra, use_path)
    missing = [e for e in extra if not Path(e).exists()]
    for m in missing:
        yield Finding(
            "qemu",
            "error",
            f"--qemu {m} does not exist",
            fix="give the patched build's bin/ directory or one of its binaries "
            "(qemu-patches/build.py prints the directory)",
        )
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(has_pageshare_driver, binaries))
    good = [b for b, r in zip(binaries, results, strict=True) if r]
    for b, r in zip(binaries, results, strict=True):
        if r:
            yield Finding(
                "qemu",
                "ok",
                f"{b} has the pageshare block driver",
                details={"binary": b, "driver": True},
            )
        elif r is None:
            yield Finding(
                "qemu",
                "warning",
                f"could not ask {b} for its block drivers",
                why="a QEMU that cannot be probed may or may not have the filter",
                fix=f"run `{b} --help` or start it with -qmp stdio by hand to see why",
                details={"binary": b, "driver": None},
            )
        else:
            yield Finding(
                "qemu",
                "warning",
                f"{b} lacks the pageshare block driver",
                why="VMs started with this QEMU read their base from disk and share nothing; "
                "a -blockdev driver=pageshare line fails with it",
                fix="start VMs with the patched QEMU (qemu-patches/build.py, its bin/) "
                + ("such as " + good[0] if good else "")
                + f", or install the pageshare-qemu package ({PACKAGE_QEMU_BIN}) and "
                "point the VMs at it (libvirt: the domain's <emulator>)",
                details={"binary": b, "driver": False},
            )
    if not good:
        yield Finding(
            "qemu",
            "error",
            "no QEMU with the pageshare block driver"
            + (f" on PATH or in {PACKAGE_QEMU_BIN}" if use_path else "")
            + (" or given with --qemu" if extra else ""),
            why="the pageshare filter lives in the patched QEMU only; without it no guest "
            "uses the page server",
            fix="install the pageshare-qemu package (packaging/debs.py; it goes to "
            f"{PACKAGE_QEMU_BIN}, which is checked too), or build it with "
            "qemu-patches/build.py (prints its output dir; binaries in bin/) and put that "
            "bin/ on PATH, or pass --qemu DIR",
            details={"checked": binaries},
        )


# --------------------------------------------------------------------------- server and Redis


def redis_ping(url: str, timeout: float = 3.0) -> str:
    """Raises OSError if Redis at url cannot be reached; returns its reply."""
    u = urlparse(url)
    host, port = u.hostname or "127.0.0.1", u.port or 6379
    if u.scheme == "unix":
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(timeout)
        s.connect(u.path)
    else:
        s = socket.create_connection((host, port), timeout=timeout)
    with s:
        s.sendall(b"PING\r\n")
        reply = s.recv(128).decode(errors="replace").strip()
    if not reply:
        raise OSError("Redis closed the connection without a reply")
    # "+PONG", or "-NOAUTH ..." from a Redis with a password: reachable either way.
    return reply


# What a client's last STATS says about its table (PROTOCOL.md, STATS offset
# 104), for the states in which its guest reads the listed blocks from disk.
NOT_SHARING = {
    "base-changed": (
        "their base file changed after the server verified it, and no table of the content "
        "they read before has been proven for it since",
        "if only its owner, mode, links or times changed, the server verifies it again and "
        "they share again within seconds; if its bytes changed (someone wrote the base), "
        "restart those VMs on a base that no one modifies",
    ),
    "unproven": (
        "the server's table is not about the file they read (another file or copy, another "
        "format, a block device or a qcow2 with an external data file)",
        "point each VM's filter `server` at the socket of the server that serves its very "
        "base file (`pageshare attach` matches them by device and inode)",
    ),
}


def _not_sharing(img: dict[str, Any]) -> Iterator[Finding]:
    """A warning per reason for which clients of @img read from disk."""
    counts = img.get("clients_proof") or {}
    clients = [c for c in img.get("client_list") or [] if isinstance(c, dict)]
    for state, (why, fix) in NOT_SHARING.items():
        n = int(counts.get(state) or 0)
        if not n:
            continue
        pids = [c.get("pid") for c in clients if c.get("proof") == state]
        yield Finding(
            "image",
            "warning",
            f"image {img.get('name')}: {n} of its {img.get('clients')} VMs do not share its "
            f"pages ({state}: QEMU pids {', '.join(str(p) for p in pids)})",
            why=f"{why}; they read every block from disk",
            fix=fix,
            details={
                "name": img.get("name"),
                "path": img.get("path"),
                "proof": state,
                "clients": n,
                "pids": pids,
            },
        )


def check_server(control: Path) -> Iterator[Finding]:
    try:
        st = server_status(control)
    except UNREACHABLE as e:
        reason = unreachable_reason(e)
        yield Finding(
            "server",
            "error",
            f"no pageshare-server answers on {control} ({reason})",
            why="without a running server no image's pages are published: every VM reads its "
            "base from disk",
            fix="start it (systemctl start pageshare-server, or pageshare-server run --config "
            "FILE; see page-server/README.md); if it runs with another socket_dir, pass "
            "--control SOCKET_DIR/control.sock",
            details={"control": str(control), "error": str(e)},
        )
        return
    details = {
        k: st.get(k)
        for k in ("pid", "version", "host", "uptime_seconds", "degraded", "degraded_reason")
    }
    yield Finding(
        "server",
        "ok",
        f"pageshare-server {st.get('version')} (pid {st.get('pid')}) answers on {control}",
        details={"control": str(control), **details},
    )
    if st.get("degraded"):
        yield Finding(
            "server",
            "warning",
            f"the server runs degraded: {st.get('degraded_reason') or 'no reason given'}",
            why="a degraded server publishes tables flagged DEGRADED: QEMU copies its pages "
            "instead of merging them, so guests do not share them",
            fix="boot the pageshare kernel (the reason above: the server degrades only where "
            "the kernel lacks the series) and restart the server",
            details={"degraded_reason": st.get("degraded_reason")},
        )
    images = st.get("images") or []
    serving = 0
    for img in images:
        name = img.get("name")
        d = {
            k: img.get(k)
            for k in (
                "name",
                "path",
                "socket",
                "state",
                "message",
                "generation",
                "blocks",
                "bytes",
                "list_source",
                "list_from",
                "list_digest",
                "arena_loaded_blocks",
                "image_file",
                "last_error",
                "clients",
            )
        }
        d["degraded"] = bool(st.get("degraded"))
        if img.get("state") == "serving" and img.get("generation") is not None:
            serving += 1
            yield Finding(
                "image",
                "ok",
                f"image {name} ({img.get('path')}) published: generation "
                f"{img.get('generation')}, {img.get('blocks')} blocks, socket "
                f"{img.get('socket')}" + (", degraded" if st.get("degraded") else ""),
                details=d,
            )
        elif img.get("reverifying"):
            yield Finding(
                "image",
                "warning",
                f"image {name} ({img.get('path')}) changed on disk (a write, or only its owner, "
                "mode, links or times): the server verifies it again"
                + (f" ({img.get('message')})" if img.get("message") else ""),
                why="until it is verified again, its VMs read every block from disk; if the "
                "content is the same, the server publishes it again within seconds and "
                "the VMs share again",
                fix="nothing, if only its metadata changed (libvirt's chown at a domain's "
                "start, a chmod, a new link); chown the base to QEMU's user before the "
                "server loads it to avoid the pause; never write a base in use",
                details=d,
            )
        else:
            msg = img.get("message") or img.get("last_error") or ""
            yield Finding(
                "image",
                "warning",
                f"image {name} ({img.get('path')}) is not serving: state "
                f"{img.get('state')}" + (f" ({msg})" if msg else ""),
                why="VMs on this image read every block from disk until a list is published",
                fix="check the image path and its list (`pageshare list verify LIST --image "
                "IMAGE`), then `pageshare-server reload`; the server log says why it "
                "refused",
                details=d,
            )
        yield from _not_sharing(img)
    if serving == 0:
        yield Finding(
            "server",
            "error",
            "the server publishes no image" + ("" if images else " (none configured)"),
            why="no VM on this host can share pages",
            fix="configure [[image]] entries with a list (list_file or Redis) in the server's "
            "config and reload it (page-server/README.md)",
            details={"images": len(images)},
        )
    redis = st.get("redis")
    if isinstance(redis, dict):
        url = str(redis.get("url") or "")
        try:
            reply = redis_ping(url) if url else ""
            reached: str | None = None
        except OSError as e:
            reply, reached = "", str(e)
        d = {
            "url": url,
            "server_connected": redis.get("connected"),
            "server_last_error": redis.get("last_error"),
            "ping": reply or reached,
        }
        if redis.get("connected") and reached is None:
            yield Finding(
                "redis", "ok", f"Redis {url} reachable, the server is connected", details=d
            )
        else:
            why_not = (
                "the server reports it is not connected"
                + (f": {redis.get('last_error')}" if redis.get("last_error") else "")
                if not redis.get("connected")
                else ""
            )
            if reached is not None:
                why_not = (
                    (why_not + "; ") if why_not else ""
                ) + f"this host cannot reach it: {reached}"
            yield Finding(
                "redis",
                "error",
                f"Redis {url} is not usable ({why_not})",
                why="the server takes its lists (and new generations) from Redis and pushes "
                "its statistics there; images without a list file get no list",
                fix="start Redis or fix [redis] url in the server's config; the server "
                "reconnects by itself",
                details=d,
            )


# --------------------------------------------------------------------------- guests


def _guest_name(args: list[str]) -> str:
    for i, a in enumerate(args[:-1]):
        if a in ("-name", "--name"):
            v = args[i + 1]
            opts = dict(o.split("=", 1) for o in v.split(",") if "=" in o)
            return opts.get("guest") or v.split(",")[0]
    return ""


def _qmp_block_drivers(path: Path, timeout: float = 3.0) -> list[str]:
    """Drivers of QEMU's named block nodes over QMP (raises OSError, ValueError
    or QMPError)."""
    qmp = QMP(path, timeout=timeout)
    try:
        return [str(n.get("drv")) for n in qmp.command("query-named-block-nodes")]
    finally:
        qmp.close()


def qemu_processes() -> Iterator[tuple[int, str, list[str]]]:
    me = os.getpid()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            args = (d / "cmdline").read_bytes().split(b"\0")
            comm = (d / "comm").read_text().strip()
            stat = (d / "stat").read_text()
        except OSError:
            continue
        argv = [a.decode(errors="replace") for a in args if a]
        if not argv:
            continue
        exe = Path(argv[0]).name
        if not (exe.startswith("qemu-system-") or comm.startswith("qemu-system-")):
            continue
        # Our own driver probes (check_qemu) are children of this process.
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == me:
            continue
        yield int(d.name), exe if exe.startswith("qemu-system-") else comm, argv


CAP_SYS_PTRACE = 19


@dataclass(frozen=True)
class Creds:
    """A process's credentials, as /proc/PID/status gives them."""

    uids: tuple[int, int, int, int]  # real, effective, saved, file system
    gids: tuple[int, int, int, int]
    cap_permitted: int


def proc_creds(pid: int) -> Creds | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    try:
        uids = tuple(int(x) for x in fields["Uid"].split())
        gids = tuple(int(x) for x in fields["Gid"].split())
        caps = int(fields["CapPrm"].strip(), 16)
    except (KeyError, ValueError):
        return None
    if len(uids) != 4 or len(gids) != 4:
        return None
    return Creds(uids, gids, caps)


def read_refusal(reader: Creds, target: Creds) -> str:
    """Why the kernel refuses reader PTRACE_MODE_READ_FSCREDS on target, which
    process_vm_readv() and merge_pages() need, "" when it allows it: as
    ptrace_may_access() decides, the reader's file system uid and gid must be
    the target's real, effective and saved ones, and (commoncap) its permitted
    capabilities must cover the target's; CAP_SYS_PTRACE overrides both.  (A
    target that is not dumpable is refused too; /proc does not show that.)"""
    if reader.cap_permitted >> CAP_SYS_PTRACE & 1:
        return ""
    uid, gid = reader.uids[3], reader.gids[3]
    if any(u != uid for u in target.uids[:3]) or any(g != gid for g in target.gids[:3]):
        return (
            f"QEMU runs as uid {uid} gid {gid}, the server as uid {target.uids[0]} gid "
            f"{target.gids[0]}"
        )
    extra = target.cap_permitted & ~reader.cap_permitted
    if extra:
        return f"the server holds capabilities QEMU lacks (CapPrm {extra:#x})"
    return ""


def check_guests(server_pid: int | None = None) -> Iterator[Finding]:
    n = 0
    server = proc_creds(server_pid) if server_pid else None
    for pid, exe, argv in qemu_processes():
        n += 1
        name = _guest_name(argv) or exe
        qemu = proc_creds(pid)
        refusal = read_refusal(qemu, server) if qemu and server else ""
        if refusal:
            yield Finding(
                "guests",
                "warning",
                f"guest {name} (pid {pid}) may not read pageshare-server's memory (pid "
                f"{server_pid}): {refusal}",
                why="its pageshare filter is refused (EPERM) and reads every block from disk: "
                "nothing is shared",
                fix="run the server as QEMU's user and group with no capability (pageshare-"
                "server's drop-in examples/unprivileged-qemu.conf), or QEMU as root",
                details={
                    "pid": pid,
                    "name": name,
                    "server_pid": server_pid,
                    "qemu_uid": qemu.uids[0] if qemu else None,
                    "server_uid": server.uids[0] if server else None,
                },
            )
        cmdline_has = any(re.search(r'driver"?\s*[=:]\s*"?pageshare\b', a) for a in argv)
        qmp = qmp_socket_of(argv)
        graph: list[str] | None = None
        qmp_error = ""
        if qmp is not None:
            try:
                graph = _qmp_block_drivers(qmp)
            except (OSError, ValueError, QMPError) as e:
                qmp_error = f"{type(e).__name__}: {e}"
        has = ("pageshare" in graph) if graph is not None else cmdline_has
        d = {
            "pid": pid,
            "name": name,
            "binary": argv[0],
            "qmp": str(qmp) if qmp else None,
            "block_drivers": graph,
            "qmp_error": qmp_error or None,
            "cmdline": shlex.join(argv)[:2000],
        }
        source = "its block graph (QMP)" if graph is not None else "its command line"
        if has:
            yield Finding(
                "guests",
                "ok",
                f"guest {name} (pid {pid}) has a pageshare node ({source})",
                details=d,
            )
        else:
            yield Finding(
                "guests",
                "warning",
                f"guest {name} (pid {pid}) runs without the pageshare filter "
                f"(no pageshare node in {source})",
                why="its base-image reads fill its own page cache with private copies; the "
                "host keeps one per guest",
                fix="if its QEMU is the patched one, `pageshare attach "
                + (str(qmp) if qmp else "QMP_SOCKET")
                + "` adds the filter while it runs; "
                "else start it with the patched QEMU and a pageshare node above its base "
                "(qemu-patches/README.md has the -blockdev line); or ignore this if the "
                "guest is not cloned from a served image",
                details=d,
            )
    if n == 0:
        yield Finding("guests", "ok", "no QEMU guests running")


# --------------------------------------------------------------------------- AppArmor


# The operator's line for each of libvirt's profiles (docs/install.md,
# "libvirt"); `if exists`, so that a profile still compiles once
# pageshare-host is purged.
QEMU_INCLUDE = "include if exists <abstractions/pageshare-qemu>"
LIBVIRTD_INCLUDE = "include if exists <abstractions/pageshare-libvirtd>"
# The profiles that may confine the daemon running QEMU: Debian's libvirtd;
# upstream's virtqemud (modular daemons), where a distribution ships it.
DAEMON_PROFILES = ("usr.sbin.libvirtd", "usr.sbin.virtqemud")
PACKAGE_EMULATOR = PACKAGE_QEMU_BIN / "qemu-system-x86_64"
LIBVIRT_DOMAINS = Path("/etc/libvirt/qemu")
# apparmor_parser's include syntax: `include <x>`, `#include <x>`, `include
# if exists <x>`, or a quoted path.
_INCLUDE = re.compile(
    r"^[ \t]*#?include(?:[ \t]+if[ \t]+exists)?[ \t]*"
    r'(?:<([^>\n]+)>|"([^"\n]+)")',
    re.M,
)
# what apparmor_parser leaves out of an included directory
_NOT_INCLUDED = (
    ".dpkg-new",
    ".dpkg-old",
    ".dpkg-dist",
    ".dpkg-bak",
    ".dpkg-remove",
    ".rpmnew",
    ".rpmsave",
    ".pacnew",
    ".pacsave",
    ".orig",
    ".rej",
    "~",
)


def apparmor_includes(profile: Path, apparmor_d: Path = APPARMOR_D) -> set[Path]:
    """What a profile includes, directly or through what it includes, each
    resolved (whether it exists or not): `<x>` is looked up in apparmor_d,
    a quoted path is absolute or relative to apparmor_d, and a directory
    includes its files, as apparmor_parser reads them."""
    targets: set[Path] = set()
    todo = [profile]
    while todo:
        try:
            path = todo.pop().resolve()
        except (OSError, RuntimeError):  # a symbolic link loop
            continue
        if path in targets:
            continue
        targets.add(path)
        if path.is_dir():
            with contextlib.suppress(OSError):
                todo += [
                    f
                    for f in path.iterdir()
                    if f.is_file()
                    and not f.name.startswith(".")
                    and not f.name.endswith(_NOT_INCLUDED)
                ]
            continue
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        for m in _INCLUDE.finditer(text):
            todo.append(apparmor_d / (m.group(1) or m.group(2)))
    targets.discard(profile.resolve())
    return targets


def libvirt_domains_on(emulator: Path, domains: Path = LIBVIRT_DOMAINS) -> list[str]:
    """libvirt's defined QEMU domains whose <emulator> is this binary (or a
    link to it: AppArmor sees the file that is executed)."""
    want = os.path.realpath(emulator)
    names = []
    for f in sorted(domains.glob("*.xml")) if domains.is_dir() else []:
        try:
            root = ElementTree.parse(f).getroot()
        except (OSError, ElementTree.ParseError):
            continue
        e = (root.findtext("devices/emulator") or "").strip()
        if e and os.path.realpath(e) == want:
            names.append(root.findtext("name") or f.stem)
    return names


def _apparmor_parser() -> str | None:
    return shutil.which(
        "apparmor_parser", path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
    )


def _compile_error(parser: str | None, apparmor_d: Path, profile: Path) -> str:
    """What apparmor_parser says against the profile (compiled, not loaded),
    or "" when it compiles (or there is no apparmor_parser to ask)."""
    if not parser:
        return ""
    try:
        p = subprocess.run(
            [parser, "-Q", "-K", "--base", str(apparmor_d), str(profile)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{parser}: {e}"
    if p.returncode == 0:
        return ""
    lines = [x for x in p.stderr.splitlines() if x.strip() and "Cache read/write" not in x]
    return lines[0] if lines else f"{parser} exited with {p.returncode}"


def _included(
    parser: str | None,
    apparmor_d: Path,
    profile: Path,
    ours: Path,
    ok: str,
    why_broken: str,
    details: dict[str, Any],
) -> Finding:
    """A profile that includes OURS: OK, or an error if it no longer
    compiles (WHY_BROKEN: what that breaks)."""
    error = _compile_error(parser, apparmor_d, profile)
    if not error:
        return Finding("apparmor", "ok", ok, details=details)
    return Finding(
        "apparmor",
        "error",
        f"{profile} does not compile with {ours} included: {error}",
        why=why_broken,
        fix=f"correct what `apparmor_parser -Q -K {profile}` reports",
        details=details,
    )


def _cannot_start(used_by: list[str]) -> str:
    if not used_by:
        return ""
    if len(used_by) == 1:
        return f": domain {used_by[0]} runs pageshare-qemu and cannot start"
    return f": domains {', '.join(used_by)} run pageshare-qemu and cannot start"


def check_apparmor(
    enabled: Path = APPARMOR_ENABLED,
    apparmor_d: Path = APPARMOR_D,
    emulator: Path = PACKAGE_EMULATOR,
    domains: Path = LIBVIRT_DOMAINS,
    parse: bool = True,
) -> Iterator[Finding]:
    """Where AppArmor is on and libvirt confines QEMU with it, each
    profile on the way to a domain's QEMU must include pageshare-host's
    part: the domains' (TEMPLATE.qemu) pageshare-qemu, or QEMU may neither
    run pageshare-qemu nor reach the server; libvirtd's, where pageshare-qemu
    is installed, pageshare-libvirtd, or libvirtd may not run it.  Where
    one is included, the profile must still compile (apparmor_parser -Q).
    A domain on pageshare-qemu that could not start makes it an error.
    Nothing to say where AppArmor is off."""
    try:
        on = enabled.read_text().strip() == "Y"
    except OSError:
        on = False
    if not on:
        return
    parser = _apparmor_parser() if parse else None
    used_by = libvirt_domains_on(emulator, domains) if emulator.exists() else []

    # The domains' profile: virt-aa-helper makes it from TEMPLATE.qemu.
    libvirt_qemu = apparmor_d / "abstractions" / "libvirt-qemu"
    if libvirt_qemu.exists():
        template = apparmor_d / "libvirt" / "TEMPLATE.qemu"
        profile = template if template.exists() else libvirt_qemu
        ours = apparmor_d / "abstractions" / "pageshare-qemu"
        included = apparmor_includes(profile, apparmor_d)
        details: dict[str, Any] = {"profile": str(profile), "abstraction": str(ours)}
        dropins = apparmor_d / "abstractions" / "libvirt-qemu.d"
        if dropins.resolve() in included:  # Debian 13: the local file is deprecated
            local = dropins / "pageshare-qemu"
            add = f"mkdir -p {dropins} && echo '{QEMU_INCLUDE}' > {local}"
        else:
            local = apparmor_d / "local" / "abstractions" / "libvirt-qemu"
            add = f"echo '{QEMU_INCLUDE}' >> {local}"
        details.update(file=str(local), line=QEMU_INCLUDE)
        if ours.exists() and ours.resolve() in included:
            yield _included(
                parser,
                apparmor_d,
                profile,
                ours,
                f"libvirt's AppArmor profile for its domains' QEMU includes {ours}",
                "virt-aa-helper makes every domain's profile from it: no domain "
                "starts, on any QEMU",
                details,
            )
        else:
            yield Finding(
                "apparmor",
                "error" if used_by else "warning",
                f"libvirt's AppArmor profile for its domains' QEMU ({profile}) does not "
                f"include {ours}"
                + ("" if ours.exists() else " (it is missing)")
                + _cannot_start(used_by),
                why="virt-aa-helper adds no rule for a domain's <emulator>, and libvirt's "
                "abstraction names only Debian's QEMU binaries: a domain on "
                f"pageshare-qemu does not start ({emulator}: Permission denied); nor may "
                "the filter reach the page server: guests would read every block from "
                "disk and share nothing",
                fix=("" if ours.exists() else "install pageshare-host, which ships it; then ")
                + f"{add}: domains started afterwards get it (a running one at its next start)",
                details=details,
            )

    # The daemon's own profile: it executes the emulator itself, to probe it.
    if not emulator.exists():
        return
    ours = apparmor_d / "abstractions" / "pageshare-libvirtd"
    for name in DAEMON_PROFILES:
        profile = apparmor_d / name
        if not profile.exists() or (apparmor_d / "disable" / name).exists():
            continue
        daemon = name.rsplit(".", 1)[1]
        local = apparmor_d / "local" / name
        details = {
            "profile": str(profile),
            "abstraction": str(ours),
            "file": str(local),
            "line": LIBVIRTD_INCLUDE,
        }
        if ours.exists() and ours.resolve() in apparmor_includes(profile, apparmor_d):
            yield _included(
                parser,
                apparmor_d,
                profile,
                ours,
                f"{daemon}'s AppArmor profile lets it execute pageshare-qemu ({ours} is included)",
                f"AppArmor cannot load it: {daemon} keeps the profile it has until "
                "the next boot, and then runs unconfined, so libvirt confines no QEMU",
                details,
            )
            continue
        yield Finding(
            "apparmor",
            "error" if used_by else "warning",
            f"{daemon}'s AppArmor profile ({profile}) does not let it execute pageshare-qemu "
            f"({emulator})"
            + ("" if ours.exists() else f"; {ours} is missing")
            + _cannot_start(used_by),
            why=f"{daemon} executes a domain's <emulator> under its own profile, to probe it, "
            "before the domain starts, and that profile executes only what it names "
            "(/usr/bin/*, /usr/sbin/*, libvirt's helpers): the exec is refused (\"cannot "
            f'execute binary {emulator}: Permission denied"), and a domain on '
            "pageshare-qemu can be neither defined nor started",
            fix=("" if ours.exists() else "install pageshare-host, which ships it; then ")
            + f"echo '{LIBVIRTD_INCLUDE}' >> {local} && apparmor_parser -r {profile} "
            f"(a running {daemon} gets it at once)",
            details=details,
        )


# --------------------------------------------------------------------------- driver


def _server_pid(control: Path) -> int | None:
    try:
        pid = server_status(control).get("pid")
    except UNREACHABLE:
        return None
    return pid if isinstance(pid, int) else None


def run_checks(args: argparse.Namespace) -> list[Finding]:
    checks: list[tuple[str, Any]] = [
        ("kernel", lambda: check_kernel()),
        ("ksm", lambda: check_ksm()),
        ("khugepaged", lambda: check_khugepaged()),
        ("qemu", lambda: check_qemu(list(args.qemu), not args.no_path)),
        ("server", lambda: check_server(Path(args.control))),
        ("guests", lambda: check_guests(_server_pid(Path(args.control)))),
        ("apparmor", lambda: check_apparmor()),
    ]
    skip = set(args.skip or [])
    out: list[Finding] = []
    for name, fn in checks:
        if name in skip:
            continue
        try:
            out.extend(fn())
        except Exception as e:  # a broken check is itself a finding, never a traceback
            out.append(
                Finding(
                    name,
                    "error",
                    f"the {name} check failed: {type(e).__name__}: {e}",
                    why="this part of the host could not be checked",
                    fix="report it with the output of `pageshare host check --json`",
                )
            )
    return out


def worst(findings: Iterable[Finding]) -> int:
    return max((SEVERITIES[f.severity] for f in findings), default=0)


def render_text(findings: list[Finding]) -> str:
    mark = {"ok": "ok  ", "warning": "WARN", "error": "FAIL"}
    lines = []
    for f in findings:
        lines.append(f"[{mark[f.severity]}] {f.check}: {f.what}")
        if f.severity != "ok":
            if f.why:
                lines.append(f"       why: {f.why}")
            if f.fix:
                lines.append(f"       fix: {f.fix}")
    counts = {s: sum(f.severity == s for f in findings) for s in SEVERITIES}
    lines.append(f"{counts['error']} error(s), {counts['warning']} warning(s), {counts['ok']} ok")
    return "\n".join(lines) + "\n"


def build_parser(prog: str = "pageshare host check") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Exit status: 0 all ok, 1 warnings, 2 errors.",
    )
    p.add_argument("--json", action="store_true", help="print the findings as JSON")
    p.add_argument(
        "--control",
        default=str(DEFAULT_CONTROL),
        metavar="PATH",
        help=f"pageshare-server's control socket (default {DEFAULT_CONTROL})",
    )
    p.add_argument(
        "--qemu",
        action="append",
        default=[],
        metavar="PATH",
        help="also check this QEMU binary, or every qemu-system-*/qemu-img in this "
        "directory (repeatable)",
    )
    p.add_argument(
        "--no-path",
        action="store_true",
        help="check only the QEMU binaries given with --qemu, not those on PATH "
        f"or in {PACKAGE_QEMU_BIN}",
    )
    p.add_argument(
        "--skip",
        action="append",
        choices=["kernel", "ksm", "khugepaged", "qemu", "server", "guests", "apparmor"],
        help="leave out a check (repeatable)",
    )
    return p


def main(argv: list[str], prog: str = "pageshare host check") -> int:
    p = build_parser(prog)

    def print_json_usage() -> None:
        bad = f"bad arguments: {' '.join(argv)}"
        usage = Finding("usage", "error", bad, fix=f"see {prog} --help")
        print(json.dumps({"status": "error", "exit": 2, "findings": [asdict(usage)]}))

    args = parse_args_or_exit_code(p, argv, print_json_usage)
    if isinstance(args, int):
        return args
    started = time.monotonic()
    findings = run_checks(args)
    rc = worst(findings)
    if args.json:
        print(
            json.dumps(
                {
                    "host": socket.gethostname(),
                    "kernel": platform.release(),
                    "status": {0: "ok", 1: "warning", 2: "error"}[rc],
                    "exit": rc,
                    "seconds": round(time.monotonic() - started, 3),
                    "findings": [asdict(f) for f in findings],
                },
                indent=2,
            )
        )
    else:
        sys.stdout.write(render_text(findings))
    return rc
