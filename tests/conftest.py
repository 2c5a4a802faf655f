"""Shared fixtures: golden images, and a guard that the host is left as found."""

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from package_root import Root, install_root, pageshare_debs
from pageshare import cache, golden
from pageshare.analysis.ksm import KSM, RESTORE_ORDER, host_lock
from xdist.scheduler import LoadScopeScheduling

REPO = Path(__file__).resolve().parents[1]

# Helper modules holding asserts that used to live in test modules: pytest
# rewrites them too, so that a failing one says what it compared, as before.
pytest.register_assert_rewrite(
    "analysis_failures",
    "package_guest",
    "results_samples",
    "listed_blocks",
    "listed_file_bytes",
    "migration_helpers",
    "notebook_helpers",
    "refine_helpers",
)

# A skipped test checks nothing, so a run with one fails (make test, CI):
# every test here can run on the machine scripts/install-deps.sh prepares,
# and one that cannot must say so as a failure, not pass quietly.
# PAGESHARE_ALLOW_SKIPS=1 lets a partial machine run what it can.
_skipped: list[str] = []


# Markers by cost (registered in pyproject.toml): a test that uses one of
# these fixtures needs a golden image, a Debian root with the packages, the
# page server or Debian's grub-common (downloaded) built or fetched, or
# drives the host's KSM.  Modules whose tests all build QEMU, the page
# server or packages say so with their own pytestmark.
BUILD_FIXTURES = frozenset({"small_image", "demo_image", "pageshare_root", "servers", "grub_host"})
KSM_FIXTURES = frozenset({"host_guard"})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        if names & BUILD_FIXTURES:
            item.add_marker(pytest.mark.build)
        if names & KSM_FIXTURES:
            item.add_marker(pytest.mark.hostksm)
    # The free files last, in FREE_FILES order, the rest in file order: the
    # order a run without xdist takes (with it, units go out by
    # unit_priority) and, within a unit, the order of its tests.
    items.sort(
        key=lambda item: (
            FREE_FILES.index(_path(item.nodeid)) + 1 if _path(item.nodeid) in FREE_FILES else 0
        )
    )


# `make test` runs two pytest workers (pytest-xdist), because most of the
# time one core waits on a single-vCPU TCG guest.  Tests that share
# something of the host's run in one lane, one test at a time, in file
# order: "analysis" (tests/analyzer, tests/images) boots analysis guests and
# takes turns on the host's KSM (its lock); "hosts" drives the host's
# libvirtd, fixed ports, QEMU's migration and the page server.  The files
# in FREE_FILES share nothing of the host (their guests, dumps and VM hold
# all they test) and are long: units that the first worker to run dry
# takes, after both lanes have started.  What two workers may build at
# once (images, apt lists, package roots) is made under a lock
# (pageshare.cache.locked), once.
ANALYSIS_LANE_DIRS = ("tests/analyzer/", "tests/images/")
FREE_FILES = (
    "tests/kernel/test_kernel_syscall.py",
    "tests/deploy/test_host_package_guest.py",
    "tests/analyzer/test_drgn_backend.py",
    "tests/deploy/test_server_package_guest.py",
    "tests/deploy/test_qemu_package_guest.py",
)
# Free files whose tests share no fixture narrower than the session: each
# test is a unit of its own.  With a whole file as a unit, a worker took the
# next unit when the file's last test started (see _reschedule), and the
# other worker sat idle for 10 minutes at the end of the run of 1838672.
FREE_BY_TEST = frozenset(
    {
        "tests/deploy/test_host_package_guest.py",
        "tests/deploy/test_server_package_guest.py",
        "tests/deploy/test_qemu_package_guest.py",
    }
)
# The kernel suite is handed out first: it is one test of about 22 minutes,
# and the unit a worker holds behind it waits that long.  The other free
# units go longest first by the times earlier runs recorded (test-times/,
# each test's newest), in FREE_FILES order where none did.


def _path(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def lane(nodeid: str) -> str:
    path = _path(nodeid)
    if path in FREE_BY_TEST:
        return nodeid
    if path in FREE_FILES:
        return path
    return "analysis" if path.startswith(ANALYSIS_LANE_DIRS) else "hosts"


def recorded_seconds(times_dir: Path) -> dict[str, float]:
    """Each test's time in the newest run that ran it and passed (a few
    kilobytes a run: read whole)."""
    seconds: dict[str, float] = {}
    for f in sorted(times_dir.glob("*.tsv")):
        for line in f.read_text().splitlines():
            fields = line.split("\t")
            if len(fields) == 4 and fields[3] == "passed":
                seconds[fields[2]] = float(fields[1])
    return seconds


TIMES_KEPT = 100


def prune_recorded_times(times_dir: Path, keep: int = TIMES_KEPT) -> None:
    """Removes all but the KEEP newest runs' times.  Every run writes a file,
    a single test's too, and the scheduler needs each test's newest: KEEP is
    some sessions of single tests between two full runs (under 10 MB)."""
    for f in sorted(times_dir.glob("*.tsv"))[:-keep]:
        f.unlink(missing_ok=True)


def unit_priority(
    scope: str, nodeids: Iterable[str], seconds: dict[str, float]
) -> tuple[int, float, int]:
    """Sort key of a unit: the lanes, the kernel suite, then the longest."""
    if scope in ("analysis", "hosts"):
        return (0, 0.0, 0)
    path = _path(scope)
    expected = sum(seconds.get(n, 0.0) for n in nodeids)
    return (1 if path == FREE_FILES[0] else 2, -expected, FREE_FILES.index(path))


class LaneScheduling(LoadScopeScheduling):  # type: ignore[misc]
    """xdist's load-by-scope with a scope per lane or free unit (xdist's own
    loadgroup cannot be used: it renames items' nodeids, which pytest 9 no
    longer lets it do), handing units out by unit_priority."""

    def __init__(self, config: Any, log: Any, seconds: dict[str, float]) -> None:
        super().__init__(config, log)
        self.seconds = seconds
        config.option.loadscopereorder = False

    def _split_scope(self, nodeid: str) -> str:
        return lane(nodeid)

    def _assign_work_unit(self, node: Any) -> None:
        # The workqueue is in collection order; hand out by priority.
        scope = min(self.workqueue, key=lambda s: unit_priority(s, self.workqueue[s], self.seconds))
        self.workqueue.move_to_end(scope, last=False)
        super()._assign_work_unit(node)

    def _reschedule(self, node: Any) -> None:
        # xdist tops a worker up when 2 of its tests are left, so a worker
        # still busy with a lane would take a free unit ahead of the other,
        # idle one.  With 1 left a worker is waiting (it runs a test only
        # once it knows the next one): that is running dry.
        if node.shutting_down:
            return
        if not self.workqueue:
            node.shutdown()
            return
        if self._pending_of(self.assigned_work[node]) <= 1:
            self._assign_work_unit(node)


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    gone = [f for f in FREE_FILES if not (REPO / f).exists()]
    if gone:
        raise pytest.UsageError(f"tests/conftest.py: FREE_FILES names files that are gone: {gone}")
    return LaneScheduling(config, log, recorded_seconds(cache.cache_dir("test-times")))


# Each test's time, written as the run goes: `--durations` prints only at
# the end, so a run stopped by CI's time limit would say nothing of where its
# time went.  Every test goes to a file under the cache (CI runs on the same
# machine, so the next session reads it there) with its outcome; tests of a
# minute or more, and any that did not pass, also to the terminal, with the
# time since the session started.
_SLOW_TEST_S = 60.0
# A worker's reports reach the controlling process too: count them there.
_IN_WORKER = "PYTEST_XDIST_WORKER" in os.environ
_session_start = time.monotonic()
_times_file = Path(os.devnull)
_test_seconds: dict[str, float] = {}
_test_outcome: dict[str, str] = {}


def _elapsed() -> float:
    return time.monotonic() - _session_start


def pytest_sessionstart(session: pytest.Session) -> None:
    global _session_start, _times_file
    _session_start = time.monotonic()
    if _IN_WORKER:
        return
    times_dir = cache.cache_dir("test-times")
    prune_recorded_times(times_dir)
    _times_file = times_dir / time.strftime("%Y%m%d-%H%M%S.tsv")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if _IN_WORKER:
        return
    if report.skipped and not hasattr(report, "wasxfail"):
        _skipped.append(report.nodeid)
    _test_seconds[report.nodeid] = _test_seconds.get(report.nodeid, 0.0) + report.duration
    if report.outcome != "passed":
        _test_outcome.setdefault(report.nodeid, f"{report.outcome} in {report.when}")
    if report.when != "teardown":
        return
    took = _test_seconds.pop(report.nodeid)
    outcome = _test_outcome.pop(report.nodeid, "passed")
    with open(_times_file, "a") as f:
        f.write(f"{_elapsed():.0f}\t{took:.1f}\t{report.nodeid}\t{outcome}\n")
    if took >= _SLOW_TEST_S or outcome != "passed":
        minutes, seconds = divmod(int(_elapsed()), 60)
        sys.stdout.write(
            f"\n[{minutes}:{seconds:02d} in] {report.nodeid}: {took:.0f} s, {outcome}\n"
        )


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _skipped and os.environ.get("PAGESHARE_ALLOW_SKIPS") != "1" and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    terminalreporter.write_line(f"each test's time: {_times_file}")
    if _skipped and os.environ.get("PAGESHARE_ALLOW_SKIPS") != "1":
        terminalreporter.write_line(
            f"FAILED: {len(_skipped)} test(s) skipped, and a skipped test checks nothing: "
            + ", ".join(_skipped)
            + " (install what they need: scripts/install-deps.sh; "
            "PAGESHARE_ALLOW_SKIPS=1 accepts skips on a partial machine)",
            red=True,
        )


@pytest.fixture(scope="session")
def small_image() -> Path:
    return golden.build_image("small").path


@pytest.fixture(scope="session")
def demo_image() -> Path:
    return golden.build_image("demo").path


def ksm_settings() -> dict[str, str]:
    k = KSM()
    return {n: k.read(n) for n in RESTORE_ORDER if (k.root / n).exists()}


def qemu_pids(marker: str = "") -> set[int]:
    """QEMU processes, optionally only those whose command line contains marker."""
    out = subprocess.run(
        ["pgrep", "-f", f"qemu-system-x86_64.*{marker}"], capture_output=True, text=True
    )
    return {int(p) for p in out.stdout.split()}


@dataclass
class Analysis:
    rc: int
    stdout: str
    stderr: str
    workdir: Path
    lists: Path
    db: Path

    def json(self) -> dict[str, object]:
        data: dict[str, object] = json.loads(self.stdout)
        return data


# What one `make test` makes once for all its workers: the package roots
# (two to two and a half minutes a suite) were made by each worker that
# needed them, twice a run.  The controlling process names the directory
# (its workers inherit the environment) and removes it when the run ends;
# a run without xdist is its own controlling process.
_SHARED_ENV = "PAGESHARE_TEST_SHARED_DIR"


def pytest_configure(config: pytest.Config) -> None:
    if not _IN_WORKER:
        os.environ[_SHARED_ENV] = tempfile.mkdtemp(prefix="pageshare-test-shared-")


def pytest_unconfigure(config: pytest.Config) -> None:
    shared = None if _IN_WORKER else os.environ.pop(_SHARED_ENV, None)
    if shared:
        subprocess.run(["rm", "-rf", "--one-file-system", shared], check=False)


@pytest.fixture(scope="session")
def pageshare_root() -> Callable[[str], Root]:
    """A fresh Debian root of a suite with the pageshare package (and
    pageshare-host) installed by apt (package_root.py), made once per
    run and suite, whichever worker asks first (the other waits)."""
    shared = Path(os.environ[_SHARED_ENV])

    def get(suite: str) -> Root:
        dest, ready = shared / f"root-{suite}", shared / f"root-{suite}.ready"
        with cache.locked(shared / f"root-{suite}.lock"):
            if not ready.exists():
                # a worker whose install failed left a partial root
                subprocess.run(["rm", "-rf", "--one-file-system", str(dest)], check=True)
                dest.mkdir()
                install_root(suite, pageshare_debs(), dest)
                ready.touch()
        return Root(dest, suite)

    return get


@pytest.fixture
def host_guard(tmp_path: Path) -> Iterator[None]:
    """Fails the test if it changed host KSM settings or left its QEMU running.

    Holds the host KSM lock around the comparison, so that a concurrent
    analysis (the other worker's, or another developer's on a shared
    machine) cannot make it flaky.  That means waiting for the analysis,
    at the start and at the end: tests that do not touch KSM use
    qemu_guard instead.
    """
    with host_lock():
        before_ksm = ksm_settings()
    yield
    with host_lock():
        assert ksm_settings() == before_ksm, "host KSM settings were not restored"
    assert qemu_pids(str(tmp_path)) == set(), "a QEMU process was left running"


@pytest.fixture
def qemu_guard(tmp_path: Path) -> Iterator[None]:
    """Fails the test if it left a QEMU of its own (one running on a file
    in its tmp_path) running."""
    yield
    assert qemu_pids(str(tmp_path)) == set(), "a QEMU process was left running"


def run_analyze(
    tmp: Path,
    *args: str,
    env: dict[str, str] | None = None,
    timeout: float = 1800,
    user: str | None = None,
) -> Analysis:
    workdir, lists, db = tmp / "work", tmp / "lists", tmp / "results.sqlite"
    workdir.mkdir(exist_ok=True)
    e = dict(os.environ, PAGESHARE_WORKDIR=str(workdir), PYTHONPATH=str(REPO / "analyzer"))
    e.update(env or {})
    cmd = [
        sys.executable,
        "-m",
        "pageshare.cli",
        "analyze",
        "--lists-dir",
        str(lists),
        "--db",
        str(db),
        *args,
    ]
    if user:
        cmd = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *cmd]
    p = subprocess.run(cmd, capture_output=True, text=True, env=e, timeout=timeout, cwd=tmp)
    return Analysis(p.returncode, p.stdout, p.stderr, workdir, lists, db)


def analyze_cleanly(tmp: Path, image: Path, *args: str) -> tuple[Analysis, Path]:
    """`analyze-image --json --settle 10 ARGS IMAGE`, which must succeed and
    leave the host as found (KSM settings, no QEMU, no work files); returns
    the analysis and IMAGE converted to raw in TMP, for byte checks."""
    with host_lock():
        before_ksm = ksm_settings()
    result = run_analyze(tmp, "--json", "--settle", "10", *args, str(image))
    assert result.rc == 0, result.stderr
    with host_lock():
        assert ksm_settings() == before_ksm
    assert qemu_pids(str(tmp)) == set()
    assert list(result.workdir.iterdir()) == []
    raw = tmp / "base.raw"
    subprocess.run(["qemu-img", "convert", "-O", "raw", str(image), str(raw)], check=True)
    return result, raw
