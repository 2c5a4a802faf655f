"""pageshare-host, the hypervisor's package, without building or booting
anything: its modules (debs.HOST_MODULES: cli, errors and the host
subpackage) import nothing of the analyzer's,
statically (every import statement, also inside functions) and when each of
its commands runs from a tree that holds only them, as the package installs
them; `pageshare --help` there lists only what it can run and the
analyzer's commands say which package has them; the watcher's unit scores
below 4.0 in `systemd-analyze security`; the AppArmor parts compile
where libvirt's profiles include them (apparmor_parser, on this host's
libvirt and apparmor), give libvirtd and the domains the exec rules they
lack (python3-apparmor), and host check says which line a profile lacks.
The package itself, installed and run under systemd:
test_host_package_guest.py.
"""

from __future__ import annotations

import ast
import importlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import debs
import pytest
from debs import HOST_MODULES
from pageshare.cli import ANALYZER_COMMANDS

REPO = Path(__file__).resolve().parents[2]
PKG = REPO / "analyzer" / "pageshare"
# What the host tools may import beyond the standard library: Debian's
# python3-libvirt, imported only when a libvirt domain is named.
THIRD_PARTY = {"libvirt", "libvirt_qemu"}


def module_name(rel: str) -> str:
    """The dotted name of a file of PKG ("host/qmp.py": pageshare.host.qmp)."""
    parts = ["pageshare", *rel.removesuffix(".py").split("/")]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> list[tuple[str, int, bool]]:
    """(module, line, at top level) for every import in a file of PKG; relative
    imports resolved against the file's package (pageshare.X, pageshare.host.X),
    and `from P import X` as P.X where X is a module or subpackage of P."""
    package = module_name(str(path.relative_to(PKG).parent / "__init__.py")).split(".")
    tree = ast.parse(path.read_text())
    top = {id(n) for n in tree.body}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno, id(node) in top) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package[: len(package) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            names = [base]
            if base.split(".")[0] == "pageshare":
                where = PKG.joinpath(*base.split(".")[1:])
                names = [
                    f"{base}.{a.name}"
                    if (where / f"{a.name}.py").exists() or (where / a.name).is_dir()
                    else base
                    for a in node.names
                ]
            out += [(n, node.lineno, id(node) in top) for n in names]
    return out


def test_the_host_package_is_the_host_subpackage() -> None:
    """pageshare-host ships cli, errors and the host subpackage whole: every
    module of it, and no other."""
    host = {f"host/{f.name}" for f in (PKG / "host").glob("*.py")}
    assert "host/__init__.py" in host and "host/qmp.py" in host
    assert set(HOST_MODULES) == {"__init__.py", "cli.py", "errors.py"} | host
    assert debs.PACKAGES["pageshare-host"].sources["analyzer/pageshare/host"] == (
        "python/pageshare/host"
    )


def test_host_modules_import_only_each_other() -> None:
    allowed = {module_name(m) for m in HOST_MODULES}
    bad = []
    for m in HOST_MODULES:
        for name, line, top in imports(PKG / m):
            root = name.split(".")[0]
            if root == "pageshare":
                ok = name in allowed or (m == "cli.py" and not top)  # cli: analyzer commands
            else:
                ok = (
                    root in sys.stdlib_module_names
                    or root == "__future__"
                    or (root in THIRD_PARTY and not top)
                )
            if not ok:
                bad.append(f"{m}:{line}: {name}")
    assert not bad, bad


def host_tree(tmp: Path) -> Path:
    """The host tools' modules alone, as pageshare-host installs them."""
    pkg = tmp / "python" / "pageshare"
    for m in HOST_MODULES:
        (pkg / m).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(PKG / m, pkg / m)
    return pkg.parent


def run_host(tree: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pageshare.cli", *args],
        cwd=tree,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"},
    )


def test_host_commands_run_without_the_analyzer(tmp_path: Path) -> None:
    tree = host_tree(tmp_path)
    usage = run_host(tree, "--help")
    assert usage.returncode == 0, usage.stderr
    for line in (
        "host check",
        "attach QMP",
        "detach QMP",
        "attach --libvirt",
        "libvirt-watch",
        "libvirt-hook",
    ):
        assert line in usage.stdout, usage.stdout
    assert "analyze IMAGE" not in usage.stdout and "list publish" not in usage.stdout
    assert "the analyzer, in the pageshare package" in usage.stdout, usage.stdout
    for args in (["host", "check"], ["attach"], ["detach"], ["libvirt-watch"], ["libvirt-hook"]):
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
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=tree,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"},
    )
    assert p.returncode == 0, p.stderr
    loaded = json.loads(p.stdout)
    ours = {m for m in loaded if m.startswith("pageshare.")}
    assert ours <= {module_name(m) for m in HOST_MODULES}, ours
    assert not [m for m in loaded if m.split(".")[0] in ("drgn", "guestfs", "redis")], loaded


def test_the_checkout_lists_every_command() -> None:
    from pageshare import cli

    assert cli.analyzer_installed()
    text = cli.usage()
    assert "analyze IMAGE" in text and "host check" in text and "not installed" not in text


def test_every_command_runs_a_function_of_its_package() -> None:
    """The command tree: every command and subcommand names a function that
    exists, and the host tools' commands run modules of the host subpackage."""
    from pageshare import cli

    def commands(node: cli.Command | cli.Group) -> list[cli.Command]:
        if isinstance(node, cli.Command):
            return [node]
        return [*node.subcommands.values(), *([node.otherwise] if node.otherwise else [])]

    assert set(cli.COMMANDS) == set(cli.HOST_COMMANDS) | set(cli.ANALYZER_COMMANDS)
    for name, node in cli.COMMANDS.items():
        for c in commands(node):
            module = importlib.import_module(f"pageshare.{c.module or 'cli'}")
            assert callable(getattr(module, c.function)), (name, c)
            if name in cli.HOST_COMMANDS:
                assert c.module.startswith(f"{cli.HOST_PACKAGE}."), (name, c)


def exposure(unit: Path, tmp: Path) -> float:
    """`systemd-analyze security --offline` of a unit (its binary need not exist here)."""
    copy = tmp / unit.name
    copy.write_text(re.sub(r"^ExecStart=\S+", "ExecStart=/bin/true", unit.read_text(), flags=re.M))
    p = subprocess.run(
        ["systemd-analyze", "security", "--offline=yes", "--no-pager", str(copy)],
        capture_output=True,
        text=True,
        timeout=60,
    )
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


# --------------------------------------------------------------------------- AppArmor
# pageshare-host's two AppArmor parts (analyzer/*.apparmor) against this
# host's Debian 12 profiles (libvirt-daemon-system, apparmor), compiled but
# not loaded (-Q -K: this host's kernel has no AppArmor), and host check's
# findings about them on real and on fake /etc/apparmor.d trees.

ETC_APPARMOR = Path("/etc/apparmor.d")
EMULATOR = "/usr/lib/pageshare-qemu/bin/qemu-system-x86_64"


def apparmor_tree(tmp: Path, *, qemu: bool, libvirtd: bool, copy_mode: bool = False) -> Path:
    """A copy of this host's /etc/apparmor.d with pageshare-host's parts
    installed, and included where host check says (and docs/install.md), as
    asked."""
    assert (ETC_APPARMOR / "usr.sbin.libvirtd").exists(), (
        "libvirt's AppArmor profiles are missing (scripts/install-deps.sh installs libvirt)"
    )
    from pageshare.host.hostcheck import LIBVIRTD_INCLUDE, QEMU_INCLUDE

    root = tmp / "apparmor.d"
    shutil.copytree(ETC_APPARMOR, root, symlinks=True)
    text = (REPO / "analyzer" / "pageshare-qemu.apparmor").read_text()
    if copy_mode:
        text = text.replace("  #ptrace (read, trace)", "  ptrace (read, trace)").replace(
            "  #@{PROC}", "  @{PROC}"
        )
        assert "\n  ptrace (read, trace) peer=unconfined," in text
    (root / "abstractions" / "pageshare-qemu").write_text(text)
    shutil.copy2(
        REPO / "analyzer" / "pageshare-libvirtd.apparmor",
        root / "abstractions" / "pageshare-libvirtd",
    )
    for wanted, local, line in (
        (qemu, "local/abstractions/libvirt-qemu", QEMU_INCLUDE),
        (libvirtd, "local/usr.sbin.libvirtd", LIBVIRTD_INCLUDE),
    ):
        if wanted:
            (root / local).parent.mkdir(parents=True, exist_ok=True)
            with open(root / local, "a") as f:
                f.write(line + "\n")
    return root


def apparmor_parser(root: Path, profile: Path, *args: str) -> str:
    parser = shutil.which("apparmor_parser", path="/usr/sbin:/sbin:/usr/bin")
    assert parser, "apparmor_parser is missing (scripts/install-deps.sh installs apparmor)"
    p = subprocess.run(
        [parser, "-Q", "-K", "--base", str(root), *args, str(profile)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    return p.stdout


@pytest.mark.parametrize("copy_mode", [False, True])
def test_the_apparmor_parts_compile_in_libvirts_profiles(copy_mode: bool, tmp_path: Path) -> None:
    """libvirt's per-domain profile (TEMPLATE.qemu, as virt-aa-helper fills
    it) with pageshare-qemu included from libvirt's local abstraction, and
    libvirtd's profile with pageshare-libvirtd included from its local
    file, as docs/install.md says; also with the copy-mode lines uncommented."""
    root = apparmor_tree(tmp_path, qemu=True, libvirtd=True, copy_mode=copy_mode)
    template = apparmor_parser(root, root / "libvirt" / "TEMPLATE.qemu", "-p")
    assert "/run/pageshare/*.sock rw," in template and "ptrace (read) peer=unconfined," in template
    assert "/usr/lib/pageshare-qemu/bin/* rmix," in template
    apparmor_parser(root, root / "libvirt" / "TEMPLATE.qemu")
    daemon = apparmor_parser(root, root / "usr.sbin.libvirtd", "-p")
    assert f"\n  {EMULATOR} PUx,\n" in daemon
    assert "/run/pageshare" not in daemon  # QEMU's rules stay QEMU's
    apparmor_parser(root, root / "usr.sbin.libvirtd")
    # `include if exists`: both still compile once pageshare-host is purged
    for part in ("pageshare-qemu", "pageshare-libvirtd"):
        (root / "abstractions" / part).unlink()
    apparmor_parser(root, root / "libvirt" / "TEMPLATE.qemu")
    apparmor_parser(root, root / "usr.sbin.libvirtd")


# The exec rules a profile has for a path, by AppArmor's own rule logic
# (python3-apparmor, as aa-logprof uses it), in a process of its own: its
# state is global.
EXEC_RULES = """
import json, sys
import apparmor.aa as aa
root, paths = sys.argv[1], sys.argv[2:]
aa.init_aa(confdir=sys.argv[1] + "/../aa-conf", profiledir=root)
aa.read_profiles()
aa.read_profile(root + "/libvirt/TEMPLATE.qemu", True)
out = {}
for name in ("libvirtd", "LIBVIRT_TEMPLATE"):
    (prof,) = [aa.aa[k][name] for k in aa.aa if name in aa.aa[k]]
    parts = [prof] + [aa.include[i][i] for i in aa.include_list_recursive(prof)]
    out[name] = {p: sorted(r.get_clean() for part in parts for r in part["file"]
                           .get_exec_rules_for_path(p, only_exact_matches=False).rules)
                 for p in paths}
print(json.dumps(out))
"""


def exec_rules(root: Path) -> dict[str, dict[str, list[str]]]:
    (root.parent / "aa-conf").mkdir(exist_ok=True)
    p = subprocess.run(
        [sys.executable, "-c", EXEC_RULES, str(root), EMULATOR, "/usr/bin/qemu-system-x86_64"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, "python3-apparmor (scripts/install-deps.sh installs it): " + p.stderr
    out: dict[str, dict[str, list[str]]] = json.loads(p.stdout.splitlines()[-1])
    return out


def test_libvirtd_may_execute_pageshare_qemu_only_with_pageshare_libvirtd(tmp_path: Path) -> None:
    """Why a domain on pageshare-qemu did not start under Debian 12's
    AppArmor with only the domains' part included (Permission denied):
    libvirtd executes the emulator itself (its capabilities probe) under its
    own profile, which has an exec rule for Debian's QEMU (/usr/bin/* PUx)
    and none for pageshare-qemu's; the domain's profile (TEMPLATE.qemu;
    virt-aa-helper adds no rule for the emulator) has one only through
    pageshare-qemu.  With both parts included, both may."""
    stock = exec_rules(apparmor_tree(tmp_path / "stock", qemu=False, libvirtd=False))
    assert stock["libvirtd"] == {EMULATOR: [], "/usr/bin/qemu-system-x86_64": ["/usr/bin/* PUx,"]}
    assert stock["LIBVIRT_TEMPLATE"] == {
        EMULATOR: [],
        "/usr/bin/qemu-system-x86_64": ["/usr/bin/qemu-system-x86_64 mrix,"],
    }
    domains_only = exec_rules(apparmor_tree(tmp_path / "qemu", qemu=True, libvirtd=False))
    assert domains_only["libvirtd"][EMULATOR] == []  # the Permission denied
    assert domains_only["LIBVIRT_TEMPLATE"][EMULATOR] == ["/usr/lib/pageshare-qemu/bin/* mrix,"]
    both = exec_rules(apparmor_tree(tmp_path / "both", qemu=True, libvirtd=True))
    assert both["libvirtd"][EMULATOR] == [f"{EMULATOR} PUx,"]
    assert both["LIBVIRT_TEMPLATE"][EMULATOR] == ["/usr/lib/pageshare-qemu/bin/* mrix,"]


def fake_apparmor(tmp: Path, debian: int) -> tuple[Path, Path, Path, Path]:
    """A minimal /etc/apparmor.d laid out as Debian 12's or 13's libvirt
    lays it out (13: libvirt's abstraction includes abstractions/libvirt-qemu.d/
    and, deprecated, the local file), AppArmor on, pageshare-qemu installed,
    no domain defined: (enabled, apparmor.d, emulator, domains)."""
    enabled, d = tmp / "enabled", tmp / "apparmor.d"
    enabled.write_text("Y\n")
    (d / "abstractions").mkdir(parents=True)
    (d / "libvirt").mkdir()
    (d / "libvirt" / "TEMPLATE.qemu").write_text(
        "#include <tunables/global>\nprofile LIBVIRT_TEMPLATE flags=(attach_disconnected) {\n"
        "  #include <abstractions/libvirt-qemu>\n}\n"
    )
    local = (
        "  include if exists <abstractions/libvirt-qemu.d>\n"
        "  include if exists <local/abstractions/libvirt-qemu>\n"
        if debian == 13
        else "  # Site-specific additions and overrides. See local/README for details.\n"
        "  #include <local/abstractions/libvirt-qemu>\n"
    )
    (d / "abstractions" / "libvirt-qemu").write_text(
        "  /usr/bin/qemu-system-x86_64 rmix,\n" + local
    )
    (d / "usr.sbin.libvirtd").write_text(
        "profile libvirtd /usr/sbin/libvirtd {\n  /usr/bin/* PUx,\n"
        "  #include <local/usr.sbin.libvirtd>\n}\n"
    )
    (d / "local" / "abstractions").mkdir(parents=True)
    (d / "local" / "usr.sbin.libvirtd").write_text("")
    emulator = tmp / "pageshare-qemu" / "bin" / "qemu-system-x86_64"
    emulator.parent.mkdir(parents=True)
    emulator.write_text("")
    domains = tmp / "libvirt-qemu"
    domains.mkdir()
    return enabled, d, emulator, domains


def apply(finding: Any) -> None:
    """What the finding's fix says: its line into its file (for Debian 13's
    libvirt-qemu.d, a file of its own)."""
    f = Path(finding.details["file"])
    f.parent.mkdir(parents=True, exist_ok=True)
    with open(f, "a") as out:
        out.write(finding.details["line"] + "\n")
    assert f"'{finding.details['line']}' >" in finding.fix and str(f) in finding.fix, finding


@pytest.mark.parametrize("debian", [12, 13])
def test_host_check_says_which_apparmor_line_libvirt_lacks(debian: int, tmp_path: Path) -> None:
    from pageshare.host.hostcheck import LIBVIRTD_INCLUDE, QEMU_INCLUDE, check_apparmor

    enabled, d, emulator, domains = fake_apparmor(tmp_path, debian)

    def findings() -> list[Any]:
        return list(check_apparmor(enabled, d, emulator, domains, parse=False))

    enabled.write_text("N\n")
    assert findings() == []  # AppArmor off
    enabled.write_text("Y\n")
    # pageshare-host's parts missing (pageshare-qemu alone)
    qemu, daemon = findings()
    assert qemu.severity == daemon.severity == "warning", (qemu, daemon)
    assert "(it is missing)" in qemu.what and qemu.fix.startswith("install pageshare-host")
    assert "pageshare-libvirtd is missing" in daemon.what, daemon
    (d / "abstractions" / "pageshare-qemu").write_text("  /run/pageshare/*.sock rw,\n")
    (d / "abstractions" / "pageshare-libvirtd").write_text(f"  {emulator} PUx,\n")
    qemu, daemon = findings()
    assert qemu.severity == daemon.severity == "warning", (qemu, daemon)
    assert "does not include" in qemu.what and "Permission denied" in qemu.why, qemu
    assert qemu.details["line"] == QEMU_INCLUDE, qemu
    assert qemu.details["file"] == str(
        d / "abstractions" / "libvirt-qemu.d" / "pageshare-qemu"
        if debian == 13
        else d / "local" / "abstractions" / "libvirt-qemu"
    ), qemu
    assert (
        f"libvirtd's AppArmor profile ({d / 'usr.sbin.libvirtd'}) does not let it execute "
        f"pageshare-qemu ({emulator})" == daemon.what
    ), daemon
    assert "to probe it" in daemon.why and "cannot execute binary" in daemon.why, daemon
    assert daemon.fix == (
        f"echo '{LIBVIRTD_INCLUDE}' >> {d / 'local' / 'usr.sbin.libvirtd'} "
        f"&& apparmor_parser -r {d / 'usr.sbin.libvirtd'} "
        "(a running libvirtd gets it at once)"
    ), daemon

    # a defined domain on pageshare-qemu (named by its /usr/bin link) cannot start: errors
    link = tmp_path / "pageshare-qemu-system-x86_64"
    link.symlink_to(emulator)
    (domains / "vm1.xml").write_text(
        f"<domain type='kvm'><name>vm1</name><devices><emulator>{link}</emulator>"
        "</devices></domain>\n"
    )
    (domains / "vm2.xml").write_text(
        "<domain type='kvm'><name>vm2</name><devices><emulator>/usr/bin/qemu-system-x86_64"
        "</emulator></devices></domain>\n"
    )
    (domains / "broken.xml").write_text("<domain")
    qemu, daemon = findings()
    assert qemu.severity == daemon.severity == "error", (qemu, daemon)
    assert qemu.what.endswith(": domain vm1 runs pageshare-qemu and cannot start"), qemu
    assert daemon.what.endswith(": domain vm1 runs pageshare-qemu and cannot start"), daemon

    # the domains' line alone: libvirtd still may not run it (the state of the
    # failed guest test), then both
    apply(qemu)
    qemu, daemon = findings()
    assert (qemu.severity, daemon.severity) == ("ok", "error"), (qemu, daemon)
    apply(daemon)
    assert [f.severity for f in findings()] == ["ok", "ok"]
    # a disabled daemon profile, or no pageshare-qemu: nothing about libvirtd
    (d / "disable").mkdir()
    (d / "disable" / "usr.sbin.libvirtd").symlink_to(d / "usr.sbin.libvirtd")
    assert [f.what for f in findings()] == [qemu.what]
    (d / "disable" / "usr.sbin.libvirtd").unlink()
    emulator.unlink()
    assert [f.what for f in findings()] == [qemu.what]
    # no libvirt: nothing at all
    shutil.rmtree(d / "libvirt")
    (d / "abstractions" / "libvirt-qemu").unlink()
    (d / "usr.sbin.libvirtd").unlink()
    assert findings() == []


def test_apparmor_includes_follows_what_apparmor_parser_reads(tmp_path: Path) -> None:
    from pageshare.host.hostcheck import apparmor_includes

    d = tmp_path / "apparmor.d"
    (d / "a.d").mkdir(parents=True)
    (d / "p").write_text(
        "#include <tunables/x>\n  # include <commented>\n"
        '  include if exists <a.d>\n  include "/abs/olute"\n'
        '  #include "rel"\n'
    )
    (d / "a.d" / "one").write_text("include <b>\n")
    (d / "a.d" / "one.dpkg-old").write_text("include <old>\n")
    (d / "a.d" / ".hidden").write_text("include <hidden>\n")
    (d / "b").write_text("include <p>\n")  # a loop
    got = {
        str(p.relative_to(d)) if p.is_relative_to(d) else str(p)
        for p in apparmor_includes(d / "p", d)
    }
    assert got == {"tunables/x", "a.d", "a.d/one", "b", "/abs/olute", "rel"}, got


def test_host_check_compiles_libvirts_profiles_with_the_lines(tmp_path: Path) -> None:
    """With this host's real profiles: the lines docs/install.md gives are ok,
    and a profile that no longer compiles once included is an error."""
    from pageshare.host.hostcheck import check_apparmor

    root = apparmor_tree(tmp_path, qemu=True, libvirtd=True)
    enabled = tmp_path / "enabled"
    enabled.write_text("Y\n")
    emulator = tmp_path / "qemu-system-x86_64"
    emulator.write_text("")
    found = list(check_apparmor(enabled, root, emulator, tmp_path / "none"))
    assert [f.severity for f in found] == ["ok", "ok"], found
    with open(root / "local" / "usr.sbin.libvirtd", "a") as f:
        f.write(f"  {EMULATOR} ix,\n")  # conflicts with the part's PUx
    qemu, daemon = check_apparmor(enabled, root, emulator, tmp_path / "none")
    assert qemu.severity == "ok", qemu
    assert daemon.severity == "error" and "does not compile" in daemon.what, daemon
    assert "conflicting x modifiers" in daemon.what, daemon


def test_install_md_and_the_parts_give_host_checks_lines() -> None:
    """One line per profile, the same wherever it is written: host check,
    the operator's guide (docs/install.md; the README and ARCHITECTURE.md
    point there) and each part's own header."""
    from pageshare.host.hostcheck import LIBVIRTD_INCLUDE, QEMU_INCLUDE

    guide = (REPO / "docs" / "install.md").read_text()
    for line, local, part in (
        (QEMU_INCLUDE, "/etc/apparmor.d/local/abstractions/libvirt-qemu", "pageshare-qemu"),
        (LIBVIRTD_INCLUDE, "/etc/apparmor.d/local/usr.sbin.libvirtd", "pageshare-libvirtd"),
    ):
        assert f"echo '{line}' >> {local}" in guide, line
        header = (REPO / "analyzer" / f"{part}.apparmor").read_text()
        assert f"#   echo '{line}' \\\n#       >> {local}\n" in header, part
    assert "apparmor_parser -r /etc/apparmor.d/usr.sbin.libvirtd" in guide
    # Debian 13: the domains' line in a file of its own, as host check gives it
    dropins = "/etc/apparmor.d/abstractions/libvirt-qemu.d"
    assert f"mkdir -p {dropins} && echo '{QEMU_INCLUDE}' > {dropins}/pageshare-qemu" in guide
