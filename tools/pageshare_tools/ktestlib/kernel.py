"""3. kernel: the config fragments (tinyconfig + config/*.config, each option
verified) and the bzImage builds, cached by (source tree, fragments, recipe)."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import time
from pathlib import Path

from .common import CONFIGS, KtestError, cache_root, jobs, log, nice_prefix, run
from .series import apply_series, checkout_tree
from .source import Source

# Bump when the way a kernel is configured or built changes, so that cached
# images built the old way are not reused.
BUILD_RECIPE = "3"
# The configs that are not test kernels (config_fragments()).
GUEST_CONFIG = "guest"  # config/guest.config: the booted guest's kernel
BENCH_GUEST_CONFIG = "guest-bench"  # + config/guest-bench.config: bench/e2e_vs_ksm.py's


def config_fragments(config: str) -> list[Path]:
    # the booted guest's kernel is not a test kernel: tinyconfig + its own
    if config == GUEST_CONFIG:
        frags = [CONFIGS / "guest.config"]
    elif config == BENCH_GUEST_CONFIG:
        frags = [CONFIGS / "guest.config", CONFIGS / "guest-bench.config"]
    else:
        frags = [CONFIGS / "base.config", CONFIGS / f"{config}.config"]
    for f in frags:
        if not f.exists():
            raise KtestError(f"no config fragment {f}")
    return frags


def parse_fragment(path: Path) -> dict[str, str]:
    want: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        m = re.match(r"^(CONFIG_\w+)=(.*)$", line)
        if m:
            want[m.group(1)] = m.group(2)
        m = re.match(r"^# (CONFIG_\w+) is not set$", line)
        if m:
            want[m.group(1)] = "n"
    return want


# Parts of the tree no kernel image is built from: the selftests, which
# ktest compiles into the guest's payload at run time.  Left out of
# tree_id(), so a selftest edit does not give every kernel config (and the
# kernel package) a new key and a rebuild; the test binaries' key takes
# them in instead (selftests_id(), commands.binaries_key).
NOT_BUILT_IN = "tools/testing"


def tree_id(src: Source, commit: str) -> str:
    """Hash of the tree at commit without NOT_BUILT_IN: the `git ls-tree`
    entries (mode, type, object id, name) of each directory on its path,
    with the path's own entry dropped."""
    h = hashlib.sha256()
    parts = NOT_BUILT_IN.split("/")
    for depth, name in enumerate(parts):
        where = "/".join(parts[:depth])
        listing = run(
            ["git", "ls-tree", "-z", f"{commit}:{where}"], cwd=src.repo, capture=True
        ).stdout
        below = False
        for entry in filter(None, listing.split("\0")):
            meta, entry_name = entry.split("\t", 1)
            is_tree = meta.split()[1] == "tree"
            if entry_name == name and (is_tree or depth == len(parts) - 1):
                below = is_tree  # listed at the next depth, or left out at the last
                continue
            h.update(f"{where}/{entry}\n".encode())
        if not below:  # a tree without the path: all of it is hashed
            break
    return h.hexdigest()


def selftests_id(src: Source, commit: str) -> str:
    """The git tree id of NOT_BUILT_IN at commit: what the test binaries'
    key (commands.binaries_key) takes from the tree, which tree_id() leaves
    out."""
    return run(
        ["git", "rev-parse", f"{commit}:{NOT_BUILT_IN}"], cwd=src.repo, capture=True
    ).stdout.strip()


def image_key(src: Source, commit: str, config: str) -> str:
    """Hash of what the kernel is built from: the source tree after the series
    without its selftests (tree_id: so a reworded commit message or a
    selftest edit does not cause a rebuild), the config
    fragments and the build recipe."""
    h = hashlib.sha256()
    h.update(f"recipe={BUILD_RECIPE}\nsource={src.key}\nconfig={config}\n".encode())
    h.update(tree_id(src, commit).encode())
    for f in config_fragments(config):
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def make(
    src: Source, build: Path, *targets: str, logfile: Path, extra: list[str] | None = None
) -> None:
    cmd = [
        *nice_prefix(),
        "make",
        "-C",
        str(src.tree),
        f"O={build}",
        "ARCH=x86_64",
        f"-j{jobs()}",
        *(extra or []),
        *targets,
    ]
    run(cmd, logfile=logfile)


def configure(src: Source, build: Path, config: str, logfile: Path) -> None:
    frags = config_fragments(config)
    make(src, build, "tinyconfig", logfile=logfile)
    run(
        [
            str(src.tree / "scripts/kconfig/merge_config.sh"),
            "-m",
            "-O",
            str(build),
            str(build / ".config"),
            *map(str, frags),
        ],
        cwd=build,
        logfile=logfile,
    )
    make(src, build, "olddefconfig", logfile=logfile)
    have: dict[str, str] = {}
    for line in (build / ".config").read_text().splitlines():
        m = re.match(r"^(CONFIG_\w+)=(.*)$", line)
        if m:
            have[m.group(1)] = m.group(2)
    bad = []
    for f in frags:
        for k, v in parse_fragment(f).items():
            got = have.get(k, "n")
            if got != v:
                bad.append(f"{k}={v} (got {got}) from {f.name}")
    if bad:
        raise KtestError(
            "config options did not stick (missing dependency?):\n  " + "\n  ".join(bad)
        )


def build_kernel(src: Source, commit: str, config: str, outdir: Path, logfile: Path) -> float:
    """Configure and build bzImage + uapi headers at commit; return seconds spent."""
    t0 = time.monotonic()
    build = cache_root() / "build" / f"{src.key}-{config}"
    build.mkdir(parents=True, exist_ok=True)
    checkout_tree(src, commit)
    configure(src, build, config, logfile)
    make(src, build, "bzImage", logfile=logfile)
    hdr = outdir / "headers"
    if hdr.exists():
        shutil.rmtree(hdr)
    make(src, build, "headers_install", logfile=logfile, extra=[f"INSTALL_HDR_PATH={hdr}"])
    shutil.copy2(build / "arch/x86/boot/bzImage", outdir / "bzImage")
    shutil.copy2(build / ".config", outdir / "config")
    shutil.copy2(build / "System.map", outdir / "System.map")
    return time.monotonic() - t0


def ensure_kernel(src: Source, patches: list[Path], config: str) -> Path:
    commits = apply_series(src, patches)
    key = image_key(src, commits[-1], config)
    outdir = cache_root() / "images" / f"{config}-{key}"
    meta = outdir / "meta.json"
    if meta.exists() and (outdir / "bzImage").exists():
        m = json.loads(meta.read_text())
        log(
            f"kernel {config}: cached {outdir} (built in {m['build_seconds']:.0f} s "
            f"on {m['built_at']}); no rebuild"
        )
        return outdir
    tmp = outdir.with_name(outdir.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    logfile = tmp / "build.log"
    log(f"kernel {config}: building {len(patches)} patches on {src.key} (log: {outdir}/build.log)")
    secs = build_kernel(src, commits[-1], config, tmp, logfile)
    (tmp / "meta.json").write_text(
        json.dumps(
            {
                "build_seconds": secs,
                "built_at": time.strftime("%Y-%m-%d %H:%M:%S"),
                "source": src.key,
                "series": [p.name for p in patches],
                "commit": commits[-1],
                "config": config,
                "jobs": jobs(),
            },
            indent=1,
        )
    )
    if outdir.exists():
        shutil.rmtree(outdir)
    tmp.rename(outdir)
    log(f"kernel {config}: built in {secs:.0f} s -> {outdir}/bzImage")
    return outdir
