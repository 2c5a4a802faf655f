"""Bad input and hostile host conditions: one clear message, non-zero exit, nothing left.

Each case runs the real CLI.  The host_guard fixture checks that KSM settings
are unchanged and no QEMU is left; each test checks the work directory is empty.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, cast

import pytest
from analysis_failures import assert_clean_failure, json_error
from conftest import REPO, run_analyze
from image_trees import mkfs_image
from pageshare.analysis.analyze import _wait_ready
from pageshare.analysis.debugsyms import find_vmlinux
from pageshare.analysis.vm import Guest
from pageshare.analysis.workload import Markers
from pageshare.errors import UserError
from pageshare.image.image_inspect import probe_format
from pageshare.progress import Progress


@pytest.mark.usefixtures("host_guard")
def test_missing_file(tmp_path: Path) -> None:
    assert_clean_failure(run_analyze(tmp_path, str(tmp_path / "nope.qcow2")), "no such file")


@pytest.mark.usefixtures("host_guard")
def test_not_an_image(tmp_path: Path) -> None:
    f = tmp_path / "notes.txt"
    f.write_text("this is not a disk image\n" * 200)
    r = run_analyze(tmp_path, str(f))
    assert_clean_failure(r, "not a disk image")
    # The refusal says what analyze-image takes.
    assert (
        "raw disk image that starts with a partition table (MBR or GPT) or holds an ext2, "
        "ext3, ext4, XFS or btrfs file system on the whole disk" in " ".join(r.stderr.split())
    )


def test_an_image_format_analyze_image_does_not_take_is_named(tmp_path: Path) -> None:
    """A VMDK is a disk image, not "not a disk image": its format is named, and
    the conversion the hint gives makes an image the probe takes."""
    vmdk = tmp_path / "golden.vmdk"
    subprocess.run(["qemu-img", "create", "-q", "-f", "vmdk", str(vmdk), "64M"], check=True)
    with pytest.raises(UserError, match="image format vmdk is not supported") as e:
        probe_format(vmdk)
    convert = f"qemu-img convert -O qcow2 {vmdk} IMAGE.qcow2"
    assert convert in e.value.hint
    subprocess.run(convert.split(), check=True, cwd=tmp_path)
    assert probe_format(tmp_path / "IMAGE.qcow2") == ("qcow2", 64 << 20)


def cut(src: Path, dest: Path, size: int) -> Path:
    with open(src, "rb") as f:
        dest.write_bytes(f.read(size))
    return dest


@pytest.mark.usefixtures("host_guard")
def test_truncated_qcow2(tmp_path: Path, small_image: Path) -> None:
    f = cut(small_image, tmp_path / "cut.qcow2", 1 << 20)
    r = run_analyze(tmp_path, str(f))
    assert_clean_failure(r, "cut.qcow2: the image file is damaged: truncated")
    assert "no Linux installation" not in r.stderr


@pytest.mark.usefixtures("host_guard")
def test_qcow2_truncated_in_its_data_area(tmp_path: Path, small_image: Path) -> None:
    # Header and tables complete, data clusters past 200 MiB missing: libguestfs
    # used to call this "no Linux installation found".
    f = cut(small_image, tmp_path / "cut200.qcow2", 200 << 20)
    r = run_analyze(tmp_path, str(f))
    assert_clean_failure(r, "the image file is damaged: truncated; qemu-img check:")
    assert "errors were found on the image" in r.stderr
    assert "exceeding the end of the file" in r.stderr  # qemu-img check's key line
    assert "download the golden image again" in r.stderr
    assert "no Linux installation" not in r.stderr
    error = json_error(run_analyze(tmp_path, "--json", str(f)), "image-damaged", "truncated")
    assert "qemu-img check" in str(error["hint"])


@pytest.mark.usefixtures("host_guard")
def test_truncated_raw(tmp_path: Path, small_image: Path) -> None:
    raw = tmp_path / "full.raw"
    subprocess.run(["qemu-img", "convert", "-O", "raw", str(small_image), str(raw)], check=True)
    os.truncate(raw, 200 << 20)
    r = run_analyze(tmp_path, str(raw))
    assert_clean_failure(r, "the image file is damaged: truncated")
    assert f"the file has only {200 << 20} bytes" in r.stderr


@pytest.mark.usefixtures("host_guard")
def test_json_errors(tmp_path: Path, small_image: Path) -> None:
    json_error(
        run_analyze(tmp_path, "--json", str(tmp_path / "nope.qcow2")), "user-error", "no such file"
    )
    f = tmp_path / "notes.txt"
    f.write_text("this is not a disk image\n" * 200)
    json_error(run_analyze(tmp_path, "--json", str(f)), "user-error", "not a disk image")
    trunc = cut(small_image, tmp_path / "cut.qcow2", 1 << 20)
    json_error(run_analyze(tmp_path, "--json", str(trunc)), "image-damaged", "damaged")
    # A command line that does not parse: usage on stderr as before, the object on stdout.
    r = run_analyze(tmp_path, "--json", "--runs", "many", str(small_image))
    json_error(r, "usage", "--runs")
    assert "usage:" in r.stderr


@pytest.mark.usefixtures("host_guard")
def test_image_with_backing_file(tmp_path: Path, small_image: Path) -> None:
    f = tmp_path / "overlay.qcow2"
    subprocess.run(
        ["qemu-img", "create", "-q", "-f", "qcow2", "-b", str(small_image), "-F", "qcow2", str(f)],
        check=True,
    )
    assert_clean_failure(run_analyze(tmp_path, str(f)), "backing file")


@pytest.mark.usefixtures("host_guard")
def test_image_whose_backing_file_is_missing(tmp_path: Path) -> None:
    """`qemu-img convert` cannot help an overlay without its base: say that."""
    base = tmp_path / "base.qcow2"
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(base), "64M"], check=True)
    f = tmp_path / "overlay.qcow2"
    subprocess.run(
        ["qemu-img", "create", "-q", "-f", "qcow2", "-b", str(base), "-F", "qcow2", str(f)],
        check=True,
    )
    base.unlink()
    r = run_analyze(tmp_path, str(f))
    assert_clean_failure(r, f"has a backing file, {base}, and it is missing")
    assert "analyze the base image itself" in r.stderr
    error = json_error(run_analyze(tmp_path, "--json", str(f)), "user-error", "missing")
    assert str(base) in str(error["hint"])


def qcow2(path: Path, backing: str = "", fmt: str = "qcow2", unsafe: bool = False) -> Path:
    """A 64 MiB qcow2 (an overlay of BACKING, named as given, if any)."""
    subprocess.run(
        [
            "qemu-img",
            "create",
            "-q",
            "-f",
            "qcow2",
            *(["-u"] if unsafe else []),
            *(["-b", backing, "-F", fmt] if backing else []),
            str(path),
            "64M",
        ],
        check=True,
    )
    return path


@pytest.mark.usefixtures("host_guard")
def test_an_overlay_given_by_a_relative_path_finds_its_base(tmp_path: Path) -> None:
    """qemu-img gives a relative backing file already joined to the overlay's
    directory: a base that is there is not called missing."""
    (tmp_path / "images").mkdir()
    qcow2(tmp_path / "images/base.qcow2")
    qcow2(tmp_path / "images/overlay.qcow2", "base.qcow2")
    r = run_analyze(tmp_path, "images/overlay.qcow2")  # run in tmp_path
    assert_clean_failure(r, "images/overlay.qcow2: has a backing file (base.qcow2)")
    assert "missing" not in r.stderr
    assert "qemu-img convert -O qcow2 images/overlay.qcow2 STANDALONE.qcow2" in " ".join(
        r.stderr.split()
    )


def test_a_missing_file_further_down_the_backing_chain_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """base <- mid <- top, base gone: `qemu-img convert` of top cannot work, so
    the error names the missing file as mid records it, and what the hint
    says to do makes an image the probe takes."""
    monkeypatch.chdir(tmp_path)
    qcow2(tmp_path / "base.qcow2")
    qcow2(tmp_path / "mid.qcow2", "base.qcow2")
    top = qcow2(tmp_path / "top.qcow2", "mid.qcow2")
    (tmp_path / "base.qcow2").rename(tmp_path / "moved.qcow2")
    with pytest.raises(UserError) as e:
        probe_format(top)
    mid, base = tmp_path / "mid.qcow2", tmp_path / "base.qcow2"
    assert e.value.message == (
        f"{top}: has a backing file, mid.qcow2, whose backing chain "
        f"is broken: {mid} has a backing file, base.qcow2, and it is "
        f"missing (looked for {base})"
    )
    assert f"put base.qcow2 back at {base}" in e.value.hint
    rebase = f"qemu-img rebase -u -F qcow2 -b NEW_PATH {mid}"
    assert rebase in e.value.hint
    # Do as the hint says: point mid at the moved base, then convert.
    subprocess.run(rebase.replace("NEW_PATH", str(tmp_path / "moved.qcow2")).split(), check=True)
    convert = f"qemu-img convert -O qcow2 {top} STANDALONE.qcow2"
    assert convert in e.value.hint
    subprocess.run(convert.split(), check=True)
    assert probe_format(tmp_path / "STANDALONE.qcow2") == ("qcow2", 64 << 20)


def test_a_backing_file_qemu_img_cannot_read(tmp_path: Path) -> None:
    (tmp_path / "base.qcow2").write_text("not an image\n")
    f = qcow2(tmp_path / "overlay.qcow2", str(tmp_path / "base.qcow2"), unsafe=True)
    with pytest.raises(
        UserError,
        match=r"has a backing file, .*base.qcow2, and qemu-img cannot "
        r"read it \(.*base.qcow2\): .*not in qcow2 format",
    ) as e:
        probe_format(f)
    assert f"make {tmp_path / 'base.qcow2'} readable and complete" in e.value.hint


def test_a_backing_chain_that_loops(tmp_path: Path) -> None:
    a = qcow2(tmp_path / "a.qcow2", "b.qcow2", unsafe=True)
    qcow2(tmp_path / "b.qcow2", "a.qcow2", unsafe=True)
    with pytest.raises(
        UserError,
        match=f"{tmp_path / 'b.qcow2'} has a backing file, a.qcow2, "
        f"and the backing chain loops back to {a}",
    ):
        probe_format(a)


def test_a_backing_file_that_is_no_local_file_is_not_called_missing(tmp_path: Path) -> None:
    """nbd://, json:{...}: qemu reaches those itself; nothing to look for here."""
    for name in ("nbd://127.0.0.1:10809/golden", 'json:{"driver":"file","filename":"/x"}'):
        f = qcow2(tmp_path / "overlay.qcow2", name, fmt="raw", unsafe=True)
        with pytest.raises(UserError, match="has a backing file") as e:
            probe_format(f)
        assert e.value.message == f"{f}: has a backing file ({name})"
        assert f"qemu-img convert -O qcow2 {f} STANDALONE.qcow2" in e.value.hint
        f.unlink()


@pytest.mark.parametrize(
    "mkfs", [["mkfs.xfs", "-q", "-f"], ["mkfs.btrfs", "-q", "-f"]], ids=["xfs", "btrfs"]
)
def test_a_raw_whole_disk_xfs_or_btrfs_is_a_disk_image(tmp_path: Path, mkfs: list[str]) -> None:
    """A file system on the whole raw disk, no partition table: the probe takes
    it as the same bytes in qcow2 are taken, and a cut copy is called damaged."""
    disk = tmp_path / "disk.raw"
    size = 320 << 20
    disk.touch()
    os.truncate(disk, size)
    subprocess.run([*mkfs, str(disk)], check=True, capture_output=True)
    assert probe_format(disk) == ("raw", size)
    os.truncate(disk, size // 2)
    with pytest.raises(
        UserError,
        match=f"damaged: truncated; .* reaches byte {size}, but "
        f"the file has only {size // 2} bytes",
    ):
        probe_format(disk)


@pytest.mark.vm
@pytest.mark.usefixtures("host_guard")
def test_no_linux_inside(tmp_path: Path) -> None:
    img = mkfs_image(tmp_path, "ext4", {"data/readme.txt": "just data\n"})
    assert_clean_failure(run_analyze(tmp_path, str(img)), "no Linux installation found")


@pytest.mark.vm
@pytest.mark.usefixtures("host_guard")
def test_unsupported_root_filesystem(tmp_path: Path) -> None:
    # A Debian-looking root on squashfs (as live and appliance images have):
    # inspected as Linux, but its files are compressed into blocks no disk
    # sector serves, so no block map leads from a page to the disk.
    tree = {
        "etc/os-release": 'ID=debian\nVERSION_ID="12"\nNAME="Debian GNU/Linux"\n',
        "etc/debian_version": "12.0\n",
        "etc/fstab": "/dev/sda1 / squashfs ro 0 0\n",
        "bin/sh": "",
        "usr/bin/env": "",
        "etc/hostname": "x\n",
    }
    img = mkfs_image(tmp_path, "squashfs", tree)
    r = run_analyze(tmp_path, str(img))
    assert_clean_failure(r, "only ext2/3/4, XFS and btrfs are supported")
    assert "squashfs cannot be mapped" in r.stderr


@pytest.mark.usefixtures("host_guard")
def test_not_root(tmp_path: Path, small_image: Path) -> None:
    os.chmod(tmp_path, 0o777)
    r = run_analyze(tmp_path, str(small_image), user="65534")
    assert_clean_failure(r, "must run as root")


@pytest.mark.usefixtures("host_guard")
def test_no_ksm(tmp_path: Path, small_image: Path) -> None:
    r = run_analyze(tmp_path, str(small_image), env={"PAGESHARE_KSM_SYSFS": "/nonexistent"})
    assert_clean_failure(r, "host KSM is not available")


@pytest.mark.usefixtures("host_guard")
def test_vmlinux_without_debug_info(tmp_path: Path, small_image: Path) -> None:
    stripped = next(Path("/boot").glob("vmlinuz-*"))
    r = run_analyze(tmp_path, "--vmlinux", str(stripped), str(small_image))
    assert_clean_failure(r, "no DWARF debug info")


def test_no_debug_symbols_in_the_archive() -> None:
    # A real lookup in Debian's archive for a kernel that never existed.
    with pytest.raises(UserError, match="no debug symbols") as e:
        find_vmlinux("6.1.0-999-nonexistent-amd64", None)
    assert "--vmlinux" in e.value.hint


@pytest.mark.vm
@pytest.mark.usefixtures("host_guard")
def test_guest_whose_boot_fails_stops_the_analysis_at_once(
    tmp_path: Path, small_image: Path
) -> None:
    # The image's init is gone, and /bin/sh, the initramfs' last resort:
    # it finds no init and, with the guests' panic=-1, reboots at once.
    broken = tmp_path / "broken.qcow2"
    raw = tmp_path / "broken.raw"
    subprocess.run(["qemu-img", "convert", "-O", "raw", str(small_image), str(raw)], check=True)
    for f in ("/usr/lib/systemd/systemd", "/usr/bin/sh"):
        subprocess.run(
            ["debugfs", "-w", "-R", f"rm {f}", str(raw)], check=True, capture_output=True
        )
    subprocess.run(["qemu-img", "convert", "-O", "qcow2", str(raw), str(broken)], check=True)
    raw.unlink()
    # QEMU exits (-no-reboot) and the analysis stops there, showing why,
    # not after the boot timeout (which it was before: 15 minutes by default)
    r = run_analyze(tmp_path, "--boot-timeout", "600", str(broken))
    assert r.rc == 2, r.stderr
    assert "stopped during the analysis" in r.stderr, r.stderr
    assert "last serial lines" in r.stderr and "No init found" in r.stderr, r.stderr
    assert list(r.workdir.iterdir()) == []


class SilentGuest:
    """A guest whose serial never shows the boot marker."""

    name = "a"

    def check_alive(self) -> None:
        pass

    def serial_text(self) -> str:
        return "Loading, please wait...\nBegin: Running /scripts/local-block ... done.\n"


def test_a_guest_that_never_boots_is_given_up_after_the_boot_timeout() -> None:
    with pytest.raises(UserError) as e:
        _wait_ready([cast(Guest, SilentGuest())], Markers.new(), 0.5, 60, Progress(quiet=True))
    assert "guest a: the guest did not finish booting within 0s" in str(e.value)
    assert "last serial lines:\n    Loading, please wait..." in str(e.value)
    assert "raise --boot-timeout" in e.value.hint


def _default_sigint() -> None:
    """Ctrl-C's default action in the analysis, whatever this test inherited:
    a non-interactive shell starts its background jobs with SIGINT ignored
    (POSIX), so `make test &` would pass the analysis an ignored SIGINT,
    and Python installs no KeyboardInterrupt then."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.vm
@pytest.mark.usefixtures("host_guard")
def test_ctrl_c_during_ksm_phase(tmp_path: Path, small_image: Path) -> None:
    workdir = tmp_path / "work"
    workdir.mkdir()
    env = dict(os.environ, PAGESHARE_WORKDIR=str(workdir), PYTHONPATH=str(REPO / "analyzer"))
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pageshare.cli",
            "analyze",
            "--settle",
            "600",
            "--lists-dir",
            str(tmp_path),
            "--db",
            str(tmp_path / "r.sqlite"),
            str(small_image),
        ],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
        preexec_fn=_default_sigint,
    )
    assert p.stderr is not None
    seen = []
    deadline = time.monotonic() + 900
    try:
        for line in p.stderr:
            seen.append(line)
            if "host KSM merging" in line:
                break
            assert time.monotonic() < deadline, "".join(seen)
        time.sleep(3)
        ksm_run = Path("/sys/kernel/mm/ksm/run").read_text().strip()
        assert ksm_run == "1", (
            f"KSM should be running during the analysis (run = {ksm_run})\n" + "".join(seen)
        )
        p.send_signal(signal.SIGINT)
        rest = p.stderr.read()
        assert p.wait(timeout=120) == 130, "".join(seen) + rest
        assert "interrupted" in rest
        assert list(workdir.iterdir()) == []
        assert shutil.which("qemu-img")
    finally:
        # A failed check must not leave the analysis running (its guests and
        # host KSM merging) under the tests that follow: interrupt it, so
        # that it restores host KSM, and kill what is left.
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
            try:
                p.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


@pytest.mark.usefixtures("host_guard")
def test_not_enough_space_for_dumps(tmp_path: Path, small_image: Path) -> None:
    # A real, tiny file system as the work directory (tmpfs needs no loop device).
    small = tmp_path / "tiny"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(small)], check=True)
    try:
        r = run_analyze(tmp_path, str(small_image), env={"PAGESHARE_WORKDIR": str(small)})
        assert r.rc == 2 and "not enough space" in r.stderr and "PAGESHARE_WORKDIR" in r.stderr
        assert list(small.iterdir()) == []
    finally:
        subprocess.run(["umount", str(small)], check=True)


@pytest.mark.vm
@pytest.mark.usefixtures("host_guard")
def test_crash_forced_on_a_kernel_it_cannot_read(tmp_path: Path) -> None:
    from pageshare import golden

    trixie = golden.build_image("trixie").path
    r = run_analyze(tmp_path, "--introspector", "crash", str(trixie))
    assert_clean_failure(r, "--introspector crash")
    assert "--introspector auto" in r.stderr


@pytest.mark.parametrize(
    "raised, kind, rc",
    [(RuntimeError("boom"), "internal", 1), (KeyboardInterrupt(), "interrupted", 130)],
)
def test_json_error_when_not_the_operators_fault(
    raised: BaseException,
    kind: str,
    rc: int,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from pageshare import cli
    from pageshare.analysis import analyze

    def fail(*_: Any) -> None:
        raise raised

    monkeypatch.setattr(analyze, "analyze", fail)
    monkeypatch.delenv("PAGESHARE_DEBUG", raising=False)
    assert cli.run_analyze(["--json", "x.qcow2"]) == rc
    out = capsys.readouterr()
    data = json.loads(out.out)
    assert data["ok"] is False and data["exit_code"] == rc
    assert data["error"]["kind"] == kind
    assert "Traceback" not in out.err
