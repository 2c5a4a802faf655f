#!/usr/bin/env python3
"""Per-request cost of the pageshare filter, measured with qemu-img bench.

    .venv/bin/python qemu-patches/bench.py [--rounds 7] [--count 200000]

One base image (64 MiB of random data, qcow2), an empty qcow2 overlay on
it, and a real pageshare-server serving it.  qemu-img bench (the patched
build) reads the overlay 4 KiB at a time, sequentially, one request in
flight (-d 1), so the time per request is the latency of a 4 KiB read
through the whole block layer.  The graphs, run interleaved round by round
in the same process tree so that they see the same machine:

  none        overlay <- base                      (no filter)
  no-table    overlay <- pageshare <- base          server absent: the fast path
  not-listed  ... table with 1 block: every lookup misses
  not-ram     ... every block listed; qemu-img's buffers are not guest RAM
              (the per-block lookup + RAM check + fallback read: the
              "reads it cannot merge" of the talk)
  copy        ... every block listed, mode=copy, x-any-buffer=on: every
              request is served by process_vm_readv(2) from the server
              instead of a read (the merged read, in its stock-kernel form)

With --counting both, every filter graph also runs with count-reads=off
(as "<graph>:off"), interleaved with the others, and a last table gives
the cost of the filter's read counting per graph (on against off).

Two bases:

  shm     the overlay (no backing file in its header) over a raw copy of
          the base on tmpfs (/dev/shm; a read is a memcpy from the page
          cache): little is left but the block layer's own path, so the
          filter's cost per request shows up in absolute terms.  (This was
          a null-co base until the filter began to require proof that the
          server verified the very file below it: null-co is no file, so
          its tables are never used.)
  qcow2   the real chain, cache=writeback (the base in the host page
          cache) and cache=none (O_DIRECT reads from the disk): realistic
          per-request times, where the filter's cost is within the noise of
          a shared host

Prints medians and minima in microseconds per request (wall time from
qemu-img bench, and the CPU time of all qemu-img threads from wait4), and
the difference against "none".
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
import build  # noqa: E402  (qemu-patches/build.py, this script's neighbour)

SIZE = 64 << 20


def run_bench(qemu_img: str, spec: str, count: int, cache: str) -> tuple[float, float]:
    """(wall seconds, CPU seconds of all of qemu-img's threads) per request.

    The wall time is what qemu-img bench reports; the CPU time (user + sys
    from wait4) does not grow while the process waits for a CPU, so it is
    the steadier measure on a shared host."""
    p = subprocess.Popen(
        [
            qemu_img,
            "bench",
            "-c",
            str(count),
            "-d",
            "1",
            "-s",
            "4096",
            "-S",
            "4096",
            "-t",
            cache,
            "--image-opts",
            spec,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert p.stdout
    out = p.stdout.read()
    _, status, ru = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        raise SystemExit(f"qemu-img bench failed: {out}")
    m = re.search(r"Run completed in ([0-9.]+) seconds", out)
    assert m, out
    return float(m.group(1)) / count, (ru.ru_utime + ru.ru_stime) / count


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument(
        "--count-shm", type=int, default=300_000, help="requests per run (raw base on tmpfs)"
    )
    ap.add_argument("--count", type=int, default=50_000, help="requests per run (writeback)")
    ap.add_argument("--count-direct", type=int, default=10_000, help="requests per run (none)")
    ap.add_argument("--json", type=Path, help="also write the raw samples here")
    ap.add_argument("--only", choices=["shm", "qcow2"], help="one base only")
    ap.add_argument(
        "--counting",
        choices=["on", "off", "both"],
        default="on",
        help="the filter's count-reads option (both: each graph with and "
        "without, compared at the end)",
    )
    a = ap.parse_args()

    from pageshare.lists import sectorlist
    from pageshare_tools.server_process import ImageSpec, Server, make_list

    out = build.ensure_built()
    qemu_img = str(out / "bin" / "qemu-img")
    tmp = Path(tempfile.mkdtemp(prefix="pageshare-bench-", dir="/var/tmp"))
    shm = Path(tempfile.mkdtemp(prefix="pageshare-bench-", dir="/dev/shm"))
    server = None
    try:
        data = random.Random(1).randbytes(SIZE)
        raw = tmp / "base.raw"
        raw.write_bytes(data)
        shm_raw = shm / "base.raw"
        shm_raw.write_bytes(data)
        base = tmp / "base.qcow2"
        subprocess.run([qemu_img, "convert", "-q", "-O", "qcow2", str(raw), str(base)], check=True)
        ovl = tmp / "ovl.qcow2"
        subprocess.run(
            [qemu_img, "create", "-q", "-f", "qcow2", "-b", str(base), "-F", "qcow2", str(ovl)],
            check=True,
        )
        ovl_nb = tmp / "ovl-nobacking.qcow2"
        subprocess.run(
            [qemu_img, "create", "-q", "-f", "qcow2", str(ovl_nb), str(SIZE)], check=True
        )
        ident = sectorlist.ImageIdentity(SIZE, hashlib.sha256(data).hexdigest(), "bench")
        all_blocks = {
            b * 8: hashlib.sha256(data[b * 4096 : (b + 1) * 4096]).hexdigest()
            for b in range(SIZE // 4096)
        }
        lists = {"one": {8: all_blocks[8]}, "all": all_blocks}
        for name, blocks in lists.items():
            make_list(ident, blocks, tmp / f"{name}.pcsl")
        # the same lists serve both bases: same virtual content
        server = Server(
            tmp / "server",
            [
                ImageSpec("one", base, list_file=tmp / "one.pcsl"),
                ImageSpec("all", base, list_file=tmp / "all.pcsl"),
                ImageSpec("one-shm", shm_raw, list_file=tmp / "one.pcsl", fmt="raw"),
                ImageSpec("all-shm", shm_raw, list_file=tmp / "all.pcsl", fmt="raw"),
            ],
        )
        server.start()
        for name in ("one", "all", "one-shm", "all-shm"):
            server.wait_generation(name, 1)

        def spec(ps: dict[str, str] | None, on_shm: bool) -> str:
            if on_shm:
                s = f"driver=qcow2,file.driver=file,file.filename={ovl_nb}"
                bottom = f"driver=raw,file.driver=file,file.filename={shm_raw}"
            else:
                s = f"driver=qcow2,file.driver=file,file.filename={ovl}"
                bottom = "driver=qcow2"  # file name from the overlay's header
            if ps is None:
                return s + "," + ",".join("backing." + x for x in bottom.split(","))
            return (
                s
                + ",backing.driver=pageshare,"
                + ",".join(f"backing.{k}={v}" for k, v in ps.items())
                + ","
                + ",".join("backing.file." + x for x in bottom.split(","))
            )

        def variants(on_shm: bool) -> dict[str, str]:
            sfx = "-shm" if on_shm else ""
            graphs: dict[str, dict[str, str]] = {
                "no-table": {"server": str(tmp / "absent.sock"), "reconnect-delay": "0"},
                "not-listed": {"server": str(server.sock("one" + sfx))},
                "not-ram": {"server": str(server.sock("all" + sfx))},
                "copy": {
                    "server": str(server.sock("all" + sfx)),
                    "mode": "copy",
                    "x-any-buffer": "on",
                },
            }
            out = {"none": spec(None, on_shm)}
            for name, ps in graphs.items():
                if a.counting in ("on", "off"):
                    out[name] = spec({**ps, "count-reads": a.counting}, on_shm)
                else:
                    out[name] = spec({**ps, "count-reads": "on"}, on_shm)
                    out[name + ":off"] = spec({**ps, "count-reads": "off"}, on_shm)
            return out

        samples: dict[str, dict[str, dict[str, list[float]]]] = {}
        counts: dict[str, int] = {}
        for base_kind, cache, count in (
            ("shm", "writeback", a.count_shm),
            ("qcow2", "writeback", a.count),
            ("qcow2", "none", a.count_direct),
        ):
            if a.only and a.only != base_kind:
                continue
            var = variants(base_kind == "shm")
            key = f"{base_kind} cache={cache}"
            s = samples.setdefault(key, {"wall": {v: [] for v in var}, "cpu": {v: [] for v in var}})
            counts[key] = count
            run_bench(qemu_img, var["none"], count // 4, cache)  # warm-up
            for r in range(a.rounds):
                order = list(var)
                random.Random(r).shuffle(order)
                for v in order:
                    wall, cpu = run_bench(qemu_img, var[v], count, cache)
                    s["wall"][v].append(wall * 1e6)
                    s["cpu"][v].append(cpu * 1e6)
                print(f"[bench] {key} round {r + 1}/{a.rounds}", file=sys.stderr, flush=True)

        print(
            f"qemu-img bench -c N -d 1 -s 4096 -S 4096 (aio=threads), 64 MiB qcow2 base, "
            f"empty overlay, {a.rounds} interleaved rounds; us per request; "
            f"count-reads={a.counting}"
        )
        for key, s in samples.items():
            print(f"\n{key} (N={counts[key]} requests per run)")
            print(
                f"{'graph':<14} {'wall med':>8} {'wall min':>8} {'d med':>7} {'d med %':>8} "
                f"{'cpu med':>8} {'cpu min':>8} {'d med':>7} {'d med %':>8}"
            )
            wref = statistics.median(s["wall"]["none"])
            cref = statistics.median(s["cpu"]["none"])
            for v in s["wall"]:
                w, c = statistics.median(s["wall"][v]), statistics.median(s["cpu"][v])
                print(
                    f"{v:<14} {w:8.3f} {min(s['wall'][v]):8.3f} {w - wref:+7.3f} "
                    f"{(w / wref - 1) * 100:+7.1f}% {c:8.3f} {min(s['cpu'][v]):8.3f} "
                    f"{c - cref:+7.3f} {(c / cref - 1) * 100:+7.1f}%"
                )
        if a.counting == "both":
            print(
                "\nthe cost of counting: each graph with count-reads=on against =off "
                "(medians; the same rounds)"
            )
            print(
                f"{'base':<22} {'graph':<11} {'cpu on':>8} {'cpu off':>8} {'d':>7} {'d %':>7} "
                f"{'wall d':>7} {'wall d %':>8}"
            )
            for key, s in samples.items():
                for v in [x for x in s["cpu"] if x + ":off" in s["cpu"]]:
                    c_on = statistics.median(s["cpu"][v])
                    c_off = statistics.median(s["cpu"][v + ":off"])
                    w_on = statistics.median(s["wall"][v])
                    w_off = statistics.median(s["wall"][v + ":off"])
                    print(
                        f"{key:<22} {v:<11} {c_on:8.3f} {c_off:8.3f} {c_on - c_off:+7.3f} "
                        f"{(c_on / c_off - 1) * 100:+6.1f}% {w_on - w_off:+7.3f} "
                        f"{(w_on / w_off - 1) * 100:+7.1f}%"
                    )
        if a.json:
            a.json.write_text(json.dumps(samples, indent=1))
    finally:
        if server:
            server.stop(signal.SIGKILL)
        subprocess.run(["rm", "-rf", str(tmp), str(shm)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
