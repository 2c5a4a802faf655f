"""`pageshare host check` on this host, against real parts: the host's kernel
and KSM, a real pageshare-server, the patched and Debian's QEMU, and running
QEMU guests.  Runs the real command (as root) and checks its text and JSON."""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from grub_tree import ROOT_UUID, GrubTree, grub_common
from page_server_helpers import (
    ImageSpec,
    Server,
    make_list,
    nonzero_blocks,
    psc,
    redis_server,
    wait_for,
)
from pageshare.analysis.ksm import host_lock
from pageshare.host import grubboot, hostcheck, server_control
from pageshare.lists import sectorlist
from qemu_helpers import qemu_build

REPO = Path(__file__).resolve().parents[2]
KSM_RUN = Path("/sys/kernel/mm/ksm/run")
DEBIAN_QEMU = "/usr/bin/qemu-system-x86_64"
MAX_PTES_SHARED = Path("/sys/kernel/mm/transparent_hugepage/khugepaged/max_ptes_shared")
ALL = ("kernel", "ksm", "khugepaged", "qemu", "server", "guests", "apparmor")

assert os.geteuid() == 0, "pageshare host check reads /proc and sysfs: run these tests as root"


def only(*checks: str) -> list[str]:
    return [a for c in ALL if c not in checks for a in ("--skip", c)]


def host_check(*args: str) -> tuple[int, str]:
    env = dict(os.environ, PYTHONPATH=str(REPO / "analyzer"))
    p = subprocess.run(
        [sys.executable, "-m", "pageshare.cli", "host", "check", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert not p.stderr.strip() or "Traceback" not in p.stderr, p.stderr
    return p.returncode, p.stdout


def host_check_json(*args: str) -> tuple[int, dict[str, Any]]:
    rc, out = host_check("--json", *args)
    data: dict[str, Any] = json.loads(out)
    assert data["exit"] == rc
    assert data["status"] == {0: "ok", 1: "warning", 2: "error"}[rc]
    assert rc == max((hostcheck.SEVERITIES[f["severity"]] for f in data["findings"]), default=0)
    for f in data["findings"]:
        assert f["severity"] in hostcheck.SEVERITIES and f["what"]
        if f["severity"] != "ok":
            assert f["why"] and f["fix"], f
    return rc, data


def same_findings(text: str, data: dict[str, Any]) -> None:
    """The text and the JSON output carry the same findings."""
    mark = {"ok": "ok  ", "warning": "WARN", "error": "FAIL"}
    lines = [ln for ln in text.splitlines() if ln.startswith("[")]
    want = [f"[{mark[f['severity']]}] {f['check']}: {f['what']}" for f in data["findings"]]
    assert lines == want


def findings(data: dict[str, Any], check: str) -> list[dict[str, Any]]:
    return [f for f in data["findings"] if f["check"] == check]


# --------------------------------------------------------------------------- kernel, KSM


def test_kernel_series_is_reported() -> None:
    args = only("kernel")
    rc, text = host_check(*args)
    rc_j, data = host_check_json(*args)
    assert rc == rc_j
    same_findings(text, data)
    k, *grub = findings(data, "kernel")
    if Path("/sys/kernel/mm/ksm/merge_page_merged").exists():
        # a second finding only if GRUB's default entry boots another kernel
        assert k["severity"] == "ok" and [g["severity"] for g in grub] in ([], ["warning"])
        assert rc == (1 if grub else 0)
        return
    assert not grub
    assert rc == 2 and k["severity"] == "error"
    assert "merge_page_merged" in k["what"] and os.uname().release in k["what"]
    if grubboot.pageshare_kernels():
        # installed, not running: the finding says so and what GRUB boots by default
        assert "is installed" in k["what"], k
        return
    # This host's kernel (6.18) lacks the series: an error that says what to install.
    assert "kernel-syscall/" in k["fix"]
    assert "`make kernel-package`" in k["fix"] and "make kernel-test" not in k["fix"]
    assert "[FAIL] kernel:" in text and "kernel-syscall/" in text
    # The full check (every part) exits 2 on this host as well.
    rc_all, out = host_check("--control", "/nonexistent/control.sock")
    assert rc_all == 2 and "merge_page_merged" in out


def makefile_recipes(path: Path) -> dict[str, str]:
    """The Makefile's explicit targets and their recipes (a rule's tab-indented
    lines; variable assignments and special targets such as .PHONY left out)."""
    recipes: dict[str, str] = {}
    current: list[str] = []
    for line in path.read_text().splitlines():
        if line.startswith("\t"):
            for t in current:
                recipes[t] += line.strip() + "\n"
            continue
        m = re.match(r"([A-Za-z0-9_. -]+?)\s*:(?![:=])", line)
        current = [t for t in m.group(1).split() if not t.startswith(".")] if m else []
        for t in current:
            recipes.setdefault(t, "")
    return recipes


def test_kernel_fix_names_the_package_target(tmp_path: Path) -> None:
    """Whatever kernel this host runs, the fix for one without the series
    names `make` targets that exist, among them the one that builds the
    kernel's Debian package (packaging/kernel_deb.py), and no test target."""
    recipes = makefile_recipes(REPO / "Makefile")
    builds_deb = [t for t, r in recipes.items() if "packaging/kernel_deb.py" in r]
    assert builds_deb, recipes
    # no merge_page_merged there, no pageshare kernel in /boot
    [k] = hostcheck.check_kernel(tmp_path, boot=tmp_path / "boot")
    named = re.findall(r"`make ([\w.-]+)`", k.fix)
    assert named and all(t in recipes for t in named), (named, sorted(recipes))
    assert set(named) & set(builds_deb), (named, builds_deb)
    tests = [t for t, r in recipes.items() if "run-tests.sh" in r or "pytest" in r]
    assert not set(named) & set(tests), (named, tests)


# The kernel finding on a host where the pageshare kernel is installed beside
# a later Debian kernel: /boot and grub.cfg as Debian 13's update-grub writes
# them (tests/grub_tree.py; the snippet itself: test_grub_default.py).
PAGESHARE = "6.12.38-pageshare-cloud-amd64"
DEBIAN_NEWER = "6.12.43+deb13-cloud-amd64"


def pinned(release: str) -> str:
    return f"gnulinux-advanced-{ROOT_UUID}>gnulinux-{release}-advanced-{ROOT_UUID}"


@pytest.fixture
def grub_host() -> Iterator[GrubTree]:
    tree = GrubTree(grub_common("trixie"))
    tree.kernels(DEBIAN_NEWER)
    yield tree
    tree.remove()


def kernel_findings(tree: GrubTree, release: str, series: bool) -> list[hostcheck.Finding]:
    ksm = tree.fs / "ksm"
    ksm.mkdir(exist_ok=True)
    if series:
        (ksm / "merge_page_merged").write_text("0\n")
    found = list(
        hostcheck.check_kernel(
            ksm,
            boot=tree.boot,
            grub_cfg=tree.boot / "grub/grub.cfg",
            grubenv=tree.boot / "grub/grubenv",
            snippet=tree.grub_d / "pageshare-kernel.cfg",
            release=release,
        )
    )
    for f in found:
        assert f.check == "kernel" and f.what
        assert f.severity == "ok" or (f.why and f.fix), f
    return found


def test_kernel_installed_but_not_the_default(grub_host: GrubTree) -> None:
    """Booted on Debian's newer kernel, the pageshare kernel installed: the
    finding says what GRUB's default boots and, step by step, what to do."""
    tree = grub_host
    [k] = kernel_findings(tree, DEBIAN_NEWER, series=False)
    assert "make kernel-package" in k.fix  # none installed yet: build and install it
    tree.kernels(PAGESHARE)
    # no grub.cfg yet
    [k] = kernel_findings(tree, DEBIAN_NEWER, series=False)
    assert f"the pageshare kernel {PAGESHARE} is installed in {tree.boot} but not running" in k.what
    assert k.fix.startswith(f"reboot into {PAGESHARE}: no {tree.boot}/grub/grub.cfg")
    # grub.cfg from before the kernel was installed
    (tree.boot / f"vmlinuz-{PAGESHARE}").rename(tree.fs / "aside")
    tree.mkconfig()
    (tree.fs / "aside").rename(tree.boot / f"vmlinuz-{PAGESHARE}")
    [k] = kernel_findings(tree, DEBIAN_NEWER, series=False)
    assert k.fix.startswith("run `update-grub`: ") and f"no entry for {PAGESHARE}" in k.fix
    # update-grub without pageshare-host's snippet: Debian's newer kernel is the default
    tree.mkconfig()
    [k] = kernel_findings(tree, DEBIAN_NEWER, series=False)
    assert k.severity == "error" and f"kernel {DEBIAN_NEWER} lacks the merge_pages series" in k.what
    assert (
        f"the pageshare kernel {PAGESHARE} is installed but GRUB's default entry boots "
        f"{DEBIAN_NEWER} (entry 'Debian GNU/Linux'; set default=\"0\" in grub.cfg)"
    ) in k.what, k.what
    assert "--force-confmiss pageshare-host" in k.fix
    assert f'GRUB_DEFAULT="{pinned(PAGESHARE)}" in /etc/default/grub' in k.fix
    assert k.details["grub_default_release"] == DEBIAN_NEWER
    assert k.details["pageshare_kernels"] == [PAGESHARE]
    # the snippet installed after that update-grub: run it
    snippet = tree.install_snippet()
    os.utime(snippet, (time.time() + 5, time.time() + 5))
    [k] = kernel_findings(tree, DEBIAN_NEWER, series=False)
    assert k.fix.startswith(f"run `update-grub` ({tree.boot}/grub/grub.cfg is older than ")
    assert f'make it "{pinned(PAGESHARE)}"' in k.fix
    # after update-grub: the default boots it, this boot was another kernel
    tree.mkconfig()
    [k] = kernel_findings(tree, DEBIAN_NEWER, series=False)
    assert "is installed and GRUB's default entry boots it" in k.what
    assert k.fix.startswith("reboot: this boot was not GRUB's default")


def test_kernel_running_and_the_next_boot(grub_host: GrubTree) -> None:
    tree = grub_host
    tree.kernels(PAGESHARE)
    tree.install_snippet()
    tree.mkconfig()
    [k] = kernel_findings(tree, PAGESHARE, series=True)
    assert k.severity == "ok"
    assert k.what == f"kernel {PAGESHARE} has the merge_pages series; GRUB's default entry boots it"
    assert k.details["grub_default"] == pinned(PAGESHARE)
    # opted out: the next reboot would leave the series, a warning says so now
    tree.default.write_text(tree.default.read_text() + "PAGESHARE_GRUB_DEFAULT=false\n")
    tree.mkconfig()
    ok, warn = kernel_findings(tree, PAGESHARE, series=True)
    assert ok.severity == "ok" and "GRUB" not in ok.what
    assert warn.severity == "warning"
    assert warn.what.startswith(
        f"GRUB's default entry boots {DEBIAN_NEWER}, not a pageshare kernel: after a reboot"
    )
    assert "GRUB_DEFAULT=0 boots the first" in warn.why
    assert f'make it "{pinned(PAGESHARE)}"' in warn.fix
    assert hostcheck.worst([ok, warn]) == 1


def test_kernel_saved_default_names_grub_set_default(grub_host: GrubTree) -> None:
    tree = grub_host
    tree.kernels(PAGESHARE)
    tree.install_snippet()
    tree.default.write_text(tree.default.read_text() + "GRUB_DEFAULT=saved\n")
    tree.mkconfig()
    (tree.boot / "grub/grubenv").write_text(
        f"# GRUB Environment Block\nsaved_entry={pinned(DEBIAN_NEWER)}\n" + "#" * 900
    )
    [k] = kernel_findings(tree, DEBIAN_NEWER, series=False)
    assert f'saved_entry="{pinned(DEBIAN_NEWER)}" in grubenv (GRUB_DEFAULT=saved)' in k.what
    assert f"`grub-set-default '{pinned(PAGESHARE)}'`, then reboot" in k.fix
    # after grub-set-default
    (tree.boot / "grub/grubenv").write_text(
        f"# GRUB Environment Block\nsaved_entry={pinned(PAGESHARE)}\n" + "#" * 900
    )
    [k] = kernel_findings(tree, DEBIAN_NEWER, series=False)
    assert "GRUB's default entry boots it" in k.what


def test_ksm_run_state() -> None:
    args = only("ksm")
    with host_lock():
        original = KSM_RUN.read_text().strip()
        try:
            KSM_RUN.write_text("0\n")
            rc, text = host_check(*args)
            rc_j, data = host_check_json(*args)
            same_findings(text, data)
            [k] = findings(data, "ksm")
            assert (rc, rc_j, k["severity"]) == (2, 2, "error")
            assert k["details"]["run"] == "0" and "EOPNOTSUPP" in k["why"]
            assert "echo 1 > /sys/kernel/mm/ksm/run" in k["fix"]
            assert "systemd-tmpfiles --create pageshare-server.conf" in k["fix"]

            KSM_RUN.write_text("1\n")
            rc, text = host_check(*args)
            rc_j, data = host_check_json(*args)
            same_findings(text, data)
            [k] = findings(data, "ksm")
            assert (rc, rc_j, k["severity"]) == (0, 0, "ok")
            assert "[ok  ] ksm: KSM is in merge mode" in text
        finally:
            KSM_RUN.write_text(original + "\n")
    assert KSM_RUN.read_text().strip() == original


def test_khugepaged_max_ptes_shared() -> None:
    """A host whose khugepaged may collapse shared pages gets a warning that says
    how to stop it; with max_ptes_shared = 0 the check is ok.  Restored after."""
    args = only("khugepaged")
    original = MAX_PTES_SHARED.read_text().strip()
    try:
        MAX_PTES_SHARED.write_text("256\n")
        rc, text = host_check(*args)
        rc_j, data = host_check_json(*args)
        same_findings(text, data)
        [k] = findings(data, "khugepaged")
        assert (rc, rc_j, k["severity"]) == (1, 1, "warning")
        assert k["details"]["max_ptes_shared"] == 256 and "unshare" in k["what"]
        assert f"echo 0 > {MAX_PTES_SHARED}" in k["fix"]
        assert "/usr/lib/tmpfiles.d/pageshare-server.conf" in k["fix"]

        MAX_PTES_SHARED.write_text("0\n")
        rc, text = host_check(*args)
        rc_j, data = host_check_json(*args)
        [k] = findings(data, "khugepaged")
        assert (rc, rc_j, k["severity"]) == (0, 0, "ok")
        assert "[ok  ] khugepaged: khugepaged never collapses shared pages" in text
    finally:
        MAX_PTES_SHARED.write_text(original + "\n")
    assert MAX_PTES_SHARED.read_text().strip() == original


# --------------------------------------------------------------------------- server, Redis


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    d = tmp_path_factory.mktemp("hostcheck")
    raw = d / "img.raw"
    data = random.Random(12).randbytes(8 << 20)
    raw.write_bytes(data)
    return raw, hashlib.sha256(data).hexdigest()


def start(s: Server, servers: list[Server]) -> None:
    """Start the server and wait until its control socket answers (the socket
    file appears at bind(), a moment before the server listens on it)."""
    servers.append(s)
    s.start()

    def answers() -> bool:
        try:
            s.status()
            return True
        except ConnectionRefusedError:
            return False

    wait_for(answers, 20, "the control socket to answer")


@pytest.fixture
def servers() -> Iterator[list[Server]]:
    """The page servers a test started (built first: build, in conftest.py)."""
    started: list[Server] = []
    yield started
    for s in started:
        s.stop()


def test_server_images_published_then_stopped(
    image: tuple[Path, str], tmp_path: Path, servers: list[Server]
) -> None:
    raw, sha = image
    blocks = nonzero_blocks(raw, 500, stride=3)
    good = make_list(
        sectorlist.ImageIdentity(raw.stat().st_size, sha, raw.name), blocks, tmp_path / "good.pcsl"
    )
    # A list for another image (wrong content hash): the server refuses it.
    make_list(
        sectorlist.ImageIdentity(raw.stat().st_size, "00" * 32, raw.name),
        blocks,
        tmp_path / "other.pcsl",
    )
    s = Server(
        tmp_path / "srv",
        [
            ImageSpec("img", raw, tmp_path / "good.pcsl", fmt="raw"),
            ImageSpec("other", raw, tmp_path / "other.pcsl", fmt="raw"),
        ],
    )
    start(s, servers)
    s.wait_generation("img", 1)
    wait_for(lambda: not s.image("other")["loading"], 60, "the other image's load")
    status = s.status()

    args = ["--control", str(s.control), *only("server")]
    rc, text = host_check(*args)
    rc_j, data = host_check_json(*args)
    same_findings(text, data)
    assert rc == rc_j
    [srv] = [f for f in findings(data, "server") if f["severity"] == "ok"]
    assert s.proc is not None and srv["details"]["pid"] == s.proc.pid
    imgs = {f["details"]["name"]: f for f in findings(data, "image")}
    ok = imgs["img"]
    assert ok["severity"] == "ok"
    assert ok["details"]["generation"] == 1 and ok["details"]["state"] == "serving"
    assert ok["details"]["blocks"] == len(good.blocks)
    assert ok["details"]["image_file"] == status["images"][0]["image_file"] is not None
    assert ok["details"]["degraded"] == status["degraded"]
    assert f"generation 1, {len(good.blocks)} blocks" in ok["what"]
    bad = imgs["other"]
    assert bad["severity"] == "warning" and "is not serving" in bad["what"]
    assert bad["details"]["state"] != "serving"
    # One image serves: no "publishes no image" error; a degraded server is a warning.
    assert not [f for f in data["findings"] if f["severity"] == "error"]
    degraded = [f for f in findings(data, "server") if "degraded" in f["what"]]
    assert bool(degraded) == status["degraded"]
    assert rc == 1  # the refused image (and a degraded server) are warnings
    assert "[ok  ] image: image img" in text and "[WARN] image: image other" in text

    s.stop()
    rc, text = host_check(*args)
    rc_j, data = host_check_json(*args)
    same_findings(text, data)
    assert rc == rc_j == 2
    [err] = findings(data, "server")
    assert err["severity"] == "error" and "no pageshare-server answers" in err["what"]
    assert str(s.control) in err["what"] and "pageshare-server" in err["fix"]


def test_server_with_no_image_serving_is_an_error(
    image: tuple[Path, str], tmp_path: Path, servers: list[Server]
) -> None:
    raw, _ = image
    make_list(
        sectorlist.ImageIdentity(raw.stat().st_size, "00" * 32, raw.name),
        nonzero_blocks(raw, 10),
        tmp_path / "other.pcsl",
    )
    s = Server(tmp_path / "srv", [ImageSpec("other", raw, tmp_path / "other.pcsl", fmt="raw")])
    start(s, servers)
    wait_for(lambda: not s.image("other")["loading"], 60, "the image's load")
    rc, data = host_check_json("--control", str(s.control), *only("server"))
    assert rc == 2
    assert [f["what"] for f in findings(data, "server") if f["severity"] == "error"] == [
        "the server publishes no image"
    ]


@pytest.mark.build
def test_redis_reachable_and_down(
    image: tuple[Path, str], tmp_path: Path, servers: list[Server]
) -> None:
    raw, sha = image
    make_list(
        sectorlist.ImageIdentity(raw.stat().st_size, sha, raw.name),
        nonzero_blocks(raw, 10),
        tmp_path / "good.pcsl",
    )
    with redis_server(tmp_path) as r:
        s = Server(
            tmp_path / "srv",
            [ImageSpec("img", raw, tmp_path / "good.pcsl", fmt="raw")],
            redis_url=r.url,
        )
        start(s, servers)
        s.wait_generation("img", 1)
        wait_for(lambda: s.status()["redis"]["connected"], 30, "the server's Redis connection")
        args = ["--control", str(s.control), *only("server")]
        _, data = host_check_json(*args)
        [red] = findings(data, "redis")
        assert red["severity"] == "ok" and red["details"]["url"] == r.url
        assert red["details"]["ping"] == "+PONG"
        r.stop()
        rc, data = host_check_json(*args)
        [red] = findings(data, "redis")
        assert rc == 2 and red["severity"] == "error" and r.url in red["what"]
        assert "cannot reach it" in red["what"]


# --------------------------------------------------------------------------- QEMU


@pytest.mark.build
def test_patched_qemu_has_the_driver_and_debian_lacks_it() -> None:
    build = qemu_build()
    args = ["--no-path", "--qemu", str(build.dir / "bin"), "--qemu", DEBIAN_QEMU, *only("qemu")]
    rc, text = host_check(*args)
    rc_j, data = host_check_json(*args)
    same_findings(text, data)
    by_bin = {f["details"]["binary"]: f for f in findings(data, "qemu")}
    assert by_bin[build.qemu_system]["severity"] == "ok"
    assert by_bin[build.qemu_system]["details"]["driver"] is True
    assert by_bin[build.qemu_img]["details"]["driver"] is True
    deb = by_bin[DEBIAN_QEMU]
    assert deb["severity"] == "warning" and deb["details"]["driver"] is False
    assert "lacks the pageshare block driver" in deb["what"]
    assert rc == rc_j == 1

    # Debian's alone: no QEMU on this host has the driver, an error.
    rc, data = host_check_json("--no-path", "--qemu", DEBIAN_QEMU, *only("qemu"))
    assert rc == 2
    assert any(
        f["severity"] == "error" and "no QEMU with the pageshare block driver" in f["what"]
        for f in findings(data, "qemu")
    )


# --------------------------------------------------------------------------- guests


def start_qemu(
    binary: str, tmp: Path, name: str, *extra: str
) -> tuple[subprocess.Popen[bytes], Path]:
    qmp = tmp / f"{name}.qmp"
    p = subprocess.Popen(
        [
            binary,
            "-M",
            "none",
            "-nodefaults",
            "-display",
            "none",
            "-name",
            f"{name},debug-threads=on",
            "-qmp",
            f"unix:{qmp},server=on,wait=off",
            *extra,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    wait_for(lambda: qmp.exists() or p.poll() is not None, 30, f"{name}'s QMP socket")
    assert p.poll() is None, p.stderr.read().decode() if p.stderr else ""
    return p, qmp


def stop_qemu(p: subprocess.Popen[bytes]) -> None:
    if p.poll() is None:
        p.kill()
    p.wait(10)


@pytest.mark.build
@pytest.mark.usefixtures("qemu_guard")
def test_guest_without_the_filter_is_reported(tmp_path: Path) -> None:
    build = qemu_build()
    raw = tmp_path / "base.raw"
    raw.write_bytes(bytes(1 << 20))
    plain, with_filter = None, None
    try:
        plain, _ = start_qemu(DEBIAN_QEMU, tmp_path, "hostcheck-plain")
        # A patched QEMU with a pageshare node (no server: the filter reads from disk).
        with_filter, _ = start_qemu(
            build.qemu_system,
            tmp_path,
            "hostcheck-filtered",
            "-blockdev",
            f"driver=file,node-name=base,filename={raw},read-only=on",
            "-blockdev",
            f"driver=pageshare,node-name=ps,file=base,read-only=on,server={tmp_path / 'none.sock'}",
        )
        time.sleep(0.5)
        args = only("guests")
        rc, text = host_check(*args)
        rc_j, data = host_check_json(*args)
        guests = {f["details"]["pid"]: f for f in findings(data, "guests") if f["details"]}
        g = guests[plain.pid]
        assert g["severity"] == "warning" and g["details"]["name"] == "hostcheck-plain"
        assert "runs without the pageshare filter" in g["what"] and str(plain.pid) in g["what"]
        assert g["details"]["block_drivers"] == []  # asked over its QMP socket
        assert f"`pageshare attach {g['details']['qmp']}`" in g["fix"], g["fix"]
        assert f"guest hostcheck-plain (pid {plain.pid}) runs without" in text
        f = guests[with_filter.pid]
        assert f["severity"] == "ok" and "pageshare" in f["details"]["block_drivers"]
        assert rc >= 1 and rc_j >= 1
    finally:
        for p in (plain, with_filter):
            if p is not None:
                stop_qemu(p)


def test_json_reports_bad_arguments_as_json() -> None:
    rc, out = host_check("--json", "--skip", "nonsense")
    assert rc == 2
    data = json.loads(out)
    assert data["status"] == "error" and data["findings"][0]["check"] == "usage"


def test_control_framing_matches_the_reference_client() -> None:
    assert (server_control.MSG_STATUS_REQ, server_control.MSG_STATUS_REPLY) == (
        psc.MSG_STATUS_REQ,
        psc.MSG_STATUS_REPLY,
    )


def test_who_may_read_the_server() -> None:
    """process_vm_readv()/merge_pages() need PTRACE_MODE_READ on the server."""
    full, dac = (1 << 41) - 1, 1 << 2  # all capabilities; CAP_DAC_READ_SEARCH
    root = hostcheck.Creds((0, 0, 0, 0), (0, 0, 0, 0), full)
    qemu = hostcheck.Creds((64055,) * 4, (64055,) * 4, 0)
    same_user = hostcheck.Creds((64055,) * 4, (64055,) * 4, 0)
    same_user_dac = hostcheck.Creds((64055,) * 4, (64055,) * 4, dac)
    other_group = hostcheck.Creds((64055,) * 4, (107,) * 4, 0)
    root_server = hostcheck.Creds((0, 0, 0, 0), (0, 0, 0, 0), dac)
    assert hostcheck.read_refusal(root, root_server) == ""  # CAP_SYS_PTRACE
    assert hostcheck.read_refusal(qemu, same_user) == ""
    assert (
        hostcheck.read_refusal(qemu, root_server)
        == "QEMU runs as uid 64055 gid 64055, the server as uid 0 gid 0"
    )
    assert "gid 107" in hostcheck.read_refusal(qemu, other_group)
    assert (
        hostcheck.read_refusal(qemu, same_user_dac)
        == "the server holds capabilities QEMU lacks (CapPrm 0x4)"
    )
    me = hostcheck.proc_creds(os.getpid())
    assert me is not None and me.uids[0] == os.getuid() and me.gids[0] == os.getgid()
    assert hostcheck.proc_creds(2**22 + 1) is None
