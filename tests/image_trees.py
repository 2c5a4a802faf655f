"""Small file-system images made from a dict of files (path -> text), and a
Debian-looking root tree to make them from: what the inspection needs to
take a file system for a Debian 12 root (os-release, fstab, a kernel file
that is not really one).  Nothing here boots.  mkfs_image is used by
test_bad_input.py and test_inspect_cache.py, DEBIAN_TREE by
test_unaligned_partition.py, test_encrypted_image.py, test_md_raid.py and
test_btrfsmap.py.
"""

import subprocess
from pathlib import Path

DEBIAN_TREE = {
    "etc/os-release": 'ID=debian\nVERSION_ID="12"\nNAME="Debian GNU/Linux"\n',
    "etc/debian_version": "12.0\n",
    "etc/fstab": "/dev/sda1 / ext4 defaults 0 1\n",
    "bin/sh": "",
    "usr/bin/env": "",
    "etc/hostname": "x\n",
    "boot/vmlinuz-6.1.0-56-amd64": "not really a kernel\n",
}


def mkfs_image(tmp: Path, fstype: str, tree: dict[str, str]) -> Path:
    root = tmp / "tree"
    for rel, content in tree.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(content)
    img = tmp / f"{fstype}.raw"
    if fstype == "squashfs":
        # On partition 1 of an MBR disk, at sector 2048.
        fs = tmp / "fs.squashfs"
        subprocess.run(["mksquashfs", str(root), str(fs), "-quiet", "-noappend"], check=True)
        subprocess.run(["truncate", "-s", "64M", str(img)], check=True)
        subprocess.run(
            ["sfdisk", "-q", str(img)],
            input="label: dos\nstart=2048, type=83\n",
            text=True,
            check=True,
        )
        subprocess.run(
            ["dd", f"if={fs}", f"of={img}", "bs=512", "seek=2048", "conv=notrunc", "status=none"],
            check=True,
        )
        return img
    subprocess.run(["truncate", "-s", "64M", str(img)], check=True)
    subprocess.run([f"mkfs.{fstype}", "-q", "-F", "-d", str(root), str(img)], check=True)
    return img
