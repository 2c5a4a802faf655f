"""The kernel images' cache key (ktestlib.kernel.tree_id): what a kernel is
built from, and nothing else.

The selftests under tools/testing/ are compiled into the guest's payload
when ktest runs, never into a bzImage or the kernel package, so an edit
there must not give every kernel config a new key (a rebuild of each on
the next run, and a cold one in a CI cache).  Every other path must.  The
test binaries' key (commands.binaries_key) must follow the selftests, or a
selftest edit would run the old binaries.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from pageshare_tools import ktestlib as ktest
from pageshare_tools.ktestlib.commands import binaries_key
from pageshare_tools.ktestlib.kernel import tree_id


def git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *ktest.GIT_ID, *args], cwd=repo, check=True, capture_output=True, text=True
    ).stdout.strip()


def commit_with(repo: Path, path: str, text: str) -> str:
    f = repo / path
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text(text)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", f"edit {path}")
    return git(repo, "rev-parse", "HEAD")


def test_only_the_selftests_are_left_out_of_the_key(tmp_path: Path) -> None:
    repo = tmp_path / "linux"
    repo.mkdir()
    git(repo, "init", "-q")
    for path in (
        "Makefile",
        "mm/ksm.c",
        "tools/testing/selftests/mm/merge_page_tests.c",
        "tools/lib/bitmap.c",
        "lib/testing/kunit.c",
    ):
        base = commit_with(repo, path, f"{path} v1\n")
    src = ktest.Source("6.12-test", repo, repo)
    key = tree_id(src, base)

    selftest = commit_with(repo, "tools/testing/selftests/mm/merge_page_tests.c", "v2\n")
    assert tree_id(src, selftest) == key
    new_selftest = commit_with(repo, "tools/testing/selftests/mm/another_test.c", "v1\n")
    assert tree_id(src, new_selftest) == key

    keys = {key}
    for path in ("mm/ksm.c", "tools/lib/bitmap.c", "lib/testing/kunit.c", "Makefile"):
        k = tree_id(src, commit_with(repo, path, f"{path} v2\n"))
        assert k not in keys, f"an edit of {path} left the key unchanged"
        keys.add(k)
    # a mode change is a change of what is built
    (repo / "Makefile").chmod(0o755)
    git(repo, "commit", "-q", "-am", "mode")
    assert tree_id(src, git(repo, "rev-parse", "HEAD")) not in keys


def test_a_selftest_edit_gives_the_test_binaries_a_new_key(tmp_path: Path) -> None:
    repo = tmp_path / "linux"
    repo.mkdir()
    git(repo, "init", "-q")
    commit_with(repo, "mm/ksm.c", "v1\n")
    base = commit_with(repo, "tools/testing/selftests/mm/merge_page_tests.c", "v1\n")
    src = ktest.Source("6.12-test", repo, repo)
    kdir = tmp_path / "debug-0123456789abcdef"
    key = binaries_key(src, base, kdir)
    assert binaries_key(src, base, kdir) == key
    edited = commit_with(repo, "tools/testing/selftests/mm/merge_page_tests.c", "v2\n")
    assert tree_id(src, edited) == tree_id(src, base)
    assert binaries_key(src, edited, kdir) != key
    assert binaries_key(src, base, tmp_path / "debug-fedcba9876543210") != key
