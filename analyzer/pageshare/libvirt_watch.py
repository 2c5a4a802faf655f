"""`pageshare libvirt-watch`: attach the filter to every libvirt domain as it starts.

Operators define VMs in libvirt and start them with `virsh start`, the
dashboard or OpenStack; nobody will type `pageshare attach` after each
start.  This daemon listens to libvirtd's lifecycle events and attaches
the filter (attach.attach through libvirt's monitor passthrough) to each
domain that starts, and, when it starts or libvirtd comes back, to every
domain already running (attach is idempotent).  A domain whose base image
is not served is left alone with one line that says so; nothing here can
stop or change a VM otherwise.

Why events and not a libvirt hook (/etc/libvirt/hooks/qemu): a hook runs
inside libvirtd's start path and must not call back into libvirt (it
would deadlock), and it runs before QEMU's monitor is available.  An event
arrives once the domain runs: the guest has started reading by then (the
firmware, the boot loader), and attach reports those reads (they went to
disk: their pages stay private copies until read again).

Attaches run one at a time in a worker thread, so the event loop keeps
reading events while QEMU answers; each opens its own connection.
"""

from __future__ import annotations

import argparse
import json
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import attach
from .errors import print_error
from .hostcheck import DEFAULT_CONTROL
from .libvirt_qmp import DEFAULT_URI, LibvirtUnavailable, load_libvirt, running_domains
from .qmp import QMPError

RECONNECT_SECONDS = 5.0
STOP = ""                              # the worker's end-of-queue mark


def _line(domain: str, why: str, r: dict[str, Any]) -> str:
    """One line per drive, as an operator reads it in the journal."""
    parts = []
    for d in r.get("drives", []):
        res = d.get("result", "?")
        text = f"{domain}: {d.get('drive')} {res}"
        if res == "attached":
            img = d.get("image") or {}
            text += f" (image {img.get('name', '?')}, filter {d.get('filter')})"
            rb = d.get("reads_before")
            if rb:
                text += (f"; before attach {rb['rd_operations']} read requests, "
                         f"{rb['rd_bytes'] / 2**20:.1f} MiB went to disk")
        elif d.get("error"):
            text += f": {d['error'].get('message')}"
        parts.append(text)
    if not parts:
        err = r.get("error") or {}
        parts.append(f"{domain}: not attached: {err.get('message', 'no drive')}"
                     + (f" (hint: {err['hint']})" if err.get("hint") else ""))
    return "\n".join(f"pageshare libvirt-watch: {p} [{why}]" for p in parts)


class Watcher:
    def __init__(self, uri: str, control: Path, mode: str | None, timeout: float,
                 emit: Callable[[str, str, dict[str, Any]], None]) -> None:
        self.uri, self.control, self.mode, self.timeout = uri, control, mode, timeout
        self.emit = emit
        self.todo: queue.Queue[tuple[str, str]] = queue.Queue()
        self.stopping = threading.Event()
        self.worker = threading.Thread(target=self._work, name="attach", daemon=True)

    def attach_one(self, domain: str, why: str) -> dict[str, Any]:
        opts = attach.Options(None, [], self.control, mode=self.mode, timeout=self.timeout,
                              libvirt=domain, uri=self.uri)
        try:
            r = attach.attach(opts)
        except attach.AttachError as e:
            r = {"action": "attach", "qmp": opts.target, "drives": [], "ok": False,
                 "error": e.to_json()}
        except QMPError as e:
            r = {"action": "attach", "qmp": opts.target, "drives": [], "ok": False,
                 "error": {"kind": "qemu-refused", "message": f"QMP: {e}",
                           "hint": "nothing was changed; the message is QEMU's own"}}
        self.emit(domain, why, r)
        return r

    def _work(self) -> None:
        while True:
            domain, why = self.todo.get()
            if domain == STOP:
                return
            try:
                self.attach_one(domain, why)
            except Exception as e:       # one VM's failure must not end the watch
                self.emit(domain, why, {"drives": [], "ok": False, "error": {
                    "kind": "internal", "message": f"{type(e).__name__}: {e}", "hint": ""}})

    def run(self) -> int:
        libvirt, _ = load_libvirt()
        libvirt.virEventRegisterDefaultImpl()
        # wake the loop every second, so that SIGTERM is seen without an event
        libvirt.virEventAddTimeout(1000, lambda _timer, _opaque: None, None)
        self.worker.start()
        while not self.stopping.is_set():
            try:
                conn = libvirt.openReadOnly(self.uri)
            except libvirt.libvirtError as e:
                print(f"pageshare libvirt-watch: cannot connect to {self.uri}: "
                      f"{e.get_error_message()}; retrying every {RECONNECT_SECONDS:.0f} s",
                      file=sys.stderr, flush=True)
                self.stopping.wait(RECONNECT_SECONDS)
                continue
            closed = threading.Event()

            def on_event(_conn: Any, dom: Any, event: int, _detail: int, _opaque: Any) -> None:
                if event == libvirt.VIR_DOMAIN_EVENT_STARTED:
                    self.todo.put((dom.name(), "started"))

            def on_close(_conn: Any, _reason: int, flag: threading.Event) -> None:
                flag.set()

            conn.registerCloseCallback(on_close, closed)
            cb = conn.domainEventRegisterAny(None, libvirt.VIR_DOMAIN_EVENT_ID_LIFECYCLE,
                                             on_event, None)
            print(f"pageshare libvirt-watch: watching {self.uri}", file=sys.stderr, flush=True)
            try:
                for name in running_domains(self.uri):
                    self.todo.put((name, "running"))
            except LibvirtUnavailable as e:
                print(f"pageshare libvirt-watch: {e}", file=sys.stderr, flush=True)
            while not closed.is_set() and not self.stopping.is_set():
                libvirt.virEventRunDefaultImpl()
            if closed.is_set():
                print(f"pageshare libvirt-watch: lost {self.uri}; reconnecting",
                      file=sys.stderr, flush=True)
            else:
                try:
                    conn.domainEventDeregisterAny(cb)
                    conn.unregisterCloseCallback()
                    conn.close()
                except libvirt.libvirtError:
                    pass
        self.todo.put((STOP, ""))
        self.worker.join(timeout=self.timeout + 5)
        return 0


EPILOG = """\
what it does:
  connects to libvirtd (read-only, for its events), and for every domain
  that starts, and every domain already running when it starts, runs
  `pageshare attach --libvirt DOMAIN`: the filter is put above each disk's
  base image that the page server serves.  Domains whose base is not served
  are left as they are.  One line per drive says what happened (--json: one
  JSON object per attach).  It reconnects when libvirtd restarts.  Run by
  systemd as pageshare-libvirt-watch.service.

requirements: QEMU must be the patched one (<emulator> in the domain XML),
and allowed to read the page server's memory.  QEMU run as root (qemu.conf
user) is, with the server's default unit.  QEMU run as libvirt's unprivileged
user (Debian: libvirt-qemu) is once the server runs as that user and group:
install the drop-in /usr/share/doc/pageshare-server/examples/
unprivileged-qemu.conf (README, "Installing the page server on a host").
Without it QEMU logs "may not read the page server's memory" and reads
every block from disk: right bytes, no sharing.

examples:
  systemctl enable --now pageshare-libvirt-watch   # as installed: at every boot
  pageshare libvirt-watch                 # in the foreground, one line per drive
  pageshare libvirt-watch --json          # the same as JSON objects, for scripts
  pageshare libvirt-watch --mode copy     # hosts without the kernel series
  pageshare libvirt-watch --connect 'qemu:///system?socket=/run/libvirt/libvirt-sock'
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pageshare libvirt-watch",
        description="Attach the pageshare filter to every libvirt domain when it starts.",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG)
    p.add_argument("--connect", metavar="URI", default=DEFAULT_URI,
                   help=f"libvirt's URI (default {DEFAULT_URI})")
    p.add_argument("--control", type=Path, default=DEFAULT_CONTROL, metavar="PATH",
                   help=f"the page server's control socket (default {DEFAULT_CONTROL})")
    p.add_argument("--mode", choices=("merge", "copy"),
                   help="the filter's mode: merge (default) or copy (testing, stock kernels)")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds per QMP command")
    p.add_argument("--json", action="store_true", help="one JSON object per attach on stdout")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)

    def emit(domain: str, why: str, r: dict[str, Any]) -> None:
        if args.json:
            print(json.dumps({"domain": domain, "event": why, "time": time.time(), **r}),
                  flush=True)
        else:
            print(_line(domain, why, r), flush=True)

    try:
        w = Watcher(args.connect, args.control, args.mode, args.timeout, emit)

        def stop(_sig: int, _frame: object) -> None:
            w.stopping.set()

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        return w.run()
    except LibvirtUnavailable as e:
        print_error(str(e), prog="pageshare libvirt-watch")
        return 1
