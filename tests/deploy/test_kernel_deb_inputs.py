"""What makes `make kernel-package` reproducible by its inputs
(packaging/kernel_deb.py), checked without building a kernel: the build's
time comes from the series, the module signing key is kept (or the
operator's), and a failed comparison names the files that differ.

The whole claim, two builds from scratch giving the same bytes, is
`packaging/kernel_deb.py --check-reproducible` (about two hours on 2
cores, so not in `make test`; its last result is in docs/benchmarks.md).
"""

from __future__ import annotations

import email.utils
import subprocess
import time
from pathlib import Path

import kernel_deb
import pytest
from pageshare_tools import ktestlib as ktest


def test_the_build_time_is_the_newest_patch_date_of_the_series() -> None:
    patches = ktest.series_files()
    dates = []
    for p in patches:
        line = next(x for x in p.read_text().splitlines() if x.startswith("Date: "))
        dates.append(email.utils.parsedate_to_datetime(line[6:]).timestamp())
    assert kernel_deb.build_epoch(patches) == int(max(dates))
    # the cover letter is not an input of the build
    assert all(not p.name.startswith("0000-") for p in patches)


def test_a_series_without_dates_is_refused(tmp_path: Path) -> None:
    p = tmp_path / "0001-x.patch"
    p.write_text("From: someone\nSubject: [PATCH] x\n\nbody\nDate: not the header\n")
    with pytest.raises(kernel_deb.KernelDebError, match="Date: header"):
        kernel_deb.build_epoch([p])


def test_the_signing_key_is_made_once_and_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(kernel_deb.SIGNING_KEY_ENV, raising=False)
    key = kernel_deb.signing_key(tmp_path, None)
    assert key == tmp_path / "signing" / "signing_key.pem"
    assert key.stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "signing").stat().st_mode & 0o077 == 0
    fingerprint = kernel_deb.cert_sha256(key)
    again = kernel_deb.signing_key(tmp_path, None)
    assert again == key and kernel_deb.cert_sha256(again) == fingerprint
    # the fingerprint mokutil and openssl show
    shown = subprocess.run(
        ["openssl", "x509", "-in", str(key), "-noout", "-fingerprint", "-sha256"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert shown.split("=", 1)[1].strip().replace(":", "").lower() == fingerprint
    text = subprocess.run(
        ["openssl", "x509", "-in", str(key), "-noout", "-text"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "Code Signing" in text and "CA:FALSE" in text


def test_the_operators_key_is_used_and_a_bad_one_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mine = tmp_path / "mine.pem"
    subprocess.run(
        [
            "openssl", "req", "-new", "-nodes", "-utf8", "-sha256", "-days", "30", "-batch",
            "-x509", "-newkey", "rsa:2048", "-subj", "/CN=operator/",
            "-outform", "PEM", "-out", str(mine), "-keyout", str(mine),
        ],
        check=True,
        capture_output=True,
    )  # fmt: skip
    cache = tmp_path / "cache"
    assert kernel_deb.signing_key(cache, mine) == mine
    monkeypatch.setenv(kernel_deb.SIGNING_KEY_ENV, str(mine))
    assert kernel_deb.signing_key(cache, None) == mine
    assert not (cache / "signing").exists(), "no key is made when the operator gives one"

    cert_only = tmp_path / "cert.pem"
    subprocess.run(["openssl", "x509", "-in", str(mine), "-out", str(cert_only)], check=True)
    for bad in (cert_only, tmp_path / "missing.pem"):
        with pytest.raises(kernel_deb.KernelDebError, match="private key and its certificate"):
            kernel_deb.signing_key(cache, bad)


def test_the_package_key_follows_the_signing_certificate(tmp_path: Path) -> None:
    repo = tmp_path / "linux"
    repo.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    (repo / "Makefile").write_text("all:\n")
    subprocess.run(["git", *ktest.GIT_ID, "add", "-A"], cwd=repo, check=True)
    subprocess.run(["git", *ktest.GIT_ID, "commit", "-qm", "x"], cwd=repo, check=True)
    src = ktest.Source("6.12-test", repo, repo)
    config = tmp_path / "config.xz"
    config.write_bytes(b"CONFIG_KSM=y\n")
    a = kernel_deb.package_key(src, "HEAD", config, "aa" * 32)
    assert kernel_deb.package_key(src, "HEAD", config, "aa" * 32) == a
    assert kernel_deb.package_key(src, "HEAD", config, "bb" * 32) != a


def test_a_comparison_names_the_files_that_differ(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    for root in (a, b):
        (root / "boot").mkdir(parents=True)
        (root / "boot/config").write_text("same\n")
        (root / "lib/modules/x").mkdir(parents=True)
    (a / "boot/vmlinuz").write_bytes(b"\x01" * 100)
    (b / "boot/vmlinuz").write_bytes(b"\x01" * 99 + b"\x02")
    (a / "lib/modules/x/only-a.ko").write_text("")
    assert kernel_deb.differing_files(a, b) == [
        "boot/vmlinuz",
        "lib/modules/x/only-a.ko (only in one)",
    ]
    assert kernel_deb.differing_files(a, a) == []


def test_the_build_environment_dates_the_changelog_with_the_series(tmp_path: Path) -> None:
    """mkdebian's bare `date -R` (the changelog's date) answers the series'
    time; any other `date` is the real one."""
    epoch = 1764345555
    inp = kernel_deb.Inputs(
        src=ktest.Source("x", tmp_path, tmp_path),
        version="6.12.117-1~deb12u1",
        patches=[],
        head="HEAD",
        config=tmp_path / "config.xz",
        signing_key=tmp_path / "key.pem",
        cert_sha256="aa" * 32,
        epoch=epoch,
    )
    env = kernel_deb.build_env(inp, tmp_path)

    def date(*args: str) -> str:
        return subprocess.run(
            ["sh", "-c", 'date "$@"', "date", *args],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()

    changelog_date = date("-R")
    assert email.utils.parsedate_to_datetime(changelog_date).timestamp() == epoch
    assert changelog_date.endswith("+0000"), "the build machine's time zone in the changelog"
    assert abs(int(date("+%s")) - time.time()) < 60
    assert date("-d", "@0", "+%Y") == "1970"
    assert env["SOURCE_DATE_EPOCH"] == str(epoch)
    assert email.utils.parsedate_to_datetime(env["KBUILD_BUILD_TIMESTAMP"]).timestamp() == epoch


def test_two_builds_making_the_key_at_once_sign_with_the_same_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(kernel_deb.SIGNING_KEY_ENV, raising=False)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        keys = list(pool.map(lambda _: kernel_deb.signing_key(tmp_path, None), range(2)))
    assert keys[0] == keys[1]
    assert len({kernel_deb.cert_sha256(k) for k in keys}) == 1
    assert [p.name for p in (tmp_path / "signing").iterdir()] == ["signing_key.pem"]
