"""The page server's pcsl parser (Rust) against the reference (sectorlist.py):
same verdict and same line on valid, hand-broken and randomly mutated lists."""

from __future__ import annotations

import hashlib
import json
import random
import re
import subprocess
from pathlib import Path

import pytest
from page_server_helpers import REPO, server_binary
from pageshare.lists import sectorlist

pytestmark = pytest.mark.build


def rust_verdicts(files: list[Path]) -> dict[str, tuple[bool, int | None]]:
    out: dict[str, tuple[bool, int | None]] = {}
    for i in range(0, len(files), 500):
        batch = files[i : i + 500]
        p = subprocess.run(
            [str(server_binary()), "check-list", "--json", *map(str, batch)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert p.returncode in (0, 1), p.stderr
        for r in json.loads(p.stdout):
            out[r["file"]] = (r["ok"], r.get("line"))
    return out


def python_verdict(path: Path) -> tuple[bool, int | None]:
    try:
        sectorlist.read(path)
        return True, None
    except sectorlist.ListFormatError as e:
        return False, e.line


def valid_texts() -> list[str]:
    rnd = random.Random(1)
    texts = []
    for n in (0, 1, 3, 17, 200):
        blocks = {
            8 * k: hashlib.sha256(bytes([k % 256]) * 7).hexdigest()
            for k in sorted(rnd.sample(range(1, 50_000), n))
        }
        sl = sectorlist.SectorList(
            image=sectorlist.ImageIdentity(
                1 << 30, hashlib.sha256(b"%d" % n).hexdigest(), f"img {n}.qcow2"
            ),
            blocks=blocks,
            generator="test 1.0",
            created="2026-01-01T00:00:00Z",
            criteria="x: y z",
            runs="1",
            extra={"x-note": "tab\there", "x-2": ""},
        )
        texts.append(sectorlist.dumps(sl))
    readme = (REPO / "lists" / "README.md").read_text()
    m = re.search(r"```pcsl\n(.*?)```", readme, re.S)
    assert m
    texts.append(m.group(1))
    return texts


def hand_broken(text: str) -> list[str]:
    lines = text.split("\n")
    sep = lines.index("---")
    body = lines[sep + 1 : -1]
    cases = [
        "",
        "\ufeff" + text,
        text.replace("# pcsl v1", "# pcsl v2", 1),
        text.replace("# pcsl v1", "# PCSL v1", 1),
        text[:-1],
        text + "\n",
        text + "junk\n",
        text.replace("\n", "\r\n"),
        text.replace("block-size: 4096", "block-size: 8192"),
        text.replace("sector-size: 512", "sector-size: 0512"),
        text.replace("hash: sha256", "hash: md5"),
        text.replace("---\n", "--- \n"),
        text.replace("image-name:", "image-name:x"),
        text.replace("image-name:", "Image-name:"),
        text.replace("generator:", "generator: a\x85b"),
        text.replace("generator:", "x-: 1"),
        text.replace("generator:", "unknown-key: 1"),
        text.replace("\n---\n", "\n\n---\n"),
        text.replace("generator:", "# comment\ngenerator:"),
        text.replace("runs:", "runs: 1\nruns:"),
        text.replace("image-virtual-size: ", "image-virtual-size: 99999999999999999999"),
        text.replace("image-virtual-size: ", "image-virtual-size: +"),
        text.replace("list-digest: sha256:", "list-digest: sha1:"),
        text.split("---\n")[0],
    ]
    if len(body) >= 2:
        swapped = [*lines[: sep + 1], body[1], body[0], *body[2:], ""]
        cases.append("\n".join(swapped))
        dup = [*lines[: sep + 1], body[0], body[0], *body[2:], ""]
        cases.append("\n".join(dup))
        s, h = body[0].split(" ")
        for bad in (
            f"{int(s) + 1} {h}",
            f"0{s} {h}",
            f"{s}  {h}",
            f"{s} {h.upper()}",
            f"{s} {h[:-1]}",
            f"{s}\t{h}",
            f"{int(s) + 8 * 10**12} {h}",
        ):
            cases.append("\n".join([*lines[: sep + 1], bad, *body[1:], ""]))
    return cases


def mutate(rnd: random.Random, data: bytes) -> bytes:
    v = bytearray(data)
    pieces = [
        b"\n",
        b"\r",
        b" ",
        b"---\n",
        b"0",
        b"8",
        b"count: ",
        b":",
        b"\xff",
        b"\xe2\x80\xa8",
        b"x-",
        b"#",
        b"\xc2\x85",
    ]
    for _ in range(rnd.randrange(1, 4)):
        at = rnd.randrange(len(v) + 1)
        op = rnd.randrange(5)
        if op == 0 and v:
            v[rnd.randrange(len(v))] ^= 1 << rnd.randrange(8)
        elif op == 1:
            del v[at:]
        elif op == 2:
            v[at:at] = rnd.choice(pieces)
        elif op == 3:
            del v[at : at + rnd.randrange(80)]
        elif v:
            i = rnd.randrange(len(v))
            v[i] = rnd.randrange(32, 127)
    return bytes(v)


def test_rust_and_python_parsers_agree(tmp_path: Path) -> None:
    files: list[Path] = []

    def add(data: bytes) -> None:
        p = tmp_path / f"{len(files):05d}.pcsl"
        p.write_bytes(data)
        files.append(p)

    rnd = random.Random(20261121)
    valid = valid_texts()
    for t in valid:
        add(t.encode())
        for b in hand_broken(t):
            add(b.encode("utf-8", "surrogatepass"))
        for _ in range(400):
            add(mutate(rnd, t.encode()))
    rust = rust_verdicts(files)
    mismatches = []
    accepted = rejected = 0
    for f in files:
        py = python_verdict(f)
        rs = rust[str(f)]
        accepted += py[0]
        rejected += not py[0]
        if py != rs:
            mismatches.append((f.name, py, rs))
    assert not mismatches, f"{len(mismatches)} disagreements, e.g. {mismatches[:5]}"
    # The corpus really exercises both outcomes.
    assert accepted >= len(valid) + 20 and rejected > len(files) // 2, (accepted, rejected)


def test_rust_parser_reports_the_reason(tmp_path: Path) -> None:
    text = valid_texts()[2]
    p = tmp_path / "x.pcsl"
    p.write_text(text.replace("count: 3", "count: 4"))
    out = subprocess.run(
        [str(server_binary()), "check-list", str(p)], capture_output=True, text=True
    )
    assert out.returncode == 1
    assert "truncated file?" in out.stdout
    p.write_text(text)
    out = subprocess.run(
        [str(server_binary()), "check-list", str(p)], capture_output=True, text=True
    )
    assert out.returncode == 0 and "OK" in out.stdout and "3 blocks" in out.stdout
