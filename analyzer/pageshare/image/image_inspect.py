"""What is inside a golden image: OS, root filesystem geometry, guest kernel.

libguestfs does the inspection (it knows partition tables, LVM, fstab and
distributions far better than anything we would write); the answer is cached
by the image file's content (see _content_key), since the appliance boot
takes tens of seconds under TCG.  Before that, a damaged file (a truncated
qcow2 or raw disk) is refused as damaged, not as "no Linux found".
The analyzer supports what it can map back to disk sectors exactly: a Linux
root on ext4, XFS or a single-device btrfs (also in a subvolume), on a
partition, the whole disk or a linear LV, plus every other such file system
its /etc/fstab mounts (fslayout.py); the kernel and initrd are found with all
of them mounted, btrfs subvolumes where fstab's subvol= puts them
(libguestfs mounts "btrfsvol:" mountables; bootfiles.py).
"""

import hashlib
import json
import os
import re
import shutil
import struct
import subprocess
import tempfile
from contextlib import suppress
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from ..cache import cache_dir, inputs_key
from ..errors import UserError
from .bootfiles import find_kernel
from .fslayout import (
    BTRFS_MAGIC,
    BTRFS_SUPER_OFFSET,
    XFS_MAGIC,
    MappedFs,
    SkippedFs,
    canonical_btrfsvols,
    mount_all,
    root_must_map,
    split_btrfsvol,
    survey,
)

# 3: every file system of /etc/fstab (filesystems, skipped), kernels on a separate /boot.
# 4: LVM linear logical volumes (runs, guest_start_sector, lv)
# 5: single-device btrfs mapped (subvol), no longer skipped
# 6: a file system on MD RAID skipped naming the array, level, members
INSPECT_VERSION = 7  # 7: ext2/ext3 mapped, no longer skipped; linear MD arrays mapped (md)


@dataclass(frozen=True)
class ImageInfo:
    path: str
    format: str
    virtual_size: int
    distro: str
    product: str
    major: int
    minor: int
    root_device: str  # as libguestfs names it, e.g. /dev/sda1
    root_partition: int  # 0 = whole disk
    root_start_sector: int
    root_fstype: str
    root_uuid: str
    block_size: int
    fs_features: str
    kernel_version: str
    kernel_path: str  # inside the image
    initrd_path: str  # inside the image, "" if none
    # Every file system /etc/fstab mounts whose pages are mapped, root first,
    # and those that are not, with the reason.
    filesystems: tuple[MappedFs, ...] = ()
    skipped: tuple[SkippedFs, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "ImageInfo":
        mapped = tuple(
            MappedFs(**{**f, "runs": tuple(tuple(r) for r in f["runs"])}) for f in d["filesystems"]
        )
        return cls(
            **{**d, "filesystems": mapped, "skipped": tuple(SkippedFs(**f) for f in d["skipped"])}
        )


# What the probe accepts, as its refusals say.
ACCEPTED = (
    "a qcow2 image without a backing file, or a raw disk image that starts with a "
    "partition table (MBR or GPT) or holds an ext2, ext3, ext4, XFS or btrfs file "
    "system on the whole disk"
)


def probe_format(path: Path) -> tuple[str, int]:
    """(format, virtual size) from qemu-img, with a clear error for non-images."""
    if not path.exists():
        raise UserError(f"{path}: no such file", "give the path of a golden image (qcow2 or raw)")
    if not path.is_file():
        raise UserError(f"{path}: not a regular file", "give the path of a golden image file")
    if not os.access(path, os.R_OK):
        raise UserError(f"{path}: not readable", "check the file's permissions")
    info, error = _qemu_img_info(path)
    if info is None:
        raise UserError(
            f"{path}: qemu-img cannot read it: {error}",
            "check that the file is a complete, uncorrupted image",
        )
    fmt = info["format"]
    # Raw images have no magic; qemu-img calls anything it does not know
    # "raw".  Only accept raw when a partition table or a file system
    # analyze-image maps (ext2/3/4, XFS, btrfs) starts the disk.
    if fmt == "raw" and not _looks_like_raw_disk(path):
        raise UserError(
            f"{path}: not a disk image (neither qcow2 nor another format qemu-img "
            "knows, nor a raw disk with a partition table or an ext2/3/4, XFS or "
            "btrfs file system on the whole disk)",
            f"analyze-image takes {ACCEPTED}",
        )
    if fmt not in ("qcow2", "raw"):
        raise UserError(
            f"{path}: image format {fmt} is not supported",
            f"analyze-image takes {ACCEPTED}: convert it with `qemu-img convert "
            f"-O qcow2 {path} IMAGE.qcow2` and analyze IMAGE.qcow2",
        )
    if info.get("backing-filename"):
        raise _backing_file_error(path, info)
    check_damage(path, fmt)
    return fmt, int(info["virtual-size"])


def _qemu_img_info(path: Path, fmt: str = "") -> tuple[dict[str, Any] | None, str]:
    """qemu-img info's answer for one image (not its backing chain), or None
    and why qemu-img could not read it."""
    out = subprocess.run(
        ["qemu-img", "info", "--output=json", *(["-f", fmt] if fmt else []), str(path)],
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        return None, out.stderr.strip() or f"exit status {out.returncode}"
    info: dict[str, Any] = json.loads(out.stdout)
    return info, ""


def _not_a_local_file(name: str) -> bool:
    """A backing file qemu reaches through a protocol (nbd://..., json:{...}):
    as qemu's path_has_protocol, a colon before any slash."""
    return ":" in name.split("/", 1)[0]


def _backing_file_error(path: Path, info: dict[str, Any]) -> UserError:
    """An overlay is refused.  The hint depends on whether its backing chain
    is all there, since `qemu-img convert` needs every file of it to make a
    standalone image: a missing file is named as the image that records it
    names it, with where qemu looks for it and what to do."""
    first = str(info["backing-filename"])
    convert = (
        f"`qemu-img convert -O qcow2 {path} STANDALONE.qcow2` makes a standalone "
        "image of the overlay and its backing chain, to analyze instead (or analyze "
        "the base image itself)"
    )
    holder, current, seen = path, info, {path.resolve()}
    while current.get("backing-filename"):
        named = str(current["backing-filename"])
        # qemu resolves a relative name against the directory of the image that
        # records it, as that image was named to qemu-img: the result is
        # relative to our working directory, as path is.
        full_name = str(current.get("full-backing-filename") or "")
        if _not_a_local_file(full_name or named):
            break  # on the network or in a json: spec; qemu-img reaches it or says why
        full = Path(full_name) if full_name else holder.parent / named
        where = os.path.abspath(full)
        lead = f"{path}: has a backing file, {first}," + (
            ""
            if holder == path
            else f" whose backing chain is broken: {holder} has a backing file, {named},"
        )
        if not full.exists():
            fmt = current.get("backing-filename-format")
            return UserError(
                f"{lead} and it is missing (looked for {where})",
                f"a golden image must be self-contained, and {holder} is an overlay whose "
                f"base is not there: put {named} back at {where} (or, if it was moved, point "
                f"{holder} at it with `qemu-img rebase -u {f'-F {fmt} ' if fmt else ''}"
                f"-b NEW_PATH {holder}`); then {convert}",
            )
        if full.resolve() in seen:
            return UserError(
                f"{lead} and the backing chain loops back to {where}",
                "a golden image must be self-contained, and no qemu tool can "
                "read this overlay: analyze the base image itself",
            )
        seen.add(full.resolve())
        next_info, error = _qemu_img_info(full, str(current.get("backing-filename-format") or ""))
        if next_info is None:
            return UserError(
                f"{lead} and qemu-img cannot read it ({where}): {error}",
                "a golden image must be self-contained, and making one from this overlay "
                f"needs its whole backing chain: make {where} readable and complete; then "
                f"{convert}",
            )
        holder, current = full, next_info
    return UserError(
        f"{path}: has a backing file ({first})", f"a golden image must be self-contained: {convert}"
    )


def _damaged(path: Path, what: str, fmt: str) -> UserError:
    check = f", and check it with `qemu-img check {path}`" if fmt == "qcow2" else ""
    return UserError(
        f"{path}: the image file is damaged: {what}",
        "the file is truncated or corrupted (an interrupted copy or download?): "
        "copy or download the golden image again, compare its size and checksum "
        f"with the original{check}",
        kind="image-damaged",
    )


def check_damage(path: Path, fmt: str) -> None:
    """Refuses a damaged image file before libguestfs would call it "no Linux".

    qcow2: `qemu-img check` (metadata only, well under a second); corruptions
    such as clusters past the end of a truncated file are fatal, leaked
    clusters are not.  raw: a partition (MBR or GPT), or an ext, XFS or btrfs
    file system on the whole disk, that ends past the end of the file means it
    was cut short.
    """
    if fmt == "qcow2":
        out = subprocess.run(["qemu-img", "check", str(path)], capture_output=True, text=True)
        # 0: clean, 3: leaks only (harmless for reading); 2: corruptions; 1: check failed.
        if out.returncode in (0, 3, 63) or re.search(r"Failed to get .* lock", out.stderr):
            return  # clean, or locked by a running writer (not a sign of damage)
        lines = [ln.strip() for ln in (out.stdout + "\n" + out.stderr).splitlines() if ln.strip()]
        summary = next(
            (
                ln.rstrip(".")
                for ln in lines
                if "errors were found" in ln or "error was found" in ln
            ),
            f"exit status {out.returncode}",
        )
        first = next((ln for ln in lines if ln.startswith(("ERROR", "qemu-img:"))), "")
        cut = "truncated; " if "end of the file" in out.stdout + out.stderr else ""
        raise _damaged(
            path, f"{cut}qemu-img check: {summary}" + (f" (first: {first})" if first else ""), fmt
        )
    if fmt == "raw":
        size = path.stat().st_size
        end = _data_end(path)
        if end > size:
            raise _damaged(
                path,
                f"truncated; its partition table or file system reaches byte "
                f"{end}, but the file has only {size} bytes",
                fmt,
            )


def _data_end(path: Path) -> int:
    """Where a raw disk's content must reach: the end in bytes of the last
    partition in the MBR or GPT, or of an ext, XFS or btrfs file system on the
    whole disk; 0 if none is there."""
    with open(path, "rb") as f:
        head = f.read(2048)
        if len(head) < 2048:
            return 0
        if head[:4] == XFS_MAGIC:
            # sb_blocksize (be32 at 4) times sb_dblocks (be64 at 8).
            (block_size,) = struct.unpack_from(">I", head, 4)
            (blocks,) = struct.unpack_from(">Q", head, 8)
            return int(block_size * blocks)
        f.seek(BTRFS_SUPER_OFFSET)
        btrfs = f.read(4096)
        if btrfs[0x40:0x48] == BTRFS_MAGIC:
            (total_bytes,) = struct.unpack_from("<Q", btrfs, 0x70)
            return int(total_bytes)
        if head[1024 + 56 : 1024 + 58] == b"\x53\xef":
            sb = head[1024:]
            (count,) = struct.unpack_from("<I", sb, 4)
            (log_block,) = struct.unpack_from("<I", sb, 24)
            (incompat,) = struct.unpack_from("<I", sb, 0x60)
            if incompat & 0x80:  # 64bit: s_blocks_count_hi
                count |= struct.unpack_from("<I", sb, 0x150)[0] << 32
            if log_block <= 6:
                return int(count * (1024 << log_block))
        if head[510:512] != b"\x55\xaa":
            return 0
        end = 0
        for i in range(4):
            e = head[446 + 16 * i : 462 + 16 * i]
            ptype, start, count = e[4], *struct.unpack_from("<II", e, 8)
            if ptype and ptype != 0xEE and count:
                end = max(end, (start + count) * 512)
        if head[512:520] == b"EFI PART":
            entries_lba, n, entry_size = struct.unpack_from("<QII", head, 512 + 72)
            if 128 <= entry_size <= 4096 and 0 < n <= 1024:
                f.seek(entries_lba * 512)
                table = f.read(n * entry_size)
                for i in range(len(table) // entry_size):
                    e = table[i * entry_size : (i + 1) * entry_size]
                    first, last = struct.unpack_from("<QQ", e, 32)
                    if any(e[:16]) and last >= first:
                        end = max(end, (last + 1) * 512)
        return end


def _looks_like_raw_disk(path: Path) -> bool:
    with open(path, "rb") as f:
        head = f.read(2048)
        f.seek(BTRFS_SUPER_OFFSET)
        btrfs = f.read(4096)[0x40:0x48] == BTRFS_MAGIC
    if len(head) < 2048:
        return False
    mbr = head[510:512] == b"\x55\xaa"
    gpt = head[512:520] == b"EFI PART"
    ext = head[1024 + 56 : 1024 + 58] == b"\x53\xef"
    xfs = head[:4] == XFS_MAGIC
    return mbr or gpt or ext or xfs or btrfs


def _content_key(path: Path) -> str:
    """The inspection cache key: the sha256 of the image file's bytes.

    The same image under any path (a hard link or a byte copy) gets the same
    key, so its kernel and initrd are stored once.  A conversion (qemu-img
    convert) has other bytes and is inspected again.  Hashing reads the file
    once (about a second per GiB); the answer is remembered per file
    identity (device, inode, size, mtime, ctime) under inspect/by-file/, so a
    file seen before is not read again.  The analysis's own image identity
    (image-content-sha256 of the virtual disk) needs a raw copy and is only
    computed after inspection.
    """
    st = path.stat()
    stamp = inputs_key(
        [INSPECT_VERSION, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]
    )
    index = cache_dir("inspect") / "by-file"
    known = index / stamp
    try:
        key = known.read_text().strip()
        if re.fullmatch(r"[0-9a-f]{16}", key):
            return key
    except OSError:
        pass
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
        after = os.fstat(f.fileno())
    key = inputs_key([INSPECT_VERSION, h.hexdigest(), st.st_size])
    if (after.st_size, after.st_mtime_ns, after.st_ctime_ns) != (
        st.st_size,
        st.st_mtime_ns,
        st.st_ctime_ns,
    ):
        return key  # changed while we read it: do not remember this identity
    index.mkdir(exist_ok=True)
    tmp = index / f".{stamp}.{os.getpid()}"
    tmp.write_text(key + "\n")
    os.replace(tmp, known)
    return key


def _cache_dir(path: Path) -> Path:
    return cache_dir("inspect") / _content_key(path)


@dataclass(frozen=True)
class Inspection:
    info: ImageInfo
    kernel: Path  # the guest kernel, copied out of the image
    initrd: Path | None


def inspect_image(path: Path, fmt: str, virtual_size: int, tcg: bool = True) -> Inspection:
    """Inspects the image and copies its kernel and initrd out, in one appliance boot."""
    d = _cache_dir(path)
    meta = d / "info.json"
    if not meta.exists():
        # Inspect into a private directory and publish it whole: a refused or
        # interrupted inspection leaves nothing behind under inspect/.
        tmpdir = Path(tempfile.mkdtemp(prefix=".inspect-", dir=d.parent))
        try:
            info = _inspect_with_guestfs(path, fmt, virtual_size, tcg, tmpdir)
            (tmpdir / "info.json").write_text(json.dumps(info.to_json(), indent=1))
            if d.exists() and not meta.exists():
                shutil.rmtree(d, ignore_errors=True)  # an incomplete entry of an older version
            try:
                tmpdir.rename(d)
            except OSError:
                if not meta.exists():  # not a concurrent inspection's entry
                    raise
        finally:
            shutil.rmtree(tmpdir, ignore_errors=True)
    # The entry may come from another path of the same image: report this one.
    info = replace(ImageInfo.from_json(json.loads(meta.read_text())), path=str(path.resolve()))
    initrd = d / "initrd.img"
    return Inspection(info, d / "vmlinuz", initrd if info.initrd_path else None)


def _refuse_encrypted(path: Path, g: Any) -> None:
    """No root was found and some volume is encrypted: the root is presumably inside.

    list_filesystems leaves encrypted volumes out; their type is crypto_LUKS
    (crypto_BITLK, ...) for vfs_type."""
    fss: dict[str, str] = {}
    for dev in [*g.list_devices(), *g.list_partitions(), *g.lvs()]:
        with suppress(RuntimeError):
            fss[dev] = g.vfs_type(dev)
    encrypted = sorted(d for d, t in fss.items() if t.startswith("crypto_"))
    if not encrypted:
        return
    kinds = sorted({fss[d].removeprefix("crypto_") for d in encrypted})
    raise UserError(
        f"{path}: no Linux root file system found outside encrypted volumes: "
        f"{', '.join(encrypted)} {'is' if len(encrypted) == 1 else 'are'} encrypted "
        f"({', '.join(kinds)}), and the root is presumably inside; analyze-image cannot map "
        "an encrypted file system",
        "the guests' page caches hold decrypted bytes, which equal no block of the encrypted "
        "disk, so no page of an encrypted file system can be served from the golden image "
        "(and the analysis reads the image offline, without keys); analyze a golden image "
        "whose root file system is not encrypted (encrypt what must be at the storage layer, "
        "or only data file systems, which are then skipped)",
    )


def _inspect_with_guestfs(
    path: Path, fmt: str, virtual_size: int, tcg: bool, outdir: Path
) -> ImageInfo:
    try:
        import guestfs  # Debian's python3-guestfs; the venv sees system site-packages
    except ImportError:
        raise UserError(
            "python3-guestfs is not importable",
            "run scripts/install-deps.sh (apt: python3-guestfs) and use the "
            "project's venv, which sees Debian's site-packages",
        ) from None
    g = guestfs.GuestFS(python_return_dict=True)
    try:
        if tcg:
            # /dev/kvm may exist yet not run guests; the appliance would hang.
            g.set_backend_settings(["force_tcg"])
        g.add_drive_opts(str(path), readonly=1, format=fmt)
        g.launch()
        roots = g.inspect_os()
        if not roots:
            fss = g.list_filesystems()
            _refuse_encrypted(path, g)
            raise UserError(
                f"{path}: no Linux installation found (file systems: "
                f"{', '.join(f'{d}={t}' for d, t in fss.items()) or 'none'})",
                "analyze-image needs a bootable Linux golden image; if this one "
                "has Linux, check that the file is complete (its size and checksum "
                "against the original; qemu-img check for qcow2)",
            )
        root = roots[0]
        ostype = g.inspect_get_type(root)
        if ostype != "linux":
            raise UserError(
                f"{path}: the OS inside is {ostype}, not Linux",
                "analyze-image analyses Linux guests only",
            )
        # libguestfs resolves /etc/fstab's UUID=/LABEL= to devices; an fstab
        # without a root line still gives the root.
        mountpoints = canonical_btrfsvols(g, {**g.inspect_get_mountpoints(root), "/": root})
        mapped, skipped = survey(g, mountpoints, virtual_size // 512)
        every: list[MappedFs | SkippedFs] = [*mapped, *skipped]
        rootfs = root_must_map(path, next(f for f in every if f.mountpoint == "/"))
        mount_all(g, mountpoints)
        subvols = {
            sv: mp for mp, sv in ((mp, split_btrfsvol(m)[1]) for mp, m in mountpoints.items()) if sv
        }
        kernel, initrd, version = find_kernel(g, subvols)
        g.download(kernel, str(outdir / "vmlinuz"))
        if initrd:
            g.download(initrd, str(outdir / "initrd.img"))
        return ImageInfo(
            path=str(path.resolve()),
            format=fmt,
            virtual_size=virtual_size,
            distro=g.inspect_get_distro(root),
            product=g.inspect_get_product_name(root),
            major=g.inspect_get_major_version(root),
            minor=g.inspect_get_minor_version(root),
            root_device=mountpoints["/"],
            root_partition=rootfs.partition,
            root_start_sector=rootfs.start_sector,
            root_fstype=rootfs.fstype,
            root_uuid=rootfs.uuid,
            block_size=rootfs.block_size,
            fs_features=rootfs.features,
            kernel_version=version,
            kernel_path=kernel,
            initrd_path=initrd,
            filesystems=tuple(mapped),
            skipped=tuple(skipped),
        )
    except RuntimeError as e:
        raise UserError(
            f"{path}: libguestfs could not inspect the image: {e}",
            "check the image with virt-inspector; it must be a readable disk image",
        ) from None
    finally:
        g.close()
