"""A small synchronous QMP client.

The analyzer needs a handful of commands (stop, dump-guest-memory, query-dump,
human-monitor-command, quit) on a socket QEMU created; asyncio and the
qemu.qmp package would be more machinery than the job needs.
"""

import contextlib
import json
import os
import socket
import struct
import time
from pathlib import Path
from typing import IO, Any, Protocol

from pageshare.errors import PageshareError


class QMPError(PageshareError, RuntimeError):
    """QEMU answered a command with an error, or the connection broke."""


# sun_path holds 108 bytes with its NUL (unix(7)); QEMU refuses longer names.
UNIX_PATH_MAX = 107


def connect_unix(sock: socket.socket, path: Path) -> None:
    """Connects SOCK to the unix socket at PATH, however long PATH is: a
    longer one is reached through a descriptor of its directory
    (/proc/self/fd/N/NAME), as a work directory deep in a long path needs."""
    if len(os.fsencode(path)) <= UNIX_PATH_MAX:
        sock.connect(str(path))
        return
    fd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY)
    try:
        sock.connect(f"/proc/self/fd/{fd}/{path.name}")
    finally:
        os.close(fd)


class Monitor(Protocol):
    """What `pageshare attach` needs of a QMP connection: QMP over a socket
    (QMP below) or through libvirt (libvirt_qmp.LibvirtQMP)."""

    def command(self, name: str, timeout: float | None = None, **args: Any) -> Any: ...

    def hmp(self, line: str) -> str: ...

    def peer_pid(self) -> int | None: ...

    def close(self) -> None: ...


class QMPStream:
    """QMP over a pair of text streams: QEMU's -qmp stdio through pipes (whoever
    started QEMU bounds the exchange in time), or a socket's (QMP below)."""

    def __init__(self, reader: IO[str], writer: IO[str]) -> None:
        self._reader = reader
        self._writer = writer
        self.greeting = self._read()
        self.events: list[dict[str, Any]] = []
        self.command("qmp_capabilities")

    def _set_timeout(self, timeout: float) -> None:
        """Pipes have no timeout of their own."""

    def _read(self) -> dict[str, Any]:
        line = self._reader.readline()
        if not line:
            raise QMPError("QEMU closed the QMP connection")
        msg: dict[str, Any] = json.loads(line)
        return msg

    def _reply(self, prefix: str) -> Any:
        """The next reply, the events before it kept in self.events; PREFIX
        leads an error's message."""
        while True:
            reply = self._read()
            if "event" in reply:
                self.events.append(reply)
                continue
            if "error" in reply:
                err = reply["error"]
                raise QMPError(f"{prefix}{err.get('class')}: {err.get('desc')}")
            return reply.get("return")

    def command(self, name: str, timeout: float | None = None, **args: Any) -> Any:
        if timeout is not None:
            self._set_timeout(timeout)
        self.send(name, **args)
        return self._reply(f"{name}: ")

    def send(self, name: str, **args: Any) -> None:
        """Queue a command without waiting for its reply (see replies());
        QEMU answers in order, once it runs again if it is stopped."""
        msg: dict[str, Any] = {"execute": name}
        if args:
            msg["arguments"] = args
        self._writer.write(json.dumps(msg) + "\n")
        self._writer.flush()

    def replies(self, n: int, timeout: float | None = None) -> list[Any]:
        """The next ``n`` replies to commands queued with send(), in order."""
        if timeout is not None:
            self._set_timeout(timeout)
        return [self._reply("") for _ in range(n)]

    def hmp(self, line: str) -> str:
        args: dict[str, Any] = {"command-line": line}
        out: str = self.command("human-monitor-command", None, **args)
        return out


class QMP(QMPStream):
    """QMP on QEMU's unix socket."""

    def __init__(self, path: Path, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self._sock.settimeout(timeout)
                connect_unix(self._sock, path)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                self._sock.close()
                # QEMU creates the socket a moment after it starts.
                if time.monotonic() > deadline:
                    raise QMPError(f"no QMP socket at {path} after {timeout:.0f}s") from None
                time.sleep(0.1)
        self._file = self._sock.makefile("rw", encoding="utf-8")
        super().__init__(self._file, self._file)

    def _set_timeout(self, timeout: float) -> None:
        self._sock.settimeout(timeout)

    def peer_pid(self) -> int | None:
        """The pid of the QEMU at the other end (SO_PEERCRED), if known."""
        try:
            cred = self._sock.getsockopt(
                socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")
            )
        except OSError:
            return None
        pid: int = struct.unpack("3i", cred)[0]
        return pid or None

    def close(self) -> None:
        """Closes the connection.  A command that could not be sent to a QEMU
        that has exited stays in the stream's buffer, and closing the stream
        would try to send it again: that is not an error here (it masked the
        analysis' own message about a guest that stopped)."""
        try:
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                self._file.close()
        finally:
            self._sock.close()


def qmp_socket_of(args: list[str]) -> Path | None:
    """A QMP unix socket named on a QEMU command line (-qmp unix:PATH,server or
    -chardev socket,id=X,path=PATH,server + -mon chardev=X,mode=control)."""
    chardevs: dict[str, str] = {}
    mons: list[str] = []
    for i, a in enumerate(args[:-1]):
        v = args[i + 1]
        if a in ("-qmp", "--qmp") and v.startswith("unix:"):
            return Path(v[5:].split(",")[0])
        if a in ("-chardev", "--chardev") and v.startswith("socket,"):
            opts = dict(o.split("=", 1) for o in v.split(",")[1:] if "=" in o)
            if "id" in opts and "path" in opts:
                chardevs[opts["id"]] = opts["path"]
        if a in ("-mon", "--mon"):
            opts = dict(o.split("=", 1) for o in v.split(",") if "=" in o)
            if opts.get("mode") == "control" and "chardev" in opts:
                mons.append(opts["chardev"])
    for m in mons:
        if m in chardevs:
            return Path(chardevs[m])
    return None
