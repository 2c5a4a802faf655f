"""Which guest frames host KSM merged: /proc/PID/pagemap and /proc/kpageflags.

A guest frame is merged across the pair when its host page has KPF_KSM and
the same host PFN backs a frame of the other VM.  KPF_KSM alone is not enough:
on a shared host a frame may be merged with some other process.  Reading
these files needs CAP_SYS_ADMIN (PFNs read as zero otherwise).
"""

import re
import struct
from array import array
from dataclasses import dataclass

from ..host.qmp import QMP

PAGE = 4096
PM_PRESENT = 1 << 63
PM_SWAP = 1 << 62
PFN_MASK = (1 << 55) - 1

KPF_ANON = 1 << 12
KPF_COMPOUND_HEAD = 1 << 15
KPF_COMPOUND_TAIL = 1 << 16
KPF_KSM = 1 << 21
KPF_THP = 1 << 22
KPF_ZERO_PAGE = 1 << 24


@dataclass(frozen=True)
class RamRange:
    gpa: int  # guest-physical start
    hva: int  # host virtual address of gpa in QEMU
    length: int


# "  0000000000100000-000000003fffffff (prio 0, ram): pc.ram @0000000000100000"
_MTREE_RAM = re.compile(
    r"^\s*([0-9a-f]+)-([0-9a-f]+) \(prio [-\d]+, ram\): (\S+)(?: @([0-9a-f]+))?", re.M
)


def parse_mtree_ram(text: str, block: str) -> list[tuple[int, int, int]]:
    """(gpa, length, ramblock offset) of each flat-view range of RAMBlock `block`.

    Only the "memory" address space counts; the same RAM also shows up in
    I/O and per-device address spaces of `info mtree -f`.
    """
    spaces = re.split(r"^FlatView #\d+\n", text, flags=re.M)
    for space in spaces:
        if not re.search(r'AS "memory"', space):
            continue
        out = []
        for m in _MTREE_RAM.finditer(space):
            if m.group(3) != block:
                continue
            start, end = int(m.group(1), 16), int(m.group(2), 16)
            off = int(m.group(4), 16) if m.group(4) else 0
            out.append((start, end - start + 1, off))
        return out
    return []


def ram_ranges(qmp: QMP, block: str = "pc.ram") -> list[RamRange]:
    """Guest RAM as host virtual address ranges, from QEMU's own view.

    One RAMBlock is one contiguous host mapping, so a single gpa2hva of
    offset 0 anchors all flat-view ranges of that block.
    """
    ranges = parse_mtree_ram(qmp.hmp("info mtree -f"), block)
    if not ranges:
        raise RuntimeError(f"RAMBlock {block} not found in 'info mtree -f'")
    first_gpa, _, first_off = ranges[0]
    reply = qmp.hmp(f"gpa2hva 0x{first_gpa:x}")
    m = re.search(r"is (0x[0-9a-f]+)", reply)
    if not m:
        raise RuntimeError(f"unexpected gpa2hva reply: {reply!r}")
    base = int(m.group(1), 16) - first_off
    return [RamRange(gpa, base + off, ln) for gpa, ln, off in ranges]


@dataclass
class HostView:
    """Per guest frame number: host PFN (0 = not present) and kpageflags."""

    gpfns: array  # type: ignore[type-arg]
    pfns: array  # type: ignore[type-arg]
    flags: array  # type: ignore[type-arg]

    def present(self) -> int:
        return sum(1 for p in self.pfns if p)


def snapshot(pid: int, ranges: list[RamRange]) -> HostView:
    gpfns, pfns, flags = array("Q"), array("Q"), array("Q")
    with (
        open(f"/proc/{pid}/pagemap", "rb", buffering=0) as pm,
        open("/proc/kpageflags", "rb", buffering=0) as kf,
    ):
        for r in ranges:
            n = r.length // PAGE
            pm.seek((r.hva // PAGE) * 8)
            raw = pm.read(n * 8)
            entries = struct.unpack(f"<{len(raw) // 8}Q", raw)
            base = r.gpa // PAGE
            for i, e in enumerate(entries):
                if not e & PM_PRESENT or e & PM_SWAP:
                    continue
                pfn = e & PFN_MASK
                if pfn == 0:
                    raise PermissionError("pagemap shows no PFNs: reading it needs root")
                kf.seek(pfn * 8)
                (fl,) = struct.unpack("<Q", kf.read(8))
                gpfns.append(base + i)
                pfns.append(pfn)
                flags.append(fl)
    return HostView(gpfns, pfns, flags)


@dataclass
class MergeClass:
    cross: dict[int, int]  # gpfn -> host pfn, KSM page shared with the other VM
    intra: dict[int, int]  # KSM page mapped only by this VM (or other processes)
    zero: set[int]  # mapped to the shared zero page
    present: int


def classify_pair(a: HostView, b: HostView) -> tuple[MergeClass, MergeClass]:
    def ksm_pfns(v: HostView) -> set[int]:
        return {p for p, f in zip(v.pfns, v.flags, strict=True) if f & KPF_KSM}

    ka, kb = ksm_pfns(a), ksm_pfns(b)

    def one(v: HostView, other: set[int]) -> MergeClass:
        cross: dict[int, int] = {}
        intra: dict[int, int] = {}
        zero: set[int] = set()
        for g, p, f in zip(v.gpfns, v.pfns, v.flags, strict=True):
            if f & KPF_ZERO_PAGE:
                zero.add(g)
            elif f & KPF_KSM:
                (cross if p in other else intra)[g] = p
        return MergeClass(cross, intra, zero, len(v.gpfns))

    return one(a, kb), one(b, ka)
