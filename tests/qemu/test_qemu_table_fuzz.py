"""Fuzzing what a page server sends the pageshare filter.

qemu-patches/fuzz/table_fuzz.c is a libFuzzer target around the filter's
own block/pageshare-table.c (from the patched tree that build.py built):
the TABLE message and the table memfd.  Here it is built with ASan and
UBSan, its seed corpus is checked verdict by verdict (valid tables
accepted, the malformed shapes refused with the right reason), and then
it fuzzes for a fixed time; any crash, assertion, sanitizer report or
hang (-timeout) fails the test.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from qemu_helpers import BUILD_PY, REPO, SEED_VERDICTS, qemu_build

pytestmark = pytest.mark.build

FUZZ = REPO / "qemu-patches" / "fuzz"
FUZZ_SECONDS = 60


@pytest.fixture(scope="module")
def fuzzer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    qemu_build()
    if shutil.which("clang") is None:
        pytest.fail("clang is not installed (scripts/install-deps.sh)")
    p = subprocess.run(
        [sys.executable, str(BUILD_PY), "--worktree"], capture_output=True, text=True, check=True
    )
    src = Path(p.stdout.strip().splitlines()[-1]) / "src" / "block"
    assert (src / "pageshare-table.c").exists(), src
    out = tmp_path_factory.mktemp("fuzz") / "table_fuzz"
    subprocess.run(
        [
            "clang",
            "-g",
            "-O1",
            "-fsanitize=fuzzer,address,undefined",
            "-fno-sanitize-recover=all",
            "-I",
            str(FUZZ / "include"),
            "-I",
            str(src),
            str(src / "pageshare-table.c"),
            str(FUZZ / "table_fuzz.c"),
            "-o",
            str(out),
        ],
        check=True,
    )
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("corpus")
    subprocess.run([sys.executable, str(FUZZ / "make_seeds.py"), str(d)], check=True)
    return d


def test_seed_verdicts(fuzzer: Path, corpus: Path) -> None:
    seeds = sorted(corpus.glob("seed-*.bin"))
    p = subprocess.run(
        [str(fuzzer), *map(str, seeds)],
        capture_output=True,
        text=True,
        env={"PS_FUZZ_REPORT": "1", "PATH": "/usr/bin:/bin"},
        timeout=120,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    verdicts = dict(
        zip(
            (s.stem.removeprefix("seed-") for s in seeds),
            re.findall(r"^PS-FUZZ-VERDICT (.*)$", p.stderr, re.M),
            strict=True,
        )
    )
    assert verdicts == SEED_VERDICTS, verdicts


def test_fuzz(fuzzer: Path, corpus: Path, tmp_path: Path) -> None:
    work = tmp_path / "corpus"
    shutil.copytree(corpus, work)
    p = subprocess.run(
        [
            str(fuzzer),
            f"-max_total_time={FUZZ_SECONDS}",
            "-timeout=5",
            "-rss_limit_mb=2048",
            f"-artifact_prefix={tmp_path}/",
            str(work),
        ],
        capture_output=True,
        text=True,
        timeout=FUZZ_SECONDS + 300,
    )
    found = (
        sorted(tmp_path.glob("crash-*"))
        + sorted(tmp_path.glob("timeout-*"))
        + sorted(tmp_path.glob("oom-*"))
    )
    assert p.returncode == 0 and not found, f"{found}\n{p.stderr[-4000:]}"
    m = re.search(r"Done (\d+) runs", p.stderr)
    assert m and int(m.group(1)) > 10000, p.stderr[-2000:]
    print(p.stderr.strip().splitlines()[-1])
