"""KSM controller: save/tune/restore and convergence, against a sysfs-shaped directory.

The real host KSM is driven by the end-to-end tests; here the logic runs on
a directory laid out like /sys/kernel/mm/ksm so every path can be forced.
"""

import os
import threading
import time
from pathlib import Path

import pytest
from pageshare.analysis.ksm import KSM, ksm_session
from pageshare.errors import UserError

SETTINGS = {
    "run": "0",
    "pages_to_scan": "100",
    "sleep_millisecs": "20",
    "smart_scan": "1",
    "use_zero_pages": "0",
    "max_page_sharing": "256",
    "advisor_mode": "[none] scan-time",
}


def write_counter(path: Path, value: int) -> None:
    """As sysfs does: a reader sees the old value or the new one, never an empty
    file (write_text truncates first, and a sampler on a loaded machine read
    the gap)."""
    tmp = path.with_name(path.name + ".new")
    tmp.write_text(f"{value}\n")
    os.replace(tmp, path)


def fake_ksm(tmp_path: Path) -> Path:
    for k, v in SETTINGS.items():
        (tmp_path / k).write_text(v + "\n")
    for k in ("full_scans", "pages_sharing", "pages_shared"):
        (tmp_path / k).write_text("0\n")
    return tmp_path


def test_choice_files_read_as_selected_value(tmp_path: Path) -> None:
    assert KSM(fake_ksm(tmp_path)).read("advisor_mode") == "none"


def test_session_restores_after_tune(tmp_path: Path) -> None:
    root = fake_ksm(tmp_path)
    with ksm_session(KSM(root)) as k:
        k.tune()
        assert (root / "run").read_text().strip() == "1"
        assert (root / "pages_to_scan").read_text().strip() == "20000"
        assert (root / "smart_scan").read_text().strip() == "0"
    for name in ("run", "pages_to_scan", "sleep_millisecs", "smart_scan", "use_zero_pages"):
        assert (root / name).read_text().strip() == SETTINGS[name]


def test_session_restores_on_exception_and_keyboard_interrupt(tmp_path: Path) -> None:
    root = fake_ksm(tmp_path)
    for exc in (RuntimeError("boom"), KeyboardInterrupt()):
        with pytest.raises(type(exc)), ksm_session(KSM(root)) as k:
            k.tune()
            raise exc
        assert (root / "run").read_text().strip() == "0"
        assert (root / "pages_to_scan").read_text().strip() == "100"


def test_missing_ksm_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="not available"), ksm_session(KSM(tmp_path / "none")):
        pass


def test_converges_when_a_full_scan_finds_nothing_new(tmp_path: Path) -> None:
    root = fake_ksm(tmp_path)
    stop = threading.Event()

    def ksmd() -> None:
        # several full scans per sampling interval, sharing grows then settles
        scans, sharing = 0, 0
        while not stop.is_set():
            scans += 3
            sharing = min(sharing + 5000, 20000)
            write_counter(root / "full_scans", scans)
            write_counter(root / "pages_sharing", sharing)
            time.sleep(0.02)

    t = threading.Thread(target=ksmd)
    t.start()
    try:
        conv = KSM(root).converge(timeout=10, interval=0.05)
    finally:
        stop.set()
        t.join()
    assert conv.converged
    assert conv.full_scans >= 3
    assert conv.samples[-1].values["pages_sharing"] == 20000


def test_gives_up_at_timeout(tmp_path: Path) -> None:
    root = fake_ksm(tmp_path)  # full_scans never moves
    conv = KSM(root).converge(timeout=0.3, interval=0.05)
    assert not conv.converged


def test_settle_time_is_sampled_but_not_cut_short(tmp_path: Path) -> None:
    root = fake_ksm(tmp_path)
    (root / "full_scans").write_text("100\n")
    (root / "pages_sharing").write_text("5000\n")

    def scans_advance(s: object) -> None:
        write_counter(root / "full_scans", int((root / "full_scans").read_text()) + 2)

    conv = KSM(root).converge(timeout=5, interval=0.05, min_time=0.5, on_sample=scans_advance)
    assert conv.converged
    assert conv.seconds >= 0.5
    assert len(conv.samples) >= 8  # sampled throughout the settle period


def test_an_unreadable_counter_is_not_a_stable_zero(tmp_path: Path) -> None:
    """pages_sharing that cannot be read is left out of a sample; it must not
    count as 0 pages shared and so as stable since the first sample's 0."""
    root = fake_ksm(tmp_path)

    def scans_advance_sharing_gone(s: object) -> None:
        (root / "pages_sharing").unlink(missing_ok=True)
        write_counter(root / "full_scans", int((root / "full_scans").read_text()) + 2)

    conv = KSM(root).converge(timeout=0.5, interval=0.05, on_sample=scans_advance_sharing_gone)
    assert not conv.converged
    assert conv.full_scans >= 3


def test_host_lock_serialises_ksm_users(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pageshare.analysis.ksm import host_lock

    monkeypatch.setenv("PAGESHARE_KSM_LOCK", str(tmp_path / "ksm.lock"))
    order: list[str] = []
    waited: list[str] = []
    with host_lock():

        def second() -> None:
            with host_lock(waited.append):
                order.append("second")

        t = threading.Thread(target=second)
        t.start()
        time.sleep(0.3)
        order.append("first done")
    t.join(timeout=5)
    assert order == ["first done", "second"]
    assert waited and "another analysis" in waited[0]


def test_settings_left_by_a_killed_analysis_are_restored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGKILL cannot be caught: the next analysis must put the host back."""
    import subprocess
    import sys

    (tmp_path / "ksm").mkdir()
    root = fake_ksm(tmp_path / "ksm")
    monkeypatch.setenv("PAGESHARE_KSM_LOCK", str(tmp_path / "ksm.lock"))
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path\n"
            "from pageshare.analysis.ksm import KSM, ksm_session\n"
            "with ksm_session(KSM(Path(sys.argv[1]))) as k:\n"
            "    k.tune(); print('tuned', flush=True); time.sleep(60)\n",
            str(root),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={**__import__("os").environ, "PYTHONPATH": str(Path(__file__).parents[2] / "analyzer")},
    )
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "tuned"
    child.kill()
    child.wait()
    assert (root / "run").read_text().strip() == "1"  # left tuned
    said: list[str] = []
    with ksm_session(KSM(root), said.append):
        assert (root / "run").read_text().strip() == "0"  # recovered before use
        assert (root / "pages_to_scan").read_text().strip() == "100"
    assert any("died" in s for s in said)
    assert not (tmp_path / "ksm.saved").exists()
