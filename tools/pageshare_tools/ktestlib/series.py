"""2. series: patches/ applied on the source's "base" tag with git am (the
commit after each patch, memoised) and the build tree checked out."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from .common import GIT_ID, PATCHES, KtestError, run
from .source import Source

# Author of the series (and of its cover letter).
AUTHOR = ("Pageshare Developers", "dev@pageshare.example")


def series_files() -> list[Path]:
    return sorted(p for p in PATCHES.glob("*.patch") if not p.name.startswith("0000-"))


def series_hash(patches: list[Path]) -> str:
    h = hashlib.sha256()
    for p in patches:
        h.update(p.name.encode() + b"\0")
        h.update(p.read_bytes())
    return h.hexdigest()


def apply_series(src: Source, patches: list[Path]) -> list[str]:
    """git am the series on top of base; return the commit after each patch."""
    memo = src.repo.parent / "series-commits.json"
    data: dict[str, list[str]] = json.loads(memo.read_text()) if memo.exists() else {}
    key = series_hash(patches)
    commits = data.get(key)
    if commits and all(
        run(
            ["git", "cat-file", "-e", c + "^{commit}"], cwd=src.repo, check=False, capture=True
        ).returncode
        == 0
        for c in commits
    ):
        return commits
    run(["git", *GIT_ID, "am", "--abort"], cwd=src.repo, check=False, capture=True)
    run(["git", *GIT_ID, "checkout", "-q", "-f", "--detach", "base"], cwd=src.repo)
    commits = []
    for p in patches:
        r = run(
            ["git", *GIT_ID, "am", "-q", "--keep-cr", str(p)],
            cwd=src.repo,
            check=False,
            capture=True,
        )
        if r.returncode != 0:
            run(["git", *GIT_ID, "am", "--abort"], cwd=src.repo, check=False, capture=True)
            raise KtestError(f"{p.name} does not apply:\n{r.stdout}{r.stderr}")
        commits.append(run(["git", "rev-parse", "HEAD"], cwd=src.repo, capture=True).stdout.strip())
    if not commits:
        commits = [run(["git", "rev-parse", "base"], cwd=src.repo, capture=True).stdout.strip()]
    data[key] = commits
    memo.write_text(json.dumps(data, indent=1))
    return commits


def checkout_tree(src: Source, commit: str) -> None:
    """Point the build tree at commit.  git touches only files that differ,
    so an incremental build recompiles only what the change affects."""
    run(["git", *GIT_ID, "checkout", "-q", "-f", "--detach", commit], cwd=src.tree)
    run(["git", "clean", "-q", "-f", "-d"], cwd=src.tree)
