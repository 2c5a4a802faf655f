"""Where an LVM logical volume's bytes are on the disk, read from the PV's own metadata.

No device-mapper is needed (or available on the hosts that analyze images):
the physical volume's label (sector 1, "LABELONE") gives its UUID, where its
extents start and where its metadata area is; the metadata area's header
points at the current text copy of the volume group's metadata, which lists
every logical volume's segments.  A linear segment (type "striped" with one
stripe) is a run of extents on one PV, so a byte of the LV maps to exactly
one byte of the disk.  Anything else (striped over several PVs, mirror,
raid, thin, cache, snapshots' COW) is refused by the caller with the reason.
"""

import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pageshare.errors import PageshareError

SECTOR = 512
LABEL_ID = b"LABELONE"
LABEL_TYPE = b"LVM2 001"
MDA_MAGIC = b" LVM2 x[5A%r0N*>"

Reader = Callable[[int, int], bytes]  # (byte offset, size) -> bytes of one device


class LvmError(PageshareError, ValueError):
    pass


@dataclass(frozen=True)
class PvLabel:
    uuid: str  # as the metadata writes it: 6-4-4-4-4-4-6
    pe_start: int  # bytes from the PV's start to its first extent
    metadata: str  # the current VG metadata text ("" if the PV has none)


@dataclass(frozen=True)
class Segment:
    """A run of an LV's sectors on the disk: LV sectors [lv_start, lv_start + sectors)
    are disk sectors [disk_start, disk_start + sectors)."""

    lv_start: int
    sectors: int
    disk_start: int


def _uuid(raw: bytes) -> str:
    s = raw.decode("ascii")
    return "-".join(
        s[a:b] for a, b in ((0, 6), (6, 10), (10, 14), (14, 18), (18, 22), (22, 26), (26, 32))
    )


def read_label(read: Reader) -> PvLabel | None:
    """The PV label in the first four sectors of a device, None if it is no PV."""
    for n in range(4):
        sector = read(n * SECTOR, SECTOR)
        if sector[:8] == LABEL_ID and sector[24:32] == LABEL_TYPE:
            break
    else:
        return None
    (offset,) = struct.unpack_from("<I", sector, 20)
    pvh = sector[offset:]
    uuid = _uuid(pvh[:32])
    pos = 40  # after the UUID and device_size_xl
    areas: list[list[tuple[int, int]]] = [[], []]  # data areas, then metadata areas
    for kind in (0, 1):
        while pos + 16 <= len(pvh):
            off, size = struct.unpack_from("<QQ", pvh, pos)
            pos += 16
            if off == 0:
                break
            areas[kind].append((off, size))
    if not areas[0]:
        raise LvmError("PV label without a data area")
    pe_start = areas[0][0][0]
    text = ""
    for mda_off, mda_size in areas[1]:
        text = _metadata_text(read, mda_off, mda_size)
        if text:
            break
    return PvLabel(uuid, pe_start, text)


def _metadata_text(read: Reader, mda_off: int, mda_size: int) -> str:
    header = read(mda_off, SECTOR)
    if header[4:20] != MDA_MAGIC:
        raise LvmError(f"no LVM2 metadata area header at byte {mda_off}")
    start, size = struct.unpack_from("<QQ", header, 24)
    off, length = struct.unpack_from("<QQ", header, 40)
    if not length:
        return ""
    # The area is a ring after its 512-byte header: a copy may wrap to its start.
    first = min(length, size - off)
    data = read(start + off, first)
    if first < length:
        data += read(start + SECTOR, length - first)
    return data.rstrip(b"\0").decode("utf-8", "replace")


_TOKEN = re.compile(r'\s*(?:#[^\n]*|("(?:[^"\\]|\\.)*")|([\w.+\-]+)|(\S))')


def parse_config(text: str) -> dict[str, Any]:
    """LVM's configuration syntax: `name { ... }` sections, `key = value` with
    numbers, "strings" and [lists]."""
    tokens: list[tuple[str, Any]] = []
    for m in _TOKEN.finditer(text):
        if m.group(1) is not None:
            tokens.append(("value", m.group(1)[1:-1].replace('\\"', '"')))
        elif m.group(2) is not None:
            word = m.group(2)
            tokens.append(("value", int(word)) if re.fullmatch(r"-?\d+", word) else ("word", word))
        elif m.group(3) is not None:
            tokens.append(("punct", m.group(3)))
    pos = 0

    def section() -> dict[str, Any]:
        nonlocal pos
        out: dict[str, Any] = {}
        while pos < len(tokens):
            kind, name = tokens[pos]
            if (kind, name) == ("punct", "}"):
                pos += 1
                return out
            if kind != "word":
                raise LvmError(f"unexpected {name!r} in LVM metadata")
            nxt = tokens[pos + 1][1] if pos + 1 < len(tokens) else None
            pos += 2
            if nxt == "{":
                out[name] = section()
            elif nxt == "=":
                out[name] = value()
            else:
                raise LvmError(f"unexpected {nxt!r} after {name!r} in LVM metadata")
        return out

    def value() -> Any:
        nonlocal pos
        kind, v = tokens[pos]
        pos += 1
        if (kind, v) != ("punct", "["):
            return v
        items = []
        while tokens[pos][1] != "]":
            if tokens[pos][1] != ",":
                items.append(tokens[pos][1])
            pos += 1
        pos += 1
        return items

    return section()


def volume_group(metadata: str) -> tuple[str, dict[str, Any]]:
    """(VG name, its section) from a PV's metadata text."""
    cfg = parse_config(metadata)
    vgs = [(k, v) for k, v in cfg.items() if isinstance(v, dict) and "extent_size" in v]
    if len(vgs) != 1:
        raise LvmError("the metadata does not describe exactly one volume group")
    return vgs[0]


def lv_segments(
    vg: dict[str, Any], lv: str, pv_disk_start: dict[str, int]
) -> tuple[list[Segment], str]:
    """The disk sectors of a linear LV, or ([], why not).

    pv_disk_start: for each PV UUID of the VG found on the disk, the disk
    sector where its first extent is (partition start + pe_start).
    """
    extent = int(vg["extent_size"])  # in sectors
    lvs = vg.get("logical_volumes", {})
    if lv not in lvs:
        return [], f"logical volume {lv} is not in the volume group's metadata"
    pvs = {name: p.get("id", "") for name, p in vg.get("physical_volumes", {}).items()}
    out: list[Segment] = []
    lvd = lvs[lv]
    for key in sorted(
        (k for k in lvd if re.fullmatch(r"segment\d+", k)), key=lambda k: int(k[len("segment") :])
    ):
        seg = lvd[key]
        kind, stripes = seg.get("type"), seg.get("stripes", [])
        if kind != "striped" or int(seg.get("stripe_count", 0)) != 1 or len(stripes) != 2:
            what = f"{seg.get('stripe_count')} stripes" if kind == "striped" else f"type {kind!r}"
            return [], (
                f"segment {key[len('segment') :]} of {lv} is not linear ({what}): "
                "only linear logical volumes are mapped"
            )
        pv_uuid = pvs.get(stripes[0], "")
        if pv_uuid not in pv_disk_start:
            return [], (
                f"{lv} has extents on PV {pv_uuid or stripes[0]}, which is not on the image's disk"
            )
        out.append(
            Segment(
                int(seg["start_extent"]) * extent,
                int(seg["extent_count"]) * extent,
                pv_disk_start[pv_uuid] + int(stripes[1]) * extent,
            )
        )
    if not out:
        return [], f"logical volume {lv} has no segments"
    return out, ""


def to_disk(
    segments: list[Segment] | tuple[Segment, ...], lv_sector: int, count: int = 1
) -> int | None:
    """The disk sector of LV sectors [lv_sector, lv_sector + count), None if
    they are not all in one segment (so not contiguous on the disk)."""
    for s in segments:
        if s.lv_start <= lv_sector < s.lv_start + s.sectors:
            if lv_sector + count > s.lv_start + s.sectors:
                return None
            return s.disk_start + lv_sector - s.lv_start
    return None


@dataclass(frozen=True)
class VolumeGroup:
    name: str
    metadata: dict[str, Any]  # the VG's section of its metadata
    pv_starts: dict[str, int]  # PV UUID -> disk sector of its first extent
    pv_partitions: tuple[tuple[int, int], ...]  # (partition number, start sector) of PVs

    def partition_of(self, disk_sector: int) -> int:
        """The number of the PV partition a disk sector is in (the last one starting
        at or before it)."""
        return max(
            (p for p in self.pv_partitions if p[1] <= disk_sector),
            key=lambda p: p[1],
            default=(0, 0),
        )[0]


def volume_groups(g: Any, partitions: dict[int, int]) -> dict[str, VolumeGroup]:
    """The volume groups whose PVs are partitions of the image's disk (or the
    whole disk), read through libguestfs (g.pread_device) without activating
    anything.  partitions: number -> start sector; empty for no partition table."""
    found: dict[str, VolumeGroup] = {}
    for number, start in sorted(partitions.items()) or [(0, 0)]:
        dev = f"/dev/sda{number or ''}"

        def read(at: int, size: int, dev: str = dev) -> bytes:
            data: bytes = g.pread_device(dev, size, at)
            return data

        try:
            label = read_label(read)
        except (RuntimeError, LvmError, UnicodeDecodeError):
            continue  # not a PV (or unreadable): not LVM's to map
        if label is None or not label.metadata:
            continue
        name, vg = volume_group(label.metadata)
        old = found.get(name)
        pv_starts = {**(old.pv_starts if old else {}), label.uuid: start + label.pe_start // SECTOR}
        parts = (*(old.pv_partitions if old else ()), (number, start))
        found[name] = VolumeGroup(name, old.metadata if old else vg, pv_starts, parts)
    return found
