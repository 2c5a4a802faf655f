"""The kernel series' user-space constants, defined once in
kernel-syscall/include/uapi/linux/ksm.h (whose upper half ktest.py keeps
byte-identical to the header the series adds), and copied where a build
cannot include that header: the page server (Rust, page-server/src/sys.rs)
and QEMU's filter (its patch defines PS_* because QEMU builds against the
host's kernel headers).  Each copy must say what the header says."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def header() -> dict[str, int]:
    text = (REPO / "kernel-syscall/include/uapi/linux/ksm.h").read_text()
    return {
        m.group(1): int(m.group(2), 0)
        for m in re.finditer(r"^#define\s+(\w+)\s+(0x[0-9a-fA-F]+|\d+)\b", text, re.M)
    }


def test_the_header_defines_what_the_copies_use() -> None:
    h = header()
    assert h["MADV_ALLOWMERGED"] == 26 and h["MADV_DISALLOWMERGED"] == 27
    assert h["__NR_merge_page"] == 463 and h["__NR_merge_pages"] == 464
    assert h["MERGE_PAGE_NOWAIT"] == 0x1 and h["MERGE_PAGE_NOSPLIT"] == 0x2


def test_the_page_server_copies_the_header() -> None:
    h = header()
    rs = (REPO / "page-server/src/sys.rs").read_text()
    consts = {
        m.group(1): int(m.group(2), 0)
        for m in re.finditer(r"pub const (\w+): [\w:]+ = (0x[0-9a-fA-F]+|\d+);", rs)
    }
    assert consts["MADV_ALLOWMERGED"] == h["MADV_ALLOWMERGED"]
    assert consts["MADV_DISALLOWMERGED"] == h["MADV_DISALLOWMERGED"]
    assert consts["NR_MERGE_PAGE"] == h["__NR_merge_page"]
    assert consts["NR_MERGE_PAGES"] == h["__NR_merge_pages"]


def test_the_qemu_filter_copies_the_header() -> None:
    h = header()
    patch = "\n".join(p.read_text() for p in sorted((REPO / "qemu-patches").glob("0*.patch")))
    defs = {
        m.group(1): int(m.group(2), 0)
        for m in re.finditer(r"^\+#define\s+(PS_\w+)\s+(0x[0-9a-fA-F]+|\d+)\b", patch, re.M)
    }
    assert defs["PS_NR_MERGE_PAGES"] == h["__NR_merge_pages"]
    assert defs["PS_MERGE_PAGE_NOWAIT"] == h["MERGE_PAGE_NOWAIT"]
