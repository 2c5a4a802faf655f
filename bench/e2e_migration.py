"""The end-to-end benchmark's migration phase (bench/e2e_vs_ksm.py
--migrate; issue 21 in merge mode): parsing and summary.

After the pageshare configuration's workload, bench/e2e/driver.sh
(migrate_phase) migrates guest 1, from the same state each time, with each
method (precopy, xbzrle, multifd-zstd, block-refs) to a fresh QEMU in the
pageshare host, and prints:

  E2E-MQ method JSON        the source's last query-migrate reply
  E2E-M  method k=v ...     status, clock stamps (ms, /proc/uptime), both
                            QEMUs' CPU (ms, from migrate to completion), the
                            filters' migration-refs-* counters; a second
                            line after the census (its end, KSM's target)
  E2E-MS method side ...    e2e_sampler's samples (its E2E-G fields from
                            t_ms on) of the source before the migration
                            (side src) and of the destination from right
                            after switchover (side dst)

This module turns them into migration.csv (one row per method),
migration_samples.csv and the table appended to summary.md.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

METHODS = ["precopy", "xbzrle", "multifd-zstd", "block-refs"]
MIB = 2**20

# migration.csv, in this order
ROW_FIELDS = [
    "method",
    "status",
    "why",
    "transferred_bytes",
    "total_ms",
    "downtime_ms",
    "setup_ms",
    "normal_pages",
    "zero_pages",
    "block_ref_pages",
    "multifd_bytes",
    "xbzrle_pages",
    "src_cpu_ms",
    "dst_cpu_ms",
    "bandwidth",
    "refs_sent",
    "refs_refused",
    "refs_merged",
    "refs_copied",
    "refs_read",
    "refs_failed",
    "src_listed",
    "src_listed_shared",
    "src_on_server",
    "census_after_ms",
    "dst_listed",
    "dst_listed_shared",
    "dst_on_server",
    "refs_of_src_listed",
    "refs_merged_frac",
    "dst_shared_frac",
    "dst_on_server_frac",
    "ksm_target_frac",
    "t_ksm_shared_s",
    "t_ksm_server_s",
    "t_shared_90_s",
    "followed_s",
    "dst_shared_frac_last",
    "dst_on_server_frac_last",
]


def parse(lines: list[str]) -> dict[str, Any]:
    """The E2E-M, E2E-MQ and E2E-MS lines of a serial log."""
    m: dict[str, dict[str, str]] = {}
    mq: dict[str, dict[str, Any]] = {}
    ms: list[list[str]] = []
    for raw in lines:
        line = raw.strip()
        if line.startswith("E2E-MQ "):
            _, method, text = [*line.split(" ", 2), ""][:3]
            try:
                reply = json.loads(text)
            except ValueError:
                reply = {"error": {"desc": f"unparsed: {text[:200]}"}}
            mq[method] = reply.get("return", reply)
        elif line.startswith("E2E-M "):
            parts = line.split()
            d = m.setdefault(parts[1], {})
            for kv in parts[2:]:
                k, eq, v = kv.partition("=")
                if eq:
                    d[k] = v
        elif line.startswith("E2E-MS "):
            ms.append(line.split()[1:])
    return {"m": m, "mq": mq, "ms": ms}


def _int(d: dict[str, str], k: str) -> int | None:
    v = d.get(k)
    try:
        return None if v is None or int(v) < 0 else int(v)
    except ValueError:
        return None


def _frac(a: int | None, b: int | None) -> float | None:
    """a / b; None if either is unknown (None, or -1 from the sampler)."""
    return None if a is None or b is None or a < 0 or b <= 0 else a / b


def samples(rows: list[list[str]], guest_fields: list[str]) -> list[dict[str, Any]]:
    """E2E-MS rows as dicts: method, side and the sampler's fields (a
    sampler with fewer columns: -1, one with more: cut)."""
    keys = guest_fields[1:]
    out = []
    for r in rows:
        vals = (r[2:] + ["-1"] * len(keys))[: len(keys)]
        d: dict[str, Any] = {"method": r[0], "side": r[1]}
        d.update({k: int(v) for k, v in zip(keys, vals, strict=True)})
        out.append(d)
    return out


def _reach(
    dst: list[dict[str, Any]], key: str, target: float | None, t_done: int | None
) -> float | None:
    """Seconds from switchover until the destination's samples first show
    ``key``/listed at ``target`` or more (None: never while followed)."""
    if target is None or t_done is None:
        return None
    for s in dst:
        if s["listed"] > 0 and s[key] / s["listed"] >= target:
            return max(0.0, float(s["t_ms"] - t_done) / 1000)
    return None


def summarize(parsed: dict[str, Any], guest_fields: list[str]) -> dict[str, dict[str, Any]]:
    """Per method, in the order they ran: migration.csv's row."""
    smp = samples(parsed["ms"], guest_fields)
    order = list(parsed["m"])
    out: dict[str, dict[str, Any]] = {}
    for method in order:
        d = parsed["m"][method]
        q = parsed["mq"].get(method, {})
        ram = q.get("ram", {})
        src = [s for s in smp if s["method"] == method and s["side"] == "src"]
        dst = [s for s in smp if s["method"] == method and s["side"] == "dst"]
        t_done = _int(d, "t_done_ms")
        brp = ram.get("block-ref-pages")
        r: dict[str, Any] = {
            "method": method,
            "status": d.get("status", "?"),
            "why": d.get("why", "").replace("_", " ") or None,
            "transferred_bytes": ram.get("transferred"),
            "total_ms": q.get("total-time"),
            "downtime_ms": q.get("downtime"),
            "setup_ms": q.get("setup-time"),
            "normal_pages": ram.get("normal"),
            "zero_pages": ram.get("duplicate"),
            "block_ref_pages": brp,
            "multifd_bytes": ram.get("multifd-bytes"),
            "xbzrle_pages": q.get("xbzrle-cache", {}).get("pages"),
        }
        for k in (
            "src_cpu_ms",
            "dst_cpu_ms",
            "bandwidth",
            "refs_sent",
            "refs_refused",
            "refs_merged",
            "refs_copied",
            "refs_read",
            "refs_failed",
        ):
            r[k] = _int(d, k)
        s0 = src[0] if src else None
        d0 = dst[0] if dst else None
        dl = dst[-1] if dst else None
        r["src_listed"] = s0["listed"] if s0 else None
        r["src_listed_shared"] = s0["listed_shared"] if s0 else None
        r["src_on_server"] = s0["on_server"] if s0 else None
        r["census_after_ms"] = d0["t_ms"] - t_done if d0 and t_done is not None else None
        r["dst_listed"] = d0["listed"] if d0 else None
        r["dst_listed_shared"] = d0["listed_shared"] if d0 else None
        r["dst_on_server"] = d0["on_server"] if d0 else None
        r["refs_of_src_listed"] = _frac(brp, r["src_listed"])
        r["refs_merged_frac"] = _frac(r["refs_merged"], brp)
        r["dst_shared_frac"] = _frac(r["dst_listed_shared"], r["dst_listed"])
        r["dst_on_server_frac"] = _frac(r["dst_on_server"], r["dst_listed"])
        r["followed_s"] = (dl["t_ms"] - t_done) / 1000 if dl and t_done is not None else None
        r["dst_shared_frac_last"] = _frac(dl["listed_shared"], dl["listed"]) if dl else None
        r["dst_on_server_frac_last"] = _frac(dl["on_server"], dl["listed"]) if dl else None
        out[method] = r
        r["_dst"] = dst
        r["_t_done"] = t_done
    # KSM against block-refs: how long until a destination that got every
    # page in full holds as large a share of its listed pages shared (and
    # as the server's page) as block-refs' destination right after switchover
    refs = out.get("block-refs", {})
    for method, r in out.items():
        dst, t_done = r.pop("_dst"), r.pop("_t_done")
        r["t_shared_90_s"] = _reach(dst, "listed_shared", 0.9, t_done)
        if method == "block-refs" or r["status"] != "completed":
            r["ksm_target_frac"] = r["t_ksm_shared_s"] = r["t_ksm_server_s"] = None
            continue
        r["ksm_target_frac"] = refs.get("dst_shared_frac")
        r["t_ksm_shared_s"] = _reach(dst, "listed_shared", refs.get("dst_shared_frac"), t_done)
        r["t_ksm_server_s"] = _reach(dst, "on_server", refs.get("dst_on_server_frac"), t_done)
    return {m: {k: r.get(k) for k in ROW_FIELDS} for m, r in out.items()}


def _fmt(v: Any, spec: str) -> str:
    if v is None:
        return "-"
    return format(v, spec)


def markdown(rows: dict[str, dict[str, Any]]) -> str:
    """The migration table for summary.md (and docs/benchmarks.md)."""
    if not rows:
        return ""
    methods = list(rows)
    pre = rows.get("precopy", {})

    def rel(r: dict[str, Any], k: str) -> float | None:
        a, b = r.get(k), pre.get(k)
        return None if a is None or not b else 1 - a / b

    table: list[tuple[str, Any]] = [
        ("status", lambda r: r["status"] + (f" ({r['why']})" if r["why"] else "")),
        (
            "MiB on the wire",
            lambda r: _fmt(r["transferred_bytes"] and r["transferred_bytes"] / MIB, ".1f"),
        ),
        ("total time, s", lambda r: _fmt(r["total_ms"] and r["total_ms"] / 1000, ".1f")),
        ("downtime, ms", lambda r: _fmt(r["downtime_ms"], "d")),
        ("setup, ms", lambda r: _fmt(r["setup_ms"], "d")),
        (
            "less than precopy: bytes, time",
            lambda r: (
                f"{_fmt(rel(r, 'transferred_bytes'), '.0%')}, {_fmt(rel(r, 'total_ms'), '.0%')}"
            ),
        ),
        (
            "CPU source / destination QEMU, s",
            lambda r: (
                f"{_fmt(r['src_cpu_ms'] and r['src_cpu_ms'] / 1000, '.1f')} / "
                f"{_fmt(r['dst_cpu_ms'] and r['dst_cpu_ms'] / 1000, '.1f')}"
            ),
        ),
        ("listed pages the source guest holds", lambda r: _fmt(r["src_listed"], "d")),
        ("pages sent as references", lambda r: _fmt(r["block_ref_pages"], "d")),
        ("of the listed pages held, as references", lambda r: _fmt(r["refs_of_src_listed"], ".1%")),
        ("references refused at send time", lambda r: _fmt(r["refs_refused"], "d")),
        (
            "references merged / copied / read / failed on the destination",
            lambda r: " / ".join(
                _fmt(r[k], "d") for k in ("refs_merged", "refs_copied", "refs_read", "refs_failed")
            ),
        ),
        ("census, ms after switchover", lambda r: _fmt(r["census_after_ms"], "d")),
        ("destination: listed pages held", lambda r: _fmt(r["dst_listed"], "d")),
        (
            "of them shared (KSM pages) right after switchover",
            lambda r: _fmt(r["dst_shared_frac"], ".1%"),
        ),
        (
            "of them the server's page (PFN) right after switchover",
            lambda r: _fmt(r["dst_on_server_frac"], ".1%"),
        ),
        (
            "s until KSM shares block-refs' share",
            lambda r: _fmt(r["t_ksm_shared_s"], ".0f") if r["ksm_target_frac"] is not None else "-",
        ),
        (
            "s until as many are the server's page",
            lambda r: _fmt(r["t_ksm_server_s"], ".0f") if r["ksm_target_frac"] is not None else "-",
        ),
        ("s until 90 % of them are shared", lambda r: _fmt(r["t_shared_90_s"], ".0f")),
        ("followed for, s", lambda r: _fmt(r["followed_s"], ".0f")),
        (
            "shared / the server's page when last sampled",
            lambda r: (
                f"{_fmt(r['dst_shared_frac_last'], '.1%')} / "
                f"{_fmt(r['dst_on_server_frac_last'], '.1%')}"
            ),
        ),
    ]
    out = [
        "",
        "Live migration of guest 1 after the workload (--migrate), each method "
        "from the same guest state:",
        "",
        "| | " + " | ".join(methods) + " |",
        "|---|" + "---:|" * len(methods),
    ]
    for label, f in table:
        out.append(f"| {label} | " + " | ".join(f(rows[m]) for m in methods) + " |")
    out += ["", *targets(rows)]
    return "\n".join(out) + "\n"


def targets(rows: dict[str, dict[str, Any]]) -> list[str]:
    """Issue 21's targets, met or not, in words."""
    r = rows.get("block-refs")
    if not r or r["status"] != "completed":
        return ["- block-refs did not complete: no target can be judged"]
    out = []
    f = r["refs_of_src_listed"]
    out.append(
        f"- listed pages held that go as references: {_fmt(f, '.1%')} "
        f"({_fmt(r['block_ref_pages'], 'd')} of {_fmt(r['src_listed'], 'd')}; "
        f"target 95 %): {'met' if f is not None and f >= 0.95 else 'NOT met'}"
    )
    m = r["refs_merged_frac"]
    on = r["dst_on_server"]
    brp = r["block_ref_pages"]
    arrived = _frac(min(on, brp) if on is not None and brp is not None else None, brp)
    ok = m is not None and m >= 1 and arrived is not None and arrived >= 1
    out.append(
        f"- referenced pages shared on arrival: merged by the destination's filter "
        f"{_fmt(m, '.1%')}, the server's page at the census (of as many) "
        f"{_fmt(arrived, '.1%')} (target 100 %): {'met' if ok else 'NOT met'}"
    )
    p = rows.get("precopy")
    if p and p["status"] == "completed" and p["downtime_ms"] is not None:
        ok = r["downtime_ms"] is not None and r["downtime_ms"] <= p["downtime_ms"]
        out.append(
            f"- downtime {_fmt(r['downtime_ms'], 'd')} ms against precopy's "
            f"{p['downtime_ms']} ms (target: no worse): {'met' if ok else 'NOT met'}"
        )
    else:
        out.append("- downtime: no completed precopy to compare with")
    return out


def write_results(
    out: Path, lines: list[str], guest_fields: list[str], summary: dict[str, Any]
) -> str:
    """migration.csv, migration_samples.csv and summary["migration"] from a
    run's serial log; the markdown for summary.md ("" without a migration
    phase)."""
    parsed = parse(lines)
    if not parsed["m"]:
        return ""
    rows = summarize(parsed, guest_fields)
    with open(out / "migration.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(ROW_FIELDS)
        for r in rows.values():
            w.writerow(["" if r[k] is None else r[k] for k in ROW_FIELDS])
    with open(out / "migration_samples.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["method", "side", *guest_fields[1:]])
        for s in samples(parsed["ms"], guest_fields):
            w.writerow([s["method"], s["side"], *(s[k] for k in guest_fields[1:])])
    summary["migration"] = rows
    return markdown(rows)
