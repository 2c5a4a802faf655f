"""The aggregation maths of analyze-image, on small hand-made runs.

Which blocks the list keeps (the majority rule and --min-runs), the breakdown
of merged memory and the list's coverage, the top files: each input is a few
sectors and frames, so that the right answer can be worked out by hand.
"""

from collections import Counter
from pathlib import Path

import pytest
from pageshare.analysis.aggregate import (
    Kept,
    PageFact,
    RunResult,
    breakdown,
    keep_blocks,
    ksm_series,
    majority,
    top_files,
    unservable_pages,
)
from pageshare.analysis.analyze import Options
from pageshare.analysis.ksm import Sample
from pageshare.analysis.mapping import Placement

ROOT = Placement.partition("11" * 16, 2048)
BOOT = Placement.partition("22" * 16, 1050624, "/boot")


def fact(
    sector: int, ino: int = 12, index: int = 0, kind: str = "file", fs: Placement | None = ROOT
) -> PageFact:
    return PageFact(sector, ino, index, kind, fs)


Sectors = list[int] | dict[int, PageFact]


def run(a: Sectors, b: Sectors | None = None) -> RunResult:
    """A run whose guests verified these sectors (only what keep_blocks reads)."""

    def facts(x: Sectors | None) -> dict[int, PageFact]:
        return x if isinstance(x, dict) else {s: fact(s) for s in x or []}

    return RunResult(
        {"A": facts(a), "B": facts(b)},
        {"A": Counter(), "B": Counter()},
        {"A": 0, "B": 0},
        {"A": {}, "B": {}},
    )


def tally(
    cats_a: dict[str, int],
    listed_a: dict[int, int],
    nonzero_a: int,
    cats_b: dict[str, int] | None = None,
    listed_b: dict[int, int] | None = None,
    nonzero_b: int = 0,
) -> RunResult:
    """A run as breakdown() reads it: per guest, frames by category, the
    gpfn -> sector of its listed frames, and its merged non-zero frames."""
    return RunResult(
        {"A": {}, "B": {}},
        {"A": Counter(cats_a), "B": Counter(cats_b or {})},
        {"A": nonzero_a, "B": nonzero_b},
        {"A": listed_a, "B": listed_b or {}},
    )


@pytest.mark.parametrize("runs,default", [(1, 1), (2, 2), (3, 2), (4, 3), (5, 3), (10, 6)])
def test_default_min_runs_is_a_majority(runs: int, default: int) -> None:
    assert majority(runs) == default
    assert Options(image=Path("x"), runs=runs).effective_min_runs() == default
    # --min-runs 0 is no --min-runs: the default.
    assert Options(image=Path("x"), runs=runs, min_runs=0).effective_min_runs() == default


def test_explicit_min_runs_wins() -> None:
    assert Options(image=Path("x"), runs=4, min_runs=1).effective_min_runs() == 1
    assert Options(image=Path("x"), runs=4, min_runs=4).effective_min_runs() == 4


def test_majority_of_three_runs() -> None:
    # 8: runs 1 and 2 (kept); 16: run 1 only (dropped); 24: every run;
    # 32: run 3 only, in guest B (dropped).
    results = [run([8, 16, 24]), run([8], [24]), run([24], [32])]
    kept = keep_blocks(results, majority(3))
    assert kept.sectors == [8, 24]
    assert kept.runs_seen == {8: 2, 16: 1, 24: 3, 32: 1}
    assert kept.both_vms == {8: False, 16: False, 24: False, 32: False}


def test_min_runs_one_keeps_every_block_seen_and_all_runs_only_the_constant_ones() -> None:
    results = [run([8, 16]), run([8, 24]), run([8], [40])]
    assert keep_blocks(results, 1).sectors == [8, 16, 24, 40]
    assert keep_blocks(results, 3).sectors == [8]
    # More runs than there were keeps nothing (preflight refuses such a --min-runs).
    assert keep_blocks(results, 4).sectors == []
    assert keep_blocks([], 1) == Kept([], {}, {}, {})


def test_both_guests_of_one_run_count_once() -> None:
    # Sector 8 in both guests of run 1 is one run, not two: below --min-runs 2.
    results = [run([8], [8]), run([16])]
    kept = keep_blocks(results, 2)
    assert kept.sectors == []
    assert kept.runs_seen == {8: 1, 16: 1}
    # ... and is recorded as seen in both guests, once any run had it in both.
    assert kept.both_vms[8] is True and kept.both_vms[16] is False
    later = keep_blocks([run([8]), run([8], [8]), run([], [8])], 1)
    assert later.both_vms[8] is True


def test_fact_is_the_last_runs_and_guest_as_first() -> None:
    a1, b1 = fact(8, ino=1), fact(8, ino=2)
    a2, b3 = fact(8, ino=3), fact(8, ino=4)
    assert keep_blocks([run({8: a1}, {8: b1})], 1).fact[8] is a1
    assert keep_blocks([run({8: a1}, {8: b1}), run({8: a2})], 1).fact[8] is a2
    assert keep_blocks([run({8: a1}), run({8: a2}), run({}, {8: b3})], 1).fact[8] is b3


def test_breakdown_counts_frames_the_majority_dropped_as_page_cache() -> None:
    # Guest A listed three frames (sectors 8, 16, 24); the list kept 8 and 24,
    # so one frame moves from listed to other page cache.  Guest B listed none.
    r = tally(
        {"listed": 3, "page-cache": 2, "anon": 1, "zero": 4},
        {1: 8, 2: 16, 3: 24},
        6,
        {"kernel": 2},
        {},
        2,
    )
    pages, coverage = breakdown([r], {8, 24})
    assert pages == {"listed": 2, "page-cache": 3, "anon": 1, "zero": 4, "kernel": 2}
    # The summary's --json keeps this order, and the zero counts (none here).
    assert list(pages) == ["listed", "page-cache", "anon", "zero", "kernel"]
    assert coverage == 2 / 8


def test_breakdown_adds_up_runs_and_keeps_zero_categories() -> None:
    # Two frames of one guest on one block both count; nothing is kept in run 2.
    r1 = tally({"listed": 2}, {1: 8, 2: 8}, 2)
    r2 = tally({"listed": 1, "anon": 3}, {5: 16}, 4)
    pages, coverage = breakdown([r1, r2], {8})
    assert pages == {"listed": 2, "page-cache": 1, "anon": 3}
    assert coverage == 2 / 6
    # Nothing listed at all: "listed" is still there, with 0.
    pages, coverage = breakdown([r2], set())
    assert pages == {"listed": 0, "anon": 3, "page-cache": 1}
    assert coverage == 0.0


def test_coverage_of_nothing_merged_is_zero() -> None:
    # Only zero pages merged: no non-zero frame to cover, and no division by it.
    pages, coverage = breakdown([tally({"zero": 5}, {}, 0, {"zero": 3}, {}, 0)], {8})
    assert coverage == 0.0
    assert pages == {"zero": 8, "listed": 0, "page-cache": 0}
    assert breakdown([], {8}) == ({}, 0.0)


def test_top_files_by_listed_blocks() -> None:
    facts = {
        8: fact(8, ino=12),
        16: fact(16, ino=12),
        24: fact(24, ino=12, fs=BOOT),
        32: fact(32, ino=13),
        40: fact(40, ino=0, kind="bdev", fs=None),
        48: fact(48, ino=14),
        56: fact(56, ino=15, fs=None),
    }
    paths: dict[tuple[Placement, int], str | None] = {
        (ROOT, 12): "/usr/lib/libc.so.6",
        (BOOT, 12): "/boot/vmlinuz",
        (ROOT, 13): "/usr/bin/python3",
        (ROOT, 14): None,
    }
    keep = sorted(facts)
    mib = 4096 / 2**20
    # Inode 12 of / and of /boot are two files; a path not found (14) and a
    # page without a file system (56) are "?"; ties keep the first block's order.
    assert top_files(keep, facts, paths) == [
        ("/usr/lib/libc.so.6", 2 * mib),
        ("?", 2 * mib),
        ("/boot/vmlinuz", mib),
        ("/usr/bin/python3", mib),
        ("(metadata)", mib),
    ]
    assert top_files(keep, facts, paths, n=2) == [("/usr/lib/libc.so.6", 2 * mib), ("?", 2 * mib)]
    assert top_files([], facts, paths) == []


def test_unservable_pages_add_up_over_runs() -> None:
    r1, r2, r3 = run([]), run([]), run([])
    r1.unservable.update({"inline": 2})
    r2.unservable.update({"inline": 1, "compressed": 5})
    assert unservable_pages([r1, r2, r3]) == {"inline": 3, "compressed": 5}
    assert unservable_pages([r3]) == {}


def test_ksm_series_numbers_the_runs_and_rounds_t() -> None:
    r1, r2, r3 = run([]), run([]), run([])
    r1.ksm_samples = [Sample(0.0, {"full_scans": 0}), Sample(1.00049, {"full_scans": 1})]
    r3.ksm_samples = [Sample(2.5, {"pages_sharing": 7, "not_a_column": 1})]
    series = ksm_series([r1, r2, r3])
    assert [(e["run"], e["t"]) for e in series] == [(1, 0.0), (1, 1.0), (3, 2.5)]
    # Every column of ksm_sample, None where the kernel had no such counter.
    assert series[2] == {
        "run": 3,
        "t": 2.5,
        "full_scans": None,
        "pages_shared": None,
        "pages_sharing": 7,
        "pages_unshared": None,
        "pages_volatile": None,
        "ksm_zero_pages": None,
        "pages_scanned": None,
        "general_profit": None,
    }
    assert ksm_series([]) == []
