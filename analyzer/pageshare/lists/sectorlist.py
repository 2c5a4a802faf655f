"""The "pcsl v1" sector list: which 4 KiB blocks of a base image to preload.

The analyzer writes one list per golden image; a page server on every host
reads it, re-reads each listed block from its copy of the base image, checks
the block against the list's hash and only then preloads it.  The format is
therefore built so that a reader can never act on a list that is corrupted,
truncated or meant for another image:

* the header names the image by virtual size and a layout-independent content
  hash (the same for the qcow2 and a raw conversion of it);
* ``count`` and ``list-digest`` (sha256 of the exact body bytes) catch
  truncation and edits of the body;
* every body line carries the sha256 of its block, so a reader that checks
  blocks against the image never preloads stale data even if the header lies.

The authoritative description of the format is lists/README.md; keep the two
in sync.  Reading images (raw, qcow2, their content hash) is diskimage.py's;
the `pageshare list` command is listcli.py.
"""

import datetime as _dt
import hashlib
import os
import re
import stat
import tempfile
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

from pageshare.errors import PageshareError

FORMAT_VERSION = 1
BLOCK_SIZE = 4096
SECTOR_SIZE = 512
SECTORS_PER_BLOCK = BLOCK_SIZE // SECTOR_SIZE
HASH_NAME = "sha256"
MAGIC = f"# pcsl v{FORMAT_VERSION}"
SEPARATOR = "---"

# Header keys in the order dumps() writes them.
HEADER_KEYS: tuple[str, ...] = (
    "image-virtual-size",
    "image-content-sha256",
    "image-name",
    "block-size",
    "sector-size",
    "hash",
    "count",
    "list-digest",
    "generator",
    "created",
    "criteria",
    "runs",
)
# Keys a reader needs to use the list safely.  The rest are informational, so a
# hand-written example list may leave them out; dumps() always writes them.
REQUIRED_KEYS: tuple[str, ...] = (
    "image-virtual-size",
    "image-content-sha256",
    "block-size",
    "sector-size",
    "hash",
    "count",
    "list-digest",
)

# At most 19 digits: every size and sector fits in a signed 64-bit integer (what
# a C page server will parse them into), and Python's int() refuses strings
# longer than 4300 digits with a plain ValueError, which must not escape loads().
_MAX_DIGITS = 19
_UINT = re.compile(r"0|[1-9][0-9]*")
_HEX64 = re.compile(r"[0-9a-f]{64}")
_KEY = re.compile(r"[a-z][a-z0-9-]*")
_EXT_KEY = re.compile(r"x-[a-z0-9][a-z0-9-]*")
_BODY_LINE = re.compile(r"(0|[1-9][0-9]{0,18}) ([0-9a-f]{64})")
_VERSION_LINE = re.compile(r"# pcsl v([0-9]+)")
# Characters a free-text header value must not contain: line breaks would end
# the header line early (here or in tools using str.splitlines()), and other
# control characters make the file unreadable in a terminal.  Tab is allowed.
_BAD_TEXT = re.compile(r"[\x00-\x08\x0a-\x1f\x7f-\x9f\u2028\u2029]")


class ListFormatError(PageshareError, ValueError):
    """A sector list that must not be used; the message names the line.

    ``line`` is 1-based; ``reason`` says what is wrong; ``source`` is the file
    name when the text came from read().
    """

    def __init__(self, line: int, reason: str, source: str = "") -> None:
        self.line = line
        self.reason = reason
        self.source = source
        prefix = f"{source}: " if source else ""
        super().__init__(f"{prefix}line {line}: {reason}")


@dataclass(frozen=True)
class ImageIdentity:
    """Which base image a list belongs to.

    ``virtual_size`` and ``content_sha256`` identify the image's virtual disk
    content independently of its on-disk layout; ``name`` is informational.
    """

    virtual_size: int
    content_sha256: str
    name: str = ""


@dataclass
class SectorList:
    """The blocks of one base image that guests keep cached, with their hashes."""

    image: ImageIdentity
    blocks: dict[int, str]  # first 512-byte sector of the 4 KiB block -> sha256 hex
    generator: str = ""
    created: str = ""  # ISO 8601 UTC; dumps() writes the current time if empty
    criteria: str = ""
    runs: str = ""
    extra: dict[str, str] = field(default_factory=dict)  # x-* header keys, in file order

    def sorted_sectors(self) -> list[int]:
        return sorted(self.blocks)

    def body_bytes(self) -> bytes:
        return "".join(f"{s} {self.blocks[s]}\n" for s in self.sorted_sectors()).encode()

    def digest(self) -> str:
        return f"{HASH_NAME}:{hashlib.sha256(self.body_bytes()).hexdigest()}"

    def total_bytes(self) -> int:
        return len(self.blocks) * BLOCK_SIZE


def block_hash(data: bytes) -> str:
    """sha256 hex of one 4 KiB block (the per-line hash of the body)."""
    if len(data) != BLOCK_SIZE:
        raise ValueError(f"block_hash needs exactly {BLOCK_SIZE} bytes, got {len(data)}")
    return hashlib.sha256(data).hexdigest()


# --------------------------------------------------------------------------- writing


def _now_iso() -> str:
    return _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _check_text(what: str, value: str) -> None:
    if not isinstance(value, str):
        raise ValueError(f"cannot write list: {what} must be a str, got {type(value).__name__}")
    m = _BAD_TEXT.search(value)
    if m:
        raise ValueError(
            f"cannot write list: {what} contains control character {m.group()!r} "
            "(header values are single lines)"
        )


def _is_uint(value: object) -> bool:
    # bool is an int subclass; True as a size is always a bug.
    return (
        isinstance(value, int)
        and not isinstance(value, bool)
        and value >= 0
        and len(str(value)) <= _MAX_DIGITS
    )


def _validate_for_write(sl: SectorList) -> None:
    """Refuse to write anything loads() would reject: a writer bug must not
    produce a file that every page server then throws away."""
    img = sl.image
    if not _is_uint(img.virtual_size):
        raise ValueError(f"cannot write list: bad image virtual size {img.virtual_size!r}")
    if not isinstance(img.content_sha256, str) or not _HEX64.fullmatch(img.content_sha256):
        raise ValueError(
            "cannot write list: image content_sha256 must be 64 lowercase hex digits, "
            f"got {img.content_sha256!r}"
        )
    _check_text("image name", img.name)
    for name in ("generator", "created", "criteria", "runs"):
        _check_text(name, getattr(sl, name))
    for key, value in sl.extra.items():
        if not isinstance(key, str) or not _EXT_KEY.fullmatch(key):
            raise ValueError(
                f"cannot write list: extra header key {key!r} must look like 'x-name' "
                "(lowercase letters, digits, '-')"
            )
        _check_text(f"header value of {key}", value)
    for sector, digest in sl.blocks.items():
        if not _is_uint(sector):
            raise ValueError(f"cannot write list: bad sector {sector!r}")
        if sector % SECTORS_PER_BLOCK:
            raise ValueError(f"cannot write list: sector {sector} is not 4 KiB aligned")
        if sector * SECTOR_SIZE + BLOCK_SIZE > img.virtual_size:
            raise ValueError(
                f"cannot write list: block at sector {sector} extends past the image end "
                f"({img.virtual_size} bytes)"
            )
        if not isinstance(digest, str) or not _HEX64.fullmatch(digest):
            raise ValueError(
                f"cannot write list: hash of sector {sector} must be 64 lowercase hex "
                f"digits, got {digest!r}"
            )


def _header_line(key: str, value: str) -> str:
    # No trailing space for empty values: editors strip it, and loads() accepts both.
    return f"{key}: {value}" if value else f"{key}:"


def dumps(sl: SectorList) -> str:
    """Serialise to pcsl v1 text.  Raises ValueError for a list that is not
    writable (unaligned or out-of-range sectors, bad hashes, multi-line values).
    An empty ``created`` is written as the current UTC time; ``sl`` itself is
    not modified."""
    _validate_for_write(sl)
    body = sl.body_bytes()
    values = {
        "image-virtual-size": str(sl.image.virtual_size),
        "image-content-sha256": sl.image.content_sha256,
        "image-name": sl.image.name,
        "block-size": str(BLOCK_SIZE),
        "sector-size": str(SECTOR_SIZE),
        "hash": HASH_NAME,
        "count": str(len(sl.blocks)),
        "list-digest": f"{HASH_NAME}:{hashlib.sha256(body).hexdigest()}",
        "generator": sl.generator,
        "created": sl.created or _now_iso(),
        "criteria": sl.criteria,
        "runs": sl.runs,
    }
    lines = [MAGIC]
    lines += [_header_line(k, values[k]) for k in HEADER_KEYS]
    lines += [_header_line(k, v) for k, v in sl.extra.items()]
    lines.append(SEPARATOR)
    return "\n".join(lines) + "\n" + body.decode()


def write(sl: SectorList, path: Path) -> None:
    """Write atomically: readers (and a crash) see the old file or the new one,
    never a partial list."""
    write_atomic(Path(path), dumps(sl).encode())


def write_atomic(path: Path, data: bytes) -> None:
    """Replace path with data so that readers and a crash see old or new, never partial."""
    directory = path.parent if str(path.parent) else Path(".")
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    try:
        # mkstemp creates 0600; lists are read by page servers that may run as
        # another user, so keep the mode of the file we replace, else 0644.
        try:
            mode = stat.S_IMODE(os.stat(path).st_mode)
        except FileNotFoundError:
            mode = 0o644
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        with suppress(FileNotFoundError):
            os.unlink(tmp_name)
        raise
    # Persist the rename itself; without this a crash can leave the old name.
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


# --------------------------------------------------------------------------- reading


def _show(text: str, limit: int = 60) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


def _parse_uint(line_no: int, key: str, value: str) -> int:
    if not _UINT.fullmatch(value):
        # int() alone would accept " 5", "+5", "1_000" and non-ASCII digits.
        raise ListFormatError(
            line_no,
            f"{key}: expected a decimal integer (digits only, no sign or leading zeros), "
            f"got {_show(value)}",
        )
    if len(value) > _MAX_DIGITS:
        raise ListFormatError(line_no, f"{key}: value {_show(value)} is too large")
    return int(value)


def _diagnose_body_line(line: str) -> str:
    expected = "expected '<sector> <sha256hex>'"
    if line == "":
        return f"empty line in the body ({expected})"
    if line.endswith("\r"):
        return "line ends with CR: CRLF line endings are not allowed, use LF"
    parts = line.split(" ")
    if len(parts) != 2:
        return f"{expected} separated by a single space, got {_show(line)}"
    sector, digest = parts
    if not _UINT.fullmatch(sector):
        return f"sector {_show(sector)} is not a decimal integer (no sign or leading zeros)"
    if len(sector) > _MAX_DIGITS:
        return f"sector {_show(sector)} is too large"
    return f"malformed hash {_show(digest)}: must be 64 lowercase hex digits (sha256)"


def _check_magic(first: str) -> None:
    if first == MAGIC:
        return
    if first.rstrip("\r") == MAGIC:
        raise ListFormatError(1, "line ends with CR: CRLF line endings are not allowed, use LF")
    if first.startswith("\ufeff"):
        raise ListFormatError(1, "file starts with a byte-order mark; save it as UTF-8 without BOM")
    m = _VERSION_LINE.fullmatch(first)
    if m:
        raise ListFormatError(
            1,
            f"unsupported format version pcsl v{m[1]} (this reader understands only "
            f"v{FORMAT_VERSION}); update pageshare",
        )
    raise ListFormatError(
        1, f"not a pcsl sector list: first line must be {MAGIC!r}, got {_show(first)}"
    )


def loads(text: str) -> SectorList:
    """Parse and fully validate pcsl v1 text; raises ListFormatError naming the line.

    In steps: the lines (magic, final newline), the header's lines
    (_read_header), their values (_check_header), the body's lines
    (_read_body) and last the body's digest."""
    if not isinstance(text, str):
        raise TypeError(f"loads() needs str, got {type(text).__name__}")
    if text == "":
        raise ListFormatError(1, f"empty file: expected {MAGIC!r}")
    lines = text.split("\n")  # not splitlines(): that also splits at \r, \x0c, \u2028...
    _check_magic(lines[0])
    if lines[-1] != "":
        raise ListFormatError(len(lines), "last line has no terminating newline: truncated file?")
    lines.pop()

    values, extra, sep_index = _read_header(lines)
    header = _check_header(values, sep_index + 1)
    blocks = _read_body(lines, sep_index, header)
    body_start = sum(len(line) + 1 for line in lines[: sep_index + 1])
    actual = hashlib.sha256(text[body_start:].encode()).hexdigest()
    if f"{HASH_NAME}:{actual}" != header.digest:
        raise ListFormatError(
            header.digest_line, "list body does not match list-digest: file corrupted or edited"
        )

    def text_of(key: str) -> str:
        return values[key][1] if key in values else ""

    return SectorList(
        image=ImageIdentity(
            virtual_size=header.virtual_size,
            content_sha256=header.content,
            name=text_of("image-name"),
        ),
        blocks=blocks,
        generator=text_of("generator"),
        created=text_of("created"),
        criteria=text_of("criteria"),
        runs=text_of("runs"),
        extra=extra,
    )


def _read_header(lines: list[str]) -> tuple[dict[str, tuple[int, str]], dict[str, str], int]:
    """The header's lines, up to '---': its known keys' (line number,
    value), its extension keys' values, and the index of the '---' line."""
    values: dict[str, tuple[int, str]] = {}  # key -> (line number, value)
    extra: dict[str, str] = {}
    first_seen: dict[str, int] = {}
    for index in range(1, len(lines)):
        line_no = index + 1
        line = lines[index]
        if line == SEPARATOR:
            return values, extra, index
        if line.endswith("\r"):
            raise ListFormatError(
                line_no, "line ends with CR: CRLF line endings are not allowed, use LF"
            )
        if line.startswith("#"):
            continue
        key, colon, rest = line.partition(":")
        if not colon or not _KEY.fullmatch(key):
            raise ListFormatError(
                line_no, f"expected a 'key: value' header line or '---', got {_show(line)}"
            )
        if rest and not rest.startswith(" "):
            raise ListFormatError(line_no, f"expected a space after '{key}:'")
        value = rest[1:]
        bad = _BAD_TEXT.search(value)
        if bad:
            raise ListFormatError(
                line_no, f"value of '{key}' contains control character {bad.group()!r}"
            )
        if key in first_seen:
            raise ListFormatError(
                line_no, f"duplicate header key '{key}' (first on line {first_seen[key]})"
            )
        first_seen[key] = line_no
        if key.startswith("x-"):
            if not _EXT_KEY.fullmatch(key):
                raise ListFormatError(line_no, f"extension key {key!r} needs a name after 'x-'")
            extra[key] = value
        elif key in HEADER_KEYS:
            values[key] = (line_no, value)
        else:
            # Refuse rather than ignore: a future incompatible header must not be
            # silently misread by this version.
            raise ListFormatError(
                line_no,
                f"unknown header key '{key}' (extensions must start with 'x-'; "
                "is this list from a newer pageshare?)",
            )
    raise ListFormatError(
        len(lines), "file ends before the '---' line that ends the header: truncated file?"
    )


@dataclass(frozen=True)
class _Header:
    """The header's values the body is checked against."""

    virtual_size: int
    content: str
    count: int
    count_line: int
    digest: str
    digest_line: int


def _check_header(values: dict[str, tuple[int, str]], sep_line_no: int) -> _Header:
    """The required keys there, each value as pcsl v1 allows it."""
    for key in REQUIRED_KEYS:
        if key not in values:
            raise ListFormatError(sep_line_no, f"header lacks required key '{key}'")

    def uint_of(key: str) -> int:
        line_no, value = values[key]
        return _parse_uint(line_no, key, value)

    virtual_size = uint_of("image-virtual-size")
    content_line, content = values["image-content-sha256"]
    if not _HEX64.fullmatch(content):
        raise ListFormatError(
            content_line,
            f"image-content-sha256 must be 64 lowercase hex digits, got {_show(content)}",
        )
    for key, supported in (("block-size", BLOCK_SIZE), ("sector-size", SECTOR_SIZE)):
        if uint_of(key) != supported:
            raise ListFormatError(
                values[key][0],
                f"unsupported {key} {values[key][1]} (pcsl v{FORMAT_VERSION} supports only "
                f"{supported})",
            )
    hash_line, hash_name = values["hash"]
    if hash_name != HASH_NAME:
        raise ListFormatError(
            hash_line,
            f"unsupported hash {_show(hash_name)} (pcsl v{FORMAT_VERSION} supports only "
            f"{HASH_NAME})",
        )
    count = uint_of("count")
    digest_line, digest = values["list-digest"]
    if not (digest.startswith(f"{HASH_NAME}:") and _HEX64.fullmatch(digest[len(HASH_NAME) + 1 :])):
        raise ListFormatError(
            digest_line,
            f"list-digest must be 'sha256:' and 64 lowercase hex digits, got {_show(digest)}",
        )
    return _Header(virtual_size, content, count, values["count"][0], digest, digest_line)


def _read_body(lines: list[str], sep_index: int, header: _Header) -> dict[int, str]:
    """The body's block lines after the '---' at sep_index: as many as
    'count' says, each a 4 KiB-aligned sector inside the image, ascending,
    with its hash.  Structure only: the digest is checked after."""
    body = lines[sep_index + 1 :]
    first_body_line = sep_index + 2
    count, count_line = header.count, header.count_line
    if len(body) < count:
        raise ListFormatError(
            len(lines),
            f"file ends after {len(body)} of the {count} block lines announced by 'count' "
            f"(line {count_line}): truncated file?",
        )
    if len(body) > count:
        raise ListFormatError(
            first_body_line + count,
            f"unexpected line after the {count} block lines announced by 'count' "
            f"(line {count_line}): trailing garbage or a wrong count",
        )
    blocks: dict[int, str] = {}
    previous = -1
    for offset, line in enumerate(body):
        line_no = first_body_line + offset
        m = _BODY_LINE.fullmatch(line)
        if m is None:
            raise ListFormatError(line_no, _diagnose_body_line(line))
        sector = int(m[1])
        if sector == previous:
            raise ListFormatError(line_no, f"duplicate sector {sector}")
        if sector < previous:
            raise ListFormatError(
                line_no,
                f"sector {sector} follows sector {previous}: the body must be sorted ascending",
            )
        if sector % SECTORS_PER_BLOCK:
            raise ListFormatError(
                line_no,
                f"sector {sector} is not 4 KiB aligned (must be a multiple of {SECTORS_PER_BLOCK})",
            )
        end = sector * SECTOR_SIZE + BLOCK_SIZE
        if end > header.virtual_size:
            raise ListFormatError(
                line_no,
                f"block at sector {sector} (bytes {sector * SECTOR_SIZE}..{end - 1}) extends "
                f"past the image end (image-virtual-size {header.virtual_size})",
            )
        blocks[sector] = m[2]
        previous = sector
    return blocks


def read(path: Path) -> SectorList:
    """Read and validate a list file.  Bad content raises ListFormatError whose
    message starts with the file name; OSErrors (FileNotFoundError...) pass through."""
    path = Path(path)
    return loads_bytes(path.read_bytes(), str(path))


def loads_bytes(data: bytes, name: str = "<bytes>") -> SectorList:
    """Validate the bytes of a list file (``name`` prefixes error messages)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ListFormatError(
            data.count(b"\n", 0, e.start) + 1,
            f"not valid UTF-8 (byte offset {e.start})",
            name,
        ) from None
    try:
        return loads(text)
    except ListFormatError as e:
        raise ListFormatError(e.line, e.reason, name) from None


# --------------------------------------------------------------------------- lists and images


def verify_against_image(sl: SectorList, read_block: Callable[[int], bytes]) -> list[int]:
    """Sorted sectors whose block in the image does not hash to the listed value.

    ``read_block(sector)`` must return the 4096 bytes at ``sector * 512``; a
    wrong-length answer (e.g. the image ends early) counts as a mismatch so the
    caller never preloads that block.
    """
    bad: list[int] = []
    for sector in sl.sorted_sectors():
        data = read_block(sector)
        if len(data) != BLOCK_SIZE or block_hash(data) != sl.blocks[sector]:
            bad.append(sector)
    return bad


_IMAGE_EXTENSIONS = (".qcow2", ".raw", ".img")


def list_file_name(image: ImageIdentity) -> str:
    """The file name the analyzer gives a list: ``<image-name>-<12 hex>.pcsl``.

    The content hash prefix keeps lists of different builds of the same image
    name apart; the name part is the image file name without directory and
    without a .qcow2/.raw/.img extension, reduced to characters that are safe
    in file names.
    """
    stem = Path(image.name).name if image.name else ""
    for ext in _IMAGE_EXTENSIONS:
        if stem.endswith(ext) and len(stem) > len(ext):
            stem = stem[: -len(ext)]
            break
    stem = re.sub(r"[^A-Za-z0-9._-]", "_", stem).lstrip(".") or "image"
    return f"{stem}-{image.content_sha256[:12]}.pcsl"


# --------------------------------------------------------------------------- human view


def extents_runs(sectors: list[int]) -> list[tuple[int, int]]:
    """Contiguous runs of 4 KiB blocks as (start_sector, n_blocks)."""
    runs: list[tuple[int, int]] = []
    for sector in sorted(set(sectors)):
        if runs:
            start, n = runs[-1]
            if sector == start + n * SECTORS_PER_BLOCK:
                runs[-1] = (start, n + 1)
                continue
        runs.append((sector, 1))
    return runs


def _fmt_size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def format_human(sl: SectorList, limit: int | None = 50) -> str:
    """Header summary, run count and the first ``limit`` runs (all if None)."""
    img = sl.image
    mib = sl.total_bytes() / (1 << 20)
    share = ""
    if img.virtual_size:
        share = f" ({100 * sl.total_bytes() / img.virtual_size:.2f}% of the image)"
    lines = [
        f"pcsl v{FORMAT_VERSION} sector list",
        f"image:          {img.name or '(unnamed)'}, virtual size {img.virtual_size} bytes "
        f"({_fmt_size(img.virtual_size)})",
        f"content sha256: {img.content_sha256}",
        f"blocks:         {len(sl.blocks)} x 4 KiB = {mib:.2f} MiB{share}",
        f"list-digest:    {sl.digest()}",
    ]
    for label, value in (
        ("generator", sl.generator),
        ("created", sl.created),
        ("criteria", sl.criteria),
        ("analysis runs", sl.runs),
    ):
        if value:
            lines.append(f"{label + ':':<15} {value}")
    for key, value in sl.extra.items():
        lines.append(f"{key + ':':<15} {value}")
    runs = extents_runs(sl.sorted_sectors())
    lines.append(f"contiguous runs: {len(runs)}")
    shown = runs if limit is None else runs[: max(limit, 0)]
    for start, n in shown:
        end = start + n * SECTORS_PER_BLOCK - 1
        noun = "block" if n == 1 else "blocks"
        lines.append(f"  sector {start}..{end} ({n} {noun}, {n * BLOCK_SIZE // 1024} KiB)")
    if len(shown) < len(runs):
        lines.append(f"  ... {len(runs) - len(shown)} more runs (--all shows every run)")
    return "\n".join(lines)
