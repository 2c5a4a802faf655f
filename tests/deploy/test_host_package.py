"""pageshare-host, the hypervisor's package, without building or booting
anything: its modules (cli.HOST_MODULES) import nothing of the analyzer's,
statically (every import statement, also inside functions) and when each of
its commands runs from a tree that holds only them, as the package installs
them; `pageshare --help` there lists only what it can run and the
analyzer's commands say which package has them; the watcher's unit scores
below 4.0 in `systemd-analyze security`; the AppArmor abstraction parses
where libvirt's profiles include it (apparmor_parser, on this host's
libvirt and apparmor).  The package itself, installed and run under
systemd: test_host_package_guest.py.
"""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from pageshare.cli import ANALYZER_COMMANDS, HOST_MODULES

REPO = Path(__file__).resolve().parents[2]
PKG = REPO / "analyzer" / "pageshare"
# What the host tools may import beyond the standard library: Debian's
# python3-libvirt, imported only when a libvirt domain is named.
THIRD_PARTY = {"libvirt", "libvirt_qemu"}


def imports(path: Path) -> list[tuple[str, int, bool]]:
    """(module, line, at top level) for every import in a file; relative
    imports as pageshare.X."""
    tree = ast.parse(path.read_text())
    top = {id(n) for n in tree.body}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno, id(node) in top) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = "pageshare" + (f".{node.module}" if node.module else "")
                # `from . import X`: module X, or a name of pageshare/__init__.py
                names = [base if node.module or not (PKG / f"{a.name}.py").exists()
                         else f"{base}.{a.name}" for a in node.names]
            else:
                names = [node.module or ""]
            out += [(n, node.lineno, id(node) in top) for n in names]
    return out


def test_host_modules_import_only_each_other() -> None:
    allowed = {f"pageshare.{m}" for m in HOST_MODULES} | {"pageshare"}
    bad = []
    for m in HOST_MODULES:
        for name, line, top in imports(PKG / f"{m}.py"):
            root = name.split(".")[0]
            if root == "pageshare":
                ok = name in allowed or (m == "cli" and not top)   # cli: analyzer commands
            else:
                ok = root in sys.stdlib_module_names or root == "__future__" or (
                    root in THIRD_PARTY and not top)
            if not ok:
                bad.append(f"{m}.py:{line}: {name}")
    assert not bad, bad


def host_tree(tmp: Path) -> Path:
    """The host tools' modules alone, as pageshare-host installs them."""
    pkg = tmp / "python" / "pageshare"
    pkg.mkdir(parents=True)
    for m in HOST_MODULES:
        shutil.copy2(PKG / f"{m}.py", pkg / f"{m}.py")
    return pkg.parent


def run_host(tree: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pageshare.cli", *args], cwd=tree,
                          capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"})


def test_host_commands_run_without_the_analyzer(tmp_path: Path) -> None:
    tree = host_tree(tmp_path)
    usage = run_host(tree, "--help")
    assert usage.returncode == 0, usage.stderr
    for line in ("host check", "attach QMP", "detach QMP", "attach --libvirt", "libvirt-watch",
                 "libvirt-hook"):
        assert line in usage.stdout, usage.stdout
    assert "analyze IMAGE" not in usage.stdout and "list publish" not in usage.stdout
    assert "the analyzer, in the pageshare package" in usage.stdout, usage.stdout
    for args in (["host", "check"], ["attach"], ["detach"], ["libvirt-watch"],
                 ["libvirt-hook"]):
        p = run_host(tree, *args, "--help")
        assert p.returncode == 0 and "Traceback" not in p.stderr, (args, p.stderr)
    for cmd in ANALYZER_COMMANDS:
        p = run_host(tree, cmd, "--help")
        assert p.returncode == 2 and "Traceback" not in p.stderr, (cmd, p.stderr)
        assert f"`pageshare {cmd}` is part of the analyzer" in p.stderr, p.stderr
        assert "apt install ./pageshare_*.deb" in p.stderr, p.stderr
    # a real run of the host check and of attach's error path, and what they imported
    probe = (
        "import sys, json, contextlib, io\n"
        "from pageshare import cli\n"
        "out, err = io.StringIO(), io.StringIO()\n"
        "with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):\n"
        "    cli.main(['host', 'check', '--json', '--control', '/nonexistent.sock'])\n"
        "    cli.main(['attach', '/nonexistent.qmp', '--json'])\n"
        "    cli.main(['libvirt-hook', 'vm1', 'prepare', 'begin', '-'])\n"
        "print(json.dumps(sorted(sys.modules)))\n")
    p = subprocess.run([sys.executable, "-c", probe], cwd=tree, capture_output=True, text=True,
                       timeout=300, env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"})
    assert p.returncode == 0, p.stderr
    loaded = json.loads(p.stdout)
    ours = {m for m in loaded if m.startswith("pageshare.")}
    assert ours <= {f"pageshare.{m}" for m in HOST_MODULES}, ours
    assert not [m for m in loaded if m.split(".")[0] in ("drgn", "guestfs", "redis")], loaded


def test_the_checkout_lists_every_command() -> None:
    from pageshare import cli
    assert cli.analyzer_installed()
    text = cli.usage()
    assert "analyze IMAGE" in text and "host check" in text and "not installed" not in text


def exposure(unit: Path, tmp: Path) -> float:
    """`systemd-analyze security --offline` of a unit (its binary need not exist here)."""
    copy = tmp / unit.name
    copy.write_text(re.sub(r"^ExecStart=\S+", "ExecStart=/bin/true", unit.read_text(),
                           flags=re.M))
    p = subprocess.run(["systemd-analyze", "security", "--offline=yes", "--no-pager", str(copy)],
                       capture_output=True, text=True, timeout=60)
    m = re.search(r"exposure level for \S+: (\d+\.\d+)", p.stdout)
    assert m, p.stdout + p.stderr
    return float(m.group(1))


def test_the_watchers_unit_is_hardened(tmp_path: Path) -> None:
    unit = REPO / "analyzer" / "pageshare-libvirt-watch.service"
    score = exposure(unit, tmp_path)
    print(f"systemd-analyze security --offline: {unit.name} {score}")
    assert score < 4.0
    text = unit.read_text()
    caps = re.search(r"^CapabilityBoundingSet=(.*)$", text, re.M)
    assert caps and set(caps.group(1).split()) == {"CAP_DAC_READ_SEARCH", "CAP_DAC_OVERRIDE"}
    assert re.search(r"^RestrictAddressFamilies=AF_UNIX$", text, re.M)
    assert re.search(r"^PrivateNetwork=yes$", text, re.M)
    assert re.search(r"^SystemCallFilter=@system-service$", text, re.M)


@pytest.mark.parametrize("copy_mode", [False, True])
def test_the_apparmor_abstraction_parses_in_libvirts_profile(copy_mode: bool,
                                                              tmp_path: Path) -> None:
    """libvirt's per-domain profile (TEMPLATE.qemu, as virt-aa-helper fills
    it) with the abstraction included from libvirt's local abstraction, as
    the README says; also with the copy-mode lines uncommented.  Parsed
    only (-Q -K): this host has no AppArmor to load it into."""
    etc = Path("/etc/apparmor.d")
    assert (etc / "abstractions" / "libvirt-qemu").exists(), \
        "libvirt's AppArmor abstraction is missing (scripts/install-deps.sh installs libvirt)"
    parser = shutil.which("apparmor_parser")
    assert parser, "apparmor_parser is missing (scripts/install-deps.sh installs apparmor)"
    root = tmp_path / "apparmor.d"
    shutil.copytree(etc, root, symlinks=True)
    text = (REPO / "analyzer" / "pageshare-qemu.apparmor").read_text()
    if copy_mode:
        text = text.replace("  #ptrace (read, trace)", "  ptrace (read, trace)").replace(
            "  #@{PROC}", "  @{PROC}")
        assert "\n  ptrace (read, trace) peer=unconfined," in text
    (root / "abstractions" / "pageshare-qemu").write_text(text)
    local = root / "local" / "abstractions" / "libvirt-qemu"
    local.parent.mkdir(parents=True, exist_ok=True)
    with open(local, "a") as f:
        f.write("include <abstractions/pageshare-qemu>\n")
    profile = root / "libvirt" / "TEMPLATE.qemu"
    p = subprocess.run([parser, "-Q", "-K", "--base", str(root), "-I", str(root), "-p",
                        str(profile)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "/run/pageshare/*.sock rw," in p.stdout and "ptrace (read) peer=unconfined," in p.stdout
    q = subprocess.run([parser, "-Q", "-K", "--base", str(root), "-I", str(root), str(profile)],
                       capture_output=True, text=True, timeout=120)
    assert q.returncode == 0, q.stderr


def test_host_check_says_when_libvirts_apparmor_lacks_the_abstraction(tmp_path: Path) -> None:
    from pageshare.hostcheck import check_apparmor
    enabled, d = tmp_path / "enabled", tmp_path / "apparmor.d"
    (d / "abstractions").mkdir(parents=True)
    enabled.write_text("Y\n")
    assert list(check_apparmor(enabled, d)) == []                 # no libvirt profile
    (d / "abstractions" / "libvirt-qemu").write_text("")
    enabled.write_text("N\n")
    assert list(check_apparmor(enabled, d)) == []                 # AppArmor off
    enabled.write_text("Y\n")
    (f,) = check_apparmor(enabled, d)
    assert f.severity == "warning" and "pageshare-qemu is missing" in f.what, f
    assert f.fix.startswith("install pageshare-host"), f
    (d / "abstractions" / "pageshare-qemu").write_text("")
    (f,) = check_apparmor(enabled, d)
    assert f.severity == "warning" and "echo 'include <abstractions/pageshare-qemu>'" in f.fix
    local = d / "local" / "abstractions" / "libvirt-qemu"
    local.parent.mkdir(parents=True)
    local.write_text("# site rules\ninclude <abstractions/pageshare-qemu>\n")
    (f,) = check_apparmor(enabled, d)
    assert f.severity == "ok", f
