#!/usr/bin/env python3
"""One round of the feedback loop, end to end (issue 22's measurement).

    sudo .venv/bin/python bench/feedback_round.py [--out DIR] [-- E2E_ARGS]

1. Round 1: the end-to-end benchmark's pageshare configuration
   (bench/e2e_vs_ksm.py --configs pageshare --feedback) with
   analyze-image's default list for the small golden image, the one made
   from a booted image with no workload (--list-from boot).  The page
   server in the pageshare host counts what its guests read and publishes
   it to a Redis there; the driver dumps what it published.
2. That summary goes into a Redis on this machine, as a page server would
   have published it, and `pageshare list refine` writes the next
   generation of the list from it, dropping listed blocks no guest read
   (--drop-unread).  The benchmark is one host with three guests, so the
   thresholds are --min-guests 3 --min-hosts 1 (the defaults, 4 and 2,
   cannot be met by one host); a fleet needs the defaults or more (see
   `pageshare list refine --help`).
3. Round 2: the same configuration and workload with the refined list.

summary.md compares the rounds with each other and with the list made
from the guests' own workload (bench/results/e2e-20261127-pageshare): the
page-cache savings, and the preloaded blocks no guest maps at the end.
E2E_ARGS go to both runs of bench/e2e_vs_ksm.py (--observe, --guests ...).
"""

from __future__ import annotations

import argparse
import base64
import gzip
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# e2e_vs_ksm is this script's neighbour in bench/ (the script's directory)
import e2e_vs_ksm as e2e
from pageshare import cache, golden
from pageshare_tools.server_process import unix_redis

REPO = Path(__file__).resolve().parents[1]

# The list made from the guests' own workload, in the run without the
# sampler's bias: the savings a refined list is measured against.
REFERENCE = REPO / "bench/results/e2e-20261127-pageshare"
MIN_GUESTS = 3
MIN_HOSTS = 1
WINDOW = "600"


def log(msg: str) -> None:
    print(f"[feedback-round {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run_e2e(out: Path, list_args: list[str], extra: list[str], feedback: bool) -> dict[str, Any]:
    cmd = [
        sys.executable,
        str(REPO / "bench/e2e_vs_ksm.py"),
        "--configs",
        "pageshare",
        "--out",
        str(out),
        *list_args,
        *(["--feedback"] if feedback else []),
        *extra,
    ]
    log("running " + " ".join(cmd[1:]))
    subprocess.run(cmd, check=True)
    summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
    return summary


def load_feedback(run: Path, cli: list[str]) -> list[str]:
    """The summaries the pageshare configuration published, into the Redis
    that cli (redis-cli and its connection options) reaches, as the server
    wrote them; the keys."""
    fb = json.loads(gzip.decompress((run / "feedback.json.gz").read_bytes()))
    keys = fb.get("pageshare", {})
    if not keys:
        raise SystemExit(f"{run}: the pageshare configuration published no read feedback")
    for key, fields in keys.items():
        blocks = base64.b64decode(fields.pop("blocks", ""))
        args = [a for f, v in fields.items() for a in (f, v)]
        subprocess.run([*cli, "HSET", key, *args], check=True, capture_output=True)
        # the binary field through stdin (-x: the last argument)
        subprocess.run(
            [*cli, "-x", "HSET", key, "blocks"], input=blocks, check=True, capture_output=True
        )
        subprocess.run(
            [*cli, "SADD", key.rsplit(":", 1)[0] + ":hosts", fields["host"]],
            check=True,
            capture_output=True,
        )
    return list(keys)


def table(
    r1: dict[str, Any],
    r2: dict[str, Any],
    ref: dict[str, Any],
    refine: dict[str, Any],
    nlisted: tuple[int, int],
) -> str:
    c1, c2, cr = (s["configs"]["pageshare"] for s in (r1, r2, ref))
    for c, s in ((c1, r1), (c2, r2), (cr, ref)):
        c["_listed"] = s["listed_blocks"]

    def row(label: str, f: Any) -> str:
        return f"| {label} | " + " | ".join(f(c) for c in (c1, c2, cr)) + " |"

    saved_ref = cr["saved_mib"]["listed"]

    def unused(c: dict[str, Any]) -> str:
        u = c.get("server_unused_mib_end")
        if u is None:
            return "-"
        return f"{u:.1f} ({u / (c['_listed'] * 4096 / 2**20):.0%} of the list)"

    lines = [
        "| | round 1: analyze-image's boot list | round 2: refined | the workload's own list |",
        "|---|---:|---:|---:|",
        row("listed blocks", lambda c: str(c["_listed"])),
        row("saved: listed page cache, MiB", lambda c: f"{c['saved_mib']['listed']:.1f}"),
        row(
            "the same, of the workload list's",
            lambda c: f"{c['saved_mib']['listed'] / saved_ref:.0%}",
        ),
        row("preloaded pages no guest maps at the end, MiB", unused),
        row(
            "listed pages held that are shared at the end",
            lambda c: f"{c['listed_shared_frac_end']:.0%}",
        ),
        row("pages merged at read time by the filter", lambda c: str(c["filter_merged"])),
        "",
        f"refine ({refine.get('added', '?')} added, {refine.get('dropped', '?')} dropped; "
        f"list {nlisted[0]} -> {nlisted[1]} blocks); thresholds: {MIN_GUESTS} guests on "
        f"{MIN_HOSTS} host (the benchmark's one host), --drop-unread --window {WINDOW}",
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--out", type=Path, default=REPO / "bench/results" / time.strftime("feedback-%Y%m%d-%H%M")
    )
    ap.add_argument(
        "--summarize",
        action="store_true",
        help="only write summary.md again from the runs in --out",
    )
    ap.add_argument("e2e_args", nargs="*", help="after --: given to both benchmark runs")
    args = ap.parse_args()
    if args.summarize:
        return summarize(args.out)
    if shutil.which("redis-server") is None:
        ap.error("needs Debian's redis-server (scripts/install-deps.sh installs it)")
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    image = golden.build_image("small").path
    boot_list = e2e.ensure_list(image, cache.cache_root(), None)
    run_e2e(out / "round1", ["--list", str(boot_list)], args.e2e_args, True)
    refined = out / "refined.pcsl"
    with tempfile.TemporaryDirectory(prefix="feedback-round-") as td:
        sock = Path(td) / "redis.sock"
        with unix_redis(sock, poll=0.1, stop=signal.SIGTERM):
            keys = load_feedback(out / "round1", ["redis-cli", "-s", str(sock)])
            log(f"loaded {', '.join(keys)}; refining")
            p = subprocess.run(
                [
                    str(REPO / ".venv/bin/pageshare"),
                    "list",
                    "refine",
                    str(image),
                    "--list",
                    str(boot_list),
                    "--min-guests",
                    str(MIN_GUESTS),
                    "--min-hosts",
                    str(MIN_HOSTS),
                    "--drop-unread",
                    "--window",
                    WINDOW,
                    "-o",
                    str(refined),
                    "--db",
                    str(out / "results.sqlite"),
                    "--redis",
                    f"unix://{sock}",
                    "--json",
                ],
                capture_output=True,
                text=True,
            )
    (out / "refine.json").write_text(p.stdout)
    if p.returncode != 0:
        log(f"refine failed ({p.returncode}): {p.stderr.strip()}")
        return 1
    run_e2e(out / "round2", ["--list", str(refined)], args.e2e_args, False)
    (out / "command").write_text(
        f"bench/feedback_round.py {' '.join(sys.argv[1:])}\nround 1 list: {boot_list}\n"
    )
    return summarize(out)


def summarize(out: Path) -> int:
    """summary.md of a round from its files: round1/ and round2/ (the
    benchmark's), refine.json, command."""
    r1, r2 = (json.loads((out / r / "summary.json").read_text()) for r in ("round1", "round2"))
    ref = json.loads((REFERENCE / "summary.json").read_text())
    refine = json.loads((out / "refine.json").read_text())
    cmd = (out / "command").read_text().splitlines() if (out / "command").exists() else []
    md = (
        "".join(f"- {line}\n" for line in cmd)
        + "\n"
        + table(r1, r2, ref, refine, (r1["listed_blocks"], r2["listed_blocks"]))
    )
    (out / "summary.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
