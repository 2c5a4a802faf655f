"""ELF dump reading (VMCOREINFO note, memory fallback) and the workload script."""

import struct
from pathlib import Path

from pageshare.analysis.dump import ElfDump, parse_vmcoreinfo
from pageshare.analysis.workload import Markers, Workload, kernel_cmdline, script

VMCI = (
    "OSRELEASE=6.1.0-56-cloud-amd64\nBUILD-ID=" + "ab" * 20 + "\nPAGESIZE=4096\n"
    "KERNELOFFSET=2a000000\n"
)


def make_elf(path: Path, pages: dict[int, bytes], note: bool, paddr: int = 0x1000) -> None:
    """A minimal QEMU-like ELF64 core: optional VMCOREINFO note + one PT_LOAD."""
    ram = bytearray(4 * 4096)
    for pfn, data in pages.items():
        off = pfn * 4096 - paddr
        ram[off : off + 4096] = data
    phnum = 2 if note else 1
    phoff = 64
    data_off = phoff + 56 * phnum
    notes = b""
    if note:
        name, desc = b"VMCOREINFO\0", VMCI.encode()
        notes = (
            struct.pack("<III", len(name), len(desc), 0)
            + name.ljust(12, b"\0")
            + desc.ljust((len(desc) + 3) & ~3, b"\0")
        )
    load_off = data_off + len(notes)
    hdr = (
        b"\x7fELF\x02\x01\x01"
        + bytes(9)
        + struct.pack("<HHIQQQIHHHHHH", 4, 62, 1, 0, phoff, 0, 0, 64, 56, phnum, 0, 0, 0)
    )
    ph = b""
    if note:
        ph += struct.pack("<IIQQQQQQ", 4, 0, data_off, 0, 0, len(notes), len(notes), 0)
    ph += struct.pack("<IIQQQQQQ", 1, 0, load_off, 0, paddr, len(ram), len(ram), 0)
    path.write_bytes(hdr + ph + notes + bytes(ram))


def test_pages_by_guest_physical_address(tmp_path: Path) -> None:
    p = tmp_path / "d.elf"
    make_elf(p, {2: b"\x11" * 4096, 4: b"\x22" * 4096}, note=True)
    d = ElfDump(p)
    try:
        assert d.page(2) == b"\x11" * 4096
        assert d.page(4) == b"\x22" * 4096
        assert d.page(0) is None and d.page(5) is None  # outside the PT_LOAD
        vmci = parse_vmcoreinfo(d.vmcoreinfo() or "")
        assert vmci["OSRELEASE"] == "6.1.0-56-cloud-amd64" and vmci["BUILD-ID"] == "ab" * 20
    finally:
        d.close()


def test_vmcoreinfo_found_in_memory_without_note(tmp_path: Path) -> None:
    p = tmp_path / "d.elf"
    make_elf(p, {3: VMCI.encode().ljust(4096, b"\0")}, note=False)
    d = ElfDump(p)
    try:
        assert parse_vmcoreinfo(d.vmcoreinfo() or "")["KERNELOFFSET"] == "2a000000"
    finally:
        d.close()


def test_workload_script_and_cmdline() -> None:
    m = Markers("cafe0001")
    s = script(Workload("nginx -t"), m)
    assert s.index("is-system-running --wait") < s.index("nginx -t") < s.index(m.ready)
    assert "PAGESHARE-READY-cafe0001 rc=$rc" in s
    assert "rc=0" in script(Workload(), m)
    cmd = kernel_cmdline("1234-5678")
    assert "root=UUID=1234-5678" in cmd and "modules_load=qemu_fw_cfg" in cmd
    assert 'systemd.run="/usr/bin/systemd-run --no-block' in cmd
    assert "systemd.run_success_action=none" in cmd
