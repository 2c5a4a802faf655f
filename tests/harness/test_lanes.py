"""The two-worker scheduler of `make test` (conftest.py's LaneScheduling).

The real scheduler class is driven by a small simulation of two xdist
workers: a worker runs the head of its queue only once it holds a second
test or has been told to shut down (xdist's worker needs the next item to
run a test's teardown), and each finished test goes back to the scheduler
as xdist's controller reports it.  The durations are those of the warm run
of 1838672 (CI, 2026-11-29), whose two workers ended 4946 s after the
start, one of them idle for the last 608 s.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import conftest
import pytest
from conftest import (
    FREE_BY_TEST,
    FREE_FILES,
    LaneScheduling,
    _path,
    lane,
    prune_recorded_times,
    recorded_seconds,
)

KERNEL = "tests/kernel/test_kernel_syscall.py::test_kernel_series_in_a_vm"
HOST = "tests/deploy/test_host_package_guest.py::test_host_package_on_a_hypervisor"
SERVER = "tests/deploy/test_server_package_guest.py::test_server_package_under_systemd"
QEMU = "tests/deploy/test_qemu_package_guest.py::test_qemu_package_installs_beside_debian_qemu"
DRGN = "tests/analyzer/test_drgn_backend.py"

# Seconds each unit took in the run of 1838672; the two lanes as ten tests
# each of a tenth of their time (3296 s and 2335 s).
RUN_1838672 = {
    **{f"tests/analyzer/test_a{i}.py::test": 329.6 for i in range(10)},
    **{f"tests/deploy/test_h{i}.py::test": 233.5 for i in range(10)},
    KERNEL: 1321.7,
    f"{HOST}[small]": 423.5,
    f"{HOST}[trixie]": 481.2,
    f"{DRGN}::test_drgn_classifies_a_6_12_dump": 87.1,
    f"{DRGN}::test_the_packaged_pagescan_classifies_as_the_checkout": 211.3,
    f"{DRGN}::test_the_packaged_drgn_on_debian_13": 138.0,
    f"{DRGN}::test_the_rest": 89.6,
    f"{SERVER}[small]": 285.0,
    f"{SERVER}[trixie]": 223.7,
    f"{QEMU}[small]": 253.2,
    f"{QEMU}[trixie]": 124.9,
}


class Worker:
    """What the scheduler sees of an xdist worker, and the queue it runs."""

    def __init__(self, name: str, handed: list[list[int]]) -> None:
        self.name, self.shutting_down = name, False
        self.gateway = SimpleNamespace(id=name)
        self.queue: list[int] = []
        self.ran: list[tuple[float, float, str]] = []  # start, end, nodeid
        self.handed = handed  # every unit sent to any worker, in order

    def send_runtest_some(self, indices: list[int]) -> None:
        self.queue.extend(indices)
        self.handed.append(indices)

    def shutdown(self) -> None:
        self.shutting_down = True

    def can_run(self) -> bool:
        return len(self.queue) >= 2 or (self.shutting_down and bool(self.queue))


def simulate(
    seconds: dict[str, float], known: dict[str, float]
) -> tuple[list[Worker], list[list[str]]]:
    """Run the collection SECONDS (in its order) on two workers with a
    scheduler that knows the times KNOWN; returns the workers and the units
    in the order they were handed out."""
    collection = list(seconds)
    config = SimpleNamespace(getvalue=lambda name: ["2*popen"], option=SimpleNamespace())
    sched = LaneScheduling(config, None, known)
    handed: list[list[int]] = []
    workers = [Worker("gw0", handed), Worker("gw1", handed)]
    for w in workers:
        sched.add_node(w)
        sched.add_node_collection(w, collection)
    sched.schedule()
    now = 0.0
    running: dict[str, tuple[float, int]] = {}  # worker: (end, index)
    while True:
        for w in workers:
            if w.name not in running and w.can_run():
                index = w.queue.pop(0)
                end = now + seconds[collection[index]]
                running[w.name] = (end, index)
                w.ran.append((now, end, collection[index]))
        if not running:
            break
        name = min(running, key=lambda n: running[n][0])
        now, index = running.pop(name)
        sched.mark_test_complete(next(w for w in workers if w.name == name), index)
    assert sorted(n for w in workers for _, _, n in w.ran) == sorted(collection)
    return workers, [[collection[i] for i in unit] for unit in handed]


def free_units(handed: list[list[str]]) -> list[str]:
    """The free units in the order they were handed out, each by its scope."""
    return [lane(u[0]) for u in handed if lane(u[0]) not in ("analysis", "hosts")]


def test_each_package_guest_test_is_a_unit_and_the_rest_by_file_or_lane() -> None:
    assert lane(f"{HOST}[small]") == f"{HOST}[small]"
    assert lane(f"{DRGN}::test_drgn_classifies_a_6_12_dump") == DRGN
    assert lane(KERNEL) == "tests/kernel/test_kernel_syscall.py"
    assert lane("tests/images/test_xfs_e2e.py::test_the_guest_root_was_xfs") == "analysis"
    assert lane("tests/qemu/test_migration.py::test_refs_on_the_source_only") == "hosts"
    assert set(FREE_FILES) >= FREE_BY_TEST
    repo = Path(__file__).resolve().parents[2]
    for f in FREE_BY_TEST:
        # a fixture of module scope would be made once per worker then
        assert 'scope="module"' not in (repo / f).read_text(), f


def test_units_go_out_lanes_first_then_the_kernel_suite_then_longest_first() -> None:
    workers, handed = simulate(RUN_1838672, RUN_1838672)
    assert {lane(u[0]) for u in handed[:2]} == {"analysis", "hosts"}
    assert {w.ran[0][2].split("/")[1] for w in workers} == {"analyzer", "deploy"}
    free = free_units(handed)
    unit_seconds = {u: sum(t for n, t in RUN_1838672.items() if lane(n) == u) for u in free}
    assert free[0] == "tests/kernel/test_kernel_syscall.py"
    assert free[1:] == sorted(free[1:], key=lambda u: -unit_seconds[u]), unit_seconds
    assert f"{HOST}[small]" in free and DRGN in free


def test_the_simulation_reproduces_the_run_of_1838672(monkeypatch: pytest.MonkeyPatch) -> None:
    """What that run's scheduler did (each free file one unit, handed out in
    FREE_FILES order): its workers ended at 4338 and 4946 s."""
    monkeypatch.setattr(conftest, "FREE_BY_TEST", frozenset())
    workers, _ = simulate(RUN_1838672, {})
    ends = sorted(w.ran[-1][1] for w in workers)
    assert abs(ends[0] - 4338) < 15 and abs(ends[1] - 4946) < 15, ends


def test_the_recorded_run_ends_close_to_an_even_split() -> None:
    total = sum(RUN_1838672.values())
    workers, _ = simulate(RUN_1838672, RUN_1838672)
    ends = sorted(w.ran[-1][1] for w in workers)
    print(f"simulated: workers end at {ends[0]:.0f} and {ends[1]:.0f} s (ideal {total / 2:.0f})")
    # 4946 s in the real run of 1838672, the first worker idle 608 s
    assert ends[1] - total / 2 < 120, ends
    assert ends[1] - ends[0] < 240, ends


def test_without_recorded_times_the_free_files_go_in_their_order() -> None:
    _, handed = simulate(RUN_1838672, {})
    order = [FREE_FILES.index(_path(u)) for u in free_units(handed)]
    assert order == sorted(order), free_units(handed)


def test_recorded_seconds_take_the_newest_passed_run(tmp_path: Path) -> None:
    (tmp_path / "20261101-000000.tsv").write_text("10\t5.0\tt::a\tpassed\n10\t7.0\tt::b\tpassed\n")
    (tmp_path / "20261102-000000.tsv").write_text(
        "10\t6.0\tt::a\tpassed\n10\t99.0\tt::b\tfailed in call\nbroken line\n"
    )
    assert recorded_seconds(tmp_path) == {"t::a": 6.0, "t::b": 7.0}


def test_recorded_times_keep_the_newest_runs(tmp_path: Path) -> None:
    runs = [f"202611{d:02d}-120000.tsv" for d in range(1, 8)]
    for name in reversed(runs):  # created newest first: the name orders them
        (tmp_path / name).write_text("10\t5.0\tt::a\tpassed\n")
    (tmp_path / "notes.txt").write_text("not a run")
    prune_recorded_times(tmp_path, keep=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == [*runs[-3:], "notes.txt"]
    prune_recorded_times(tmp_path, keep=3)  # nothing more to remove
    assert len(list(tmp_path.glob("*.tsv"))) == 3


@pytest.mark.parametrize("idle", [True, False])
def test_a_worker_holds_one_unit_behind_its_running_test(idle: bool) -> None:
    """The rule LaneScheduling keeps from xdist's: a worker with one test
    left is waiting for the next (it runs a test once it knows the next),
    so it gets a unit; one with two is busy and gets none."""
    seconds = {f"{HOST}[small]": 1.0, f"{HOST}[trixie]": 1.0, f"{QEMU}[small]": 1.0}
    config = SimpleNamespace(getvalue=lambda name: ["1*popen"], option=SimpleNamespace())
    sched = LaneScheduling(config, None, seconds)
    w = Worker("gw0", [])
    sched.add_node(w)
    sched.add_node_collection(w, list(seconds))
    sched.schedule()
    assert len(w.queue) == 2  # one unit, then a second behind it
    if idle:
        sched.mark_test_complete(w, w.queue.pop(0))
        assert len(w.queue) == 2 and not w.shutting_down
        sched.mark_test_complete(w, w.queue.pop(0))
        assert w.shutting_down, "no unit left: told to finish"
    else:
        sched._reschedule(w)
        assert len(w.queue) == 2, "a busy worker takes no unit"
