"""QMP to a libvirt domain's QEMU, through libvirt.

libvirtd holds the only QMP connection of the QEMU it starts (a socket it
passes as an fd), so `pageshare attach` cannot open one of its own.  libvirt
forwards a QMP command with virDomainQemuMonitorCommand (`virsh
qemu-monitor-command`), the same call a person would use to debug a VM;
this is that, with the interface of qmp.QMP that attach uses.  libvirt
marks the domain "tainted: custom-monitor" the first time (it can no longer
vouch for every change to the VM), and does not know about the filter node:
`pageshare detach` before a block job, snapshot or migration that libvirt
runs on the disk (see docs/ARCHITECTURE.md).

The python3-libvirt binding (Debian package) is imported when a domain is
named, so the rest of pageshare works without it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import PageshareError
from .qmp import QMPError

DEFAULT_URI = "qemu:///system"

# The element libvirt-watch keeps in a domain's <metadata> (live definition
# only) once the filter is attached: <pageshare:filter block-refs="on|off"/>.
# It travels with the domain when it migrates; the destination's hook
# (libvirt_hook.py) reads it.
METADATA_NS = "https://pageshare.invalid/libvirt/1"
METADATA_KEY = "pageshare"
METADATA_ELEMENT = "filter"


class LibvirtUnavailable(PageshareError, RuntimeError):
    """The binding is missing, or libvirtd or the domain cannot be reached."""


def load_libvirt() -> tuple[Any, Any]:
    try:
        import libvirt
        import libvirt_qemu
    except ImportError:
        raise LibvirtUnavailable(
            "the libvirt Python binding is missing (Debian: apt install python3-libvirt)"
        ) from None
    # libvirt prints every error to stderr by default; they are raised anyway.
    libvirt.registerErrorHandler(lambda _ctx, _err: None, None)
    return libvirt, libvirt_qemu


def qemu_pid(uuid: str, proc: Path = Path("/proc")) -> int | None:
    """The QEMU process of the domain with this UUID: libvirt passes it as
    `-uuid` on every QEMU command line it writes."""
    for d in proc.iterdir():
        if not d.name.isdigit():
            continue
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        for i, a in enumerate(argv[:-1]):
            if a == b"-uuid" and argv[i + 1].decode(errors="replace").lower() == uuid.lower():
                return int(d.name)
    return None


class LibvirtQMP:
    """QMP commands to the QEMU of one running libvirt domain."""

    def __init__(self, uri: str, domain: str) -> None:
        libvirt, self._qemu = load_libvirt()
        self._error = libvirt.libvirtError
        try:
            self._conn = libvirt.open(uri)
        except self._error as e:
            raise LibvirtUnavailable(
                f"cannot connect to libvirt at {uri}: {e.get_error_message()}"
            ) from None
        try:
            self._dom = self._conn.lookupByName(domain)
        except self._error as e:
            self._conn.close()
            raise LibvirtUnavailable(
                f"no domain {domain!r} at {uri}: {e.get_error_message()}"
            ) from None
        if not self._dom.isActive():
            self._conn.close()
            raise LibvirtUnavailable(f"domain {domain!r} is not running")
        self.name = domain
        self.uri = uri

    def command(self, name: str, timeout: float | None = None, **args: Any) -> Any:
        # libvirt waits for QEMU's answer as long as it takes; ``timeout`` is
        # what qmp.QMP honours, kept for the same signature.
        msg: dict[str, Any] = {"execute": name}
        if args:
            msg["arguments"] = args
        try:
            text = self._qemu.qemuMonitorCommand(self._dom, json.dumps(msg), 0)
        except self._error as e:
            raise QMPError(f"{name}: {e.get_error_message()}") from None
        reply: dict[str, Any] = json.loads(text)
        if "error" in reply:
            err = reply["error"]
            raise QMPError(f"{name}: {err.get('class')}: {err.get('desc')}")
        return reply.get("return")

    def hmp(self, line: str) -> str:
        args: dict[str, Any] = {"command-line": line}
        out: str = self.command("human-monitor-command", None, **args)
        return out

    def peer_pid(self) -> int | None:
        return qemu_pid(self._dom.UUIDString())

    def set_metadata(self, block_refs: bool | None) -> None:
        """Mark the running domain (its live definition) as one whose filter
        pageshare attached, with block references on or off; None removes
        the mark."""
        libvirt, _ = load_libvirt()
        xml = (
            None
            if block_refs is None
            else f'<{METADATA_ELEMENT} block-refs="{"on" if block_refs else "off"}"/>'
        )
        try:
            self._dom.setMetadata(
                libvirt.VIR_DOMAIN_METADATA_ELEMENT,
                xml,
                METADATA_KEY,
                METADATA_NS,
                libvirt.VIR_DOMAIN_AFFECT_LIVE,
            )
        except self._error as e:
            raise QMPError(f"setting the domain's metadata: {e.get_error_message()}") from None

    def close(self) -> None:
        self._conn.close()


def running_domains(uri: str) -> list[str]:
    libvirt, _ = load_libvirt()
    try:
        conn = libvirt.open(uri)
    except libvirt.libvirtError as e:
        raise LibvirtUnavailable(
            f"cannot connect to libvirt at {uri}: {e.get_error_message()}"
        ) from None
    try:
        return sorted(
            d.name() for d in conn.listAllDomains(libvirt.VIR_CONNECT_LIST_DOMAINS_ACTIVE)
        )
    finally:
        conn.close()
