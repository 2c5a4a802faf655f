"""Never wrong data: reads through the pageshare filter equal the disk chain.

The patched qemu-io (qemu-patches/build.py) reads and writes an overlay of
the project's small golden image whose backing child is the pageshare
filter, in copy mode (process_vm_readv from the page server: the whole
filter logic runs on a stock kernel) with x-any-buffer (qemu-io's buffers
are not guest RAM).  A real pageshare-server serves a list of real
non-zero blocks of the image.  The server is stopped, restarted, killed
with SIGKILL in the middle of a batch of reads and hot-reloaded with
another list while one qemu-io process keeps going.  Every read is
compared with

* a model of the chain: the base image's bytes plus every write made, and
* the same offsets read by the stock qemu-io (Debian's, no filter) from the
  same overlay after a flush,

and at the end the patched qemu-img compares the whole disk through the
filter with the overlay read by the stock tools.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import threading
from pathlib import Path

import pytest
from page_server_helpers import (
    ImageSpec,
    Server,
    content_sha256,
    make_list,
    nonzero_blocks,
    raw_copy,
    wait_for,
)
from pageshare import golden
from pageshare.lists import sectorlist
from qemu_helpers import (
    DiskModel,
    QemuIo,
    dump_range,
    image_opts,
    qemu_build,
    trace_counters,
)

pytestmark = pytest.mark.build

assert os.geteuid() == 0, "copy mode reads the page server's memory: run as root"

STOCK_QEMU_IO = "/usr/bin/qemu-io"
SCALE = 3  # operations per batch = SCALE x the numbers below
TRACE = [
    "pageshare_close",
    "pageshare_table",
    "pageshare_connect",
    "pageshare_disconnect",
    "pageshare_no_table",
    "pageshare_table_refused",
]


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    image = golden.build_image("small").path
    raw = raw_copy(image, tmp_path_factory.mktemp("small") / "small.raw")
    return image, raw, content_sha256(raw)


class Workload:
    """Random reads and writes, with every read checked against the model
    and (per batch) against the stock qemu-io."""

    def __init__(
        self, rnd: random.Random, qio: QemuIo, model: DiskModel, ovl: Path, listed: list[int]
    ) -> None:
        self.rnd, self.qio, self.model, self.ovl = rnd, qio, model, ovl
        self.listed = listed  # listed 4 KiB block numbers
        self.reads = 0
        self.bytes = 0
        self.writes = 0
        self.write_log: list[tuple[int, int]] = []  # (offset, length) in order
        self.compared = 0  # reads equal to stock's

    def _read_cmd(self) -> tuple[str, int, int]:
        r = self.rnd
        kind = r.random()
        blk = r.choice(self.listed)
        if kind < 0.45:  # aligned, whole listed blocks
            off, n = blk * 4096, r.randint(1, 24) * 4096
            return f"read -v {off} {n}", off, n
        if kind < 0.65:  # misaligned start and length
            off = blk * 4096 + r.randrange(0, 4096, 512)
            n = r.randrange(512, 48 * 1024, 512)
            return f"read -v {off} {n}", off, n
        if kind < 0.72:  # byte granular
            off = blk * 4096 + r.randrange(0, 4096)
            n = r.randrange(1, 20000)
            return f"read -v {off} {n}", off, n
        if kind < 0.88:  # several iov elements, some split pages
            off = blk * 4096 - r.choice([0, 0, 512, 2048])
            off = max(off, 0)
            parts = [
                r.choice([512, 1024, 2048, 3584, 4096, 8192, 12288]) for _ in range(r.randint(2, 6))
            ]
            return f"readv -v {off} {' '.join(map(str, parts))}", off, sum(parts)
        off = r.randrange(0, self.model.size - 65536, 512)  # anywhere
        n = r.randrange(512, 65536, 512)
        return f"read -v {off} {n}", off, n

    def _write_cmd(self) -> tuple[str, int, bytes]:
        r = self.rnd
        blk = r.choice(self.listed)
        off = blk * 4096 + r.choice([0, 0, 512, 2048, 3072])
        n = r.choice([512, 2048, 4096, 8192, 6144, 16384])
        pat = r.randrange(1, 256)
        return f"write -P {pat} {off} {n}", off, bytes([pat]) * n

    def batch(self, ops: int) -> list[tuple[int, int, bytes, int]]:
        """Run ``ops`` operations; returns the reads (offset, length, data)."""
        done: list[tuple[int, int, bytes, int]] = []
        for _ in range(ops):
            if self.rnd.random() < 0.2:
                cmd, off, data = self._write_cmd()
                out = self.qio.cmd(cmd)
                assert "wrote" in out, f"{cmd}: {out}"
                self.model.write(off, data)
                self.write_log.append((off, len(data)))
                self.writes += 1
                continue
            cmd, off, n = self._read_cmd()
            out = self.qio.cmd(cmd)
            assert "read " in out and "bytes at offset" in out, f"{cmd}: {out[-500:]}"
            got = dump_range(out, off, n)
            want = self.model.read(off, n)
            if got != want:
                bad = next(i for i in range(n) if got[i] != want[i])
                raise AssertionError(
                    f"{cmd}: wrong data at offset {off + bad} (block {(off + bad) // 4096})"
                )
            done.append((off, n, got, len(self.write_log)))
            self.reads += 1
            self.bytes += n
        return done

    def check_with_stock(self, reads: list[tuple[int, int, bytes, int]]) -> None:
        """The same offsets through Debian's qemu-io, no filter, after the
        batch: equal to what the filter returned where no later write of
        the batch touched the range, and to the model everywhere."""
        out = self.qio.cmd("flush")
        assert "error" not in out.lower(), out
        args = [STOCK_QEMU_IO, "-U", "-r", "-f", "qcow2", str(self.ovl)]
        for off, n, _, _ in reads:
            args += ["-c", f"read -v {off} {n}"]
        p = subprocess.run(args, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr
        # Each command's dump starts at its own offset; split by the report lines.
        chunks = p.stdout.split("bytes at offset")
        assert len(chunks) == len(reads) + 1, p.stdout[-2000:]
        for (off, n, got, nwrites), text in zip(reads, chunks[:-1], strict=True):
            stock = dump_range(text, off, n)
            assert stock == self.model.read(off, n), f"model and stock disagree at {off}+{n}"
            later = self.write_log[nwrites:]
            if not any(wo < off + n and off < wo + wn for wo, wn in later):
                assert stock == got, f"stock qemu-io disagrees at {off}+{n}"
                self.compared += 1


def restart(server: Server) -> None:
    """Start the server again; a SIGKILLed one leaves its socket files
    behind, and a stale control socket would look like a ready server."""
    server.stop(signal.SIGKILL)
    for sock in (server.dir / "run").glob("*.sock"):
        sock.unlink()
    server.start()
    server.wait_generation("small", 1)


@pytest.mark.parametrize("overlay_kind", ["plain", "subclusters"])
def test_reads_through_the_filter_equal_the_disk_chain(
    small: tuple[Path, Path, str], tmp_path: Path, overlay_kind: str
) -> None:
    image, raw, sha = small
    q = qemu_build()
    ident = sectorlist.ImageIdentity(raw.stat().st_size, sha, image.name)

    # Two lists of real non-zero blocks, overlapping, for a hot reload.
    blocks_a = nonzero_blocks(raw, 2500, stride=2)
    blocks_b = nonzero_blocks(raw, 2500, stride=3)
    lst = tmp_path / "small.pcsl"
    make_list(ident, blocks_a, lst)
    listed = sorted({s // 8 for s in blocks_a} | {s // 8 for s in blocks_b})

    server = Server(tmp_path / "server", [ImageSpec("small", image, list_file=lst)])
    server.start()
    try:
        server.wait_generation("small", 1)
        sock = server.sock("small")

        ovl = tmp_path / "ovl.qcow2"
        opts = ["-o", "extended_l2=on,cluster_size=64k"] if overlay_kind == "subclusters" else []
        subprocess.run(
            [
                "qemu-img",
                "create",
                "-q",
                "-f",
                "qcow2",
                *opts,
                "-b",
                str(image),
                "-F",
                "qcow2",
                str(ovl),
            ],
            check=True,
        )

        filter_opts: dict[str, object] = {
            "mode": "copy",
            "x-any-buffer": True,
            "reconnect-delay": 1,
            "image-sha256": sha,
        }
        spec = image_opts(ovl, image, server=sock, opts=filter_opts)
        argv = [q.qemu_io, *(a for t in TRACE for a in ("-T", t)), "--image-opts", spec]
        qio = QemuIo(argv, stderr_path=tmp_path / "qemu-io.stderr")
        qio.start()
        model = DiskModel(raw)
        wl = Workload(random.Random(f"integrity-{overlay_kind}"), qio, model, ovl, listed)
        try:
            # 1. Served.
            wl.check_with_stock(wl.batch(40 * SCALE))
            # 2. Server stopped: everything from disk, nothing fails.
            server.stop(signal.SIGTERM)
            wl.check_with_stock(wl.batch(25 * SCALE))
            # 3. Back: the filter reconnects by itself (reconnect-delay 1 s).
            restart(server)
            qio.idle(2.5)
            wl.check_with_stock(wl.batch(40 * SCALE))

            # 4. SIGKILL in the middle of a batch of reads.
            def kill() -> None:
                if server.proc:
                    server.proc.send_signal(signal.SIGKILL)

            killer = threading.Timer(random.Random(7).uniform(0.05, 0.4), kill)
            killer.start()
            wl.check_with_stock(wl.batch(40 * SCALE))
            killer.join()
            restart(server)
            qio.idle(2.5)
            wl.check_with_stock(wl.batch(30 * SCALE))
            # 5. Hot reload with another list: a new generation mid-run.
            make_list(ident, blocks_b, lst)
            server.wait_generation("small", 2)
            qio.idle(1.0)
            wl.check_with_stock(wl.batch(40 * SCALE))
            # 6. And once more killed while idle, back, read again.
            server.stop(signal.SIGKILL)
            wl.check_with_stock(wl.batch(15 * SCALE))
            restart(server)
            qio.idle(2.5)
            wl.check_with_stock(wl.batch(30 * SCALE))
            assert qio.close() == 0, qio.stderr()[-3000:]
        finally:
            qio.kill()
            model.close()

        log = qio.stderr()
        c = trace_counters(log)
        # The filter really worked in between the outages.
        assert c["merged"] > 500, (c, log[-3000:])
        assert c["hits"] >= c["merged"]
        assert c["no_table"] > 0, c  # reads while the server was gone
        assert c["connects"] >= 4, c  # start + three reconnects
        assert c["failed"] < c["merged"] // 10, c
        assert "generation 2" in log, log[-3000:]
        assert wl.compared > wl.reads // 2, (wl.compared, wl.reads)
        print(
            f"{wl.reads} reads ({wl.bytes >> 20} MiB, {wl.compared} compared byte for byte "
            f"with the stock qemu-io), {wl.writes} writes; filter: {c}"
        )

        # 7. The whole disk through the filter equals the overlay read by the stock tools.
        wait_for(server.alive, 5, "server")
        p = subprocess.run(
            [
                q.qemu_img,
                "compare",
                "-U",
                "--image-opts",
                spec,
                f"driver=qcow2,file.driver=file,file.filename={ovl}",
            ],
            capture_output=True,
            text=True,
            timeout=1200,
        )
        assert p.returncode == 0, p.stdout + p.stderr
        assert "Images are identical" in p.stdout
    finally:
        server.stop(signal.SIGKILL)


def test_the_server_hears_each_connections_own_counters(
    small: tuple[Path, Path, str], tmp_path: Path
) -> None:
    """PROTOCOL.md's STATS: a client's counters for this connection.  After a
    reconnect the new server must not be told of the reads made before it,
    through the old connection or with none: those were the old server's,
    or nobody's."""
    image, raw, sha = small
    q = qemu_build()
    ident = sectorlist.ImageIdentity(raw.stat().st_size, sha, image.name)
    listed_sectors = nonzero_blocks(raw, 2500, stride=2)
    lst = tmp_path / "small.pcsl"
    make_list(ident, listed_sectors, lst)
    listed = {s // 8 for s in listed_sectors}
    unlisted = [b for b in range(raw.stat().st_size // 4096) if b not in listed][:60]

    server = Server(tmp_path / "server", [ImageSpec("small", image, list_file=lst)])
    server.start()
    try:
        server.wait_generation("small", 1)
        ovl = tmp_path / "ovl.qcow2"
        subprocess.run(
            ["qemu-img", "create", "-q", "-f", "qcow2", "-b", str(image), "-F", "qcow2", str(ovl)],
            check=True,
        )
        spec = image_opts(
            ovl,
            image,
            server=server.sock("small"),
            opts={"mode": "copy", "x-any-buffer": True, "reconnect-delay": 1, "image-sha256": sha},
        )
        qio = QemuIo([q.qemu_io, "--image-opts", spec], stderr_path=tmp_path / "qemu-io.stderr")
        qio.start()
        try:

            def read_blocks(blocks: list[int]) -> None:
                for b in blocks:
                    out = qio.cmd(f"read {b * 4096} 4096")
                    assert "read 4096/4096 bytes" in out, out

            def heard() -> dict[str, int]:
                stats: dict[str, int] = server.image("small")["client_stats"]
                return stats

            # Through the first connection: 20 unlisted blocks, each one
            # lookup and one fallback; then 10 with no server at all.
            read_blocks(unlisted[:20])
            wait_for(lambda: heard()["lookups"] == 20, 20, "the first STATS")
            assert heard()["fallbacks"] == 20, heard()
            server.stop(signal.SIGTERM)
            read_blocks(unlisted[20:30])
            # A new server: it hears of the 30 blocks read since the filter
            # reconnected, and of nothing before.
            restart(server)
            qio.idle(2.5)
            read_blocks(unlisted[30:60])
            wait_for(lambda: heard()["lookups"] == 30, 20, "a STATS with the 30 reads")
            got = heard()
            assert got["fallbacks"] == 30 and got["hits"] == 0 and got["merged"] == 0, got
            assert qio.close() == 0, qio.stderr()[-3000:]
        finally:
            qio.kill()
    finally:
        server.stop()
