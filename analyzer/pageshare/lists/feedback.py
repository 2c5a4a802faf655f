"""The fleet's read feedback in Redis: what each page server's guests read.

Every page server (page-server/) counts, per image it serves, which base
blocks its guests read (unlisted blocks, and listed blocks read at least
once) and publishes a cumulative summary per host, next to the lists
(distribute.py's key layout)::

    <prefix>:feedback:<image key>:<host>    hash, one per host and image:
        host      the host name (the server's host_name, or its hostname)
        image     <virtual size>-<content sha256>, the image key
        since     unix seconds: start of the accumulation (cumulative since then)
        updated   unix seconds: this publish
        guests    distinct guests that reported during the accumulation
        version   1 (FEEDBACK_VERSION)
        blocks    RECORD x n, little endian, sorted by block, no duplicates:
                  u64 block    4 KiB block index in the image's virtual disk
                  u32 guests   distinct guests that read it (the server
                               saturates at 16 per block)
                  u32 reads    reads summed over those guests
                  u32 flags    bit 0 (FLAG_LISTED): the block was listed
                               (a LISTED_READ), else an unlisted read
    <prefix>:feedback:<image key>:hosts     set of the host names that published

Block numbers are the lists' unit divided by 8: block b is list sector 8 * b.
Guests are counted per host by the server, one QEMU process each; a guest
seen by a server before and after its restart is counted twice at most,
and a guest migrated between hosts counts on each.  Nothing else about a
guest leaves its host.

This module is the one place that knows the format: :func:`decode`
(validating, for ``pageshare list refine``), :func:`encode` (the same
record layout, for tests and tools) and :func:`read_fleet`, which reads
every host's summary for an image and keeps going past ones that do not
parse (reported in :attr:`Fleet.failures`).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import PageshareError
from .distribute import Store

FEEDBACK_VERSION = 1
RECORD = struct.Struct("<QIII")  # block, guests, reads, flags
FLAG_LISTED = 1
FIELDS = ("host", "image", "since", "updated", "guests", "version", "blocks")
HOSTS = "hosts"  # the last key part of the set of host names


class SummaryFormatError(PageshareError, ValueError):
    """A host's feedback summary that is not used: the message says why."""

    kind = "bad-summary"


@dataclass(frozen=True)
class HostSummary:
    """One host's decoded summary for one image."""

    host: str
    image: str
    since: int
    updated: int
    guests: int
    version: int
    blocks: bytes  # the raw records, validated; iterate with records()
    key: str = ""

    @property
    def count(self) -> int:
        return len(self.blocks) // RECORD.size

    def records(self) -> Iterator[tuple[int, int, int, int]]:
        """(block, guests, reads, flags), in block order."""
        return RECORD.iter_unpack(self.blocks)

    def to_json(self) -> dict[str, Any]:
        return {
            "host": self.host,
            "key": self.key,
            "since": self.since,
            "updated": self.updated,
            "guests": self.guests,
            "blocks": self.count,
        }


@dataclass
class Fleet:
    """Every host's summary for one image, and those that could not be used."""

    image_key: str
    summaries: list[HostSummary] = field(default_factory=list)
    failures: list[dict[str, str]] = field(default_factory=list)  # host, key, error


def summary_key(store: Store, image_key: str, host: str) -> str:
    return store.key("feedback", image_key, host)


def hosts_key(store: Store, image_key: str) -> str:
    return store.key("feedback", image_key, HOSTS)


def _text(raw: Mapping[Any, Any], name: str) -> str:
    v = raw.get(name, raw.get(name.encode()))
    if v is None:
        raise SummaryFormatError(f"field {name!r} is missing")
    if isinstance(v, bytes):
        try:
            return v.decode("utf-8")
        except UnicodeDecodeError:
            raise SummaryFormatError(f"field {name!r} is not UTF-8 text") from None
    return str(v)


def _uint(raw: Mapping[Any, Any], name: str, bits: int = 64) -> int:
    text = _text(raw, name)
    if not text.isascii() or not text.isdigit() or len(text) > 20:
        raise SummaryFormatError(f"field {name!r} must be a decimal integer, got {text[:40]!r}")
    value = int(text)
    if value >= 1 << bits:
        raise SummaryFormatError(f"field {name!r} is too large ({value})")
    return value


def decode(raw: Mapping[Any, Any], image_key: str, host: str = "", key: str = "") -> HostSummary:
    """Validate one host's hash (as redis-py returns it, bytes or str) for image_key.

    Raises SummaryFormatError naming what is wrong: a missing field, another
    version, another image (a host serving another image under this key), a
    host name that is not the key's, a record area whose length is not a
    multiple of 20 bytes, blocks unsorted or repeated, or since after updated.
    """
    if not raw:
        raise SummaryFormatError("the hash is empty (expired, or never written)")
    version = _uint(raw, "version", 32)
    if version != FEEDBACK_VERSION:
        raise SummaryFormatError(
            f"summary format version {version}; this pageshare reads version "
            f"{FEEDBACK_VERSION} (update pageshare, or the page server)"
        )
    name = _text(raw, "host")
    if host and name != host:
        raise SummaryFormatError(f"names host {name!r}, but is stored under host {host!r}")
    image = _text(raw, "image")
    if image != image_key:
        raise SummaryFormatError(
            f"is for image {image}, not {image_key} (a host serving "
            "another image wrote it under this key)"
        )
    since, updated = _uint(raw, "since"), _uint(raw, "updated")
    if since > updated:
        raise SummaryFormatError(f"since ({since}) is after updated ({updated})")
    guests = _uint(raw, "guests", 32)
    blocks = raw.get("blocks", raw.get(b"blocks"))
    if blocks is None:
        raise SummaryFormatError("field 'blocks' is missing")
    if isinstance(blocks, str):
        blocks = blocks.encode("latin-1", errors="replace")
    if not isinstance(blocks, bytes):
        raise SummaryFormatError("field 'blocks' is not a byte string")
    if len(blocks) % RECORD.size:
        raise SummaryFormatError(
            f"field 'blocks' is {len(blocks)} bytes, not a multiple of the {RECORD.size}-byte "
            "record: truncated or another format"
        )
    previous = -1
    for n, (block, _, _, _) in enumerate(RECORD.iter_unpack(blocks)):
        if block <= previous:
            raise SummaryFormatError(
                f"record {n}: block {block} after block {previous} (records must be sorted "
                "by block, each block once)"
            )
        previous = block
    return HostSummary(name, image, since, updated, guests, version, blocks, key)


def encode(
    host: str,
    image_key: str,
    since: int,
    updated: int,
    guests: int,
    records: Mapping[int, tuple[int, int, int]],
) -> dict[str, bytes]:
    """A summary hash as a page server writes it: records = block -> (guests, reads, flags)."""
    body = b"".join(RECORD.pack(b, *records[b]) for b in sorted(records))
    return {
        "host": host.encode(),
        "image": image_key.encode(),
        "since": b"%d" % since,
        "updated": b"%d" % updated,
        "guests": b"%d" % guests,
        "version": b"%d" % FEEDBACK_VERSION,
        "blocks": body,
    }


def _host_of(store: Store, image_key: str, key: str) -> str:
    return key[len(store.key("feedback", image_key, "")) :]


def _hgetall(store: Store, key: str) -> dict[Any, Any] | str:
    """The hash, or what is wrong with the key (e.g. not a hash) as a string."""
    import redis

    try:
        h: dict[Any, Any] = store.r.hgetall(key)
        return h
    except redis.exceptions.ResponseError as e:
        return f"the key is not a hash ({e})"


def read_fleet(store: Store, image_key: str) -> Fleet:
    """Every host's summary for image_key: the hosts in the hosts set and every
    summary key there is (a server may have written its hash but not yet the
    set).  A summary that does not parse is reported in failures, not used."""

    def names(v: Any) -> str:
        return v.decode("utf-8", errors="replace") if isinstance(v, bytes) else str(v)

    hosts = {
        names(h) for h in store._call("feedback", store.r.smembers, hosts_key(store, image_key))
    }
    pattern = summary_key(store, image_key, "*")
    for k in store._call("feedback", lambda: list(store.r.scan_iter(match=pattern, count=1000))):
        host = _host_of(store, image_key, names(k))
        if host != HOSTS:
            hosts.add(host)
    fleet = Fleet(image_key)
    for host in sorted(hosts):
        key = summary_key(store, image_key, host)
        raw = store._call("feedback", _hgetall, store, key)
        try:
            if isinstance(raw, str):
                raise SummaryFormatError(raw)
            fleet.summaries.append(decode(raw, image_key, host, key))
        except SummaryFormatError as e:
            fleet.failures.append({"host": host, "key": key, "error": str(e)})
    return fleet
