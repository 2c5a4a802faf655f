"""A golden image with an encrypted (LUKS) file system.

Pages of an encrypted file system can never be served from the golden
image: guests cache the decrypted bytes, the disk holds ciphertext.  With
the root inside LUKS, libguestfs finds no root at all; the refusal must say
that the image is encrypted (not that it may be damaged, as "no Linux
found" did) and what the operator can do.  A data file system in LUKS next
to a plain root is skipped and the root mapped.  The LUKS header is written
into a plain file by cryptsetup (no device mapper) and put into a partition
of a small raw disk; nothing boots but the libguestfs appliance.
"""

import subprocess
from pathlib import Path

import pytest
from analysis_failures import assert_clean_failure, json_error
from conftest import run_analyze
from image_trees import DEBIAN_TREE
from pageshare.image.image_inspect import inspect_image, probe_format

pytestmark = pytest.mark.vm


def luks_disk(tmp: Path, root_plain: bool) -> Path:
    """GPT: partition 1 (1 MiB, 32 MiB) ext4, partition 2 (33 MiB, 32 MiB) LUKS2.

    root_plain: partition 1 is the root and mounts the LUKS volume's file
    system on /data; otherwise it holds only what a /boot holds and the root
    is (presumably) inside LUKS, as a Debian installer's encrypted layout.
    """
    tree = tmp / "tree"
    files = (
        {
            **DEBIAN_TREE,
            "etc/fstab": "/dev/sda1 / ext4 defaults 0 1\n"
            "/dev/mapper/cryptdata /data ext4 defaults 0 2\n",
            "etc/crypttab": "cryptdata /dev/sda2 none luks\n",
            "data/.keep": "",
        }
        if root_plain
        else {"vmlinuz-6.1.0-56-amd64": "not really a kernel\n", "grub/grub.cfg": ""}
    )
    for rel, content in files.items():
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_text(content)
    disk = tmp / "luks.raw"
    with open(disk, "wb") as f:
        f.truncate(80 << 20)
    subprocess.run(
        ["sfdisk", "-q", "--no-reread", "-X", "gpt", str(disk)],
        text=True,
        input="start=2048, size=65536\nstart=67584, size=65536\n",
        check=True,
    )
    plain, crypt = tmp / "plain.ext4", tmp / "crypt.img"
    for part in (plain, crypt):
        with open(part, "wb") as out:
            out.truncate(32 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-b", "4096", "-d", str(tree), str(plain)], check=True)
    (tmp / "key").write_bytes(b"golden")
    subprocess.run(
        [
            "cryptsetup",
            "luksFormat",
            "-q",
            "--type",
            "luks2",
            "--pbkdf",
            "pbkdf2",
            "--pbkdf-force-iterations",
            "1000",
            "--key-file",
            str(tmp / "key"),
            str(crypt),
        ],
        check=True,
        capture_output=True,
    )
    for src, at in ((plain, 2048), (crypt, 67584)):
        subprocess.run(
            [
                "dd",
                f"if={src}",
                f"of={disk}",
                "bs=512",
                f"seek={at}",
                "conv=notrunc,sparse",
                "status=none",
            ],
            check=True,
        )
        src.unlink()
    return disk


@pytest.mark.usefixtures("host_guard")
def test_root_inside_luks_is_refused_saying_it_is_encrypted(tmp_path: Path) -> None:
    img = luks_disk(tmp_path, root_plain=False)
    r = run_analyze(tmp_path, str(img))
    assert_clean_failure(
        r,
        "luks.raw: no Linux root file system found outside encrypted "
        "volumes: /dev/sda2 is encrypted (LUKS), and the root is "
        "presumably inside; analyze-image cannot map an encrypted file "
        "system",
    )
    assert "damaged" not in r.stderr and "complete" not in r.stderr
    assert "booting guests" not in r.stderr
    error = json_error(
        run_analyze(tmp_path, "--json", str(img)), "user-error", "/dev/sda2 is encrypted (LUKS)"
    )
    hint = str(error["hint"])
    assert "decrypted bytes, which equal no block of the encrypted disk" in hint
    assert "analyze a golden image whose root file system is not encrypted" in hint


@pytest.mark.usefixtures("host_guard")
def test_a_luks_data_volume_is_skipped_and_the_plain_root_mapped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PAGESHARE_CACHE", str(tmp_path / "cache"))
    img = luks_disk(tmp_path, root_plain=True)
    fmt, vsize = probe_format(img)
    info = inspect_image(img, fmt, vsize).info
    assert [(f.mountpoint, f.start_sector) for f in info.filesystems] == [("/", 2048)]
    assert [(s.mountpoint, s.device) for s in info.skipped] == [("/data", "/dev/mapper/cryptdata")]
    assert "an encrypted volume" in info.skipped[0].reason
