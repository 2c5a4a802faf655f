"""Running the crash utility with the pagescan extension on a dump.

crash is driven in batch mode (-s, commands from a file) and always under a
hard SIGKILL timeout: some crash commands hang forever on newer kernels and
ignore SIGTERM (seen with 8.0.2's `mount` on 6.1).  It runs with
--no_modules: pagescan needs only vmlinux's types, and a dump taken while a
module loads holds a half-written module list, which crash would otherwise
walk at start-up.  The extension is the
installed package's, or built from the checkout's crash-ext/ (datafiles.py).
"""

import subprocess
from pathlib import Path

from .classify import PageRecord, parse_file
from .datafiles import crash_version, pagescan_extension

__all__ = ["classify_pfns", "crash_version"]


def classify_pfns(
    vmlinux: Path, dump: Path, pfns: list[int], workdir: Path, timeout: float = 900
) -> dict[int, PageRecord]:
    ext = pagescan_extension()
    name = dump.stem
    pfn_file = workdir / f"{name}.pfns"
    out_file = workdir / f"{name}.pagescan.tsv"
    cmds = workdir / f"{name}.crash-cmds"
    pfn_file.write_text("".join(f"{p}\n" for p in sorted(pfns)))
    cmds.write_text(f"extend {ext}\npagescan -i {pfn_file} -o {out_file}\nquit\n")
    try:
        p = subprocess.run(
            [
                "timeout",
                "-s",
                "KILL",
                str(int(timeout)),
                "crash",
                "-s",
                "--no_modules",
                str(vmlinux),
                str(dump),
                "-i",
                str(cmds),
            ],
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
        )
    finally:
        pfn_file.unlink(missing_ok=True)
        cmds.unlink(missing_ok=True)
    if p.returncode != 0 or not out_file.exists():
        tail = (p.stdout + p.stderr).strip()[-800:]
        if p.returncode == -9 or p.returncode == 137:
            raise RuntimeError(f"crash did not finish within {timeout:.0f}s on {dump.name}")
        raise RuntimeError(f"crash failed on {dump.name} (exit {p.returncode}):\n{tail}")
    try:
        return parse_file(out_file)
    finally:
        out_file.unlink(missing_ok=True)
