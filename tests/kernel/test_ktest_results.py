"""ktest's reading of a suite VM's serial output (ktestlib.parse_results).

The guest's /init (ktestlib.guest.INIT) frames each test between
KTEST-BEGIN and KTEST-END lines; KTEST-END carries the exit status and the
test's wall time in the guest, which `ktest.py run` prints per test.
"""

from __future__ import annotations

from pageshare_tools import ktestlib as ktest
from pageshare_tools.ktestlib.guest import INIT

TESTS = [ktest.GuestTest("a", ["/tests/a"], 60), ktest.GuestTest("b", ["/tests/b"], 60)]


def test_each_result_has_its_status_output_and_time() -> None:
    lines = [
        "KTEST-BEGIN 1 a",
        "ok 1 first",
        "KTEST-END 1 rc=0 secs=312",
        "KTEST-BEGIN 2 b",
        "not ok 1 second",
        "KTEST-END 2 rc=1 secs=7",
        "KTEST-DONE",
    ]
    results, bad, done = ktest.parse_results(lines, TESTS)
    assert [(r.name, r.rc, r.secs, r.output) for r in results] == [
        ("a", 0, 312, ["ok 1 first"]),
        ("b", 1, 7, ["not ok 1 second"]),
    ]
    assert done and bad == []


def test_a_test_that_never_ended_has_no_status_or_time() -> None:
    lines = ["KTEST-BEGIN 1 a", "KTEST-END 1 rc=0", "KTEST-BEGIN 2 b", "[  9.1] Oops: 0000"]
    results, bad, done = ktest.parse_results(lines, TESTS)
    assert (results[0].rc, results[0].secs) == (0, None)  # an initramfs without the time
    assert (results[1].rc, results[1].secs) == (None, None)
    assert not done and bad == ["[  9.1] Oops: 0000"]


def test_the_guest_init_writes_what_is_parsed() -> None:
    assert 'echo "KTEST-BEGIN $n $name"' in INIT
    assert 'echo "KTEST-END $n rc=$rc secs=$(($(date +%s) - t0))"' in INIT
