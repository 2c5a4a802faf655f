"""pageshare.host.qmp against a QMP peer on a real unix socket that goes away,
as a guest's QEMU does when the guest panics with panic=-1 and -no-reboot."""

import contextlib
import json
import socket
import threading
from pathlib import Path

import pytest
from pageshare.host.qmp import QMP, QMPError


def qemu_that_exits(path: Path) -> threading.Thread:
    """A QMP server that greets, accepts qmp_capabilities, then exits."""
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(1)

    def serve() -> None:
        conn, _ = srv.accept()
        with conn, conn.makefile("rw", encoding="utf-8") as f:
            f.write(json.dumps({"QMP": {"version": {}, "capabilities": []}}) + "\n")
            f.flush()
            assert json.loads(f.readline())["execute"] == "qmp_capabilities"
            f.write(json.dumps({"return": {}}) + "\n")
            f.flush()
        srv.close()

    t = threading.Thread(target=serve)
    t.start()
    return t


def test_closing_after_qemu_exited_is_quiet(tmp_path: Path) -> None:
    sock = tmp_path / "qmp.sock"
    server = qemu_that_exits(sock)
    qmp = QMP(sock, timeout=5)
    server.join()
    # What Guest.shutdown() does: quit (it may fail: QEMU is gone), close.
    with pytest.raises((QMPError, BrokenPipeError, ConnectionResetError)):
        qmp.command("quit", timeout=5)
    qmp.close()  # raised BrokenPipeError: the unsent quit was still buffered
    with contextlib.suppress(OSError):
        qmp.close()  # twice is harmless
