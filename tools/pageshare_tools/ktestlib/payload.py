"""4b. the pageshare filter test's payload: the patched QEMU
(qemu-patches/build.py), pageshare-server (cargo), their shared libraries and
firmware, a random base image and its lists, the server configs and the
booted guest's kernel and initramfs, packed as a cpio appended to the
initramfs and cached by content."""

from __future__ import annotations

import hashlib
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pageshare_tools.cargo import cargo as find_cargo
from pageshare_tools.cargo import cargo_target_dir

from .common import REPO, KtestError, cpio_gz, log, nice_prefix, run

FILTER_TEST = "pageshare_filter_merge"
PAYLOAD_DIR = "/pageshare"
# Bump when the payload's layout or content recipe changes.
PAYLOAD_RECIPE = "3"
PAYLOAD_IMAGE_MIB = 8
PAYLOAD_SEED = 20261121
QEMU_BINARIES = ["qemu-system-x86_64", "qemu-img", "qemu-storage-daemon"]
QEMU_FIRMWARE = [
    "bios-256k.bin",
    "kvmvapic.bin",  # what -M pc -nodefaults loads
    "linuxboot_dma.bin",
]  # and -kernel (the booted guest)


# The booted guest of the test (a guest kernel reading through the filter in
# merge mode, nested under TCG): a small kernel of its own (config/guest.config:
# Debian's generic kernel took over 7 minutes to boot nested) and an init that
# reads the disk, checks what it read (again after the test migrated it to a
# second QEMU), writes a block and reads it back.
GUEST_READ_BLOCKS = 1024  # the listed part of the payload image (blocks 0-1023)
GUEST_WRITE_BLOCK = 5  # a listed block the guest overwrites with zeros
GUEST_INIT = r"""#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev
n=0; while [ ! -b /dev/vda ] && [ $n -lt 300 ]; do sleep 0.1; n=$((n+1)); done
up() { cut -d' ' -f1 /proc/uptime; }
# keep the disk open: the last close of a block device drops its page cache
exec 3</dev/vda
echo "GUEST-BOOTED $(up)"
# phase 1: the first half of the listed blocks, into the page cache
dd if=/dev/vda of=/dev/null bs=4096 count=__HALF__ 2>/dev/null
echo "GUEST-PHASE1 $(up)"
# the test restarts the page server now; it says go with a keypress
read -r -t 600 go
# phase 2: everything, then a checksum of what the guest holds
dd if=/dev/vda of=/dev/null bs=4096 count=__BLOCKS__ 2>/dev/null
sum=$(dd if=/dev/vda bs=4096 count=__BLOCKS__ 2>/dev/null | sha256sum)
echo "GUEST-SHA256 ${sum%% *}"
echo "GUEST-PHASE2 $(up)"
# the test migrates the guest to a second QEMU now and says go there: the
# checksum is then of the page cache pages the migration filled
read -r -t 600 go
sum=$(dd if=/dev/vda bs=4096 count=__BLOCKS__ 2>/dev/null | sha256sum)
echo "GUEST-MIGRATED ${sum%% *} $(up)"
read -r -t 600 go
# a write into a merged block, then the block read back from the disk
dd if=/dev/zero of=/dev/vda bs=4096 seek=__WBLOCK__ count=1 conv=fsync 2>/dev/null
echo 3 > /proc/sys/vm/drop_caches
sum=$(dd if=/dev/vda bs=4096 skip=__WBLOCK__ count=1 2>/dev/null | sha256sum)
echo "GUEST-WROTE ${sum%% *}"
read -r -t 600 go
echo "GUEST-DONE $(up)"
poweroff -f
"""


def build_guest_initramfs(root: Path, busybox: Path) -> Path:
    """The booted guest's initramfs: busybox and GUEST_INIT."""
    init = (
        GUEST_INIT.replace("__HALF__", str(GUEST_READ_BLOCKS // 2))
        .replace("__BLOCKS__", str(GUEST_READ_BLOCKS))
        .replace("__WBLOCK__", str(GUEST_WRITE_BLOCK))
    )
    with tempfile.TemporaryDirectory(prefix="ktest-guest-") as td:
        top = Path(td)
        for d in ("bin", "dev", "proc", "sys"):
            (top / d).mkdir(parents=True)
        shutil.copy2(busybox, top / "bin/busybox")
        (top / "init").write_text(init)
        (top / "init").chmod(0o755)
        out = root / "guest-initramfs.cpio.gz"
        out.write_bytes(cpio_gz(top))
    return out


def build_patched_qemu() -> Path:
    """qemu-patches/build.py (cached there; a warm run takes well under a second)."""
    log("QEMU with the pageshare series: qemu-patches/build.py")
    p = subprocess.run(
        [sys.executable, str(REPO / "qemu-patches/build.py")], stdout=subprocess.PIPE, text=True
    )
    lines = p.stdout.strip().splitlines()
    if p.returncode != 0 or not lines:
        raise KtestError(
            f"qemu-patches/build.py failed ({p.returncode}); the "
            f"{FILTER_TEST} test needs the patched QEMU (see qemu-patches/README.md)"
        )
    out = Path(lines[-1])
    for b in QEMU_BINARIES:
        if not (out / "bin" / b).exists():
            raise KtestError(f"qemu-patches/build.py printed {out}, which has no bin/{b}")
    return out


def build_page_server() -> Path:
    """cargo build --release of page-server/, into the tests' target directory."""
    cargo = find_cargo()
    if cargo is None:
        raise KtestError(
            f"cargo is not installed (scripts/install-deps.sh); the {FILTER_TEST} "
            "test needs pageshare-server"
        )
    target = cargo_target_dir()
    env = {
        **os.environ,
        "CARGO_TARGET_DIR": str(target),
        "PATH": f"{Path(cargo).parent}:{os.environ.get('PATH', '')}",
    }
    log("pageshare-server: cargo build --release")
    run(
        [*nice_prefix(), cargo, "build", "--release", "--locked", "--quiet"],
        cwd=REPO / "page-server",
        env=env,
        capture=True,
    )
    return target / "release/pageshare-server"


def shared_libs(binary: Path) -> list[Path]:
    """Every shared object binary loads (ldd on the host), the loader included."""
    p = run(["ldd", str(binary)], capture=True)
    libs = []
    for line in p.stdout.splitlines():
        m = re.search(r"(?:=>\s*)?(/\S+)\s+\(0x", line)
        if m:
            libs.append(Path(m.group(1)))
        elif "not found" in line:
            raise KtestError(f"{binary}: {line.strip()}")
    return libs


def write_pcsl(image: bytes, blocks: list[int], name: str) -> str:
    """A pcsl v1 list (lists/README.md) of the given 4 KiB blocks of image,
    written by the analyzer's own serialiser (standard library only too)."""
    from pageshare.lists import sectorlist

    sl = sectorlist.SectorList(
        image=sectorlist.ImageIdentity(len(image), hashlib.sha256(image).hexdigest(), name),
        blocks={b * 8: sectorlist.block_hash(image[b * 4096 : (b + 1) * 4096]) for b in blocks},
        generator="ktest.py",
        created="2026-01-01T00:00:00Z",
        criteria="every block < 1024 except each eighth (ktest payload)",
    )
    return sectorlist.dumps(sl)


SERVER_TOML = f"""# pageshare-server in the ktest VM (the {FILTER_TEST} test)
socket_dir = "/tmp/pageshare/run"
cache_dir = "/tmp/pageshare/cache"
metrics_listen = ""
host_name = "ktest"
qemu_storage_daemon = "{PAYLOAD_DIR}/bin/qemu-storage-daemon"

[[image]]
name = "base"
path = "{PAYLOAD_DIR}/base.raw"
format = "raw"
list_file = "{PAYLOAD_DIR}/base.pcsl"
"""

# A second server for the stalled-client case: its own sockets and cache, a
# list the test rewrites under /tmp, and a 1 s switch timeout, so that a
# client that hears nothing is given up on (its blocks released) at once.
STALL_SERVER_TOML = f"""# the {FILTER_TEST} test's stalled-client case
socket_dir = "/tmp/pageshare/run-stall"
cache_dir = "/tmp/pageshare/cache-stall"
metrics_listen = ""
host_name = "ktest-stall"
qemu_storage_daemon = "{PAYLOAD_DIR}/bin/qemu-storage-daemon"

[limits]
client_switch_timeout_secs = 1

[[image]]
name = "base"
path = "{PAYLOAD_DIR}/base.raw"
format = "raw"
list_file = "/tmp/pageshare/stall.pcsl"
"""


def build_filter_payload(root: Path, busybox: Path, guest_kernel: Path) -> Path:
    """A gzip'd cpio with the patched QEMU, pageshare-server, their shared
    libraries (at their host paths), firmware, a random raw base image, its
    list and a server config, all under PAYLOAD_DIR.  Appended to the
    initramfs (the kernel unpacks concatenated archives); cached by content."""
    qemu = build_patched_qemu()
    server = build_page_server()
    bins = [qemu / "bin" / b for b in QEMU_BINARIES] + [server]
    firmware = []
    for fw in QEMU_FIRMWARE:
        f = (qemu / "share/qemu" / fw).resolve()
        if not f.is_file():
            raise KtestError(f"firmware {fw} not found in {qemu}/share/qemu (seabios package)")
        firmware.append((fw, f))
    libs: dict[Path, Path] = {}
    for b in bins:
        for lib in shared_libs(b):
            libs[lib] = lib.resolve()
    h = hashlib.sha256(
        f"recipe={PAYLOAD_RECIPE} mib={PAYLOAD_IMAGE_MIB} seed={PAYLOAD_SEED}\n".encode()
    )
    h.update(SERVER_TOML.encode())
    h.update(STALL_SERVER_TOML.encode())
    h.update(GUEST_INIT.encode())
    for f in [*bins, *(f for _, f in firmware), *sorted(libs.values()), busybox, guest_kernel]:
        st = f.stat()
        h.update(f"{f}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    out = root / "payload" / f"filter-{h.hexdigest()[:16]}.cpio.gz"
    if out.exists():
        log(f"filter payload: cached {out}")
        return out
    t0 = time.monotonic()
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ktest-payload-") as td:
        top = Path(td)
        pd = top / PAYLOAD_DIR.lstrip("/")
        (pd / "bin").mkdir(parents=True)
        (pd / "share/qemu").mkdir(parents=True)
        for b in bins:
            # Stripped copies: the initramfs is unpacked into guest RAM.
            run(["strip", "-o", str(pd / "bin" / b.name), str(b)])
        for name, f in firmware:
            shutil.copy2(f, pd / "share/qemu" / name)
        for lib, real in libs.items():
            dst = top / str(lib).lstrip("/")
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(real, dst)
        image = random.Random(PAYLOAD_SEED).randbytes(PAYLOAD_IMAGE_MIB << 20)
        (pd / "base.raw").write_bytes(image)
        (pd / "guest").mkdir()
        initrd = build_guest_initramfs(top, busybox)
        shutil.copy2(guest_kernel, pd / "guest/vmlinuz")
        shutil.move(str(initrd), pd / "guest/initramfs.cpio.gz")
        head = image[: GUEST_READ_BLOCKS * 4096]
        (pd / "guest/expect").write_text(
            f"sha256 {hashlib.sha256(head).hexdigest()}\n"
            f"zero {hashlib.sha256(bytes(4096)).hexdigest()}\n"
        )
        blocks = [b for b in range(min(1024, len(image) // 4096)) if b % 8 != 7]
        (pd / "base.pcsl").write_text(write_pcsl(image, blocks, "base.raw"))
        (pd / "base-kept.pcsl").write_text(write_pcsl(image, blocks[::4], "base.raw"))
        (pd / "server.toml").write_text(SERVER_TOML)
        (pd / "server-stall.toml").write_text(STALL_SERVER_TOML)
        tmp = out.with_suffix(".tmp")
        tmp.write_bytes(cpio_gz(top))
        tmp.rename(out)
    log(
        f"filter payload: built {out} ({out.stat().st_size >> 20} MiB) "
        f"in {time.monotonic() - t0:.0f} s"
    )
    old = sorted(out.parent.glob("filter-*.cpio.gz"), key=lambda f: f.stat().st_mtime)[:-3]
    for f in old:
        f.unlink()
    return out
