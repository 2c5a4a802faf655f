"""The page server's control socket, as the host tools ask it: `pageshare
host check`, `attach` and the libvirt watcher (page-server/PROTOCOL.md,
"Control socket": u32 kind, u32 length, payload; little-endian).
Standard library only: a host module (pageshare-host ships the host subpackage)."""

from __future__ import annotations

import json
import os
import socket
import struct
from pathlib import Path
from typing import Any

DEFAULT_CONTROL = Path("/run/pageshare/control.sock")
# PROTOCOL.md, control socket: STATUS_REQ (32) -> STATUS_REPLY (33, JSON).
MSG_STATUS_REQ = 32
MSG_STATUS_REPLY = 33
# What server_status() raises when no server answers.
UNREACHABLE = (OSError, EOFError, ValueError)


def frame(kind: int, payload: bytes = b"") -> bytes:
    """A message as PROTOCOL.md frames it on every socket of the server."""
    return struct.pack("<II", kind, len(payload)) + payload


def read_exact(sock: socket.socket, n: int) -> bytes:
    """N bytes of a message whose start has come (EOFError if they do not)."""
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError("the server closed the connection mid-reply")
        buf += chunk
    return buf


def control_request(
    path: str | os.PathLike[str], kind: int, payload: bytes = b"", timeout: float = 10.0
) -> tuple[int, bytes]:
    """One request on pageshare-server's control socket."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(os.fspath(path))
        s.sendall(frame(kind, payload))
        k, n = struct.unpack("<II", read_exact(s, 8))
        return k, read_exact(s, n)


def server_status(control: Path, timeout: float = 10.0) -> dict[str, Any]:
    """The server's status JSON (raises one of UNREACHABLE)."""
    k, body = control_request(control, MSG_STATUS_REQ, timeout=timeout)
    if k != MSG_STATUS_REPLY:
        raise ValueError(f"unexpected reply kind {k} to STATUS_REQ")
    data: dict[str, Any] = json.loads(body)
    return data


def unreachable_reason(e: BaseException) -> str:
    """Why server_status() failed, in words for a message."""
    if isinstance(e, FileNotFoundError):
        return "no control socket there"
    if isinstance(e, ConnectionRefusedError):
        return "nothing listens on it"
    return f"{type(e).__name__}: {e}"
