#!/usr/bin/env python3
"""Benchmark: booted guests sharing their page cache through the whole
stack, against KSM (the talk's evaluation 3).

One command:

    sudo .venv/bin/python bench/e2e_vs_ksm.py [--guests 3] [--observe 180]

It checks first what it can on this machine (root, the tools, a series
with merge_pages and a host config with KSM, host KSM if analyze-image must
run), then builds (all cached) the patched 6.12 kernel (plain config), the
small guest kernel of config/guest-bench.config, the patched QEMU and
pageshare-server, takes the golden image (default: the "small" variant) and
a list analyze-image made for it (run once and cached; by default with the
guests' own workload as analyze-image's --workload, --list-from boot for
its plain boot), and boots the patched kernel under TCG as a pageshare host,
KSM in merge mode, with all of it in its initramfs.  In that host
bench/e2e/driver.sh runs the same N guests and workload in each
configuration (none, ksm, ksm-advisor, pageshare, ksm-fpr,
pageshare-faults; see driver.sh) while kernel-syscall/tests/e2e_sampler.c
records, every second, from outside the guests: each QEMU's PSS and RSS, which guest
pages hold listed blocks, zeros or other data and which of them are shared
(KSM pages, by pagemap and kpageflags), ksmd's and the server's CPU, the
filter's merge counters and time, MemAvailable, khugepaged's collapses.
The driver refuses a host without the series or with KSM off, saves KSM's
settings and restores them on every way out.

Results go to --out (default bench/results/e2e-<date>/) as CSV:
samples_host.csv, samples_guest.csv, events.csv, guests.csv, plus
summary.json and summary.md (the table for docs/benchmarks.md) and the
host VM's whole serial log (serial.log.gz), from which all of it is parsed.
notebooks/e2e_vs_ksm.ipynb plots them.

The guests are booted Linux kernels (virtio-blk, the golden image's ext4
root mounted read-only, its own binaries run in a chroot, then most of /usr
read as `grep -r` does), nested under TCG in the TCG-booted host: see
docs/ARCHITECTURE.md ("End to end") for why not a full multi-user boot.
"""

from __future__ import annotations

import argparse
import base64
import csv
import dataclasses
import gzip
import hashlib
import itertools
import json
import os
import platform
import re
import shlex
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# e2e_migration is this script's neighbour (bench/, on sys.path as the
# script's directory; the tests put bench/ there through pytest's pythonpath).
import e2e_migration
from pageshare import cache, golden
from pageshare.lists import sectorlist
from pageshare_tools import ktestlib as ktest

REPO = Path(__file__).resolve().parents[1]

CONFIGS = ["none", "ksm", "ksm-advisor", "pageshare", "ksm-fpr", "pageshare-faults"]
# ksm-ptsN, pageshare-ptsN: "ksm" or "pageshare" with ksmd's pages_to_scan N
SCAN_RATE = re.compile(r"(ksm|pageshare)-pts(\d+)")
# NAME-rN: configuration NAME run again, a repeat of its own in the results
REPEAT = re.compile(r"(.+)-r(\d+)")
# --frontier: KSM alone at several scan rates and the advisor, pageshare with
# ksmd at the default and much lower, and "none" (the baseline the
# kworkers' and the machine's CPU are taken against)
FRONTIER = [
    "none",
    "ksm",
    "ksm-pts1000",
    "ksm-pts5000",
    "ksm-advisor",
    "pageshare",
    "pageshare-pts10",
    "pageshare-pts0",
]
PAGE = 4096
MIB = 2**20
GREP_DIRS = (
    "/mnt/usr/bin /mnt/usr/sbin /mnt/usr/lib/x86_64-linux-gnu /mnt/usr/lib/systemd "
    "/mnt/usr/lib/udev"
)
SUM_DIRS = "/mnt/usr/bin /mnt/usr/lib/x86_64-linux-gnu"
# --mixed: guests not in lockstep, guest i reading (and checksumming) the
# directories of MIXED[(i - 1) % 3] after a delay of its seconds; each
# shares part of its reads with each other guest
MIXED = [
    (GREP_DIRS, 0),
    ("/mnt/usr/bin /mnt/usr/sbin /mnt/usr/lib/systemd", 45),
    ("/mnt/usr/lib/x86_64-linux-gnu /mnt/usr/lib/udev /mnt/usr/sbin", 90),
]
GUEST_FIELDS = [
    "cfg",
    "t_ms",
    "guest",
    "qemu_cpu_ms",
    "rss_kb",
    "pss_kb",
    "present",
    "ksm",
    "listed",
    "listed_shared",
    "zero",
    "zero_shared",
    "other_shared",
    "requests",
    "merged",
    "merge_ns",
    "merge_failed",
    "not_listed",
    "full",
    "on_server",
    "stale",
    "stale_shared",
    "unshared_server",
    "unshared_replaced",
    "unshared_thp",
    "unshared_never",
    "anon_huge_kb",
]
# E2E-U: a listed guest page found replaced by another PFN after a sample saw
# it shared (e2e_sampler.c: follow_listed)
REPLACED_FIELDS = ["cfg", "t_ms", "guest", "offset", "pfn", "kpageflags", "was_pfn"]
# E2E-F: the filter's fallback counters, and the listed pages not shared by
# what the merge trace says of their address (e2e_sampler.c: follow_listed)
FALLBACK_FIELDS = [
    "cfg",
    "t_ms",
    "guest",
    "partial",
    "unaligned",
    "no_table",
    "not_ram",
    "merge_failed",
    "unsupported",
    "unproven",
    "merges_traced",
    "unshared_unmerged",
    "unshared_unseen",
    "batch1",
    "batch2",
    "batch4",
    "batch8",
    "batch16",
    "batch32",
    "batch64",
]
BATCH_FIELDS = FALLBACK_FIELDS[-7:]
# E2E-L: a listed page not shared at an address merged since a sample last
# saw it shared
LOST_FIELDS = ["cfg", "t_ms", "guest", "offset", "pfn", "kpageflags", "block", "ms_since_merge"]
HOST_FIELDS = [
    "cfg",
    "t_ms",
    "memavail_kb",
    "ksmd_cpu_ms",
    "server_cpu_ms",
    "server_rss_kb",
    "server_pss_kb",
    "pages_shared",
    "pages_sharing",
    "ksm_zero_pages",
    "merge_page_merged",
    "full_scans",
    "distinct_listed",
    "distinct_zero",
    "distinct_other",
    "sample_ms",
    "khugepaged_collapsed",
    "khugepaged_full_scans",
    "distinct_stale",
    "kworker_cpu_ms",
    "busy_cpu_ms",
    "sampler_cpu_ms",
    "mem_pages",
    "distinct_pages",
    "server_unused",
    "swap_used_kb",
]
# The guests' workload as analyze-image runs it in its Debian guests
# (--list-from workload): the same grep over the same directories.
LIST_WORKLOAD = "grep -r -q -F PAGESHARE-BENCH-NEVER-FOUND {dirs}; true"
KSM = Path("/sys/kernel/mm/ksm")
TOOLS = ("qemu-img", "qemu-system-x86_64", "gcc", "strip", "cpio", "gzip", "make", "cargo")


class BenchError(Exception):
    """The benchmark cannot run; the message says why and what to do."""


def log(msg: str) -> None:
    print(f"[e2e_vs_ksm] {msg}", file=sys.stderr, flush=True)


def page_hash(block: bytes) -> int:
    """64-bit FNV-1a over little-endian 64-bit words: e2e_sampler.c's page_hash()."""
    h = 0xCBF29CE484222325
    for (w,) in struct.iter_unpack("<Q", block):
        h = ((h ^ w) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def list_workload(grep_dirs: str) -> str:
    """analyze-image's --workload for --list-from workload: the guests' grep,
    on the image's own paths (the guests mount it on /mnt)."""
    dirs = " ".join(d.removeprefix("/mnt") for d in grep_dirs.split())
    return LIST_WORKLOAD.format(dirs=dirs)


def list_dir(image: Path, cache: Path, workload: str | None) -> Path:
    """Where the list for image (and workload) is cached."""
    st = image.stat()
    ident = f"{image.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    if workload is not None:
        ident += f"\nworkload={workload}"
    return cache / "bench-lists" / hashlib.sha256(ident.encode()).hexdigest()[:16]


def cached_list(image: Path, cache: Path, workload: str | None) -> Path | None:
    found = sorted(list_dir(image, cache, workload).glob("*.pcsl"))
    return found[-1] if found else None


def stale_page(i: int) -> bytes:
    """Page i of the stale memory each guest writes and frees
    (bench/e2e/guest-init.sh's awk): different from every other page and
    from every disk block, the same in every guest."""
    return b"pageshare stale page %4074d\n" % i


def stale_hashes(mib: int) -> bytes:
    """e2e_sampler's hash file of the stale pages ($E2E_STALE_HASHES)."""
    return b"".join(struct.pack("<Q", page_hash(stale_page(i))) for i in range(mib * 256))


def ensure_list(image: Path, cache: Path, workload: str | None = None) -> Path:
    """The list analyze-image makes for image (with workload as its
    --workload, or its plain boot), made once per image file and workload."""
    found = cached_list(image, cache, workload)
    if found:
        log(f"list: cached {found}")
        return found
    d = list_dir(image, cache, workload)
    d.mkdir(parents=True, exist_ok=True)
    log(f"list: analyze-image {image} (once per image; several minutes under TCG)")
    cmd = [
        sys.executable,
        "-m",
        "pageshare.cli",
        "analyze",
        "--runs",
        "1",
        "--lists-dir",
        str(d),
        "--db",
        str(d / "results.sqlite"),
        str(image),
    ]
    if workload is not None:
        cmd[4:4] = ["--workload", workload]
    p = subprocess.run(cmd, env=dict(os.environ, PYTHONPATH=str(REPO / "analyzer")))
    made = sorted(d.glob("*.pcsl"))
    if p.returncode != 0 or not made:
        raise BenchError(
            f"analyze-image failed on {image} (exit {p.returncode}); "
            "run it by hand to see why: " + shlex.join(cmd)
        )
    return made[-1]


def listed_hashes(image: Path, pcsl: Path) -> tuple[bytes, int]:
    """e2e_sampler's hash file (the listed blocks' page_hash, 8 bytes each)
    and the number of blocks; checks every block's bytes against the list."""
    sl = sectorlist.read(pcsl)
    with tempfile.TemporaryDirectory(prefix="e2e-raw-", dir="/var/tmp") as td:
        raw = Path(td) / "base.raw"
        subprocess.run(["qemu-img", "convert", "-O", "raw", str(image), str(raw)], check=True)
        if raw.stat().st_size != sl.image.virtual_size:
            raise BenchError(
                f"{pcsl} is for an image of {sl.image.virtual_size} bytes, "
                f"{image} is {raw.stat().st_size}: pass the list made for it"
            )
        out = bytearray()
        with open(raw, "rb") as f:
            for sector, digest in sorted(sl.blocks.items()):
                f.seek(sector * 512)
                block = f.read(PAGE)
                if sectorlist.block_hash(block) != digest:
                    raise BenchError(
                        f"{pcsl}: block at sector {sector} does not match "
                        f"{image}; the list is for another image"
                    )
                out += struct.pack("<Q", page_hash(block))
    return bytes(out), len(sl.blocks)


def half_list(pcsl: Path) -> str:
    """The list with every other block: what the faults configuration reloads."""
    sl = sectorlist.read(pcsl)
    keep = dict(sorted(sl.blocks.items())[::2])
    return sectorlist.dumps(dataclasses.replace(sl, blocks=keep))


SERVER_TOML = """# pageshare-server in the benchmark's host VM (bench/e2e_vs_ksm.py)
socket_dir = "/tmp/pageshare/run"
cache_dir = "/tmp/pageshare/cache"
metrics_listen = ""
host_name = "e2e-bench"
qemu_storage_daemon = "/pageshare/bin/qemu-storage-daemon"

[[image]]
name = "base"
path = "/pageshare/base.qcow2"
format = "qcow2"
list_file = "/tmp/pageshare/base.pcsl"
"""
# --feedback: the server publishes what its guests read to a Redis in the
# host VM (driver.sh starts it), often, so that the summary the driver dumps
# after each filter configuration is at most one interval old
FEEDBACK_TOML = """
[redis]
url = "unix:///tmp/redis.sock"
prefix = "pageshare"

[feedback]
interval_secs = 10
"""


@dataclass
class Settings:
    guests: int
    guest_mib: int
    host_mib: int
    observe: int
    interval_ms: int
    configs: list[str]
    grep_dirs: str
    sum_dirs: str
    work_timeout: int
    # (defaults: what runs recorded before these existed did)
    boot_timeout: int = 0  # a guest not booted by then: its configuration runs again
    stale_mib: int = 0  # stale memory each guest frees after its reads
    # --migrate: the migration phase after the pageshare configuration
    migrate: bool = False
    migrate_ksm_cap: int = 300  # s a destination is followed until KSM shares as much
    migrate_mbit: int = 1000  # max-bandwidth of each migration
    mixed: bool = False  # guests not in lockstep (MIXED)
    pressure_mib: int = 0  # host memory pressure: filler MiB (driver.sh pressure_on)
    feedback: bool = False  # Redis in the host VM, the read feedback dumped (feedback.json)
    corunner_mib: int = 0  # --corunner: the last guest hashes this many MiB, reads nothing


def base_config(name: str) -> str:
    """A configuration's name without its repeat suffix (NAME-rN)."""
    m = REPEAT.fullmatch(name)
    return m.group(1) if m else name


def known_config(name: str) -> bool:
    base = base_config(name)
    return base in CONFIGS or SCAN_RATE.fullmatch(base) is not None


def host_preflight(ksm: Path, need_host_ksm: bool) -> None:
    """What can be checked on this machine before any build: the tools, a
    series that carries merge_pages, a pageshare host config with KSM, and
    this host's KSM when analyze-image has to make the list.  The pageshare
    host itself is checked again by driver.sh, in it, before anything runs."""
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        raise BenchError(
            f"missing tools: {', '.join(missing)}; install them "
            "(scripts/install-deps.sh) and run again"
        )
    patches = sorted((REPO / "kernel-syscall/patches").glob("*.patch"))
    if not any("merge_page_merged" in p.read_text(errors="replace") for p in patches):
        raise BenchError(
            "kernel-syscall/patches/ has no merge_pages series (no patch adds "
            "/sys/kernel/mm/ksm/merge_page_merged): the pageshare host would "
            "lack the series; restore the series and run again"
        )
    frags = [REPO / "kernel-syscall/config" / f for f in ("base.config", "plain.config")]
    opts: dict[str, str] = {}
    for f in frags:
        for line in f.read_text().splitlines():
            key, eq, val = line.strip().partition("=")
            if eq and key.startswith("CONFIG_"):
                opts[key] = val
    if opts.get("CONFIG_KSM") != "y":
        raise BenchError(
            "the pageshare host's config (kernel-syscall/config/base.config + "
            "plain.config) does not set CONFIG_KSM=y: pageshare needs KSM"
        )
    if need_host_ksm and not (ksm / "run").exists():
        raise BenchError(
            f"this host has no KSM ({ksm} missing), and analyze-image needs it "
            "to make the list (it finds what guests share with host KSM): run "
            "on a host with CONFIG_KSM, or pass --list with a list made "
            "elsewhere for the same image"
        )


def guest_initramfs(busybox: Path, st: Settings, out: Path) -> None:
    init = (
        (REPO / "bench/e2e/guest-init.sh")
        .read_text()
        .replace("__GREP_DIRS__", st.grep_dirs)
        .replace("__SUM_DIRS__", st.sum_dirs)
        .replace("__STALE_MIB__", str(st.stale_mib))
    )
    with tempfile.TemporaryDirectory(prefix="e2e-guest-") as td:
        top = Path(td)
        for d in ("bin", "dev", "proc", "sys", "mnt"):
            (top / d).mkdir()
        shutil.copy2(busybox, top / "bin/busybox")
        (top / "init").write_text(init)
        (top / "init").chmod(0o755)
        out.write_bytes(ktest.cpio_gz(top))


def build_payload(
    image: Path,
    pcsl: Path,
    hashes: bytes,
    st: Settings,
    busybox: Path,
    guest_kernel: Path,
    out: Path,
) -> None:
    """/pageshare in the host VM: binaries with their libraries, firmware,
    the golden image and its list, the guest kernel and initramfs."""
    qemu = ktest.build_patched_qemu()
    server = ktest.build_page_server()
    sampler = out.parent / "e2e_sampler"
    ktest.run(ktest.sampler_argv(sampler))
    bins = [qemu / "bin" / b for b in ktest.QEMU_BINARIES] + [server]
    if st.feedback:
        for name in ("redis-server", "redis-cli"):
            found = shutil.which(name)
            if not found:
                raise BenchError(
                    f"--feedback runs {name} in the pageshare host: install "
                    "Debian's redis-server (scripts/install-deps.sh does)"
                )
            bins.append(Path(found))
    with tempfile.TemporaryDirectory(prefix="e2e-payload-", dir="/var/tmp") as td:
        top = Path(td)
        pd = top / "pageshare"
        for d in ("bin", "share/qemu", "guest"):
            (pd / d).mkdir(parents=True)
        for b in bins:
            ktest.run(["strip", "-o", str(pd / "bin" / b.name), str(b)])
        shutil.copy2(sampler, pd / "bin/e2e_sampler")
        for fw in ktest.QEMU_FIRMWARE:
            shutil.copy2((qemu / "share/qemu" / fw).resolve(), pd / "share/qemu" / fw)
        for b in bins:
            for lib in ktest.shared_libs(b):
                dst = top / str(lib).lstrip("/")
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(lib.resolve(), dst)
        shutil.copy2(image, pd / "base.qcow2")
        # The server's proof of the base is its file stamp; a ctime under
        # two seconds old is not trusted (qemu-patches/README.md).
        shutil.copy2(pcsl, pd / "base.pcsl")
        (pd / "base-half.pcsl").write_text(half_list(pcsl))
        (pd / "listed.hashes").write_bytes(hashes)
        (pd / "stale.hashes").write_bytes(stale_hashes(st.stale_mib))
        (pd / "server.toml").write_text(SERVER_TOML + (FEEDBACK_TOML if st.feedback else ""))
        shutil.copy2(REPO / "bench/e2e/driver.sh", pd / "driver.sh")
        (pd / "e2e.env").write_text(
            f"GUESTS={st.guests}\nGUEST_MIB={st.guest_mib}\nOBSERVE={st.observe}\n"
            f"INTERVAL_MS={st.interval_ms}\nWORK_TIMEOUT={st.work_timeout}\n"
            f"BOOT_TIMEOUT={st.boot_timeout}\n"
            f"CONFIGS='{' '.join(st.configs)}'\n"
        )
        with open(pd / "e2e.env", "a") as env:
            env.write(
                migrate_env(st) + guest_args_env(st) + f"PRESSURE_MIB={st.pressure_mib}\n"
                f"FEEDBACK={int(st.feedback)}\n"
            )
        shutil.copy2(guest_kernel, pd / "guest/vmlinuz")
        guest_initramfs(busybox, st, pd / "guest/initramfs.cpio.gz")
        out.write_bytes(ktest.cpio_gz(top))


def guest_args_env(st: Settings) -> str:
    """driver.sh's GUEST_ARGS_i: each guest's kernel arguments for
    guest-init.sh: with --mixed its directories and its delay, with
    --corunner the last guest's MiB to hash (it reads nothing then)."""
    out = []
    for i in range(1, st.guests + 1):
        args = []
        if st.mixed:
            dirs, delay = MIXED[(i - 1) % len(MIXED)]
            args += [f"e2e_grep={dirs.replace(' ', ',')}", f"e2e_delay={delay}"]
        if st.corunner_mib and i == st.guests:
            args.append(f"e2e_cpu={st.corunner_mib}")
        if args:
            out.append(f"GUEST_ARGS_{i}='{' '.join(args)}'\n")
    return "".join(out)


def migrate_env(st: Settings) -> str:
    """driver.sh's settings of its migration phase (migrate_phase)."""
    if not st.migrate:
        return "MIGRATE=0\n"
    return (
        f"MIGRATE=1\nMIG_KSM_CAP={st.migrate_ksm_cap}\nMIG_BW={st.migrate_mbit * 1_000_000 // 8}\n"
    )


def migrate_budget(st: Settings) -> int:
    """Seconds the migration phase may take: per method the census, the
    migration (up to 900 s in the driver), the destination followed."""
    return len(e2e_migration.METHODS) * (st.migrate_ksm_cap + 300) if st.migrate else 0


def parse(lines: list[str]) -> dict[str, list[list[str]]]:
    """The E2E- lines of the serial log, by kind."""
    rows: dict[str, list[list[str]]] = defaultdict(list)
    for line in lines:
        line = line.strip()
        for kind in (
            "E2E-G ",
            "E2E-H ",
            "E2E-EV ",
            "E2E-GUEST ",
            "E2E-ERROR ",
            "E2E-GLOG ",
            "E2E-U ",
            "E2E-F ",
            "E2E-L ",
        ):
            if line.startswith(kind):
                if kind == "E2E-U ":
                    rows["replaced"].append(line.split()[1:])
                elif kind == "E2E-F ":
                    r = line.split()[1:]
                    rows["fallback"].append(r + ["-1"] * (len(FALLBACK_FIELDS) - len(r)))
                elif kind == "E2E-L ":
                    rows["lost"].append(line.split()[1:])
                elif kind == "E2E-GLOG ":
                    rows["glog"].append([*line.split(" ", 3), ""][1:4])
                elif kind == "E2E-EV ":
                    parts = line.split(" ", 4)
                    rows["ev"].append(parts[1:] + [""] * (5 - len(parts)))
                elif kind == "E2E-GUEST ":
                    rows["guest"].append(line.split(" ", 3)[1:])
                elif kind == "E2E-ERROR ":
                    rows["error"].append([line[len(kind) :]])
                else:
                    r = line.split()[1:]
                    # a sampler from before the last columns: -1, unknown
                    want = len(HOST_FIELDS if kind == "E2E-H " else GUEST_FIELDS)
                    rows[kind.strip()].append(r + ["-1"] * (want - len(r)))
    return rows


def feedback_summaries(lines: list[str]) -> dict[str, dict[str, dict[str, Any]]]:
    """The read feedback the driver dumped (--feedback): per configuration,
    per Redis key, the summary's fields as the server published them, the
    blocks field as bytes (feedback.py's record layout)."""
    out: dict[str, dict[str, dict[str, Any]]] = defaultdict(lambda: defaultdict(dict))
    b64: dict[tuple[str, str], list[str]] = defaultdict(list)
    for line in lines:
        parts = line.strip().split(" ", 4)
        if parts[0] == "E2E-FB" and len(parts) >= 4:
            out[parts[1]][parts[2]][parts[3]] = parts[4] if len(parts) == 5 else ""
        elif parts[0] == "E2E-FBB" and len(parts) == 4:
            b64[(parts[1], parts[2])].append(parts[3])
    for (cfg, key), chunks in b64.items():
        raw = base64.b64decode("".join(chunks))
        # redis-cli --raw ends the value with a newline
        out[cfg][key]["blocks"] = raw[:-1] if raw.endswith(b"\n") and len(raw) % 20 == 1 else raw
    return {c: dict(v) for c, v in out.items()}


def write_feedback(path: Path, fb: dict[str, dict[str, dict[str, Any]]]) -> None:
    """feedback_summaries() as gzipped JSON, the blocks in base64."""
    path.write_bytes(
        gzip.compress(
            json.dumps(
                {
                    c: {
                        k: {
                            f: (base64.b64encode(v).decode() if f == "blocks" else v)
                            for f, v in fields.items()
                        }
                        for k, fields in keys.items()
                    }
                    for c, keys in fb.items()
                }
            ).encode()
        )
    )


def write_csv(path: Path, header: list[str], rows: list[list[str]]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)


def guest_marks(text: str) -> dict[str, list[str]]:
    """'GUEST-BOOTED 12.3 GUEST-BINS 1 2 ...' -> {'BOOTED': ['12.3'], ...}."""
    marks: dict[str, list[str]] = {}
    key = ""
    for tok in text.split():
        if tok.startswith("GUEST-"):
            key = tok[len("GUEST-") :]
            marks[key] = []
        elif key:
            marks[key].append(tok)
    return marks


def summarize(rows: dict[str, list[list[str]]], st: Settings, nlisted: int) -> dict[str, Any]:
    """Per configuration: memory, sharing by class, CPU, workload times."""
    events: dict[str, dict[str, tuple[int, str]]] = defaultdict(dict)
    # host-side stamps of the guests' markers: cfg -> guest -> marker -> ms
    stamps: dict[str, dict[int, dict[str, int]]] = defaultdict(lambda: defaultdict(dict))
    for cfg, t_ev, name, rest, *_ in rows["ev"]:
        if name == "mark":
            g, m = rest.split()
            stamps[cfg][int(g)][m] = int(t_ev)
        else:
            events[cfg][name] = (int(t_ev), rest)
    host: dict[str, list[dict[str, int]]] = defaultdict(list)
    for r in rows["E2E-H"]:
        host[r[0]].append({k: int(v) for k, v in zip(HOST_FIELDS[1:], r[1:], strict=True)})
    guest: dict[str, dict[int, list[dict[str, int]]]] = defaultdict(lambda: defaultdict(list))
    for r in rows["E2E-G"]:
        d = {k: int(v) for k, v in zip(GUEST_FIELDS[1:], r[1:], strict=True)}
        guest[r[0]][d["guest"]].append(d)
    marks: dict[str, dict[int, dict[str, list[str]]]] = defaultdict(dict)
    for cfg, idx, text in rows["guest"]:
        if st.corunner_mib and int(idx) == st.guests:
            continue  # the co-runner reads nothing: no checksum
        marks[cfg][int(idx)] = guest_marks(text)
    sums = {m.get("SUM", ["?"])[0] for c in marks.values() for m in c.values()}
    # each guest read the same bytes in every configuration, and in
    # lockstep every guest the same as the others
    by_guest: dict[int, set[str]] = defaultdict(set)
    for c_marks in marks.values():
        for g_idx, g_marks in c_marks.items():
            by_guest[g_idx].add(g_marks.get("SUM", ["?"])[0])
    identical = all(len(v) == 1 for v in by_guest.values()) and (st.mixed or len(sums) == 1)

    out: dict[str, Any] = {
        "configs": {},
        "bytes_identical": identical,
        "checksums": sorted(sums),
        "listed_blocks": nlisted,
    }
    # guests that did not boot (the driver ran their configuration again)
    hangs = [
        {"cfg": cfg, "t_ms": int(t), "detail": rest}
        for cfg, t, name, rest, *_ in rows["ev"]
        if name in ("boot-hung", "boot-failed")
    ]
    if hangs:
        out["boot_hangs"] = hangs
    for cfg in st.configs:
        if cfg not in events or "work-done" not in events[cfg] or not host[cfg]:
            out["configs"][cfg] = {"error": "did not finish"}
            continue
        # the configuration's last start: an earlier one whose guest did
        # not boot is not counted
        t_begin = events[cfg]["begin"][0]
        t_work = events[cfg]["work-done"][0]
        host[cfg] = [h for h in host[cfg] if h["t_ms"] >= t_begin]
        for gid in guest[cfg]:
            guest[cfg][gid] = [s for s in guest[cfg][gid] if s["t_ms"] >= t_begin]
        stamps[cfg] = defaultdict(
            dict,
            {
                gid: {m: t for m, t in by_mark.items() if t >= t_begin}
                for gid, by_mark in stamps[cfg].items()
            },
        )
        if not host[cfg]:
            out["configs"][cfg] = {"error": "did not finish"}
            continue
        # samples up to the end event (the driver stops the guests after it),
        # and only while every guest's QEMU was there to be read
        t_end = events[cfg].get("end", (1 << 62, ""))[0]
        gone = [s["t_ms"] for g in guest[cfg].values() for s in g if s["pss_kb"] < 0]
        t_end = min([t_end, *(t - 1 for t in gone)])
        hs = [h for h in host[cfg] if h["t_ms"] <= t_end] or host[cfg][:1]
        last_t = hs[-1]["t_ms"]

        gids = sorted(guest[cfg])
        series = {
            g: [s for s in guest[cfg][g] if s["t_ms"] <= t_end] or guest[cfg][g][:1] for g in gids
        }

        def at(t: int, g: int, series: dict[int, list[dict[str, int]]] = series) -> dict[str, int]:
            """Guest g's last sample at or before t."""
            before = [s for s in series[g] if s["t_ms"] <= t]
            return before[-1] if before else series[g][0]

        end = [series[g][-1] for g in gids]
        work = [at(t_work, g) for g in gids]
        listed_end = sum(s["listed"] for s in end)
        shared_end = sum(s["listed_shared"] for s in end)
        # Time from the end of the workload until 90 % of the listed pages
        # that guests hold are shared (0: already at the end of the reads).
        t90 = None
        for t in sorted({s["t_ms"] for g in gids for s in series[g]}):
            ss = [at(t, g) for g in gids]
            tot = sum(s["listed"] for s in ss)
            if t >= t_work and tot and sum(s["listed_shared"] for s in ss) >= 0.9 * tot:
                t90 = (t - t_work) / 1000
                break
        lag50, lag90 = share_lag(series, gids, t_work)
        h_end = hs[-1]
        saved = {
            "listed": sum(s["listed_shared"] for s in end) - h_end["distinct_listed"],
            "zero": sum(s["zero_shared"] for s in end) - h_end["distinct_zero"],
            "other": sum(s["other_shared"] for s in end) - h_end["distinct_other"],
            # freed stale memory (0 for a sampler without the class)
            "stale": max(0, sum(s["stale_shared"] for s in end) - h_end["distinct_stale"]),
        }
        ksmd_cpu = (hs[-1]["ksmd_cpu_ms"] - hs[0]["ksmd_cpu_ms"]) / 1000
        # The server's CPU from its first merge on; before it, the one-time
        # start-up (the image's content hash, cached by file identity after).
        first_merge = next(
            (h["t_ms"] for h in hs if any(at(h["t_ms"], g)["merged"] > 0 for g in gids)), None
        )
        h_first = next(
            (h for h in hs if first_merge is not None and h["t_ms"] >= first_merge), hs[-1]
        )
        server_ms = cpu_since(hs, h_first)
        server_cpu = server_ms / 1000 if server_ms is not None else None
        server_startup_cpu = h_first["server_cpu_ms"] / 1000

        # the filter's counters as last read: a sample whose QMP query
        # failed (a busy QEMU) carries -1s
        def counter(key: str, series: dict[int, list[dict[str, int]]] = series) -> int:
            return sum(
                next((s[key] for s in reversed(ss) if s[key] >= 0), 0) for ss in series.values()
            )

        merged = counter("merged")
        merge_s = counter("merge_ns") / 1e9
        # wall times, from the driver's stamps (a nested guest's clock is slow)
        greps, bins, boots = [], [], []
        for st_g in stamps[cfg].values():
            if "GREP" in st_g and "BINS" in st_g:
                greps.append((st_g["GREP"] - st_g["BINS"]) / 1000)
            if "BINS" in st_g and "BOOTED" in st_g:
                bins.append((st_g["BINS"] - st_g["BOOTED"]) / 1000)
            if "BOOTED" in st_g:
                boots.append((st_g["BOOTED"] - t_begin) / 1000)
        ksm_saved_gib = h_end["pages_sharing"] * PAGE / 2**30
        # stale memory each guest freed (GUEST-FREED mib memfree_before
        # memfree_full memfree_after page_reporting_order)
        freed = [m["FREED"] for m in marks[cfg].values() if len(m.get("FREED", [])) == 5]
        thp = [h["khugepaged_collapsed"] for h in hs if h["khugepaged_collapsed"] >= 0]
        c: dict[str, Any] = {
            "work_s": (t_work - t_begin) / 1000,
            "observed_s": (last_t - t_work) / 1000,
            "pss_mib_end": (sum(s["pss_kb"] for s in end) + h_end["server_pss_kb"]) / 1024,
            "rss_mib_end": (sum(s["rss_kb"] for s in end) + h_end["server_rss_kb"]) / 1024,
            "pss_mib_work_done": sum(s["pss_kb"] for s in work) / 1024,
            # guest RAM the host holds (present pages of the guests' RAM)
            "resident_mib_end": sum(s["present"] for s in end) * PAGE / MIB,
            # of it, in transparent huge pages (QEMU asks for them): what
            # merges, KSM's included, have not split
            "anon_huge_mib_work_done": (
                sum(s["anon_huge_kb"] for s in work) / 1024
                if work[0]["anon_huge_kb"] >= 0
                else None
            ),
            "anon_huge_mib_end": (
                sum(s["anon_huge_kb"] for s in end) / 1024 if end[0]["anon_huge_kb"] >= 0 else None
            ),
            # of it, freed stale pages still there (free page reporting
            # hands back what it reports)
            "stale_resident_mib_end": (
                sum(s["stale"] for s in end) * PAGE / MIB if end[0]["stale"] >= 0 else None
            ),
            "server_pss_mib": h_end["server_pss_kb"] / 1024,
            "memavail_mib_end": h_end["memavail_kb"] / 1024,
            "memavail_mib_min": min(h["memavail_kb"] for h in hs) / 1024,
            # swap in use (--pressure's zram), the most while sampled
            "swap_used_mib_max": (
                max(h["swap_used_kb"] for h in hs) / 1024 if hs[0]["swap_used_kb"] >= 0 else None
            ),
            "listed_pages_held": listed_end,
            "listed_shared_frac_end": shared_end / listed_end if listed_end else 0.0,
            # listed, shared guest pages that are the server's physical page
            "listed_on_server_frac_end": (
                sum(s["on_server"] for s in end) / shared_end
                if shared_end and end[0]["on_server"] >= 0
                else None
            ),
            "listed_shared_frac_work_done": (
                sum(s["listed_shared"] for s in work) / max(1, sum(s["listed"] for s in work))
            ),
            "t90_after_reads_s": t90,
            "lag50_s": lag50,
            "lag90_s": lag90,
            "saved_mib": {k: v * PAGE / MIB for k, v in saved.items()},
            "pages_sharing": h_end["pages_sharing"],
            "ksmd_cpu_s": ksmd_cpu,
            "ksmd_cpu_s_per_gib": ksmd_cpu / ksm_saved_gib if ksm_saved_gib > 0 else None,
            "filter_merged": merged,
            # the kernel's own count of the same merges (all guests)
            "kernel_merge_page_merged": hs[-1]["merge_page_merged"] - hs[0]["merge_page_merged"],
            "filter_merge_s": merge_s,
            "server_cpu_s": server_cpu,
            "server_startup_cpu_s": server_startup_cpu,
            "pageshare_cpu_s_per_gib": (
                (merge_s + server_cpu) / (merged * PAGE / 2**30)
                if merged and server_cpu is not None
                else None
            ),
            "merge_failed": counter("merge_failed"),
            "grep_s_mean": sum(greps) / len(greps) if greps else None,
            "bins_s_mean": sum(bins) / len(bins) if bins else None,
            "boot_s_mean": sum(boots) / len(boots) if boots else None,
            "sample_ms_mean": sum(h["sample_ms"] for h in hs) / len(hs),
            # khugepaged collapsing guest RAM in the pageshare host: a
            # collapse copies the KSM pages of the range (unshares them)
            "thp_collapses": thp[-1] - thp[0] if thp else None,
            "stale_freed_mib": (sum(int(f[0]) for f in freed) / len(freed) if freed else None),
            # MemFree regained by the delete, MiB (mean over guests)
            "stale_memfree_back_mib": (
                sum(int(f[3]) - int(f[2]) for f in freed) / len(freed) / 1024 if freed else None
            ),
            "page_reporting_order": (freed[0][4] if freed and freed[0][4] != "-" else None),
        }
        c.update(at_reads_end(series, stamps[cfg]))
        c["thp_events"] = thp_events(events[cfg])
        c["corunner_mib_s"] = corunner_pace(stamps[cfg].get(st.guests, {}), st.corunner_mib)
        c["merge_batches"] = merge_batches(rows["fallback"], cfg, t_begin, t_end)
        c.update(census(hs, series, gids, at))
        c.update(cpu_beyond(hs))
        out["configs"][cfg] = c
    sharing_costs(out["configs"])
    return out


def corunner_pace(stamps: dict[str, int], mib: int) -> float | None:
    """The co-runner's pace, MiB hashed per second of host time (the
    driver's stamps of its CPUBEGIN and CPUEND lines); None without one."""
    t0, t1 = stamps.get("CPUBEGIN"), stamps.get("CPUEND")
    if not mib or t0 is None or t1 is None or t1 <= t0:
        return None
    return mib / ((t1 - t0) / 1000)


def corunner(configs: dict[str, dict[str, Any]]) -> list[str]:
    """Co-runners as markdown lines: the CPU-bound guest's pace and the
    readers' grep time beside pageshare against beside none, pair by pair
    (none, pageshare; none-r2, pageshare-r2 ...: each pair ran back to
    back), the ratios' spread, and issue 20's target (within 5 % of no
    filter) read from the worst pair.  Empty without a pair."""
    pairs = []
    for name, c in configs.items():
        m = REPEAT.fullmatch(name)
        suffix = f"-r{m.group(2)}" if m else ""
        base = base_config(name)
        other = configs.get("none" + suffix)
        if (
            base == "pageshare"
            and other is not None
            and c.get("corunner_mib_s")
            and other.get("corunner_mib_s")
        ):
            pairs.append((suffix or "-r1", other, c))
    if not pairs:
        return []
    out = [
        "",
        "Co-runners: the CPU-bound guest and the readers beside the filter, against none",
        "",
        "| pair | co-runner MiB/s, none | pageshare | ratio | readers' grep s, none "
        "| pageshare | ratio |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    ratios, grep_ratios = [], []
    for suffix, n, p in pairs:
        r = p["corunner_mib_s"] / n["corunner_mib_s"]
        ratios.append(r)
        g = (
            p["grep_s_mean"] / n["grep_s_mean"]
            if p.get("grep_s_mean") and n.get("grep_s_mean")
            else None
        )
        if g is not None:
            grep_ratios.append(g)
        out.append(
            f"| {suffix.removeprefix('-r')} | {n['corunner_mib_s']:.2f} | "
            f"{p['corunner_mib_s']:.2f} | "
            f"{r:.3f} | {fmt(n.get('grep_s_mean'))} | {fmt(p.get('grep_s_mean'))} | "
            f"{fmt(g, '.3f')} |"
        )
    out.append("")
    out.append(
        f"- co-runner pace beside the filter / beside none: {min(ratios):.3f} to "
        f"{max(ratios):.3f} over {len(ratios)} pair(s)"
        + (
            f"; readers' grep time {min(grep_ratios):.3f} to {max(grep_ratios):.3f}"
            if grep_ratios
            else ""
        )
    )
    out.append(
        "- co-runners within 5 % of no filter: "
        + (
            "met in every pair"
            if min(ratios) >= 0.95
            else f"MISSED (the worst pair {min(ratios):.3f})"
        )
    )
    # The yardstick for those ratios: the same configuration run again.
    # Two none runs that differ by more than the target cannot tell a
    # filter's cost of that size from the host's noise.
    nones = [
        c["corunner_mib_s"]
        for name, c in configs.items()
        if base_config(name) == "none" and c.get("corunner_mib_s")
    ]
    if len(nones) >= 2:
        apart = max(nones) / min(nones) - 1
        out.append(
            f"- the none runs among themselves: {min(nones):.3f} to {max(nones):.3f} MiB/s, "
            f"{apart:.1%} apart"
            + (
                ": more than the target's 5 %, so this run cannot tell a cost of that "
                "size from noise"
                if apart > 0.05
                else ""
            )
        )
    return out


def thp_events(ev: dict[str, tuple[int, str]]) -> dict[str, int] | None:
    """The host's huge page events in the configuration, from its sampled
    start to its end (driver.sh's thp-begin and thp-end: /proc/vmstat's
    thp_split_pmd, thp_split_page, thp_collapse_alloc, thp_fault_alloc);
    None for a run without them."""
    if "thp-begin" not in ev or "thp-end" not in ev:
        return None

    def parse(text: str) -> dict[str, int]:
        return {k: int(v) for k, _, v in (f.partition("=") for f in text.split()) if v.isdigit()}

    begin, end = parse(ev["thp-begin"][1]), parse(ev["thp-end"][1])
    return {k.removeprefix("thp_"): end[k] - begin[k] for k in sorted(end) if k in begin}


def merge_batches(
    fallback: list[list[str]], cfg: str, t_begin: int, t_end: int
) -> list[int] | None:
    """The filters' merge_pages calls by the blocks each carried (1, 2-3,
    4-7 ... 64 or more), summed over the guests' last readings in the
    configuration; None without them (no filter, or an older sampler)."""
    last: dict[str, list[int]] = {}
    for r in fallback:
        d = dict(zip(FALLBACK_FIELDS, r, strict=True))
        if d["cfg"] == cfg and t_begin <= int(d["t_ms"]) <= t_end and int(d["batch1"]) >= 0:
            last[d["guest"]] = [int(d[k]) for k in BATCH_FIELDS]
    if not last:
        return None
    return [sum(v[i] for v in last.values()) for i in range(len(BATCH_FIELDS))]


def at_reads_end(
    series: dict[int, list[dict[str, int]]], stamps: dict[int, dict[str, int]]
) -> dict[str, Any]:
    """Each guest's listed pages shared at its own end of reads (its GREP
    mark, stamped by the driver, which asks the sampler for a full pass at
    once): the first full sample at or after the mark, and how long after
    it that sample was taken.  Guests are the driver's 1, 2, ... and the
    sampler's 0, 1, ..."""
    fracs: list[float] = []
    lags: list[float] = []
    for gid, ss in sorted(series.items()):
        t = stamps.get(gid + 1, {}).get("GREP")
        s = next((s for s in ss if t is not None and s["t_ms"] >= t and s["full"]), None)
        if t is None or s is None or not s["listed"]:
            continue
        fracs.append(s["listed_shared"] / s["listed"])
        lags.append((s["t_ms"] - t) / 1000)
    return {
        "listed_shared_frac_reads_end": fracs or None,
        "listed_shared_frac_reads_end_min": min(fracs) if fracs else None,
        "reads_end_sample_after_s_max": max(lags) if lags else None,
    }


def census(
    hs: list[dict[str, int]], series: dict[int, list[dict[str, int]]], gids: list[int], at: Any
) -> dict[str, Any]:
    """Memory that sharing could still save, from the sampler's census (its
    full samples): duplicates not yet shared (distinct physical pages of
    the guests' RAM and the server's listed pages, less their distinct
    contents) integrated over the configuration's samples, MiB*s, and at
    the end; what sharing saved at the end net of everything the server
    preloads (the guests' present pages less the distinct physical pages,
    the server's among them); the server's pages no guest maps.  None for
    a sampler without the census.  Also, from the guests' full samples
    alone, the listed pages they held that were not shared, integrated
    over time (MiB*s): the one class read-time sharing is for."""
    listed_ms = 0.0
    for ss in series.values():
        full = [(s["t_ms"], s["listed"] - s["listed_shared"]) for s in ss if s["full"]]
        listed_ms += sum((t1 - t0) * (a + b) / 2 for (t0, a), (t1, b) in itertools.pairwise(full))
    listed = {"listed_unshared_mib_s": listed_ms / 1000 * PAGE / MIB if series else None}
    cs = [h for h in hs if h["mem_pages"] >= 0 and h["distinct_pages"] >= 0]
    if not cs:
        return listed | {
            "dup_mib_s": None,
            "dup_mib_end": None,
            "net_saved_mib_end": None,
            "server_unused_mib_end": None,
        }
    dup = [(h["t_ms"], max(0, h["mem_pages"] - h["distinct_pages"])) for h in cs]
    pages_ms = sum((t1 - t0) * (d0 + d1) / 2 for (t0, d0), (t1, d1) in itertools.pairwise(dup))
    last = cs[-1]
    present = sum(at(last["t_ms"], g)["present"] for g in gids)
    return listed | {
        "dup_mib_s": pages_ms / 1000 * PAGE / MIB,
        "dup_mib_end": dup[-1][1] * PAGE / MIB,
        "net_saved_mib_end": (present - last["mem_pages"]) * PAGE / MIB,
        "server_unused_mib_end": (max(0, last["server_unused"]) * PAGE / MIB),
    }


def cpu_beyond(hs: list[dict[str, int]]) -> dict[str, Any]:
    """CPU over the configuration's samples beyond ksmd's and the server's:
    all kworkers (merge_pages' prune work runs there), and the whole
    machine's busy time less the sampler's own (None for a sampler without
    them)."""

    def delta(key: str) -> float | None:
        a, b = hs[0][key], hs[-1][key]
        return (b - a) / 1000 if a >= 0 and b >= a else None

    busy, sampler = delta("busy_cpu_ms"), delta("sampler_cpu_ms")
    return {
        "sampled_s": (hs[-1]["t_ms"] - hs[0]["t_ms"]) / 1000,
        "kworker_cpu_s": delta("kworker_cpu_ms"),
        "machine_cpu_s": busy - sampler if busy is not None and sampler is not None else None,
    }


def sharing_costs(configs: dict[str, dict[str, Any]]) -> None:
    """Each configuration's whole sharing CPU and what it bought, against
    "none" when it ran: ksmd, the filter's time in merge_pages (wall time in
    the guests' QEMU), the server (start-up hash and after) and the kworkers
    beyond none's rate; memory saved beyond none's (its guests' zero-page
    mappings); the machine's busy time beyond none's (noisy: the guests'
    emulation dominates it)."""
    base = configs.get("none", {})
    if "error" in base or base.get("kworker_cpu_s") is None or not base.get("sampled_s"):
        base = {}
    for c in configs.values():
        if "error" in c:
            continue
        kw = c.get("kworker_cpu_s")
        if kw is not None and base:
            kw = max(0.0, kw - base["kworker_cpu_s"] / base["sampled_s"] * c["sampled_s"])
        c["kworker_excess_cpu_s"] = kw
        parts = [
            c["ksmd_cpu_s"],
            c["filter_merge_s"],
            c["server_startup_cpu_s"],
            c["server_cpu_s"] if c["filter_merged"] else 0.0,
            kw,
        ]
        c["sharing_cpu_s"] = (
            None if any(p is None for p in parts) else sum(p for p in parts if p is not None)
        )
        saved = c.get("net_saved_mib_end")
        if saved is not None and base.get("net_saved_mib_end") is not None:
            saved -= base["net_saved_mib_end"]
        # the server's start-up hash is paid once per image per host, not
        # per guest or per configuration: the figure without it as well
        c["sharing_cpu_after_startup_s"] = (
            None
            if c["sharing_cpu_s"] is None
            else c["sharing_cpu_s"] - (c["server_startup_cpu_s"] or 0.0)
        )
        c["sharing_saved_mib_end"] = saved
        c["sharing_cpu_s_per_gib_saved"] = (
            c["sharing_cpu_s"] / (saved / 1024)
            if c["sharing_cpu_s"] is not None and saved and saved > 0
            else None
        )
        m, mb = c.get("machine_cpu_s"), base.get("machine_cpu_s")
        c["machine_cpu_beyond_none_s"] = m - mb if m is not None and mb is not None else None


def cpu_since(hs: list[dict[str, int]], first: dict[str, int]) -> int | None:
    """The server's CPU (ms) from sample ``first`` to the last one, or None
    if the sampler lost the server: it follows the pid it was started with,
    so after the faults configuration kills and restarts the server it
    reads -1.  A counter that drops (a new process of the same pid would
    start from 0) starts a new sum."""
    total, prev, on = 0, None, False
    for h in hs:
        on = on or h is first
        cur = h["server_cpu_ms"]
        if on and cur < 0:
            return None
        if on and prev is not None and h is not first:
            total += cur - prev if cur >= prev else cur
        prev = cur
    return total


def share_lag(
    series: dict[int, list[dict[str, int]]], gids: list[int], t_work: int
) -> tuple[float | None, float | None]:
    """How long after the guests held a level of listed pages the same
    level was shared: the horizontal distance between the two curves (sum
    over guests; "held" from full samples only), at 50 % and 90 % of what
    they held at the end of the reads.  The time from a read to its page
    being shared, for the pages as a whole."""
    times = sorted({s["t_ms"] for g in gids for s in series[g]})

    def total(t: int, key: str, full_only: bool) -> int:
        n = 0
        for g in gids:
            before = [s for s in series[g] if s["t_ms"] <= t and (s["full"] or not full_only)]
            n += before[-1][key] if before else 0
        return n

    held = [(t, total(t, "listed", True)) for t in times]
    shared = [(t, total(t, "listed_shared", False)) for t in times]
    final = max((n for t, n in held if t <= t_work), default=0)
    out: list[float | None] = []
    for frac in (0.5, 0.9):
        level = frac * final
        t_held = next((t for t, n in held if n >= level), None)
        t_shared = next((t for t, n in shared if n >= level), None)
        out.append(
            None
            if t_held is None or t_shared is None or final == 0
            else max(0.0, (t_shared - t_held) / 1000)
        )
    return out[0], out[1]


def fmt(v: Any, spec: str = ".1f") -> str:
    if v is None:
        return "-"
    if spec == "batches":
        return " / ".join(map(str, v))
    return format(v, spec)


def markdown(summary: dict[str, Any], cmdline: str, facts: str) -> str:
    rows = [
        ("guests' QEMU PSS + server PSS at the end, MiB", "pss_mib_end", ".0f"),
        ("guests' QEMU RSS + server RSS at the end, MiB", "rss_mib_end", ".0f"),
        ("MemAvailable at the end, MiB", "memavail_mib_end", ".0f"),
        ("MemAvailable at its lowest, MiB", "memavail_mib_min", ".0f"),
        ("swap in use at its most, MiB", "swap_used_mib_max", ".0f"),
        ("guest RAM the host holds (present pages) at the end, MiB", "resident_mib_end", ".0f"),
        ("saved: listed page cache, MiB", ("saved_mib", "listed"), ".1f"),
        ("saved: zero pages, MiB", ("saved_mib", "zero"), ".1f"),
        ("saved: freed stale memory, MiB", ("saved_mib", "stale"), ".1f"),
        ("saved: everything else, MiB", ("saved_mib", "other"), ".1f"),
        (
            "listed pages held by guests shared at the end of the reads",
            "listed_shared_frac_work_done",
            ".0%",
        ),
        ("listed pages held by guests shared at the end", "listed_shared_frac_end", ".0%"),
        (
            "the same at each guest's own end of reads, the lowest",
            "listed_shared_frac_reads_end_min",
            ".1%",
        ),
        (
            "that sample taken after the guest's end of reads, at most s",
            "reads_end_sample_after_s_max",
            ".1f",
        ),
        ("of those, the server's own page (PFN)", "listed_on_server_frac_end", ".0%"),
        ("s after the reads until 90 % of listed pages shared", "t90_after_reads_s", ".0f"),
        ("s from holding to sharing half the listed pages (curve lag)", "lag50_s", ".0f"),
        ("s from holding to sharing 90 % of them (curve lag)", "lag90_s", ".0f"),
        ("ksmd CPU, s", "ksmd_cpu_s", ".1f"),
        ("ksmd CPU s per GiB saved (pages_sharing)", "ksmd_cpu_s_per_gib", ".1f"),
        ("pages merged at read time by the filter", "filter_merged", "d"),
        ("the same, counted by the kernel (merge_page_merged)", "kernel_merge_page_merged", "d"),
        ("filter time in merge_pages, s", "filter_merge_s", ".2f"),
        ("server CPU at start-up (image hash, once per image), s", "server_startup_cpu_s", ".1f"),
        ("server CPU from its first merge on, s", "server_cpu_s", ".2f"),
        (
            "pageshare s per GiB merged (merge wall time + server CPU)",
            "pageshare_cpu_s_per_gib",
            ".1f",
        ),
        ("merges left to ksmd (EAGAIN etc.)", "merge_failed", "d"),
        (
            "merge_pages calls by blocks carried: 1 / 2-3 / 4-7 / 8-15 / 16-31 / 32-63 / 64",
            "merge_batches",
            "batches",
        ),
        ("co-runner's pace (the last guest hashing), MiB/s", "corunner_mib_s", ".2f"),
        ("guest booted and root mounted, s after start (mean)", "boot_s_mean", ".0f"),
        ("binaries in chroot (mean), s", "bins_s_mean", ".1f"),
        ("grep -r over /usr programs and libraries (mean), s", "grep_s_mean", ".1f"),
        ("workload, s (start to all done)", "work_s", ".0f"),
        ("stale memory freed by each guest after its reads, MiB", "stale_freed_mib", ".0f"),
        (
            "of it, still held by the host at the end (all guests), MiB",
            "stale_resident_mib_end",
            ".1f",
        ),
        ("huge pages collapsed by khugepaged in the pageshare host", "thp_collapses", "d"),
        ("host's huge page PMDs split (thp_split_pmd)", ("thp_events", "split_pmd"), "d"),
        ("host's huge pages split (thp_split_page)", ("thp_events", "split_page"), "d"),
        ("host's huge pages made by faults (thp_fault_alloc)", ("thp_events", "fault_alloc"), "d"),
        (
            "guests' RAM in huge pages at the end of the workload, MiB",
            "anon_huge_mib_work_done",
            ".0f",
        ),
        ("the same at the end, MiB", "anon_huge_mib_end", ".0f"),
        ("sampler pass (mean), ms", "sample_ms_mean", ".0f"),
        ("duplicates not yet shared, integrated over the run, MiB*s", "dup_mib_s", ".0f"),
        ("duplicates not yet shared at the end, MiB", "dup_mib_end", ".1f"),
        (
            "listed pages held by guests not yet shared, integrated, MiB*s",
            "listed_unshared_mib_s",
            ".0f",
        ),
        ("saved at the end net of the server's pages, MiB", "net_saved_mib_end", ".1f"),
        ("the same beyond none's (its zero-page mappings), MiB", "sharing_saved_mib_end", ".1f"),
        ("server's pages no guest maps at the end, MiB", "server_unused_mib_end", ".1f"),
        ("kworkers' CPU, s", "kworker_cpu_s", ".1f"),
        (
            "the same beyond none's rate (all of it if none did not run), s",
            "kworker_excess_cpu_s",
            ".1f",
        ),
        ("sharing CPU: ksmd + merge_pages + server + those kworkers, s", "sharing_cpu_s", ".1f"),
        ("sharing CPU s per GiB saved (beyond none)", "sharing_cpu_s_per_gib_saved", ".1f"),
        (
            "sharing CPU without the server's start-up hash, s",
            "sharing_cpu_after_startup_s",
            ".1f",
        ),
        ("machine's busy CPU less the sampler's, s", "machine_cpu_s", ".0f"),
        ("the same beyond none's (noisy), s", "machine_cpu_beyond_none_s", ".0f"),
    ]
    cfgs = list(summary["configs"])
    out = [
        f"- command: `{cmdline}`",
        f"- {facts}",
        f"- listed blocks: {summary['listed_blocks']}; guests read identical bytes in "
        f"every configuration: {'yes' if summary['bytes_identical'] else 'NO'} "
        f"({len(summary['checksums'])} distinct checksum(s))",
        "",
        "| | " + " | ".join(cfgs) + " |",
        "|---|" + "---:|" * len(cfgs),
    ]
    for label, key, spec in rows:
        vals = []
        for c in cfgs:
            d = summary["configs"][c]
            if "error" in d:
                vals.append(d["error"])
                continue
            v = (d.get(key[0]) or {}).get(key[1]) if isinstance(key, tuple) else d.get(key)
            vals.append(fmt(v, spec))
        out.append(f"| {label} | " + " | ".join(vals) + " |")
    if any(c.get("thp_events") == {} for c in summary["configs"].values()):
        # the events were taken, but /proc/vmstat had none of them
        out += [
            "",
            "- host's huge page events: none in the pageshare host's /proc/vmstat "
            "(its kernel lacks CONFIG_VM_EVENT_COUNTERS; config/plain.config sets it)",
        ]
    return "\n".join(out + frontier(summary["configs"]) + corunner(summary["configs"])) + "\n"


def frontier(configs: dict[str, dict[str, Any]]) -> list[str]:
    """The CPU/memory frontier as markdown lines, and issue 20's targets
    read from it: a pageshare configuration that ends with at least
    KSM-default's savings (within 5 %) for at least 5x less sharing CPU and
    10x fewer MiB*s of duplicates not yet shared, and pageshare points that
    dominate every KSM-only point on those two axes.  Empty without at
    least one of each with the census."""

    def ok(name: str) -> bool:
        c = configs[name]
        return (
            "error" not in c
            and c.get("sharing_cpu_s") is not None
            and c.get("dup_mib_s") is not None
            and c.get("sharing_saved_mib_end") is not None
        )

    ksm = [n for n in configs if ok(n) and (n.startswith("ksm") and n != "ksm-fpr")]
    ps = [n for n in configs if ok(n) and n.startswith("pageshare") and n != "pageshare-faults"]
    if not ksm or not ps:
        return []
    out = [
        "",
        "Frontier: sharing CPU (all costs) against memory not yet shared",
        "",
        "| configuration | sharing CPU, s | the same without the start-up hash, s "
        "| duplicates not yet shared, MiB*s | listed pages not yet shared, MiB*s "
        "| saved at the end beyond none, MiB | CPU s per GiB saved |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for n in ksm + ps:
        c = configs[n]
        out.append(
            f"| {n} | {c['sharing_cpu_s']:.1f} | {fmt(c.get('sharing_cpu_after_startup_s'))} "
            f"| {c['dup_mib_s']:.0f} | {fmt(c.get('listed_unshared_mib_s'), '.0f')} | "
            f"{c['sharing_saved_mib_end']:.1f} | "
            f"{fmt(c['sharing_cpu_s_per_gib_saved'])} |"
        )
    out.append("")
    for cpu, how in (
        ("sharing_cpu_s", "all costs"),
        ("sharing_cpu_after_startup_s", "without the server's start-up hash"),
    ):
        if any(configs[n].get(cpu) is None for n in ksm + ps):
            continue
        out += frontier_targets(configs, ksm, ps, cpu, how)
    return out


def frontier_targets(
    configs: dict[str, dict[str, Any]], ksm: list[str], ps: list[str], cpu: str, how: str
) -> list[str]:
    """Issue 20's two frontier targets, met or MISSED, with sharing CPU
    read from key ``cpu`` (described by ``how``)."""
    out = []
    if "ksm" in ksm:
        k = configs["ksm"]
        best = next(
            (
                n
                for n in ps
                if configs[n]["sharing_saved_mib_end"] >= 0.95 * k["sharing_saved_mib_end"]
                and configs[n][cpu] * 5 <= k[cpu]
                and configs[n]["dup_mib_s"] * 10 <= k["dup_mib_s"]
            ),
            None,
        )
        out.append(
            f"- ({how}) a pageshare configuration with KSM-default's savings "
            "(within 5 %), 5x less sharing CPU and 10x fewer MiB*s: "
            + (f"met by {best}" if best else "MISSED (no configuration meets all three)")
        )
    beaten = [
        n
        for n in ksm
        if not any(
            configs[p][cpu] <= configs[n][cpu]
            and configs[p]["dup_mib_s"] <= configs[n]["dup_mib_s"]
            for p in ps
        )
    ]
    out.append(
        f"- ({how}) pageshare dominating every KSM-only point on CPU and MiB*s: "
        + ("met" if not beaten else f"MISSED at {', '.join(beaten)}")
    )
    return out


def symbolize(rips: list[int], system_map: Path) -> list[str]:
    """Kernel addresses as symbol+offset, from the kernel's System.map."""
    syms: list[tuple[int, str]] = []
    for line in system_map.read_text().splitlines():
        addr, kind, name = [*line.split(), "", "", ""][:3]
        if kind.lower() in ("t", "w"):
            syms.append((int(addr, 16), name))
    syms.sort()
    out = []
    for rip in rips:
        below = [(a, n) for a, n in syms if a <= rip]
        out.append(f"{below[-1][1]}+{rip - below[-1][0]:#x}" if below else f"{rip:#x}")
    return out


def write_results(
    out: Path,
    lines: list[str],
    st: Settings,
    nlisted: int,
    cmdline: str,
    facts: str,
    system_map: Path | None = None,
    known_symbols: dict[tuple[str, int], list[str]] | None = None,
) -> dict[str, Any]:
    """The CSVs, summary.json and summary.md of a run, from its serial log.
    A guest that did not boot gets its RIPs named from the guest kernel's
    system_map (or known_symbols, a recorded run's)."""
    rows = parse(lines)
    write_csv(out / "samples_guest.csv", GUEST_FIELDS, rows["E2E-G"])
    write_csv(out / "replaced.csv", REPLACED_FIELDS, rows["replaced"])
    write_csv(out / "fallback.csv", FALLBACK_FIELDS, rows["fallback"])
    write_csv(out / "lost.csv", LOST_FIELDS, rows["lost"])
    write_csv(out / "samples_host.csv", HOST_FIELDS, rows["E2E-H"])
    write_csv(out / "events.csv", ["cfg", "t_ms", "event", "detail"], rows["ev"])
    write_csv(out / "guests.csv", ["cfg", "guest", "marks"], rows["guest"])
    summary = summarize(rows, st, nlisted)
    fb = feedback_summaries(lines)
    if fb:
        write_feedback(out / "feedback.json.gz", fb)
    for h in summary.get("boot_hangs", []):
        rips = [
            int(x, 16)
            for x in h["detail"].partition("RIP")[2].split()
            if all(c in "0123456789abcdef" for c in x)
        ]
        if system_map is not None and system_map.exists():
            h["symbols"] = symbolize(rips, system_map)
        elif known_symbols and (h["cfg"], h["t_ms"]) in known_symbols:
            h["symbols"] = known_symbols[(h["cfg"], h["t_ms"])]
    summary.update(command=cmdline, facts=facts, settings=st.__dict__)
    mig_md = e2e_migration.write_results(out, lines, GUEST_FIELDS, summary)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    md = markdown(summary, cmdline, facts) + mig_md
    (out / "summary.md").write_text(md)
    print(md)
    if rows["error"]:
        raise BenchError(
            "the run in the pageshare host stopped: "
            + rows["error"][0][0]
            + f" (serial log: {out / 'serial.log.gz'})"
        )
    return summary


def reparse(run: Path) -> int:
    """Recompute a recorded run's CSVs and summaries from its serial log
    (after the summary's arithmetic changed); settings, command line and
    facts are the run's own."""
    old = json.loads((run / "summary.json").read_text())
    if (run / "serial.log").exists():
        (run / "serial.log.gz").write_bytes(gzip.compress((run / "serial.log").read_bytes()))
        (run / "serial.log").unlink()
    lines = (
        gzip.decompress((run / "serial.log.gz").read_bytes()).decode(errors="replace").splitlines()
    )
    known = {
        (h["cfg"], h["t_ms"]): h["symbols"] for h in old.get("boot_hangs", []) if "symbols" in h
    }
    write_results(
        run,
        lines,
        Settings(**old["settings"]),
        old["listed_blocks"],
        old["command"],
        old["facts"],
        known_symbols=known,
    )
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--image", type=Path, help="golden image (default: the small variant)")
    ap.add_argument(
        "--list", type=Path, help="its list (default: analyze-image's, see --list-from; cached)"
    )
    ap.add_argument(
        "--list-from",
        choices=("workload", "boot"),
        default="workload",
        help="without --list: analyze-image with the guests' own grep as its "
        "--workload (default), or its plain boot of the image",
    )
    ap.add_argument("--guests", type=int, default=3)
    ap.add_argument("--guest-mib", type=int, default=384)
    ap.add_argument("--host-mib", type=int, default=6144, help="memory of the pageshare host VM")
    ap.add_argument(
        "--observe",
        type=int,
        default=150,
        help="seconds sampled after the guests' workload is done",
    )
    ap.add_argument("--interval-ms", type=int, default=1000)
    ap.add_argument(
        "--configs",
        default=",".join(CONFIGS),
        help=f"comma-separated, in order (default {','.join(CONFIGS)}); also "
        "ksm-ptsN and pageshare-ptsN: ksmd's pages_to_scan N instead of "
        "100; NAME-rN: NAME once more, under a name of its own",
    )
    ap.add_argument(
        "--frontier",
        action="store_true",
        help=f"run the CPU/memory frontier instead: {','.join(FRONTIER)} (10-30 min "
        "of VM time each here, under TCG: docs/benchmarks.md, 'Run time')",
    )
    ap.add_argument(
        "--feedback",
        action="store_true",
        help="a Redis in the pageshare host for the server's read feedback; "
        "what it published after each filter configuration goes to "
        "feedback.json.gz (bench/feedback_round.py refines a list from it)",
    )
    ap.add_argument(
        "--pressure",
        type=int,
        default=0,
        metavar="MIB",
        help="host memory pressure in every configuration: a never-read "
        "tmpfs file of MIB MiB written before the guests start, with a "
        "zram swap device in the pageshare host (try host-mib less "
        "about 1700)",
    )
    ap.add_argument("--grep-dirs", default=GREP_DIRS)
    ap.add_argument(
        "--mixed",
        action="store_true",
        help="guests not in lockstep: each reads its own directories, part "
        "of them shared with each other guest, after its own delay "
        "(MIXED in the script); the list should cover them all",
    )
    ap.add_argument(
        "--corunner",
        type=int,
        default=0,
        metavar="MIB",
        help="the last guest is a CPU-bound co-runner: it hashes MIB MiB of "
        "zeros and reads nothing; its pace beside the filter is compared with "
        "its pace beside none, pair by pair (alternate them: --configs "
        "none,pageshare,none-r2,pageshare-r2,...)",
    )
    ap.add_argument("--sum-dirs", default=SUM_DIRS)
    ap.add_argument("--work-timeout", type=int, default=2400)
    ap.add_argument(
        "--boot-timeout",
        type=int,
        default=900,
        help="a guest that has not mounted its root after this many seconds "
        "is shown (log, RIP) and its configuration run again, once",
    )
    ap.add_argument(
        "--stale-mib",
        type=int,
        default=64,
        help="MiB of stale memory each guest frees after its reads (what "
        "free page reporting hands back)",
    )
    ap.add_argument(
        "--migrate",
        action="store_true",
        help="after the pageshare configuration's workload, migrate guest 1 "
        "in the pageshare host with each of precopy, xbzrle, multifd-zstd "
        "and block-refs from the same state (migration.csv and a table "
        "in summary.md)",
    )
    ap.add_argument(
        "--migrate-ksm-cap",
        type=int,
        default=300,
        help="seconds a destination is followed until KSM shares as much of "
        "it as block-refs' does right after switchover",
    )
    ap.add_argument(
        "--migrate-mbit", type=int, default=1000, help="max-bandwidth of each migration, Mbit/s"
    )
    ap.add_argument("--out", type=Path)
    ap.add_argument(
        "--reparse",
        type=Path,
        metavar="RUN_DIR",
        help="only recompute a recorded run's CSVs and summaries from its serial log, and exit",
    )
    args = ap.parse_args()
    if args.reparse:
        return reparse(args.reparse)
    configs = FRONTIER if args.frontier else [c for c in args.configs.split(",") if c]
    bad = [c for c in configs if not known_config(c)]
    if bad:
        ap.error(
            f"unknown configuration(s) {', '.join(bad)}; known: {', '.join(CONFIGS)}, "
            "ksm-ptsN or pageshare-ptsN (pages_to_scan N), and any of them again as "
            "NAME-rN"
        )
    if args.corunner and args.guests < 2:
        ap.error("--corunner needs --guests 2 or more: the last guest is the co-runner")
    if len(set(configs)) != len(configs):
        ap.error("a configuration is named twice in --configs")
    if args.migrate and "pageshare" not in configs:
        ap.error(
            "--migrate migrates a guest of the pageshare configuration: "
            "--configs must include pageshare"
        )
    if os.geteuid() != 0:
        ap.error("run as root (analyze-image drives host KSM)")
    for given in (args.image, args.list):
        if given is not None and not given.is_file():
            ap.error(f"{given}: no such file")
    st = Settings(
        args.guests,
        args.guest_mib,
        args.host_mib,
        args.observe,
        args.interval_ms,
        configs,
        args.grep_dirs,
        args.sum_dirs,
        args.work_timeout,
        args.boot_timeout,
        args.stale_mib,
        args.migrate,
        args.migrate_ksm_cap,
        args.migrate_mbit,
        args.mixed,
        args.pressure,
        args.feedback,
        args.corunner,
    )
    workload = list_workload(st.grep_dirs) if args.list_from == "workload" else None
    ktest.exit_on_sigterm()  # a stopped run stops its pageshare host VM too
    t_start = time.monotonic()
    # refuse early: before the golden image, the kernels and QEMU are built
    host_preflight(
        KSM,
        args.list is None
        and args.image is not None
        and cached_list(args.image, cache.cache_root(), workload) is None,
    )
    try:
        root = ktest.cache_root()
        image = args.image or golden.build_image("small").path
        host_preflight(
            KSM, args.list is None and cached_list(image, cache.cache_root(), workload) is None
        )
        pcsl = args.list or ensure_list(image, cache.cache_root(), workload)
        hashes, nlisted = listed_hashes(image, pcsl)
        log(f"{nlisted} listed blocks in {pcsl}")
        patches = ktest.series_files()
        src = ktest.ensure_source(root)
        with src.locked():
            kdir = ktest.ensure_kernel(src, patches, "plain")
            gk = ktest.ensure_kernel(src, patches, ktest.BENCH_GUEST_CONFIG) / "bzImage"
        busybox = ktest.ensure_busybox(root)
        out = args.out or REPO / "bench/results" / time.strftime("e2e-%Y%m%d-%H%M")
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="e2e-", dir="/var/tmp") as td:
            payload = Path(td) / "payload.cpio.gz"
            build_payload(image, pcsl, hashes, st, busybox, gk, payload)
            initramfs = Path(td) / "initramfs.cpio.gz"
            # KSM in merge mode from boot on, as on a pageshare host (the
            # driver refuses a host with KSM off)
            test = ktest.GuestTest(
                "e2e",
                ["/bin/sh", "/pageshare/driver.sh"],
                (st.work_timeout + st.boot_timeout) * len(configs) + 600 + migrate_budget(st),
                pre="echo 1 > /sys/kernel/mm/ksm/run",
            )
            empty = Path(td) / "tests"
            empty.mkdir()
            ktest.build_initramfs(busybox, empty, [test], initramfs, payload)
            log(
                f"prepared in {time.monotonic() - t_start:.0f} s; booting the pageshare "
                f"host (-m {st.host_mib}M), serial log {out / 'serial.log'}"
            )
            t_boot = time.monotonic()
            lines = ktest.boot(
                kdir,
                initramfs,
                out / "serial.log",
                test.timeout + 300,
                mem=f"{st.host_mib}M",
                show=lambda s: s.startswith(
                    ("E2E-EV", "E2E-GUEST", "E2E-ERROR", "E2E-M ", "KTEST-")
                ),
            )
        vm_s = time.monotonic() - t_boot
    except ktest.KtestError as e:
        raise BenchError(str(e)) from e
    serial = out / "serial.log"
    (out / "serial.log.gz").write_bytes(gzip.compress(serial.read_bytes()))
    serial.unlink()
    cmdline = shlex.join(["bench/e2e_vs_ksm.py", *sys.argv[1:]])
    facts = (
        f"host: {os.cpu_count()} cores, {platform.release()}; pageshare host: patched "
        f"6.12 plain under TCG, -m {st.host_mib}M -smp 2; {st.guests} guests of "
        f"{st.guest_mib} MiB nested under TCG; image {image.name} "
        f"({image.parent.name}); list {pcsl.name}, {nlisted} blocks, "
        + (
            f"given with --list ({pcsl})"
            if args.list
            else f"analyze-image --workload {shlex.quote(workload)}"
            if workload
            else "analyze-image of the image's boot"
        )
        + f"; VM time {vm_s / 60:.0f} min"
    )
    summary = write_results(out, lines, st, nlisted, cmdline, facts, gk.parent / "System.map")
    if not any(x.startswith("E2E-EV all") and " finished" in x for x in lines):
        log(f"the run did not finish; see {out / 'serial.log.gz'}")
        return 1
    if not summary["bytes_identical"]:
        log("guests read different bytes in different configurations: a wrong byte")
        return 1
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BenchError as e:
        print(f"e2e_vs_ksm: {e}", file=sys.stderr)
        sys.exit(2)
