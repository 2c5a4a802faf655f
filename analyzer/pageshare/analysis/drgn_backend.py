"""Classifying guest page frames with drgn, for kernels the installed crash cannot open.

crash 8.0.x (Debian 12's and 13's) fails on 6.11+ dumps (crash issue #194;
fixed in crash 9.0), so Debian 13 guests (6.12) need another reader.  drgn
(PyPI wheel) opens QEMU's ELF dumps natively and reads the DWARF of the same
vmlinux.  This module is a port of crash-ext/pagescan.c: the same kinds, the
same fields and the same corner cases, so that analyze.py and the results DB
cannot tell which backend produced a record.  tests/analyzer/test_drgn_backend.py
holds the two backends to that on a real 6.1 dump.

Speed: going through drgn.Object for every field costs microseconds per
attribute, so struct page is read as bytes and unpacked at offsets taken
once from the debug info, and everything per inode (super block, block
device, strings) is read once and cached, as pagescan does.
"""

import struct
from dataclasses import dataclass, replace
from pathlib import Path

import drgn

from ..errors import UserError
from .classify import PageRecord
from .dump import ElfDump

ULONG_MASK = (1 << 64) - 1
# Widths of the C buffers pagescan reads strings into (minus their NUL), so
# that over-long names are cut exactly where pagescan cuts them.
FSTYPE_MAX = 15
DISK_NAME_MAX = 31
# crash's pfn_to_map() tests this bit of mem_section::section_mem_map
# (SECTION_HAS_MEM_MAP); it is used when the enum is not in the debug info.
SECTION_HAS_MEM_MAP_BIT = 1
# struct pages read per drgn call: 64 x 64 bytes = one page of the vmemmap.
PAGES_PER_READ = 64


def open_dump(vmlinux: Path, dump: Path) -> drgn.Program:
    """A drgn Program over a QEMU ELF dump, with the vmlinux's types and symbols.

    VMCOREINFO is read with our own ElfDump, which falls back to finding it
    in guest memory; passing it to the Program makes drgn treat the ELF as a
    kernel core even when QEMU wrote no VMCOREINFO note (guest without the
    qemu_fw_cfg driver).
    """
    elf = ElfDump(dump)
    try:
        vmcoreinfo = elf.vmcoreinfo()
    finally:
        elf.close()
    if vmcoreinfo is None:
        raise UserError(
            f"{dump.name}: no VMCOREINFO in the dump or guest memory",
            "the guest kernel must be built with CONFIG_CRASH_CORE",
        )
    prog = drgn.Program(vmcoreinfo=vmcoreinfo.encode())
    prog.set_core_dump(str(dump))
    if not prog.flags & drgn.ProgramFlags.IS_LINUX_KERNEL:
        raise RuntimeError(f"drgn does not see a Linux kernel in {dump}")
    load_kernel_debug_info(prog, vmlinux, dump)
    return prog


def load_kernel_debug_info(prog: drgn.Program, vmlinux: Path, dump: Path) -> None:
    """Loads the kernel's own types and symbols from @vmlinux, and nothing else.

    The analysis needs struct page, inodes, super blocks and block devices,
    all in vmlinux.  drgn's load_debug_info() would also walk the guest's
    module list to find the modules' files, and a dump taken while a module
    was being loaded or unloaded holds a half-written entry: drgn then
    allocates what a garbage size says and fails with MemoryError (or reads
    unmapped addresses).  So take only the first module loaded_modules()
    yields, which is always vmlinux (drgn makes it from VMCOREINFO, with
    its KASLR offset and build-id, before it reads the list), and never ask
    for the next.  Only the given file is tried (no debuginfod, no
    /usr/lib/debug); drgn refuses it when its build-id is not the dump's
    kernel.
    """
    kernel, _ = next(iter(prog.loaded_modules()))
    if not isinstance(kernel, drgn.MainModule):
        raise RuntimeError(f"drgn did not start with the kernel in {dump}: {kernel.name}")
    kernel.try_file(str(vmlinux))
    if not kernel.debug_file_path:
        raise UserError(
            f"drgn could not use {vmlinux} for {dump.name}: not the debug info "
            "of the kernel in the dump",
            "give the DWARF vmlinux of the exact kernel build the guest runs",
        )


def _offset(prog: drgn.Program, type_name: str, member: str) -> int | None:
    """Offset of a member (also inside anonymous unions), None if the kernel lacks it."""
    try:
        return int(drgn.offsetof(prog.type(type_name), member))
    except LookupError:
        return None


def _enum(prog: drgn.Program, name: str) -> int | None:
    try:
        return int(prog.constant(name).value_())
    except LookupError:
        return None


@dataclass(frozen=True)
class Layout:
    """Offsets and flag numbers from the guest kernel's debug info (pagescan's `o`)."""

    page_size: int
    page_flags: int
    page_mapping: int
    page_index: int
    page_compound_head: int
    page_type: int | None
    as_host: int
    inode_ino: int
    inode_sb: int
    inode_mapping: int
    inode_size: int | None
    inode_blkbits: int | None
    sb_dev: int | None
    sb_bdev: int | None
    sb_type: int | None
    sb_uuid: int | None
    fstype_name: int | None
    bdev_dev: int | None
    bdev_start_sect: int | None
    bdev_disk: int | None
    disk_name: int | None
    bdev_inode_vfs_inode: int | None
    pg_locked: int | None
    pg_uptodate: int | None
    pg_dirty: int | None
    pg_writeback: int | None
    pg_swapbacked: int | None
    pg_slab: int | None  # a page flag on 6.1
    pg_private: int | None
    pgty_slab: int | None  # 6.12: slab is a page type, not a flag

    @staticmethod
    def of(prog: drgn.Program) -> "Layout":
        def off(t: str, m: str) -> int | None:
            return _offset(prog, f"struct {t}", m)

        required = {
            "page_flags": off("page", "flags"),
            "page_mapping": off("page", "mapping"),
            "page_index": off("page", "index"),
            "page_compound_head": off("page", "compound_head"),
            "as_host": off("address_space", "host"),
            "inode_ino": off("inode", "i_ino"),
            "inode_sb": off("inode", "i_sb"),
            "inode_mapping": off("inode", "i_mapping"),
        }
        missing = [k for k, v in required.items() if v is None]
        if missing:
            raise RuntimeError(f"struct page/inode layout not found in debug info: {missing}")
        return Layout(
            page_size=prog.type("struct page").size or 0,
            page_flags=required["page_flags"] or 0,
            page_mapping=required["page_mapping"] or 0,
            page_index=required["page_index"] or 0,
            page_compound_head=required["page_compound_head"] or 0,
            page_type=off("page", "page_type"),
            as_host=required["as_host"] or 0,
            inode_ino=required["inode_ino"] or 0,
            inode_sb=required["inode_sb"] or 0,
            inode_mapping=required["inode_mapping"] or 0,
            inode_size=off("inode", "i_size"),
            inode_blkbits=off("inode", "i_blkbits"),
            sb_dev=off("super_block", "s_dev"),
            sb_bdev=off("super_block", "s_bdev"),
            sb_type=off("super_block", "s_type"),
            sb_uuid=off("super_block", "s_uuid"),
            fstype_name=off("file_system_type", "name"),
            bdev_dev=off("block_device", "bd_dev"),
            bdev_start_sect=off("block_device", "bd_start_sect"),
            bdev_disk=off("block_device", "bd_disk"),
            disk_name=off("gendisk", "disk_name"),
            # struct bdev_inode { struct block_device bdev; struct inode vfs_inode; }
            bdev_inode_vfs_inode=off("bdev_inode", "vfs_inode"),
            pg_locked=_enum(prog, "PG_locked"),
            pg_uptodate=_enum(prog, "PG_uptodate"),
            pg_dirty=_enum(prog, "PG_dirty"),
            pg_writeback=_enum(prog, "PG_writeback"),
            pg_swapbacked=_enum(prog, "PG_swapbacked"),
            pg_slab=_enum(prog, "PG_slab"),
            pg_private=_enum(prog, "PG_private"),
            pgty_slab=_enum(prog, "PGTY_slab"),
        )


def _flag(flags: int, bit: int | None) -> bool:
    return bit is not None and bool((flags >> bit) & 1)


class Scanner:
    """Classifies PFNs of one dump; per-inode and per-section facts are cached."""

    def __init__(self, prog: drgn.Program) -> None:
        self.prog = prog
        self.o = Layout.of(prog)
        from drgn.helpers.linux.mm import pfn_to_page

        # SPARSEMEM_VMEMMAP (all x86_64 distribution kernels): struct pages
        # form one virtual array, so a PFN's page is one multiplication away.
        self.page0 = int(pfn_to_page(prog, 0).value_())
        # Per inode, pagescan's struct inode_info: a record of no page that
        # holds the inode's columns, which each of its pages' records copies.
        self._inodes: dict[int, PageRecord] = {}
        self._sections: dict[int, bool] = {}
        self._block: tuple[int, bytes | None] = (-1, None)
        self._init_sections()

    # --- reads that fail softly, like pagescan's rd() -------------------

    def _u64(self, addr: int) -> int | None:
        try:
            return int(self.prog.read_u64(addr))
        except drgn.FaultError:
            return None

    def _u32(self, addr: int) -> int | None:
        try:
            return int(self.prog.read_u32(addr))
        except drgn.FaultError:
            return None

    def _bytes(self, addr: int, size: int) -> bytes | None:
        try:
            return bytes(self.prog.read(addr, size))
        except drgn.FaultError:
            return None

    def _cstr(self, addr: int, size: int) -> str:
        data = self._bytes(addr, size)
        if data is None:
            return ""
        return data.split(b"\0", 1)[0].decode(errors="replace")

    # --- PFN -> struct page: crash's phys_to_page() ---------------------

    def _init_sections(self) -> None:
        prog = self.prog
        self.section_shift = int(prog["SECTION_SIZE_BITS"].value_()) - int(
            prog["PAGE_SHIFT"].value_()
        )
        self.sections_per_root = int(prog["SECTIONS_PER_ROOT"].value_())
        self.section_roots = int(prog["NR_SECTION_ROOTS"].value_())
        self.section_size = prog.type("struct mem_section").size or 0
        self.section_map_off = drgn.offsetof(prog.type("struct mem_section"), "section_mem_map")
        bit = _enum(prog, "SECTION_HAS_MEM_MAP_BIT")
        self.has_mem_map = 1 << (SECTION_HAS_MEM_MAP_BIT if bit is None else bit)
        ms = prog["mem_section"]
        # SPARSEMEM_EXTREME: a pointer to an array of root pointers;
        # otherwise a static two-dimensional array.
        self.extreme = ms.type_.unaliased_kind() == drgn.TypeKind.POINTER
        self.mem_section = int(ms.value_()) if self.extreme else int(ms.address_ or 0)

    def _has_page(self, pfn: int) -> bool:
        """Does the PFN's memory section have a mem_map (crash: valid_section_nr and
        section_has_mem_map)?  Section granularity, as in crash."""
        nr = pfn >> self.section_shift
        known = self._sections.get(nr)
        if known is not None:
            return known
        root_nr, idx = divmod(nr, self.sections_per_root)
        ok = False
        if root_nr >= self.section_roots:  # beyond MAX_PHYSMEM_BITS: crash checks it too
            root = None
        elif self.extreme:
            root = self._u64(self.mem_section + 8 * root_nr) if self.mem_section else None
        else:
            root = self.mem_section + root_nr * self.sections_per_root * self.section_size
        if root:
            smm = self._u64(root + idx * self.section_size + self.section_map_off)
            ok = smm is not None and bool(smm & self.has_mem_map)
        self._sections[nr] = ok
        return ok

    def _page_bytes(self, pfn: int) -> bytes | None:
        """struct page of a PFN.  Sorted PFN lists are mostly runs, so the pages are
        read PAGES_PER_READ at a time: one drgn read (and page-table walk) each."""
        size = self.o.page_size
        nr, i = divmod(pfn, PAGES_PER_READ)
        if self._block[0] != nr:
            self._block = (
                nr,
                self._bytes(self.page0 + nr * PAGES_PER_READ * size, PAGES_PER_READ * size),
            )
        block = self._block[1]
        if block is None:  # part of the block is unmapped: this page alone may not be
            return self._bytes(self.page0 + pfn * size, size)
        return block[i * size : (i + 1) * size]

    # --- per-inode facts: pagescan's inode_info() ------------------------

    def _inode(self, inode: int) -> PageRecord:
        facts = self._inodes.get(inode)
        if facts is None:
            facts = self._inodes[inode] = self._read_inode(inode)
        return facts

    def _read_inode(self, inode: int) -> PageRecord:
        o = self.o
        ino = self._u64(inode + o.inode_ino) or 0
        size = (self._u64(inode + o.inode_size) or 0) if o.inode_size is not None else 0
        blkbits = 0
        if o.inode_blkbits is not None:
            b = self._bytes(inode + o.inode_blkbits, 1)
            blkbits = b[0] if b else 0
        base = PageRecord(0, "", ino=ino, i_size=size, blkbits=blkbits)
        sb = self._u64(inode + o.inode_sb)
        if not sb:
            return base
        s_dev = (self._u32(sb + o.sb_dev) or 0) if o.sb_dev is not None else 0
        fstype = ""
        if o.sb_type is not None and o.fstype_name is not None:
            fst = self._u64(sb + o.sb_type)
            name = self._u64(fst + o.fstype_name) if fst else None
            if name:
                fstype = self._cstr(name, FSTYPE_MAX)
        uuid = ""
        if o.sb_uuid is not None:
            raw = self._bytes(sb + o.sb_uuid, 16)
            uuid = raw.hex() if raw is not None else ""
        bdev: int | None = None
        if fstype == "bdev" and o.bdev_inode_vfs_inode is not None:
            bdev = inode - o.bdev_inode_vfs_inode  # I_BDEV(inode)
        elif o.sb_bdev is not None:
            bdev = self._u64(sb + o.sb_bdev)
        bd_dev, start, disk = 0, 0, ""
        if bdev:
            if o.bdev_dev is not None:
                bd_dev = self._u32(bdev + o.bdev_dev) or 0
            if o.bdev_start_sect is not None:
                start = self._u64(bdev + o.bdev_start_sect) or 0
            if o.bdev_disk is not None and o.disk_name is not None:
                gd = self._u64(bdev + o.bdev_disk)
                if gd:
                    disk = self._cstr(gd + o.disk_name, DISK_NAME_MAX)
        return PageRecord(
            0,
            "",
            ino=ino,
            s_dev=s_dev,
            fstype=fstype,
            fs_uuid=uuid,
            bd_dev=bd_dev,
            disk=disk,
            start_sect=start,
            i_size=size,
            blkbits=blkbits,
        )

    # --- one frame: pagescan's classify() --------------------------------

    def _is_slab(self, flags: int, pg: bytes) -> bool:
        o = self.o
        if _flag(flags, o.pg_slab):
            return True
        if o.pgty_slab is None or o.page_type is None:
            return False
        # 6.12: the top byte of page_type holds the PGTY_* value.
        (ptype,) = struct.unpack_from("<I", pg, o.page_type)
        return bool(ptype >> 24 == o.pgty_slab)

    def classify(self, pfn: int) -> PageRecord:
        o = self.o
        if not self._has_page(pfn):
            return PageRecord(pfn, "nopage")
        page = self.page0 + pfn * o.page_size
        pg = self._page_bytes(pfn)
        if pg is None:
            return PageRecord(pfn, "unreadable")
        head = page
        (chead,) = struct.unpack_from("<Q", pg, o.page_compound_head)
        if chead & 1:
            # Tail page: flags, mapping and index live in the head page.
            head = chead - 1
            pg = self._bytes(head, o.page_size)
            if pg is None:
                return PageRecord(pfn, "unreadable")
        (flags,) = struct.unpack_from("<Q", pg, o.page_flags)
        (mapping,) = struct.unpack_from("<Q", pg, o.page_mapping)
        (index,) = struct.unpack_from("<Q", pg, o.page_index)
        # Unsigned arithmetic, as in C: a bogus head gives a wrapped index, not an error.
        index = (index + ((page - head) & ULONG_MASK) // o.page_size) & ULONG_MASK

        if self._is_slab(flags, pg):
            kind = "slab"  # slab_cache overlays ->mapping
        elif not mapping:
            kind = "nomapping"  # free, kernel, page tables, ...
        elif mapping & 3 == 3:
            kind = "ksm"  # merged by the guest's own KSM
        elif mapping & 1:
            kind = "anon"
        elif mapping & 2:
            kind = "movable"
        else:
            host = self._u64(mapping + o.as_host)
            imap = self._u64(host + o.inode_mapping) if host else None
            if not host or imap is None or imap != mapping:
                # Not an inode's own page cache (stale or overlaid field).
                kind = "badmapping"
            else:
                e = self._inode(host)
                if _flag(flags, o.pg_swapbacked):
                    kind = "shmem"
                elif e.fstype == "bdev":
                    kind = "bdev"
                else:
                    kind = "file"
                state = "".join(
                    c if _flag(flags, bit) else "-"
                    for c, bit in (
                        ("U", o.pg_uptodate),
                        ("D", o.pg_dirty),
                        ("W", o.pg_writeback),
                        ("L", o.pg_locked),
                        ("P", o.pg_private),
                    )
                )
                return replace(
                    e, pfn=pfn, kind=kind, flags=flags, index=index, inode=host, state=state
                )
        return PageRecord(pfn, kind, flags)


def classify_pfns(
    vmlinux: Path, dump: Path, pfns: list[int], workdir: Path
) -> dict[int, PageRecord]:
    """Same contract as crash_backend.classify_pfns (workdir is unused: no temp files)."""
    del workdir
    scanner = Scanner(open_dump(vmlinux, dump))
    return {pfn: scanner.classify(pfn) for pfn in sorted(pfns)}
