#!/usr/bin/env python3
"""The filter's read counts outside QEMU: invariants, then cost per block.

    .venv/bin/python qemu-patches/count_test.py

Compiles qemu-patches/fuzz/count_test.c, which includes
block/pageshare-count.c of the build's work tree (the series commit), with
that file's own compiler command from the build's compile_commands.json,
links it with the build's libqemuutil.a and runs it: 40 random streams
against exact counts (every reported count a lower bound at most N/k
below the truth, every block read more than N/k times reported, exact
counts when nothing was replaced, the heap and its hash index
consistent), then the read path's counting cost in ns per block.
Exit status 0 if the invariants hold.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import build  # qemu-patches/build.py, this script's neighbour

HERE = Path(__file__).resolve().parent


def main() -> int:
    out = build.ensure_built()
    work = build.worktree_for(out)
    bdir = work / "build"
    cmds = json.loads((bdir / "compile_commands.json").read_text())
    entry = next(e for e in cmds if str(e["file"]).endswith("block/pageshare-count.c"))
    args = shlex.split(str(entry["command"]))
    with tempfile.TemporaryDirectory(prefix="pageshare-count-") as tmp:
        obj = Path(tmp) / "count_test.o"
        exe = Path(tmp) / "count_test"
        cc: list[str] = []
        skip = False
        for a in args:
            if skip:
                skip = False  # the argument of -o, -MQ, -MF, -c
            elif a in ("-o", "-MQ", "-MF", "-c"):
                skip = True
            elif a not in ("-MD", "-Werror"):
                cc.append(a)
        cc += [
            "-I",
            str(work / "src" / "block"),
            "-c",
            str(HERE / "fuzz" / "count_test.c"),
            "-o",
            str(obj),
        ]
        subprocess.run(cc, cwd=bdir, check=True)
        glib = subprocess.run(
            ["pkg-config", "--libs", "glib-2.0", "gmodule-2.0"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        subprocess.run(
            [
                args[0],
                "-o",
                str(exe),
                str(obj),
                str(bdir / "libqemuutil.a"),
                *glib,
                "-lm",
                "-lpthread",
            ],
            check=True,
        )
        return subprocess.run([str(exe)]).returncode


if __name__ == "__main__":
    sys.exit(main())
