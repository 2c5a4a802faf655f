"""The end-to-end benchmark's migration phase (bench/e2e_vs_ksm.py
--migrate, bench/e2e_migration.py, driver.sh's migrate_phase), without
its nested run:

- the E2E-M/E2E-MQ/E2E-MS lines parse into migration.csv's rows, with
  issue 21's numbers (bytes, times, CPU, references against the listed
  pages the source held, the destination's census right after
  switchover, how long KSM takes to catch up) on a stream whose answers
  are known; a failed method is a row that says why;
- the table and the targets, met and not met;
- write_results adds the migration to the summary, and nothing without a
  migration phase;
- the driver's shell helpers read a query-migrate reply and the sampler's
  lines as the Python side does.
"""

from __future__ import annotations

import csv
import json
import subprocess
from pathlib import Path
from typing import Any

import e2e_migration as mig
import e2e_vs_ksm as e2e

REPO = Path(__file__).resolve().parents[2]

T_DONE = 100_000


def g(method: str, side: str, t: int, listed: int, shared: int, on_server: int) -> str:
    """An E2E-MS line: the sampler's E2E-G fields from t_ms on."""
    f = dict.fromkeys(e2e.GUEST_FIELDS[1:], 0)
    f.update(t_ms=t, listed=listed, listed_shared=shared, on_server=on_server, full=1)
    return f"E2E-MS {method} {side} " + " ".join(str(v) for v in f.values())


def mq(downtime: int, transferred: int, brp: int = 0, total: int = 4000) -> str:
    return json.dumps(
        {
            "return": {
                "status": "completed",
                "setup-time": 5,
                "downtime": downtime,
                "total-time": total,
                "ram": {
                    "transferred": transferred,
                    "normal": 100,
                    "duplicate": 7,
                    "block-ref-pages": brp,
                    "multifd-bytes": 0,
                },
            }
        }
    )


def m_line(method: str, refs: tuple[int, ...] = (0, 0, -1, -1, -1, -1)) -> str:
    s, rf, mg, cp, rd, fl = refs
    return (
        f"E2E-M {method} status=completed t_migrate_ms={T_DONE - 4000} "
        f"t_done_ms={T_DONE} t_running_ms={T_DONE + 50} src_cpu_ms=1500 dst_cpu_ms=900 "
        f"bandwidth=125000000 refs_sent={s} refs_refused={rf} refs_merged={mg} "
        f"refs_copied={cp} refs_read={rd} refs_failed={fl}"
    )


def stream(refs_downtime: int = 30, brp: int = 9_700, merged: int = 9_700) -> list[str]:
    lines = [
        "E2E-EV pageshare 1 mig-phase methods=block-refs precopy xbzrle multifd-zstd",
        # block-refs: 9,700 of the 10,000 listed pages held go as references
        g("block-refs", "src", T_DONE - 5000, 10_000, 9_800, 9_750),
        "E2E-MQ block-refs " + mq(refs_downtime, 60 * mig.MIB, brp),
        m_line("block-refs", (brp, 300, merged, 0, 0, 0)),
        "E2E-M block-refs census_end_ms=106000 ksm_target_permille=950 ksm_cap_s=300",
        g("block-refs", "dst", T_DONE + 800, 10_000, 9_700, 9_700),
        g("block-refs", "dst", T_DONE + 1800, 10_000, 9_700, 9_700),
        # precopy: everything in full; KSM shares 97 % after 120 s, the
        # server's page 97 % after 150 s
        g("precopy", "src", T_DONE - 5000, 10_000, 9_800, 9_750),
        "E2E-MQ precopy " + mq(40, 200 * mig.MIB),
        m_line("precopy"),
        g("precopy", "dst", T_DONE + 900, 10_000, 100, 0),
        g("precopy", "dst", T_DONE + 60_000, 10_000, 5_000, 4_000),
        g("precopy", "dst", T_DONE + 120_000, 10_000, 9_700, 9_000),
        g("precopy", "dst", T_DONE + 150_000, 10_000, 9_800, 9_700),
        "E2E-M precopy census_end_ms=250000 ksm_target_permille=970 ksm_cap_s=300",
        # xbzrle: KSM never gets there within the cap
        g("xbzrle", "src", T_DONE - 5000, 10_000, 9_800, 9_750),
        "E2E-MQ xbzrle " + mq(35, 201 * mig.MIB),
        m_line("xbzrle"),
        g("xbzrle", "dst", T_DONE + 900, 10_000, 0, 0),
        g("xbzrle", "dst", T_DONE + 300_000, 10_000, 6_000, 6_000),
        # multifd-zstd failed
        "E2E-M multifd-zstd status=failed why=status_failed:_no_zstd",
    ]
    return lines


def test_rows_from_a_known_stream() -> None:
    rows = mig.summarize(mig.parse(stream()), e2e.GUEST_FIELDS)
    assert list(rows) == ["block-refs", "precopy", "xbzrle", "multifd-zstd"]
    r = rows["block-refs"]
    assert r["status"] == "completed"
    assert r["transferred_bytes"] == 60 * mig.MIB and r["downtime_ms"] == 30
    assert r["total_ms"] == 4000 and r["setup_ms"] == 5
    assert r["src_cpu_ms"] == 1500 and r["dst_cpu_ms"] == 900
    assert r["block_ref_pages"] == 9_700 and r["src_listed"] == 10_000
    assert r["refs_of_src_listed"] == 0.97
    assert r["refs_merged"] == 9_700 and r["refs_merged_frac"] == 1.0
    assert r["census_after_ms"] == 800
    assert r["dst_shared_frac"] == 0.97 and r["dst_on_server_frac"] == 0.97
    assert r["ksm_target_frac"] is None and r["t_ksm_shared_s"] is None
    p = rows["precopy"]
    assert p["refs_merged"] is None  # -1: no filter counter
    assert p["ksm_target_frac"] == 0.97
    assert p["t_ksm_shared_s"] == 120.0 and p["t_ksm_server_s"] == 150.0
    assert p["followed_s"] == 150.0 and p["t_shared_90_s"] == 120.0
    assert r["t_shared_90_s"] == 0.8
    assert p["dst_shared_frac"] == 0.01 and p["dst_shared_frac_last"] == 0.98
    x = rows["xbzrle"]
    assert x["t_ksm_shared_s"] is None and x["followed_s"] == 300.0
    assert x["dst_shared_frac_last"] == 0.6
    f = rows["multifd-zstd"]
    assert f["status"] == "failed" and f["why"] == "status failed: no zstd"
    assert f["transferred_bytes"] is None and f["t_ksm_shared_s"] is None


def test_markdown_and_targets_met() -> None:
    rows = mig.summarize(mig.parse(stream()), e2e.GUEST_FIELDS)
    md = mig.markdown(rows)
    assert "| | block-refs | precopy | xbzrle | multifd-zstd |" in md
    assert "| MiB on the wire | 60.0 | 200.0 | 201.0 | - |" in md
    assert "| downtime, ms | 30 | 40 | 35 | - |" in md
    assert "| less than precopy: bytes, time | 70%, 0% | 0%, 0% |" in md
    assert "| of the listed pages held, as references | 97.0% |" in md
    assert "| s until KSM shares block-refs' share | - | 120 | - | - |" in md
    assert "failed (status failed: no zstd)" in md
    assert "target 95 %): met" in md
    assert "(target 100 %): met" in md
    assert "(target: no worse): met" in md


def test_targets_not_met() -> None:
    rows = mig.summarize(
        mig.parse(stream(refs_downtime=50, brp=9_000, merged=8_000)), e2e.GUEST_FIELDS
    )
    t = "\n".join(mig.targets(rows))
    assert "90.0% (9000 of 10000; target 95 %): NOT met" in t
    assert "merged by the destination's filter 88.9%" in t and "(target 100 %): NOT met" in t
    assert "50 ms against precopy's 40 ms (target: no worse): NOT met" in t
    # without block-refs nothing can be judged
    lines = [x for x in stream() if " block-refs " not in x]
    rows = mig.summarize(mig.parse(lines), e2e.GUEST_FIELDS)
    assert mig.targets(rows) == ["- block-refs did not complete: no target can be judged"]
    assert rows["precopy"]["ksm_target_frac"] is None


def test_write_results(tmp_path: Path) -> None:
    summary: dict[str, Any] = {}
    md = mig.write_results(tmp_path, stream(), e2e.GUEST_FIELDS, summary)
    assert md.startswith("\nLive migration of guest 1")
    assert list(summary["migration"]) == ["block-refs", "precopy", "xbzrle", "multifd-zstd"]
    with open(tmp_path / "migration.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["method"] for r in rows] == list(summary["migration"])
    assert rows[1]["t_ksm_shared_s"] == "120.0" and rows[2]["t_ksm_shared_s"] == ""
    with open(tmp_path / "migration_samples.csv") as f:
        samples = list(csv.DictReader(f))
    assert len(samples) == 11 and samples[0]["side"] == "src"
    assert json.dumps(summary)  # summary.json can hold it
    # a run without the phase: nothing written, nothing added
    summary = {}
    assert mig.write_results(tmp_path / "none", ["E2E-EV x 1 end"], e2e.GUEST_FIELDS, summary) == ""
    assert summary == {}


def test_short_sampler_lines_and_bad_json() -> None:
    parsed = mig.parse(
        ["E2E-MQ precopy {not json", "E2E-M precopy status=completed", "E2E-MS precopy dst 5 0 1"]
    )
    assert "error" in parsed["mq"]["precopy"]
    s = mig.samples(parsed["ms"], e2e.GUEST_FIELDS)
    assert s[0]["t_ms"] == 5 and s[0]["listed"] == -1
    rows = mig.summarize(parsed, e2e.GUEST_FIELDS)
    assert rows["precopy"]["dst_shared_frac"] is None


def test_driver_env() -> None:
    st = e2e.Settings(3, 384, 6144, 150, 1000, ["pageshare"], "", "", 2400)
    assert e2e.migrate_env(st) == "MIGRATE=0\n"
    assert e2e.migrate_budget(st) == 0
    st.migrate = True
    assert e2e.migrate_env(st) == "MIGRATE=1\nMIG_KSM_CAP=300\nMIG_BW=125000000\n"
    assert e2e.migrate_budget(st) == 4 * 600


def driver_function(name: str) -> str:
    """One of driver.sh's shell functions, as written there."""
    text = (REPO / "bench/e2e/driver.sh").read_text()
    start = text.index(f"\n{name}() {{") + 1
    return text[start : text.index("\n}\n", start) + 3]


def test_driver_reads_what_python_reads(tmp_path: Path) -> None:
    reply = mq(31, 12345, 678)
    samples = tmp_path / "s"
    samples.write_text(
        "E2E-H x\n"
        + g("x", "dst", 1, 10_000, 9_700, 9_000).replace("E2E-MS x dst", "E2E-G mig")
        + "\n"
    )
    script = (
        "".join(driver_function(f) for f in ("mig_field", "mig_str", "mig_samples", "mig_share"))
        + f"""
r='{reply}'
echo "$(mig_field "$r" downtime) $(mig_field "$r" block-ref-pages) $(mig_str "$r" status)"
mig_share {samples}
"""
    )
    out = subprocess.run(["sh", "-c", script], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["31", "678", "completed", "970"]
    # Python reads the same sample the same way
    parsed = mig.parse([samples.read_text().splitlines()[1].replace("E2E-G mig", "E2E-MS x dst")])
    s = mig.samples(parsed["ms"], e2e.GUEST_FIELDS)[0]
    assert s["listed_shared"] * 1000 // s["listed"] == 970
