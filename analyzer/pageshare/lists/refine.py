"""`pageshare list refine IMAGE`: the next list generation, from what the fleet's guests read.

Page servers publish per host and image a summary of the base blocks their
guests read (feedback.py has the format).  A refinement:

1. reads the image as analyze-image does (inspection, raw virtual disk,
   content sha256, the mapped file systems), and the current list: a file
   (``--list``) or the one published in Redis for the image;
2. reads every host's summary (one that does not parse is reported and
   skipped), and sums per block the guests (over hosts) and the hosts that
   saw at least one guest read it;
3. adds an unlisted block only if it lies inside the image, at least
   ``min_guests`` guests on at least ``min_hosts`` hosts read it, it is one
   whole page of a regular file of the image (fileblocks.py: the same
   file-system readers as analyze-image), and its bytes are not all zero;
   its hash is computed from the image's bytes;
4. with ``drop_unread``, drops listed blocks no guest read on any host
   during the window, but only if every host's summary covers the window
   (since <= window start, updated recently) and none failed to parse;
5. writes the list as the next generation (header ``x-generation``,
   ``x-parent-list-digest``), checks it back against the image byte for
   byte, and records the refinement in the results database (resultsdb.py:
   refinement, refined_block: each block added or dropped with what the
   fleet read of it, so that each generation's coverage follows,
   docs/results-db.md "Coverage per generation").

Publishing stays ``pageshare list publish`` (distribute.publish; ``--publish``
calls it).  Start from :func:`refine`; listcli.py holds the command line.
"""

from __future__ import annotations

import datetime as dt
import os
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import __version__
from ..analysis import resultsdb
from ..errors import UserError
from ..image import diskimage
from ..image.image_inspect import inspect_image, probe_format
from ..progress import Progress
from . import distribute, feedback, sectorlist
from .fileblocks import classify

# Defaults of the thresholds; the --help of `pageshare list refine` and
# analyzer/README.md explain them.
DEFAULT_MIN_GUESTS = 4
DEFAULT_MIN_HOSTS = 2
DEFAULT_WINDOW = 7 * 86400.0
# A summary not updated for this long no longer tells what its host's guests
# read now: it cannot justify dropping a block.
STALE_SUMMARY = 3600.0

PAGE = 4096
SECTORS_PER_PAGE = PAGE // 512

# Why an unlisted block the fleet read was not added (besides fileblocks.REASONS).
OUTSIDE_IMAGE = "outside-image"
BELOW_HOSTS = "below-min-hosts"
BELOW_GUESTS = "below-min-guests"
ZERO = "zero"
# Why a listed block was dropped.
UNREAD = "unread"
BYTES_DIFFER = "bytes-differ"


def default_db() -> Path:
    from ..analysis.analyze import default_db as analyze_db

    return analyze_db()


@dataclass
class RefineOptions:
    image: Path
    store: distribute.Store
    list_path: Path | None = None  # None: the list published in Redis for the image
    min_guests: int = DEFAULT_MIN_GUESTS
    min_hosts: int = DEFAULT_MIN_HOSTS
    drop_unread: bool = False
    window_s: float = DEFAULT_WINDOW
    output: Path | None = None
    lists_dir: Path = Path("lists")
    db: Path = field(default_factory=default_db)
    workdir_parent: Path = Path(os.environ.get("PAGESHARE_WORKDIR", "/var/tmp"))
    publish: bool = False
    now: float | None = None  # unix seconds; None: the clock


@dataclass
class RefineResult:
    image: str
    image_key: str
    parent: dict[str, Any]
    list_path: str
    list_digest: str
    generation: int
    blocks: int
    min_guests: int
    min_hosts: int
    hosts: list[dict[str, Any]]
    failures: list[dict[str, str]]
    reported_unlisted: int
    reported_listed: int
    added: int
    rejected: dict[str, int]
    dropped: int
    dropped_reasons: dict[str, int]
    drop_unread: dict[str, Any]
    refinement_id: int
    phases: dict[str, float] = field(default_factory=dict)
    published: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out["ok"] = True
        return out


class RefineError(UserError):
    """What stops a refinement: no feedback, a list of another image, ..."""


def _iso(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def generation_of(sl: sectorlist.SectorList) -> int:
    """A list's generation: its x-generation, 1 for analyze-image's lists (none)."""
    g = sl.extra.get("x-generation", "")
    return int(g) if g.isascii() and g.isdigit() and len(g) < 10 else 1


def refined_file_name(image: sectorlist.ImageIdentity, generation: int) -> str:
    return sectorlist.list_file_name(image).removesuffix(".pcsl") + f".gen{generation}.pcsl"


@dataclass
class _Tally:
    """The fleet's summaries summed per block."""

    unlisted: dict[int, list[int]] = field(default_factory=dict)  # block -> [guests, hosts, reads]
    listed_read: dict[int, list[int]] = field(default_factory=dict)  # the same, listed blocks
    guest_reads_listed: int = 0
    guest_reads_unlisted: int = 0


def tally(summaries: list[feedback.HostSummary], listed: set[int]) -> _Tally:
    """Per block: guests summed over hosts, hosts with a guest that read it, reads.

    Whether a block is listed is the parent list's business, not the record's
    flag: a host may serve an older or newer generation.  A listed block any
    record names with a guest or a read counts as read (it is kept); its
    hosts are those whose record does."""
    t = _Tally()
    for s in summaries:
        for block, guests, reads, _flags in s.records():
            if block in listed:
                if guests or reads:
                    t.guest_reads_listed += guests
                    _add_host(t.listed_read, block, guests, reads)
                continue
            if not guests:
                continue
            t.guest_reads_unlisted += guests
            _add_host(t.unlisted, block, guests, reads)
    return t


def _add_host(acc: dict[int, list[int]], block: int, guests: int, reads: int) -> None:
    """One host's record of BLOCK added to its [guests, hosts, reads]."""
    got = acc.get(block)
    if got is None:
        acc[block] = [guests, 1, reads]
    else:
        got[0] += guests
        got[1] += 1
        got[2] += reads


def drop_refusal(
    summaries: list[feedback.HostSummary],
    failures: list[dict[str, str]],
    window_start: float,
    now: float,
) -> str | None:
    """Why unread blocks must not be dropped, or None if every host's summary
    covers [window_start, now]."""
    if failures:
        return (
            f"the summaries of {', '.join(f['host'] for f in failures)} could not be read: "
            "what their guests read is unknown"
        )
    late = [s for s in summaries if s.since > window_start]
    if late:
        s = late[0]
        return (
            f"{len(late)} host(s) counted only since after the window began, e.g. "
            f"{s.host} since {_iso(s.since)} (window from {_iso(window_start)}): a block "
            "read before that would look unread; use a shorter --window or wait"
        )
    stale = [s for s in summaries if now - s.updated > STALE_SUMMARY]
    if stale:
        s = stale[0]
        return (
            f"{len(stale)} host(s) have not published for over {STALE_SUMMARY:.0f} s, "
            f"e.g. {s.host} (last {_iso(s.updated)}): what their guests read since is "
            "unknown"
        )
    return None


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _check_options(opts: RefineOptions) -> None:
    if opts.min_guests < 1 or opts.min_hosts < 1:
        raise RefineError(
            "--min-guests and --min-hosts must be at least 1",
            f"the defaults are --min-guests {DEFAULT_MIN_GUESTS} --min-hosts {DEFAULT_MIN_HOSTS}",
        )
    if opts.min_guests < opts.min_hosts:
        raise RefineError(
            f"--min-guests {opts.min_guests} is below --min-hosts "
            f"{opts.min_hosts}: every host counted needs a guest",
            "raise --min-guests to at least --min-hosts",
        )
    if opts.drop_unread and opts.window_s <= 0:
        raise RefineError("--window must be positive", "e.g. --window 7d")


@dataclass
class _Parent:
    """The list being refined and where it came from."""

    sl: sectorlist.SectorList
    path: str  # a file, or redis:KEY
    revision: int | None  # Redis' revision of it, when it came from there


def _parent_list(
    opts: RefineOptions,
    parent_file: sectorlist.SectorList | None,
    key: str,
    vsize: int,
    content: str,
    workdir: Path,
) -> _Parent:
    """The list given with --list, or the one published in Redis for this
    image; refused if it is another image's."""
    store = opts.store
    revision: int | None = None
    if parent_file is not None and opts.list_path is not None:
        parent, parent_path = parent_file, str(opts.list_path)
    else:
        try:
            path, parent = distribute.fetch(store, key, workdir / "parent.pcsl")
        except distribute.DistributeError as e:
            if "no list in Redis" not in e.message:
                raise
            raise RefineError(
                f"no list is published in Redis for {opts.image} ({key[:28]}...)",
                "pass the current list with --list FILE, or publish "
                "one first (pageshare list publish)",
            ) from None
        rev = store._call("fetch", store.r.hget, store.key("meta", key), "revision")
        revision = int(rev) if rev is not None and bytes(rev).isdigit() else None
        parent_path = f"redis:{store.key('list', key)}"
        del path
    if (parent.image.virtual_size, parent.image.content_sha256) != (vsize, content):
        raise RefineError(
            f"the list {parent_path} is for image {distribute.image_key(parent.image)}, "
            f"not {opts.image} ({key})",
            "give the list of this image (pageshare list show FILE names its image)",
        )
    return _Parent(parent, parent_path, revision)


def _read_fleet(opts: RefineOptions, key: str, progress: Progress) -> feedback.Fleet:
    """The hosts' summaries for this image; refused if there is none."""
    with progress.phase("feedback", "reading the fleet's summaries from Redis"):
        fleet = feedback.read_fleet(opts.store, key)
    for f in fleet.failures:
        progress.say(f"note: summary of host {f['host']} not used: {f['error']}")
    if not fleet.summaries:
        why = f"; {len(fleet.failures)} could not be read" if fleet.failures else ""
        raise RefineError(
            f"no host has published feedback for {opts.image} ({key[:28]}...){why}",
            "page servers publish it every feedback.interval_secs to "
            f"{feedback.summary_key(opts.store, key, '<host>')}: check that they serve this "
            "image, reach this Redis (--redis, --prefix) and have feedback enabled",
        )
    return fleet


def _candidates(
    t: _Tally, opts: RefineOptions, max_block: int, rejected: Counter[str]
) -> dict[int, list[int]]:
    """Unlisted blocks read by enough guests on enough hosts, by first
    sector; the others counted in REJECTED by why."""
    candidates: dict[int, list[int]] = {}
    for block, acc in t.unlisted.items():
        if block >= max_block:
            rejected[OUTSIDE_IMAGE] += 1
        elif acc[1] < opts.min_hosts:
            rejected[BELOW_HOSTS] += 1
        elif acc[0] < opts.min_guests:
            rejected[BELOW_GUESTS] += 1
        else:
            candidates[block * SECTORS_PER_PAGE] = acc
    return candidates


def _blocks_to_add(
    candidates: dict[int, list[int]],
    verdicts: dict[int, str],
    read_at: Callable[[int, int], bytes],
    rejected: Counter[str],
) -> dict[int, str]:
    """The candidates that are one page of one file and not zero, with the
    hash of the image's bytes; the others counted in REJECTED."""
    added: dict[int, str] = {}
    for sector in sorted(candidates):
        why = verdicts.get(sector, "unmapped")
        if why:
            rejected[why] += 1
            continue
        data = read_at(sector * 512, PAGE)
        if not any(data):
            rejected[ZERO] += 1
            continue
        added[sector] = sectorlist.block_hash(data)
    return added


def _unread_to_drop(
    opts: RefineOptions,
    parent: sectorlist.SectorList,
    fleet: feedback.Fleet,
    t: _Tally,
    window_start: float | None,
    now: float,
    progress: Progress,
) -> tuple[dict[int, str], str | None]:
    """With --drop-unread, the listed blocks no guest read in the window,
    unless some host's summary does not cover it (then why, and none)."""
    if not (opts.drop_unread and window_start is not None):
        return {}, None
    refused = drop_refusal(fleet.summaries, fleet.failures, window_start, now)
    if refused:
        progress.say(f"note: no unread block dropped: {refused}")
        return {}, refused
    return {s: UNREAD for s in parent.blocks if s // SECTORS_PER_PAGE not in t.listed_read}, None


def _new_list(
    opts: RefineOptions,
    parent: sectorlist.SectorList,
    added: dict[int, str],
    dropped: dict[int, str],
    generation: int,
    hosts: int,
    identity: tuple[int, str],
) -> sectorlist.SectorList:
    """The parent without DROPPED and with ADDED, as generation GENERATION."""
    vsize, content = identity
    blocks = {s: h for s, h in parent.blocks.items() if s not in dropped}
    blocks.update(added)
    extra = dict(parent.extra)
    extra.update(
        {
            "x-generation": str(generation),
            "x-parent-list-digest": parent.digest(),
            "x-refined": f"{hosts} host(s), guests >= {opts.min_guests}, "
            f"hosts >= {opts.min_hosts}, +{len(added)} -{len(dropped)}",
        }
    )
    return sectorlist.SectorList(
        image=sectorlist.ImageIdentity(vsize, content, parent.image.name or opts.image.name),
        blocks=blocks,
        generator=f"pageshare list refine {__version__}",
        criteria=(parent.criteria + "," if parent.criteria else "")
        + f"fleet-read(guests>={opts.min_guests},hosts>={opts.min_hosts}),regular-file,"
        "nonzero,verified",
        runs=parent.runs,
        extra=extra,
    )


def _write_checked(
    sl: sectorlist.SectorList, out: Path, read_at: Callable[[int, int], bytes]
) -> sectorlist.SectorList:
    """SL written to OUT and read back; removed again unless every block of
    what was read back holds the image's bytes."""
    out.parent.mkdir(parents=True, exist_ok=True)
    sectorlist.write(sl, out)
    written = sectorlist.read(out)
    bad = sectorlist.verify_against_image(written, lambda s: read_at(s * 512, PAGE))
    if bad or written.image != sl.image:
        out.unlink(missing_ok=True)
        raise RuntimeError(
            f"the written list does not match the image at sectors {bad[:5]}: not kept"
        )
    return written


def refine(opts: RefineOptions, progress: Progress) -> RefineResult:
    """The next generation of an image's list from what the fleet's guests
    read: blocks read on enough guests and hosts added (each one page of one
    file, not zero, hashed from the image), blocks no longer the image's
    bytes (and, with --drop-unread, unread ones) dropped; written, checked
    against the image, recorded in the results database."""
    _check_options(opts)
    now = time.time() if opts.now is None else opts.now
    store = opts.store
    store._call("ping", store.r.ping)  # Redis down: say so before reading the image
    parent_file: sectorlist.SectorList | None = None
    if opts.list_path is not None:
        parent_file = sectorlist.read(opts.list_path)

    fmt, vsize = probe_format(opts.image)
    with progress.phase("inspect", f"inspecting {opts.image} (libguestfs, cached per image)"):
        insp = inspect_image(opts.image, fmt, vsize)
    info = insp.info
    opts.workdir_parent.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="pageshare-refine-", dir=opts.workdir_parent))
    db = resultsdb.connect(opts.db)
    refinement_id = 0
    try:
        from ..analysis.analyze import read_base_image

        with progress.phase("base-image", "reading the base image (raw, content sha256)"):
            if fmt == "raw":
                raw = opts.image
            else:
                raw = workdir / "base.raw"
                diskimage.to_raw(opts.image, raw)
            base = read_base_image(opts.image, raw, vsize, insp, workdir, progress)
        content, read_at = base.content, base.read_at
        key = f"{vsize}-{content}"
        pl = _parent_list(opts, parent_file, key, vsize, content, workdir)
        parent, parent_path, revision = pl.sl, pl.path, pl.revision
        parent_gen = generation_of(parent)
        generation = parent_gen + 1
        fleet = _read_fleet(opts, key, progress)

        image_id = resultsdb.record_image(db, opts.image, fmt, vsize, content, info)
        window_start = now - opts.window_s if opts.drop_unread else None
        refinement_id = resultsdb.start_refinement(
            db,
            image_id,
            started_at=_now(),
            tool_version=__version__,
            parent_path=parent_path,
            parent_digest=parent.digest(),
            parent_generation=parent_gen,
            parent_revision=revision,
            parent_blocks=len(parent.blocks),
            min_guests=opts.min_guests,
            min_hosts=opts.min_hosts,
            drop_unread=opts.drop_unread,
            window_s=opts.window_s if opts.drop_unread else None,
            window_start=window_start,
        )
        db.commit()

        listed = {s // SECTORS_PER_PAGE for s in parent.blocks}
        t = tally(fleet.summaries, listed)
        progress.say(
            f"{len(fleet.summaries)} host(s): {len(t.unlisted)} unlisted block(s) "
            f"read, {len(t.listed_read)} of {len(listed)} listed block(s) read"
        )
        rejected: Counter[str] = Counter()
        candidates = _candidates(t, opts, vsize // PAGE, rejected)
        block_sizes = {
            (f.uuid.replace("-", "").lower(), f.guest_start_sector): f.block_size
            for f in info.filesystems
        }
        with progress.phase("map", f"mapping {len(candidates)} candidate block(s) to files"):
            verdicts = classify(
                sorted(candidates), base.geo.filesystems, base.sources, block_sizes, progress.say
            )
        with progress.phase("hash", "hashing the blocks to add from the image's bytes"):
            added = _blocks_to_add(candidates, verdicts, read_at, rejected)

        dropped, refused = _unread_to_drop(opts, parent, fleet, t, window_start, now, progress)
        with progress.phase("verify", "checking the kept blocks against the image"):
            for sector, digest in parent.blocks.items():
                if (
                    sector not in dropped
                    and sectorlist.block_hash(read_at(sector * 512, PAGE)) != digest
                ):
                    dropped[sector] = BYTES_DIFFER

        sl = _new_list(
            opts, parent, added, dropped, generation, len(fleet.summaries), (vsize, content)
        )
        out = opts.output or opts.lists_dir / refined_file_name(sl.image, generation)
        with progress.phase("write-list", f"writing {out} and checking it against the image"):
            written = _write_checked(sl, out, read_at)

        hosts = [s.to_json() for s in fleet.summaries]
        rows = [
            resultsdb.RefinedBlock(
                s, "added", "read-by-fleet", candidates[s][0], candidates[s][1], candidates[s][2], h
            )
            for s, h in sorted(added.items())
        ]
        # A dropped block's reads too (0 if unread), so that the new list's share
        # of these reads is known: guest_reads_listed - dropped + added guests.
        for s, why in sorted(dropped.items()):
            g, n, r = t.listed_read.get(s // SECTORS_PER_PAGE, [0, 0, 0])
            rows.append(resultsdb.RefinedBlock(s, "dropped", why, g, n, r, None))
        resultsdb.finish_refinement(
            db,
            refinement_id,
            finished_at=_now(),
            hosts=hosts,
            failures=fleet.failures,
            reported_unlisted=len(t.unlisted),
            reported_listed=len(t.listed_read),
            guest_reads_listed=t.guest_reads_listed,
            guest_reads_unlisted=t.guest_reads_unlisted,
            rejected=rejected,
            dropped=Counter(dropped.values()),
            drop_refused=refused,
            generation=generation,
            list_path=out,
            list_digest=written.digest(),
            listed_blocks=len(written.blocks),
            blocks=rows,
        )
        db.commit()
        result = RefineResult(
            image=str(opts.image),
            image_key=key,
            parent={
                "path": parent_path,
                "digest": parent.digest(),
                "generation": parent_gen,
                "revision": revision,
                "blocks": len(parent.blocks),
            },
            list_path=str(out),
            list_digest=written.digest(),
            generation=generation,
            blocks=len(written.blocks),
            min_guests=opts.min_guests,
            min_hosts=opts.min_hosts,
            hosts=hosts,
            failures=fleet.failures,
            reported_unlisted=len(t.unlisted),
            reported_listed=len(t.listed_read),
            added=len(added),
            rejected=dict(rejected),
            dropped=len(dropped),
            dropped_reasons=dict(Counter(dropped.values())),
            drop_unread={
                "asked": opts.drop_unread,
                "window_s": opts.window_s if opts.drop_unread else None,
                "window_start": window_start,
                "refused": refused,
            },
            refinement_id=refinement_id,
            phases=dict(progress.phases),
        )
        if opts.publish:
            result.published = distribute.publish(store, out)
        return result
    except BaseException as e:
        if refinement_id:
            resultsdb.fail_refinement(db, refinement_id, _now(), f"{type(e).__name__}: {e}")
            db.commit()
        raise
    finally:
        db.close()
        shutil.rmtree(workdir, ignore_errors=True)


def format_result(r: RefineResult) -> str:
    """The human summary: what was read, added, not added and dropped, and why."""
    lines = [
        f"wrote {r.list_path}: generation {r.generation}, {r.blocks} blocks "
        f"({r.blocks * PAGE / 2**20:.1f} MiB), {r.list_digest}",
        f"  from {r.parent['path']} (generation {r.parent['generation']}, "
        f"{r.parent['blocks']} blocks)",
    ]
    hosts = ", ".join(h["host"] for h in r.hosts)
    lines.append(
        f"fleet: {len(r.hosts)} host(s) ({hosts}): {r.reported_unlisted} unlisted "
        f"block(s) read, {r.reported_listed} listed block(s) read"
    )
    for f in r.failures:
        lines.append(f"  not used: {f['host']}: {f['error']}")
    lines.append(
        f"added {r.added} block(s) ({r.added * PAGE / 2**20:.1f} MiB): read by >= "
        f"{r.min_guests} guests on >= {r.min_hosts} hosts, one page of a regular file, "
        "not zero, hashed from the image"
    )
    if r.rejected:
        lines.append(
            "not added: "
            + ", ".join(f"{n} {why}" for why, n in sorted(r.rejected.items(), key=lambda x: -x[1]))
        )
    if r.dropped:
        lines.append(
            f"dropped {r.dropped} block(s): "
            + ", ".join(f"{n} {why}" for why, n in sorted(r.dropped_reasons.items()))
        )
    if r.drop_unread["asked"] and r.drop_unread["refused"]:
        lines.append(f"no unread block dropped: {r.drop_unread['refused']}")
    elif r.drop_unread["asked"] and not r.dropped_reasons.get(UNREAD):
        lines.append("no unread block dropped: every listed block was read in the window")
    lines.append(f"recorded as refinement {r.refinement_id} in the results database")
    if r.published:
        lines.append(
            f"published: revision {r.published['revision']}, "
            f"{r.published['subscribers']} page server(s) listening"
        )
    else:
        lines.append(f"publish it with: pageshare list publish {r.list_path}")
    return "\n".join(lines)
