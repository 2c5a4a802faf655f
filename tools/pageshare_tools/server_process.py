"""A pageshare-server process (and Redis) run for the tests and the benchmarks.

Builds the daemon with cargo (target directory in the cache), writes its
configuration, starts it (optionally as another user), waits for it and
asks it for its status; runs a throwaway redis-server (on a TCP port,
Redis, or on a Unix socket alone, unix_redis); makes sector lists from real
images.  The tests (tests/page_server_helpers.py adds their pytest glue)
and the benchmarks (page-server/bench, qemu-patches/bench.py,
bench/migration_bench.py, bench/feedback_round.py) share it, as QEMU's iotests and benchmarks share
python/qemu/machine.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pageshare.cache import cache_root
from pageshare.lists import sectorlist

from pageshare_tools import pageshare_client as psc
from pageshare_tools.cargo import cargo, cargo_target_dir

# the repository's page-server/ (this file is tools/pageshare_tools/server_process.py)
PAGE_SERVER = Path(__file__).resolve().parents[2] / "page-server"


class HarnessError(Exception):
    """The server (or Redis) could not be built or run here."""


CACHE = cache_root()
TARGET = cargo_target_dir()


_built: dict[str, Path] = {}


def server_binary(profile: str = "release") -> Path:
    """Build page-server (cargo, target dir in the cache) once per session."""
    if profile in _built:
        return _built[profile]
    c = cargo()
    if c is None:
        raise HarnessError(
            "cargo is not installed (scripts/install-deps.sh); page-server cannot be built"
        )
    env = dict(os.environ, CARGO_TARGET_DIR=str(TARGET))
    env["PATH"] = f"{Path(c).parent}:{env.get('PATH', '')}"
    args = [c, "build", "--quiet", "--locked"] + (["--release"] if profile == "release" else [])
    p = subprocess.run(
        ["nice", "-n", "10", *args],
        cwd=PAGE_SERVER,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if p.returncode != 0:
        raise HarnessError(f"cargo build failed:\n{p.stderr[-4000:]}")
    path = TARGET / profile / "pageshare-server"
    _built[profile] = path
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(
    pred: Any, timeout: float = 30.0, what: str = "condition", interval: float = 0.05
) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = pred()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what} (last: {last!r})")


# --------------------------------------------------------------------------- Redis


@contextlib.contextmanager
def unix_redis(
    sock: Path, poll: float = 0.05, stop: int = signal.SIGKILL
) -> Iterator[subprocess.Popen[bytes]]:
    """A throwaway redis-server on the Unix socket SOCK alone (no TCP port,
    nothing saved); on the way in it waits for SOCK (100 polls, POLL seconds
    apart: the caller checks that it is there), on the way out it is sent
    STOP and reaped."""
    p = subprocess.Popen(
        [
            "redis-server",
            "--unixsocket",
            str(sock),
            "--port",
            "0",
            "--save",
            "",
            "--appendonly",
            "no",
        ],
        stdout=subprocess.DEVNULL,
    )
    try:
        for _ in range(100):
            if sock.exists():
                break
            time.sleep(poll)
        yield p
    finally:
        p.send_signal(stop)
        p.wait()


@dataclass
class Redis:
    port: int
    dir: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        # appendonly: lists survive a restart, like a production Redis.
        self.proc = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(self.dir),
                "--save",
                "",
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
                "--daemonize",
                "no",
                "--logfile",
                str(self.dir / "log"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_for(self.ping, 10, "redis-server to start")

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(10)
        self.proc = None


# --------------------------------------------------------------------------- server


@dataclass
class ImageSpec:
    name: str
    path: Path
    list_file: Path | None = None
    list_redis: str | None = None
    fmt: str = "auto"


@dataclass
class Server:
    dir: Path
    images: list[ImageSpec]
    redis_url: str | None = None
    host: str = "host"
    extra: str = ""
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    metrics_port: int = 0
    # (uid, gid) to run as, with no capability (what the unit's drop-in for
    # an unprivileged QEMU gives it), or None: root.
    run_as: tuple[int, int] | None = None

    @property
    def config(self) -> Path:
        return self.dir / "server.toml"

    @property
    def control(self) -> Path:
        return self.dir / "run" / "control.sock"

    @property
    def log(self) -> Path:
        return self.dir / "server.log"

    def sock(self, name: str) -> Path:
        return self.dir / "run" / f"{name}.sock"

    def write_config(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        if not self.metrics_port:
            self.metrics_port = free_port()
        lines = [
            f'socket_dir = "{self.dir / "run"}"',
            f'cache_dir = "{self.dir / "cache"}"',
            f'host_name = "{self.host}"',
            f'metrics_listen = "127.0.0.1:{self.metrics_port}"',
            self.extra,
        ]
        if self.redis_url:
            lines += [
                "[redis]",
                f'url = "{self.redis_url}"',
                "poll_interval_secs = 2",
                "stats_interval_secs = 1",
                "max_backoff_secs = 2",
            ]
        for img in self.images:
            lines += [
                "[[image]]",
                f'name = "{img.name}"',
                f'path = "{img.path}"',
                f'format = "{img.fmt}"',
            ]
            if img.list_file:
                lines.append(f'list_file = "{img.list_file}"')
            if img.list_redis:
                lines.append(f'list_redis = "{img.list_redis}"')
        self.config.write_text("\n".join(lines) + "\n")

    def start(self) -> None:
        self.write_config()
        env = dict(os.environ)
        env.pop("NOTIFY_SOCKET", None)
        env.update(self.env)
        cmd = [str(server_binary()), "run", "--config", str(self.config)]
        if self.run_as:
            uid, gid = self.run_as
            for d in (self.dir, self.dir / "run", self.dir / "cache"):
                d.mkdir(parents=True, exist_ok=True)
                os.chown(d, uid, gid)
            cmd = [
                "setpriv",
                f"--reuid={uid}",
                f"--regid={gid}",
                "--clear-groups",
                "--inh-caps=-all",
                "--bounding-set=-all",
                *cmd,
            ]
        logf = open(self.log, "ab")  # noqa: SIM115 - handed to the child
        self.proc = subprocess.Popen(cmd, stdout=logf, stderr=logf, env=env)
        logf.close()
        wait_for(
            lambda: self.control.exists() or self.proc is None or self.proc.poll() is not None,
            20,
            "control socket",
        )
        assert self.proc.poll() is None, f"server died:\n{self.log_text()}"

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def status(self) -> dict[str, Any]:
        k, body = psc.control_request(self.control, psc.MSG_STATUS_REQ)
        assert k == psc.MSG_STATUS_REPLY
        data: dict[str, Any] = json.loads(body)
        return data

    def metrics(self) -> str:
        """The Prometheus text of its metrics endpoint."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as r:
            text: str = r.read().decode()
        return text

    def image(self, name: str) -> dict[str, Any]:
        img: dict[str, Any] = next(i for i in self.status()["images"] if i["name"] == name)
        return img

    def wait_generation(self, name: str, gen: int, timeout: float = 120) -> dict[str, Any]:
        def ok() -> dict[str, Any] | None:
            i = self.image(name)
            return i if (i["generation"] or 0) >= gen and not i["loading"] else None

        result: dict[str, Any] = wait_for(ok, timeout, f"{name} generation {gen}")
        return result

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        rc = self.proc.returncode
        self.proc = None
        return rc


# --------------------------------------------------------------------------- lists


def raw_copy(image: Path, dest: Path) -> Path:
    """qemu-img convert -O raw (sparse): the virtual disk as a plain file."""
    if not dest.exists():
        tmp = dest.with_suffix(".tmp")
        subprocess.run(["qemu-img", "convert", "-O", "raw", str(image), str(tmp)], check=True)
        tmp.rename(dest)
    return dest


def content_sha256(raw: Path) -> str:
    h = hashlib.sha256()
    with open(raw, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


def nonzero_blocks(raw: Path, limit: int, stride: int = 1, start: int = 0) -> dict[int, str]:
    """Real blocks of the image: the first ``limit`` non-zero 4 KiB blocks
    (every ``stride``-th), as sector -> sha256 (what analyze-image lists)."""
    zero = bytes(4096)
    out: dict[int, str] = {}
    n = 0
    with open(raw, "rb") as f:
        # Skip holes quickly with SEEK_DATA.
        fd = f.fileno()
        size = os.fstat(fd).st_size
        off = start
        while off < size and len(out) < limit:
            try:
                data_off = os.lseek(fd, off, os.SEEK_DATA)
            except OSError:
                break
            off = data_off - data_off % 4096
            f.seek(off)
            chunk = f.read(1 << 20)
            if not chunk:
                break
            for i in range(0, len(chunk) - 4095, 4096):
                b = chunk[i : i + 4096]
                if b != zero:
                    if n % stride == 0:
                        out[(off + i) // 512] = hashlib.sha256(b).hexdigest()
                        if len(out) >= limit:
                            break
                    n += 1
            off += len(chunk)
    return out


def make_list(
    identity: sectorlist.ImageIdentity, blocks: dict[int, str], path: Path, generator: str = "test"
) -> sectorlist.SectorList:
    sl = sectorlist.SectorList(
        image=identity,
        blocks=dict(blocks),
        generator=generator,
        criteria="test blocks",
        runs="none",
    )
    sectorlist.write(sl, path)
    return sl


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0
