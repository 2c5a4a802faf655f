"""The page server's socket protocol, defined once in page-server/PROTOCOL.md
(message types, the TABLE message and the table memfd), and copied where a
program cannot read the document: the server (Rust, page-server/src/proto.rs
and src/table.rs), its reference clients (page-server/client/
pageshare_client.py and pageshare_table.h), QEMU's filter (the block/
pageshare* files qemu-patches/0004 adds), the fake server of the filter's
iotest (qemu-patches/0005) and the filter's fuzz seeds
(qemu-patches/fuzz/make_seeds.py).  Each copy must say what the document
says.  Source text is parsed, nothing is built or run."""

from __future__ import annotations

import ast
import contextlib
import re
import struct
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PS = REPO / "page-server"

# PROTOCOL.md's field types, as Python's struct module spells them.
STRUCT_CHAR = {"u32": "I", "u64": "Q", "i64": "q", "f64": "d"}


@dataclass(frozen=True)
class Field:
    offset: int
    type: str  # "u32", "u8[32]", ...
    text: str  # the document's description

    @property
    def fmt(self) -> str:
        m = re.fullmatch(r"u8\[(\d+)\]", self.type)
        return f"{m.group(1)}s" if m else STRUCT_CHAR[self.type]

    @property
    def size(self) -> int:
        return struct.calcsize("<" + self.fmt)


@dataclass(frozen=True)
class Protocol:
    image_messages: dict[str, int]  # image socket: TABLE, ..., STATS
    control_messages: dict[str, int]  # control socket: STATUS_REQ, ...
    max_client_payload: int
    max_status_reply: int
    table_msg: list[Field]
    table_msg_size: int
    table_msg_version: int
    table_msg_v1_size: int
    flag_degraded: int
    formats: dict[str, int]
    proof_file: int
    no_table_version: int
    no_table_reasons: set[int]
    no_generation: int
    header: list[Field]
    header_size: int
    magic: bytes
    table_version: int
    block_size: int
    buckets_offset: int
    min_buckets: int
    hash_mult: int

    @property
    def messages(self) -> dict[str, int]:
        return self.image_messages | self.control_messages

    def fixed(self, fields: list[Field]) -> dict[int, int | bytes]:
        """The values a field of `fields` always has, by offset."""
        out: dict[int, int | bytes] = {}
        for f in fields:
            if m := re.search(r"magic `(\w+)`", f.text):
                out[f.offset] = m.group(1).encode()
            elif m := re.search(r"(?<![<>])= (\d+)\b", f.text):
                out[f.offset] = int(m.group(1))
            elif f.text.startswith("reserved"):
                out[f.offset] = 0
        if fields is self.table_msg:
            # proof flags: this server always sets FILE (and so must a fake)
            out[88] = self.proof_file
        return out


def section(text: str, heading: str) -> str:
    """The text under a heading that starts with `heading`, up to the
    next heading of the same or a higher level."""
    m = re.search(r"^(#+) " + re.escape(heading) + r".*$", text, re.M)
    assert m, f"PROTOCOL.md has no heading {heading!r}"
    level = len(m.group(1))
    end = re.compile(rf"^#{{1,{level}}} ", re.M).search(text, m.end())
    return text[m.end() : end.start() if end else len(text)]


def fields(text: str) -> list[Field]:
    rows = [
        Field(int(m.group(1)), m.group(2), m.group(3))
        for m in re.finditer(r"^\| (\d+) \| ([ui]\d+(?:\[\d+\])?|f64) \| (.*) \|$", text, re.M)
    ]
    assert rows, "no field table"
    return rows


def one(pattern: str, text: str, what: str) -> str:
    m = re.search(pattern, text)
    assert m, f"found no {what or pattern!r}"
    return m.group(1)


def protocol() -> Protocol:
    doc = (PS / "PROTOCOL.md").read_text()
    types = r"^#+ `(\w+)` \(type (\d+)\)"
    image = {m.group(1): int(m.group(2)) for m in re.finditer(types, doc, re.M)}
    control = {
        m.group(1): int(m.group(2))
        for m in re.finditer(r"`(\w+)` \((\d+)\b", section(doc, "Control socket"))
    }
    table = section(doc, "`TABLE`")
    msg = fields(table)
    fmt_row = next(f for f in msg if "image format" in f.text)
    no_table = section(doc, "`NO_TABLE`")
    memfd = section(doc, "Table memfd layout")
    header = fields(memfd)
    by_offset = {f.offset: f.text for f in header}
    return Protocol(
        image_messages=image,
        control_messages=control,
        max_client_payload=int(one(r"client -> server: at most (\d+)", doc, "the request limit")),
        max_status_reply=int(
            one(r"up to (\d+) MiB", section(doc, "Control socket"), "the status reply limit")
        )
        << 20,
        table_msg=msg,
        table_msg_size=int(one(r"Payload, (\d+) bytes", table, "the TABLE size")),
        table_msg_version=int(one(r"TABLE message version = (\d+)", table, "the version")),
        table_msg_v1_size=int(one(r"version 1, (\d+) bytes", table, "version 1's size")),
        flag_degraded=1 << int(one(r"flags: bit (\d+) = DEGRADED", table, "DEGRADED")),
        formats={
            m.group(2): int(m.group(1)) for m in re.finditer(r"(\d+) = (raw|qcow2)\b", fmt_row.text)
        },
        proof_file=1 << int(one(r"proof flags: bit (\d+) = FILE", table, "FILE")),
        no_table_version=int(one(r"`u32 version = (\d+);", no_table, "NO_TABLE's version")),
        no_table_reasons={
            int(n)
            for n in re.findall(
                r"(\d+) [a-z \n]+[,.]", one(r"Reasons: ([^.]*\.)", no_table, "the reasons")
            )
        },
        no_generation=int(
            one(
                r"`(0x[0-9a-f]+)`: \"I use no table\"", section(doc, "`SWITCHED`"), "no generation"
            ),
            16,
        ),
        header=header,
        header_size=int(one(r"(\d+)-byte header", memfd, "the header size")),
        magic=one(r"magic `(\w+)`", by_offset[0], "the magic").encode(),
        table_version=int(one(r"^version = (\d+)$", by_offset[8], "the table version")),
        block_size=int(one(r"block size = (\d+)", memfd, "the block size")),
        buckets_offset=int(one(r"buckets offset = (\d+)", memfd, "the buckets offset")),
        min_buckets=int(one(r"power of two, >= (\d+)", memfd, "the least bucket count")),
        hash_mult=int(one(r"key \* (0x[0-9A-F]+) mod 2\^64", memfd, "the hash"), 16),
    )


def layout_fmt(fields: list[Field]) -> str:
    return "<" + "".join(f.fmt for f in fields)


def layout_sizes(fields: list[Field]) -> list[tuple[int, int]]:
    return [(f.offset, f.size) for f in fields]


def test_the_document_is_consistent() -> None:
    p = protocol()
    assert p.image_messages == {
        "TABLE": 1,
        "NO_TABLE": 2,
        "BYE": 3,
        "SWITCHED": 16,
        "STATS": 17,
        "READS": 18,
        "LISTED_READ": 19,
    }
    assert p.control_messages == {
        "STATUS_REQ": 32,
        "STATUS_REPLY": 33,
        "RELOAD_REQ": 34,
        "RELOAD_REPLY": 35,
    }
    for rows, size in [(p.table_msg, p.table_msg_size), (p.header, p.header_size)]:
        end = 0
        for f in rows:
            assert f.offset == end, f"field at {f.offset} follows one that ends at {end}"
            end += f.size
        assert end == size
    assert p.table_msg_size == 136 and p.table_msg_version == 2 and p.table_msg_v1_size == 88
    assert p.header_size == 128 and p.buckets_offset == p.header_size
    assert p.magic == b"PSTABLE1" and p.table_version == 1 and p.block_size == 4096
    assert p.formats == {"raw": 1, "qcow2": 2}
    assert p.flag_degraded == 1 and p.proof_file == 1 and p.min_buckets == 16
    assert p.no_table_version == 1 and p.no_table_reasons == {1, 2, 3, 4, 5}
    assert p.hash_mult == 0x9E3779B97F4A7C15 and p.no_generation == 2**64 - 1
    assert p.max_client_payload == 4096 and p.max_status_reply == 16 << 20
    assert p.fixed(p.table_msg) == {0: 2, 88: 1, 92: 0}
    assert p.fixed(p.header) == {0: b"PSTABLE1", 8: 1, 12: 128, 84: 4096, 88: 128, 120: 0}


# --- Rust -------------------------------------------------------------------


def rust_value(s: str) -> int | bytes:
    s = s.strip()
    if m := re.fullmatch(r'b"(.*)"', s):
        return m.group(1).encode()
    if s == "u64::MAX":
        return 2**64 - 1
    if m := re.fullmatch(r"(\w+) << (\w+)", s):
        return int(m.group(1), 0) << int(m.group(2), 0)
    return int(s.replace("_", ""), 0)


def rust_consts(path: Path) -> dict[str, int | bytes]:
    return {
        m.group(1): rust_value(m.group(2))
        for m in re.finditer(r"^pub const (\w+): [^=]+ = ([^;]+);", path.read_text(), re.M)
    }


def rust_fn(text: str, name: str) -> str:
    m = re.search(r"^(pub(\([\w]+\))? )?fn " + name + r"\b.*?^\}", text, re.M | re.S)
    if not m:
        m = re.search(r"^    (pub(\([\w]+\))? )?fn " + name + r"\b.*?^    \}", text, re.M | re.S)
    assert m, f"no fn {name}"
    return m.group(0)


def test_the_page_server_copies_the_document() -> None:
    p = protocol()
    proto = rust_consts(PS / "src/proto.rs")
    msgs = {k.removeprefix("MSG_"): v for k, v in proto.items() if k.startswith("MSG_")}
    assert msgs == p.messages
    assert proto["MAX_CLIENT_PAYLOAD"] == p.max_client_payload
    assert proto["MAX_SERVER_PAYLOAD"] == p.max_status_reply
    assert proto["TABLE_PAYLOAD_LEN"] == p.table_msg_size
    assert proto["TABLE_MSG_VERSION"] == p.table_msg_version
    assert proto["PROOF_FILE"] == p.proof_file
    assert {"raw": proto["FORMAT_RAW"], "qcow2": proto["FORMAT_QCOW2"]} == p.formats
    assert proto["NO_GENERATION"] == p.no_generation
    assert {v for k, v in proto.items() if k.startswith("NT_")} == p.no_table_reasons
    # table_payload() writes the fields in order, each commented with its offset
    writes = re.findall(
        r"extend_from_slice\(.*\); // (\d+)",
        rust_fn((PS / "src/proto.rs").read_text(), "table_payload"),
    )
    assert [int(o) for o in writes] == [f.offset for f in p.table_msg]
    no_table = rust_fn((PS / "src/server/clients.rs").read_text(), "send_no_table")
    assert re.findall(r"&(\d+)u32\.to_le_bytes\(\)", no_table) == [str(p.no_table_version)]

    table = rust_consts(PS / "src/table.rs")
    assert table["MAGIC"] == p.magic
    assert table["VERSION"] == p.table_version
    assert table["HEADER_SIZE"] == p.header_size == p.buckets_offset
    assert table["HASH_MULT"] == p.hash_mult
    assert table["FLAG_DEGRADED"] == p.flag_degraded
    assert 1 << int(table["MIN_BITS"]) == p.min_buckets
    build = rust_fn((PS / "src/table.rs").read_text(), "build")
    assert re.findall(r"&(\d+)u32\.to_le_bytes\(\)", build) == [str(p.block_size)]


# --- Python -----------------------------------------------------------------


def py_value(node: ast.expr) -> object:
    """A constant expression's value (numbers, strings, bytes, dicts,
    shifts and sums, struct.Struct("...")); ValueError for anything else."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Dict):
        return {py_value(k): py_value(v) for k, v in zip(node.keys, node.values, strict=True) if k}
    if isinstance(node, ast.BinOp):
        a, b = py_value(node.left), py_value(node.right)
        if isinstance(a, int) and isinstance(b, int):
            ops = {ast.LShift: a << b, ast.Sub: a - b, ast.Add: a + b, ast.Mult: a * b}
            if type(node.op) in ops:
                return ops[type(node.op)]
    if (
        isinstance(node, ast.Call)
        and ast.unparse(node.func) == "struct.Struct"
        and len(node.args) == 1
        and isinstance(node.args[0], ast.Constant)
    ):
        return struct.Struct(str(node.args[0].value))
    raise ValueError(ast.unparse(node))


def py_consts(text: str) -> dict[str, object]:
    out: dict[str, object] = {}
    for node in ast.parse(text).body:
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
        ):
            with contextlib.suppress(ValueError):
                out[node.targets[0].id] = py_value(node.value)
    return out


def no_spaces(fmt: str) -> str:
    return fmt.replace(" ", "")


def check_packs(text: str, p: Protocol, where: str) -> None:
    """`text` builds one table header and one TABLE message with
    struct.pack, in the document's layout, with the document's fixed
    values wherever it writes a constant."""
    found = set()
    for node in ast.walk(ast.parse(text)):
        if not (
            isinstance(node, ast.Call)
            and ast.unparse(node.func) == "struct.pack"
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            continue
        fmt = no_spaces(str(node.args[0].value))
        for name, rows in [("header", p.header), ("TABLE", p.table_msg)]:
            if fmt != layout_fmt(rows):
                continue
            found.add(name)
            fixed = p.fixed(rows)
            values = node.args[1:]
            assert len(values) == len(rows), f"{where}: {name} has {len(values)} values"
            for f, arg in zip(rows, values, strict=True):
                if not isinstance(arg, ast.Constant):
                    continue
                if f.offset in fixed:
                    assert arg.value == fixed[f.offset], (
                        f"{where}: {name} at {f.offset}: {arg.value!r}"
                    )
                if "image format" in f.text:
                    assert arg.value in p.formats.values(), f"{where}: format {arg.value!r}"
    assert found == {"header", "TABLE"}, f"{where} packs no {{'header', 'TABLE'}} - {found}"


def test_the_python_client_copies_the_document() -> None:
    p = protocol()
    text = (REPO / "tools/pageshare_tools/pageshare_client.py").read_text()
    c = py_consts(text)
    msgs = {k.removeprefix("MSG_"): v for k, v in c.items() if k.startswith("MSG_")}
    assert msgs == p.messages
    assert c["NO_GENERATION"] == p.no_generation
    assert c["TABLE_MAGIC"] == p.magic
    assert c["TABLE_MSG_VERSION"] == p.table_msg_version
    assert c["PROOF_FILE"] == p.proof_file
    assert c["IMAGE_FORMATS"] == {v: k for k, v in p.formats.items()}
    assert c["HASH_MULT"] == p.hash_mult
    assert c["FLAG_DEGRADED"] == p.flag_degraded
    reasons = c["NO_TABLE_REASONS"]
    assert isinstance(reasons, dict) and set(reasons) == p.no_table_reasons
    header, payload = c["TABLE_HEADER"], c["TABLE_PAYLOAD"]
    assert isinstance(header, struct.Struct) and isinstance(payload, struct.Struct)
    assert no_spaces(header.format) == layout_fmt(p.header)
    assert no_spaces(payload.format) == layout_fmt(p.table_msg)
    assert (header.size, payload.size) == (p.header_size, p.table_msg_size)
    # Table.from_fd() checks the header against literals
    checks = dict(re.findall(r"\b(version|hsize|bsize|boff) != (\d+)", text))
    assert checks == {
        "version": str(p.table_version),
        "hsize": str(p.header_size),
        "bsize": str(p.block_size),
        "boff": str(p.buckets_offset),
    }
    assert 1 << int(one(r"not (\d+) <= bits", text, "")) == p.min_buckets
    bucket_at = re.findall(r"\b(\d+) \+ 16 \* \w+", text)
    assert bucket_at and set(bucket_at) == {str(p.buckets_offset)}


# --- C ----------------------------------------------------------------------


def c_value(s: str) -> int | bytes:
    s = s.strip()
    if m := re.fullmatch(r'"(.*)"', s):
        return m.group(1).encode()
    if s == "UINT64_MAX":
        return 2**64 - 1
    return int(re.sub(r"[uUlL]+$", "", s), 0)


def c_defines(text: str, prefix: str) -> dict[str, int | bytes]:
    """Defines of a number or a string (others are left out)."""
    value = r"(\"[^\"\n]*\"|[^ \t\n/]+)"  # a string, or up to a comment
    out: dict[str, int | bytes] = {}
    for m in re.finditer(r"^#define " + prefix + r"(\w+)[ \t]+" + value, text, re.M):
        with contextlib.suppress(ValueError):
            out[m.group(1)] = c_value(m.group(2))
    return out


C_SIZE = {"uint8_t": 1, "char": 1, "uint32_t": 4, "int32_t": 4, "uint64_t": 8, "int64_t": 8}


def c_struct_layout(text: str, name: str) -> list[tuple[int, int]]:
    body = one(r"struct " + name + r" \{([\s\S]*?)\n\}", text, f"struct {name}")
    out, offset = [], 0
    for m in re.finditer(r"^\s*(\w+) (\w+)(?:\[(\d+)\])?;", body, re.M):
        size = C_SIZE[m.group(1)] * int(m.group(3) or 1)
        out.append((offset, size))
        offset += size
    return out


def test_the_c_table_reader_copies_the_document() -> None:
    p = protocol()
    text = (PS / "client/pageshare_table.h").read_text()
    d = c_defines(text, "PST_")
    msgs = {k.removeprefix("MSG_"): v for k, v in d.items() if k.startswith("MSG_")}
    assert msgs == p.image_messages
    assert d["MAGIC"] == p.magic
    assert d["VERSION"] == p.table_version
    assert d["HEADER_SIZE"] == p.header_size
    assert d["HASH_MULT"] == p.hash_mult
    assert d["FLAG_DEGRADED"] == p.flag_degraded
    assert d["TABLE_MSG_VERSION"] == p.table_msg_version
    assert {"raw": d["FORMAT_RAW"], "qcow2": d["FORMAT_QCOW2"]} == p.formats
    assert d["PROOF_FILE"] == p.proof_file
    assert c_struct_layout(text, "pst_header") == layout_sizes(p.header)
    assert c_struct_layout(text, "pst_table_msg") == layout_sizes(p.table_msg)
    assert one(r"sizeof\(struct pst_table_msg\) == (\d+)", text, "") == str(p.table_msg_size)
    assert one(r"block_size != (\d+)", text, "") == str(p.block_size)
    assert 1 << int(one(r"bucket_bits < (\d+)", text, "")) == p.min_buckets


# --- QEMU (qemu-patches) ----------------------------------------------------


def added_files(patch: Path) -> dict[str, str]:
    """The lines a patch adds, by file (all of a file the patch creates)."""
    out: dict[str, list[str]] = {}
    lines: list[str] = []
    for line in patch.read_text().splitlines():
        if line.startswith("+++ b/"):
            lines = out.setdefault(line[len("+++ b/") :], [])
        elif line.startswith("diff --git"):
            lines = []
        elif line.startswith("+"):
            lines.append(line[1:])
    return {name: "\n".join(lines) + "\n" for name, lines in out.items()}


def qemu_patch(number: str) -> dict[str, str]:
    (patch,) = (REPO / "qemu-patches").glob(f"{number}-*.patch")
    return added_files(patch)


def test_the_qemu_filter_copies_the_document() -> None:
    p = protocol()
    files = {k: v for k, v in qemu_patch("0004").items() if k.startswith("block/pageshare")}
    assert {"block/pageshare.c", "block/pageshare-table.c", "block/pageshare-table.h"} <= set(files)
    src = "".join(files.values())
    d = c_defines(src, "PS_")
    msgs = {
        k.removeprefix("MSG_"): v
        for k, v in d.items()
        if k.startswith("MSG_") and k not in ("MSG_MAX_PAYLOAD", "MSG_MAX_SEND")
    }
    assert msgs == p.image_messages
    # what the filter sends is at most what the document says a server takes
    protocol_md = (REPO / "page-server/PROTOCOL.md").read_text()
    doc_max = one(r"client -> server: at most (\d+)", protocol_md, "")
    assert d["MSG_MAX_SEND"] == int(doc_max)
    assert d["TABLE_MSG_VERSION"] == p.table_msg_version
    assert d["TABLE_MSG_SIZE"] == p.table_msg_size
    assert d["FLAG_DEGRADED"] == p.flag_degraded
    assert {"raw": d["FORMAT_RAW"], "qcow2": d["FORMAT_QCOW2"]} == p.formats
    assert d["PROOF_FILE"] == p.proof_file
    assert d["TABLE_MAGIC"] == p.magic
    assert d["TABLE_HEADER_SIZE"] == p.header_size == p.buckets_offset
    assert d["BLOCK_SIZE"] == p.block_size
    assert d["NO_GENERATION"] == p.no_generation
    mults = re.findall(r"key \* (0x[0-9A-Fa-f]+)ULL", src)
    assert len(mults) >= 2 and {int(m, 16) for m in mults} == {p.hash_mult}
    table_c = files["block/pageshare-table.c"]
    assert one(r"ldl_le_p\(map \+ 8\) != (\d+)", table_c, "") == str(p.table_version)
    assert 1 << int(one(r"bits < (\d+)", table_c, "")) == p.min_buckets
    # every field it reads is the document's field at that offset, of that size
    for buf, rows in [("msg", p.table_msg), ("map", p.header)]:
        reads = qemu_reads(table_c, buf)
        assert len(reads) >= 5
        doc = {f.offset: f for f in rows}
        for name, offset, size in reads:
            f = doc.get(offset)
            assert f and f.size == size, f"{buf} + {offset}: {size} bytes"
            assert name in QEMU_NAMES, f"what is the filter's {name}? (QEMU_NAMES)"
            assert f.text.startswith(QEMU_NAMES[name]), f"{buf} + {offset} is not {name}"


# What the filter calls the fields it reads, and how the document's
# description of each begins.
QEMU_NAMES = {
    "flags": ("flags",),
    "generation": ("generation",),
    "entries": ("entry count",),
    "memfd_size": ("table memfd size",),
    "image_size": ("image virtual size",),
    "sha256": ("image content sha256",),
    "pid": ("server pid",),
    "format": ("image format",),
    "proof": ("proof flags",),
    "dev": ("`st_dev`",),
    "ino": ("`st_ino`",),
    "file_size": ("`st_size`",),
    "mtime_ns": ("mtime",),
    "ctime_ns": ("ctime",),
    "nbuckets": ("bucket count",),
    "bits": ("bucket bits",),
    "arena": ("arena base",),
    "arena_len": ("arena length",),
    "PS_TABLE_MAGIC": ("magic",),
    "1": ("version",),
    "PS_TABLE_MSG_VERSION": ("TABLE message version",),
    "PS_TABLE_HEADER_SIZE": ("header size", "buckets offset"),
    "PS_BLOCK_SIZE": ("block size",),
}


def qemu_reads(text: str, buf: str) -> list[tuple[str, int, int]]:
    """(what, offset, size) of each field pageshare-table.c reads from
    `buf`: into info->what or a local, or to compare with info->what or a
    constant."""
    width = {"l": 4, "q": 8}
    at = buf + r"(?: \+ (\d+))?"
    out = [
        (m.group(1), int(m.group(3) or 0), width[m.group(2)])
        for m in re.finditer(r"(?:info->)?(\w+) = (?:\(\w+\))?ld([lq])_le_p\(" + at + r"\)", text)
    ]
    out += [
        (m.group(3), int(m.group(2) or 0), width[m.group(1)])
        for m in re.finditer(r"ld([lq])_le_p\(" + at + r"\) != (?:info->)?(\w+)", text)
    ]
    out += [
        (m.group(2), int(m.group(1) or 0), int(m.group(3)))
        for m in re.finditer(r"mem(?:cpy|cmp)\(" + at + r", (?:info->)?(\w+), (\d+)\)", text)
    ]
    out += [
        (m.group(1), int(m.group(2) or 0), int(m.group(3)))
        for m in re.finditer(r"mem(?:cpy|cmp)\((?:info->)?(\w+), " + at + r", (\d+)\)", text)
    ]
    return out


def test_the_iotest_fake_server_copies_the_document() -> None:
    p = protocol()
    (name,) = [n for n in qemu_patch("0005") if n == "tests/qemu-iotests/tests/pageshare"]
    text = qemu_patch("0005")[name]
    assert py_consts(text)["HASH_MULT"] == p.hash_mult
    check_packs(text, p, name)
    assert 1 << int(one(r"\bbits = (\d+)\n", text, "")) == p.min_buckets
    sent = one(r"struct\.pack\('<II', (\d+), len\(self\.msg\)\)", text, "the TABLE it sends")
    assert int(sent) == p.messages["TABLE"]
    assert int(one(r"kind == (\d+):\n\s*self\.switched", text, "")) == p.messages["SWITCHED"]
    assert int(one(r"kind == (\d+):\n\s*self\.stats", text, "")) == p.messages["STATS"]
    # the old protocol: version 1, the first 88 bytes
    m = re.search(r"struct\.pack\('<I', (\d+)\) \+ srv\.msg\[4:(\d+)\]", text)
    assert m and (int(m.group(1)), int(m.group(2))) == (1, p.table_msg_v1_size)


def test_the_fuzz_seeds_copy_the_document() -> None:
    p = protocol()
    text = (REPO / "qemu-patches/fuzz/make_seeds.py").read_text()
    c = py_consts(text)
    assert c["HASH_MULT"] == p.hash_mult
    assert c["MSG_SIZE"] == p.table_msg_size
    check_packs(text, p, "make_seeds.py")
    assert 1 << int(one(r"\bbits = (\d+)\n", text, "")) == p.min_buckets
