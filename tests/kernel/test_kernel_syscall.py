"""The merge_pages kernel series, built, booted under QEMU and tested.

kernel-syscall/run-tests.sh builds the patched 6.12 kernel with the debug
config (cached by series + config), boots it with an initramfs holding the
series' kselftests, the kernel's own KSM selftests and a randomized stress,
and exits non-zero on any failed test or any WARN/BUG/lockdep/KASAN/KFENCE
report in the kernel log.  The suite includes pageshare_filter_merge:
the patched QEMU and a real pageshare-server inside that VM, with
reads through the pageshare filter really merged by merge_pages.  This
wrapper makes it part of `make test` and refuses skipped tests and missing
test programs: either would hide a missing check.
"""

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.vm


def test_kernel_series_in_a_vm() -> None:
    p = subprocess.run(
        [str(REPO / "kernel-syscall" / "run-tests.sh"), "--config", "debug"],
        capture_output=True,
        text=True,
        timeout=3600,
    )
    out = p.stdout
    results = re.findall(r"^(ok|not ok) \d+ (\S+)(.*)$", out, re.M)
    report = out[-4000:] + p.stderr[-2000:]
    assert p.returncode == 0, report
    assert results, "no TAP results: " + report
    assert all(status == "ok" for status, _, _ in results), report
    skipped = [name for _, name, rest in results if "# SKIP" in rest]
    assert not skipped, f"skipped: {skipped}\n{report}"
    # kselftest programs count skipped cases in their "# Totals" lines
    inner_skips = re.findall(r"^.*# Totals: .*skip:[1-9].*$", out, re.M)
    assert not inner_skips, f"skipped cases: {inner_skips}\n{report}"
    names = {name for _, name, _ in results}
    # The suite's programs (kernel-syscall/ktest.py guest_tests()): losing
    # one from the initramfs must fail here, not shrink the suite silently.
    for expected in (
        "merge_page_tests",
        "merge_page_stress",
        "ksm_functional_tests",
        "ksm_tests",
        "pageshare_filter_merge",
    ):
        assert expected in names, f"{expected} did not run: {sorted(names)}\n{report}"
    summary = re.search(r"^ktest: (\d+)/\1 tests passed, 0 kernel reports", out, re.M)
    assert summary, report
