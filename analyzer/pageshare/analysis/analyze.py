"""analyze-image: from a golden image to a verified sector list.

One analysis = N runs.  Each run boots a pair of guests from fresh overlays
of the base, lets host KSM merge them, records which frames merged across
the pair (host view), classifies those frames inside the guests with crash
and pagescan (guest view), and maps clean page-cache pages back to
base-image sectors, verifying every byte.  Blocks seen in at least
`min_runs` runs form the list.  docs/ARCHITECTURE.md explains the why.
"""

import datetime as dt
import os
import platform
import re
import shutil
import sqlite3
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .. import __version__
from ..errors import UserError
from ..image import btrfsmap, diskimage, xfsmap
from ..image.ext4map import Extent, fs_image, read_extents, read_paths
from ..image.fslayout import MappedFs, SkippedFs
from ..image.image_inspect import Inspection, inspect_image, probe_format
from ..lists import sectorlist
from ..progress import Progress
from . import drgn_backend, resultsdb
from .aggregate import (
    PAGE,
    VMS,
    PageFact,
    RunResult,
    breakdown,
    keep_blocks,
    ksm_series,
    majority,
    top_files,
    unservable_pages,
)
from .classify import PageRecord
from .crash_backend import classify_pfns, crash_version
from .debugsyms import check_vmlinux, find_vmlinux
from .dump import ElfDump, parse_vmcoreinfo
from .hostmap import MergeClass, classify_pair, ram_ranges, snapshot
from .ksm import KSM, Sample, ksm_session
from .mapping import (
    COMPRESSED,
    INLINE,
    STABLE,
    Candidate,
    FsKey,
    Geometry,
    Placement,
    map_page,
    norm_uuid,
)
from .resultsdb import GuestPage, ListedBlock, connect
from .vm import BootSpec, Guest, choose_accel, qemu_version, require_qemu
from .workload import FW_CFG_NAME, Markers, Workload, kernel_cmdline, write_script


def default_db() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local/share")
    return Path(os.environ.get("PAGESHARE_DB", Path(base) / "pageshare" / "results.sqlite"))


@dataclass
class Options:
    image: Path
    lists_dir: Path = Path("lists")
    db: Path = field(default_factory=default_db)
    runs: int = 1
    min_runs: int | None = None
    ram_mib: int = 1024
    accel: str = "auto"
    workload: Workload = field(default_factory=Workload)
    settle: float = 20.0
    boot_timeout: float = 900.0
    ksm_timeout: float = 600.0
    vmlinux: Path | None = None
    include_metadata: bool = False
    introspector: str = "auto"  # auto, crash or drgn: see choose_introspector
    workdir_parent: Path = Path(os.environ.get("PAGESHARE_WORKDIR", "/var/tmp"))

    def effective_min_runs(self) -> int:
        return self.min_runs if self.min_runs else majority(self.runs)


@dataclass
class Summary:
    image: str
    list_path: str
    analysis_id: int
    accel: str
    accel_reason: str
    runs: int
    min_runs: int
    listed_blocks: int
    listed_mib: float
    breakdown_pages: dict[str, int]
    coverage: float
    top_files: list[tuple[str, float]]
    phases: dict[str, float]
    ksm: list[dict[str, Any]]
    introspector: str = ""
    introspector_reason: str = ""
    # KSM-merged page-cache pages (both VMs, all runs) of btrfs inline or
    # compressed extents: cached file data the list cannot cover.
    unservable_pages: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return self.__dict__.copy()


@dataclass(frozen=True)
class RunContext:
    """What every run of one analysis shares, set up once by analyze() (and read
    again by _finish), so that a run's function takes it and its number only."""

    opts: Options
    progress: Progress
    db: sqlite3.Connection
    analysis_id: int
    workdir: Path
    raw: Path  # the base image as raw (base.raw)
    geo: Geometry
    sources: dict[FsKey, tuple[Path, int]]  # where debugfs/xfs_db/btrfs read each fs
    fmt: str  # of opts.image, as the guests open it
    boot: BootSpec
    accel: str
    accel_reason: str
    vmlinux: Path


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def preflight(opts: Options) -> None:
    """Everything that can be checked before spending minutes."""
    if os.geteuid() != 0:
        raise UserError(
            "analyze-image must run as root",
            "it reads /proc/PID/pagemap and /proc/kpageflags and drives host KSM: run it with sudo",
        )
    KSM().check_usable()
    require_qemu()
    for tool in ("debugfs", "readelf", "dpkg-deb"):
        if not shutil.which(tool):
            raise UserError(f"{tool} not found", "run scripts/install-deps.sh")
    if opts.runs < 1:
        raise UserError("--runs must be at least 1", "")
    if not 1 <= opts.effective_min_runs() <= opts.runs:
        raise UserError(f"--min-runs must be between 1 and --runs ({opts.runs})", "")
    if opts.ram_mib < 256:
        raise UserError("--ram below 256 MiB cannot boot a Debian guest", "use --ram 1024")
    if opts.vmlinux:
        # The build-id is checked against the guest once it runs.
        check_vmlinux(opts.vmlinux, None)
    check_space(opts)


def check_space(opts: Options, fs_copies: bool = False) -> None:
    """The work directory holds a raw copy of the base and two RAM-sized dumps, and
    with fs_copies the copies of file systems that xfs_db, btrfs or debugfs read
    apart (XFS, btrfs, LVs of several segments): at most the image's data again."""
    opts.workdir_parent.mkdir(parents=True, exist_ok=True)
    size = opts.image.stat().st_size if opts.image.exists() else 0
    need = 2 * opts.ram_mib * 2**20 + size * (2 if fs_copies else 1)
    free = shutil.disk_usage(opts.workdir_parent).free
    if free < need * 1.1:
        raise UserError(
            f"not enough space in {opts.workdir_parent}: {free / 2**30:.1f} GiB free, "
            f"about {need * 1.1 / 2**30:.1f} GiB needed for the raw image copy"
            + (", copies of its XFS or btrfs file systems" if fs_copies else "")
            + " and two memory dumps",
            "free space there, or point PAGESHARE_WORKDIR at a larger file system",
        )


def analyze(opts: Options, progress: Progress) -> Summary:
    preflight(opts)
    fmt, vsize = probe_format(opts.image)
    with progress.phase("inspect", f"inspecting {opts.image} with libguestfs"):
        insp = inspect_image(opts.image, fmt, vsize, tcg=opts.accel != "kvm")
    info = insp.info
    progress.say(
        f"{info.product} ({info.distro} {info.major}.{info.minor}), kernel "
        f"{info.kernel_version}, root {info.root_fstype} on {info.root_device} at "
        f"sector {info.root_start_sector}, {info.block_size}-byte blocks"
    )
    for fs in info.filesystems:
        where = (
            f"LV {fs.lv}, {len(fs.runs)} segment(s) from sector {fs.start_sector}"
            if fs.lv
            else f"linear MD {fs.md}, {len(fs.runs)} member(s) from sector {fs.start_sector}"
            if fs.md
            else f"at sector {fs.start_sector}"
        )
        if fs.lv or fs.md or fs.mountpoint != "/":
            progress.say(
                f"{'also ' if fs.mountpoint != '/' else ''}mapped: {fs.mountpoint} "
                f"({fs.fstype} on {fs.device}, {where}, {fs.block_size}-byte blocks)"
            )
    for sk in info.skipped:
        progress.say(
            f"note: {sk.mountpoint} ({sk.fstype or 'unknown'} on {sk.device}) is not "
            f"mapped, its files cannot be listed: {sk.reason}"
        )
    if any(f.fstype in ("xfs", "btrfs") or len(f.runs) > 1 for f in info.filesystems):
        check_space(opts, fs_copies=True)
    if any(f.fstype == "xfs" for f in info.filesystems) and not shutil.which("xfs_db"):
        raise UserError(
            "xfs_db not found; the image has XFS file systems to map",
            "run scripts/install-deps.sh (apt: xfsprogs)",
        )
    if any(f.fstype == "btrfs" for f in info.filesystems) and not shutil.which("btrfs"):
        raise UserError(
            "btrfs (btrfs-progs) not found; the image has btrfs file systems to map",
            "run scripts/install-deps.sh (apt: btrfs-progs)",
        )
    if any("inline_data" in f.features or "encrypt" in f.features for f in info.filesystems):
        progress.say("note: inline_data/encrypt files cannot be listed and will be skipped")

    with progress.phase("debug-symbols", "finding debug symbols for the guest kernel"):
        vmlinux = opts.vmlinux or find_vmlinux(info.kernel_version, None, progress.say)
    check_introspector(opts.introspector, info.kernel_version)
    accel, accel_reason = choose_accel(opts.accel, insp.kernel)
    progress.say(f"accelerator: {accel} ({accel_reason})")

    opts.workdir_parent.mkdir(parents=True, exist_ok=True)
    # Absolute: the guests' QEMUs run in it (vm.Guest.start) and name their
    # files by this path.
    workdir = Path(tempfile.mkdtemp(prefix="pageshare-analyze-", dir=opts.workdir_parent.resolve()))
    db = connect(opts.db)
    analysis_id = 0
    try:
        with progress.phase("base-image", "reading the base image (raw copy, content hash)"):
            raw = workdir / "base.raw"
            diskimage.to_raw(opts.image, raw)
            base = read_base_image(opts.image, raw, vsize, insp, workdir, progress)
        insp, geo, content, sources = base.insp, base.geo, base.content, base.sources
        image_id = resultsdb.record_image(db, opts.image, fmt, vsize, content, insp.info)
        analysis_id = resultsdb.start_analysis(
            db,
            image_id,
            started_at=_now(),
            tool_version=__version__,
            host_kernel=platform.release(),
            qemu_version=qemu_version(),
            crash_version=installed_crash(),
            accel=accel,
            accel_reason=accel_reason,
            ram_mib=opts.ram_mib,
            runs=opts.runs,
            min_runs=opts.effective_min_runs(),
            workload=opts.workload.describe(),
            settle_s=opts.settle,
            # The request until a run has seen the guest kernel; then the backend used.
            introspector=opts.introspector,
        )
        resultsdb.record_filesystems(db, analysis_id, insp.info.filesystems, insp.info.skipped)
        db.commit()

        root = info.filesystems[0]
        boot = BootSpec(
            insp.kernel,
            insp.initrd,
            kernel_cmdline(info.root_uuid, f"subvol={root.subvol}" if root.subvol else ""),
        )
        ctx = RunContext(
            opts,
            progress,
            db,
            analysis_id,
            workdir,
            raw,
            geo,
            sources,
            fmt,
            boot,
            accel,
            accel_reason,
            vmlinux,
        )
        results: list[RunResult] = []
        with ksm_session(KSM(), progress.say) as ksm:
            for seq in range(1, opts.runs + 1):
                results.append(_run_once(ctx, ksm, seq))
        with progress.phase("write-list", "aggregating runs and writing the list"):
            summary = _finish(ctx, insp, content, results)
        resultsdb.finish_analysis(db, analysis_id, _now(), progress.phases)
        db.commit()
        summary.phases = dict(progress.phases)
        summary.introspector, summary.introspector_reason = results[-1].introspector
        summary.unservable_pages = unservable_pages(results)
        return summary
    except BaseException as e:
        if analysis_id:
            resultsdb.fail_analysis(db, analysis_id, _now(), f"{type(e).__name__}: {e}")
            db.commit()
        raise
    finally:
        db.close()
        shutil.rmtree(workdir, ignore_errors=True)


def _wait_ready(
    guests: list[Guest],
    markers: Markers,
    boot_timeout: float,
    workload_timeout: float,
    progress: Progress,
) -> dict[str, float]:
    """Waits for each guest's boot marker, then its ready marker (after the workload)."""
    t0 = time.monotonic()
    booted: dict[str, float] = {}
    done: dict[str, float] = {}
    last_note = t0
    while len(done) < len(guests):
        now = time.monotonic()
        for g in guests:
            if g.name in done:
                continue
            g.check_alive()
            text = g.serial_text()
            if g.name not in booted and markers.booted in text:
                booted[g.name] = now - t0
            if markers.ready in text:
                done[g.name] = now - t0
                rc = text.split(markers.ready, 1)[1].split()[0:1]
                progress.say(f"guest {g.name} ready after {done[g.name]:.0f}s ({' '.join(rc)})")
                if rc and rc[0] != "rc=0":
                    progress.say(f"warning: the workload in guest {g.name} exited with {rc[0]}")
                continue
            if g.name not in booted and now - t0 > boot_timeout:
                raise UserError(
                    f"guest {g.name}: the guest did not finish booting within "
                    f"{boot_timeout:.0f}s; last serial lines:\n    {_tail(g)}",
                    "check that the image boots to multi-user (systemd) with console="
                    "ttyS0, or raise --boot-timeout (TCG is slow)",
                )
            if g.name in booted and now - t0 - booted[g.name] > workload_timeout:
                raise UserError(
                    f"guest {g.name}: the workload did not finish within "
                    f"{workload_timeout:.0f}s; last serial lines:\n    {_tail(g)}",
                    "check the --workload command, or raise --workload-timeout",
                )
        if now - last_note > 30:
            progress.say(f"waiting for guests ({now - t0:.0f}s; TCG boots take a minute or two)")
            last_note = now
        time.sleep(0.5)
    return done


def _tail(g: Guest, n: int = 12) -> str:
    return "\n    ".join(g.serial_text().strip().splitlines()[-n:])


def _run_once(ctx: RunContext, ksm: KSM, seq: int) -> RunResult:
    """Run seq: boots the pair, lets KSM merge, classifies and verifies the
    merged frames; recorded in the results DB, committed when the run is done."""
    opts, progress, db, workdir = ctx.opts, ctx.progress, ctx.db, ctx.workdir
    tag = f"run {seq}/{opts.runs}"
    markers = Markers.new()
    script = write_script(workdir, opts.workload, markers)
    guests = [
        Guest(
            name,
            workdir,
            opts.image,
            ctx.fmt,
            ctx.boot,
            ctx.accel,
            opts.ram_mib,
            {FW_CFG_NAME: script},
        )
        for name in VMS
    ]
    run_id = resultsdb.start_run(db, ctx.analysis_id, seq)
    dumps: dict[str, Path] = {}
    try:
        with progress.phase("boot", f"{tag}: booting guests A and B from fresh overlays"):
            for g in guests:
                g.start()
            boot_s = _wait_ready(
                guests, markers, opts.boot_timeout, opts.workload.timeout, progress
            )
        with progress.phase(
            "ksm",
            f"{tag}: host KSM merging (settle {opts.settle:.0f}s, then "
            "until a full scan finds nothing new)",
        ):
            params = ksm.tune()
            last = [time.monotonic()]

            def note(s: Sample) -> None:
                if time.monotonic() - last[0] > 15:
                    progress.say(
                        f"{tag}: KSM full_scans={s.values.get('full_scans')} "
                        f"pages_sharing={s.values.get('pages_sharing')}"
                    )
                    last[0] = time.monotonic()

            conv = ksm.converge(timeout=opts.ksm_timeout, on_sample=note, min_time=opts.settle)
            samples = conv.samples
            if not conv.converged:
                progress.say(
                    f"warning: KSM did not converge within {opts.ksm_timeout:.0f}s; "
                    "using what merged so far"
                )
        with progress.phase("host-view", f"{tag}: pausing guests, reading host page tables"):
            for g in guests:
                g.stop_cpus()
            views = {}
            for g in guests:
                assert g.qmp and g.proc
                views[g.name] = snapshot(g.proc.pid, ram_ranges(g.qmp))
            mc = dict(zip(VMS, classify_pair(views["A"], views["B"]), strict=True))
            # KSM is not needed any more this run: give the host its settings back
            # before the long introspection phase.
            ksm.restore()
        with progress.phase("dump", f"{tag}: dumping guest memory"):
            for g in guests:
                dumps[g.name] = workdir / f"{g.name}.elf"
                g.dump(dumps[g.name])
        resultsdb.record_ksm_run(db, run_id, conv, params)
        for g in guests:
            assert g.proc
            resultsdb.record_vm(db, run_id, g.name, g.proc.pid, boot_s[g.name], mc[g.name])
    finally:
        for g in guests:
            g.shutdown()
    resultsdb.record_ksm_samples(db, run_id, samples)
    try:
        with progress.phase("introspect", f"{tag}: classifying merged frames"):
            recs, contents, build_id, used = _introspect(
                dumps, mc, ctx.vmlinux, workdir, progress, tag, opts.introspector
            )
        resultsdb.record_guest_kernel(db, run_id, build_id[0], build_id[1])
        resultsdb.set_introspector(db, ctx.analysis_id, used[0])
        with progress.phase("map-verify", f"{tag}: mapping page cache to sectors, verifying"):
            result = _map_and_verify(
                db, run_id, mc, recs, contents, ctx.raw, ctx.geo, ctx.sources, opts.include_metadata
            )
        result.introspector = used
        result.ksm_samples = samples
        db.commit()
        return result
    finally:
        for d in dumps.values():
            d.unlink(missing_ok=True)


# Which guest kernels a crash release cannot open: (crash older than, kernels
# from).  Both limits were seen here on QEMU ELF dumps of Debian kernels:
# - crash 8.0.2 on 6.12 applies no KASLR offset and stops with "<vmlinux> and
#   <dump> do not match!"; with --kaslr forced it fails in module_init() on
#   "invalid structure member offset: module_core_size", i.e. the struct
#   module_memory layout of 6.4.  crash 8.0.6's source handles module_memory;
#   releases in between were not checked and are treated like 8.0.2.
# - 8.0.5 fails on 6.11+ (crash-utility/crash issue #194 on GitHub); the
#   fixes are in crash 9.0, so every 8.0.x is treated that way.
CRASH_KERNEL_LIMITS = (((8, 0, 6), (6, 4)), ((9, 0), (6, 11)))


def _version_tuple(text: str) -> tuple[int, ...] | None:
    """(6, 12, 117) from "6.12.117+deb13-cloud-amd64"; (8, 0, 2) from "crash 8.0.2"."""
    m = re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", text)
    return tuple(int(g) for g in m.groups() if g is not None) if m else None


def installed_crash() -> str | None:
    return crash_version() if shutil.which("crash") else None


def check_introspector(requested: str, kernel_version: str) -> None:
    """Refuses, before any guest boots, a backend that cannot read this guest kernel."""
    crash = installed_crash()
    if requested == "crash":
        if crash is None:
            raise UserError(
                "--introspector crash: the crash utility is not installed",
                "run scripts/install-deps.sh, or use --introspector auto",
            )
        auto, why = choose_introspector("auto", kernel_version, crash)
        if auto != "crash":
            raise UserError(
                f"--introspector crash: {why.removeprefix('auto: ')}",
                "use --introspector auto (drgn reads newer kernels)",
            )


def choose_introspector(requested: str, osrelease: str, crash: str | None) -> tuple[str, str]:
    """Which backend classifies the guest's frames: (crash|drgn, why).

    auto keeps crash + pagescan (the reference implementation) for every
    kernel the installed crash can open, and uses drgn for the rest.
    osrelease is VMCOREINFO's OSRELEASE; crash is the installed crash's
    version line ("crash 8.0.2"), None when crash is not installed.
    """
    if requested in ("crash", "drgn"):
        return requested, "requested with --introspector"
    if requested != "auto":
        raise ValueError(f"unknown introspector {requested!r}")
    if crash is None:
        return "drgn", "auto: crash is not installed"
    kernel, crash_v = _version_tuple(osrelease), _version_tuple(crash)
    if kernel is None or crash_v is None:
        return "drgn", f"auto: cannot tell whether {crash} opens guest kernel {osrelease!r}"
    for older_than, first_bad in CRASH_KERNEL_LIMITS:
        if crash_v < older_than and kernel[:2] >= first_bad:
            return "drgn", (
                f"auto: guest kernel {osrelease} is {first_bad[0]}.{first_bad[1]} "
                f"or newer, which {crash} cannot open"
            )
    return "crash", f"auto: {crash} opens guest kernel {osrelease}"


def _introspect(
    dumps: dict[str, Path],
    mc: dict[str, MergeClass],
    vmlinux: Path,
    workdir: Path,
    progress: Progress,
    tag: str,
    introspector: str,
) -> tuple[
    dict[str, dict[int, PageRecord]], dict[str, dict[int, bytes]], tuple[str, str], tuple[str, str]
]:
    recs: dict[str, dict[int, PageRecord]] = {}
    contents: dict[str, dict[int, bytes]] = {}
    build_id = ("", "")
    used = ("", "")
    for vm, path in dumps.items():
        elf = ElfDump(path)
        try:
            info = elf.vmcoreinfo()
            if info is None:
                raise UserError(
                    f"guest {vm}: no VMCOREINFO in the dump or guest memory",
                    "the guest kernel must be built with CONFIG_CRASH_CORE (Debian kernels are)",
                )
            vmci = parse_vmcoreinfo(info)
            build_id = (vmci.get("OSRELEASE", ""), vmci.get("BUILD-ID", ""))
            check_vmlinux(vmlinux, build_id[1] or None)
            merged = {**mc[vm].cross, **mc[vm].intra}
            contents[vm] = {}
            for gpfn in merged:
                page = elf.page(gpfn)
                if page is not None:
                    contents[vm][gpfn] = page
        finally:
            elf.close()
        nonzero = [g for g, b in contents[vm].items() if any(b)]
        used = choose_introspector(introspector, build_id[0], installed_crash())
        progress.say(
            f"{tag}: guest {vm}: {len(merged)} merged frames, {len(nonzero)} non-zero; "
            f"classifying them with {used[0]} ({used[1]})"
        )
        t0 = time.monotonic()
        classify = drgn_backend.classify_pfns if used[0] == "drgn" else classify_pfns
        recs[vm] = classify(vmlinux, path, nonzero, workdir)
        progress.say(
            f"{tag}: guest {vm}: {used[0]} classified {len(nonzero)} frames in "
            f"{time.monotonic() - t0:.1f}s"
        )
    return recs, contents, build_id, used


def category_of(rec: PageRecord | None, zero: bool, listed: bool) -> str:
    if zero:
        return "zero"
    if rec is None:
        return "kernel"
    if listed:
        return "listed"
    if rec.kind in ("file", "bdev", "shmem"):
        return "page-cache"
    if rec.kind in ("anon", "ksm"):
        return "anon"
    return "kernel"


def _map_and_verify(
    db: sqlite3.Connection,
    run_id: int,
    mc: dict[str, MergeClass],
    recs: dict[str, dict[int, PageRecord]],
    contents: dict[str, dict[int, bytes]],
    raw: Path,
    geo: Geometry,
    sources: dict[FsKey, tuple[Path, int]],
    include_metadata: bool,
) -> RunResult:
    read_at, _ = diskimage.raw_file_reader(raw)
    # One debugfs per mapped file system, for the inodes the guests cached there.
    extents: dict[tuple[FsKey, int], list[Extent]] = {}
    candidates: dict[tuple[FsKey, int], list[Candidate]] = {}
    for fs in geo.filesystems:
        inodes = sorted(
            {
                r.ino
                for v in recs.values()
                for r in v.values()
                if r.kind == "file" and geo.find(r) == fs
            }
        )
        if fs.fstype == "btrfs":
            for ino, cands in _btrfs_candidates(fs, sources[fs.key][0], inodes).items():
                candidates[fs.key, ino] = cands
            continue
        for ino, exts in _read_extents(fs, sources[fs.key], inodes).items():
            extents[fs.key, ino] = exts
    stable: dict[str, dict[int, PageFact]] = {}
    cats: dict[str, Counter[str]] = {}
    gpfn_sector: dict[str, dict[int, int]] = {}
    merged_nonzero: dict[str, int] = {}
    unservable: Counter[str] = Counter()
    for vm in VMS:
        stable[vm], cats[vm], gpfn_sector[vm] = {}, Counter(), {}
        rows: list[GuestPage] = []
        for gpfn in mc[vm].zero:
            rows.append(
                GuestPage(
                    vm, gpfn, None, "zero", None, "zero", None, None, None, None, "zero", None
                )
            )
            cats[vm]["zero"] += 1
        for merge, frames in (("cross", mc[vm].cross), ("intra", mc[vm].intra)):
            for gpfn, pfn in frames.items():
                data = contents[vm].get(gpfn)
                rec = recs[vm].get(gpfn)
                is_zero = data is not None and not any(data)
                verdict, sector, tree = "", None, 0
                if is_zero:
                    verdict = "zero"
                elif rec is not None and rec.page_cache:
                    sector, verdict, tree = map_page(
                        rec,
                        data,
                        lambda s: read_at(s * 512, PAGE),
                        extents,
                        geo,
                        include_metadata,
                        candidates,
                    )
                if verdict in (INLINE, COMPRESSED):
                    unservable[verdict] += 1
                ok = verdict == STABLE and merge == "cross"
                if verdict == STABLE and merge != "cross":
                    verdict = "intra-only"
                home = geo.find(rec) if rec is not None and rec.kind == "file" else None
                if ok and rec is not None and sector is not None:
                    stable[vm][sector] = PageFact(
                        sector,
                        rec.ino if rec.kind == "file" else 0,
                        rec.index,
                        rec.kind,
                        home,
                        tree,
                    )
                    gpfn_sector[vm][gpfn] = sector
                cat = category_of(rec, is_zero, ok)
                cats[vm][cat] += 1
                rows.append(
                    GuestPage(
                        vm,
                        gpfn,
                        pfn,
                        merge,
                        rec.kind if rec else None,
                        cat,
                        rec.ino if rec else None,
                        rec.index if rec else None,
                        rec.state if rec else None,
                        sector,
                        verdict or None,
                        norm_uuid(rec.fs_uuid) if rec and rec.fs_uuid else None,
                    )
                )
        merged_nonzero[vm] = sum(n for c, n in cats[vm].items() if c != "zero")
        # Each VM's rows as soon as they are known: a failure mapping B's frames
        # still records A's (the failed analysis' commit keeps them).
        resultsdb.record_guest_pages(db, run_id, rows)
    return RunResult(stable, cats, merged_nonzero, gpfn_sector, unservable=unservable)


def _finish(ctx: RunContext, insp: Inspection, content: str, results: list[RunResult]) -> Summary:
    """Writes the list of the blocks the runs agree on, records it, and sums up."""
    opts, db, analysis_id, accel = ctx.opts, ctx.db, ctx.analysis_id, ctx.accel
    min_runs = opts.effective_min_runs()
    kept = keep_blocks(results, min_runs)
    keep, fact = kept.sectors, kept.fact
    read_at, _ = diskimage.raw_file_reader(ctx.raw)
    blocks = {s: sectorlist.block_hash(read_at(s * 512, PAGE)) for s in keep}
    info = insp.info
    sl = sectorlist.SectorList(
        image=sectorlist.ImageIdentity(info.virtual_size, content, opts.image.name),
        blocks=blocks,
        generator=f"analyze-image {__version__}",
        criteria="cross-vm-ksm,clean,verified,aligned8,nonzero"
        + (",metadata" if opts.include_metadata else ",no-metadata"),
        runs=f"{opts.runs} run(s), kept blocks seen in >= {min_runs}",
        extra={"x-guest-kernel": info.kernel_version, "x-accel": accel},
    )
    opts.lists_dir.mkdir(parents=True, exist_ok=True)
    list_path = opts.lists_dir / sectorlist.list_file_name(sl.image)
    sectorlist.write(sl, list_path)

    paths = _listed_paths(ctx.sources, [fact[s] for s in keep])
    resultsdb.record_files(
        db, analysis_id, [(place.uuid, ino, p) for (place, ino), p in paths.items()]
    )
    resultsdb.record_listed_blocks(
        db,
        analysis_id,
        [
            ListedBlock(
                s,
                blocks[s],
                f.ino or None,
                f.index * PAGE,
                f.kind,
                kept.runs_seen[s],
                int(kept.both_vms[s]),
                f.fs.uuid if f.fs else None,
            )
            for s, f in ((s, fact[s]) for s in keep)
        ],
    )
    resultsdb.record_list(db, analysis_id, list_path, len(keep))

    pages, coverage = breakdown(results, set(keep))
    return Summary(
        image=str(opts.image),
        list_path=str(list_path),
        analysis_id=analysis_id,
        accel=accel,
        accel_reason=ctx.accel_reason,
        runs=opts.runs,
        min_runs=min_runs,
        listed_blocks=len(keep),
        listed_mib=len(keep) * PAGE / 2**20,
        breakdown_pages=pages,
        coverage=coverage,
        top_files=top_files(keep, fact, paths),
        phases={},
        ksm=ksm_series(results),
    )


def _read_extents(
    fs: Placement, source: tuple[Path, int], inodes: list[int]
) -> dict[int, list[Extent]]:
    image, offset = source
    if fs.fstype == "xfs":
        return xfsmap.read_extents(image, inodes)  # a copy of the file system alone
    return read_extents(image, offset, inodes)


def placements(filesystems: tuple[MappedFs, ...]) -> tuple[Placement, ...]:
    """The mapped file systems as the mapping sees them, root first.  A btrfs
    whose subvolumes fstab mounts in several places (@rootfs on /, @home on
    /home) is one file system, one Placement listing each mount."""
    out: dict[FsKey, Placement] = {}
    for f in filesystems:
        p = Placement(
            norm_uuid(f.uuid),
            f.guest_start_sector,
            f.runs,
            f.mountpoint,
            f.fstype,
            ((f.subvol, f.mountpoint),) if f.fstype == "btrfs" else (),
        )
        if p.key in out and p.fstype == "btrfs":
            out[p.key] = replace(out[p.key], subvols=out[p.key].subvols + p.subvols)
        else:
            out.setdefault(p.key, p)
    return tuple(out.values())


@dataclass(frozen=True)
class BaseImage:
    """The base image as analyze-image and `pageshare list refine` read it."""

    read_at: Callable[[int, int], bytes]  # over the raw virtual disk
    content: str  # the virtual disk's sha256
    sources: dict[FsKey, tuple[Path, int]]  # where debugfs/xfs_db/btrfs read each fs
    insp: Inspection  # without the btrfs file systems that cannot be mapped
    geo: Geometry


def read_base_image(
    image: Path, raw: Path, vsize: int, insp: Inspection, workdir: Path, progress: Progress
) -> BaseImage:
    """IMAGE's content hash and its mapped file systems, read from RAW (its
    virtual disk as a raw file); copies of file systems go to WORKDIR."""
    geo = Geometry(placements(insp.info.filesystems), vsize)
    read_at, _ = diskimage.raw_file_reader(raw)
    content = diskimage.image_content_sha256(read_at, vsize)
    # xfs_db and btrfs read no file system at an offset of a disk, so XFS and
    # btrfs get a copy (as an LV of several segments does).
    sources = {
        fs.key: fs_image(raw, fs.runs, workdir / f"fs-{i}.img", copy=fs.fstype in ("xfs", "btrfs"))
        for i, fs in enumerate(geo.filesystems)
    }
    insp, geo = _check_btrfs_chunks(image, insp, geo, sources, progress)
    return BaseImage(read_at, content, sources, insp, geo)


def _check_btrfs_chunks(
    image: Path,
    insp: Inspection,
    geo: Geometry,
    sources: dict[FsKey, tuple[Path, int]],
    progress: Progress,
) -> tuple[Inspection, Geometry]:
    """A btrfs's chunk tree is first read here, before any guest boots: one whose
    data is striped or mirrored (a RAID profile, found only there) refuses the
    image as its root, and is skipped like any unmappable file system otherwise."""
    drop: dict[FsKey, str] = {}
    for fs in geo.filesystems:
        if fs.fstype != "btrfs":
            continue
        try:
            btrfsmap.check_chunks(sources[fs.key][0])
        except btrfsmap.BtrfsUnsupported as e:
            if fs.mountpoint == "/":
                raise UserError(
                    f"{image}: root file system is btrfs, which cannot be analyzed: {e}",
                    "analyze an image whose root btrfs keeps its "
                    "data and metadata in SINGLE or DUP chunks (btrfs balance start "
                    "-dconvert=single -mconvert=dup), or with an ext4 or XFS "
                    "root",
                ) from None
            drop[fs.key] = str(e)
            progress.say(
                f"note: {fs.mountpoint} (btrfs) is not mapped, its files cannot be listed: {e}"
            )
    if not drop:
        return insp, geo
    info = insp.info
    keep = tuple(
        f for f in info.filesystems if (norm_uuid(f.uuid), f.guest_start_sector) not in drop
    )
    gone = tuple(
        SkippedFs(f.mountpoint, f.device, f.fstype, drop[norm_uuid(f.uuid), f.guest_start_sector])
        for f in info.filesystems
        if f not in keep
    )
    insp = replace(insp, info=replace(info, filesystems=keep, skipped=info.skipped + gone))
    return insp, Geometry(
        tuple(f for f in geo.filesystems if f.key not in drop), geo.virtual_size, geo.disk
    )


def mounted_trees(fs: Placement, default: int, paths: dict[int, str]) -> list[tuple[int, str]]:
    """(tree, mountpoint) of each mount of a btrfs, as fs.subvols lists them:
    a subvolume named by its path from the top level, or "" for the default."""
    tree_of = {p: t for t, p in paths.items()}
    return [
        (default if not sv else tree_of[sv.strip("/")], mp)
        for sv, mp in fs.subvols
        if not sv or sv.strip("/") in tree_of
    ]


def _btrfs_candidates(fs: Placement, image: Path, inodes: list[int]) -> dict[int, list[Candidate]]:
    """Per inode number, its block map in every subvolume tree that has it
    (with data or inline/compressed extents), the mounted subvolumes first."""
    if not inodes:
        return {}
    subvols, default, paths = btrfsmap.read_subvolumes(image)
    order = list(
        dict.fromkeys([t for t, _ in mounted_trees(fs, default, paths)] + [s.tree for s in subvols])
    )
    per_tree = btrfsmap.read_subvolume_extents(image, inodes, order)
    out: dict[int, list[Candidate]] = {}
    for tree in order:
        exts, skipped = per_tree[tree]
        for ino in inodes:
            if exts.get(ino) or skipped.ranges.get(ino):
                out.setdefault(ino, []).append(
                    Candidate(tree, exts.get(ino, []), tuple(skipped.ranges.get(ino, [])))
                )
    return out


def _btrfs_paths(
    fs: Placement, image: Path, inodes: set[tuple[int, int]]
) -> dict[tuple[int, int], str]:
    """Guest paths of btrfs (tree, inode)s: the path in its subvolume, under where
    that subvolume (or one holding it) is mounted; none if it is mounted nowhere."""
    _, default, paths = btrfsmap.read_subvolumes(image)
    mounts = sorted(
        ((paths[t], mp) for t, mp in mounted_trees(fs, default, paths)), key=lambda m: -len(m[0])
    )
    out: dict[tuple[int, int], str] = {}
    for tree in sorted({t for t, _ in inodes}):
        found = btrfsmap.read_paths(image, sorted(i for t, i in inodes if t == tree), tree)
        for ino, p in found.items():
            top = "/".join(x for x in (paths.get(tree), p.strip("/")) if x)
            for sv, mp in mounts:
                if tree in paths and (not sv or top == sv or top.startswith(sv + "/")):
                    out[tree, ino] = mp.rstrip("/") + "/" + top[len(sv) :].lstrip("/")
                    break
    return out


def _listed_paths(
    sources: dict[FsKey, tuple[Path, int]], facts: list[PageFact]
) -> dict[tuple[Placement, int], str | None]:
    """The guest path of every listed file, by (file system, inode): one debugfs
    per file system, its paths under its mount point (/boot/vmlinuz-...)."""
    by_fs: dict[Placement, set[int]] = {}
    trees: dict[Placement, set[tuple[int, int]]] = {}
    for f in facts:
        if f.fs is not None and f.ino:
            by_fs.setdefault(f.fs, set()).add(f.ino)
            trees.setdefault(f.fs, set()).add((f.tree, f.ino))
    out: dict[tuple[Placement, int], str | None] = {}
    for fs, inos in by_fs.items():
        image, offset = sources[fs.key]
        if fs.fstype == "btrfs":
            # An inode number listed from two subvolumes gets the first path found.
            for (_, ino), path in sorted(_btrfs_paths(fs, image, trees[fs]).items()):
                out.setdefault((fs, ino), path)
            for ino in inos:
                out.setdefault((fs, ino), None)
            continue
        found = (
            xfsmap.read_paths(image, sorted(inos))
            if fs.fstype == "xfs"
            else read_paths(image, offset, sorted(inos))
        )
        for ino in inos:
            p = found.get(ino)
            # debugfs names a file in the file system's top directory "//name".
            out[fs, ino] = (fs.mountpoint.rstrip("/") + "/" + p.lstrip("/")) if p else None
    return out


def format_summary(s: Summary) -> str:
    lines = [
        f"analyze-image: {s.image}",
        f"  list:         {s.list_path}",
        f"  listed:       {s.listed_blocks} blocks, {s.listed_mib:.1f} MiB "
        f"({s.runs} run(s), kept blocks seen in >= {s.min_runs})",
        f"  accelerator:  {s.accel} ({s.accel_reason})",
        f"  introspector: {s.introspector} ({s.introspector_reason})",
        f"  results DB:   analysis #{s.analysis_id}",
        "  KSM-merged guest memory (both VMs, all runs):",
    ]
    total = sum(s.breakdown_pages.values()) or 1
    for cat in ("listed", "page-cache", "anon", "kernel", "zero"):
        n = s.breakdown_pages.get(cat, 0)
        label = {
            "listed": "listed page cache",
            "page-cache": "other page cache",
            "anon": "anonymous",
            "kernel": "kernel/other",
            "zero": "zero pages",
        }[cat]
        lines.append(f"    {label:<18} {n * PAGE / 2**20:9.1f} MiB  {100 * n / total:5.1f} %")
    lines.append(f"  list covers {100 * s.coverage:.1f} % of merged non-zero memory")
    if s.unservable_pages:
        lines.append(
            "  btrfs page cache no disk block holds as read (not listable): "
            + ", ".join(
                f"{n * PAGE / 2**20:.1f} MiB {k}" for k, n in sorted(s.unservable_pages.items())
            )
        )
    if s.top_files:
        lines.append("  top files by listed MiB:")
        lines += [f"    {mib:7.2f} MiB  {p}" for p, mib in s.top_files[:10]]
    lines.append("  time per phase:")
    lines += [f"    {k:<14} {v:7.1f} s" for k, v in s.phases.items()]
    return "\n".join(lines)
