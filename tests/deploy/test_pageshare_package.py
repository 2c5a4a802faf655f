"""The pageshare Debian package (the analyzer), with pageshare-host (the host
tools, on which it depends), installed by apt into fresh Debian 12 and 13
roots and run from there, not from the checkout.

packaging/debs.py builds them (cached; lintian clean, their contents
checked); package_root.py installs them with `apt-get install
./pageshare-host_*.deb ./pageshare_*.deb` (and the recommended packages the
tests use) into a root made by mmdebstrap, so every other dependency comes
from Debian's archive. The roots do not contain this
checkout. What runs there: the CLI and its manual pages, the results
notebook (`pageshare report`, with the recommended pandas, matplotlib and
nbclient), the libvirt binding (an attach through libvirt's test driver,
which refuses monitor passthrough), the host check, and the vendored drgn
for the suite's Python. The crash extension built into the package is run on
a real dump in test_drgn_backend.py.
"""

from __future__ import annotations

import json
import re
import sqlite3
import subprocess
from collections.abc import Callable
from pathlib import Path

import debs
import pytest
from package_root import Root, built_deb, pageshare_deb
from pageshare.cli import HOST_PACKAGE
from results_samples import make_results_db

pytestmark = pytest.mark.vm  # long: builds roots from the Debian archive

REPO = Path(__file__).resolve().parents[2]

SUITES = {"bookworm": "3.11", "trixie": "3.13"}


def test_the_packages_hold_what_they_should() -> None:
    deb = pageshare_deb()
    paths = debs.deb_paths(deb)
    for v in SUITES.values():
        assert f"usr/lib/pageshare/python{v}/drgn/__init__.py" in paths
    assert not [p for p in paths if "__pycache__" in p]
    control = debs.deb_control_file(deb, "control")
    assert "python3-guestfs" in control and "qemu-system-x86" in control
    assert "pageshare-host (= 0.2.0)" in control, control
    assert "Recommends:" in control and "crash" in control
    # the host tools are pageshare-host's, not the analyzer's
    assert not [p for p in paths if p.startswith(("etc/", "lib/systemd"))], paths
    assert (
        "usr/bin/pageshare" not in paths
        and "usr/lib/pageshare/python/pageshare/cli.py" not in paths
    )
    assert debs.deb_control_file(deb, "conffiles") == ""

    host = built_deb("pageshare-host")
    hpaths = debs.deb_paths(host)
    control = debs.deb_control_file(host, "control")
    assert "Architecture: all" in control and "Breaks: pageshare (<< 0.2.0)" in control, control
    assert re.search(r"^Depends: python3 \(>= 3\.11\)$", control, re.M), control
    unit = debs.deb_member(host, "lib/systemd/system/pageshare-libvirt-watch.service")
    assert "ExecStart=/usr/bin/pageshare libvirt-watch" in unit
    # the libvirt hook and the configuration it shares with libvirt-watch,
    # and the AppArmor abstractions: conffiles, the hook executable, calling
    # the installed pageshare
    conffiles = debs.deb_control_file(host, "conffiles").split()
    assert {
        "/etc/libvirt/hooks/qemu.d/pageshare",
        "/etc/pageshare/libvirt.toml",
        "/etc/apparmor.d/abstractions/pageshare-qemu",
        "/etc/apparmor.d/abstractions/pageshare-libvirtd",
        "/etc/default/grub.d/pageshare-kernel.cfg",
    } <= set(conffiles), conffiles
    grub = debs.deb_member(host, "etc/default/grub.d/pageshare-kernel.cfg")
    assert grub == (REPO / "packaging/pageshare-host/grub.d/pageshare-kernel.cfg").read_text()
    hook = debs.deb_member(host, "etc/libvirt/hooks/qemu.d/pageshare")
    assert "PAGESHARE=/usr/bin/pageshare" in hook and "libvirt-hook" in hook
    listing = subprocess.run(
        ["dpkg-deb", "-c", str(host)], capture_output=True, text=True, check=True
    ).stdout
    assert re.search(r"^-rwxr-xr-x .* \./etc/libvirt/hooks/qemu\.d/pageshare$", listing, re.M)
    postinst = debs.deb_control_file(host, "postinst")
    assert "try-reload-or-restart" in postinst and "update-grub" in postinst
    assert "update-grub" in debs.deb_control_file(host, "postrm")
    modules = sorted(
        p.removeprefix(f"{debs.MODULES}/")
        for p in hpaths
        if p.startswith(f"{debs.MODULES}/") and p != f"{debs.MODULES}/{HOST_PACKAGE}"
    )
    assert modules == sorted(debs.HOST_MODULES), modules
    for d in (deb, host):
        assert (d.parent / "lintian.txt").exists()


@pytest.mark.parametrize("suite", list(SUITES))
def test_installed_by_apt_and_run_from_the_package(
    suite: str, pageshare_root: Callable[[str], Root], tmp_path: Path
) -> None:
    root = pageshare_root(suite)
    assert not (root.path / "work").exists()  # no checkout in the root

    p = root.run("pageshare --version && analyze-image --help && pageshare --help")
    assert p.returncode == 0, p.stderr
    assert "pageshare 0.2.0" in p.stdout and "what it does" in p.stdout, p.stdout
    assert "analyze IMAGE" in p.stdout and "not installed here" not in p.stdout, p.stdout
    assert (root.path / "usr/share/man/man1/analyze-image.1.gz").exists()

    # the vendored drgn for this suite's Python, from the package
    vendored = f"/usr/lib/pageshare/python{SUITES[suite]}"
    p = root.run(
        '/usr/bin/python3 -c \'import sys; sys.path[:0] = ["/usr/lib/pageshare/python",'
        f' "{vendored}"]; import drgn, pageshare.analysis.drgn_backend; print(drgn.__file__)\''
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith(f"{vendored}/drgn/"), p.stdout

    # the results notebook, headless, with the recommended packages
    work = tmp_path / "work"
    work.mkdir()
    db = make_results_db(work / "results.sqlite")
    p = root.run(
        f"cd {work} && pageshare report --db {db} --out {work}/report.ipynb "
        f"--figures {work}/figures",
        binds=(work,),
    )
    assert p.returncode == 0, p.stdout + p.stderr
    nb = json.loads((work / "report.ipynb").read_text())
    errors = [
        o for c in nb["cells"] for o in c.get("outputs", []) if o.get("output_type") == "error"
    ]
    assert not errors, errors
    assert sorted(f.suffix for f in (work / "figures").iterdir()) and all(
        f.suffix == ".png" for f in (work / "figures").iterdir()
    )
    sqlite3.connect(db).close()

    # the libvirt binding (pageshare-host recommends it): libvirt's test
    # driver has a running domain but no QEMU monitor, so attach fails, with
    # a message
    p = root.run("pageshare attach --libvirt test --connect test:///default --json")
    assert p.returncode == 1, p.stdout + p.stderr
    r = json.loads(p.stdout)
    assert not r["ok"] and r["error"]["kind"] == "qemu-refused", r
    assert "Traceback" not in p.stderr, p.stderr

    # the libvirt hook as libvirtd runs it: a call that is not pageshare's
    # returns at once; a migrating domain pageshare never marked is left
    # as it is (nothing printed: libvirt keeps its XML)
    hook = "/etc/libvirt/hooks/qemu.d/pageshare"
    p = root.run(
        f"{hook} vm1 prepare begin - </dev/null && echo '<domain><name>vm1</name>"
        f"</domain>' | {hook} vm1 migrate begin - && pageshare libvirt-hook --help"
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.startswith("usage: pageshare libvirt-hook"), p.stdout

    # the host check: no server here, so it exits 2, with JSON that says so
    p = root.run("pageshare host check --json")
    assert p.returncode == 2, p.stdout + p.stderr
    checks = json.loads(p.stdout)
    assert checks and "Traceback" not in p.stderr, p.stderr
