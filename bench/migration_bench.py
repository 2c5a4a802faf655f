#!/usr/bin/env python3
"""Live migration of a pageshare guest: block references against QEMU's
own ways of sending less (issue 21's measurement, copy mode on this host).

One page server serves every non-zero block of the small golden image (a
list that covers the whole workload: the best case for references, said
so in the results).  For each configuration, in one run, a fresh guest
boots from a qcow2 overlay through the filter (mode=copy: process_vm_readv
from the server, what runs on a stock kernel; the guest's pages are its
own copies, as after merge mode's copy-on-write), reads every file under
/usr (its RAM is then mostly page cache of listed blocks), and is migrated
over a Unix socket at a fixed bandwidth to a second QEMU with the same
graph and `-incoming defer`:

  precopy        QEMU's default
  xbzrle         xbzrle, 256 MiB cache
  multifd-zstd   multifd, 2 channels, zstd
  refs           block-refs
  refs-multifd   block-refs with multifd, 2 channels, zstd

Recorded per migration: bytes on the wire (query-migrate ram.transferred),
total time, downtime, setup time, pages sent as references, the CPU time
of both QEMU processes from `migrate` to completion (utime + stime of the
whole process: the idle guest's vCPU thread is in it on both sides), and
the filter's counters (pages it filled on the source, references sent,
refused, resolved on the destination).  Configurations run in the order
given and then reversed (--rounds 2), so that a drift of the host shows.

Usage:
  sudo .venv/bin/python bench/migration_bench.py [--rounds 2]
      [--bandwidth-mbit 1000] [--configs precopy,refs,...] [--out DIR]

Writes DIR/results.json (one object per migration) and DIR/summary.md;
DIR defaults to bench/results/migration-<date>.  About 2.5 minutes per
migration under TCG (boot, reading /usr, the migration).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from pageshare import golden
from pageshare.analysis.vm import choose_accel
from pageshare.analysis.workload import Markers, Workload, script
from pageshare.host.qmp import QMP
from pageshare.image.image_inspect import inspect_image
from pageshare.lists import sectorlist
from pageshare_tools.qemu_guest import (
    Guest,
    QemuBuild,
    blockdev_args,
    guest_cmd,
    make_overlay,
    make_signal_disk,
    qemu_build,
    signal_disk_blockdev,
    signal_guest,
    start_qemu,
    wait_for,
)
from pageshare_tools.qemu_guest import ps_stats as ps
from pageshare_tools.server_process import (
    ImageSpec,
    Server,
    content_sha256,
    make_list,
    nonzero_blocks,
    raw_copy,
)

REPO = Path(__file__).resolve().parents[1]
CLK_TCK = os.sysconf("SC_CLK_TCK")

# capabilities and parameters of each configuration (both sides get both)
CONFIGS: dict[str, tuple[list[str], dict[str, Any]]] = {
    "precopy": ([], {}),
    "xbzrle": (["xbzrle"], {"xbzrle-cache-size": 256 << 20}),
    "multifd-zstd": (["multifd"], {"multifd-channels": 2, "multifd-compression": "zstd"}),
    "refs": (["block-refs"], {}),
    "refs-multifd": (
        ["block-refs", "multifd"],
        {"multifd-channels": 2, "multifd-compression": "zstd"},
    ),
}

# The guest reads every file under /usr, says how much it caches, then
# waits (idle) for the host's word on vdb while it is migrated.
READ_ALL = (
    "find /usr -xdev -type f -exec cat {} + > /dev/null 2>&1; "
    "echo 1 > /proc/sys/vm/compact_memory 2>/dev/null; "
    "grep -E '^(MemFree|Cached):' /proc/meminfo; echo read-done"
)


def log(msg: str) -> None:
    print(f"[migration_bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


class Bench:
    def __init__(self, out: Path, bandwidth: int) -> None:
        self.out = out
        self.bandwidth = bandwidth
        self.q: QemuBuild = qemu_build()
        self.image = golden.build_image("small").path
        self.raw = raw_copy(self.image, out / "small.raw")
        self.insp = inspect_image(self.image, "qcow2", self.raw.stat().st_size)
        self.accel, _ = choose_accel("auto", self.insp.kernel)
        blocks = nonzero_blocks(self.raw, 1 << 40)
        self.listed = len(blocks)
        lst = out / "small.pcsl"
        make_list(
            sectorlist.ImageIdentity(
                self.raw.stat().st_size, content_sha256(self.raw), self.image.name
            ),
            blocks,
            lst,
        )
        self.server = Server(out / "server", [ImageSpec("small", self.image, list_file=lst)])
        self.server.start()
        self.server.wait_generation("small", 1)
        self.markers = Markers.new()
        self.workload = out / "workload.sh"
        self.workload.write_text(script(Workload(f"{READ_ALL}; {wait_for('GO')}"), self.markers))

    def guest(self, name: str, ovl: Path, go: Path, *extra: str) -> Guest:
        d = self.out / name
        serial, qmp_path, qlog = (
            d.with_suffix(".serial"),
            d.with_suffix(".qmp"),
            d.with_suffix(".log"),
        )
        for p in (serial, qmp_path):
            p.unlink(missing_ok=True)
        disks = [
            *blockdev_args(self.image, ovl, self.server.sock("small"), mode="copy"),
            *signal_disk_blockdev(go),
            "-device",
            "virtio-blk-pci,drive=ovl,id=disk0",
            "-device",
            "virtio-blk-pci,drive=go,id=disk1",
        ]
        cmd = [
            *guest_cmd(
                self.q,
                self.insp,
                self.accel,
                serial=serial,
                qmp=qmp_path,
                workload=self.workload,
                disks=disks,
            ),
            *extra,
        ]
        proc = start_qemu(cmd, qlog)
        return Guest(proc, QMP(qmp_path, timeout=60), serial, qlog)

    def configure(self, g: Guest, config: str) -> None:
        caps, params = CONFIGS[config]
        if caps:
            g.qmp.command(
                "migrate-set-capabilities",
                capabilities=[{"capability": c, "state": True} for c in caps],
            )
        if params:
            g.qmp.command("migrate-set-parameters", **params)

    def migrate(self, config: str, rnd: int) -> dict[str, Any]:
        tag = f"{config}-r{rnd}"
        ovl, go = self.out / f"{tag}.qcow2", self.out / f"{tag}.go"
        make_overlay(self.image, ovl, self.q.qemu_img)
        make_signal_disk(go)
        src: Guest | None = None
        dst: Guest | None = None
        try:
            src = self.guest(f"{tag}-src", ovl, go)
            deadline = time.monotonic() + 900
            text = ""
            while "read-done" not in text:
                assert src.proc.poll() is None, src.log.read_text(errors="replace")[-2000:]
                assert time.monotonic() < deadline, f"{tag}: guest never read /usr"
                time.sleep(2)
                text = src.serial.read_text(errors="replace") if src.serial.exists() else ""
            meminfo = {
                ln.split()[0].rstrip(":"): int(ln.split()[1])
                for ln in text.splitlines()
                if ln.startswith(("MemFree:", "Cached:"))
            }
            uri = f"unix:{self.out / (tag + '.mig')}"
            dst = self.guest(f"{tag}-dst", ovl, go, "-incoming", "defer")
            for g in (src, dst):
                self.configure(g, config)
            src.qmp.command("migrate-set-parameters", **{"max-bandwidth": self.bandwidth})
            dst.qmp.command("migrate-incoming", uri=uri)
            src_ps0 = ps(src.qmp)
            c0 = (cpu_seconds(src.proc.pid), cpu_seconds(dst.proc.pid))
            t0 = time.monotonic()
            src.qmp.command("migrate", uri=uri)
            while (info := src.qmp.command("query-migrate"))["status"] not in (
                "completed",
                "failed",
                "cancelled",
            ):
                assert time.monotonic() - t0 < 900, f"{tag}: migration still {info['status']}"
                time.sleep(0.2)
            c1 = (cpu_seconds(src.proc.pid), cpu_seconds(dst.proc.pid))
            assert info["status"] == "completed", (
                f"{tag}: {info}\n" + dst.log.read_text(errors="replace")[-2000:]
            )
            deadline = time.monotonic() + 60
            while dst.qmp.command("query-status")["status"] != "running":
                assert time.monotonic() < deadline, f"{tag}: destination not running"
                time.sleep(0.2)
            signal_guest(go, b"GO")
            ram = info["ram"]
            src_ps, dst_ps = ps(src.qmp), ps(dst.qmp)
            return {
                "config": config,
                "round": rnd,
                "transferred": ram["transferred"],
                "total_time_ms": info["total-time"],
                "downtime_ms": info.get("downtime"),
                "setup_time_ms": info.get("setup-time"),
                "normal_pages": ram["normal"],
                "zero_pages": ram["duplicate"],
                "block_ref_pages": ram.get("block-ref-pages", 0),
                "src_cpu_s": round(c1[0] - c0[0], 2),
                "dst_cpu_s": round(c1[1] - c0[1], 2),
                "guest_cached_kib": meminfo.get("Cached"),
                "guest_free_kib": meminfo.get("MemFree"),
                "filled_by_filter": src_ps0["merged"],
                "refs_sent": src_ps["migration-refs-sent"],
                "refs_refused": src_ps["migration-refs-refused"],
                "refs_copied": dst_ps["migration-refs-copied"],
                "refs_merged": dst_ps["migration-refs-merged"],
                "refs_read": dst_ps["migration-refs-read"],
                "refs_failed": dst_ps["migration-refs-failed"],
            }
        finally:
            for vm in (src, dst):
                if vm:
                    vm.kill()
            ovl.unlink(missing_ok=True)

    def close(self) -> None:
        self.server.stop(signal.SIGKILL)


def summary(rows: list[dict[str, Any]], bench: Bench, args: argparse.Namespace) -> str:
    by: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by.setdefault(r["config"], []).append(r)
    base = by.get("precopy")

    def med(rs: list[dict[str, Any]], k: str) -> float:
        return float(statistics.median(r[k] for r in rs))

    lines = [
        f"Command: `sudo .venv/bin/python bench/migration_bench.py --rounds {args.rounds} "
        f"--bandwidth-mbit {args.bandwidth_mbit} --configs {','.join(args.configs)}`",
        "",
        f"Listed blocks: {bench.listed} (every non-zero block of the small image).",
        "",
        "| configuration | runs | MiB on the wire | total s | downtime ms | "
        "setup ms | CPU src s | CPU dst s | pages as refs | refs refused | "
        "vs precopy: bytes, time |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, rs in by.items():
        rel = ""
        if base:
            rel = (
                f"{100 * (1 - med(rs, 'transferred') / med(base, 'transferred')):.0f} %, "
                f"{100 * (1 - med(rs, 'total_time_ms') / med(base, 'total_time_ms')):.0f} %"
            )
        lines.append(
            f"| {name} | {len(rs)} | {med(rs, 'transferred') / 2**20:.1f} | "
            f"{med(rs, 'total_time_ms') / 1000:.1f} | {med(rs, 'downtime_ms'):.0f} | "
            f"{med(rs, 'setup_time_ms'):.0f} | {med(rs, 'src_cpu_s'):.1f} | "
            f"{med(rs, 'dst_cpu_s'):.1f} | {med(rs, 'block_ref_pages'):.0f} | "
            f"{med(rs, 'refs_refused'):.0f} | {rel} less |"
        )
    lines += ["", "Medians over the rounds; every run is in results.json."]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--bandwidth-mbit",
        type=int,
        default=1000,
        help="max-bandwidth of every migration, Mbit/s (default 1000)",
    )
    ap.add_argument("--configs", type=lambda s: s.split(","), default=list(CONFIGS))
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    bad = [c for c in args.configs if c not in CONFIGS]
    if bad:
        ap.error(f"unknown configuration(s) {bad}; known: {', '.join(CONFIGS)}")
    if os.geteuid() != 0:
        ap.error("run as root: copy mode reads the page server's memory")
    out = args.out or REPO / "bench" / "results" / f"migration-{time.strftime('%Y%m%d-%H%M')}"
    out.mkdir(parents=True, exist_ok=True)
    bench = Bench(out, args.bandwidth_mbit * 1_000_000 // 8)
    rows: list[dict[str, Any]] = []
    try:
        for rnd in range(args.rounds):
            order = args.configs if rnd % 2 == 0 else list(reversed(args.configs))
            for config in order:
                log(f"round {rnd + 1}: {config}")
                row = bench.migrate(config, rnd)
                log(json.dumps(row))
                rows.append(row)
                (out / "results.json").write_text(json.dumps(rows, indent=1) + "\n")
    finally:
        bench.close()
        for p in out.glob("*.raw"):
            p.unlink()
    text = summary(rows, bench, args)
    (out / "summary.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
