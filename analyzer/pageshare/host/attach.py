"""`pageshare attach` / `pageshare detach`: put the pageshare filter into a
running QEMU's block graph over QMP, or take it out, without touching the
VM's definition.

attach, for each chain overlay -> base (the node at the bottom of a backing
chain) in the QEMU behind a QMP socket:

1. ask the page server (its control socket, STATUS) which images it serves,
   and match the base's file to one of them by device and inode (any path to
   the same file matches, a copy does not);
2. `blockdev-add` a pageshare node (read-only, `server` = that image's
   socket, `image-sha256` = the content the server verified) whose `file`
   child is the base node;
3. re-point the overlay's backing child at it: `blockdev-reopen` when the
   overlay's whole definition is on QEMU's command line (-blockdev JSON, as
   libvirt writes it), else HMP `qemu-io <node> "reopen -o backing=..."`,
   which keeps every other option as it is (blockdev-reopen resets what it
   is not given, and QEMU does not report all of a node's options); nodes
   QEMU named itself (-drive) can only be reopened that way: blockdev-reopen
   refuses them ("Cannot change the option 'node-name'").

The filter then checks on its own that the base is the very file the server
verified (PROTOCOL.md, "Proof of identity"): whatever attach believes, a
wrong match reads from disk, never wrong bytes.

detach re-points each overlay at the base again and deletes the filter node,
e.g. before migrating the VM to a host without pageshare.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import PageshareError, parse_args_or_exit_code, print_error, print_json_error
from .libvirt_qmp import DEFAULT_URI, LibvirtQMP, LibvirtUnavailable
from .qmp import QMP, Monitor, QMPError, qmp_socket_of
from .server_control import DEFAULT_CONTROL, UNREACHABLE, server_status, unreachable_reason

# Options of an overlay that QEMU reports, kept when blockdev-reopen is used
# (it resets every option it is not given to its default).
NODE_NAME_MAX = 31
# The children a format node can have (given by name when it is reopened).
CHILDREN = ("file", "backing", "data-file")
# Fields of query-named-block-nodes that must read the same after a reopen.
KEPT_FIELDS = ("drv", "ro", "cache", "detect_zeroes", "encrypted", "write_threshold")
# What the filter adds to query-blockstats, shown after attach and at detach.
STAT_KEYS = (
    "connected",
    "generation",
    "table-entries",
    "degraded",
    "requests",
    "merged",
    "fallback-no-table",
    "fallback-not-listed",
    "fallback-not-guest-ram",
    "fallback-unaligned",
    "fallback-unsupported",
    "fallback-merge-failed",
    "fallback-unproven",
    "base-changed",
    "merge-unsupported",
    "connects",
    "connect-failures",
)


class AttachError(PageshareError):
    """A failure an operator can act on: kind (stable, for --json), message, hint."""

    def __init__(self, kind: str, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.kind, self.message, self.hint = kind, message, hint

    def to_json(self) -> dict[str, str]:
        return {"kind": self.kind, "message": self.message, "hint": self.hint}


# --------------------------------------------------------------------------- the block graph


@dataclass
class Node:
    name: str
    drv: str
    file: str  # query-named-block-nodes "file": the filename
    info: dict[str, Any]
    children: dict[str, str] = field(default_factory=dict)  # child name -> node name
    parents: list[tuple[str, str]] = field(default_factory=list)  # (parent, child name)
    backends: list[str] = field(default_factory=list)  # BlockBackends on this node


@dataclass
class Graph:
    nodes: dict[str, Node]
    backend_names: dict[str, str]  # BlockBackend name or qdev id -> its root node

    def bottom_file(self, name: str) -> Node:
        """The protocol node a format node (or a protocol node itself) reads."""
        n = self.nodes[name]
        while "file" in n.children and n.drv not in ("file", "host_device"):
            n = self.nodes[n.children["file"]]
        return n

    def ancestors(self, name: str) -> list[str]:
        seen: list[str] = []
        todo = [name]
        while todo:
            cur = todo.pop()
            for parent, _ in self.nodes[cur].parents:
                if parent not in seen:
                    seen.append(parent)
                    todo.append(parent)
        return seen

    def labels(self, name: str) -> list[str]:
        """Names an operator may use for the drive above node ``name``: the
        BlockBackends (drive ids, qdev ids) above it, then its node names."""
        names = [name, *self.ancestors(name)]
        out = [bb for bb, root in self.backend_names.items() if root in names]
        out += [b for n in names for b in self.nodes[n].backends]
        out += names
        return list(dict.fromkeys(x for x in out if x))


def backend_label(device: str, qdev: str) -> str:
    """A drive's name: its -drive id, else its device's id (from the QOM
    path /machine/peripheral/ID/...), else that path."""
    m = re.match(r"^/machine/peripheral/([^/]+)", qdev)
    return device or (m.group(1) if m else qdev)


def read_graph(qmp: Monitor) -> Graph:
    infos = qmp.command("query-named-block-nodes", None, flat=True)
    nodes = {
        i["node-name"]: Node(i["node-name"], i["drv"], i.get("file", ""), i)
        for i in infos
        if i.get("node-name")
    }
    g = qmp.command("x-debug-query-block-graph")
    by_id = {n["id"]: n for n in g["nodes"]}
    for e in g["edges"]:
        parent, child = by_id[e["parent"]], by_id[e["child"]]
        if child["type"] != "block-driver" or child["name"] not in nodes:
            continue
        if parent["type"] == "block-driver" and parent["name"] in nodes:
            nodes[parent["name"]].children[e["name"]] = child["name"]
            nodes[child["name"]].parents.append((parent["name"], e["name"]))
        elif parent["type"] == "block-backend" and parent["name"]:
            nodes[child["name"]].backends.append(parent["name"])
    backends: dict[str, str] = {}
    for b in qmp.command("query-block"):
        root = (b.get("inserted") or {}).get("node-name")
        if not root:
            continue
        if b.get("device"):
            backends[b["device"]] = root
        qdev = b.get("qdev") or ""
        if qdev:
            # the device's id (-device ...,id=disk0) first, then its QOM path
            backends[backend_label("", qdev)] = root
            backends[qdev] = root
    return Graph(nodes, backends)


@dataclass
class Chain:
    """One overlay whose backing child is a base (a node with no backing
    child), directly or through a pageshare node."""

    overlay: str
    base: str
    filter: str | None  # the pageshare node between them, if attached
    labels: list[str]

    @property
    def drive(self) -> str:
        return self.labels[0]


def find_chains(g: Graph) -> list[Chain]:
    out = []
    for n in g.nodes.values():
        child = n.children.get("backing")
        if child is None:
            continue
        c = g.nodes[child]
        if c.drv == "pageshare" and "file" in c.children:
            out.append(Chain(n.name, c.children["file"], c.name, g.labels(n.name)))
        elif "backing" not in c.children and c.drv != "pageshare":
            out.append(Chain(n.name, c.name, None, g.labels(n.name)))
    return sorted(out, key=lambda ch: ch.drive)


def select(chains: list[Chain], drives: list[str]) -> list[Chain]:
    if not drives:
        return chains
    out = []
    for d in drives:
        hit = [c for c in chains if d in c.labels or d == c.base]
        if not hit:
            known = sorted({c.drive for c in chains})
            raise AttachError(
                "no-such-drive",
                f"no drive {d!r} with a backing chain in this QEMU",
                "give a drive id, qdev id or node name of an overlay over a base"
                + (
                    f"; drives with a base: {', '.join(known)}"
                    if known
                    else "; this QEMU has no overlay over a base image at all"
                ),
            )
        out += [c for c in hit if c not in out]
    return out


# --------------------------------------------------------------------------- QEMU


def has_driver(qmp: Monitor) -> bool:
    """Is "pageshare" a block driver this QEMU knows (its QMP schema)?"""
    for e in qmp.command("query-qmp-schema"):
        if isinstance(e, dict) and "pageshare" in (e.get("values") or []):
            return True
    return False


# The migration capability of qemu-patches 0006: pages that hold a listed
# block travel as references to it (docs/ARCHITECTURE.md, "Live migration").
BLOCK_REFS = "block-refs"


def block_refs_state(qmp: Monitor) -> bool | None:
    """Is the block-refs migration capability on (None: this QEMU has none)?"""
    for c in qmp.command("query-migrate-capabilities"):
        if c.get("capability") == BLOCK_REFS:
            return bool(c.get("state"))
    return None


def set_block_refs(qmp: Monitor, on: bool) -> None:
    qmp.command(
        "migrate-set-capabilities", None, capabilities=[{"capability": BLOCK_REFS, "state": on}]
    )


def cmdline_blockdevs(pid: int | None) -> dict[str, dict[str, Any]]:
    """-blockdev JSON definitions on a QEMU's command line, by node name."""
    if pid is None:
        return {}
    try:
        argv = [
            a.decode(errors="replace")
            for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        ]
    except OSError:
        return {}
    out: dict[str, dict[str, Any]] = {}
    for i, a in enumerate(argv[:-1]):
        if a in ("-blockdev", "--blockdev") and argv[i + 1].lstrip().startswith("{"):
            try:
                d = json.loads(argv[i + 1])
            except ValueError:
                continue
            if isinstance(d, dict) and isinstance(d.get("node-name"), str):
                out[d["node-name"]] = d
    return out


def reopen_options(g: Graph, overlay: str, backing: str, defined: dict[str, Any]) -> dict[str, Any]:
    """What blockdev-reopen gets for ``overlay``: its -blockdev definition
    from the command line (blockdev-reopen resets every option it is not
    given), its children by name, the new backing child."""
    n = g.nodes[overlay]
    opts = {k: v for k, v in defined.items() if k not in CHILDREN}
    opts["driver"] = n.drv
    opts["node-name"] = overlay
    for child in CHILDREN:
        if child in n.children:
            opts[child] = n.children[child]
    opts["backing"] = backing
    return opts


def set_backing(
    qmp: Monitor, g: Graph, overlay: str, backing: str, defined: dict[str, dict[str, Any]]
) -> str:
    """Re-point ``overlay``'s backing child; returns the method used.

    blockdev-reopen when the overlay's whole definition is known (a -blockdev
    JSON on QEMU's command line, as libvirt writes it): it resets whatever it
    is not given, and QEMU reports only some options of a node (not discard,
    not qcow2's cache sizes).  Otherwise qemu-io's reopen (HMP), which keeps
    every option as it is; it is also the only way for nodes QEMU named
    itself (-drive), which blockdev-reopen refuses ("Cannot change the
    option 'node-name'")."""
    if overlay in defined:
        opts = reopen_options(g, overlay, backing, defined[overlay])
        qmp.command("blockdev-reopen", None, options=[opts])
        return "blockdev-reopen"
    out = qmp.hmp(f'qemu-io {overlay} "reopen -o backing={backing}"').strip()
    if out:
        raise QMPError(f"qemu-io reopen: {out}")
    return "qemu-io-reopen"


def filter_stats(qmp: Monitor, node: str) -> dict[str, Any] | None:
    for s in qmp.command("query-blockstats", None, **{"query-nodes": True}):
        if s.get("node-name") == node:
            ds = s.get("driver-specific")
            if isinstance(ds, dict) and ds.get("driver") == "pageshare":
                return {k: ds[k] for k in STAT_KEYS if k in ds}
    return None


def backend_reads(qmp: Monitor, g: Graph, overlay: str) -> dict[str, Any] | None:
    """Reads accounted on the BlockBackend(s) above ``overlay`` (the guest's
    device): what the guest read before attach, overlay and base together."""
    names = {overlay, *g.ancestors(overlay)}
    ops = nbytes = 0
    found = []
    for s in qmp.command("query-blockstats"):
        root = None
        for bname, r in g.backend_names.items():
            if bname in (s.get("device"), s.get("qdev")):
                root = r
        if root in names:
            found.append(backend_label(s.get("device") or "", s.get("qdev") or ""))
            ops += int(s["stats"].get("rd_operations", 0))
            nbytes += int(s["stats"].get("rd_bytes", 0))
    if not found:
        return None
    return {"devices": found, "rd_operations": ops, "rd_bytes": nbytes}


def filter_name(g: Graph, base: str) -> str:
    stem = "pageshare-" + re.sub(r"[^A-Za-z0-9_.-]", "", base)
    name = stem[:NODE_NAME_MAX]
    i = 1
    while name in g.nodes:
        i += 1
        name = f"{stem[: NODE_NAME_MAX - 1 - len(str(i))]}-{i}"
    return name


# --------------------------------------------------------------------------- the server


@dataclass
class Served:
    name: str
    path: str
    socket: str
    state: str
    generation: int | None
    blocks: int
    sha256: str | None
    format: str | None


def served_images(control: Path) -> list[Served]:
    try:
        st = server_status(control)
    except UNREACHABLE as e:
        why = unreachable_reason(e)
        raise AttachError(
            "server-down",
            f"no pageshare-server answers on {control} ({why}); nothing changed",
            "start it (systemctl start pageshare-server) and attach again; or pass --control "
            "SOCKET_DIR/control.sock if it runs with another socket_dir; or --socket "
            "IMAGE.sock to attach anyway (the filter reads from disk until the server is up "
            "and then reconnects)",
        ) from None
    out = []
    for i in st.get("images") or []:
        ident = i.get("identity") or {}
        out.append(
            Served(
                str(i.get("name")),
                str(i.get("path")),
                str(i.get("socket")),
                str(i.get("state")),
                i.get("generation"),
                int(i.get("blocks") or 0),
                ident.get("content_sha256"),
                i.get("format"),
            )
        )
    return out


def same_file(a: str, b: str) -> bool:
    try:
        sa, sb = os.stat(a), os.stat(b)
    except OSError:
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def match_image(images: list[Served], base_file: str) -> Served | None:
    for img in images:
        if same_file(img.path, base_file):
            return img
    return None


# --------------------------------------------------------------------------- attach / detach


@dataclass
class Options:
    qmp: Path | None  # a QMP socket, or None with ``libvirt``
    drives: list[str]
    control: Path
    socket: Path | None = None
    mode: str | None = None
    reconnect_delay: int | None = None
    x_any_buffer: bool = False
    timeout: float = 30.0
    libvirt: str | None = None  # a libvirt domain, reached through libvirtd
    uri: str = DEFAULT_URI

    @property
    def target(self) -> str:
        return f"libvirt:{self.libvirt}" if self.libvirt else str(self.qmp)


def _describe(g: Graph, ch: Chain) -> dict[str, Any]:
    bf = g.bottom_file(ch.base)
    return {
        "drive": ch.drive,
        "labels": ch.labels,
        "overlay": ch.overlay,
        # the protocol node's name: the overlay's own becomes json:{...} once
        # its backing child is not the one its header names
        "overlay_file": g.bottom_file(ch.overlay).file,
        "base": ch.base,
        "base_format": g.nodes[ch.base].drv,
        "base_file": bf.file,
        "filter": ch.filter,
    }


@contextlib.contextmanager
def connect(opts: Options) -> Iterator[Monitor]:
    if opts.libvirt:
        try:
            lq = LibvirtQMP(opts.uri, opts.libvirt)
        except LibvirtUnavailable as e:
            raise AttachError(
                "qmp-unreachable",
                str(e),
                "is libvirtd running (--connect names its URI), and is the "
                "domain started? (`virsh -c URI list`)",
            ) from None
        try:
            yield lq
        finally:
            lq.close()
        return
    assert opts.qmp is not None
    with connect_socket(opts.qmp, opts.timeout) as q:
        yield q


@contextlib.contextmanager
def connect_socket(path: Path, timeout: float) -> Iterator[QMP]:
    if not path.exists():
        raise AttachError(
            "qmp-unreachable",
            f"no QMP socket at {path}",
            "give the socket of the VM's -qmp unix:PATH,server (or "
            "-chardev socket,path=PATH,server + -mon mode=control), or the "
            "QEMU's pid",
        )
    try:
        q = QMP(path, timeout=min(timeout, 5.0))
    except (OSError, QMPError, ValueError) as e:
        raise AttachError(
            "qmp-unreachable",
            f"cannot talk QMP on {path}: {e}",
            "is the QEMU running, and is no other client holding its QMP "
            "socket? (QEMU serves one client per QMP socket: libvirtd holds "
            "its own, so give such a VM a second -qmp socket)",
        ) from None
    try:
        q.command("query-version", timeout)  # from now on, QEMU has ``timeout`` s per command
        yield q
    finally:
        q.close()


def attach(opts: Options, monitor: Monitor | None = None) -> dict[str, Any]:
    """Attach as OPTS say, over MONITOR if given (else a connection of its own)."""
    result: dict[str, Any] = {"action": "attach", "qmp": opts.target, "drives": []}
    with contextlib.nullcontext(monitor) if monitor is not None else connect(opts) as q:
        if not has_driver(q):
            raise AttachError(
                "no-driver",
                "this QEMU has no pageshare block driver; nothing changed",
                "start the VM with the patched QEMU (qemu-patches/, `pageshare host check` "
                "lists the QEMU binaries that have it); a running VM keeps its QEMU binary",
            )
        g = read_graph(q)
        chains = select(find_chains(g), opts.drives)
        if not chains:
            raise AttachError(
                "no-overlay",
                "this QEMU has no overlay over a base image (no backing chain)",
                "pageshare shares the pages of a base image that VMs read through "
                "copy-on-write overlays; a VM whose disk is a single image has no base",
            )
        # the server is asked only if there is something to attach
        todo = [c for c in chains if c.filter is None]
        images = served_images(opts.control) if todo and opts.socket is None else []
        pid = q.peer_pid()
        result["qemu_pid"] = pid
        defined = cmdline_blockdevs(pid)
        explicit = bool(opts.drives)
        # one filter per base node, above which every selected overlay is re-pointed
        by_base: dict[str, list[Chain]] = {}
        for ch in chains:
            by_base.setdefault(ch.base, []).append(ch)
        for group in by_base.values():
            for ch in group:
                d = _describe(g, ch)
                result["drives"].append(d)
                try:
                    _attach_one(q, g, ch, d, opts, images, defined, group, pid)
                except AttachError as e:
                    d["result"] = "failed" if explicit or e.kind != "not-served" else "skipped"
                    d["error"] = e.to_json()
                except QMPError as e:
                    d["result"] = "failed"
                    d["error"] = AttachError(
                        "qemu-refused",
                        f"QEMU refused: {e}",
                        "nothing was changed for this drive; the message is QEMU's own "
                        "(a block job on the chain, or a node that writes the base, "
                        "can keep the filter out)",
                    ).to_json()
    done = [d for d in result["drives"] if d.get("result") in ("attached", "already-attached")]
    failed = [d for d in result["drives"] if d.get("result") == "failed"]
    if failed or not done:
        errs = failed or result["drives"]
        first = errs[0]["error"]
        result["ok"] = False
        result["error"] = (
            first
            if len(errs) == 1
            else {
                "kind": first["kind"],
                "message": f"{len(errs)} drive(s) not attached: "
                + "; ".join(f"{d['drive']}: {d['error']['message']}" for d in errs),
                "hint": first["hint"],
            }
        )
    else:
        result["ok"] = True
    return result


def _attach_one(
    q: Monitor,
    g: Graph,
    ch: Chain,
    d: dict[str, Any],
    opts: Options,
    images: list[Served],
    defined: dict[str, dict[str, Any]],
    group: list[Chain],
    pid: int | None,
) -> None:
    if ch.filter is not None:
        d["result"] = "already-attached"
        d["stats"] = filter_stats(q, ch.filter)
        return
    base_file = d["base_file"]
    local = base_file  # where this process finds it
    if not base_file.startswith("/") and pid is not None:
        local = f"/proc/{pid}/cwd/{base_file}"  # relative to QEMU's directory
    img: Served | None = None
    if opts.socket is None:
        img = match_image(images, local)
        if img is None:
            served = ", ".join(f"{i.name} ({i.path})" for i in images) or "none"
            raise AttachError(
                "not-served",
                f"its base {base_file} is not an image the server serves (served: {served})",
                "a VM shares pages only if its base is the very file a server [[image]] "
                "path names (any path to the same inode); add it to the server's config, "
                "or leave this VM as it is",
            )
        want_fmt = {"raw": ("raw", "file", "host_device"), "qcow2": ("qcow2",)}
        if img.format and d["base_format"] not in want_fmt.get(img.format, (img.format,)):
            raise AttachError(
                "not-served",
                f"its base {base_file} is the file of image {img.name}, but the VM reads it "
                f"as {d['base_format']} and the server as {img.format}",
                "the filter would read everything from disk; open the base in the server's format",
            )
        d["image"] = {
            "name": img.name,
            "path": img.path,
            "socket": img.socket,
            "state": img.state,
            "generation": img.generation,
            "blocks": img.blocks,
        }
        warnings = []
        if img.state != "serving" or img.generation is None:
            warnings.append(
                f"image {img.name} is not serving yet (state {img.state}): "
                "reads go to disk until its list is published"
            )
        if warnings:
            d["warnings"] = warnings
        sock = img.socket
    else:
        sock = str(opts.socket)
        d["image"] = {"socket": sock}
    # the filter for this base may already exist: another overlay over the
    # same base node reads through it (attached before, or a moment ago)
    existing = next((c.filter for c in group if c.filter), None)
    name = existing or filter_name(g, ch.base)
    added = False
    if existing is None:
        args: dict[str, Any] = {
            "driver": "pageshare",
            "node-name": name,
            "file": ch.base,
            "read-only": True,
            "server": sock,
        }
        if img is not None and img.sha256:
            args["image-sha256"] = img.sha256
        if opts.mode:
            args["mode"] = opts.mode
        if opts.reconnect_delay is not None:
            args["reconnect-delay"] = opts.reconnect_delay
        if opts.x_any_buffer:
            args["x-any-buffer"] = True
        d["filter_options"] = args
        q.command("blockdev-add", None, **args)
        added = True
        g.nodes[name] = Node(name, "pageshare", "", {}, {"file": ch.base})
    before = dict(g.nodes[ch.overlay].info)
    try:
        d["reads_before"] = backend_reads(q, g, ch.overlay)
        d["method"] = set_backing(q, g, ch.overlay, name, defined)
        after = next(
            i
            for i in q.command("query-named-block-nodes", None, flat=True)
            if i.get("node-name") == ch.overlay
        )
        changed = {
            k: (before.get(k), after.get(k)) for k in KEPT_FIELDS if before.get(k) != after.get(k)
        }
        if changed:
            set_backing(q, g, ch.overlay, ch.base, defined)
            raise AttachError(
                "qemu-refused",
                f"re-pointing {ch.overlay} would have changed its options {changed}; undone",
                "name the overlay's options on the command line (-blockdev JSON) so "
                "that they can be given again, and report this",
            )
    except BaseException:
        if added:
            with contextlib.suppress(QMPError):
                q.command("blockdev-del", None, **{"node-name": name})
            del g.nodes[name]
        raise
    ch.filter = name
    d["filter"] = name
    d["result"] = "attached"
    d["stats"] = filter_stats(q, name)


def detach(opts: Options) -> dict[str, Any]:
    result: dict[str, Any] = {"action": "detach", "qmp": opts.target, "drives": []}
    with connect(opts) as q:
        g = read_graph(q)
        chains = select(find_chains(g), opts.drives)
        pid = q.peer_pid()
        result["qemu_pid"] = pid
        defined = cmdline_blockdevs(pid)
        for ch in chains:
            d = _describe(g, ch)
            result["drives"].append(d)
            if ch.filter is None:
                d["result"] = "not-attached"
                continue
            try:
                d["stats"] = filter_stats(q, ch.filter)
                d["method"] = set_backing(q, g, ch.overlay, ch.base, defined)
                d["result"] = "detached"
            except QMPError as e:
                d["result"] = "failed"
                d["error"] = AttachError(
                    "qemu-refused",
                    f"QEMU refused: {e}",
                    "the filter stays in place and the VM keeps running; the message is QEMU's own",
                ).to_json()
        # delete the filter nodes nobody uses any more
        g2 = read_graph(q)
        for f in sorted({ch.filter for ch in chains if ch.filter}):
            n = g2.nodes.get(f)
            if n is None:
                continue  # an implicit node (-drive backing.driver=...) went with its parent
            if n.parents or n.backends:
                users = ", ".join(p for p, _ in n.parents) or ", ".join(n.backends)
                for d in result["drives"]:
                    if d["filter"] == f and d["result"] == "detached":
                        d.setdefault("warnings", []).append(
                            f"filter node {f} kept: {users} still read(s) through it"
                        )
                continue
            try:
                q.command("blockdev-del", None, **{"node-name": f})
            except QMPError as e:
                for d in result["drives"]:
                    if d["filter"] == f:
                        d.setdefault("warnings", []).append(f"filter node {f} not deleted: {e}")
        # no filter left: no block references either (a QEMU without pageshare
        # refuses a stream that has them), and libvirt's domain loses its mark
        if not any(n.drv == "pageshare" for n in read_graph(q).nodes.values()):
            _unmark(q, result)
    failed = [d for d in result["drives"] if d["result"] == "failed"]
    result["ok"] = not failed
    if failed:
        result["error"] = failed[0]["error"]
    return result


def _unmark(q: Monitor, result: dict[str, Any]) -> None:
    try:
        if block_refs_state(q):
            set_block_refs(q, False)
            result["block_refs"] = "turned off"
        if isinstance(q, LibvirtQMP):
            q.set_metadata(None)
    except QMPError as e:
        result.setdefault("warnings", []).append(
            f"block-refs not turned off: {e}; a migration to a host without pageshare "
            "fails (the guest stays here): `virsh qemu-monitor-command DOMAIN "
            '\'{"execute": "migrate-set-capabilities", "arguments": '
            '{"capabilities": [{"capability": "block-refs", "state": false}]}}\'`'
        )


def status(opts: Options) -> dict[str, Any]:
    result: dict[str, Any] = {"action": "status", "qmp": opts.target, "drives": []}
    with connect(opts) as q:
        g = read_graph(q)
        for ch in select(find_chains(g), opts.drives):
            d = _describe(g, ch)
            d["result"] = "attached" if ch.filter else "not-attached"
            if ch.filter:
                d["stats"] = filter_stats(q, ch.filter)
            result["drives"].append(d)
    result["ok"] = True
    return result


# --------------------------------------------------------------------------- output


def _stats_line(s: dict[str, Any] | None) -> str:
    if not s:
        return "filter: no statistics"
    fb = sum(int(v) for k, v in s.items() if k.startswith("fallback-"))
    conn = (
        f"connected, generation {s.get('generation')}, {s.get('table-entries')} blocks listed"
        if s.get("connected")
        else "not connected to its server (reads go to disk; it reconnects)"
    )
    return (
        f"filter: {conn}; {s.get('requests', 0)} read requests, {s.get('merged', 0)} "
        f"blocks merged/copied, {fb} read from disk"
        + ("; BASE CHANGED: all reads from disk" if s.get("base-changed") else "")
    )


def failure(action: str, target: str | None, e: AttachError | QMPError) -> dict[str, Any]:
    """The result of an action that failed before any drive had one."""
    error = (
        e.to_json()
        if isinstance(e, AttachError)
        else {
            "kind": "qemu-refused",
            "message": f"QMP: {e}",
            "hint": "nothing was changed; the message is QEMU's own",
        }
    )
    return {"action": action, "qmp": target, "drives": [], "ok": False, "error": error}


def render_text(r: dict[str, Any]) -> str:
    lines = []
    for d in r["drives"]:
        lines.append(
            f"{d['drive']}: overlay {d['overlay']} ({d['overlay_file']}) over base "
            f"{d['base']} ({d['base_file']})"
        )
        res = d.get("result", "?")
        if r["action"] == "status":
            if res == "attached":
                lines.append(f"  attached: filter {d['filter']}")
                lines.append("  " + _stats_line(d.get("stats")))
            else:
                lines.append("  not attached: reads of the base go to disk")
        elif res == "attached":
            img = d.get("image") or {}
            what = (f"image {img['name']}, " if "name" in img else "") + f"socket {img['socket']}"
            lines.append(f"  attached: filter {d['filter']} ({what}), by {d.get('method')}")
            rb = d.get("reads_before")
            if rb:
                lines.append(
                    f"  before attach the guest read {rb['rd_operations']} requests, "
                    f"{rb['rd_bytes'] / 2**20:.1f} MiB through "
                    f"{', '.join(rb['devices'])} (overlay and base): base blocks "
                    "among them came from disk and stay private copies until the "
                    "guest reads them again"
                )
            lines.append("  " + _stats_line(d.get("stats")))
        elif res == "already-attached":
            lines.append(f"  already attached: filter {d['filter']}, nothing changed")
            lines.append("  " + _stats_line(d.get("stats")))
        elif res == "detached":
            lines.append(
                f"  detached: filter {d['filter']} removed, the base is read from "
                f"disk again (by {d.get('method')})"
            )
            lines.append("  while attached, " + _stats_line(d.get("stats")))
        elif res == "not-attached":
            lines.append("  not attached, nothing to do")
        else:
            e = d.get("error") or {}
            lines.append(f"  {res}: {e.get('message')}")
            if e.get("hint"):
                lines.append(f"  hint: {e['hint']}")
        for w in d.get("warnings", []):
            lines.append(f"  warning: {w}")
    if r.get("block_refs") == "turned off":
        lines.append("no filter left: the migration capability block-refs is off again")
    for w in r.get("warnings", []):
        lines.append(f"warning: {w}")
    if not r["drives"] and r["ok"]:
        lines.append("no overlay over a base image in this QEMU")
    if not r["ok"]:
        e = r["error"]
        lines.append(f"pageshare {r['action']}: error: {e['message']}")
        if e.get("hint"):
            lines.append(f"pageshare {r['action']}: hint: {e['hint']}")
    return "\n".join(lines) + "\n"


ATTACH_EPILOG = """\
what it does:
  1. connects to the QEMU's QMP socket and checks that it has the pageshare
     block driver (the patched QEMU of qemu-patches/)
  2. finds each overlay whose backing child is a base image (the bottom of a
     backing chain), with -blockdev node names or the names QEMU generates for
     -drive ("#block123")
  3. asks the page server (--control) which images it serves and matches each
     base by its file (device and inode: any path to the same file)
  4. adds a read-only pageshare node above the base (blockdev-add: server =
     the image's socket, image-sha256 = the content the server verified)
  5. re-points the overlay's backing child at it: blockdev-reopen when the
     overlay's -blockdev JSON is on QEMU's command line (libvirt), else HMP
     qemu-io "reopen -o backing=..." (also for -drive's generated names,
     which blockdev-reopen refuses); the overlay's other options stay as
     they were, which is checked
  6. prints the filter's counters: merges (copies in copy mode) start with
     the next reads of listed blocks
Reads before attach went to disk: the guest's page cache keeps those pages
as private copies until it reads them again.  The filter checks by itself
that the base is the very file the server verified; anything else reads
from disk, never wrong bytes.  Idempotent: an attached drive is left as it
is.  Without --drive every drive whose base is served is attached, the
others are skipped; it fails if none could be.

exit status: 0 every selected drive attached (or already was), 1 a drive
could not be attached (its error says why; nothing changed for it), 2 usage.

examples:
  pageshare attach /run/vm1.qmp
  pageshare attach /run/vm1.qmp --drive drive0 --json
  pageshare attach 12345                 # a QEMU pid: its -qmp socket
  pageshare attach /run/vm1.qmp --status # which drives have the filter, its counters
  pageshare detach /run/vm1.qmp          # before migrating to a host without pageshare
  pageshare attach --libvirt vm1         # a libvirt domain (libvirtd holds its QMP)
VMs that libvirt starts get the filter at every start, with nobody typing
this, from `pageshare libvirt-watch` (its systemd unit).
"""

DETACH_EPILOG = """\
what it does:
  re-points each overlay's backing child at its base again (blockdev-reopen,
  or HMP qemu-io reopen, as attach does) and deletes the pageshare
  node, printing what the filter did while attached.  Pages already merged
  stay in guest RAM as ordinary copy-on-write pages.  Run it before migrating
  the VM to a host without pageshare (the destination QEMU must be able to
  open the same graph).  Once no filter is left, the migration capability
  block-refs is turned off too (a QEMU without pageshare refuses a stream
  with it), and a libvirt domain loses the mark libvirt-watch gave it (its
  <metadata>), so that no destination's hook attaches the filter again.
  Idempotent: a drive without the filter is left as it is.

exit status: 0 every selected drive detached (or had no filter), 1 QEMU
refused (the filter stays, the VM keeps running), 2 usage.
"""


def build_parser(action: str) -> argparse.ArgumentParser:
    prog = f"pageshare {action}"
    if action == "attach":
        desc = (
            "Put the pageshare filter above the base image of a running QEMU's disks, "
            "over QMP, without changing the VM's definition."
        )
    else:
        desc = "Take the pageshare filter out of a running QEMU's disks, over QMP."
    p = argparse.ArgumentParser(
        prog=prog,
        description=desc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=ATTACH_EPILOG if action == "attach" else DETACH_EPILOG,
    )
    p.add_argument(
        "qmp",
        metavar="QMP",
        nargs="?",
        help="the QEMU's QMP unix socket, or the pid of a QEMU started with one",
    )
    p.add_argument(
        "--libvirt",
        metavar="DOMAIN",
        help="instead of QMP: a running libvirt domain, reached through libvirtd "
        "(which holds the QEMU's QMP socket)",
    )
    p.add_argument(
        "--connect",
        metavar="URI",
        default=DEFAULT_URI,
        help=f"libvirt's URI with --libvirt (default {DEFAULT_URI})",
    )
    p.add_argument(
        "--drive",
        action="append",
        default=[],
        metavar="NAME",
        help="only this drive: a -drive id, a device (qdev) id, or a node name of "
        "its overlay or base (repeatable; default: all)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help='print the result as JSON; on failure {"ok": false, "exit_code", '
        '"error": {kind, message, hint}} with each drive\'s own result',
    )
    p.add_argument("--timeout", type=float, default=30.0, help="seconds per QMP command")
    if action == "attach":
        p.add_argument(
            "--control",
            type=Path,
            default=DEFAULT_CONTROL,
            metavar="PATH",
            help=f"the page server's control socket (default {DEFAULT_CONTROL})",
        )
        p.add_argument(
            "--socket",
            type=Path,
            metavar="PATH",
            help="attach with this image socket without asking the server which "
            "image is the base (e.g. the server is not up yet: the filter "
            "reads from disk and reconnects)",
        )
        p.add_argument(
            "--mode",
            choices=("merge", "copy"),
            help="merge (default: merge_pages(2)) or copy (testing, stock kernels)",
        )
        p.add_argument(
            "--reconnect-delay",
            type=int,
            metavar="S",
            help="seconds between the filter's reconnection attempts (default 5)",
        )
        p.add_argument(
            "--x-any-buffer",
            action="store_true",
            help="testing only: treat every page-aligned buffer as guest RAM "
            "(HMP qemu-io reads into QEMU's own buffers)",
        )
        p.add_argument(
            "--status",
            action="store_true",
            help="change nothing: show which drives have the filter and its counters",
        )
    return p


def resolve_qmp(arg: str) -> Path:
    if arg.isdigit():
        try:
            argv = [
                a.decode(errors="replace")
                for a in Path(f"/proc/{arg}/cmdline").read_bytes().split(b"\0")
                if a
            ]
        except OSError:
            raise AttachError(
                "qmp-unreachable", f"no process {arg}", "give a QEMU's pid or its QMP socket"
            ) from None
        path = qmp_socket_of(argv)
        if path is None:
            raise AttachError(
                "qmp-unreachable",
                f"process {arg} has no QMP unix socket on its command line",
                "start QEMU with -qmp unix:PATH,server=on,wait=off, or give the socket",
            )
        return path
    return Path(arg)


def main(argv: list[str], action: str = "attach") -> int:
    p = build_parser(action)
    want_json = "--json" in argv
    usage = f"see pageshare {action} --help"

    def print_json_usage() -> None:
        print_json_error("usage", f"bad arguments: {' '.join(argv)}", usage, action=action)

    args = parse_args_or_exit_code(p, argv, print_json_usage)
    if isinstance(args, int):
        return args
    target = f"libvirt:{args.libvirt}" if args.libvirt else args.qmp
    if (args.qmp is None) == (args.libvirt is None):
        msg = "give either QMP (a socket or a QEMU pid) or --libvirt DOMAIN"
        if want_json:
            print_json_error("usage", msg, usage, action=action)
        else:
            p.print_usage(sys.stderr)
            print_error(msg, prog=f"pageshare {action}")
        return 2
    try:
        opts = Options(
            resolve_qmp(args.qmp) if args.qmp else None,
            list(args.drive),
            getattr(args, "control", DEFAULT_CONTROL),
            getattr(args, "socket", None),
            getattr(args, "mode", None),
            getattr(args, "reconnect_delay", None),
            getattr(args, "x_any_buffer", False),
            args.timeout,
            args.libvirt,
            args.connect,
        )
        if action == "detach":
            result = detach(opts)
        elif args.status:
            result = status(opts)
        else:
            result = attach(opts)
    except (AttachError, QMPError) as e:
        result = failure(action, target, e)
    rc = 0 if result["ok"] else 1
    result["exit_code"] = rc
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        text = render_text(result)
        body, _, err = text.partition(f"pageshare {action}: error: ")
        sys.stdout.write(body)
        if err:
            sys.stderr.write(f"pageshare {action}: error: {err}")
    return rc
