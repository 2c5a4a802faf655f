"""Tests for the pcsl v1 sector list (pageshare.lists.sectorlist), its command
(listcli) and image reading (diskimage).

The list decides which bytes page servers preload into guests, so most tests
are about refusing damaged input: every corruption must raise ListFormatError
(naming a line), never yield a silently different list.
"""

import dataclasses
import datetime as dt
import hashlib
import json
import os
import random
import re
import shutil
import stat
import subprocess
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest
from pageshare.image import diskimage as D
from pageshare.lists import listcli as L
from pageshare.lists import sectorlist as S
from pageshare.lists.sectorlist import (
    BLOCK_SIZE,
    SECTOR_SIZE,
    SECTORS_PER_BLOCK,
    ImageIdentity,
    ListFormatError,
    SectorList,
)

HASH_A = "a" * 64
IMAGE_SIZE = 1 << 20  # 256 blocks


def _rand_hash(rng: random.Random) -> str:
    return f"{rng.getrandbits(256):064x}"


def _sample(n: int = 40, seed: int = 1, virtual_size: int = IMAGE_SIZE) -> SectorList:
    rng = random.Random(seed)
    n_blocks = virtual_size // BLOCK_SIZE
    sectors = rng.sample(range(n_blocks), n)
    return SectorList(
        image=ImageIdentity(virtual_size, _rand_hash(rng), "golden-debian12.qcow2"),
        blocks={b * SECTORS_PER_BLOCK: _rand_hash(rng) for b in sectors},
        generator="analyze-image 0.1.0",
        created="2026-01-02T03:04:05Z",
        criteria="clean page-cache pages of the base image, unchanged in all guests",
        runs="3 runs, kept blocks seen in >= 2",
        extra={"x-kernel": "6.1.0-18-amd64", "x-note": "tab\there, ünïcode"},
    )


def _text(
    body: list[str],
    *,
    virtual_size: int = IMAGE_SIZE,
    overrides: dict[str, str | None] | None = None,
    append: list[str] | None = None,
) -> str:
    """A list text with a *correct* count and digest for ``body``, so that tests
    of per-line rules cannot pass just because the digest no longer matches."""
    body_text = "".join(line + "\n" for line in body)
    header: dict[str, str | None] = {
        "image-virtual-size": str(virtual_size),
        "image-content-sha256": HASH_A,
        "image-name": "img.raw",
        "block-size": "4096",
        "sector-size": "512",
        "hash": "sha256",
        "count": str(len(body)),
        "list-digest": "sha256:" + hashlib.sha256(body_text.encode()).hexdigest(),
        "generator": "test",
        "created": "2026-01-02T03:04:05Z",
        "criteria": "",
        "runs": "",
    }
    header.update(overrides or {})
    lines = ["# pcsl v1"]
    lines += [f"{k}: {v}" for k, v in header.items() if v is not None]
    lines += append or []
    lines.append("---")
    return "\n".join(lines) + "\n" + body_text


def _error(text: str) -> ListFormatError:
    with pytest.raises(ListFormatError) as info:
        S.loads(text)
    return info.value


def _line_of(text: str, prefix: str) -> int:
    for number, line in enumerate(text.split("\n"), start=1):
        if line.startswith(prefix):
            return number
    raise AssertionError(f"no line starts with {prefix!r}")


# --------------------------------------------------------------------------- round trip


def test_constants() -> None:
    assert (S.FORMAT_VERSION, BLOCK_SIZE, SECTOR_SIZE, SECTORS_PER_BLOCK) == (1, 4096, 512, 8)


def test_round_trip_dumps_loads() -> None:
    sl = _sample()
    text = S.dumps(sl)
    assert text.startswith("# pcsl v1\n")
    loaded = S.loads(text)
    assert loaded == sl
    assert loaded.image == sl.image
    assert loaded.extra == sl.extra and list(loaded.extra) == list(sl.extra)
    assert S.dumps(loaded) == text


def test_header_written_in_documented_order() -> None:
    text = S.dumps(_sample())
    header = text.split("\n---\n")[0].split("\n")[1:]
    keys = [line.split(":")[0] for line in header]
    assert keys == [*S.HEADER_KEYS, "x-kernel", "x-note"]
    assert f"count: {len(_sample().blocks)}" in header
    assert f"list-digest: {_sample().digest()}" in header


def test_write_read_round_trip(tmp_path: Path) -> None:
    sl = _sample()
    path = tmp_path / "golden-0123456789ab.pcsl"
    S.write(sl, path)
    assert S.read(path) == sl
    assert path.read_text() == S.dumps(sl)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp file left


def test_write_replaces_atomically_and_keeps_mode(tmp_path: Path) -> None:
    path = tmp_path / "l.pcsl"
    S.write(_sample(seed=1), path)
    path.chmod(0o640)
    second = _sample(seed=2)
    S.write(second, path)
    assert S.read(path) == second
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert len(list(tmp_path.iterdir())) == 1


def test_write_refuses_invalid_list_and_leaves_no_file(tmp_path: Path) -> None:
    bad = _sample()
    bad.blocks[3] = HASH_A  # unaligned
    with pytest.raises(ValueError, match="aligned"):
        S.write(bad, tmp_path / "x.pcsl")
    assert list(tmp_path.iterdir()) == []


def test_created_is_filled_when_empty() -> None:
    sl = dataclasses.replace(_sample(), created="")
    loaded = S.loads(S.dumps(sl))
    assert sl.created == ""  # the caller's object is not modified
    stamp = dt.datetime.strptime(loaded.created, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.UTC)
    assert abs((dt.datetime.now(dt.UTC) - stamp).total_seconds()) < 60
    assert dataclasses.replace(loaded, created="") == sl


def test_empty_list_round_trips() -> None:
    sl = SectorList(ImageIdentity(0, HASH_A), {}, created="2026-01-01T00:00:00Z")
    text = S.dumps(sl)
    assert "count: 0\n" in text and text.endswith("---\n")
    assert S.loads(text) == sl
    assert sl.digest() == "sha256:" + hashlib.sha256(b"").hexdigest()


def test_empty_free_text_values_round_trip() -> None:
    sl = SectorList(ImageIdentity(IMAGE_SIZE, HASH_A), {8: HASH_A}, created="now")
    text = S.dumps(sl)
    assert "\ngenerator:\n" in text  # no trailing space for empty values
    assert S.loads(text) == sl
    # A writer that keeps the trailing space is read the same way.
    assert S.loads(text.replace("\ngenerator:\n", "\ngenerator: \n")) == sl


def test_optional_informational_keys_may_be_missing() -> None:
    text = _text(
        [f"8 {HASH_A}"],
        overrides={k: None for k in ("image-name", "generator", "created", "criteria", "runs")},
    )
    sl = S.loads(text)
    assert sl.blocks == {8: HASH_A}
    assert (sl.image.name, sl.generator, sl.created, sl.criteria, sl.runs) == ("",) * 5


def test_sectorlist_helpers() -> None:
    sl = SectorList(ImageIdentity(IMAGE_SIZE, HASH_A), {16: "b" * 64, 0: HASH_A})
    assert sl.sorted_sectors() == [0, 16]
    assert sl.body_bytes() == f"0 {HASH_A}\n16 {'b' * 64}\n".encode()
    assert sl.digest() == "sha256:" + hashlib.sha256(sl.body_bytes()).hexdigest()
    assert sl.total_bytes() == 2 * 4096


def test_block_hash() -> None:
    data = bytes(range(256)) * 16
    assert S.block_hash(data) == hashlib.sha256(data).hexdigest()
    for size in (0, 4095, 4097, 8192):
        with pytest.raises(ValueError):
            S.block_hash(bytes(size))


def test_digest_changes_when_any_block_changes() -> None:
    sl = _sample(n=10)
    original = sl.digest()
    for sector in sl.sorted_sectors():
        changed = dict(sl.blocks)
        h = changed[sector]
        changed[sector] = h[:-1] + ("0" if h[-1] != "0" else "1")
        assert dataclasses.replace(sl, blocks=changed).digest() != original
        removed = {s: v for s, v in sl.blocks.items() if s != sector}
        assert dataclasses.replace(sl, blocks=removed).digest() != original
    free = next(s for s in range(0, IMAGE_SIZE // 512, 8) if s not in sl.blocks)
    assert dataclasses.replace(sl, blocks={**sl.blocks, free: HASH_A}).digest() != original


@pytest.mark.parametrize(
    "mutate",
    [
        lambda sl: sl.blocks.__setitem__(4, HASH_A),
        lambda sl: sl.blocks.__setitem__(IMAGE_SIZE // 512, HASH_A),
        lambda sl: sl.blocks.__setitem__(-8, HASH_A),
        lambda sl: sl.blocks.__setitem__(8, "A" * 64),
        lambda sl: sl.blocks.__setitem__(8, "a" * 63),
        lambda sl: sl.extra.__setitem__("kernel", "x"),
        lambda sl: sl.extra.__setitem__("x-", "x"),
        lambda sl: sl.extra.__setitem__("x-ok", "two\nlines"),
        lambda sl: setattr(sl, "criteria", "a\rb"),
        lambda sl: setattr(sl, "image", ImageIdentity(IMAGE_SIZE, "A" * 64)),
        lambda sl: setattr(sl, "image", ImageIdentity(IMAGE_SIZE, HASH_A, "x\ny")),
    ],
)
def test_dumps_refuses_unwritable_lists(mutate: Callable[[SectorList], object]) -> None:
    sl = SectorList(ImageIdentity(IMAGE_SIZE, HASH_A), {0: HASH_A}, created="t")
    mutate(sl)
    with pytest.raises(ValueError, match="cannot write list"):
        S.dumps(sl)


# --------------------------------------------------------------------------- corruption


def test_flipped_hex_char_in_body_is_a_digest_error() -> None:
    text = S.dumps(_sample())
    body_start = text.index("\n---\n") + 5
    pos = body_start + text[body_start:].index(" ") + 10  # inside the first hash
    flipped = "0" if text[pos] != "0" else "1"
    err = _error(text[:pos] + flipped + text[pos + 1 :])
    assert "list body does not match list-digest: file corrupted or edited" in str(err)
    assert err.line == _line_of(text, "list-digest:")
    assert str(err).startswith(f"line {err.line}: ")


def test_deleted_body_line_is_a_count_error() -> None:
    text = S.dumps(_sample())
    lines = text.split("\n")
    del lines[_line_of(text, "---") + 3]
    err = _error("\n".join(lines))
    assert "announced by 'count'" in err.reason
    assert f"(line {_line_of(text, 'count:')})" in err.reason


def test_every_truncation_is_an_error() -> None:
    text = S.dumps(_sample(n=12))
    for cut in range(len(text)):
        with pytest.raises(ListFormatError):
            S.loads(text[:cut])


def test_truncation_messages_name_the_problem() -> None:
    text = S.dumps(_sample(n=12))
    assert "no terminating newline" in _error(text[:-1]).reason
    lines = text.split("\n")
    assert "truncated" in _error("\n".join(lines[:-3]) + "\n").reason
    header_only = text[: text.index("\n---\n") + 1]
    err = _error(header_only)
    assert "'---'" in err.reason and "truncated" in err.reason
    assert err.line == header_only.count("\n")


def test_swapped_lines_are_a_sort_error() -> None:
    body = [f"{s} {HASH_A}" for s in (0, 8, 16, 24)]
    body[1], body[2] = body[2], body[1]
    err = _error(_text(body))
    assert "sorted ascending" in err.reason
    assert err.line == _line_of(_text(body), "8 ")
    # The same via a real list whose digest then no longer matches: the sort
    # error is still what is reported, because the structure is checked first.
    text = S.dumps(_sample())
    lines = text.split("\n")
    first = _line_of(text, "---")
    lines[first], lines[first + 1] = lines[first + 1], lines[first]
    assert "sorted ascending" in _error("\n".join(lines)).reason


def test_duplicate_sector() -> None:
    err = _error(_text([f"8 {HASH_A}", f"8 {'b' * 64}"]))
    assert "duplicate sector 8" in err.reason


def test_unaligned_sector() -> None:
    text = _text([f"0 {HASH_A}", f"12 {HASH_A}"])
    err = _error(text)
    assert "not 4 KiB aligned" in err.reason
    assert err.line == _line_of(text, "12 ")


def test_sector_past_end() -> None:
    last = IMAGE_SIZE // SECTOR_SIZE - SECTORS_PER_BLOCK
    assert S.loads(_text([f"{last} {HASH_A}"])).blocks == {last: HASH_A}  # exactly fits
    err = _error(_text([f"{last + 8} {HASH_A}"]))
    assert "past the image end" in err.reason
    # A block only partly inside the image is refused too.
    err = _error(_text([f"{last} {HASH_A}"], virtual_size=IMAGE_SIZE - 512))
    assert "past the image end" in err.reason


@pytest.mark.parametrize(
    ("line", "expect"),
    [
        ("8 " + "A" * 64, "malformed hash"),
        ("8 " + "a" * 63, "malformed hash"),
        ("8 " + "a" * 65, "malformed hash"),
        ("8 " + "g" * 64, "malformed hash"),
        ("08 " + "a" * 64, "not a decimal integer"),
        ("+8 " + "a" * 64, "not a decimal integer"),
        ("８ " + "a" * 64, "not a decimal integer"),  # full-width digit: int() would accept it
        ("8  " + "a" * 64, "single space"),
        ("8\t" + "a" * 64, "single space"),
        ("8 " + "a" * 64 + " x", "single space"),
        ("8 " + "a" * 64 + "\r", "CRLF"),
        ("", "empty line"),
        ("9" * 40 + " " + "a" * 64, "too large"),
    ],
)
def test_malformed_body_lines(line: str, expect: str) -> None:
    text = _text([f"0 {HASH_A}", line])
    err = _error(text)
    assert expect in err.reason
    assert err.line == len(text.split("\n")) - 1


def test_unknown_header_key() -> None:
    text = _text([], append=["compression: zstd"])
    err = _error(text)
    assert "unknown header key 'compression'" in err.reason
    assert err.line == _line_of(text, "compression")


def test_x_keys_are_preserved() -> None:
    text = _text([f"8 {HASH_A}"], append=["x-kernel: 6.1", "x-empty:"])
    sl = S.loads(text)
    assert sl.extra == {"x-kernel": "6.1", "x-empty": ""}
    again = S.loads(S.dumps(sl))
    assert again.extra == sl.extra
    assert "x-kernel: 6.1\nx-empty:\n---\n" in S.dumps(sl)


def test_comments_in_header_are_ignored() -> None:
    text = _text([f"8 {HASH_A}"], append=["# a comment", "#another"])
    assert S.loads(text).blocks == {8: HASH_A}


@pytest.mark.parametrize(
    ("first", "expect"),
    [
        ("# pcsl v2", "unsupported format version pcsl v2"),
        ("# pcsl v1 ", "not a pcsl sector list"),
        ("#pcsl v1", "not a pcsl sector list"),
        ("# PCSL v1", "not a pcsl sector list"),
        ("\ufeff# pcsl v1", "byte-order mark"),
        ("# pcsl v1\r", "CRLF"),
        ("image-virtual-size: 1", "not a pcsl sector list"),
    ],
)
def test_bad_magic(first: str, expect: str) -> None:
    text = _text([]).replace("# pcsl v1", first, 1)
    err = _error(text)
    assert expect in err.reason
    assert err.line == 1


def test_empty_text() -> None:
    assert _error("").line == 1


def test_missing_header_key() -> None:
    for key in S.REQUIRED_KEYS:
        text = _text([f"8 {HASH_A}"], overrides={key: None})
        err = _error(text)
        assert f"lacks required key '{key}'" in err.reason
        assert err.line == _line_of(text, "---")


def test_duplicate_header_key() -> None:
    text = _text([], append=["generator: again"])
    err = _error(text)
    assert "duplicate header key 'generator'" in err.reason
    assert f"first on line {_line_of(text, 'generator')}" in err.reason
    assert err.line == _line_of(text, "generator: again")
    assert "duplicate" in _error(_text([], append=["x-a: 1", "x-a: 1"])).reason


@pytest.mark.parametrize(
    ("key", "value", "expect"),
    [
        ("image-virtual-size", "1M", "decimal integer"),
        ("image-virtual-size", " 1048576", "decimal integer"),
        ("image-virtual-size", "1_048_576", "decimal integer"),
        ("image-virtual-size", "-1", "decimal integer"),
        ("image-virtual-size", "9" * 30, "too large"),
        ("count", "01", "decimal integer"),
        ("count", "", "decimal integer"),
        ("block-size", "8192", "unsupported block-size 8192"),
        ("block-size", "4k", "decimal integer"),
        ("sector-size", "4096", "unsupported sector-size 4096"),
        ("hash", "sha1", "unsupported hash"),
        ("image-content-sha256", "A" * 64, "64 lowercase hex"),
        ("list-digest", "a" * 64, "list-digest must be 'sha256:'"),
        ("list-digest", "md5:" + "a" * 64, "list-digest must be 'sha256:'"),
        ("list-digest", "sha256:" + "a" * 64, "does not match list-digest"),
        ("count", "2", "announced by 'count'"),
        ("count", "0", "trailing garbage"),
        ("image-name", "a\x00b", "control character"),
    ],
)
def test_bad_header_values(key: str, value: str, expect: str) -> None:
    text = _text([f"8 {HASH_A}"], overrides={key: value})
    err = _error(text)
    assert expect in err.reason
    assert re.fullmatch(r"line \d+: .+", str(err), re.DOTALL)


@pytest.mark.parametrize(
    ("line", "expect"),
    [
        ("generator:x", "expected a space"),
        ("just text", "expected a 'key: value'"),
        ("Generator: x", "expected a 'key: value'"),
        ("", "expected a 'key: value'"),
        ("x-: 1", "needs a name after 'x-'"),
        ("criteria: x\r", "CRLF"),
    ],
)
def test_malformed_header_lines(line: str, expect: str) -> None:
    text = _text([], append=[line])
    err = _error(text)
    assert expect in err.reason
    assert err.line == len(text.split("\n")) - 2


def test_trailing_garbage() -> None:
    text = S.dumps(_sample(n=5)) + "garbage\n"
    err = _error(text)
    assert "trailing garbage" in err.reason
    assert err.line == len(text.split("\n")) - 1
    assert "trailing garbage" in _error(S.dumps(_sample(n=5)) + "\n").reason


def test_read_reports_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.pcsl"
    path.write_text(_text([f"4 {HASH_A}"]))
    with pytest.raises(ListFormatError) as info:
        S.read(path)
    assert str(info.value).startswith(f"{path}: line {info.value.line}: ")
    assert info.value.source == str(path)


def test_read_invalid_utf8(tmp_path: Path) -> None:
    path = tmp_path / "bad.pcsl"
    good = S.dumps(_sample(n=3)).encode()
    third_line = good.index(b"\n", good.index(b"\n") + 1) + 1
    path.write_bytes(good[:third_line] + b"\xff" + good[third_line:])
    with pytest.raises(ListFormatError) as info:
        S.read(path)
    assert info.value.line == 3
    assert "UTF-8" in info.value.reason


def test_read_missing_file_passes_through(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        S.read(tmp_path / "nope.pcsl")


# --------------------------------------------------------------------------- fuzz

_FUZZ_CHARS = "0123456789abcdef" * 4 + " \n\r\t:#-x_AF+.\x00é\u2028\ufeff"


def _mutate(rng: random.Random, text: str) -> tuple[str, int, str]:
    """One random edit: (mutated text, position, kind)."""
    kind = rng.choice(["flip", "insert", "delete", "truncate"])
    if kind == "truncate":
        pos = rng.randrange(len(text))
        return text[:pos], pos, kind
    if kind == "insert":
        pos = rng.randrange(len(text) + 1)
        return text[:pos] + rng.choice(_FUZZ_CHARS) + text[pos:], pos, kind
    pos = rng.randrange(len(text))
    if kind == "delete":
        return text[:pos] + text[pos + 1 :], pos, kind
    new = rng.choice([c for c in _FUZZ_CHARS if c != text[pos]])
    return text[:pos] + new + text[pos + 1 :], pos, kind


def _check_mutation(
    original: SectorList, body_start: int, load: Callable[[], SectorList], pos: int, kind: str
) -> bool:
    """True if the mutated list loaded; fails the test if that is not allowed."""
    try:
        loaded = load()
    except ListFormatError as e:
        assert re.match(r"(.+: )?line \d+: ", str(e)), str(e)
        return False
    except Exception as e:  # pragma: no cover - the failure we are looking for
        pytest.fail(f"{kind} at {pos}: {type(e).__name__} instead of ListFormatError: {e}")
    # Only the header's free text and identity are outside list-digest; a body
    # edit must never load, and no accepted edit may change which blocks or
    # hashes are preloaded.
    assert pos < body_start, f"{kind} at {pos} in the body was accepted"
    assert loaded.blocks == original.blocks, f"{kind} at {pos} changed the blocks"
    return True


def test_fuzz_mutations_never_yield_a_different_list() -> None:
    original = _sample(n=30, seed=7)
    text = S.dumps(original)
    text = text.replace("\n---\n", "\n# comment line\n---\n")
    assert S.loads(text) == original
    body_start = text.index("\n---\n") + 5
    rng = random.Random(20240601)
    outcomes = {True: 0, False: 0}
    for _ in range(2000):
        mutated, pos, kind = _mutate(rng, text)
        loaded = _check_mutation(original, body_start, partial(S.loads, mutated), pos, kind)
        outcomes[loaded] += 1
    # Both outcomes must occur, or the mutations were not exercising anything.
    assert outcomes[False] > 1000 and outcomes[True] > 10, outcomes


def test_fuzz_byte_mutations_through_read(tmp_path: Path) -> None:
    original = _sample(n=20, seed=8)
    data = S.dumps(original).encode()
    body_start = data.index(b"\n---\n") + 5
    rng = random.Random(99)
    path = tmp_path / "f.pcsl"
    for _ in range(300):
        pos = rng.randrange(len(data))
        kind = rng.choice(["flip", "insert", "delete"])
        if kind == "flip":
            mutated = data[:pos] + bytes([rng.randrange(256)]) + data[pos + 1 :]
        elif kind == "insert":
            mutated = data[:pos] + bytes([rng.randrange(256)]) + data[pos:]
        else:
            mutated = data[:pos] + data[pos + 1 :]
        if mutated == data:
            continue
        path.write_bytes(mutated)
        _check_mutation(original, body_start, partial(S.read, path), pos, kind)


# --------------------------------------------------------------------------- images


def _make_image(path: Path, n_blocks: int = 64, seed: int = 3) -> bytes:
    data = random.Random(seed).randbytes(n_blocks * BLOCK_SIZE)
    path.write_bytes(data)
    return data


def _list_for(data: bytes, sectors: list[int], name: str = "img.raw") -> SectorList:
    return SectorList(
        image=ImageIdentity(len(data), hashlib.sha256(data).hexdigest(), name),
        blocks={
            s: S.block_hash(data[s * SECTOR_SIZE : s * SECTOR_SIZE + BLOCK_SIZE]) for s in sectors
        },
        generator="test",
        created="2026-01-02T03:04:05Z",
    )


def test_verify_against_image_reports_exactly_the_changed_block(tmp_path: Path) -> None:
    image = tmp_path / "img.raw"
    data = _make_image(image)
    sectors = [0, 8, 16, 80, 256, 504]
    sl = _list_for(data, sectors)
    read_at, size = D.raw_file_reader(image)
    assert size == len(data)

    def read_block(sector: int) -> bytes:
        return read_at(sector * SECTOR_SIZE, BLOCK_SIZE)

    assert S.verify_against_image(sl, read_block) == []
    with open(image, "r+b") as f:  # change one byte of the block at sector 80
        f.seek(80 * SECTOR_SIZE + 1000)
        old = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([old[0] ^ 0xFF]))
    assert S.verify_against_image(sl, read_block) == [80]
    # An unlisted block changing does not matter.
    with open(image, "r+b") as f:
        f.seek(24 * SECTOR_SIZE)
        f.write(b"x" * 100)
    assert S.verify_against_image(sl, read_block) == [80]


def test_verify_against_image_short_read_is_a_mismatch() -> None:
    sl = SectorList(ImageIdentity(IMAGE_SIZE, HASH_A), {0: S.block_hash(bytes(4096)), 8: HASH_A})
    assert S.verify_against_image(sl, lambda s: bytes(4096) if s == 0 else b"") == [8]


def test_image_content_sha256_matches_file_hash(tmp_path: Path) -> None:
    image = tmp_path / "img.raw"
    data = _make_image(image, n_blocks=300) + b"tail"  # size not a multiple of chunk
    image.write_bytes(data)
    read_at, size = D.raw_file_reader(image)
    expected = hashlib.sha256(data).hexdigest()
    assert D.image_content_sha256(read_at, size) == expected
    assert D.image_content_sha256(read_at, size, chunk=4096 * 7 + 3) == expected
    assert D.image_content_sha256(read_at, 0) == hashlib.sha256(b"").hexdigest()


def test_image_content_sha256_rejects_short_reader() -> None:
    with pytest.raises(ValueError, match="reader returned"):
        D.image_content_sha256(lambda off, n: bytes(n - 1), 10000)


def test_raw_file_reader_zero_fills_past_eof(tmp_path: Path) -> None:
    image = tmp_path / "small.raw"
    image.write_bytes(b"abc")
    read_at, size = D.raw_file_reader(image)
    assert size == 3
    assert read_at(0, 3) == b"abc"
    assert read_at(1, 6) == b"bc\0\0\0\0"
    assert read_at(100, 4) == bytes(4)
    assert read_at(0, 0) == b""


def test_readme_example_is_valid() -> None:
    readme = Path(__file__).resolve().parents[2] / "lists" / "README.md"
    match = re.search(r"```pcsl\n(.*?)```", readme.read_text(), re.DOTALL)
    assert match, "lists/README.md lost its example"
    sl = S.loads(match[1])
    assert S.dumps(sl) == match[1]
    assert sl.extra == {"x-guest-kernel": "6.1.0-27-amd64"}
    assert S.list_file_name(sl.image) == "debian12-golden-0d85f5af1e0d.pcsl"
    assert f"lists/{S.list_file_name(sl.image)}" in readme.read_text()


@pytest.mark.parametrize(
    ("name", "expect"),
    [
        ("debian12-golden.qcow2", "debian12-golden"),
        ("/var/lib/images/base.raw", "base"),
        ("disk.img", "disk"),
        ("disk.vmdk", "disk.vmdk"),
        ("my image (v2).qcow2", "my_image__v2_"),
        (".qcow2", "qcow2"),  # a dot file: no extension to strip, no leading dot kept
        ("", "image"),
        ("..", "image"),
    ],
)
def test_list_file_name(name: str, expect: str) -> None:
    image = ImageIdentity(IMAGE_SIZE, "0123456789ab" + "f" * 52, name)
    assert S.list_file_name(image) == f"{expect}-0123456789ab.pcsl"


# --------------------------------------------------------------------------- human view


def test_extents_runs() -> None:
    assert S.extents_runs([]) == []
    assert S.extents_runs([0]) == [(0, 1)]
    assert S.extents_runs([0, 8, 16, 32, 40, 100 * 8]) == [(0, 3), (32, 2), (800, 1)]
    assert S.extents_runs([16, 0, 8, 8]) == [(0, 3)]  # unsorted, duplicate


def test_format_human() -> None:
    sl = SectorList(
        ImageIdentity(IMAGE_SIZE, HASH_A, "golden.qcow2"),
        {s: HASH_A for s in [0, 8, 16, 64, 128, 136]} | {s: HASH_A for s in range(1024, 2048, 8)},
        generator="analyze-image 0.1.0",
        runs="3 runs",
    )
    out = S.format_human(sl)
    assert "golden.qcow2" in out
    assert f"{len(sl.blocks)} x 4 KiB" in out
    assert f"{len(sl.blocks) * 4096 / 2**20:.2f} MiB" in out
    assert sl.digest() in out
    assert "contiguous runs: 4" in out
    assert "sector 0..23 (3 blocks, 12 KiB)" in out
    assert "sector 64..71 (1 block, 4 KiB)" in out
    assert "sector 1024..2047 (128 blocks, 512 KiB)" in out
    short = S.format_human(sl, limit=2)
    assert "sector 64..71" in short and "sector 128" not in short
    assert "2 more runs" in short


# --------------------------------------------------------------------------- CLI


def _setup(tmp_path: Path) -> tuple[Path, Path, bytes]:
    image = tmp_path / "img.raw"
    data = _make_image(image)
    lst = tmp_path / "img.pcsl"
    S.write(_list_for(data, [0, 8, 16, 200, 304]), lst)
    return lst, image, data


def test_cli_show(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lst, _, _ = _setup(tmp_path)
    assert L.main(["show", str(lst)]) == 0
    out = capsys.readouterr().out
    assert "5 x 4 KiB" in out and "MiB" in out and "contiguous runs: 3" in out
    assert L.main(["show", str(lst), "--all"]) == 0
    assert "sector 200..207" in capsys.readouterr().out


def test_cli_show_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lst, _, data = _setup(tmp_path)
    assert L.main(["show", str(lst), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["count"] == 5 and doc["bytes"] == 5 * 4096
    assert doc["runs"] == [[0, 3], [200, 1], [304, 1]] and doc["run_count"] == 3
    assert doc["header"]["image-virtual-size"] == len(data)
    assert doc["header"]["image-content-sha256"] == hashlib.sha256(data).hexdigest()
    assert doc["header"]["list-digest"] == S.read(lst).digest()


def test_cli_verify_raw(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lst, image, _ = _setup(tmp_path)
    assert L.main(["verify", str(lst), "--image", str(image)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("OK: ") and out.count("\n") == 1

    assert L.main(["verify", str(lst), "--image", str(image), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is True and doc["bad_sectors"] == [] and doc["image_format"] == "raw"
    assert doc["content_sha256"]["ok"] is True and doc["virtual_size"]["ok"] is True

    with open(image, "r+b") as f:
        f.seek(200 * 512 + 7)
        f.write(b"\x00\x01")
    assert L.main(["verify", str(lst), "--image", str(image)]) == 1
    out = capsys.readouterr().out
    assert out.startswith("MISMATCH: ") and "1 of 5 blocks differ (sectors 200)" in out
    assert "content sha256 differs" in out

    assert L.main(["verify", str(lst), "--image", str(image), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is False and doc["bad_sectors"] == [200]
    assert doc["content_sha256"]["ok"] is False

    args = ["verify", str(lst), "--image", str(image), "--no-content-hash", "--json"]
    assert L.main(args) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["content_sha256"]["ok"] is None and doc["content_sha256"]["image"] is None


def test_cli_verify_content_change_outside_the_list(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lst, image, _ = _setup(tmp_path)
    with open(image, "r+b") as f:  # block at sector 96 is not listed
        f.seek(96 * 512)
        f.write(b"changed")
    assert L.main(["verify", str(lst), "--image", str(image)]) == 1
    assert "content sha256 differs" in capsys.readouterr().out
    assert L.main(["verify", str(lst), "--image", str(image), "--no-content-hash"]) == 0
    assert "content sha256 not checked" in capsys.readouterr().out


def test_cli_verify_size_mismatch(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lst, image, data = _setup(tmp_path)
    image.write_bytes(data + bytes(4096))
    assert L.main(["verify", str(lst), "--image", str(image), "--no-content-hash"]) == 1
    assert f"virtual size {len(data) + 4096} != {len(data)}" in capsys.readouterr().out


def _qcow2_from(raw: Path, qcow2: Path) -> None:
    subprocess.run(
        ["qemu-img", "convert", "-f", "raw", "-O", "qcow2", str(raw), str(qcow2)],
        check=True,
        capture_output=True,
    )
    assert qcow2.read_bytes()[:4] == D.QCOW2_MAGIC


def test_cli_verify_qcow2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lst, image, _ = _setup(tmp_path)
    qcow2 = tmp_path / "img.qcow2"
    _qcow2_from(image, qcow2)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    args = ["verify", str(lst), "--image", str(qcow2), "--tmpdir", str(scratch)]
    assert L.main([*args, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is True and doc["image_format"] == "qcow2"
    assert doc["content_sha256"]["ok"] is True  # layout independent identity
    assert list(scratch.iterdir()) == []  # temporary raw removed

    with open(image, "r+b") as f:
        f.seek(16 * 512)
        f.write(b"different")
    _qcow2_from(image, qcow2)
    assert L.main(args) == 1
    assert "(sectors 16)" in capsys.readouterr().out
    assert list(scratch.iterdir()) == []


def test_cli_verify_qcow2_without_qemu_img(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    lst, image, _ = _setup(tmp_path)
    qcow2 = tmp_path / "img.qcow2"
    _qcow2_from(image, qcow2)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert L.main(["verify", str(lst), "--image", str(qcow2)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "qemu-img is not installed" in err


def test_cli_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lst, image, _ = _setup(tmp_path)
    assert L.main(["show", str(tmp_path / "missing.pcsl")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "missing.pcsl" in err

    bad = tmp_path / "bad.pcsl"
    bad.write_text(lst.read_text().replace("block-size: 4096", "block-size: 512"))
    assert L.main(["verify", str(bad), "--image", str(image)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {bad}: line ") and "unsupported block-size" in err

    assert L.main(["verify", str(lst), "--image", str(tmp_path / "none.img")]) == 2
    assert capsys.readouterr().err.startswith("error: ")

    for argv in ([], ["frobnicate"], ["verify", str(lst)], ["show"]):
        assert L.main(argv) == 2
        assert capsys.readouterr().err.startswith("error: ")


def test_cli_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert L.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "pageshare list" in out and "lists/README.md" in out
    assert L.main(["verify", "--help"]) == 0
    assert "--no-content-hash" in capsys.readouterr().out
