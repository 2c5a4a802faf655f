"""Reading a base image's virtual disk: raw files, qcow2 (through a raw
conversion by qemu-img), and the content hash that names an image in lists.

The one place that turns a qcow2 into raw bytes for the analysis and for
`pageshare list verify`: qemu-img reads every format QEMU reads, and a raw
file lets the rest read any block with pread.
"""

import hashlib
import os
import shutil
import stat
import subprocess
import tempfile
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from ..errors import UserError

QCOW2_MAGIC = b"QFI\xfb"


def to_raw(image: Path, dest: Path) -> None:
    """Write IMAGE's virtual disk (any format qemu-img reads) to DEST as raw."""
    qemu_img = shutil.which("qemu-img")
    if qemu_img is None:
        raise UserError(
            f"{image} needs qemu-img to be read, and qemu-img is not installed",
            hint="install qemu-utils (Debian/Ubuntu) or qemu-img (Fedora), or convert it "
            f"yourself: qemu-img convert -O raw {image} IMAGE.raw",
        )
    proc = subprocess.run(
        [qemu_img, "convert", "-O", "raw", str(image), str(dest)],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise UserError(
            f"qemu-img convert of {image} failed: {proc.stderr.strip() or proc.returncode}",
            hint="check that the image is readable and not locked by a running VM, "
            f"and that {dest.parent} has room for the raw data",
        )


def image_content_sha256(
    read_at: Callable[[int, int], bytes], virtual_size: int, chunk: int = 4 << 20
) -> str:
    """sha256 of the virtual disk content, read as [off, off+len) chunks.

    Hashing what the guest sees (not the file) makes the identity independent
    of the image format: a qcow2 and its raw conversion hash the same.
    """
    if chunk <= 0:
        raise ValueError(f"chunk must be positive, got {chunk}")
    if virtual_size < 0:
        raise ValueError(f"virtual_size must not be negative, got {virtual_size}")
    h = hashlib.sha256()
    offset = 0
    while offset < virtual_size:
        n = min(chunk, virtual_size - offset)
        data = read_at(offset, n)
        if len(data) != n:
            # A silently short read would hash to a plausible but wrong identity.
            raise ValueError(f"reader returned {len(data)} bytes at offset {offset}, expected {n}")
        h.update(data)
        offset += n
    return h.hexdigest()


class RawFile:
    """An open raw image; closed explicitly or when garbage collected."""

    def __init__(self, path: Path) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            st = os.fstat(fd)
            # st_size is 0 for block devices; seeking to the end gives their size.
            self.size = os.lseek(fd, 0, os.SEEK_END) if stat.S_ISBLK(st.st_mode) else st.st_size
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self._finalizer = weakref.finalize(self, os.close, fd)

    def read_at(self, offset: int, length: int) -> bytes:
        if not self._finalizer.alive:
            # The fd number may already belong to another file.
            raise ValueError("read from a closed image")
        if offset < 0 or length < 0:
            raise ValueError(f"bad read: offset {offset}, length {length}")
        parts: list[bytes] = []
        got = 0
        while got < length:
            chunk = os.pread(self._fd, length - got, offset + got)
            if not chunk:
                break
            parts.append(chunk)
            got += len(chunk)
        # Past EOF the virtual disk reads as zeros (as qemu does for raw images).
        parts.append(bytes(length - got))
        return b"".join(parts)

    def close(self) -> None:
        self._finalizer()


def raw_file_reader(path: Path) -> tuple[Callable[[int, int], bytes], int]:
    """A ``read_at(offset, length)`` over a raw image file (or block device) and
    its size.  Reads past EOF are zero-filled.  The file stays open as long as
    the returned reader is referenced."""
    f = RawFile(Path(path))
    return f.read_at, f.size


@contextmanager
def open_raw(image: Path, tmpdir: str | None) -> Iterator[tuple[RawFile, str]]:
    """The image as a raw reader, converting qcow2 to a temporary raw file."""
    with open(image, "rb") as f:
        magic = f.read(len(QCOW2_MAGIC))
    if magic != QCOW2_MAGIC:
        raw = RawFile(image)
        try:
            yield raw, "raw"
        finally:
            raw.close()
        return
    with tempfile.TemporaryDirectory(prefix="pageshare-raw-", dir=tmpdir) as td:
        raw_path = Path(td) / "image.raw"
        to_raw(image, raw_path)
        raw = RawFile(raw_path)
        try:
            yield raw, "qcow2"
        finally:
            # Close before the directory is removed so the space is really freed.
            raw.close()
