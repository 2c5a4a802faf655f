"""`pageshare attach` / `pageshare detach` end to end: the real command (as
an operator runs it) against the real patched QEMU (qemu-system-x86_64 -M
none, its block graph built with -blockdev, -drive or blockdev-add, reads
with HMP qemu-io into QEMU's own buffers: copy mode, x-any-buffer) and a
real pageshare-server.

Every block of the base is filled with one byte that depends on the block
(and differs from the bytes written to the overlay), so one wrong block is
one failed pattern check; every read is checked against what the disk chain
holds, before attach (the base read from disk, no filter), while attached
(listed blocks copied from the server) and after detach (from disk again).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from page_server_helpers import ImageSpec, Server, make_list, wait_for
from pageshare.host import libvirt_watch
from pageshare.host.qmp import QMP
from pageshare.lists import sectorlist
from qemu_helpers import qemu_build

pytestmark = pytest.mark.build

assert os.geteuid() == 0, "copy mode reads the page server's memory: run as root"

REPO = Path(__file__).resolve().parents[2]
DEBIAN_QEMU = "/usr/bin/qemu-system-x86_64"
BLOCKS = 2048  # 8 MiB images
LISTED = list(range(0, 256, 2))  # 128 listed blocks
UNLISTED = [1, 3, 300, 1001]
WRITTEN = 4  # a listed block the guest overwrites in its overlay
NEW = 0xFE  # the byte it writes (no pattern uses it)


def pattern(kind: str, block: int) -> int:
    return 1 + (block + (0 if kind == "A" else 100)) % 251


def make_image(path: Path, kind: str) -> Path:
    with open(path, "wb") as f:
        for b in range(BLOCKS):
            f.write(bytes([pattern(kind, b)]) * 4096)
    return path


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("attach")
    a, b = make_image(d / "a.raw", "A"), make_image(d / "b.raw", "B")
    data = a.read_bytes()
    ident = sectorlist.ImageIdentity(len(data), hashlib.sha256(data).hexdigest(), a.name)
    make_list(
        ident,
        {
            blk * 8: hashlib.sha256(data[blk * 4096 : (blk + 1) * 4096]).hexdigest()
            for blk in LISTED
        },
        d / "a.pcsl",
    )
    return {"a": a, "b": b, "list": d / "a.pcsl"}


@pytest.fixture
def server(images: dict[str, Path], tmp_path: Path) -> Iterator[Server]:
    s = Server(
        tmp_path / "srv", [ImageSpec("golden", images["a"], list_file=images["list"], fmt="raw")]
    )
    s.start()
    s.wait_generation("golden", 1)
    try:
        yield s
    finally:
        s.stop(signal.SIGKILL)


class Vm:
    """A QEMU with no machine; its block graph over QMP, reads with HMP
    qemu-io (which prints to QEMU's stdout, line-buffered into a file)."""

    def __init__(
        self,
        tmp: Path,
        name: str,
        args: list[str],
        binary: str | None = None,
        machine: tuple[str, ...] = ("-M", "none"),
        cwd: Path | None = None,
    ) -> None:
        self.tmp, self.name = tmp, name
        self.qmp_path = tmp / f"{name}.qmp"  # the operator's (pageshare attach)
        self.test_qmp_path = tmp / f"{name}-test.qmp"  # the test's own (QEMU serves one
        self.stdout_path = tmp / f"{name}.stdout"  # client per socket)
        with open(self.stdout_path, "wb") as out:
            self.proc = subprocess.Popen(
                [
                    "stdbuf",
                    "-oL",
                    binary or qemu_build().qemu_system,
                    *machine,
                    "-nodefaults",
                    "-display",
                    "none",
                    "-qmp",
                    f"unix:{self.qmp_path},server=on,wait=off",
                    "-qmp",
                    f"unix:{self.test_qmp_path},server=on,wait=off",
                    *args,
                ],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=cwd,
            )
        self.qmp = QMP(self.test_qmp_path, timeout=30)
        self.out_pos = 0

    def qemu_io(self, device: str, cmd: str) -> str:
        """What qemu-io printed (on QEMU's stdout), after the monitor's own
        reply (errors such as a device that is not there)."""
        reply = self.qmp.hmp(f'qemu-io {device} "{cmd}"')
        with open(self.stdout_path, "rb") as f:
            f.seek(self.out_pos)
            out = f.read()
        self.out_pos += len(out)
        return reply + out.decode(errors="replace")

    def wrong_blocks(self, device: str, want: dict[int, int]) -> list[int]:
        """Read each block of ``want`` (block -> fill byte) through the
        chain; the blocks whose bytes were not what the chain holds."""
        wrong = []
        for b, pat in want.items():
            out = self.qemu_io(device, f"read -P {pat} {b * 4096} 4096")
            assert "read 4096/4096 bytes" in out, out
            if "Pattern verification failed" in out:
                wrong.append(b)
        return wrong

    def nodes(self) -> dict[str, dict[str, Any]]:
        return {
            n["node-name"]: n for n in self.qmp.command("query-named-block-nodes", None, flat=True)
        }

    def pageshare_nodes(self) -> list[str]:
        return [k for k, n in self.nodes().items() if n["drv"] == "pageshare"]

    def stats(self, node: str) -> dict[str, Any] | None:
        for s in self.qmp.command("query-blockstats", None, **{"query-nodes": True}):
            if (
                s.get("node-name") == node
                and s.get("driver-specific", {}).get("driver") == "pageshare"
            ):
                d: dict[str, Any] = s["driver-specific"]
                return d
        return None

    def log(self) -> str:
        return self.stdout_path.read_text(errors="replace")

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.qmp.close()
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def vms() -> Iterator[list[Vm]]:
    made: list[Vm] = []
    try:
        yield made
    finally:
        for vm in made:
            vm.close()


def overlay(tmp: Path, name: str, base: Path) -> Path:
    ovl = tmp / f"{name}.qcow2"
    # 4 KiB clusters: a write to one block copies no neighbour into the overlay
    subprocess.run(
        [
            qemu_build().qemu_img,
            "create",
            "-q",
            "-f",
            "qcow2",
            "-o",
            "cluster_size=4096",
            "-b",
            str(base),
            "-F",
            "raw",
            str(ovl),
        ],
        check=True,
    )
    return ovl


def blockdev_vm(
    vms: list[Vm],
    tmp: Path,
    name: str,
    base: Path,
    *,
    on_cmdline: bool = False,
    ovl_opts: dict[str, Any] | None = None,
    base_writable: bool = False,
) -> Vm:
    """overlay "ovl" over base "base" with node names of their own, defined
    on the command line (-blockdev JSON, as libvirt writes it) or added
    over QMP (blockdev-add, as a hot-plug does)."""
    ovl = overlay(tmp, name, base)
    defs: list[dict[str, Any]] = [
        {
            "driver": "file",
            "node-name": "base-file",
            "filename": str(base),
            "read-only": not base_writable,
        },
        {"driver": "raw", "node-name": "base", "file": "base-file", "read-only": True},
        {"driver": "file", "node-name": "ovl-file", "filename": str(ovl)},
        {
            "driver": "qcow2",
            "node-name": "ovl",
            "file": "ovl-file",
            "backing": "base",
            **(ovl_opts or {}),
        },
    ]
    args = [a for d in defs for a in ("-blockdev", json.dumps(d))] if on_cmdline else []
    vm = Vm(tmp, name, args)
    vms.append(vm)
    if not on_cmdline:
        for d in defs:
            vm.qmp.command("blockdev-add", None, **d)
    return vm


def drive_vm(vms: list[Vm], tmp: Path, name: str, base: Path, extra: str = "") -> Vm:
    """-drive: QEMU names every node itself (#blockNNN)."""
    ovl = overlay(tmp, name, base)
    vm = Vm(tmp, name, ["-drive", f"if=none,id=drive0,file={ovl},format=qcow2{extra}"])
    vms.append(vm)
    return vm


def pageshare(*args: str) -> tuple[int, str, str]:
    env = dict(os.environ, PYTHONPATH=str(REPO / "analyzer"))
    p = subprocess.run(
        [sys.executable, "-m", "pageshare.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert "Traceback" not in p.stderr, p.stderr
    return p.returncode, p.stdout, p.stderr


def run_json(*args: str) -> tuple[int, dict[str, Any]]:
    rc, out, _ = pageshare(*args, "--json")
    data: dict[str, Any] = json.loads(out)
    assert data["exit_code"] == rc and data["ok"] == (rc == 0), data
    if rc:
        err = data["error"]
        assert err["kind"] and err["message"] and err["hint"], err
    return rc, data


def copy_opts(server: Server) -> list[str]:
    return [
        "--control",
        str(server.control),
        "--mode",
        "copy",
        "--x-any-buffer",
        "--reconnect-delay",
        "1",
    ]


def expect(kind: str, blocks: list[int]) -> dict[int, int]:
    return {b: pattern(kind, b) for b in blocks}


def chain_bytes(vm: Vm, device: str) -> None:
    """Every listed and some unlisted blocks read what the chain holds:
    the overlay's own block, the base's elsewhere."""
    want = expect("A", LISTED + UNLISTED)
    want[WRITTEN] = NEW
    assert vm.wrong_blocks(device, want) == []


# --------------------------------------------------------------------------- the walk


@pytest.mark.parametrize("style", ["blockdev-add", "cmdline"])
def test_attach_read_detach(
    images: dict[str, Path], tmp_path: Path, vms: list[Vm], server: Server, style: str
) -> None:
    """Before attach the base is read from disk (no filter); attach puts the
    filter in, listed blocks are then copied from the server; attach again
    changes nothing; detach takes it out and reads go to disk again.  The
    overlay's options (cache, detect-zeroes, discard) survive both reopens."""
    ovl_opts: dict[str, Any] = {
        "cache": {"direct": False, "no-flush": True},
        "detect-zeroes": "unmap",
        "discard": "unmap",
    }
    vm = blockdev_vm(
        vms, tmp_path, "vm", images["a"], on_cmdline=style == "cmdline", ovl_opts=ovl_opts
    )
    vm.qemu_io("ovl", f"write -P {NEW} {WRITTEN * 4096} 4096")
    chain_bytes(vm, "ovl")
    assert vm.pageshare_nodes() == []
    kept = {k: vm.nodes()["ovl"][k] for k in ("cache", "detect_zeroes", "ro", "drv")}

    rc, st = run_json("attach", str(vm.qmp_path), "--status")
    assert rc == 0 and [d["result"] for d in st["drives"]] == ["not-attached"], st
    assert "stats" not in st["drives"][0]

    rc, data = run_json("attach", str(vm.qmp_path), *copy_opts(server))
    assert rc == 0, data
    (d,) = data["drives"]
    assert d["result"] == "attached" and d["overlay"] == "ovl" and d["base"] == "base", d
    assert d["base_file"] == str(images["a"]) and d["image"]["name"] == "golden", d
    assert d["image"]["socket"] == str(server.sock("golden")), d
    # blockdev-reopen only with the overlay's whole definition at hand
    assert d["method"] == {"cmdline": "blockdev-reopen", "blockdev-add": "qemu-io-reopen"}[style], d
    assert data["qemu_pid"] == vm.proc.pid  # stdbuf execs QEMU: the same process
    # the filter proves the image with the server's content sha256
    assert (
        d["filter_options"]["image-sha256"] == server.image("golden")["identity"]["content_sha256"]
    )
    ps = d["filter"]
    assert vm.pageshare_nodes() == [ps]
    s0 = d["stats"]
    assert s0["connected"] and s0["generation"] == 1 and s0["table-entries"] == len(LISTED), s0
    assert s0["merged"] == 0, s0
    assert {k: vm.nodes()["ovl"][k] for k in kept} == kept

    chain_bytes(vm, "ovl")
    s1 = vm.stats(ps)
    assert s1 is not None
    # every listed block but the one the overlay holds came from the server
    assert s1["merged"] == len(LISTED) - 1, json.dumps(s1)
    assert s1["fallback-unproven"] == 0 and not s1["base-changed"], s1

    rc, again = run_json("attach", str(vm.qmp_path), *copy_opts(server))
    assert rc == 0 and again["drives"][0]["result"] == "already-attached", again
    assert again["drives"][0]["filter"] == ps and vm.pageshare_nodes() == [ps]
    assert again["drives"][0]["stats"]["merged"] == len(LISTED) - 1

    rc, st = run_json("attach", str(vm.qmp_path), "--status")
    assert rc == 0 and st["drives"][0]["result"] == "attached", st
    assert st["drives"][0]["stats"]["merged"] == len(LISTED) - 1

    rc, det = run_json("detach", str(vm.qmp_path))
    assert rc == 0, det
    (dd,) = det["drives"]
    assert dd["result"] == "detached" and dd["filter"] == ps, dd
    assert dd["stats"]["merged"] == len(LISTED) - 1, dd  # what it did while attached
    assert vm.pageshare_nodes() == []
    assert {k: vm.nodes()["ovl"][k] for k in kept} == kept
    chain_bytes(vm, "ovl")
    assert vm.stats(ps) is None

    rc, det2 = run_json("detach", str(vm.qmp_path))
    assert rc == 0 and det2["drives"][0]["result"] == "not-attached", det2

    # and in again, by the QEMU's pid (its -qmp socket is on its command line)
    rc, data = run_json("attach", str(vm.proc.pid), *copy_opts(server), "--drive", "ovl")
    assert rc == 0 and data["drives"][0]["result"] == "attached", data
    chain_bytes(vm, "ovl")
    s2 = vm.stats(data["drives"][0]["filter"])
    assert s2 is not None and s2["merged"] == len(LISTED) - 1, s2


def test_drive_style_generated_node_names(
    images: dict[str, Path], tmp_path: Path, vms: list[Vm], server: Server
) -> None:
    """-drive: QEMU generated every node name ("#block123"), which
    blockdev-reopen cannot address; attach and detach go through qemu-io's
    reopen, which keeps the drive's cache mode."""
    vm = drive_vm(vms, tmp_path, "vm", images["a"], ",cache=none")
    vm.qemu_io("drive0", f"write -P {NEW} {WRITTEN * 4096} 4096")
    chain_bytes(vm, "drive0")
    root = vm.qmp.command("query-block")[0]["inserted"]["node-name"]
    assert root.startswith("#")
    cache = vm.nodes()[root]["cache"]
    assert cache["direct"] is True

    rc, data = run_json("attach", str(vm.qmp_path), *copy_opts(server), "--drive", "drive0")
    assert rc == 0, data
    (d,) = data["drives"]
    assert d["result"] == "attached" and d["drive"] == "drive0", d
    assert d["overlay"] == root and d["base"].startswith("#"), d
    assert d["method"] == "qemu-io-reopen", d
    assert d["filter"].startswith("pageshare-block"), d
    assert d["reads_before"] is not None and d["reads_before"]["devices"] == ["drive0"], d
    assert vm.nodes()[root]["cache"] == cache
    chain_bytes(vm, "drive0")
    s = vm.stats(d["filter"])
    assert s is not None and s["merged"] == len(LISTED) - 1, s

    rc, text, err = pageshare("detach", str(vm.qmp_path), "--drive", "drive0")
    assert rc == 0 and err == "", err
    assert "drive0: overlay #block" in text and "detached: filter pageshare-block" in text, text
    assert f"{len(LISTED) - 1} blocks merged/copied" in text, text
    assert vm.pageshare_nodes() == []
    assert vm.nodes()[root]["cache"] == cache
    chain_bytes(vm, "drive0")


def test_disk_in_an_iothread(
    images: dict[str, Path], tmp_path: Path, vms: list[Vm], server: Server
) -> None:
    """A virtio-blk disk served by an iothread (its nodes live in the
    iothread's AioContext; qtest accel, nothing runs in the guest): the
    filter joins that context, reads through the device are right and
    copied, detach works."""
    ovl = overlay(tmp_path, "vm", images["a"])
    defs = [
        {
            "driver": "file",
            "node-name": "base-file",
            "filename": str(images["a"]),
            "read-only": True,
        },
        {"driver": "raw", "node-name": "base", "file": "base-file", "read-only": True},
        {"driver": "file", "node-name": "ovl-file", "filename": str(ovl)},
        {"driver": "qcow2", "node-name": "ovl", "file": "ovl-file", "backing": "base"},
    ]
    vm = Vm(
        tmp_path,
        "vm",
        [
            "-object",
            "iothread,id=io0",
            *(a for d in defs for a in ("-blockdev", json.dumps(d))),
            "-device",
            "virtio-blk-pci,drive=ovl,id=disk0,iothread=io0",
        ],
        machine=("-M", "q35", "-accel", "qtest"),
    )
    vms.append(vm)
    rc, data = run_json("attach", str(vm.qmp_path), *copy_opts(server))
    assert rc == 0, data
    (d,) = data["drives"]
    assert d["drive"] == "disk0" and d["result"] == "attached", d
    assert d["reads_before"]["devices"] == ["disk0"], d
    dev = "-d /machine/peripheral/disk0/virtio-backend"  # the device's BlockBackend
    assert vm.wrong_blocks(dev, expect("A", LISTED)) == []
    s = vm.stats(d["filter"])
    assert s is not None and s["merged"] == len(LISTED), s
    rc, data = run_json("detach", str(vm.qmp_path), "--drive", "disk0")
    assert rc == 0 and data["drives"][0]["result"] == "detached", data
    assert vm.pageshare_nodes() == []
    assert vm.wrong_blocks(dev, expect("A", LISTED[:16])) == []


def test_text_output(
    images: dict[str, Path], tmp_path: Path, vms: list[Vm], server: Server
) -> None:
    vm = blockdev_vm(vms, tmp_path, "vm", images["a"])
    rc, text, err = pageshare("attach", str(vm.qmp_path), *copy_opts(server))
    assert rc == 0 and err == "", err
    assert f"ovl: overlay ovl ({tmp_path / 'vm.qcow2'}) over base base ({images['a']})" in text
    assert "attached: filter pageshare-base (image golden, socket" in text, text
    assert f"connected, generation 1, {len(LISTED)} blocks listed" in text, text
    rc, text, err = pageshare("attach", str(vm.qmp_path), *copy_opts(server))
    assert rc == 0 and "already attached: filter pageshare-base, nothing changed" in text
    assert vm.wrong_blocks("ovl", expect("A", LISTED[:10])) == []
    rc, text, err = pageshare("attach", str(vm.qmp_path), "--status")
    assert rc == 0 and "  attached: filter pageshare-base\n" in text, text
    assert f"ovl: overlay ovl ({tmp_path / 'vm.qcow2'}) over base" in text, text
    assert "10 blocks merged/copied, 0 read from disk" in text, text


def test_deeper_chain(
    images: dict[str, Path], tmp_path: Path, vms: list[Vm], server: Server
) -> None:
    """drive -> top -> middle -> base: the filter goes between the middle
    overlay and the base, the drive's name finds it, and blocks the middle
    or the top overlay hold are read from them."""
    mid = overlay(tmp_path, "mid", images["a"])
    q = qemu_build()
    subprocess.run(
        [q.qemu_io, "-f", "qcow2", "-c", f"write -P {NEW} {WRITTEN * 4096} 4096", str(mid)],
        check=True,
        capture_output=True,
    )
    top = tmp_path / "top.qcow2"
    subprocess.run(
        [
            q.qemu_img,
            "create",
            "-q",
            "-f",
            "qcow2",
            "-o",
            "cluster_size=4096",
            "-b",
            str(mid),
            "-F",
            "qcow2",
            str(top),
        ],
        check=True,
    )
    vm = Vm(tmp_path, "vm", ["-drive", f"if=none,id=drive0,file={top},format=qcow2"])
    vms.append(vm)
    vm.qemu_io("drive0", f"write -P {NEW} {6 * 4096} 4096")
    rc, data = run_json("attach", str(vm.qmp_path), *copy_opts(server), "--drive", "drive0")
    assert rc == 0, data
    (d,) = data["drives"]
    assert d["overlay_file"] == str(mid) and d["base_file"] == str(images["a"]), d
    want = expect("A", LISTED)
    want[WRITTEN] = want[6] = NEW
    assert vm.wrong_blocks("drive0", want) == []
    s = vm.stats(d["filter"])
    assert s is not None and s["merged"] == len(LISTED) - 2, s
    rc, data = run_json("detach", str(vm.qmp_path))
    assert rc == 0 and data["drives"][0]["result"] == "detached", data
    assert vm.wrong_blocks("drive0", want) == []


# --------------------------------------------------------------------------- what goes wrong


def test_two_overlays_over_one_base_node(
    images: dict[str, Path], tmp_path: Path, vms: list[Vm], server: Server
) -> None:
    """Two disks whose overlays share one base node: one filter above it,
    both overlays re-pointed at it, and detach removes it once both are off."""
    vm = blockdev_vm(vms, tmp_path, "vm", images["a"])
    ovl2 = overlay(tmp_path, "vm2", images["a"])
    vm.qmp.command(
        "blockdev-add", None, **{"driver": "file", "node-name": "ovl2-file", "filename": str(ovl2)}
    )
    vm.qmp.command(
        "blockdev-add",
        None,
        **{"driver": "qcow2", "node-name": "ovl2", "file": "ovl2-file", "backing": "base"},
    )
    rc, data = run_json("attach", str(vm.qmp_path), *copy_opts(server))
    assert rc == 0, data
    assert [(d["overlay"], d["result"], d["filter"]) for d in data["drives"]] == [
        ("ovl", "attached", "pageshare-base"),
        ("ovl2", "attached", "pageshare-base"),
    ], data
    assert vm.pageshare_nodes() == ["pageshare-base"]
    for dev in ("ovl", "ovl2"):
        assert vm.wrong_blocks(dev, expect("A", LISTED)) == []
    s = vm.stats("pageshare-base")
    assert s is not None and s["merged"] == 2 * len(LISTED), s
    rc, data = run_json("detach", str(vm.qmp_path), "--drive", "ovl2")
    assert rc == 0 and data["drives"][0]["result"] == "detached", data
    assert (
        "filter node pageshare-base kept: ovl still read(s) through it"
        in data["drives"][0]["warnings"]
    ), data
    assert vm.pageshare_nodes() == ["pageshare-base"]
    rc, data = run_json("detach", str(vm.qmp_path))
    assert rc == 0 and [d["result"] for d in data["drives"]] == ["detached", "not-attached"]
    assert vm.pageshare_nodes() == []
    for dev in ("ovl", "ovl2"):
        assert vm.wrong_blocks(dev, expect("A", LISTED[:16])) == []


def test_base_not_served(
    images: dict[str, Path], tmp_path: Path, vms: list[Vm], server: Server
) -> None:
    """A VM over another image (same size) than the server's: refused before
    anything changes, and a copy of the served image is not the served file."""
    vm = blockdev_vm(vms, tmp_path, "vm", images["b"])
    rc, data = run_json("attach", str(vm.qmp_path), *copy_opts(server))
    assert rc == 1 and data["error"]["kind"] == "not-served", data
    assert str(images["b"]) in data["error"]["message"]
    assert f"golden ({images['a']})" in data["error"]["message"]
    assert data["drives"][0]["result"] == "skipped"
    assert vm.pageshare_nodes() == []
    assert vm.wrong_blocks("ovl", expect("B", LISTED[:8])) == []

    copy = tmp_path / "copy-of-a.raw"
    copy.write_bytes(images["a"].read_bytes())
    vm2 = blockdev_vm(vms, tmp_path, "vm2", copy)
    rc, text, err = pageshare("attach", str(vm2.qmp_path), *copy_opts(server), "--drive", "ovl")
    assert rc == 1, text
    assert "failed: its base" in text and "is not an image the server serves" in text, text
    assert "pageshare attach: error:" in err and "hint:" in err, err
    assert vm2.pageshare_nodes() == []


def test_one_disk_served_one_not(
    images: dict[str, Path], tmp_path: Path, vms: list[Vm], server: Server
) -> None:
    """Two disks, one over the served image: that one is attached, the
    other skipped, and the command succeeds; naming the other fails."""
    ovl_a, ovl_b = overlay(tmp_path, "a", images["a"]), overlay(tmp_path, "b", images["b"])
    vm = Vm(
        tmp_path,
        "vm",
        [
            "-drive",
            f"if=none,id=disk-a,file={ovl_a},format=qcow2",
            "-drive",
            f"if=none,id=disk-b,file={ovl_b},format=qcow2",
        ],
    )
    vms.append(vm)
    rc, data = run_json("attach", str(vm.qmp_path), *copy_opts(server))
    assert rc == 0, data
    by = {d["drive"]: d for d in data["drives"]}
    assert by["disk-a"]["result"] == "attached", by
    assert by["disk-b"]["result"] == "skipped" and by["disk-b"]["error"]["kind"] == "not-served"
    assert vm.wrong_blocks("disk-a", expect("A", LISTED)) == []
    assert vm.wrong_blocks("disk-b", expect("B", LISTED)) == []
    s = vm.stats(by["disk-a"]["filter"])
    assert s is not None and s["merged"] == len(LISTED), s

    rc, data = run_json("attach", str(vm.qmp_path), *copy_opts(server), "--drive", "disk-b")
    assert rc == 1 and data["drives"][0]["result"] == "failed", data
    assert data["error"]["kind"] == "not-served"
    rc, data = run_json("attach", str(vm.qmp_path), *copy_opts(server), "--drive", "nope")
    assert rc == 1 and data["error"]["kind"] == "no-such-drive", data
    assert "disk-a" in data["error"]["hint"] and "disk-b" in data["error"]["hint"]
    assert len(vm.pageshare_nodes()) == 1


def test_qemu_without_the_driver(
    images: dict[str, Path], tmp_path: Path, vms: list[Vm], server: Server
) -> None:
    if not Path(DEBIAN_QEMU).exists():
        pytest.fail(f"{DEBIAN_QEMU} (Debian's qemu-system-x86) is not installed")
    ovl = overlay(tmp_path, "vm", images["a"])
    vm = Vm(
        tmp_path, "vm", ["-drive", f"if=none,id=drive0,file={ovl},format=qcow2"], binary=DEBIAN_QEMU
    )
    vms.append(vm)
    before = vm.nodes()
    rc, data = run_json("attach", str(vm.qmp_path), *copy_opts(server))
    assert rc == 1 and data["error"]["kind"] == "no-driver", data
    assert "patched QEMU" in data["error"]["hint"]
    assert vm.nodes().keys() == before.keys()


def test_server_down(images: dict[str, Path], tmp_path: Path, vms: list[Vm]) -> None:
    """No server: attach refuses (it cannot tell which image the base is)
    and changes nothing; with --socket it attaches anyway, reads go to disk,
    and once the server is up the filter connects and serves."""
    srv = Server(
        tmp_path / "srv", [ImageSpec("golden", images["a"], list_file=images["list"], fmt="raw")]
    )
    vm = blockdev_vm(vms, tmp_path, "vm", images["a"])
    rc, data = run_json("attach", str(vm.qmp_path), *copy_opts(srv))
    assert rc == 1 and data["error"]["kind"] == "server-down", data
    assert str(srv.control) in data["error"]["message"] and "--socket" in data["error"]["hint"]
    assert vm.pageshare_nodes() == []

    rc, data = run_json(
        "attach", str(vm.qmp_path), *copy_opts(srv), "--socket", str(srv.sock("golden"))
    )
    assert rc == 0, data
    ps = data["drives"][0]["filter"]
    assert data["drives"][0]["stats"]["connected"] is False
    assert vm.wrong_blocks("ovl", expect("A", LISTED)) == []
    s = vm.stats(ps)
    assert s is not None and s["merged"] == 0 and s["fallback-no-table"] == len(LISTED), s
    srv.start()
    try:
        srv.wait_generation("golden", 1)
        wait_for(
            lambda: (vm.stats(ps) or {}).get("generation") == 1,
            30,
            "the filter connects once the server is up",
        )
        assert vm.wrong_blocks("ovl", expect("A", LISTED)) == []
        s = vm.stats(ps)
        assert s is not None and s["merged"] == len(LISTED), s
    finally:
        srv.stop(signal.SIGKILL)
    # attached already: the server is not needed to say so
    rc, data = run_json("attach", str(vm.qmp_path), *copy_opts(srv))
    assert rc == 0 and data["drives"][0]["result"] == "already-attached", data


def test_base_by_another_path_relative_to_qemu(
    images: dict[str, Path], tmp_path: Path, vms: list[Vm], server: Server
) -> None:
    """The VM names its base by a relative path (QEMU's working directory)
    through a symbolic link: the same file as the server's, so served.  (A
    hard link would not do here: making it changes the file's ctime, so the
    server's proof no longer holds until it has verified the file again.)"""
    (tmp_path / "vmdir").mkdir()
    (tmp_path / "vmdir" / "golden-link.raw").symlink_to(images["a"])
    ovl = overlay(tmp_path, "vm", images["a"])
    defs = [
        {
            "driver": "file",
            "node-name": "base-file",
            "filename": "golden-link.raw",
            "read-only": True,
        },
        {"driver": "raw", "node-name": "base", "file": "base-file", "read-only": True},
        {"driver": "file", "node-name": "ovl-file", "filename": str(ovl)},
        {"driver": "qcow2", "node-name": "ovl", "file": "ovl-file", "backing": "base"},
    ]
    vm = Vm(
        tmp_path,
        "vm",
        [a for d in defs for a in ("-blockdev", json.dumps(d))],
        cwd=tmp_path / "vmdir",
    )
    vms.append(vm)
    rc, data = run_json("attach", str(vm.qmp_path), *copy_opts(server))
    assert rc == 0, data
    (d,) = data["drives"]
    assert d["base_file"] == "golden-link.raw" and d["image"]["name"] == "golden", d
    assert "warnings" not in d, d
    assert vm.wrong_blocks("ovl", expect("A", LISTED)) == []
    s = vm.stats(d["filter"])
    assert s is not None and s["merged"] == len(LISTED) and s["fallback-unproven"] == 0, s


def test_qmp_socket_held_by_another_client(
    images: dict[str, Path], tmp_path: Path, vms: list[Vm]
) -> None:
    """QEMU serves one client per QMP socket (libvirtd holds its own)."""
    vm = blockdev_vm(vms, tmp_path, "vm", images["a"])
    holder = QMP(vm.qmp_path)
    try:
        rc, data = run_json("attach", str(vm.qmp_path), "--control", "/nonexistent")
        assert rc == 1 and data["error"]["kind"] == "qmp-unreachable", data
        assert "other client" in data["error"]["hint"]
    finally:
        holder.close()
    assert vm.pageshare_nodes() == []


def test_no_qmp_and_usage(tmp_path: Path) -> None:
    rc, data = run_json("attach", str(tmp_path / "nothing.qmp"))
    assert rc == 1 and data["error"]["kind"] == "qmp-unreachable", data
    rc, data = run_json("detach", str(tmp_path / "nothing.qmp"))
    assert rc == 1 and data["error"]["kind"] == "qmp-unreachable", data
    rc, data = run_json("attach", "x.qmp", "--mode", "fast")
    assert rc == 2 and data["error"]["kind"] == "usage", data
    rc, text, _ = pageshare("attach", "--help")
    assert rc == 0 and "blockdev-reopen" in text and "exit status" in text
    assert "--socket" in text and "examples:" in text
    rc, text, _ = pageshare("detach", "--help")
    assert rc == 0 and "migrat" in text
    rc, text, _ = pageshare("--help")
    assert "attach QMP" in text and "detach QMP" in text
    # The watcher's help says what the README says of an unprivileged QEMU.
    rc, text, _ = pageshare("libvirt-watch", "--help")
    assert rc == 0 and "unprivileged-qemu.conf" in text and "reads from disk (see" not in text
    examples = text.split("examples:", 1)[1].strip().splitlines()
    assert len(examples) >= 3 and all(
        e.lstrip().startswith(("pageshare", "systemctl")) for e in examples
    ), examples
    # Each example works as written: every flag is the watcher's, every unit is shipped.
    for e in examples:
        cmd = shlex.split(e, comments=True)
        if cmd[0] == "pageshare":
            assert cmd[1] == "libvirt-watch", e
            libvirt_watch.build_parser().parse_args(cmd[2:])  # exits 2 on a wrong flag
        else:
            assert (REPO / "analyzer" / f"{cmd[-1]}.service").is_file(), e


def test_qemu_refuses_and_nothing_changes(
    images: dict[str, Path], tmp_path: Path, vms: list[Vm], server: Server
) -> None:
    """A node that writes the base keeps the filter out (it shares no WRITE
    on the base): QEMU's refusal is reported, nothing is left behind."""
    vm = blockdev_vm(vms, tmp_path, "vm", images["a"], base_writable=True)
    # a second user that writes the base's file (a writable NBD export of it)
    vm.qmp.command(
        "blockdev-add",
        None,
        **{"driver": "raw", "node-name": "writer", "file": "base-file", "read-only": False},
    )
    vm.qmp.command(
        "nbd-server-start",
        None,
        addr={"type": "unix", "data": {"path": str(tmp_path / "nbd.sock")}},
    )
    vm.qmp.command(
        "block-export-add", None, type="nbd", id="w", **{"node-name": "writer"}, writable=True
    )
    rc, data = run_json("attach", str(vm.qmp_path), *copy_opts(server))
    assert rc == 1 and data["error"]["kind"] == "qemu-refused", data
    assert "QEMU refused" in data["error"]["message"]
    assert vm.pageshare_nodes() == []
    assert vm.wrong_blocks("ovl", expect("A", LISTED[:8])) == []


def test_base_changed_just_before_attach(
    images: dict[str, Path], tmp_path: Path, vms: list[Vm]
) -> None:
    """A hard link made to the base changes its ctime: the server withdraws
    its table and verifies the file again.  An attach in that window
    succeeds and says that reads go to disk for now; bytes are right all
    along, and once the server publishes again the filter serves."""
    base = tmp_path / "golden.raw"
    base.write_bytes(images["a"].read_bytes())
    srv = Server(tmp_path / "srv", [ImageSpec("g2", base, list_file=images["list"], fmt="raw")])
    srv.start()
    try:
        gen = srv.wait_generation("g2", 1)["generation"]
        os.link(base, tmp_path / "golden-link.raw")
        wait_for(
            lambda: srv.image("g2")["generation"] is None,
            10,
            "the server withdraws the table of a changed file",
        )
        vm = blockdev_vm(vms, tmp_path, "vm", tmp_path / "golden-link.raw")
        rc, data = run_json("attach", str(vm.qmp_path), *copy_opts(srv))
        assert rc == 0, data
        (d,) = data["drives"]
        assert d["result"] == "attached" and d["image"]["name"] == "g2", d
        assert any("is not serving yet" in w and "reads go to disk" in w for w in d["warnings"]), d
        assert vm.wrong_blocks("ovl", expect("A", LISTED)) == []
        s = vm.stats(d["filter"])
        assert s is not None and s["merged"] == 0, s
        srv.wait_generation("g2", gen + 1)
        wait_for(
            lambda: (vm.stats(d["filter"]) or {}).get("generation") == gen + 1,
            30,
            "the filter gets the new table",
        )
        assert vm.wrong_blocks("ovl", expect("A", LISTED)) == []
        s = vm.stats(d["filter"])
        assert s is not None and s["merged"] == len(LISTED), s
    finally:
        srv.stop(signal.SIGKILL)
