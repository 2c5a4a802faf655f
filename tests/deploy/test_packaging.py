"""packaging/debs.py without building anything real: the cache key follows
every input, and the checks of a built .deb refuse what they should (a unit
whose ExecStart the package does not install, a missing file, a missing
conffile).  The real build and install: tests/deploy/test_server_package_guest.py."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import debs
import pytest

pytestmark = pytest.mark.build

REPO = Path(__file__).resolve().parents[2]


def copy_inputs(dest: Path) -> Path:
    """The files the pageshare-server package is built from, in a fake checkout."""
    for rel in debs.PACKAGES["pageshare-server"].sources:
        src, dst = REPO / rel, dest / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, dst)
        else:
            shutil.copy2(src, dst)
    return dest


def test_key_follows_every_input(tmp_path: Path) -> None:
    pkg = debs.PACKAGES["pageshare-server"]
    src = copy_inputs(tmp_path / "src")
    key, inputs = debs.inputs_key(pkg, src)
    assert debs.inputs_key(pkg, src)[0] == key  # stable
    assert "page-server/src/main.rs" in inputs["files"]
    assert "packaging/pageshare-server/debian/rules" in inputs["files"]
    assert "cargo" in inputs["tools"] and "lintian" in inputs["tools"]
    seen = {key}
    for rel in [
        "page-server/src/main.rs",
        "page-server/pageshare-server.service",
        "page-server/server.example.toml",
        "packaging/pageshare-server/debian/control",
    ]:
        f = src / rel
        f.write_text(f.read_text() + "\n")
        k = debs.inputs_key(pkg, src)[0]
        assert k not in seen, f"changing {rel} kept the key"
        seen.add(k)
    (src / "packaging/pageshare-server/debian/rules").chmod(0o644)  # mode counts too
    assert debs.inputs_key(pkg, src)[0] not in seen
    shutil.rmtree(src / "page-server/src")
    with pytest.raises(debs.BuildError, match="missing"):
        debs.inputs_key(pkg, src)


def test_changelog_and_cargo_versions_are_read() -> None:
    v = debs.changelog_version(REPO / "packaging/pageshare-server/debian")
    assert v == debs.cargo_version(REPO / "page-server/Cargo.toml")


def fake_deb(tmp: Path, files: dict[str, str], conffiles: list[str]) -> Path:
    root = tmp / "root"
    for rel, text in files.items():
        f = root / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
    (root / "DEBIAN").mkdir(parents=True)
    (root / "DEBIAN" / "control").write_text(
        "Package: pageshare-server\nVersion: 0.1.0\nArchitecture: amd64\n"
        "Maintainer: t <t@pageshare.invalid>\nDescription: test\n"
    )
    if conffiles:
        (root / "DEBIAN" / "conffiles").write_text("".join(f"{c}\n" for c in conffiles))
    deb = tmp / "p.deb"
    subprocess.run(
        ["dpkg-deb", "--root-owner-group", "-b", str(root), str(deb)],
        check=True,
        capture_output=True,
    )
    shutil.rmtree(root)
    return deb


def good_files() -> dict[str, str]:
    pkg = debs.PACKAGES["pageshare-server"]
    files = {p: "x\n" for p in pkg.must_contain}
    files["lib/systemd/system/pageshare-server.service"] = (
        REPO / "page-server/pageshare-server.service"
    ).read_text()
    return files


def test_check_deb_accepts_a_complete_package(tmp_path: Path) -> None:
    pkg = debs.PACKAGES["pageshare-server"]
    debs.check_deb(pkg, fake_deb(tmp_path, good_files(), list(pkg.conffiles)))


def test_check_deb_refuses_what_it_should(tmp_path: Path) -> None:
    pkg = debs.PACKAGES["pageshare-server"]
    files = good_files()
    unit = files["lib/systemd/system/pageshare-server.service"]
    cases = {
        "runs /usr/local/bin/pageshare-server": (
            {
                **files,
                "lib/systemd/system/pageshare-server.service": unit.replace(
                    "ExecReload=/usr/bin/", "ExecReload=/usr/local/bin/"
                ),
            },
            list(pkg.conffiles),
        ),
        "lacks usr/bin/pageshare-server": (
            {k: v for k, v in files.items() if k != "usr/bin/pageshare-server"},
            list(pkg.conffiles),
        ),
        "conffiles are": (files, []),
    }
    for i, (what, (f, conf)) in enumerate(cases.items()):
        d = tmp_path / str(i)
        d.mkdir()
        with pytest.raises(debs.BuildError, match=what):
            debs.check_deb(pkg, fake_deb(d, f, conf))


def test_unknown_package_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        debs.main(["no-such-package"])
    assert e.value.code == 2
    assert "unknown package(s) no-such-package" in capsys.readouterr().err
    assert debs.main(["--list"]) == 0
    assert capsys.readouterr().out.split() == list(debs.PACKAGES)


def test_host_package_key_follows_only_the_host_tools(tmp_path: Path) -> None:
    """pageshare-host is built from the host tools' modules alone: an
    analyzer module's change does not rebuild it, a host module's does."""
    pkg = debs.PACKAGES["pageshare-host"]
    src = tmp_path / "src"
    for rel in [*pkg.sources, "analyzer/pageshare/analysis/analyze.py"]:
        s, d = REPO / rel, src / rel
        d.parent.mkdir(parents=True, exist_ok=True)
        if s.is_dir():
            shutil.copytree(s, d)
        else:
            shutil.copy2(s, d)
    key, inputs = debs.inputs_key(pkg, src)
    assert sorted(f for f in inputs["files"] if f.startswith("analyzer/pageshare/")) == sorted(
        f"analyzer/pageshare/{m}" for m in debs.HOST_MODULES
    )
    (src / "analyzer/pageshare/analysis/analyze.py").write_text("# changed\n")
    assert debs.inputs_key(pkg, src)[0] == key
    (src / "analyzer/pageshare/host/attach.py").write_text("# changed\n")
    assert debs.inputs_key(pkg, src)[0] != key


def test_python_packages_carry_the_python_version() -> None:
    init = REPO / "analyzer/pageshare/__init__.py"
    for name in ("pageshare", "pageshare-host"):
        assert debs.PACKAGES[name].python_init == "analyzer/pageshare/__init__.py"
        assert debs.changelog_version(REPO / f"packaging/{name}/debian") == debs.python_version(
            init
        )


def test_check_deb_keeps_the_analyzer_and_the_host_tools_apart(tmp_path: Path) -> None:
    host, analyzer = debs.PACKAGES["pageshare-host"], debs.PACKAGES["pageshare"]
    host_files = {p: "x\n" for p in host.must_contain}
    host_files["lib/systemd/system/pageshare-libvirt-watch.service"] = (
        REPO / "analyzer/pageshare-libvirt-watch.service"
    ).read_text()
    (tmp_path / "ok").mkdir()
    debs.check_deb(host, fake_deb(tmp_path / "ok", host_files, list(host.conffiles)))
    for i, extra in enumerate(
        [
            "usr/lib/pageshare/python/pageshare/analysis/analyze.py",
            "usr/lib/pageshare/python3.11/drgn/__init__.py",
            "usr/bin/analyze-image",
        ]
    ):
        d = tmp_path / f"h{i}"
        d.mkdir()
        with pytest.raises(debs.BuildError, match="holds what it must not: .*" + re.escape(extra)):
            debs.check_deb(host, fake_deb(d, {**host_files, extra: "x\n"}, list(host.conffiles)))
    ana_files = {p: "x\n" for p in analyzer.must_contain}
    (tmp_path / "a").mkdir()
    debs.check_deb(analyzer, fake_deb(tmp_path / "a", ana_files, []))
    for i, extra in enumerate(
        [
            "usr/bin/pageshare",
            "usr/lib/pageshare/python/pageshare/cli.py",
            "etc/pageshare/libvirt.toml",
        ]
    ):
        d = tmp_path / f"a{i}"
        d.mkdir()
        with pytest.raises(debs.BuildError, match="holds what it must not: .*" + re.escape(extra)):
            debs.check_deb(analyzer, fake_deb(d, {**ana_files, extra: "x\n"}, []))
