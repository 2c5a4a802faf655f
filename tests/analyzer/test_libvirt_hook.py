"""The libvirt hook's decisions without libvirt (libvirt_hook.py, the
packaged shell script in front of it, libvirt_config.py): which QEMU
arguments an incoming domain gets from its mark, that a second pass changes
nothing, that an operator's own <qemu:commandline> is kept, and which hook
calls reach pageshare at all.  The hook at work, in two libvirtds, is
tests/deploy/test_libvirt_migrate.py."""

from __future__ import annotations

import io
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from pageshare.host import libvirt_hook as hook
from pageshare.host.libvirt_config import ConfigError, HostConfig, load
from pageshare.host.libvirt_qmp import METADATA_NS

REPO = Path(__file__).resolve().parents[2]
UUID = "0d1e7a3c-1111-2222-3333-444455556666"
CFG = HostConfig(qmp_dir=Path("/var/lib/libvirt/qemu"))
SOCK = f"/var/lib/libvirt/qemu/pageshare-{UUID}.qmp"


def domain(mark: str | None, args: tuple[str, ...] = (), env: bool = False) -> str:
    """A domain XML as libvirt formats it for a migration."""
    meta = (
        f'<metadata>\n    <pageshare:filter xmlns:pageshare="{METADATA_NS}" '
        f'block-refs="{mark}"/>\n    <nova:instance xmlns:nova="http://openstack.org/'
        'xmlns/libvirt/nova/1.1"><nova:name>x</nova:name></nova:instance>\n  </metadata>'
        if mark
        else ""
    )
    cmd = ""
    if args or env:
        cmd = (
            "<qemu:commandline>\n"
            + "".join(f"    <qemu:arg value='{a}'/>\n" for a in args)
            + ("    <qemu:env name='X' value='1'/>\n" if env else "")
            + "  </qemu:commandline>"
        )
    return f"""<domain type='qemu' xmlns:qemu='http://libvirt.org/schemas/domain/qemu/1.0'>
  <name>ps-guest</name>
  <uuid>{UUID}</uuid>
  {meta}
  <memory unit='KiB'>1048576</memory>
  <devices><emulator>/usr/lib/pageshare-qemu/bin/qemu-system-x86_64</emulator></devices>
  {cmd}
</domain>
"""


def ours(refs: bool) -> list[str]:
    out = [
        "-chardev",
        f"socket,id=pageshare-qmp,path={SOCK},server=on,wait=off",
        "-mon",
        "chardev=pageshare-qmp,mode=control",
    ]
    return out + (["-global", "migration.block-refs=on"] if refs else [])


@pytest.mark.parametrize("refs", [True, False], ids=["refs", "no-refs"])
def test_a_marked_domain_gets_the_monitor_once(refs: bool) -> None:
    src = domain("on" if refs else "off", ("-foo", "bar"), env=True)
    out = hook.rewrite(src, CFG)
    assert out is not None
    d = hook.parse(out)
    assert d.args == ["-foo", "bar", *ours(refs)]
    assert d.marked and d.block_refs == refs and d.uuid == UUID
    assert hook.our_socket(d.args) == Path(SOCK)
    assert hook.rewrite(out, CFG) is None  # the same XML in, nothing out
    root = ET.fromstring(out)
    cmd = root.find(f"{{{hook.QEMU_NS}}}commandline")
    assert cmd is not None and cmd[-1].tag == f"{{{hook.QEMU_NS}}}env"  # env stays last
    # the other tools' metadata is kept, in its namespace
    assert root.find("metadata/{http://openstack.org/xmlns/libvirt/nova/1.1}instance") is not None
    assert "xmlns:qemu=" in out and "<qemu:arg" in out


def test_the_mark_decides_block_refs_on_every_migration() -> None:
    on = hook.rewrite(domain("on"), CFG)
    assert on is not None and hook.parse(on).args == ours(True)
    off = hook.rewrite(on.replace('block-refs="on"', 'block-refs="off"'), CFG)
    assert off is not None and hook.parse(off).args == ours(False)


def test_an_unmarked_domain_loses_our_arguments_and_keeps_its_own() -> None:
    assert hook.rewrite(domain(None), CFG) is None
    assert hook.rewrite(domain(None, ("-foo", "bar")), CFG) is None
    out = hook.rewrite(domain(None, ("-foo", *ours(True), "bar")), CFG)
    assert out is not None and hook.parse(out).args == ["-foo", "bar"]
    out = hook.rewrite(domain(None, tuple(ours(False))), CFG)
    assert out is not None and "commandline" not in out


def test_an_operators_own_chardev_is_not_ours() -> None:
    args = ("-chardev", "socket,id=mine,path=/tmp/x", "-global", "kvm-pit.lost_tick_policy=delay")
    out = hook.rewrite(domain("off", args), CFG)
    assert out is not None and hook.parse(out).args == [*args, *ours(False)]
    assert hook.our_socket(list(args)) is None


def test_config(tmp_path: Path) -> None:
    assert load(tmp_path / "missing.toml") == HostConfig()
    with pytest.raises(ConfigError, match="no such file"):
        load(tmp_path / "missing.toml", required=True)
    conf = tmp_path / "libvirt.toml"
    conf.write_text('control = "/run/x.sock"\nmode = "copy"\nblock_refs = true\ntimeout = 5\n')
    assert load(conf) == HostConfig(
        control=Path("/run/x.sock"), mode="copy", block_refs=True, timeout=5.0
    )
    for text, err in (
        ("block_refs = 1\n", "block_refs must be a bool"),
        ('mode = "fast"\n', "mode must be one of"),
        ("timeout = true\n", "timeout must be a int or float"),
        ('qmp_dir = "/a,b"\n', "comma"),
        ("blockrefs = true\n", "unknown key"),
        ("block_refs = \n", "libvirt.toml"),
    ):
        conf.write_text(text)
        with pytest.raises(ConfigError, match=err):
            load(conf)
    # the packaged file: every key commented out, i.e. the defaults
    assert load(REPO / "analyzer" / "libvirt.toml") == HostConfig()


def run_script(tmp: Path, args: list[str], xml: str) -> tuple[int, str]:
    """The packaged hook script with a stand-in for /usr/bin/pageshare that
    records how it was called; returns its exit status and the record."""
    record = tmp / "called"
    record.unlink(missing_ok=True)
    stub = tmp / "pageshare"
    stub.write_text(f'#!/bin/sh\necho "$@" > {record}\ncat >> {record}\nexit 3\n')
    stub.chmod(0o755)
    script = tmp / "hook"
    text = (REPO / "analyzer" / "pageshare-libvirt-hook").read_text()
    script.write_text(text.replace("PAGESHARE=/usr/bin/pageshare", f"PAGESHARE={stub}"))
    script.chmod(0o755)
    p = subprocess.run([str(script), *args], input=xml, text=True, capture_output=True, timeout=30)
    return p.returncode, record.read_text() if record.exists() else ""


def test_the_script_calls_pageshare_only_when_it_matters(tmp_path: Path) -> None:
    marked, plain = domain("on"), domain(None)
    for other in (
        ["prepare", "begin"],
        ["start", "begin"],
        ["stopped", "end"],
        ["release", "end"],
        ["migrate", "end"],
        ["restore", "end"],
    ):
        assert run_script(tmp_path, ["ps-guest", *other, "-"], marked) == (0, "")
    assert run_script(tmp_path, ["ps-guest", "migrate", "begin", "-"], plain) == (0, "")
    for op in ("migrate", "restore"):
        rc, called = run_script(tmp_path, ["ps-guest", op, "begin", "-"], marked)
        assert rc == 3 and called.startswith(f"libvirt-hook ps-guest {op} begin -\n"), called
    assert 'block-refs="on"' in called
    started = hook.rewrite(marked, CFG)
    assert started is not None
    # the live XML of a domain with our monitor, its mark gone: still ours to look at
    unmarked = started.replace('<pageshare:filter block-refs="on" />', "")
    assert "pageshare:filter" not in unmarked
    rc, called = run_script(tmp_path, ["ps-guest", "started", "begin", "-"], unmarked)
    assert rc == 3 and called.startswith("libvirt-hook ps-guest started begin -\n"), called
    # the package removed, the hook (a conffile) left behind
    script = tmp_path / "hook"
    script.write_text(
        (REPO / "analyzer" / "pageshare-libvirt-hook")
        .read_text()
        .replace("PAGESHARE=/usr/bin/pageshare", f"PAGESHARE={tmp_path / 'gone'}")
    )
    p = subprocess.run(
        [str(script), "ps-guest", "migrate", "begin", "-"],
        input=marked,
        text=True,
        capture_output=True,
        timeout=30,
    )
    assert (p.returncode, p.stdout) == (0, "")


def test_main_ignores_other_calls_and_prints_the_xml(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    conf = tmp_path / "none.toml"
    log_dir = tmp_path / "log"
    log_dir.mkdir()
    conf.write_text(f'log_dir = "{log_dir}"\nqmp_dir = "{tmp_path}"\n')
    monkeypatch.setattr("sys.stdin", io.StringIO(domain("on")))
    assert hook.main(["--config", str(conf), "ps-guest", "prepare", "begin", "-"]) == 0
    assert capsys.readouterr().out == ""
    assert hook.main(["--config", str(conf), "ps-guest", "migrate", "begin", "-"]) == 0
    out = capsys.readouterr().out
    sock = f"{tmp_path}/pageshare-{UUID}.qmp"
    assert hook.parse(out).args == [a.replace(SOCK, sock) for a in ours(True)]
    # the start that follows is this migration's: its failure fails it
    marker = tmp_path / f"pageshare-{UUID}.migrating"
    assert marker.exists()
    # a restore: the saved domain's QEMU gets none of our arguments
    monkeypatch.setattr("sys.stdin", io.StringIO(out))
    assert hook.main(["--config", str(conf), "ps-guest", "restore", "begin", "-"]) == 0
    restored = hook.parse(capsys.readouterr().out)
    assert restored.args == [] and restored.marked
    # an unmarked domain migrating in: no marker left behind
    monkeypatch.setattr("sys.stdin", io.StringIO(domain(None)))
    assert hook.main(["--config", str(conf), "ps-guest", "migrate", "begin", "-"]) == 0
    assert capsys.readouterr().out == "" and not marker.exists()
    log = (log_dir / "ps-guest.log").read_text()
    assert "pageshare libvirt-hook: migrating in: its QEMU gets the monitor" in log, log
    assert " and block-refs on" in log
    assert "restoring: pageshare's QEMU arguments removed" in log
    # the live XML without our monitor: nothing to do
    monkeypatch.setattr("sys.stdin", io.StringIO(domain("on")))
    assert hook.main(["--config", str(conf), "ps-guest", "started", "begin", "-"]) == 0
