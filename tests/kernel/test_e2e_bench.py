"""The end-to-end benchmark's own parts (bench/e2e_vs_ksm.py): what can be
checked without its 40-minute nested run.

- e2e_sampler.c (the in-VM sampler) and the benchmark hash guest pages and
  listed blocks the same way, or no page would ever be classed as listed;
- bench/e2e/driver.sh refuses, with a message that says what to do, to run
  on a kernel without KSM, without the merge_pages series or with KSM off
  (on this host's kernel and on fake sysfs directories);
- the benchmark refuses on this machine before it builds anything: no host
  KSM when analyze-image has to make the list, a series without
  merge_pages, a host config without KSM;
- the summary's arithmetic on a sample stream whose answers are known,
  also when a configuration ran again after a guest did not boot;
- the sample stream of a real run (bench/results/) parses and summarizes.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import random
import re
import shutil
import socket
import struct
import subprocess
import sys
import threading
from pathlib import Path

import e2e_vs_ksm as e2e
import pytest
from notebook_helpers import execute
from pageshare import cache, golden
from pageshare_tools import ktestlib as ktest

REPO = Path(__file__).resolve().parents[2]

KSM = Path("/sys/kernel/mm/ksm")
GUEST_FULL = e2e.GUEST_FIELDS.index("full") + 1  # its column in an E2E-G line


@pytest.fixture(scope="module")
def sampler(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("sampler") / "e2e_sampler"
    subprocess.run(ktest.sampler_argv(out), check=True)
    return out


def test_sampler_and_benchmark_hash_pages_alike(sampler: Path, tmp_path: Path) -> None:
    rnd = random.Random(20261124)
    pages = [rnd.randbytes(4096) for _ in range(6)] + [bytes(4096), b"\xff" * 4096]
    f = tmp_path / "pages.bin"
    f.write_bytes(b"".join(pages))
    out = subprocess.run(
        [str(sampler), "--hash", str(f)], capture_output=True, text=True, check=True
    ).stdout.split()
    want = [f"{e2e.page_hash(p):016x}" for p in pages]
    assert out == want
    assert len(set(want)) == len(want)


def test_stale_pages_are_the_guests(sampler: Path, tmp_path: Path) -> None:
    """The stale memory guest-init.sh's awk writes is stale_page()'s, page
    for page, and the sampler hashes it as the benchmark's hash file says;
    no stale page is zeros or repeats another."""
    init = (REPO / "bench/e2e/guest-init.sh").read_text()
    prog = init.split("'BEGIN ", 1)[1].split("' > /stale", 1)[0]
    f = tmp_path / "stale"
    awk = ["busybox", "awk"] if shutil.which("busybox") else ["awk"]  # the guests' is busybox's
    with open(f, "wb") as out:
        subprocess.run([*awk, "-v", "n=512", "BEGIN " + prog], stdout=out, check=True)
    data = f.read_bytes()
    assert data == b"".join(e2e.stale_page(i) for i in range(512))
    got = subprocess.run(
        [str(sampler), "--hash", str(f)], capture_output=True, text=True, check=True
    ).stdout.split()
    want = e2e.stale_hashes(2)
    assert [int(h, 16) for h in got] == [
        int.from_bytes(want[i : i + 8], "little") for i in range(0, len(want), 8)
    ]
    assert len(set(got)) == 512


def test_summary_stale_class() -> None:
    """Freed stale pages shared by KSM are saved as their own class, not as
    "everything else"; those still held are reported."""

    def g(t: int, guest: int, stale: int, stale_shared: int) -> str:
        return _g("ksm", t, guest, 10, 10) + f" {stale} {stale_shared}"

    lines = [
        "E2E-EV ksm 0 begin filter=0",
        g(100, 1, 500, 0),
        g(100, 2, 500, 0),
        _h("ksm", 100, 0, 0, 10, 0, 0) + " 0 0 0",
        "E2E-EV ksm 200 work-done",
        g(300, 1, 500, 500),
        g(300, 2, 500, 500),
        _h("ksm", 300, 0, 0, 10, 0, 0) + " 0 0 500",
    ]
    st = e2e.Settings(2, 384, 6144, 10, 1000, ["ksm"], "", "", 100, 900, 2)
    c = e2e.summarize(e2e.parse(lines), st, 10)["configs"]["ksm"]
    assert c["saved_mib"]["stale"] == pytest.approx(500 * 4096 / 2**20)
    assert c["saved_mib"]["other"] == 0
    assert c["stale_resident_mib_end"] == pytest.approx(1000 * 4096 / 2**20)


# A process holding pages of known content, for the sampler's census: its
# argument names the pages (ROLE:...), it prints its pid and sleeps.
# A process holding known pages.  The listed pages come from a file (argv 2,
# made by listed_pages()) and are read straight into the mapping: a copy of
# them in the holder's own heap, page-aligned by chance, would be one more
# page with listed bytes in the process ("server") the sampler counts whole.
HOLDER = r"""
import mmap, os, sys, time
role, listed_file = sys.argv[1], sys.argv[2]
if role == "guest":
    m = mmap.mmap(-1, 16 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    pages = [b"A" * 4096] * 1000 + [os.urandom(4096) for _ in range(100)] + [bytes(4096)] * 100
    n_listed = 20
else:
    m = mmap.mmap(-1, 50 * 4096, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    pages, n_listed = [], 50
for i in range(len(pages) + n_listed):
    m[i * 4096:(i + 1) * 4096] = b"x" * 4096   # written, so private even if zero
for i, p in enumerate(pages):
    m[i * 4096:(i + 1) * 4096] = p
with open(listed_file, "rb", buffering=0) as f:
    view = memoryview(m)[len(pages) * 4096:(len(pages) + n_listed) * 4096]
    assert f.readinto(view) == n_listed * 4096
    view.release()
print(os.getpid(), flush=True)
time.sleep(120)
"""


def listed_pages(tmp_path: Path, seed: int) -> tuple[list[bytes], Path]:
    """The 50 listed pages of the census test, and a file holding them for
    HOLDER."""
    listed = [random.Random(seed + i).randbytes(4096) for i in range(50)]
    f = tmp_path / "listed.pages"
    f.write_bytes(b"".join(listed))
    return listed, f


def test_sampler_census_counts_duplicates_and_the_servers_pages(
    sampler: Path, tmp_path: Path
) -> None:
    """The census on two real processes whose pages are known: a "guest"
    with 16 MiB of RAM holding 1000 copies of one page, 100 random pages,
    100 written zero pages and private copies of 20 of the server's 50
    listed pages; a "server" holding the 50.  Distinct physical pages
    1220 + 50, distinct contents 1 + 100 + 1 + 50, all 50 server pages
    backing no guest page; and the CPU columns are there."""
    listed, listed_file = listed_pages(tmp_path, 20261128)
    hashes = tmp_path / "listed.hashes"
    hashes.write_bytes(b"".join(struct.pack("<Q", e2e.page_hash(p)) for p in listed))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", HOLDER, role, str(listed_file)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for role in ("guest", "server")
    ]
    sam = None
    try:
        guest, server = (int(p.stdout.readline()) for p in procs if p.stdout)
        sam = subprocess.Popen(
            [str(sampler), "t", str(hashes), "200", str(server), "16", f"{guest}:-"],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert sam.stdout is not None
        g = h = None
        for line in sam.stdout:
            if line.startswith("E2E-G "):
                g = dict(zip(e2e.GUEST_FIELDS[1:], map(int, line.split()[2:]), strict=True))
            if line.startswith("E2E-H "):
                h = dict(zip(e2e.HOST_FIELDS[1:], map(int, line.split()[2:]), strict=True))
                break
    finally:
        for p in [*procs, *([sam] if sam else [])]:
            p.kill()
            p.wait()
    assert g is not None and h is not None
    assert g["full"] == 1 and g["listed"] == 20 and g["listed_shared"] == 0
    assert g["present"] == 1220
    assert g["anon_huge_kb"] >= 0  # smaps_rollup's AnonHugePages was read
    assert h["mem_pages"] == 1220 + 50
    assert h["distinct_pages"] == 1 + 100 + 1 + 50
    assert h["server_unused"] == 50
    # kworkers have run since boot; the machine has been busy; the sampler too
    assert h["kworker_cpu_ms"] > 0 and h["busy_cpu_ms"] > 0 and h["sampler_cpu_ms"] >= 0
    meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    swap_used = int(meminfo["SwapTotal"].split()[0]) - int(meminfo["SwapFree"].split()[0])
    assert abs(h["swap_used_kb"] - swap_used) <= 64 * 1024


def test_sampler_reads_everything_after_a_mark(sampler: Path, tmp_path: Path) -> None:
    """A new file in $E2E_MARKS (the driver's mark of a guest's end of
    reads) makes the sampler's next pass a full one, off its schedule of
    every fifth."""
    marks = tmp_path / "marks"
    marks.mkdir()
    (tmp_path / "none.hashes").write_bytes(b"")
    guest = subprocess.Popen(
        [sys.executable, "-c", HOLDER, "guest", str(listed_pages(tmp_path, 1)[1])],
        stdout=subprocess.PIPE,
        text=True,
    )
    sam = None
    try:
        assert guest.stdout is not None
        pid = int(guest.stdout.readline())
        sam = subprocess.Popen(
            [str(sampler), "t", str(tmp_path / "none.hashes"), "100", "0", "16", f"{pid}:-"],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "E2E_MARKS": str(marks)},
        )
        assert sam.stdout is not None
        full = []
        for line in sam.stdout:
            if not line.startswith("E2E-G "):
                continue
            full.append(int(line.split()[GUEST_FULL]))
            if len(full) == 2:
                (marks / "1.GREP").touch()
            if len(full) == 4:
                break
    finally:
        for p in [guest, *([sam] if sam else [])]:
            p.kill()
            p.wait()
    # 1st: the schedule's; 2nd: not; 3rd: maybe still the pass under way
    # when the mark came; 4th at the latest: the mark's
    assert full[0] == 1 and full[1] == 0 and 1 in full[2:]


def test_sampler_reads_the_filters_merge_batches(sampler: Path, tmp_path: Path) -> None:
    """The sampler reads the filter's counters from QMP (here a QMP socket
    that answers as QEMU with the filter does), its merge-batches list
    among them, and the summary adds the guests' last readings up."""
    sock_path = tmp_path / "qmp.sock"
    stats = {
        "driver": "pageshare",
        "connected": True,
        "requests": 5,
        "merged": 9,
        "merge-ns": 100,
        "fallback-merge-failed": 0,
        "fallback-not-listed": 1,
        "fallback-partial": 2,
        "fallback-unaligned": 3,
        "fallback-no-table": 4,
        "fallback-not-guest-ram": 5,
        "fallback-unsupported": 6,
        "fallback-unproven": 7,
        "merge-batches": [3, 0, 1, 0, 0, 11, 2],
        "merge-calls": 17,
    }
    reply = json.dumps({"return": [{"node-name": "ps", "driver-specific": stats}]})
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(sock_path))
    srv.listen(1)

    def qmp() -> None:
        conn, _ = srv.accept()
        with conn, conn.makefile("rw") as f:
            f.write('{"QMP": {"version": {}, "capabilities": []}}\n')
            f.flush()
            for line in f:
                cmd = json.loads(line)["execute"]
                f.write((reply if cmd == "query-blockstats" else '{"return": {}}') + "\n")
                f.flush()

    t = threading.Thread(target=qmp, daemon=True)
    t.start()
    (tmp_path / "none.hashes").write_bytes(b"")
    guest = subprocess.Popen(
        [sys.executable, "-c", HOLDER, "guest", str(listed_pages(tmp_path, 1)[1])],
        stdout=subprocess.PIPE,
        text=True,
    )
    sam = None
    try:
        assert guest.stdout is not None
        pid = int(guest.stdout.readline())
        sam = subprocess.Popen(
            [
                str(sampler),
                "pageshare",
                str(tmp_path / "none.hashes"),
                "100",
                "0",
                "16",
                f"{pid}:{sock_path}",
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert sam.stdout is not None
        lines = []
        for line in sam.stdout:
            lines.append(line)
            if line.startswith("E2E-H "):
                break
    finally:
        for p in [guest, *([sam] if sam else [])]:
            p.kill()
            p.wait()
        srv.close()
    rows = e2e.parse(lines)
    f = dict(zip(e2e.FALLBACK_FIELDS, rows["fallback"][0], strict=True))
    assert [
        f[k] for k in ("partial", "unaligned", "no_table", "not_ram", "unsupported", "unproven")
    ] == ["2", "3", "4", "5", "6", "7"]
    assert [int(f[k]) for k in e2e.BATCH_FIELDS] == [3, 0, 1, 0, 0, 11, 2]
    g = dict(zip(e2e.GUEST_FIELDS, rows["E2E-G"][0], strict=True))
    assert (g["requests"], g["merged"], g["merge_ns"]) == ("5", "9", "100")
    # two guests' last readings add up; an older sampler's rows have none
    two = [[*r[:2], str(gi), *r[3:]] for r in rows["fallback"] for gi in (0, 1)]
    t0 = int(two[0][1])
    assert e2e.merge_batches(two, "pageshare", t0, t0) == [6, 0, 2, 0, 0, 22, 4]
    old = [r[:13] + ["-1"] * 7 for r in two]
    assert e2e.merge_batches(old, "pageshare", t0, t0) is None


def test_sampler_usage_error(sampler: Path) -> None:
    p = subprocess.run([str(sampler)], capture_output=True, text=True)
    assert p.returncode == 2
    assert "usage: e2e_sampler" in p.stderr


def preflight(ksm: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    if ksm is not None:
        env["E2E_KSM_SYSFS"] = str(ksm)
    return subprocess.run(
        ["sh", str(REPO / "bench/e2e/driver.sh"), "--preflight"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def test_driver_preflight_on_this_kernel() -> None:
    """On a kernel without the series (this host's) the benchmark refuses
    with what to do; on a patched one with KSM on it passes.  Either way
    KSM's run is left as it was."""
    before = (KSM / "run").read_text() if (KSM / "run").exists() else None
    p = preflight()
    after = (KSM / "run").read_text() if (KSM / "run").exists() else None
    assert before == after
    if not KSM.exists():
        assert p.returncode == 1 and "E2E-ERROR this kernel has no KSM" in p.stdout
    elif not (KSM / "merge_page_merged").exists():
        assert p.returncode == 1, p.stdout
        assert "E2E-ERROR this kernel lacks the merge_pages series" in p.stdout
        assert "boot the patched kernel" in p.stdout
    elif before != "1\n":
        assert p.returncode == 1 and "E2E-ERROR KSM is off on this host" in p.stdout
    else:
        assert p.returncode == 0 and "E2E-PREFLIGHT ok" in p.stdout, p.stdout


def fake_ksm(tmp_path: Path, run: str, series: bool = True) -> Path:
    k = tmp_path / "ksm"
    k.mkdir()
    (k / "run").write_text(run + "\n")
    if series:
        (k / "merge_page_merged").write_text("0\n")
    return k


def test_driver_refuses_a_kernel_without_ksm(tmp_path: Path) -> None:
    p = preflight(tmp_path / "no-ksm")
    assert p.returncode == 1
    assert p.stdout.startswith("E2E-ERROR this kernel has no KSM")
    assert "CONFIG_KSM and the merge_pages series" in p.stdout


def test_driver_refuses_a_kernel_without_the_series(tmp_path: Path) -> None:
    p = preflight(fake_ksm(tmp_path, "1", series=False))
    assert p.returncode == 1
    assert p.stdout.startswith("E2E-ERROR this kernel lacks the merge_pages series")
    assert "merge_page_merged missing" in p.stdout


@pytest.mark.parametrize("run", ["0", "2"])
def test_driver_refuses_ksm_off(tmp_path: Path, run: str) -> None:
    """A host whose KSM is not in merge mode is refused, not switched on
    behind the operator's back, and is left as it was."""
    k = fake_ksm(tmp_path, run)
    p = preflight(k)
    assert p.returncode == 1
    assert p.stdout.startswith(f"E2E-ERROR KSM is off on this host ({k}/run is {run}, not 1)")
    assert f"echo 1 > {k}/run" in p.stdout
    assert (k / "run").read_text() == run + "\n"


def test_driver_preflight_passes_a_pageshare_host(tmp_path: Path) -> None:
    p = preflight(fake_ksm(tmp_path, "1"))
    assert p.returncode == 0 and p.stdout == "E2E-PREFLIGHT ok\n", p.stdout + p.stderr


def test_benchmark_refuses_before_building(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No host KSM and no list: refused with what to do, before the golden
    image, kernels or QEMU are built (build_image is never called)."""
    image = tmp_path / "golden.qcow2"
    image.write_bytes(b"x")

    def no_build(*_: object) -> None:
        raise AssertionError("built something before refusing")

    monkeypatch.setattr(e2e, "KSM", tmp_path / "no-ksm")
    monkeypatch.setattr(golden, "build_image", no_build)
    monkeypatch.setattr(ktest, "cache_root", no_build)
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(cache, "cache_root", lambda: tmp_path / "cache")
    monkeypatch.setattr(sys, "argv", ["e2e_vs_ksm.py", "--image", str(image)])
    with pytest.raises(e2e.BenchError, match=r"this host has no KSM .* pass --list"):
        e2e.main()
    # with a list given, host KSM is not needed: the refusal is gone (the
    # next step, which would build, is reached)
    monkeypatch.setattr(sys, "argv", ["e2e_vs_ksm.py", "--image", str(image), "--list", str(image)])
    with pytest.raises(AssertionError, match="built something"):
        e2e.main()


def test_benchmark_refuses_a_series_without_merge_pages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo = tmp_path / "repo"
    (repo / "kernel-syscall/patches").mkdir(parents=True)
    shutil.copytree(REPO / "kernel-syscall/config", repo / "kernel-syscall/config")
    (repo / "kernel-syscall/patches/0001-something-else.patch").write_text("diff\n")
    monkeypatch.setattr(e2e, "REPO", repo)
    with pytest.raises(e2e.BenchError, match="has no merge_pages series"):
        e2e.host_preflight(KSM, False)
    # the series back, KSM taken out of the host config
    for p in (REPO / "kernel-syscall/patches").glob("*.patch"):
        shutil.copy2(p, repo / "kernel-syscall/patches")
    base = repo / "kernel-syscall/config/base.config"
    base.write_text(base.read_text().replace("CONFIG_KSM=y", "# CONFIG_KSM is not set"))
    with pytest.raises(e2e.BenchError, match="does not set CONFIG_KSM=y"):
        e2e.host_preflight(KSM, False)


def _g(
    cfg: str,
    t: int,
    guest: int,
    listed: int,
    shared: int,
    *,
    merged: int = -1,
    merge_ns: int = -1,
    zero_shared: int = 0,
    other_shared: int = 0,
    pss: int = 100_000,
) -> str:
    vals = [
        cfg,
        t,
        guest,
        1000,
        pss + 1000,
        pss,
        5000,
        shared + zero_shared + other_shared,
        listed,
        shared,
        800,
        zero_shared,
        other_shared,
        10,
        merged,
        merge_ns,
        0,
        0,
        1,
        shared if merged >= 0 else 0,
    ]
    return "E2E-G " + " ".join(map(str, vals))


def _h(
    cfg: str, t: int, ksmd_ms: int, sharing: int, dl: int, dz: int, do: int, server_ms: int = 0
) -> str:
    vals = [cfg, t, 5_000_000, ksmd_ms, server_ms, 0, 0, 10, sharing, 0, 0, 1, dl, dz, do, 50]
    return "E2E-H " + " ".join(map(str, vals))


def test_summary_arithmetic() -> None:
    lines = [
        "E2E-EV ksm 1000 begin filter=0",
        # two guests, 1000 listed pages each; KSM shares them after the reads
        _g("ksm", 2000, 1, 1000, 0),
        _g("ksm", 2000, 2, 1000, 0),
        _h("ksm", 2000, 0, 0, 0, 0, 0),
        "E2E-EV ksm 3000 work-done",
        _g("ksm", 3000, 1, 1000, 100),
        _g("ksm", 3000, 2, 1000, 100),
        _h("ksm", 3000, 500, 100, 50, 0, 0),
        _g("ksm", 13000, 1, 1000, 950, zero_shared=200),
        _g("ksm", 13000, 2, 1000, 950, zero_shared=200, other_shared=60),
        _h("ksm", 13000, 4500, 2**18, 950, 1, 30),
        # a sample taken as the guests were being stopped: not counted
        _g("ksm", 13400, 1, 0, 0, pss=-1),
        _g("ksm", 13400, 2, 0, 0, pss=-1),
        _h("ksm", 13400, 0, 0, 0, 0, 0),
        "E2E-EV ksm 13500 end",
        # after the end event: the guests are being stopped, not counted
        _g("ksm", 14000, 1, 0, 0),
        _g("ksm", 14000, 2, 0, 0),
        _h("ksm", 14000, 0, 0, 0, 0, 0),
        "E2E-EV ksm 1500 mark 1 BOOTED",
        "E2E-EV ksm 1600 mark 2 BOOTED",
        "E2E-EV ksm 1700 mark 1 BINS",
        "E2E-EV ksm 1800 mark 2 BINS",
        "E2E-EV ksm 2200 mark 1 GREP",
        "E2E-EV ksm 2400 mark 2 GREP",
        "E2E-GUEST ksm 1 GUEST-BOOTED 20.5 GUEST-BINS 21 25 GUEST-GREP 25 55 GUEST-SUM abc",
        "E2E-GUEST ksm 2 GUEST-BOOTED 22.5 GUEST-BINS 23 26 GUEST-GREP 26 66 GUEST-SUM abc",
        "E2E-EV all 14000 finished",
    ]
    st = e2e.Settings(2, 384, 6144, 10, 1000, ["ksm"], "", "", 100)
    s = e2e.summarize(e2e.parse(lines), st, 4096)
    c = s["configs"]["ksm"]
    assert s["bytes_identical"] and s["checksums"] == ["abc"]
    assert c["work_s"] == 2.0 and c["observed_s"] == 10.0
    assert c["listed_shared_frac_work_done"] == pytest.approx(0.1)
    assert c["listed_shared_frac_end"] == pytest.approx(0.95)
    assert c["t90_after_reads_s"] == 10.0
    # each guest's own end of reads: the sampler numbers guests from 0, the
    # driver's marks from 1, so sampler guest 1 is the driver's guest 2
    # (GREP at 2.4 s; sampler guest 2 has no driver guest 3): the next full
    # sample, at 3 s, holds 100 of its 1000 listed pages shared
    assert c["listed_shared_frac_reads_end"] == [pytest.approx(0.1)]
    assert c["reads_end_sample_after_s_max"] == pytest.approx(0.6)
    # saved = guest mappings of shared pages - distinct shared pages
    assert c["saved_mib"]["listed"] == pytest.approx((1900 - 950) * 4096 / 2**20)
    assert c["saved_mib"]["zero"] == pytest.approx((400 - 1) * 4096 / 2**20)
    assert c["saved_mib"]["other"] == pytest.approx((60 - 30) * 4096 / 2**20)
    # 4.5 s of ksmd for 2**18 pages_sharing = 1 GiB
    assert c["ksmd_cpu_s"] == pytest.approx(4.5)
    assert c["ksmd_cpu_s_per_gib"] == pytest.approx(4.5)
    assert c["pageshare_cpu_s_per_gib"] is None
    assert c["listed_on_server_frac_end"] == 0.0  # KSM's pages are not the server's
    assert c["grep_s_mean"] == pytest.approx(0.55)  # driver stamps, not guest clocks
    assert c["bins_s_mean"] == pytest.approx(0.2)
    assert c["boot_s_mean"] == pytest.approx(0.55)
    md = e2e.markdown(s, "bench/e2e_vs_ksm.py", "facts")
    assert "| ksmd CPU s per GiB saved (pages_sharing) | 4.5 |" in md


def test_summary_pageshare_cpu_and_wrong_bytes() -> None:
    gib_pages = 2**18
    lines = [
        "E2E-EV pageshare 0 begin filter=1",
        _g("pageshare", 100, 1, 10, 10, merged=0, merge_ns=0),
        _h("pageshare", 100, 0, 0, 0, 0, 0, server_ms=1000),
        "E2E-EV pageshare 200 work-done",
        _g("pageshare", 300, 1, 10, 10, merged=gib_pages, merge_ns=2_000_000_000),
        _h("pageshare", 300, 0, gib_pages, 10, 0, 0, server_ms=1500),
        "E2E-GUEST pageshare 1 GUEST-SUM abc",
        "E2E-GUEST pageshare 2 GUEST-SUM abd",
    ]
    st = e2e.Settings(1, 384, 6144, 10, 1000, ["pageshare", "none"], "", "", 100)
    s = e2e.summarize(e2e.parse(lines), st, 10)
    c = s["configs"]["pageshare"]
    assert c["t90_after_reads_s"] == pytest.approx(0.1)
    assert c["filter_merged"] == gib_pages
    assert c["kernel_merge_page_merged"] == 0  # _h() leaves the kernel counter at 0
    assert c["listed_on_server_frac_end"] == 1.0
    # 2 s in merge_pages per GiB; the server's 1.5 s before its first merge
    # (start-up: the image's hash) is reported apart
    assert c["pageshare_cpu_s_per_gib"] == pytest.approx(2.0)
    assert c["server_startup_cpu_s"] == pytest.approx(1.5)
    assert not s["bytes_identical"]
    assert s["configs"]["none"] == {"error": "did not finish"}
    assert "NO" in e2e.markdown(s, "x", "y")


def test_summary_takes_the_last_start_of_a_configuration() -> None:
    """A configuration whose guest did not boot ran again: its samples and
    marks before the last "begin" are not counted, the hang is recorded;
    the stale memory the guests freed and the host's THP collapses are."""

    def h(t: int, sharing: int, thp: int) -> str:
        return _h("ksm", t, 0, sharing, 0, 0, 0) + f" {thp} 0"

    lines = [
        "E2E-EV ksm 1000 begin filter=0",
        _g("ksm", 1500, 1, 999, 999),
        h(1500, 999, 5),
        "E2E-EV ksm 1600 mark 1 BOOTED",
        "E2E-EV ksm 2000 boot-hung 2 not booted after 900 s; RIP ffffffff81000010 ffffffff81000020",
        "E2E-GLOG ksm 2 [    0.000000] Linux version 6.12",
        "E2E-EV ksm 2100 retry a guest did not boot",
        "E2E-EV ksm 3000 begin filter=0",
        _g("ksm", 3500, 1, 100, 0),
        _g("ksm", 3500, 2, 100, 0),
        h(3500, 0, 7),
        "E2E-EV ksm 3600 mark 1 BOOTED",
        "E2E-EV ksm 3700 mark 2 BOOTED",
        "E2E-EV ksm 4000 work-done",
        _g("ksm", 5000, 1, 100, 100),
        _g("ksm", 5000, 2, 100, 100),
        h(5000, 100, 9),
        "E2E-GUEST ksm 1 GUEST-SUM abc GUEST-FREED 64 200000 134000 190000 9",
        "E2E-GUEST ksm 2 GUEST-SUM abc GUEST-FREED 64 200000 134000 192048 9",
        "E2E-EV ksm 5500 end",
    ]
    st = e2e.Settings(2, 384, 6144, 10, 1000, ["ksm"], "", "", 100, 900, 64)
    rows = e2e.parse(lines)
    assert rows["glog"] == [["ksm", "2", "[    0.000000] Linux version 6.12"]]
    s = e2e.summarize(rows, st, 10)
    c = s["configs"]["ksm"]
    assert s["boot_hangs"] == [
        {
            "cfg": "ksm",
            "t_ms": 2000,
            "detail": "2 not booted after 900 s; RIP ffffffff81000010 ffffffff81000020",
        }
    ]
    assert c["boot_s_mean"] == pytest.approx(0.65)  # (600 + 700) / 2, not the 1st start
    assert c["listed_pages_held"] == 200
    assert c["thp_collapses"] == 2
    assert c["stale_freed_mib"] == 64
    assert c["stale_memfree_back_mib"] == pytest.approx((56000 + 58048) / 2 / 1024)
    assert c["page_reporting_order"] == "9"
    assert c["resident_mib_end"] == pytest.approx(2 * 5000 * 4096 / 2**20)
    md = e2e.markdown(s, "x", "y")
    assert "| huge pages collapsed by khugepaged in the pageshare host | 2 |" in md


def test_summary_frontier_counts_every_cost() -> None:
    """Sharing CPU is ksmd + merge_pages + the server (start-up too) + the
    kworkers beyond none's rate; duplicates not yet shared integrate over
    the census samples; savings are net of the server's pages and of
    none's; the targets are read from the frontier, misses as misses."""

    def h(
        cfg: str, t: int, ksmd: int, server: int, kw: int, mem: int, dist: int, unused: int = 0
    ) -> str:
        return (
            _h(cfg, t, ksmd, 0, 0, 0, 0, server_ms=server)
            + f" 0 0 0 {kw} {2 * t} {t // 10} {mem} {dist} {unused}"
        )

    lines = []
    for cfg in ("none", "ksm", "pageshare-pts0"):
        lines += [f"E2E-EV {cfg} 0 begin filter=0", f"E2E-EV {cfg} 500 work-done"]
    lines += [
        # none: 1000 duplicates all along; kworkers at 0.1 s/s
        _g("none", 1000, 1, 10, 0),
        h("none", 1000, 0, 0, 0, 5000, 4000),
        _g("none", 11000, 1, 10, 0),
        h("none", 11000, 0, 0, 1000, 5000, 4000),
        # ksm: 10 s of ksmd, 0.5 s of kworkers beyond none's, 900 pages saved
        _g("ksm", 1000, 1, 10, 0),
        h("ksm", 1000, 0, 0, 0, 5000, 4000),
        _g("ksm", 11000, 1, 10, 10),
        h("ksm", 11000, 10_000, 0, 1500, 4100, 4000),
        # pageshare, ksmd idle: 0.1 s ksmd, 1 s merge_pages, the server's 5 s
        # start-up and 0.5 s after; 880 saved net of 20 unused server pages
        _g("pageshare-pts0", 1000, 1, 10, 10, merged=100, merge_ns=0),
        h("pageshare-pts0", 1000, 0, 5000, 0, 4150, 4100),
        _g("pageshare-pts0", 11000, 1, 10, 10, merged=200, merge_ns=10**9),
        h("pageshare-pts0", 11000, 100, 5500, 1000, 4120, 4120, unused=20),
    ]
    lines += [f"E2E-GUEST {c} 1 GUEST-SUM abc" for c in ("none", "ksm", "pageshare-pts0")]
    st = e2e.Settings(1, 384, 6144, 10, 1000, ["none", "ksm", "pageshare-pts0"], "", "", 100)
    s = e2e.summarize(e2e.parse(lines), st, 10)
    mib = 4096 / 2**20
    none, ksm, ps = (s["configs"][c] for c in ("none", "ksm", "pageshare-pts0"))
    assert none["dup_mib_s"] == pytest.approx(1000 * mib * 10)
    assert none["net_saved_mib_end"] == 0
    assert ksm["dup_mib_s"] == pytest.approx((1000 + 100) / 2 * mib * 10)
    assert ksm["dup_mib_end"] == pytest.approx(100 * mib)
    assert ksm["kworker_excess_cpu_s"] == pytest.approx(0.5)
    assert ksm["sharing_cpu_s"] == pytest.approx(10.5)
    assert ksm["sharing_saved_mib_end"] == pytest.approx(900 * mib)
    assert ksm["sharing_cpu_s_per_gib_saved"] == pytest.approx(10.5 / (900 * mib / 1024))
    assert ps["server_startup_cpu_s"] == pytest.approx(5.0)
    assert ps["kworker_excess_cpu_s"] == 0
    assert ps["sharing_cpu_s"] == pytest.approx(0.1 + 1 + 5 + 0.5)
    assert ps["net_saved_mib_end"] == pytest.approx(880 * mib)
    assert ps["server_unused_mib_end"] == pytest.approx(20 * mib)
    assert ps["dup_mib_s"] == pytest.approx(50 / 2 * mib * 10)
    # listed pages held but not shared: ksm's 10 go from unshared to shared
    assert none["listed_unshared_mib_s"] == pytest.approx(10 * mib * 10)
    assert ksm["listed_unshared_mib_s"] == pytest.approx(10 / 2 * mib * 10)
    assert ps["listed_unshared_mib_s"] == 0
    assert ps["sharing_cpu_after_startup_s"] == pytest.approx(0.1 + 1 + 0.5)
    assert ksm["sharing_cpu_after_startup_s"] == pytest.approx(10.5)
    # the machine's busy time less the sampler's: 2 ms/ms less 0.1 ms/ms
    assert ps["machine_cpu_s"] == pytest.approx(20 - 1)
    assert ps["machine_cpu_beyond_none_s"] == 0
    md = e2e.markdown(s, "x", "y")
    # 6.6 s is not 5x less than 10.5 s: a miss, said so; it dominates ksm
    assert "(all costs) a pageshare configuration with KSM-default's savings" in md
    assert "(all costs) pageshare dominating every KSM-only point on CPU and MiB*s: met" in md
    assert "5x less sharing CPU and 10x fewer MiB*s: MISSED" in md
    # without the start-up hash, once per image per host, 1.6 s is
    assert "start-up hash) a pageshare configuration with KSM-default's savings" in md
    assert "10x fewer MiB*s: met by pageshare-pts0" in md
    assert "| pageshare-pts0 | 6.6 | 1.6 | 1 | 0 | 3.4 |" in md


def test_benchmark_names_scan_rates() -> None:
    """ksm-ptsN and pageshare-ptsN are configurations; other names are
    refused before anything is built, and the driver knows the same ones."""
    assert e2e.SCAN_RATE.fullmatch("ksm-pts0") and e2e.SCAN_RATE.fullmatch("pageshare-pts5000")
    assert not e2e.SCAN_RATE.fullmatch("ksm-ptsx")
    assert all(c in e2e.CONFIGS or e2e.SCAN_RATE.fullmatch(c) for c in e2e.FRONTIER)
    p = subprocess.run(
        [sys.executable, str(REPO / "bench/e2e_vs_ksm.py"), "--configs", "ksm,ksm-pts12x"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 2 and "unknown configuration(s) ksm-pts12x" in p.stderr
    driver = (REPO / "bench/e2e/driver.sh").read_text()
    assert "ksm-pts[0-9]*) run_once_more" in driver
    assert "pageshare-pts[0-9]*) run_once_more" in driver


def test_benchmark_names_repeats() -> None:
    """NAME-rN runs NAME again: the script accepts it for every known NAME,
    and the driver's pattern strips exactly the suffix (scan rates and the
    -faults and -fpr names kept)."""
    for name in ("none-r2", "pageshare-r12", "pageshare-pts0-r3", "ksm-fpr-r2"):
        assert e2e.known_config(name), name
    assert e2e.base_config("pageshare-pts10-r2") == "pageshare-pts10"
    assert not e2e.known_config("nothing-r2") and not e2e.known_config("none-rx")
    driver = (REPO / "bench/e2e/driver.sh").read_text()
    assert "case ${c%-r[0-9]*} in" in driver and "c_base=${cfg%-r[0-9]*}" in driver
    names = ["none-r2", "pageshare-pts10-r2", "ksm-fpr", "pageshare-faults", "ksm-pts5000"]
    out = subprocess.run(
        ["sh", "-c", 'for c in "$@"; do echo "${c%-r[0-9]*}"; done', "sh", *names],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert out == [e2e.base_config(n) for n in names]
    p = subprocess.run(
        [sys.executable, str(REPO / "bench/e2e_vs_ksm.py"), "--guests", "1", "--corunner", "64"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 2 and "--corunner needs --guests 2 or more" in p.stderr


def test_mixed_guests_get_their_own_reads(tmp_path: Path) -> None:
    """--mixed: what the driver puts on guest i's kernel command line (from
    e2e.env, as driver.sh's start_guest evaluates it) makes guest-init.sh
    read and checksum MIXED[i - 1]'s directories after its delay."""
    st = e2e.Settings(3, 384, 6144, 10, 1000, ["ksm"], e2e.GREP_DIRS, e2e.SUM_DIRS, 100, mixed=True)
    init = (REPO / "bench/e2e/guest-init.sh").read_text()
    parse = init[init.index('grep_dirs="__GREP_DIRS__"') : init.index('sleep "$delay"')]
    parse = (
        parse.replace("__GREP_DIRS__", st.grep_dirs)
        .replace("__SUM_DIRS__", st.sum_dirs)
        .replace("/proc/cmdline", str(tmp_path / "cmdline"))
    )
    driver = (REPO / "bench/e2e/driver.sh").read_text()
    assert 'eval "gargs=\\${GUEST_ARGS_$i:-}"' in driver
    for i in (1, 2, 3):
        script = (
            e2e.guest_args_env(st)
            + f"i={i}\n"
            + 'eval "gargs=\\${GUEST_ARGS_$i:-}"\n'
            + f'echo "console=ttyS0 panic=-1 $gargs" > {tmp_path / "cmdline"}\n'
            + parse
            + 'echo "$grep_dirs|$sum_dirs|$delay"\n'
        )
        out = subprocess.run(
            ["sh", "-c", script], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirs, delay = e2e.MIXED[i - 1]
        assert out == f"{dirs}|{dirs}|{delay}"
    # without --mixed: no arguments, every guest the default dirs at once
    assert e2e.guest_args_env(dataclasses.replace(st, mixed=False)) == ""


def test_corunner_guest_hashes_and_reads_nothing(tmp_path: Path) -> None:
    """--corunner MIB: the last guest's kernel command line makes
    guest-init.sh hash MIB MiB and print the lines the driver stamps, then
    GUEST-WORK-DONE, before anything that reads the disk."""
    st = e2e.Settings(2, 384, 6144, 10, 1000, ["none"], "/mnt/usr", "/mnt/usr", 100, corunner_mib=3)
    env = e2e.guest_args_env(st)
    assert env == "GUEST_ARGS_2='e2e_cpu=3'\n"
    init = (REPO / "bench/e2e/guest-init.sh").read_text()
    part = init[init.index('grep_dirs="__GREP_DIRS__"') : init.index("# the image's own binaries")]
    part = part.replace("/proc/cmdline", str(tmp_path / "cmdline")).replace(
        "while :; do sleep 3600; done", "exit 0"
    )
    script = (
        env
        + "i=2\n"
        + 'eval "gargs=\\${GUEST_ARGS_$i:-}"\n'
        + f'echo "console=ttyS0 $gargs" > {tmp_path / "cmdline"}\n'
        + "up() { echo 1.0; }\n"
        + part
        + "echo NOT-REACHED\n"
    )
    out = subprocess.run(
        ["sh", "-c", script], capture_output=True, text=True, check=True, timeout=60
    ).stdout.split("\n")
    assert [x.split()[0] for x in out if x] == [
        "GUEST-BOOTED",
        "GUEST-CPUBEGIN",
        "GUEST-CPUEND",
        "GUEST-WORK-DONE",
    ]
    driver = (REPO / "bench/e2e/driver.sh").read_text()
    assert "for m in BOOTED BINS GREP FREED CPUBEGIN CPUEND WORK-DONE; do" in driver


def test_summary_corunner_pairs() -> None:
    """The co-runner's pace from the driver's stamps of its lines (host
    time), pair by pair against none; the co-runner has no checksum and
    does not make the guests' bytes differ; a pair below 95 % is a miss."""

    def cfg(name: str, t0: int, cpu_ms: int, grep_ms: int) -> list[str]:
        return [
            f"E2E-EV {name} {t0} begin filter=0",
            _g(name, t0 + 100, 1, 10, 10),
            _g(name, t0 + 100, 2, 0, 0),
            _h(name, t0 + 100, 0, 0, 0, 0, 0),
            f"E2E-EV {name} {t0 + 200} mark 1 BINS",
            f"E2E-EV {name} {t0 + 200 + grep_ms} mark 1 GREP",
            f"E2E-EV {name} {t0 + 300} mark 2 CPUBEGIN",
            f"E2E-EV {name} {t0 + 300 + cpu_ms} mark 2 CPUEND",
            f"E2E-EV {name} {t0 + 90_000} work-done",
            f"E2E-GUEST {name} 1 GUEST-SUM abc",
            f"E2E-GUEST {name} 2 GUEST-CPUBEGIN 1 GUEST-CPUEND 9",
        ]

    lines = [
        *cfg("none", 0, 10_000, 50_000),  # 64 MiB in 10 s
        *cfg("pageshare", 100_000, 10_240, 40_000),
        *cfg("none-r2", 200_000, 10_000, 50_000),
        *cfg("pageshare-r2", 300_000, 12_800, 40_000),
    ]
    names = ["none", "pageshare", "none-r2", "pageshare-r2"]
    st = e2e.Settings(2, 384, 6144, 10, 1000, names, "", "", 100, corunner_mib=64)
    s = e2e.summarize(e2e.parse(lines), st, 10)
    assert s["bytes_identical"] and s["checksums"] == ["abc"]
    assert s["configs"]["none"]["corunner_mib_s"] == pytest.approx(6.4)
    assert s["configs"]["pageshare-r2"]["corunner_mib_s"] == pytest.approx(5.0)
    md = e2e.markdown(s, "c", "f")
    assert "| 1 | 6.40 | 6.25 | 0.977 | 50.0 | 40.0 | 0.800 |" in md
    assert "| 2 | 6.40 | 5.00 | 0.781 |" in md
    assert "co-runner pace beside the filter / beside none: 0.781 to 0.977 over 2 pair(s)" in md
    assert "co-runners within 5 % of no filter: MISSED (the worst pair 0.781)" in md
    assert "the none runs among themselves: 6.400 to 6.400 MiB/s, 0.0% apart\n" in md + "\n"
    # none runs 25 % apart: the ratios are not told apart from noise
    noisy = [
        x.replace("none-r2 210300 mark 2 CPUEND", "none-r2 212800 mark 2 CPUEND") for x in lines
    ]
    md = e2e.markdown(e2e.summarize(e2e.parse(noisy), st, 10), "c", "f")
    assert "the none runs among themselves: 5.120 to 6.400 MiB/s, 25.0% apart: more than" in md
    assert "cannot tell a cost of that size from noise" in md
    # without --corunner: no pace, no table
    st0 = dataclasses.replace(st, corunner_mib=0)
    s0 = e2e.summarize(e2e.parse(lines), st0, 10)
    assert s0["configs"]["none"]["corunner_mib_s"] is None
    assert "Co-runners" not in e2e.markdown(s0, "c", "f")


def test_bytes_identical_per_guest_when_mixed() -> None:
    """Mixed guests read different bytes from each other but each the same
    in every configuration; in lockstep all guests must agree."""
    lines = [f"E2E-GUEST {c} {g} GUEST-SUM s{g}" for c in ("ksm", "pageshare") for g in (1, 2)]
    for mixed, want in ((True, True), (False, False)):
        st = e2e.Settings(2, 384, 6144, 10, 1000, ["ksm", "pageshare"], "", "", 100, mixed=mixed)
        assert e2e.summarize(e2e.parse(lines), st, 10)["bytes_identical"] is want
    lines[-1] = "E2E-GUEST pageshare 2 GUEST-SUM wrong"
    assert not e2e.summarize(e2e.parse(lines), st, 10)["bytes_identical"]


def test_summary_huge_pages() -> None:
    """Guest RAM in transparent huge pages (the E2E-G column after
    unshared_never), summed over guests at the end of the workload and at
    the end; a sampler without the column reports nothing."""

    def g(t: int, guest: int, thp_kb: int) -> str:
        return _g("pageshare", t, guest, 10, 10) + " 0 0 0 0 0 0 " + str(thp_kb)

    lines = [
        "E2E-EV pageshare 0 begin filter=1",
        g(100, 1, 4096),
        g(100, 2, 2048),
        _h("pageshare", 100, 0, 0, 0, 0, 0),
        "E2E-EV pageshare 200 work-done",
        g(300, 1, 2048),
        g(300, 2, 0),
        _h("pageshare", 300, 0, 0, 0, 0, 0),
    ]
    st = e2e.Settings(2, 384, 6144, 10, 1000, ["pageshare"], "", "", 100)
    c = e2e.summarize(e2e.parse(lines), st, 10)["configs"]["pageshare"]
    assert c["anon_huge_mib_work_done"] == 6.0 and c["anon_huge_mib_end"] == 2.0
    old = [x if not x.startswith("E2E-G") else _g("pageshare", 100, 1, 10, 10) for x in lines]
    c = e2e.summarize(e2e.parse(old), st, 10)["configs"]["pageshare"]
    assert c["anon_huge_mib_end"] is None


def test_summary_host_huge_page_events(tmp_path: Path) -> None:
    """driver.sh's thp-begin and thp-end events: its thp_counters on a
    /proc/vmstat as the kernel writes it, and the summary's differences
    between them; a run without the events reports none."""
    driver = (REPO / "bench/e2e/driver.sh").read_text()
    func = driver[driver.index("thp_counters() {") : driver.index("run_config() {")]
    vmstat = tmp_path / "vmstat"
    vmstat.write_text(
        "nr_free_pages 100\nthp_fault_alloc 7\nthp_fault_fallback 1\n"
        "thp_collapse_alloc 2\nthp_split_page 3\nthp_split_page_failed 9\n"
        "thp_split_pmd 11\n"
    )
    out = subprocess.run(
        ["sh", "-c", func.replace("/proc/vmstat", str(vmstat)) + "thp_counters"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.split() == [
        "thp_fault_alloc=7",
        "thp_collapse_alloc=2",
        "thp_split_page=3",
        "thp_split_pmd=11",
    ]
    lines = [
        "E2E-EV pageshare 0 begin filter=1",
        f"E2E-EV pageshare 10 thp-begin {out.strip()}",
        _g("pageshare", 100, 1, 10, 10),
        _h("pageshare", 100, 0, 0, 0, 0, 0),
        "E2E-EV pageshare 200 work-done",
        "E2E-EV pageshare 300 thp-end thp_fault_alloc=9 thp_collapse_alloc=2 "
        "thp_split_page=3 thp_split_pmd=40 ",
        "E2E-EV pageshare 310 end",
    ]
    st = e2e.Settings(1, 384, 6144, 10, 1000, ["pageshare"], "", "", 100)
    s = e2e.summarize(e2e.parse(lines), st, 10)
    assert s["configs"]["pageshare"]["thp_events"] == {
        "collapse_alloc": 0,
        "fault_alloc": 2,
        "split_page": 0,
        "split_pmd": 29,
    }
    assert "| host's huge page PMDs split (thp_split_pmd) | 29 |" in e2e.markdown(s, "c", "f")
    old = [x for x in lines if " thp-" not in x]
    s = e2e.summarize(e2e.parse(old), st, 10)
    assert s["configs"]["pageshare"]["thp_events"] is None
    assert "| host's huge page PMDs split (thp_split_pmd) | - |" in e2e.markdown(s, "c", "f")
    assert "CONFIG_VM_EVENT_COUNTERS" not in e2e.markdown(s, "c", "f")
    # a kernel without VM event counters: the events are taken, and empty
    bare = [
        x.partition(" thp-begin ")[0] + " thp-begin "
        if " thp-begin " in x
        else x.partition(" thp-end ")[0] + " thp-end "
        if " thp-end " in x
        else x
        for x in lines
    ]
    s = e2e.summarize(e2e.parse(bare), st, 10)
    assert s["configs"]["pageshare"]["thp_events"] == {}
    md = e2e.markdown(s, "c", "f")
    assert "| host's huge page PMDs split (thp_split_pmd) | - |" in md
    assert "its kernel lacks CONFIG_VM_EVENT_COUNTERS" in md


def test_symbolize(tmp_path: Path) -> None:
    m = tmp_path / "System.map"
    m.write_text(
        "ffffffff81000000 T _text\nffffffff81000010 t spin\n"
        "ffffffff81000018 D data\nffffffff81000040 T next\n"
    )
    assert e2e.symbolize([0xFFFFFFFF81000014, 0xFFFFFFFF81000040, 0x10], m) == [
        "spin+0x4",
        "next+0x0",
        "0x10",
    ]


def test_list_workload_is_the_guests_grep() -> None:
    w = e2e.list_workload(e2e.GREP_DIRS)
    assert w == (
        "grep -r -q -F PAGESHARE-BENCH-NEVER-FOUND /usr/bin /usr/sbin "
        "/usr/lib/x86_64-linux-gnu /usr/lib/systemd /usr/lib/udev; true"
    )
    assert "PAGESHARE-BENCH-NEVER-FOUND" in (REPO / "bench/e2e/guest-init.sh").read_text()


def test_filter_counters_as_last_read() -> None:
    """A last sample whose QMP query failed (-1s) does not zero a guest's
    merges: its counters are the last ones read."""
    lines = [
        "E2E-EV pageshare 0 begin filter=1",
        _g("pageshare", 100, 1, 10, 10, merged=10, merge_ns=1000),
        _g("pageshare", 100, 2, 10, 10, merged=10, merge_ns=1000),
        _h("pageshare", 100, 0, 0, 0, 0, 0),
        "E2E-EV pageshare 200 work-done",
        _g("pageshare", 300, 1, 10, 10, merged=20, merge_ns=3000),
        _g("pageshare", 300, 2, 10, 10),
        _h("pageshare", 300, 0, 0, 0, 0, 0),
    ]
    st = e2e.Settings(2, 384, 6144, 10, 1000, ["pageshare"], "", "", 100)
    c = e2e.summarize(e2e.parse(lines), st, 10)["configs"]["pageshare"]
    assert c["filter_merged"] == 30
    assert c["filter_merge_s"] == pytest.approx(4000 / 1e9)


def test_server_cpu_across_a_restart_and_a_lost_server() -> None:
    """A counter that drops is a new server process (its CPU counts from 0);
    a sample of -1 (the sampler lost the killed server) makes the server's
    CPU unknown, not negative."""
    first = {"server_cpu_ms": 100}
    hs = [
        {"server_cpu_ms": 50},
        first,
        {"server_cpu_ms": 300},
        {"server_cpu_ms": 20},
        {"server_cpu_ms": 70},
    ]
    assert e2e.cpu_since(hs, first) == 200 + 20 + 50
    assert e2e.cpu_since([*hs, {"server_cpu_ms": -1}], first) is None
    assert e2e.cpu_since([{"server_cpu_ms": -1}, first, {"server_cpu_ms": 150}], first) == 50


RUNS = sorted(p.parent for p in (REPO / "bench/results").glob("e2e-*/summary.json")) + sorted(
    p.parent for p in (REPO / "bench/results").glob("feedback-*/round*/summary.json")
)


def test_a_run_is_recorded() -> None:
    assert RUNS, "no recorded run under bench/results/e2e-*/"


@pytest.mark.parametrize("run", RUNS, ids=[r.name for r in RUNS])
def test_recorded_run_parses_and_agrees_with_its_summary(run: Path) -> None:
    """Each committed run's raw serial log gives its committed summary."""
    lines = (
        gzip.decompress((run / "serial.log.gz").read_bytes()).decode(errors="replace").splitlines()
    )
    saved = json.loads((run / "summary.json").read_text())
    st = e2e.Settings(**saved["settings"])
    again = e2e.summarize(e2e.parse(lines), st, saved["listed_blocks"])
    assert again["configs"] == saved["configs"]
    assert saved["bytes_identical"]
    assert os.path.getsize(run / "samples_guest.csv") > 0


@pytest.mark.parametrize("run", RUNS, ids=[r.name for r in RUNS])
def test_notebook_plots_the_recorded_run(run: Path, tmp_path: Path) -> None:
    """notebooks/e2e_vs_ksm.ipynb runs headless on each recorded run and
    draws its three figures."""
    nb = execute(
        REPO / "notebooks/e2e_vs_ksm.ipynb",
        {"PAGESHARE_E2E_RESULTS": str(run), "PAGESHARE_FIGURES": str(tmp_path)},
        "e2e-kernel-",
    )
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors
    for name in ("shared_over_time", "pss_over_time", "cpu_per_gib"):
        png = tmp_path / f"e2e_{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    text = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))
    assert run.name in text


def test_notebook_reads_the_newest_finished_run_by_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without PAGESHARE_E2E_RESULTS the notebook takes the newest run whose
    configurations all finished, not one stopped part way (its stopped
    configurations carry an error), which a reader would take for the
    current comparison."""

    def finished(run: Path) -> bool:
        configs = json.loads((run / "summary.json").read_text())["configs"].values()
        return all("error" not in c for c in configs)

    stopped = [r for r in RUNS if not finished(r)]
    want = max(
        (r for r in RUNS if finished(r)), key=lambda r: (re.findall(r"\d{8}", r.name), r.name)
    )
    monkeypatch.delenv("PAGESHARE_E2E_RESULTS", raising=False)
    nb = execute(
        REPO / "notebooks/e2e_vs_ksm.ipynb", {"PAGESHARE_FIGURES": str(tmp_path)}, "e2e-kernel-"
    )
    text = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))
    assert want.name in text
    assert stopped and not [r.name for r in stopped if r.name in text], stopped


def test_share_lag_is_the_distance_between_held_and_shared() -> None:
    def s(t: int, listed: int, shared: int, full: int) -> dict[str, int]:
        return {"t_ms": t, "listed": listed, "listed_shared": shared, "full": full}

    series = {
        1: [s(1000, 100, 0, 1), s(2000, 100, 60, 0), s(3000, 100, 95, 0)],
        2: [s(1000, 0, 0, 1), s(2000, 0, 0, 0), s(3000, 0, 0, 0)],
    }
    assert e2e.share_lag(series, [1, 2], 1500) == (1.0, 2.0)
    # never shared: no lag to report
    never = {1: [s(1000, 100, 0, 1), s(2000, 100, 0, 0)]}
    assert e2e.share_lag(never, [1], 1500) == (None, None)
