"""The drgn introspection backend: same records as crash + pagescan, and 6.12 guests.

The vm tests boot a real golden image once, dump its memory the way
analyze-image does, and classify every frame of the dump:

- on Debian 12 (6.1) with both backends, which must agree record by
  record: pagescan is the reference the drgn port is held to;
- on Debian 13 (6.12), which crash 8.0.x cannot open, with drgn alone,
  checked against what is known about the guest (its root file system,
  disk and partition) and against `choose_introspector`'s rule.
"""

import json
import mmap
import shutil
import sqlite3
import struct
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import fields
from pathlib import Path

import drgn
import pytest
from drgn.helpers.linux.mm import follow_phys
from package_root import Root
from pageshare import golden
from pageshare.analysis import crash_backend, drgn_backend
from pageshare.analysis.analyze import choose_introspector
from pageshare.analysis.classify import PageRecord
from pageshare.analysis.debugsyms import check_vmlinux, find_vmlinux
from pageshare.analysis.dump import ElfDump, parse_vmcoreinfo
from pageshare.analysis.resultsdb import connect
from pageshare.analysis.vm import BootSpec, Guest, choose_accel
from pageshare.analysis.workload import FW_CFG_NAME, Markers, Workload, kernel_cmdline, write_script
from pageshare.image.image_inspect import inspect_image, probe_format

# --- choosing the backend (fast) ---------------------------------------------


def test_auto_uses_crash_for_kernels_it_opens() -> None:
    name, why = choose_introspector("auto", "6.1.0-56-cloud-amd64", "crash 8.0.2")
    assert name == "crash" and "6.1.0-56-cloud-amd64" in why
    assert choose_introspector("auto", "6.10.3", "crash 8.0.6")[0] == "crash"


def test_auto_uses_drgn_for_kernels_crash_cannot_open() -> None:
    name, why = choose_introspector("auto", "6.12.117+deb13-cloud-amd64", "crash 8.0.2")
    assert name == "drgn"
    assert "6.12.117+deb13-cloud-amd64" in why and "crash 8.0.2" in why
    assert choose_introspector("auto", "6.11.0", "crash 8.0.6")[0] == "drgn"
    # 8.0.2 lacks the struct module_memory layout of 6.4.
    assert choose_introspector("auto", "6.5.0-1-amd64", "crash 8.0.2")[0] == "drgn"
    assert choose_introspector("auto", "6.1.0", None) == ("drgn", "auto: crash is not installed")
    assert choose_introspector("auto", "weird", "crash 8.0.2")[0] == "drgn"


def test_auto_trusts_crash_9_with_new_kernels() -> None:
    assert choose_introspector("auto", "6.12.117+deb13-cloud-amd64", "crash 9.0.0")[0] == "crash"


def test_explicit_choice_wins() -> None:
    assert choose_introspector("crash", "6.12.1", "crash 8.0.2") == (
        "crash",
        "requested with --introspector",
    )
    assert choose_introspector("drgn", "6.1.0", "crash 8.0.2")[0] == "drgn"
    with pytest.raises(ValueError):
        choose_introspector("gdb", "6.1.0", "crash 8.0.2")


def test_results_db_gains_the_introspector_column(tmp_path: Path) -> None:
    """A database made before the column existed is migrated by connect()."""
    path = tmp_path / "old.sqlite"
    old = sqlite3.connect(path)
    old.execute(
        "CREATE TABLE analysis (id INTEGER PRIMARY KEY, image_id INTEGER NOT NULL, "
        "started_at TEXT NOT NULL, status TEXT NOT NULL)"
    )
    old.execute("INSERT INTO analysis VALUES (1, 1, 'then', 'ok')")
    old.commit()
    old.close()
    for _ in range(2):  # and a second connect() leaves it alone
        db = connect(path)
        cols = [r[1] for r in db.execute("PRAGMA table_info(analysis)")]
        assert cols.count("introspector") == 1
        assert db.execute("SELECT status, introspector FROM analysis").fetchall() == [("ok", None)]
        db.close()
    fresh = connect(tmp_path / "new.sqlite")
    assert "introspector" in [r[1] for r in fresh.execute("PRAGMA table_info(analysis)")]
    fresh.close()


# --- real dumps ----------------------------------------------------------------


def _boot_and_dump(variant: str, tmp: Path) -> tuple[Path, Path, str]:
    """Boots the golden image once as analyze-image does (direct kernel boot, workload
    markers over fw_cfg, pause), dumps guest memory; returns (vmlinux, dump, osrelease)."""
    image = golden.build_image(variant).path
    fmt, vsize = probe_format(image)
    insp = inspect_image(image, fmt, vsize, tcg=True)
    vmlinux = find_vmlinux(insp.info.kernel_version, None)
    accel, _ = choose_accel("auto", insp.kernel)
    markers = Markers.new()
    script = write_script(tmp, Workload(), markers)
    boot = BootSpec(insp.kernel, insp.initrd, kernel_cmdline(insp.info.root_uuid))
    guest = Guest("D", tmp, image, fmt, boot, accel, 1024, {FW_CFG_NAME: script})
    dump = tmp / "guest.elf"
    guest.start()
    try:
        deadline = time.monotonic() + 900
        while markers.ready not in guest.serial_text():
            guest.check_alive()
            assert time.monotonic() < deadline, guest.serial_text()[-3000:]
            time.sleep(1)
        guest.stop_cpus()
        guest.dump(dump)
    finally:
        guest.shutdown()
    elf = ElfDump(dump)
    try:
        vmci = parse_vmcoreinfo(elf.vmcoreinfo() or "")
    finally:
        elf.close()
    check_vmlinux(vmlinux, vmci["BUILD-ID"])
    return vmlinux, dump, vmci["OSRELEASE"]


def _all_pfns(dump: Path) -> list[int]:
    elf = ElfDump(dump)
    try:
        return [p for s in elf.segments for p in range(s.paddr // 4096, (s.paddr + s.size) // 4096)]
    finally:
        elf.close()


@pytest.fixture(scope="module")
def dump_61(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path, str]]:
    tmp = tmp_path_factory.mktemp("drgn-61")
    yield _boot_and_dump("small", tmp)
    shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def dump_612(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path, str]]:
    tmp = tmp_path_factory.mktemp("drgn-612")
    yield _boot_and_dump("trixie", tmp)
    shutil.rmtree(tmp, ignore_errors=True)


def _diff(a: PageRecord | None, b: PageRecord | None) -> str:
    if a is None or b is None:
        return f"drgn {a} / crash {b}"
    return ", ".join(
        f"{f.name}: drgn {getattr(a, f.name)!r} crash {getattr(b, f.name)!r}"
        for f in fields(PageRecord)
        if getattr(a, f.name) != getattr(b, f.name)
    )


def _tail_pages(scanner: drgn_backend.Scanner, pfns: list[int]) -> int:
    n = 0
    for pfn in pfns:
        page = scanner._page_bytes(pfn) if scanner._has_page(pfn) else None
        if page and struct.unpack_from("<Q", page, scanner.o.page_compound_head)[0] & 1:
            n += 1
    return n


@pytest.mark.vm
def test_drgn_matches_crash_on_a_6_1_dump(dump_61: tuple[Path, Path, str], tmp_path: Path) -> None:
    vmlinux, dump, osrelease = dump_61
    assert osrelease.startswith("6.1.")
    # Every frame of the guest, plus PFNs beyond its RAM (nopage).
    pfns = [*_all_pfns(dump), 1 << 28, (1 << 34) + 5]
    t0 = time.monotonic()
    by_drgn = drgn_backend.classify_pfns(vmlinux, dump, pfns, tmp_path)
    t1 = time.monotonic()
    by_crash = crash_backend.classify_pfns(vmlinux, dump, pfns, tmp_path)
    t2 = time.monotonic()
    print(f"\n{len(pfns)} PFNs: drgn {t1 - t0:.1f}s, crash + pagescan {t2 - t1:.1f}s")

    assert set(by_drgn) == set(by_crash) == set(pfns)
    bad = [p for p in pfns if by_drgn[p] != by_crash[p]]
    assert not bad, f"{len(bad)} of {len(pfns)} records differ, e.g.:\n" + "\n".join(
        f"  pfn {p}: {_diff(by_drgn[p], by_crash[p])}" for p in bad[:20]
    )
    kinds = Counter(r.kind for r in by_crash.values())
    print(f"identical: {len(pfns)} records {dict(kinds)}")
    # The comparison covered what matters: lots of file pages with their
    # inode facts, metadata, anon and slab, and compound tails.
    assert kinds["file"] > 1000 and kinds["bdev"] > 0 and kinds["anon"] > 0
    assert kinds["slab"] > 0 and kinds["nopage"] >= 2
    assert {r.disk for r in by_crash.values() if r.kind == "file"} >= {"vda"}
    scanner = drgn_backend.Scanner(drgn_backend.open_dump(vmlinux, dump))
    assert _tail_pages(scanner, pfns) > 100
    assert choose_introspector("auto", osrelease, crash_backend.crash_version())[0] == "crash"


@pytest.mark.vm
def test_drgn_reads_a_dump_without_vmcoreinfo_note(
    dump_61: tuple[Path, Path, str], tmp_path: Path
) -> None:
    """Guests without qemu_fw_cfg give dumps without the note; ElfDump finds the
    text in guest memory and drgn must still treat the dump as a kernel."""
    vmlinux, dump, _ = dump_61
    bare = tmp_path / "bare.elf"
    subprocess.run(["cp", "--sparse=always", str(dump), str(bare)], check=True)
    elf = ElfDump(bare)
    notes = elf.notes
    elf.close()
    with bare.open("r+b") as f, mmap.mmap(f.fileno(), 0) as mm:
        renamed = 0
        for off, size in notes:
            at = mm.find(b"VMCOREINFO\0", off, off + size)
            if at >= 0:
                mm[at : at + 1] = b"X"
                renamed += 1
        assert renamed == 1
    pfns = _all_pfns(dump)[::17]
    assert drgn_backend.classify_pfns(vmlinux, bare, pfns, tmp_path) == drgn_backend.classify_pfns(
        vmlinux, dump, pfns, tmp_path
    )


def _corrupt_module_list(vmlinux: Path, dump: Path, out: Path) -> None:
    """Copies DUMP to OUT with its first loaded module half-written, as a dump
    taken while a module loads can hold it: the module's notes_attrs points at
    a table (in the module's own text, which nothing classified reads) whose
    one note claims 2^62 bytes.  drgn's module enumeration allocates that and
    fails with MemoryError."""
    prog = drgn_backend.open_dump(vmlinux, dump)
    init_mm = prog["init_mm"].address_of_()
    mod = drgn.container_of(prog["modules"].next, "struct module", "list")
    layout = mod.core_layout if hasattr(mod, "core_layout") else mod.mem[0]  # 6.1 / 6.4+
    text = layout.base.value_()
    notes_t = prog.type("struct module_notes_attrs")
    attr_t = prog.type("struct bin_attribute")
    elf = ElfDump(dump)
    segments = elf.segments
    elf.close()

    def file_offset(vaddr: int) -> int:
        phys = int(follow_phys(init_mm, vaddr))
        seg = next(s for s in segments if s.paddr <= phys < s.paddr + s.size)
        return seg.offset + phys - seg.paddr

    subprocess.run(["cp", "--sparse=always", str(dump), str(out)], check=True)
    with out.open("r+b") as f, mmap.mmap(f.fileno(), 0) as mm:
        table = file_offset(text)
        struct.pack_into("<I", mm, table + drgn.offsetof(notes_t, "notes"), 1)
        note = table + drgn.offsetof(notes_t, "attrs")
        struct.pack_into("<Q", mm, note + drgn.offsetof(attr_t, "size"), 1 << 62)
        struct.pack_into("<Q", mm, note + drgn.offsetof(attr_t, "private"), text)
        struct.pack_into(
            "<Q",
            mm,
            file_offset(mod.value_() + drgn.offsetof(prog.type("struct module"), "notes_attrs")),
            text,
        )


@pytest.mark.vm
def test_a_half_written_module_list_does_not_stop_either_backend(
    dump_61: tuple[Path, Path, str], tmp_path: Path
) -> None:
    """A dump that caught a module mid-load: drgn's full load_debug_info() dies
    on it, open_dump() does not need the module list, and both backends give
    the records they give on the intact dump."""
    vmlinux, dump, _ = dump_61
    bad = tmp_path / "bad-modules.elf"
    _corrupt_module_list(vmlinux, dump, bad)
    # The corruption is the one seen on fresh machines: enumerating the
    # modules, as load_debug_info() does, fails.
    full = drgn.Program()
    full.set_core_dump(str(bad))
    with pytest.raises(MemoryError):
        full.load_debug_info([str(vmlinux)])

    pfns = _all_pfns(dump)[::17]
    want = crash_backend.classify_pfns(vmlinux, dump, pfns, tmp_path)
    assert Counter(r.kind for r in want.values())["file"] > 100
    assert drgn_backend.classify_pfns(vmlinux, bad, pfns, tmp_path) == want
    assert crash_backend.classify_pfns(vmlinux, bad, pfns, tmp_path) == want


@pytest.mark.vm
def test_drgn_classifies_a_6_12_dump(dump_612: tuple[Path, Path, str], tmp_path: Path) -> None:
    vmlinux, dump, osrelease = dump_612
    manifest = golden.build_image("trixie").manifest
    assert osrelease == manifest["kernel_version"] and osrelease.startswith("6.12.")
    pfns = _all_pfns(dump)
    t0 = time.monotonic()
    recs = drgn_backend.classify_pfns(vmlinux, dump, pfns, tmp_path)
    print(f"\n{len(pfns)} PFNs of a 6.12 guest: drgn {time.monotonic() - t0:.1f}s")
    kinds = Counter(r.kind for r in recs.values())
    assert kinds["file"] > 1000 and kinds["bdev"] > 0 and kinds["anon"] > 0
    # 6.12 has no PG_slab: slab pages are found only through the page type.
    scanner = drgn_backend.Scanner(drgn_backend.open_dump(vmlinux, dump))
    assert scanner.o.pg_slab is None and scanner.o.pgty_slab is not None
    assert kinds["slab"] > 100
    # Everything the guest reads comes from its one disk, the image's root
    # file system at the image's partition offset.
    uuid = manifest["fs_uuid"].replace("-", "")
    files = [r for r in recs.values() if r.kind == "file"]
    ext4 = [r for r in files if r.fstype == "ext4"]
    assert len(ext4) == len(files)
    assert {(r.fs_uuid, r.disk, r.start_sect, r.blkbits) for r in ext4} == {
        (uuid, "vda", manifest["root_start_sector"], 12)
    }
    assert {r.fstype for r in recs.values() if r.kind == "bdev"} == {"bdev"}
    assert all(len(r.state) == 5 and r.state[0] in "U-" for r in files)

    # crash 8.0.x cannot open this dump, and auto knows it.
    chosen = choose_introspector("auto", osrelease, crash_backend.crash_version())[0]
    try:
        crash_backend.classify_pfns(vmlinux, dump, pfns[:1000], tmp_path, timeout=300)
        crash_ok = True
    except RuntimeError as e:
        print(f"crash on 6.12: {e}")
        crash_ok = False
    assert crash_ok or chosen == "drgn"


# --- the same, from the installed Debian package ------------------------------

# Runs with the root's /usr/bin/python3 and the package's modules: classifies
# PFNS of DUMP with BACKEND and writes the records as JSON lines to OUT.
PACKAGED_RUN = """\
import dataclasses, json, sys
from pathlib import Path
sys.path[:0] = ["/usr/lib/pageshare/python", "/usr/lib/pageshare/python{py}"]
from pageshare.analysis import {backend}, datafiles
assert datafiles.checkout() is None, "the package must not use a checkout"
pfns = [int(x) for x in Path("{work}/pfns").read_text().split()]
recs = {backend}.classify_pfns(Path("{vmlinux}"), Path("{dump}"), pfns, Path("{work}"))
with open("{work}/out.jsonl", "w") as f:
    for pfn, r in sorted(recs.items()):
        f.write(json.dumps([pfn, dataclasses.asdict(r)]) + "\\n")
"""


def run_packaged(
    root: Root, backend: str, py: str, vmlinux: Path, dump: Path, pfns: list[int], work: Path
) -> dict[int, PageRecord]:
    (work / "pfns").write_text("\n".join(map(str, pfns)))
    (work / "run.py").write_text(
        PACKAGED_RUN.format(py=py, backend=backend, work=work, vmlinux=vmlinux, dump=dump)
    )
    p = root.run(f"/usr/bin/python3 {work}/run.py", binds=(work, vmlinux.parent, dump.parent))
    assert p.returncode == 0, p.stdout + p.stderr
    out: dict[int, PageRecord] = {}
    for line in (work / "out.jsonl").read_text().splitlines():
        pfn, d = json.loads(line)
        out[pfn] = PageRecord(**d)
    return out


@pytest.mark.vm
def test_the_packaged_pagescan_classifies_as_the_checkout(
    dump_61: tuple[Path, Path, str], pageshare_root: Callable[[str], Root], tmp_path: Path
) -> None:
    """The crash extension the package built, run by the installed modules with
    Debian 12's crash in a fresh root, gives the checkout's records."""
    vmlinux, dump, _ = dump_61
    pfns = _all_pfns(dump)[::5]
    want = crash_backend.classify_pfns(vmlinux, dump, pfns, tmp_path)
    work = tmp_path / "packaged"
    work.mkdir()
    got = run_packaged(
        pageshare_root("bookworm"), "crash_backend", "3.11", vmlinux, dump, pfns, work
    )
    assert got == want
    assert Counter(r.kind for r in got.values())["file"] > 100


@pytest.mark.vm
def test_the_packaged_drgn_on_debian_13(
    dump_612: tuple[Path, Path, str], pageshare_root: Callable[[str], Root], tmp_path: Path
) -> None:
    """Debian 13: the package's drgn for Python 3.13 reads the 6.12 dump as the
    checkout's does; its crash extension, built for Debian 12's crash, is
    refused with a message rather than loaded into another crash."""
    vmlinux, dump, _ = dump_612
    pfns = _all_pfns(dump)[::5]
    want = drgn_backend.classify_pfns(vmlinux, dump, pfns, tmp_path)
    work = tmp_path / "packaged"
    work.mkdir()
    root = pageshare_root("trixie")
    got = run_packaged(root, "drgn_backend", "3.13", vmlinux, dump, pfns, work)
    assert got == want
    p = root.run(
        '/usr/bin/python3 -c \'import sys; sys.path[:0] = ["/usr/lib/pageshare/python"];'
        " from pageshare.analysis import datafiles; datafiles.pagescan_extension()'"
    )
    assert p.returncode != 0
    assert "was built for crash 8.0.2" in p.stderr and "--introspector drgn" in p.stderr, p.stderr
