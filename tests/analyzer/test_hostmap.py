"""Host view: QEMU memory tree parsing and cross-VM merge classification."""

from array import array

from pageshare.analysis.hostmap import (
    KPF_KSM,
    KPF_ZERO_PAGE,
    HostView,
    classify_pair,
    parse_mtree_ram,
)

MTREE = """FlatView #0
 AS "I/O", root: io
 Root memory region: io
  0000000000000000-0000000000000007 (prio 0, i/o): dma-chan

FlatView #1
 AS "memory", root: system
 AS "cpu-memory-0", root: system
 Root memory region: system
  0000000000000000-000000000009ffff (prio 0, ram): pc.ram
  00000000000a0000-00000000000bffff (prio 1, i/o): vga-lowmem
  00000000000c0000-00000000000dffff (prio 1, rom): pc.rom
  00000000000e0000-00000000000fffff (prio 1, rom): isa-bios
  0000000000100000-000000003fffffff (prio 0, ram): pc.ram @0000000000100000
  00000000feffc000-00000000feffffff (prio 0, ram): vga.vram

FlatView #2
 AS "pci-dev", root: bus master container
  0000000000000000-000000003fffffff (prio 0, ram): pc.ram
"""


def test_mtree_memory_space_only() -> None:
    assert parse_mtree_ram(MTREE, "pc.ram") == [(0, 0xA0000, 0), (0x100000, 0x3FF00000, 0x100000)]
    assert parse_mtree_ram(MTREE, "nope") == []


def view(entries: list[tuple[int, int, int]]) -> HostView:
    return HostView(
        array("Q", [e[0] for e in entries]),
        array("Q", [e[1] for e in entries]),
        array("Q", [e[2] for e in entries]),
    )


def test_cross_intra_zero() -> None:
    a = view([(1, 100, KPF_KSM), (2, 200, KPF_KSM), (3, 300, 0), (4, 5, KPF_ZERO_PAGE)])
    b = view([(7, 100, KPF_KSM), (8, 999, KPF_KSM), (9, 300, 0)])
    ma, mb = classify_pair(a, b)
    assert ma.cross == {1: 100} and ma.intra == {2: 200} and ma.zero == {4}
    assert mb.cross == {7: 100} and mb.intra == {8: 999} and mb.zero == set()
    # same PFN without KPF_KSM (not a KSM page) is never "merged"
    assert 3 not in ma.cross and 9 not in mb.cross
