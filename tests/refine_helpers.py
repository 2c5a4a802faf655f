"""What the `pageshare list refine` tests share: the small golden image as a
raw file of our own (to read its blocks independently of the analyzer), a
parent list made from its real blocks, the fleet's summaries written into a
real Redis as page servers write them (feedback.encode), and the independent
check of a refined list against the image.  (No tests here.)"""

from __future__ import annotations

import hashlib
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
from pageshare import feedback, sectorlist
from pageshare.diskimage import image_content_sha256, raw_file_reader

PAGE = 4096


@dataclass
class Image:
    path: Path
    raw: Path
    vsize: int
    content: str

    @property
    def key(self) -> str:
        return f"{self.vsize}-{self.content}"

    def block_bytes(self, sector: int) -> bytes:
        with open(self.raw, "rb") as f:
            f.seek(sector * 512)
            return f.read(PAGE)


def raw_image(image: Path, raw: Path) -> Image:
    """image converted to raw at raw by qemu-img (the caller removes it)."""
    subprocess.run(["qemu-img", "convert", "-O", "raw", str(image), str(raw)], check=True)
    read_at, size = raw_file_reader(raw)
    return Image(image, raw, size, image_content_sha256(read_at, size))


def parent_list(img: Image, sectors: list[int], path: Path,
                wrong: tuple[int, ...] = ()) -> sectorlist.SectorList:
    """A list as analyze-image writes one (generation 1) of the image's blocks at
    sectors, written to path; the blocks at `wrong` get a hash of other bytes."""
    sl = sectorlist.SectorList(
        image=sectorlist.ImageIdentity(img.vsize, img.content, img.path.name),
        blocks={s: hashlib.sha256(img.block_bytes(s) if s not in wrong else
                                  b"not the image's bytes").hexdigest()
                for s in [*sectors, *wrong]},
        generator="analyze-image 0.1.0", criteria="cross-vm-ksm", runs="1 run(s)")
    sectorlist.write(sl, path)
    return sl


def publish_summaries(url: str, key: str, hosts: dict[str, dict[int, tuple[int, int, int]]],
                      since: float, now: float) -> None:
    """Each host's summary (block -> (guests, reads, flags)) as its page server
    publishes it, replacing what it published before."""
    r = redis.Redis.from_url(url)
    for host, recs in hosts.items():
        guests = max((g for g, _, _ in recs.values()), default=0)
        r.hset(f"pageshare:feedback:{key}:{host}",
               mapping=dict[Any, Any](
                   feedback.encode(host, key, int(since), int(now), guests, recs)))
        r.sadd(f"pageshare:feedback:{key}:hosts", host)


def check_against_image(img: Image, path: Path, expect: set[int]) -> sectorlist.SectorList:
    """The independent check: the list's blocks are expect, each hashing to the
    image's bytes, read here from a raw conversion of our own."""
    sl = sectorlist.read(path)
    assert set(sl.blocks) == expect
    assert (sl.image.virtual_size, sl.image.content_sha256) == (img.vsize, img.content)
    for s, digest in sl.blocks.items():
        data = img.block_bytes(s)
        assert hashlib.sha256(data).hexdigest() == digest, f"sector {s}"
        assert any(data)
    return sl
