"""pageshare.host.qmp against real unix sockets: a QMP peer that goes away,
as a guest's QEMU does when the guest panics with panic=-1 and -no-reboot,
and a real QEMU whose socket's path is longer than a unix socket's name."""

import contextlib
import json
import os
import socket
import subprocess
import threading
from pathlib import Path

import pytest
from pageshare.host.qmp import QMP, UNIX_PATH_MAX, QMPError


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


def test_a_socket_deeper_than_a_unix_path_holds(tmp_path: Path) -> None:
    # As analyze-image's work directory under a long PAGESHARE_WORKDIR (CI's
    # pytest-of-root/pytest-10/popen-gw0/<test name>/work/pageshare-analyze-*):
    # QEMU runs in the directory and names its socket relative to it.
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    sock = deep / "A.qmp"
    assert len(os.fsencode(sock)) > UNIX_PATH_MAX
    qemu = subprocess.Popen(
        [
            "qemu-system-x86_64",
            "-machine",
            "none",
            "-nodefaults",
            "-display",
            "none",
            "-qmp",
            f"unix:{sock.name},server=on,wait=off",
        ],
        cwd=deep,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        qmp = QMP(sock, timeout=30)  # raised OSError: AF_UNIX path too long
        assert qmp.peer_pid() == qemu.pid
        assert "qemu" in qmp.command("query-version")
        qmp.command("quit", timeout=10)
        qmp.close()
        assert qemu.wait(timeout=30) == 0
    finally:
        if qemu.poll() is None:
            qemu.kill()
            qemu.wait()
