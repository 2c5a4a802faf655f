"""An old MBR layout: a partition at sector 63, so no file system block of it
is 4 KiB-aligned on the virtual disk.

Before, such an image went through the whole analysis (boots, KSM, dumps)
and every file page came out "unaligned": an empty list and no word why.
Now the inspection refuses a root there, saying what and how to realign;
another file system there is skipped with the reason and the rest is
mapped.  The images are built here with sfdisk and mke2fs and never boot.
"""

import subprocess
from pathlib import Path

import pytest
from analysis_failures import assert_clean_failure, json_error
from conftest import run_analyze
from image_trees import DEBIAN_TREE
from pageshare.image.image_inspect import inspect_image, probe_format

pytestmark = pytest.mark.vm


def mbr_image(tmp: Path, start_sector: int, srv_sector: int = 0) -> Path:
    """A raw disk with one MBR partition at start_sector holding a Debian-looking ext4
    root, and with srv_sector a second one there, mounted on /srv by the root's fstab."""
    tree = tmp / "tree"
    files = dict(DEBIAN_TREE)
    if srv_sector:
        files["etc/fstab"] += "/dev/sda2 /srv ext4 defaults 0 2\n"
        files["srv/.keep"] = ""
    for rel, content in files.items():
        p = tree / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(content)
    fs = tmp / "root.ext4"
    subprocess.run(["truncate", "-s", "24M", str(fs)], check=True)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-b", "4096", "-d", str(tree), str(fs)], check=True)
    disk = tmp / f"mbr{start_sector}.raw"
    subprocess.run(["truncate", "-s", "64M", str(disk)], check=True)
    table = f"start={start_sector}, size={24 << 11}, type=83\n"
    if srv_sector:
        table += f"start={srv_sector}, size={24 << 11}, type=83\n"
    subprocess.run(["sfdisk", "-q", "--no-reread", str(disk)], input=table, text=True, check=True)
    for at in (start_sector, srv_sector):
        if at:
            subprocess.run(
                [
                    "dd",
                    f"if={fs}",
                    f"of={disk}",
                    "bs=512",
                    f"seek={at}",
                    "conv=notrunc,sparse",
                    "status=none",
                ],
                check=True,
            )
            # The second copy needs a UUID of its own, as a real /srv would have.
            subprocess.run(["mkfs.ext4", "-q", "-F", "-b", "4096", str(fs)], check=True)
    fs.unlink()
    return disk


@pytest.mark.usefixtures("host_guard")
def test_root_partition_at_sector_63_is_refused_with_how_to_realign(tmp_path: Path) -> None:
    img = mbr_image(tmp_path, 63)
    r = run_analyze(tmp_path, str(img))
    assert_clean_failure(
        r,
        "mbr63.raw: root file system /dev/sda1 cannot be analyzed: the "
        "partition starts at sector 63, which is not a multiple of 8",
    )
    assert "4 KiB-aligned" in r.stderr
    assert "virt-resize --align-first always" in r.stderr
    # The refusal comes from the inspection, before any guest boots.
    assert "booting guests" not in r.stderr
    error = json_error(
        run_analyze(tmp_path, "--json", str(img)), "user-error", "which is not a multiple of 8"
    )
    assert "realign /dev/sda1" in str(error["hint"])


@pytest.mark.usefixtures("host_guard")
def test_the_same_root_at_sector_2048_is_inspected(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The control: only the alignment differs, and the inspection gets past the
    # file systems to the kernel (this fake one is found; booting it would fail).
    monkeypatch.setenv("PAGESHARE_CACHE", str(tmp_path / "cache"))
    img = mbr_image(tmp_path, 2048)
    fmt, vsize = probe_format(img)
    info = inspect_image(img, fmt, vsize).info
    assert (info.root_start_sector, info.kernel_version) == (2048, "6.1.0-56-amd64")
    assert [f.mountpoint for f in info.filesystems] == ["/"] and info.skipped == ()


@pytest.mark.usefixtures("host_guard")
def test_other_file_system_at_an_odd_sector_is_skipped_with_the_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Only /srv is unaligned: the root is analysed, /srv is skipped and says why.
    monkeypatch.setenv("PAGESHARE_CACHE", str(tmp_path / "cache"))
    img = mbr_image(tmp_path, 2048, srv_sector=51263)
    fmt, vsize = probe_format(img)
    info = inspect_image(img, fmt, vsize).info
    assert [(f.mountpoint, f.start_sector) for f in info.filesystems] == [("/", 2048)]
    assert [(s.mountpoint, s.device) for s in info.skipped] == [("/srv", "/dev/sda2")]
    assert "starts at sector 51263, which is not a multiple of 8" in info.skipped[0].reason
