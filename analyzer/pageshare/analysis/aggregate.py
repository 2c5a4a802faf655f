"""From the runs of one analysis to its list and summary: the maths alone.

analyze.py boots the guests and verifies their pages; each run ends as a
RunResult.  Here those results become the blocks the list keeps (seen in at
least min_runs runs), the breakdown of KSM-merged memory with the share the
list covers, and the files with the most listed data.  Nothing here reads an
image or a database, so that tests/analyzer/test_aggregate.py can check every rule on
small hand-made runs, without a guest.
"""

from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .ksm import Sample
from .mapping import Placement
from .resultsdb import KSM_SAMPLE_KEYS

PAGE = 4096
VMS = ("A", "B")


def majority(runs: int) -> int:
    """The default --min-runs: more than half of the runs, so that a block one
    boot happened to cache is not listed, and with one or two runs all of them."""
    return runs // 2 + 1


@dataclass
class PageFact:
    """A verified page seen in one VM of one run."""

    sector: int
    ino: int
    index: int
    kind: str
    fs: Placement | None = None  # the file system of a file page
    tree: int = 0  # btrfs: the subvolume whose extents verified


@dataclass
class RunResult:
    stable: dict[str, dict[int, PageFact]]  # vm -> sector -> fact
    categories: dict[str, Counter[str]]  # vm -> category -> frames
    merged_nonzero: dict[str, int]
    gpfn_sector: dict[str, dict[int, int]]  # vm -> gpfn -> sector of its listed frames
    introspector: tuple[str, str] = ("", "")  # backend used, and why
    # Merged page-cache frames (both VMs) of btrfs data no disk block holds as
    # the page reads, by verdict (inline, compressed).
    unservable: Counter[str] = field(default_factory=Counter)
    ksm_samples: list[Sample] = field(default_factory=list)  # KSM's counters while it merged


@dataclass(frozen=True)
class Kept:
    """The blocks of the list, and what the results DB records of each."""

    sectors: list[int]  # the blocks kept, ascending
    # Of every sector any run verified (kept or not):
    runs_seen: dict[int, int]  # in how many runs (one guest or both: once a run)
    both_vms: dict[int, bool]  # whether both guests of some run had it
    fact: dict[int, PageFact]  # what it held: the last run's, guest A's first


def keep_blocks(results: Sequence[RunResult], min_runs: int) -> Kept:
    """The majority rule: a block is kept when at least min_runs runs verified
    it as cross-merged in either guest; a block one run happened to cache (a
    timer, a log rotation) stays out of the list."""
    seen: Counter[int] = Counter()
    both: dict[int, bool] = {}
    fact: dict[int, PageFact] = {}
    for r in results:
        sectors = set(r.stable["A"]) | set(r.stable["B"])
        for s in sectors:
            seen[s] += 1
            both[s] = both.get(s, False) or (s in r.stable["A"] and s in r.stable["B"])
            fact[s] = r.stable["A"].get(s) or r.stable["B"][s]
    keep = sorted(s for s, n in seen.items() if n >= min_runs)
    return Kept(keep, dict(seen), both, fact)


def breakdown(results: Sequence[RunResult], keep: Collection[int]) -> tuple[dict[str, int], float]:
    """(frames by category, coverage) over all runs and both guests.

    A run counts a frame "listed" when its block verified in that run; here
    "listed" means in the final list, so a frame whose block the majority rule
    dropped counts as other page cache.  Coverage is the listed frames' share
    of the merged non-zero frames, 0.0 when there are none."""
    total_cats: Counter[str] = Counter()
    covered = total = 0
    for r in results:
        for vm in VMS:
            cats = r.categories[vm].copy()
            in_list = sum(1 for s in r.gpfn_sector[vm].values() if s in keep)
            dropped = cats["listed"] - in_list
            cats["listed"] = in_list
            cats["page-cache"] += dropped
            total_cats.update(cats)
            covered += in_list
            total += r.merged_nonzero[vm]
    return dict(total_cats), covered / total if total else 0.0


def top_files(
    keep: Sequence[int],
    fact: Mapping[int, PageFact],
    paths: Mapping[tuple[Placement, int], str | None],
    n: int = 15,
) -> list[tuple[str, float]]:
    """(guest path, listed MiB) of the n files with the most listed blocks, most
    first (ties in the order of their first block).  Block device pages count
    as "(metadata)", a file whose path was not found as "?"."""
    per_file: Counter[str] = Counter()
    for s in keep:
        f = fact[s]
        per_file[
            (paths.get((f.fs, f.ino)) if f.fs else None)
            or ("(metadata)" if f.kind == "bdev" else "?")
        ] += 1
    return [(p, k * PAGE / 2**20) for p, k in per_file.most_common(n)]


def unservable_pages(results: Sequence[RunResult]) -> dict[str, int]:
    """Merged btrfs page-cache frames no disk block holds, by verdict, over all runs."""
    unservable: Counter[str] = Counter()
    for r in results:
        unservable.update(r.unservable)
    return dict(unservable)


def ksm_series(results: Sequence[RunResult]) -> list[dict[str, Any]]:
    """The summary's KSM time series: every sample of every run (results in run
    order, run 1 first), t rounded to the millisecond as the results DB keys it."""
    return [
        {"run": seq, "t": round(s.t, 3), **{k: s.values.get(k) for k in KSM_SAMPLE_KEYS}}
        for seq, r in enumerate(results, 1)
        for s in r.ksm_samples
    ]
