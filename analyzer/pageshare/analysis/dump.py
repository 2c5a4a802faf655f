"""Reading QEMU ELF guest-memory dumps: physical pages and VMCOREINFO.

QEMU's dump-guest-memory with paging=false writes one PT_LOAD per guest RAM
range, keyed by guest-physical address, plus a VMCOREINFO note when the guest
published one through the vmcoreinfo device (needs the guest's qemu_fw_cfg
driver).  When the note is missing we fall back to finding the VMCOREINFO
text in guest memory, where the kernel always keeps it.
"""

import mmap
import re
import struct
from dataclasses import dataclass
from pathlib import Path

PAGE = 4096
PT_LOAD, PT_NOTE = 1, 4


@dataclass(frozen=True)
class Segment:
    paddr: int
    size: int
    offset: int


class ElfDump:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._f = open(path, "rb")  # noqa: SIM115 - lives as long as the object
        self._mm = mmap.mmap(self._f.fileno(), 0, prot=mmap.PROT_READ)
        h = self._mm[:64]
        if h[:4] != b"\x7fELF" or h[4] != 2:
            raise ValueError(f"{path}: not an ELF64 dump")
        phoff = struct.unpack_from("<Q", h, 0x20)[0]
        phentsize, phnum = struct.unpack_from("<HH", h, 0x36)
        self.segments: list[Segment] = []
        self.notes: list[tuple[int, int]] = []
        for i in range(phnum):
            ph = self._mm[phoff + i * phentsize : phoff + (i + 1) * phentsize]
            p_type, _flags, off, _vaddr, paddr, filesz = struct.unpack_from("<IIQQQQ", ph)
            if p_type == PT_LOAD and filesz:
                self.segments.append(Segment(paddr, filesz, off))
            elif p_type == PT_NOTE:
                self.notes.append((off, filesz))
        self.segments.sort(key=lambda s: s.paddr)

    def close(self) -> None:
        self._mm.close()
        self._f.close()

    def page(self, pfn: int) -> bytes | None:
        pa = pfn * PAGE
        for s in self.segments:
            if s.paddr <= pa and pa + PAGE <= s.paddr + s.size:
                o = s.offset + pa - s.paddr
                return self._mm[o : o + PAGE]
        return None

    def vmcoreinfo(self) -> str | None:
        """The VMCOREINFO text from the ELF note, else found in guest memory."""
        for off, size in self.notes:
            pos, end = off, off + size
            while pos + 12 <= end:
                namesz, descsz, _type = struct.unpack_from("<III", self._mm, pos)
                name_end = pos + 12 + ((namesz + 3) & ~3)
                name = self._mm[pos + 12 : pos + 12 + namesz].rstrip(b"\0")
                if name == b"VMCOREINFO":
                    return self._mm[name_end : name_end + descsz].decode(errors="replace")
                pos = name_end + ((descsz + 3) & ~3)
        return self._vmcoreinfo_from_memory()

    def _vmcoreinfo_from_memory(self) -> str | None:
        # The kernel keeps the text in a page-aligned buffer; it starts with
        # OSRELEASE= and ends with a NUL.
        for m in re.finditer(rb"OSRELEASE=[^\n\0]{1,64}\nBUILD-ID=[0-9a-f]{40}\n", self._mm):
            end = self._mm.find(b"\0", m.start())
            text = self._mm[m.start() : end].decode(errors="replace")
            if "KERNELOFFSET=" in text or "SYMBOL(" in text:
                return text
        return None


def parse_vmcoreinfo(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        k, sep, v = line.partition("=")
        if sep:
            out[k] = v
    return out
