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

Live migration.  After each attach the watcher sets the migration
capability block-refs as this host's configuration says (block_refs in
/etc/pageshare/libvirt.toml, or --block-refs; off by default: a destination
without pageshare refuses such a stream) and marks the domain in its live
<metadata> (libvirt_qmp.METADATA_NS) with that setting.  The mark travels
with the domain, and the destination's libvirt hook (libvirt_hook.py) reads
it to attach the filter there before the guest runs, with block-refs on if
the source has it.  A domain that migrates in raises STARTED/MIGRATED while
libvirt still holds it for the migration (monitor passthrough would wait
for the migration's end): nothing is done then; on RESUMED/MIGRATED the
attach runs as on a start (normally "already-attached": the hook did it),
and the domain gets this host's block-refs setting for its next migration.
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

from ..errors import print_error
from . import attach
from .libvirt_config import DEFAULT_CONFIG, ConfigError, load
from .libvirt_qmp import (
    DEFAULT_URI,
    LibvirtQMP,
    LibvirtUnavailable,
    load_libvirt,
    running_domains,
)
from .qmp import Monitor, QMPError

RECONNECT_SECONDS = 5.0
STOP = ""  # the worker's end-of-queue mark


def _line(domain: str, why: str, r: dict[str, Any]) -> str:
    """One line per drive, as an operator reads it in the journal."""
    if r.get("action") == "note":
        return f"pageshare libvirt-watch: {domain}: {r['note']} [{why}]"
    parts = []
    for d in r.get("drives", []):
        res = d.get("result", "?")
        text = f"{domain}: {d.get('drive')} {res}"
        if res == "attached":
            img = d.get("image") or {}
            text += f" (image {img.get('name', '?')}, filter {d.get('filter')})"
            rb = d.get("reads_before")
            if rb:
                text += (
                    f"; before attach {rb['rd_operations']} read requests, "
                    f"{rb['rd_bytes'] / 2**20:.1f} MiB went to disk"
                )
        elif d.get("error"):
            text += f": {d['error'].get('message')}"
        parts.append(text)
    if not parts:
        err = r.get("error") or {}
        parts.append(
            f"{domain}: not attached: {err.get('message', 'no drive')}"
            + (f" (hint: {err['hint']})" if err.get("hint") else "")
        )
    mig = r.get("migration")
    if mig:
        refs = mig.get("block-refs")
        parts.append(
            f"{domain}: for migrations: block-refs "
            + ("not in this QEMU" if refs is None else "on" if refs else "off")
            + (f"; not set: {mig['error']}" if mig.get("error") else "")
        )
    return "\n".join(f"pageshare libvirt-watch: {p} [{why}]" for p in parts)


class Watcher:
    def __init__(
        self,
        uri: str,
        control: Path,
        mode: str | None,
        timeout: float,
        emit: Callable[[str, str, dict[str, Any]], None],
        block_refs: bool = False,
    ) -> None:
        self.uri, self.control, self.mode, self.timeout = uri, control, mode, timeout
        self.block_refs = block_refs
        self.emit = emit
        self.todo: queue.Queue[tuple[str, str]] = queue.Queue()
        self.stopping = threading.Event()
        self.worker = threading.Thread(target=self._work, name="attach", daemon=True)

    def attach_one(self, domain: str, why: str) -> dict[str, Any]:
        opts = attach.Options(
            None,
            [],
            self.control,
            mode=self.mode,
            timeout=self.timeout,
            libvirt=domain,
            uri=self.uri,
        )
        try:
            with attach.connect(opts) as q:
                r = attach.attach(opts, q)
                if r["ok"]:
                    r["migration"] = self.prepare_migration(q)
        except (attach.AttachError, QMPError) as e:
            r = attach.failure("attach", opts.target, e)
        self.emit(domain, why, r)
        return r

    def prepare_migration(self, q: Monitor) -> dict[str, Any]:
        """block-refs as this host says, and the domain's mark that the
        destination's hook reads (libvirt_hook.py)."""
        out: dict[str, Any] = {"block-refs": None}
        try:
            state = attach.block_refs_state(q)
            if state is not None and state != self.block_refs:
                attach.set_block_refs(q, self.block_refs)
                state = self.block_refs
            out["block-refs"] = state
            if isinstance(q, LibvirtQMP):
                q.set_metadata(bool(state))
        except QMPError as e:
            out["error"] = str(e)
        return out

    def note(self, domain: str, why: str, text: str) -> None:
        self.emit(domain, why, {"action": "note", "drives": [], "ok": True, "note": text})

    def _work(self) -> None:
        while True:
            domain, why = self.todo.get()
            if domain == STOP:
                return
            try:
                self.attach_one(domain, why)
            except Exception as e:  # one VM's failure must not end the watch
                self.emit(
                    domain,
                    why,
                    {
                        "drives": [],
                        "ok": False,
                        "error": {
                            "kind": "internal",
                            "message": f"{type(e).__name__}: {e}",
                            "hint": "",
                        },
                    },
                )

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
                print(
                    f"pageshare libvirt-watch: cannot connect to {self.uri}: "
                    f"{e.get_error_message()}; retrying every {RECONNECT_SECONDS:.0f} s",
                    file=sys.stderr,
                    flush=True,
                )
                self.stopping.wait(RECONNECT_SECONDS)
                continue
            closed = threading.Event()

            def on_event(_conn: Any, dom: Any, event: int, detail: int, _opaque: Any) -> None:
                if event == libvirt.VIR_DOMAIN_EVENT_STARTED:
                    if detail == libvirt.VIR_DOMAIN_EVENT_STARTED_MIGRATED:
                        # libvirt holds the domain until the migration ends
                        self.note(
                            dom.name(),
                            "started-migrated",
                            "migrating in: the libvirt hook attaches the filter "
                            "before the guest runs here; checked once it resumes",
                        )
                    else:
                        self.todo.put((dom.name(), "started"))
                elif (
                    event == libvirt.VIR_DOMAIN_EVENT_RESUMED
                    and detail == libvirt.VIR_DOMAIN_EVENT_RESUMED_MIGRATED
                ):
                    self.todo.put((dom.name(), "resumed-migrated"))

            def on_close(_conn: Any, _reason: int, flag: threading.Event) -> None:
                flag.set()

            conn.registerCloseCallback(on_close, closed)
            cb = conn.domainEventRegisterAny(
                None, libvirt.VIR_DOMAIN_EVENT_ID_LIFECYCLE, on_event, None
            )
            print(
                f"pageshare libvirt-watch: watching {self.uri} (block-refs "
                f"{'on' if self.block_refs else 'off'} for migrations from here)",
                file=sys.stderr,
                flush=True,
            )
            try:
                for name in running_domains(self.uri):
                    self.todo.put((name, "running"))
            except LibvirtUnavailable as e:
                print(f"pageshare libvirt-watch: {e}", file=sys.stderr, flush=True)
            while not closed.is_set() and not self.stopping.is_set():
                libvirt.virEventRunDefaultImpl()
            if closed.is_set():
                print(
                    f"pageshare libvirt-watch: lost {self.uri}; reconnecting",
                    file=sys.stderr,
                    flush=True,
                )
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

live migration: after each attach block-refs is set as configured (block_refs
in /etc/pageshare/libvirt.toml, or --block-refs; default off) and the domain
is marked in its <metadata>; the mark travels with the domain, and the libvirt
hook of the destination host (/etc/libvirt/hooks/qemu.d/pageshare) attaches
the filter there before the guest runs, with block-refs on if the source
uses it.  Turn block_refs on only where every host a domain may migrate to
runs pageshare and its hook (else the migration fails, and the guest stays
on the source); and not where domains are saved with `virsh save`,
managedsave (libvirt-guests) or memory snapshots: libvirt restores those
with the stream already flowing, before any hook can add the filter, so an
image with references cannot be restored.  `pageshare detach --libvirt
DOMAIN` turns block-refs off for that domain.  A domain migrating in is
left alone until it resumes (libvirt holds it); then the attach runs as on
a start ("already-attached": the hook did it).

requirements: QEMU must be the patched one (<emulator> in the domain XML),
and the kernel must let it read the page server's memory: QEMU must run as
the server's user and group with capabilities that cover the server's (or
hold CAP_SYS_PTRACE).  QEMU run as root (user = "root" in qemu.conf) does
with the pageshare-server package's unit (root, CAP_DAC_READ_SEARCH only)
as long as it keeps that capability.  QEMU run as libvirt's unprivileged
user (Debian's default, libvirt-qemu) does once the server runs as that
user and group with no capability, which the shipped drop-in does: copy
/usr/share/doc/pageshare-server/examples/unprivileged-qemu.conf into
/etc/systemd/system/pageshare-server.service.d/, `systemctl daemon-reload`
and restart pageshare-server (docs/install.md, "The page server").
Otherwise QEMU logs "may not read the page server's memory" once and reads
every block from disk: right bytes, nothing shared; `pageshare host check`
names such guests and why.

examples:
  systemctl status pageshare-libvirt-watch    # the packaged unit (libvirtd, python3-libvirt)
  systemctl restart pageshare-libvirt-watch   # after editing /etc/pageshare/libvirt.toml
  pageshare libvirt-watch                  # in the foreground, one line per drive
  pageshare libvirt-watch --json           # one JSON object per attach, for scripts
  pageshare libvirt-watch --mode copy      # hosts without the kernel series
  pageshare libvirt-watch --block-refs     # migrations from here send block references
  pageshare libvirt-watch --connect 'qemu:///system?socket=/run/libvirt/libvirt-sock'
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pageshare libvirt-watch",
        description="Attach the pageshare filter to every libvirt domain when it starts.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EPILOG,
    )
    p.add_argument(
        "--connect",
        metavar="URI",
        default=DEFAULT_URI,
        help=f"libvirt's URI (default {DEFAULT_URI})",
    )
    p.add_argument(
        "--config",
        type=Path,
        metavar="PATH",
        help=f"the host's pageshare libvirt configuration, shared with the libvirt "
        f"hook (default {DEFAULT_CONFIG}, if it exists); the options below "
        "override it",
    )
    p.add_argument(
        "--control",
        type=Path,
        metavar="PATH",
        help="the page server's control socket (default /run/pageshare/control.sock)",
    )
    p.add_argument(
        "--mode",
        choices=("merge", "copy"),
        help="the filter's mode: merge (default) or copy (testing, stock kernels)",
    )
    p.add_argument(
        "--block-refs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="live migrations from this host send listed pages as block "
        "references (QEMU capability block-refs; default off)",
    )
    p.add_argument("--timeout", type=float, help="seconds per QMP command (default 30)")
    p.add_argument("--json", action="store_true", help="one JSON object per attach on stdout")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)

    def emit(domain: str, why: str, r: dict[str, Any]) -> None:
        if args.json:
            print(
                json.dumps({"domain": domain, "event": why, "time": time.time(), **r}), flush=True
            )
        else:
            print(_line(domain, why, r), flush=True)

    try:
        cfg = load(args.config or DEFAULT_CONFIG, required=args.config is not None)
    except ConfigError as e:
        print_error(str(e), prog="pageshare libvirt-watch")
        return 1
    try:
        w = Watcher(
            args.connect,
            args.control or cfg.control,
            args.mode or cfg.mode,
            args.timeout or cfg.timeout,
            emit,
            cfg.block_refs if args.block_refs is None else args.block_refs,
        )

        def stop(_sig: int, _frame: object) -> None:
            w.stopping.set()

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        return w.run()
    except LibvirtUnavailable as e:
        print_error(str(e), prog="pageshare libvirt-watch")
        return 1
