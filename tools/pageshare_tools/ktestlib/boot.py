"""5. boot and report: qemu-system-x86_64 under TCG with the initramfs, its
serial lines, the TAP results parsed from them and the kernel log scan
(BAD_PATTERNS: any match fails a run)."""

from __future__ import annotations

import re
import selectors
import shlex
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .common import log
from .guest import GuestTest

# Kernel log reports that fail a run.  Matched against every line of the
# serial console and of the dmesg dump taken at the end.
BAD_PATTERNS = [
    r"WARNING: CPU: \d+ PID: \d+",
    r"WARNING: .* at ",
    r"\bBUG: ",
    r"kernel BUG at",
    r"Oops: ",
    r"general protection fault",
    r"possible circular locking dependency",
    r"inconsistent lock state",
    r"possible recursive locking",
    r"lockdep: ",
    r"INFO: trying to register non-static key",
    r"suspicious RCU usage",
    r"BUG: KASAN: ",
    r"BUG: KFENCE: ",
    r"UBSAN: ",
    r"Kernel panic",
    r"page dumped because",
    r"bad page state",
    r"list_add corruption",
    r"list_del corruption",
    r"page_table_check",
    r"hung_task",
    r"blocked for more than",
    r"RIP: ",
    # A stack dumped without WARN/BUG: dump_stack() callers such as the
    # fault path's "FAULT_FLAG_ALLOW_RETRY missing" (a user fault taken
    # where it must not be, by an adversarial caller's vector), OOM reports,
    # sysrq.
    r"Call Trace:",
    r"FAULT_FLAG_ALLOW_RETRY missing",
]
BAD_RE = re.compile("|".join(f"(?:{p})" for p in BAD_PATTERNS), re.IGNORECASE)


@dataclass
class Result:
    name: str
    rc: int | None
    output: list[str]
    # the test's wall time in the guest (None: it did not end, or an
    # initramfs older than the field)
    secs: int | None = None


def boot(
    kdir: Path,
    initramfs: Path,
    runlog: Path,
    timeout: int,
    extra_append: str = "",
    mem: str = "2G",
    show: Callable[[str], bool] | None = None,
) -> list[str]:
    """Boot the kernel with the initramfs under TCG; return its serial lines.
    Lines for which show() is true are echoed (default: KTEST- markers, TAP
    results and kernel reports)."""
    append = (
        "console=ttyS0 panic=-1 loglevel=5 log_buf_len=8M numa=fake=2 "
        "transparent_hugepage=madvise " + extra_append
    ).strip()
    cmd = [
        "qemu-system-x86_64",
        "-accel",
        "tcg",
        # not the host's ksmd's to scan: an analysis may run it beside us
        "-machine",
        "mem-merge=off",
        "-cpu",
        "max",
        "-m",
        mem,
        "-smp",
        "2",
        "-kernel",
        str(kdir / "bzImage"),
        "-initrd",
        str(initramfs),
        "-append",
        append,
        "-nographic",
        "-no-reboot",
        "-monitor",
        "none",
    ]
    log(f"booting: {shlex.join(cmd)}")
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    with open(runlog, "w") as lf:
        p = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            bufsize=1,
        )
        # The VM goes with this process on every way out (an exception,
        # KeyboardInterrupt, SIGTERM where the caller made it an exit:
        # common.exit_on_sigterm); one left running holds its RAM and a core.
        try:
            assert p.stdout is not None
            sel = selectors.DefaultSelector()
            sel.register(p.stdout, selectors.EVENT_READ)
            in_dmesg = False
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    p.kill()
                    if not any(x.startswith("KTEST-DONE") for x in lines):
                        lines.append("KTEST-TIMEOUT")
                        lf.write("KTEST-TIMEOUT\n")
                    break
                if not sel.select(timeout=min(left, 5)):
                    if p.poll() is not None:
                        break
                    continue
                chunk = p.stdout.readline()
                if not chunk:
                    break
                line = chunk.rstrip("\r\n")
                lf.write(line + "\n")
                lf.flush()
                lines.append(line)
                if line.startswith("KTEST-DONE"):
                    # Give the guest a moment to reboot (QEMU exits), then stop it.
                    deadline = min(deadline, time.monotonic() + 10)
                if line.startswith("KTEST-DMESG-BEGIN"):
                    in_dmesg = True
                elif line.startswith("KTEST-DMESG-END"):
                    in_dmesg = False
                elif not in_dmesg and (
                    show(line)
                    if show
                    else (
                        line.startswith("KTEST-")
                        or re.match(r"^\s*(not )?ok \d+", line)
                        or line.startswith("# Totals")
                        or BAD_RE.search(line)
                    )
                ):
                    print(f"  | {line}", flush=True)
        finally:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)
    return lines


def parse_results(lines: list[str], tests: list[GuestTest]) -> tuple[list[Result], list[str], bool]:
    results: dict[int, Result] = {}
    cur: Result | None = None
    bad: list[str] = []
    done = False
    for line in lines:
        m = re.match(r"^KTEST-BEGIN (\d+) (.*)$", line)
        if m:
            cur = Result(m.group(2), None, [])
            results[int(m.group(1))] = cur
            continue
        m = re.match(r"^KTEST-END (\d+) rc=(\d+)(?: secs=(\d+))?$", line)
        if m and int(m.group(1)) in results:
            results[int(m.group(1))].rc = int(m.group(2))
            results[int(m.group(1))].secs = int(m.group(3)) if m.group(3) else None
            cur = None
            continue
        if line.startswith("KTEST-DONE"):
            done = True
        if BAD_RE.search(line) and line not in bad:
            bad.append(line)
        if cur is not None:
            cur.output.append(line)
    out = []
    for i, t in enumerate(tests, 1):
        out.append(results.get(i, Result(t.name, None, ["(did not run)"])))
    return out, bad, done


def extract_between(lines: list[str], begin: str, end: str) -> list[str]:
    out: list[str] = []
    inside = False
    for line in lines:
        if line.startswith(begin):
            inside = True
            continue
        if line.startswith(end):
            inside = False
            continue
        if inside:
            out.append(line)
    return out
