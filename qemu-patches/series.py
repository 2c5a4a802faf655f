#!/usr/bin/env python3
"""Edit the series as git commits, export it back, check it.

    qemu-patches/series.py devtree     # <cache>/qemu/dev: base + series as commits
    qemu-patches/series.py export      # format-patch dev -> qemu-patches/*.patch
    qemu-patches/series.py checkpatch  # QEMU's scripts/checkpatch.pl on every patch

``export`` keeps the cover letter's subject and text (everything above the
shortlog in ``0000-cover-letter.patch``), so edit them there, or pass
``--cover FILE`` (first line: subject, then the text).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import build  # qemu-patches/build.py, this script's neighbour

HERE = build.HERE
DEV = build.CACHE / "dev"


def git(*args: str, cwd: Path = DEV, capture: bool = False) -> str:
    p = subprocess.run(
        ["git", *build.GIT_ID, *args], cwd=cwd, check=True, text=True, capture_output=capture
    )
    return p.stdout if capture else ""


def base_repo() -> Path:
    apt = build.PrivateApt(build.CACHE / "apt")
    version = build.resolve_version(apt, build.DEFAULT_VERSION, False)
    return build.ensure_base(apt, version)


def devtree(force: bool) -> None:
    base = base_repo()
    if DEV.exists() and not force:
        raise SystemExit(f"{DEV} exists (commit or export your work, then --force)")
    subprocess.run(["rm", "-rf", str(DEV)], check=True)
    subprocess.run(["git", "clone", "-q", "--shared", str(base), str(DEV)], check=True)
    git("checkout", "-q", "-b", "pageshare", "base")
    patches = build.series()
    if patches:
        git("am", "-q", *map(str, patches))
    print(DEV)


def cover_text(path: Path | None) -> tuple[str, str]:
    if path:
        lines = path.read_text().splitlines()
        return lines[0].strip(), "\n".join(lines[1:]).strip() + "\n"
    old = HERE / "0000-cover-letter.patch"
    if not old.exists():
        return "*** SUBJECT HERE ***", "*** BLURB HERE ***\n"
    text = old.read_text()
    m = re.search(
        r"^Subject: \[PATCH[^\]]*\] (.*?)\n\n(.*?)\n\n[^\n]*\(\d+\):\n", text, re.S | re.M
    )
    if not m:
        raise SystemExit("cannot find subject and text in 0000-cover-letter.patch")
    return m.group(1).replace("\n ", " "), m.group(2).strip() + "\n"


def export(cover: Path | None) -> None:
    subject, blurb = cover_text(cover)
    out = DEV / ".export"
    subprocess.run(["rm", "-rf", str(out)], check=True)
    git(
        "format-patch",
        "-q",
        "--cover-letter",
        "--no-signature",
        "--thread=shallow",
        "--zero-commit",
        "-o",
        str(out),
        "base..HEAD",
    )
    cl = out / "0000-cover-letter.patch"
    text = cl.read_text()
    text = text.replace("*** SUBJECT HERE ***", subject)
    text = text.replace("*** BLURB HERE ***", blurb.rstrip("\n"))
    # The cover letter's date is the newest commit's, not the export's.
    date = git("log", "-1", "--format=%ad", "--date=rfc", capture=True).strip()
    text = re.sub(r"^Date: .*$", f"Date: {date}", text, count=1, flags=re.M)
    cl.write_text(text)
    # format-patch puts the time of the export into every Message-Id; the
    # newest commit's time instead keeps an unchanged series byte for byte
    # the same (and so build.py's key, and the diff).
    stamp = git("log", "-1", "--format=%ct", capture=True).strip()
    for p in HERE.glob("0*.patch"):
        p.unlink()
    for p in sorted(out.glob("*.patch")):
        text = re.sub(
            r"\.\d+\.git\.build@pageshare\.invalid>",
            f".{stamp}.git.build@pageshare.invalid>",
            p.read_text(),
        )
        (HERE / p.name).write_text(text)
        print(p.name)


def checkpatch() -> int:
    work = DEV if (DEV / "scripts/checkpatch.pl").exists() else base_repo()
    bad = 0
    for p in build.series():
        r = subprocess.run(
            ["perl", str(work / "scripts/checkpatch.pl"), str(p)], capture_output=True, text=True
        )
        total = next((x for x in r.stdout.splitlines() if x.startswith("total:")), "?")
        print(f"{p.name}: {total}")
        if r.returncode != 0:
            print(r.stdout)
            bad += 1
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("devtree")
    d.add_argument("--force", action="store_true")
    e = sub.add_parser("export")
    e.add_argument("--cover", type=Path)
    sub.add_parser("checkpatch")
    a = ap.parse_args()
    if a.cmd == "devtree":
        devtree(a.force)
    elif a.cmd == "export":
        export(a.cover)
    else:
        return checkpatch()
    return 0


if __name__ == "__main__":
    sys.exit(main())
