"""`pageshare libvirt-hook`: the filter on the destination of a live
migration, in place before the guest runs there.

When a domain migrates, libvirtd on the destination starts its QEMU with
`-incoming defer`, issues `migrate-incoming`, and keeps the domain to itself
until the migration is over: monitor passthrough (what `pageshare attach
--libvirt` and libvirt-watch use) waits for that, and a libvirt hook must not
call libvirt anyway.  Yet with the migration capability block-refs the
destination's filter must be in the block graph when the RAM stream's setup
section arrives, and without it the guest would run its first minutes on
the destination reading its base from disk.  So this hook, run by libvirtd
as /etc/libvirt/hooks/qemu.d/pageshare, does it without libvirt:

`migrate begin` (on the destination, before QEMU starts; stdin: the domain
XML, stdout: the XML to use): for a domain that libvirt-watch marked on its
source (`<metadata><pageshare:filter block-refs="on|off"/>`, see
libvirt_qmp.METADATA_NS), add to its `<qemu:commandline>` a private QMP
monitor, `-chardev socket,id=pageshare-qmp,path=QMP_DIR/pageshare-UUID.qmp,
server=on,wait=off -mon chardev=pageshare-qmp,mode=control`, and, if the
mark says so, `-global migration.block-refs=on` (the capability must be on
before `migrate-incoming`; libvirt does not know it, so it sets only its
own).  Its earlier arguments of that kind (a domain that migrated before)
are replaced, and a domain without the mark loses them: the same XML in,
the same XML out, and nothing printed when nothing changes.

`started begin` (after `migrate-incoming`, before libvirt answers the
source, so before a single byte of the migration arrives; stdin: the live
XML): if the domain has that monitor, connect to it and run `pageshare
attach` over it (blockdev-add of the filter, blockdev-reopen of the
overlay: both work on the inactive nodes of an incoming QEMU), then check
that block-refs is as the mark says.  On an incoming migration any failure
exits 1: libvirt then kills the new QEMU and fails the migration, and the
guest keeps running on the source, with the reason in virsh's error.  On
any other start (a domain whose persistent definition kept the monitor) a
failure is only logged: libvirt-watch attaches on the start event.

`restore begin` (virsh restore, a managed save; stdin/stdout as for
migrate): our arguments are removed.  A saved state is a migration stream
that flows into QEMU the moment libvirt issues `migrate-incoming`, before
`started` runs, so the filter cannot be there in time (a state saved with
block-refs on cannot be restored under libvirt at all); libvirt-watch
attaches once the domain starts.  `started begin` is strict only for the
start that a `migrate begin` of this hook prepared (a marker file next to
the socket): a snapshot's revert or a start of a definition that kept the
monitor only logs a failure.

Each step writes one line into the domain's libvirt log
(LOG_DIR/DOMAIN.log).  Every other hook call returns at once (the shell
script in front of this filters them).
"""

from __future__ import annotations

import argparse
import contextlib
import re
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from dataclasses import dataclass
from io import StringIO
from pathlib import Path
from typing import Any

from ..errors import print_error
from . import attach
from .libvirt_config import DEFAULT_CONFIG, ConfigError, HostConfig, load
from .libvirt_qmp import METADATA_ELEMENT, METADATA_NS
from .qmp import QMPError

QEMU_NS = "http://libvirt.org/schemas/domain/qemu/1.0"
CHARDEV_ID = "pageshare-qmp"
REFS_GLOBAL = "migration.block-refs"
PROG = "pageshare libvirt-hook"


def qmp_socket(cfg: HostConfig, uuid: str) -> Path:
    return cfg.qmp_dir / f"pageshare-{uuid}.qmp"


def migrating_marker(cfg: HostConfig, uuid: str) -> Path:
    """Left by `migrate begin` for the `started begin` that follows: this
    start is that migration's, whose failure must fail the migration."""
    return cfg.qmp_dir / f"pageshare-{uuid}.migrating"


def _uuid_ok(uuid: str) -> bool:
    return re.fullmatch(r"[0-9a-fA-F-]{36}", uuid) is not None


def our_args(cfg: HostConfig, uuid: str, block_refs: bool) -> list[str]:
    out = [
        "-chardev",
        f"socket,id={CHARDEV_ID},path={qmp_socket(cfg, uuid)},server=on,wait=off",
        "-mon",
        f"chardev={CHARDEV_ID},mode=control",
    ]
    if block_refs:
        out += ["-global", f"{REFS_GLOBAL}=on"]
    return out


def _is_ours(opt: str, value: str) -> bool:
    if opt == "-chardev":
        return f"id={CHARDEV_ID}," in f"{value},"
    if opt == "-mon":
        return value.startswith(f"chardev={CHARDEV_ID},") or value == f"chardev={CHARDEV_ID}"
    if opt == "-global":
        return value.startswith(f"{REFS_GLOBAL}=")
    return False


def _pairs(values: list[str]) -> Iterator[tuple[int, bool]]:
    """(index, ours) for each argument: an option of ours and its value are both ours."""
    i = 0
    while i < len(values):
        if i + 1 < len(values) and _is_ours(values[i], values[i + 1]):
            yield i, True
            yield i + 1, True
            i += 2
        else:
            yield i, False
            i += 1


# --------------------------------------------------------------------------- the domain XML


@dataclass
class Domain:
    root: ET.Element
    name: str
    uuid: str
    marked: bool  # libvirt-watch attached the filter on the source
    block_refs: bool  # ... with block references on
    args: list[str]  # <qemu:commandline> arguments


def _register_namespaces(text: str) -> None:
    """Keep the document's own namespace prefixes when it is written again."""
    for _event, (prefix, uri) in ET.iterparse(StringIO(text), events=("start-ns",)):
        if prefix:
            # a reserved prefix (ns0, ...) is ElementTree's own: it makes one up
            with contextlib.suppress(ValueError):
                ET.register_namespace(prefix, uri)


def parse(text: str) -> Domain:
    try:
        root = ET.fromstring(text)
    except ET.ParseError as e:
        raise ConfigError(f"the domain XML from libvirt does not parse: {e}") from None
    if root.tag != "domain":
        raise ConfigError(f"not a domain XML (root element {root.tag!r})")
    mark = root.find(f"metadata/{{{METADATA_NS}}}{METADATA_ELEMENT}")
    cmd = root.find(f"{{{QEMU_NS}}}commandline")
    args = [a.get("value", "") for a in cmd.findall(f"{{{QEMU_NS}}}arg")] if cmd is not None else []
    return Domain(
        root,
        root.findtext("name", ""),
        root.findtext("uuid", ""),
        mark is not None,
        mark is not None and mark.get("block-refs") == "on",
        args,
    )


def our_socket(args: list[str]) -> Path | None:
    """The path of our monitor's socket among QEMU arguments, if there is one."""
    for i, ours in _pairs(args):
        if ours and args[i] == "-chardev":
            m = re.search(r"(?:^|,)path=([^,]+)", args[i + 1])
            if m:
                return Path(m.group(1))
    return None


def rewrite(text: str, cfg: HostConfig, add: bool = True) -> str | None:
    """The incoming domain's XML with our QEMU arguments as its mark asks
    (none without a mark, or with ADD false), or None if that is the XML
    as it is."""
    d = parse(text)
    add = add and d.marked
    if add and not _uuid_ok(d.uuid):
        raise ConfigError(f"domain {d.name!r} has no usable UUID ({d.uuid!r})")
    kept = [v for (_, ours), v in zip(_pairs(d.args), d.args, strict=True) if not ours]
    want = our_args(cfg, d.uuid, d.block_refs) if add else []
    if kept + want == d.args:
        return None
    _register_namespaces(text)
    ET.register_namespace("qemu", QEMU_NS)
    root = d.root
    cmd = root.find(f"{{{QEMU_NS}}}commandline")
    if cmd is None:
        cmd = ET.SubElement(root, f"{{{QEMU_NS}}}commandline")
    arg_elems = cmd.findall(f"{{{QEMU_NS}}}arg")
    for (_, ours), el in zip(_pairs(d.args), arg_elems, strict=True):
        if ours:
            cmd.remove(el)
    # after the other arguments (and before any <qemu:env>, as libvirt writes them)
    pos = max((k + 1 for k, el in enumerate(cmd) if el.tag == f"{{{QEMU_NS}}}arg"), default=0)
    for k, v in enumerate(want):
        el = ET.Element(f"{{{QEMU_NS}}}arg", {"value": v})
        el.tail = cmd.text
        cmd.insert(pos + k, el)
    if len(cmd) == 0:
        root.remove(cmd)
    return ET.tostring(root, encoding="unicode") + "\n"


# --------------------------------------------------------------------------- the log


class DomainLog:
    """Lines in the domain's libvirt log, as libvirt writes its own there."""

    def __init__(self, cfg: HostConfig, domain: str) -> None:
        self.path = cfg.log_dir / f"{domain}.log"

    def line(self, text: str, echo: bool = True) -> str:
        """Append TEXT (stamped); ECHO: on stderr too (libvirt logs a hook's
        output at debug level, and puts it into the error if it fails)."""
        now = time.time()
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(now))
        full = f"{stamp}.{int(now * 1000) % 1000:03d}+0000: {PROG}: {text}"
        try:
            with open(self.path, "a") as f:
                f.write(full + "\n")
        except OSError as e:
            print(f"{PROG}: cannot write {self.path}: {e}", file=sys.stderr)
        if echo:
            print(full, file=sys.stderr)
        return full


# --------------------------------------------------------------------------- started


class HookFailed(Exception):
    pass


def _drives_text(r: dict[str, Any]) -> str:
    parts = []
    for d in r.get("drives", []):
        res = d.get("result", "?")
        text = f"{d.get('drive')} {res}"
        if res in ("attached", "already-attached"):
            img = (d.get("image") or {}).get("name")
            text += f" (filter {d.get('filter')}" + (f", image {img})" if img else ")")
        elif d.get("error"):
            text += f": {d['error'].get('message')}"
        parts.append(text)
    return "; ".join(parts) or "no drive"


def started(name: str, text: str, cfg: HostConfig) -> int:
    d = parse(text)
    sock = our_socket(d.args)
    if sock is None:
        return 0
    log = DomainLog(cfg, name)
    opts = attach.Options(sock, [], cfg.control, mode=cfg.mode, timeout=cfg.timeout)
    # a live migration's start (not a snapshot's revert, not a start of a
    # definition that kept the monitor): until QEMU says otherwise
    marker = migrating_marker(cfg, d.uuid) if _uuid_ok(d.uuid) else None
    incoming = marker is not None and marker.exists()
    if marker is not None:
        marker.unlink(missing_ok=True)
    status = "?"
    try:
        with attach.connect_socket(sock, cfg.timeout) as q:
            status = q.command("query-status")["status"]
            incoming = incoming and status == "inmigrate"
            r = attach.attach(opts, q)
            refs = attach.block_refs_state(q)
        if not r["ok"]:
            err = r["error"]
            raise HookFailed(
                f"the filter is not attached: {err['message']}"
                + (f" (hint: {err['hint']})" if err.get("hint") else "")
            )
        # the stream checks it too, but later, and in QEMU's words
        want = d.block_refs if d.marked else False
        if incoming and bool(refs) != want:
            raise HookFailed(
                f"block-refs is {'on' if refs else 'off'} in this QEMU, but the "
                f"source has it {'on' if want else 'off'}"
            )
    except (HookFailed, attach.AttachError, QMPError) as e:
        msg = e.message if isinstance(e, attach.AttachError) else str(e)
        if incoming:
            log.line(
                f"migrating in: {msg}; refusing the migration (the guest keeps "
                "running on the source)",
                echo=False,
            )
            print(
                f"{PROG}: {name} cannot take the pageshare filter on this host before the "
                f"guest runs here: {msg}.  The migration is refused; the guest keeps running "
                "on the source.  To migrate it without the filter, run `pageshare detach "
                f"--libvirt {name}` on the source first.",
                file=sys.stderr,
            )
            return 1
        log.line(f"{_when(status)}: {msg}; libvirt-watch attaches on the start event")
        return 0
    if incoming:
        log.line(
            f"migrating in: {_drives_text(r)} before the guest runs here; "
            f"block-refs {'on' if refs else 'off'}"
        )
    else:
        log.line(f"{_when(status)}: {_drives_text(r)}")
    return 0


def _when(status: str) -> str:
    return "loading a saved state" if status == "inmigrate" else "starting"


def migrate(name: str, text: str, cfg: HostConfig) -> int:
    out = rewrite(text, cfg)
    d = parse(text if out is None else out)
    if _uuid_ok(d.uuid):
        marker = migrating_marker(cfg, d.uuid)
        if d.marked:
            try:
                marker.write_text(f"{name}\n")
            except OSError as e:
                raise ConfigError(
                    f"cannot write {marker}: {e} (qmp_dir in the "
                    "configuration: a directory root may write)"
                ) from None
        else:
            marker.unlink(missing_ok=True)
    if out is None:
        return 0
    DomainLog(cfg, name).line(
        "migrating in: "
        + (
            f"its QEMU gets the monitor {our_socket(d.args)} for the filter"
            + (" and block-refs on" if d.block_refs else "")
            if d.marked
            else "not marked by libvirt-watch: pageshare's QEMU arguments removed"
        )
    )
    sys.stdout.write(out)
    return 0


def restore(name: str, text: str, cfg: HostConfig) -> int:
    """A saved state is loaded as a migration stream that flows the moment
    QEMU is told to take it, before any hook can add the filter: the domain
    gets none of our arguments (libvirt-watch attaches once it starts)."""
    out = rewrite(text, cfg, add=False)
    if out is None:
        return 0
    DomainLog(cfg, name).line(
        "restoring: pageshare's QEMU arguments removed (libvirt-watch attaches on the start event)"
    )
    sys.stdout.write(out)
    return 0


EPILOG = """\
what it does:
  libvirtd runs it (installed as /etc/libvirt/hooks/qemu.d/pageshare; libvirtd
  finds hooks when it starts or reloads) with the domain's name, the operation
  and the domain XML on stdin.  Two operations matter:
    migrate begin   on the destination, before QEMU starts: a domain whose
                    source's libvirt-watch attached the filter gets a private
                    QMP monitor (and block-refs, if the source uses it)
    started begin   after migrate-incoming, before the source sends anything:
                    the filter is attached over that monitor; a failure makes
                    libvirt refuse the migration (the guest stays on the source)
  and on restore begin (virsh restore, a managed save) those QEMU arguments are
  removed: a saved state flows into QEMU before any hook could add the filter.
  Lines go into the domain's libvirt log (log_dir/DOMAIN.log).
configuration: /etc/pageshare/libvirt.toml (control, mode, timeout, qmp_dir,
  log_dir), shared with libvirt-watch.
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EPILOG,
        description="The libvirt qemu hook: the pageshare filter on the destination of a "
        "live migration, before the guest runs there.",
    )
    p.add_argument(
        "--config",
        type=Path,
        default=DEFAULT_CONFIG,
        metavar="PATH",
        help=f"the host's pageshare libvirt configuration (default {DEFAULT_CONFIG})",
    )
    p.add_argument("domain", help="the domain's name (libvirt's first argument)")
    p.add_argument("operation", help="migrate, started, ... (libvirt's second argument)")
    p.add_argument("suboperation", help="begin, end, ... (libvirt's third argument)")
    p.add_argument("extra", nargs="?", default="-", help="libvirt's fourth argument")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    op = (args.operation, args.suboperation)
    if op not in (("migrate", "begin"), ("started", "begin"), ("restore", "begin")):
        return 0
    text = sys.stdin.read()
    try:
        cfg = load(args.config)
        if op == ("migrate", "begin"):
            return migrate(args.domain, text, cfg)
        if op == ("restore", "begin"):
            return restore(args.domain, text, cfg)
        return started(args.domain, text, cfg)
    except ConfigError as e:
        print_error(str(e), prog=PROG)
        return 1
