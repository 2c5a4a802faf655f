"""Reference client for pageshare-server's socket protocol (PROTOCOL.md).

What QEMU's pageshare filter does, in Python, for tests and tools:
connect to an image socket, receive the TABLE message with the sealed table
memfd and the server's pidfd, map and check the table, look blocks up,
acknowledge new generations (SWITCHED), report counters (STATS) and what
the guest read (READS, LISTED_READ).

    with PageshareClient("/run/pageshare/debian12.sock") as c:
        msg = c.recv()                       # TableMsg, NoTableMsg or ByeMsg
        if isinstance(msg, TableMsg):
            addr = msg.table.lookup(sector // 8)
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import socket
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from types import TracebackType

# The framing and the control socket's request as the host tools have them.
from pageshare.host.server_control import control_request as control_request
from pageshare.host.server_control import frame as frame
from pageshare.host.server_control import read_exact

MSG_TABLE = 1
MSG_NO_TABLE = 2
MSG_BYE = 3
MSG_SWITCHED = 16
MSG_STATS = 17
MSG_READS = 18
MSG_LISTED_READ = 19
MSG_STATUS_REQ = 32
MSG_STATUS_REPLY = 33
MSG_RELOAD_REQ = 34
MSG_RELOAD_REPLY = 35

NO_GENERATION = (1 << 64) - 1
READS_MAX_ENTRIES = 254
LISTED_READ_MAX_ENTRIES = 509
READS_TRUNCATED = 1
TABLE_MAGIC = b"PSTABLE1"
TABLE_HEADER = struct.Struct("<8sII Q Q 32s Q Q I I Q I I Q Q Q")
TABLE_MSG_VERSION = 2
TABLE_PAYLOAD = struct.Struct("<II Q Q Q Q 32s I I d I I Q Q Q q q")  # 136 bytes
PROOF_FILE = 1
IMAGE_FORMATS = {1: "raw", 2: "qcow2"}
HASH_MULT = 0x9E3779B97F4A7C15
MASK64 = (1 << 64) - 1
FLAG_DEGRADED = 1
NO_TABLE_REASONS = {1: "loading", 2: "no-list", 3: "refused", 4: "image-changed", 5: "shutdown"}
# STATS offset 104: whether the client uses its table, and if not, why.
PROOF_STATES = {
    0: "unknown",
    1: "sharing",
    2: "no-table",
    3: "unchecked",
    4: "unproven",
    5: "base-changed",
}
REQUIRED_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE


class ProtocolError(Exception):
    pass


@dataclass
class Table:
    """A mapped, validated table memfd."""

    generation: int
    entries: int
    virtual_size: int
    content_sha256: str
    server_pid: int
    flags: int
    bits: int
    buckets: int
    arena: tuple[int, int]
    map: mmap.mmap = field(repr=False)

    @classmethod
    def from_fd(cls, fd: int) -> Table:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        if seals & REQUIRED_SEALS != REQUIRED_SEALS:
            raise ProtocolError(f"table memfd seals {seals:#x} lack {REQUIRED_SEALS:#x}")
        size = os.fstat(fd).st_size
        if size < TABLE_HEADER.size:
            raise ProtocolError(f"table memfd is {size} bytes")
        m = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        (
            magic,
            version,
            hsize,
            gen,
            vsize,
            sha,
            entries,
            buckets,
            bits,
            bsize,
            boff,
            pid,
            flags,
            abase,
            alen,
            _r,
        ) = TABLE_HEADER.unpack_from(m, 0)
        if magic != TABLE_MAGIC or version != 1 or hsize != 128 or bsize != 4096 or boff != 128:
            raise ProtocolError(f"bad table header {magic!r} v{version}")
        if buckets != 1 << bits or not 4 <= bits <= 40 or entries * 2 > buckets:
            raise ProtocolError(f"bad table geometry: {entries} entries, {buckets} buckets")
        if size < 128 + 16 * buckets:
            raise ProtocolError("table memfd shorter than its buckets")
        return cls(gen, entries, vsize, sha.hex(), pid, flags, bits, buckets, (abase, alen), m)

    def lookup(self, block: int) -> int | None:
        """Server address of 4 KiB block ``block`` (sector // 8), or None."""
        key = block + 1
        i = ((key * HASH_MULT) & MASK64) >> (64 - self.bits)
        mask = self.buckets - 1
        for _ in range(self.buckets):
            k, addr = struct.unpack_from("<QQ", self.map, 128 + 16 * i)
            if k == key:
                return int(addr)
            if k == 0:
                return None
            i = (i + 1) & mask
        return None

    def items(self) -> Iterator[tuple[int, int]]:
        """Every (block, address) in the table, in bucket order."""
        for i in range(self.buckets):
            k, addr = struct.unpack_from("<QQ", self.map, 128 + 16 * i)
            if k:
                yield k - 1, addr

    def close(self) -> None:
        self.map.close()


@dataclass(frozen=True)
class FileStamp:
    """Which file and unchanged since when: st_dev, st_ino, st_size and the
    mtime and ctime in ns (PROTOCOL.md, "Proof of identity")."""

    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, f: int | str | os.PathLike[str]) -> FileStamp:
        """The stamp of an open descriptor (fstat) or a path (stat)."""
        st = os.fstat(f) if isinstance(f, int) else os.stat(f)
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


@dataclass
class TableMsg:
    generation: int
    entries: int
    virtual_size: int
    content_sha256: str
    server_pid: int
    flags: int
    table: Table
    pidfd: int
    version: int = TABLE_MSG_VERSION
    image_format: int = 0
    published_at: float = 0.0
    proof_flags: int = 0
    file: FileStamp | None = None

    @property
    def degraded(self) -> bool:
        return bool(self.flags & FLAG_DEGRADED)

    @property
    def format_name(self) -> str:
        return IMAGE_FORMATS.get(self.image_format, str(self.image_format))

    def proves(self, f: int | str | os.PathLike[str]) -> bool:
        """Is ``f`` (an open descriptor of the base image, or its path) the
        very file the server verified, unchanged since?  What QEMU's filter
        checks with fstat() before trusting the table."""
        return self.file is not None and FileStamp.of(f) == self.file


@dataclass
class NoTableMsg:
    reason: str
    text: str


@dataclass
class ByeMsg:
    text: str


Message = TableMsg | NoTableMsg | ByeMsg


def recv_frame(sock: socket.socket, maxfds: int = 4) -> tuple[int, bytes, list[int]] | None:
    """One message as sent: its type, its payload and the descriptors that
    came with it (the caller owns them); None at end of stream."""
    data, fds, _flags, _addr = socket.recv_fds(sock, 8, maxfds)
    if not data:
        for fd in fds:
            os.close(fd)
        return None
    try:
        if len(data) < 8:
            data += read_exact(sock, 8 - len(data))
        kind, length = struct.unpack("<II", data)
        return kind, read_exact(sock, length) if length else b"", fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


class PageshareClient:
    def __init__(self, path: str | os.PathLike[str], timeout: float = 10.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(os.fspath(path))
        self.fds: list[int] = []

    def __enter__(self) -> PageshareClient:
        return self

    def __exit__(
        self, t: type[BaseException] | None, v: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds.clear()
        self.sock.close()

    def recv(self) -> Message:
        got = recv_frame(self.sock)
        if got is None:
            raise EOFError("server closed the connection")
        kind, payload, fds = got
        if kind == MSG_TABLE:
            if len(fds) != 2 or len(payload) < TABLE_PAYLOAD.size:
                raise ProtocolError(f"TABLE with {len(fds)} fds and {len(payload)} bytes")
            version = struct.unpack_from("<I", payload)[0] if len(payload) >= 4 else 0
            if version != TABLE_MSG_VERSION:
                for fd in fds:
                    os.close(fd)
                raise ProtocolError(f"TABLE message version {version}, not {TABLE_MSG_VERSION}")
            (
                version,
                flags,
                gen,
                entries,
                _tbytes,
                vsize,
                sha,
                pid,
                fmt,
                published,
                proof,
                _r,
                dev,
                ino,
                fsize,
                mtime_ns,
                ctime_ns,
            ) = TABLE_PAYLOAD.unpack_from(payload)
            self.fds += fds
            table = Table.from_fd(fds[0])
            if table.generation != gen or table.entries != entries:
                raise ProtocolError("TABLE message and memfd header disagree")
            stamp = FileStamp(dev, ino, fsize, mtime_ns, ctime_ns) if proof & PROOF_FILE else None
            return TableMsg(
                gen,
                entries,
                vsize,
                sha.hex(),
                pid,
                flags,
                table,
                fds[1],
                version,
                fmt,
                published,
                proof,
                stamp,
            )
        for fd in fds:
            os.close(fd)
        if kind == MSG_NO_TABLE:
            _version, reason = struct.unpack_from("<II", payload)
            return NoTableMsg(
                NO_TABLE_REASONS.get(reason, str(reason)), payload[8:].decode(errors="replace")
            )
        if kind == MSG_BYE:
            return ByeMsg(payload.decode(errors="replace"))
        raise ProtocolError(f"unknown message type {kind}")

    def switched(self, generation: int) -> None:
        self.sock.sendall(frame(MSG_SWITCHED, struct.pack("<Q", generation)))

    def stats(
        self,
        generation: int,
        lookups: int,
        hits: int,
        merged: int,
        merge_errors: int,
        fallbacks: int,
        migration_refs: Sequence[int] | None = None,
        proof: tuple[int, str] | None = None,
    ) -> None:
        """STATS; MIGRATION_REFS: sent, refused, merged, copied, read, failed
        (None: the 48-byte message of a client without them); PROOF:
        fallback_unproven and the proof state (a name of PROOF_STATES),
        which need the migration counters before them."""
        payload = struct.pack("<6Q", generation, lookups, hits, merged, merge_errors, fallbacks)
        if migration_refs is not None:
            payload += struct.pack("<6Q", *migration_refs)
        if proof is not None:
            assert migration_refs is not None, "the proof fields follow the migration counters"
            code = {v: k for k, v in PROOF_STATES.items()}[proof[1]]
            payload += struct.pack("<2Q", proof[0], code)
        self.sock.sendall(frame(MSG_STATS, payload))

    def reads(
        self,
        generation: int,
        counts: list[tuple[int, int]] | dict[int, int],
        truncated: bool = False,
    ) -> None:
        """READS: reads of unlisted blocks since the last report, as
        (block, reads); more than 254 go in several messages."""
        items = list(counts.items() if isinstance(counts, dict) else counts)
        for i in range(0, max(len(items), 1), READS_MAX_ENTRIES):
            chunk = items[i : i + READS_MAX_ENTRIES]
            body = b"".join(struct.pack("<QII", b, n, 0) for b, n in chunk)
            flags = READS_TRUNCATED if truncated else 0
            self.sock.sendall(
                frame(MSG_READS, struct.pack("<QII", generation, len(chunk), flags) + body)
            )

    def listed_read(self, generation: int, blocks: list[int]) -> None:
        """LISTED_READ: listed blocks read for the first time; more than
        509 go in several messages."""
        for i in range(0, max(len(blocks), 1), LISTED_READ_MAX_ENTRIES):
            chunk = blocks[i : i + LISTED_READ_MAX_ENTRIES]
            body = b"".join(struct.pack("<Q", b) for b in chunk)
            self.sock.sendall(
                frame(MSG_LISTED_READ, struct.pack("<QII", generation, len(chunk), 0) + body)
            )

    def send_raw(self, kind: int, payload: bytes) -> None:
        """Any message, as is (for tests of what the server refuses)."""
        self.sock.sendall(frame(kind, payload))


def read_server_memory(pid: int, addr: int, length: int) -> bytes:
    """Bytes at ``addr`` in process ``pid`` through /proc/PID/mem (needs
    ptrace rights, e.g. root).  /proc/PID/mem reads even PROT_NONE memory
    (as zeros if absent): use :func:`copy_server_memory` to see what a
    client sees."""
    with open(f"/proc/{pid}/mem", "rb", buffering=0) as f:
        f.seek(addr)
        return f.read(length)


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def copy_server_memory(pid: int, addr: int, length: int) -> bytes:
    """Bytes at ``addr`` in process ``pid`` copied with process_vm_readv(),
    as a copying client (QEMU's filter in copy mode) does (needs ptrace
    rights).  Raises OSError(EFAULT) if any of it is not readable: the
    server keeps an address readable only while it holds its block's
    verified bytes (released and never-loaded blocks fault)."""
    buf = ctypes.create_string_buffer(length)
    local = _IoVec(ctypes.cast(buf, ctypes.c_void_p), length)
    remote = _IoVec(addr, length)
    n = _process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
    what = f"process_vm_readv({pid}, {addr:#x}, {length})"
    if n < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")
    if n != length:
        raise OSError(errno.EFAULT, f"{what}: short copy ({n})")
    return buf.raw


_process_vm_readv = ctypes.CDLL(None, use_errno=True).process_vm_readv
_process_vm_readv.restype = ctypes.c_ssize_t
_process_vm_readv.argtypes = [
    ctypes.c_int,
    ctypes.POINTER(_IoVec),
    ctypes.c_ulong,
    ctypes.POINTER(_IoVec),
    ctypes.c_ulong,
    ctypes.c_ulong,
]
