"""Distribution of sector lists through Redis, and the fleet view.

``pageshare list publish LIST`` stores a validated list in Redis under its
image identity; page servers (page-server/) whose base image has that
identity load it, and push their status back so ``pageshare list ls`` and
``pageshare fleet`` show which host serves what.

Keys (the page server's src/redis_watch.rs uses the same layout)::

    <prefix>:list:<virtual size>-<content sha256>   the pcsl text (string)
    <prefix>:meta:<virtual size>-<content sha256>   hash: header fields, who published, when
    <prefix>:revision:<virtual size>-<sha256>       publish counter (also in meta)
    <prefix>:images                                 set of the image keys
    <prefix>:events                                 pub/sub channel, message = image key
    <prefix>:host:<host>                            hash: status (server JSON), updated, pid
    <prefix>:hosts                                  set of host names
    <prefix>:feedback:<image key>:<host>            hash: what that host's guests read
                                                    (format: feedback.py; read by
                                                    ``pageshare list refine``, refine.py)
    <prefix>:feedback:<image key>:hosts             set of the hosts that published one

Start from :func:`publish`, :func:`fetch`, :func:`list_images` and
:func:`fleet`; :func:`main` is the thin command-line layer.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import getpass
import json
import logging
import os
import socket
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pageshare.errors import RaisingArgumentParser, UsageError, UserError, print_error
from pageshare.lists import sectorlist

if TYPE_CHECKING:
    import redis

log = logging.getLogger(__name__)
log.addHandler(logging.NullHandler())

DEFAULT_URL = "redis://127.0.0.1:6379/0"
DEFAULT_PREFIX = "pageshare"
# A host that has not pushed its status for this long is shown as stale
# (servers push every stats_interval_secs, 10 s by default).
STALE_AFTER = 60.0


class DistributeError(UserError):
    """Redis unreachable, a list not found, garbage in Redis."""


def image_key(image: sectorlist.ImageIdentity) -> str:
    return f"{image.virtual_size}-{image.content_sha256}"


class Store:
    """Lists and fleet status in one Redis database."""

    def __init__(
        self, url: str = DEFAULT_URL, prefix: str = DEFAULT_PREFIX, timeout: float = 5.0
    ) -> None:
        # redis is imported where Redis is talked to, so that `pageshare list
        # show|verify` (which import refine's defaults) run without it.
        import redis

        self.url = url
        self.prefix = prefix
        try:
            self.r: redis.Redis = redis.Redis.from_url(
                url, socket_timeout=timeout, socket_connect_timeout=timeout
            )
        except ValueError as e:
            raise DistributeError(
                f"bad Redis URL {url!r}: {e}", hint="use redis://HOST:PORT/DB or unix:///PATH"
            ) from None

    def key(self, *parts: str) -> str:
        return ":".join((self.prefix, *parts))

    def _call(self, what: str, fn: Any, *args: Any) -> Any:
        import redis

        try:
            return fn(*args)
        except redis.exceptions.ConnectionError as e:
            raise DistributeError(
                f"cannot reach Redis at {self.url}: {e}",
                hint="start redis-server or pass --redis URL (or set PAGESHARE_REDIS)",
            ) from None
        except redis.exceptions.RedisError as e:
            raise DistributeError(f"Redis error during {what}: {e}") from None


def _text(v: Any) -> str:
    if isinstance(v, bytes):
        return v.decode("utf-8", errors="replace")
    return "" if v is None else str(v)


def _decode_hash(h: Mapping[Any, Any]) -> dict[str, str]:
    return {_text(k): _text(v) for k, v in h.items()}


def publish(store: Store, path: Path, publisher: str | None = None) -> dict[str, Any]:
    """Validate ``path`` and make it the current list of its image.

    Returns the metadata written, plus ``subscribers``: how many page servers
    were listening on the events channel.
    """
    # One read: the bytes validated are the bytes published.
    data = Path(path).read_bytes()
    sl = sectorlist.loads_bytes(data, str(path))  # every rule of lists/README.md
    key = image_key(sl.image)
    who = publisher or f"{getpass.getuser()}@{socket.gethostname()}"
    meta: dict[str, str] = {
        "image-key": key,
        "image-name": sl.image.name,
        "image-virtual-size": str(sl.image.virtual_size),
        "image-content-sha256": sl.image.content_sha256,
        "count": str(len(sl.blocks)),
        "bytes": str(sl.total_bytes()),
        "list-digest": sl.digest(),
        "generator": sl.generator,
        "created": sl.created,
        "criteria": sl.criteria,
        "runs": sl.runs,
        "published-by": who,
        "published-at": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "source-file": Path(path).name,
        "list-bytes": str(len(data)),
    }
    meta.update(sl.extra)

    def tx() -> list[Any]:
        p = store.r.pipeline(transaction=True)
        p.set(store.key("list", key), data)
        p.delete(store.key("meta", key))
        p.hset(store.key("meta", key), mapping=dict[Any, Any](meta))
        p.incr(store.key("revision", key))
        p.sadd(store.key("images"), key)
        p.publish(store.key("events"), key)
        result: list[Any] = p.execute()
        store.r.hset(store.key("meta", key), "revision", int(result[3]))
        return result

    res = store._call("publish", tx)
    out: dict[str, Any] = dict(meta)
    out["revision"] = int(res[3])
    out["subscribers"] = int(res[5])
    return out


def resolve(store: Store, ref: str) -> str:
    """An image key from a full key, a content-sha256 prefix or an image name."""
    keys = sorted(_text(k) for k in store._call("ls", store.r.smembers, store.key("images")))
    if ref in keys:
        return ref
    matches = [k for k in keys if k.partition("-")[2].startswith(ref)] if len(ref) >= 6 else []
    if not matches:
        for k in keys:
            name = _text(store._call("ls", store.r.hget, store.key("meta", k), "image-name"))
            if ref in (name, Path(name).stem):
                matches.append(k)
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise DistributeError(
            f"no list in Redis for {ref!r}",
            hint="'pageshare list ls' shows the images that have one",
        )
    raise DistributeError(
        f"{ref!r} matches {len(matches)} images: {', '.join(matches)}",
        hint="give more of the content sha256, or the full key",
    )


def fetch(
    store: Store, ref: str, out: Path | None = None, directory: Path = Path(".")
) -> tuple[Path, sectorlist.SectorList]:
    """Download the current list of an image, validate it, write it atomically."""
    key = resolve(store, ref)
    data = store._call("fetch", store.r.get, store.key("list", key))
    if data is None:
        raise DistributeError(f"image {key} is registered but its list key is missing")
    if not isinstance(data, bytes):
        raise DistributeError(f"list of {key} is not a byte string")
    try:
        sl = sectorlist.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, sectorlist.ListFormatError) as e:
        raise DistributeError(
            f"the list stored for {key} is not a valid pcsl v1 list: {e}",
            hint="publish a good list again with 'pageshare list publish'",
        ) from None
    if image_key(sl.image) != key:
        raise DistributeError(
            f"the list stored under {key} names image {image_key(sl.image)}",
            hint="publish the right list again with 'pageshare list publish'",
        )
    target = out or Path(directory) / sectorlist.list_file_name(sl.image)
    sectorlist.write_atomic(target, data)
    return target, sl


def fleet(store: Store, now: float | None = None) -> list[dict[str, Any]]:
    """The status each page server pushed, one dict per host (garbage tolerated)."""
    now = time.time() if now is None else now
    hosts = sorted(_text(h) for h in store._call("fleet", store.r.smembers, store.key("hosts")))
    out: list[dict[str, Any]] = []
    for host in hosts:
        h = _decode_hash(store._call("fleet", store.r.hgetall, store.key("host", host)))
        if not h:
            continue  # expired
        entry: dict[str, Any] = {"host": host, "pid": h.get("pid", ""), "error": ""}
        try:
            entry["updated"] = float(h.get("updated", "nan"))
        except ValueError:
            entry["updated"] = float("nan")
        age = now - entry["updated"]
        entry["age_seconds"] = age if age == age else None
        entry["stale"] = not (age <= STALE_AFTER)
        try:
            status = json.loads(h.get("status", ""))
            if not isinstance(status, dict):
                raise ValueError("not an object")
        except ValueError as e:
            entry["error"] = f"unreadable status: {e}"
            status = {}
        entry["degraded"] = bool(status.get("degraded", False))
        entry["redis_connected"] = (
            bool((status.get("redis") or {}).get("connected", False))
            if isinstance(status.get("redis"), dict)
            else False
        )
        images = []
        for img in status.get("images", []) if isinstance(status.get("images"), list) else []:
            if not isinstance(img, dict):
                continue
            ident = img.get("identity") if isinstance(img.get("identity"), dict) else {}
            key = f"{ident.get('virtual_size')}-{ident.get('content_sha256')}" if ident else ""
            stats = img.get("client_stats") if isinstance(img.get("client_stats"), dict) else {}
            images.append(
                {
                    "name": img.get("name", "?"),
                    "image_key": key,
                    "state": img.get("state", "?"),
                    "generation": img.get("generation"),
                    "blocks": img.get("blocks", 0),
                    "list_digest": img.get("list_digest"),
                    "clients": img.get("clients", 0),
                    "client_stats": stats,
                    "message": img.get("message", ""),
                }
            )
        entry["images"] = images
        out.append(entry)
    return out


def list_images(store: Store, now: float | None = None) -> list[dict[str, Any]]:
    """Every published list with its metadata and the hosts serving it."""
    keys = sorted(_text(k) for k in store._call("ls", store.r.smembers, store.key("images")))
    hosts = fleet(store, now)
    out = []
    for key in keys:
        meta = _decode_hash(store._call("ls", store.r.hgetall, store.key("meta", key)))
        serving = []
        for h in hosts:
            for img in h["images"]:
                if img["image_key"] == key:
                    serving.append(
                        {
                            "host": h["host"],
                            "image": img["name"],
                            "state": img["state"],
                            "generation": img["generation"],
                            "blocks": img["blocks"],
                            "current": img["list_digest"] == meta.get("list-digest"),
                            "clients": img["clients"],
                            "stale": h["stale"],
                            "client_stats": img["client_stats"],
                        }
                    )
        out.append({"image_key": key, "meta": meta, "hosts": serving})
    return out


# --------------------------------------------------------------------------- CLI


def add_redis_arguments(p: argparse.ArgumentParser) -> None:
    """--redis and --prefix, as every command that talks to the lists' Redis
    takes them (list publish, fetch, ls, refine)."""
    p.add_argument(
        "--redis",
        metavar="URL",
        default=os.environ.get("PAGESHARE_REDIS", DEFAULT_URL),
        help=f"Redis URL (default $PAGESHARE_REDIS or {DEFAULT_URL})",
    )
    p.add_argument(
        "--prefix",
        default=DEFAULT_PREFIX,
        help=f"key prefix shared with the page servers (default {DEFAULT_PREFIX})",
    )


def _build_parser(prog: str) -> argparse.ArgumentParser:
    parser = RaisingArgumentParser(
        prog=prog, description="Distribute sector lists to page servers via Redis."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    pub = sub.add_parser(
        "publish",
        help="validate a list and make it the current list of its "
        "image; page servers serving that image load it",
    )
    pub.add_argument("file", metavar="LIST", type=Path)
    pub.add_argument("--publisher", help="who to record as publisher (default user@host)")
    pub.add_argument("--json", action="store_true")
    add_redis_arguments(pub)
    fe = sub.add_parser("fetch", help="download an image's current list (validated) to a file")
    fe.add_argument(
        "image",
        metavar="IMAGE",
        help="image key (<size>-<sha256>), a sha256 prefix or the image name",
    )
    fe.add_argument(
        "-o",
        "--output",
        type=Path,
        help="file to write (default: the analyzer's file name in the current directory)",
    )
    add_redis_arguments(fe)
    ls = sub.add_parser("ls", help="the lists in Redis, their metadata, and which hosts serve them")
    ls.add_argument("--json", action="store_true", help="machine-readable output")
    add_redis_arguments(ls)
    fl = sub.add_parser("fleet", help="every page server's reported state")
    fl.add_argument("--json", action="store_true")
    add_redis_arguments(fl)
    return parser


def _fmt_ls(images: list[dict[str, Any]]) -> str:
    if not images:
        return "no lists in Redis"
    lines = []
    for img in images:
        m = img["meta"]
        try:
            mib = int(m.get("bytes", "0")) / (1 << 20)
        except ValueError:
            mib = float("nan")
        lines.append(f"{m.get('image-name') or '(unnamed)'}  {img['image_key'][:32]}...")
        lines.append(f"  {m.get('count', '?')} blocks ({mib:.1f} MiB), {m.get('list-digest', '?')}")
        lines.append(
            f"  published {m.get('published-at', '?')} by {m.get('published-by', '?')}"
            f" (revision {m.get('revision', '?')}); analysed by "
            f"{m.get('generator') or '?'} at {m.get('created') or '?'}; "
            f"{m.get('runs', '')}"
        )
        if not img["hosts"]:
            lines.append("  served by: no host")
        for h in img["hosts"]:
            flag = "" if h["current"] else " (older list)"
            stale = " STALE" if h["stale"] else ""
            lines.append(
                f"  served by {h['host']}{stale}: {h['image']} {h['state']} gen "
                f"{h['generation']} {h['blocks']} blocks{flag}, {h['clients']} clients"
            )
    return "\n".join(lines)


def _fmt_fleet(hosts: list[dict[str, Any]]) -> str:
    if not hosts:
        return "no page servers have reported"
    lines = []
    for h in hosts:
        age = h["age_seconds"]
        age_s = f"{age:.0f} s ago" if age is not None else "?"
        flags = [f for f, on in (("STALE", h["stale"]), ("DEGRADED", h["degraded"])) if on]
        lines.append(f"{h['host']} pid {h['pid']} updated {age_s} {' '.join(flags)}".rstrip())
        if h["error"]:
            lines.append(f"  {h['error']}")
        for img in h["images"]:
            cs = img["client_stats"]
            lines.append(
                f"  {img['name']}: {img['state']} gen {img['generation']} "
                f"{img['blocks']} blocks, {img['clients']} clients, "
                f"merged {cs.get('merged', 0)} fallbacks {cs.get('fallbacks', 0)}"
            )
    return "\n".join(lines)


def main(argv: list[str], prog: str = "pageshare list") -> int:
    """``pageshare list publish|fetch|ls`` and ``pageshare fleet``."""
    parser = _build_parser(prog)
    try:
        args = parser.parse_args(argv)
    except UsageError as e:
        print_error(f"{e} (see '{prog} --help')")
        return 2
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 0
    try:
        store = Store(args.redis, args.prefix)
        if args.command == "publish":
            meta = publish(store, args.file, args.publisher)
            if args.json:
                print(json.dumps(meta, indent=2))
            else:
                print(
                    f"published {args.file}: {meta['count']} blocks for image "
                    f"{meta['image-name'] or meta['image-key']} (revision {meta['revision']}, "
                    f"{meta['subscribers']} page server(s) listening)"
                )
        elif args.command == "fetch":
            path, sl = fetch(store, args.image, args.output)
            print(f"wrote {path}: {len(sl.blocks)} blocks, {sl.digest()}")
        elif args.command == "ls":
            images = list_images(store)
            print(json.dumps(images, indent=2) if args.json else _fmt_ls(images))
        elif args.command == "fleet":
            hosts = fleet(store)
            print(json.dumps(hosts, indent=2) if args.json else _fmt_fleet(hosts))
        return 0
    except sectorlist.ListFormatError as e:
        print_error(str(e))
        return 2
    except UserError as e:
        print_error(e.message, e.hint)
        return 2
    except OSError as e:
        where = f"{e.filename}: " if e.filename else ""
        print(f"error: {where}{e.strerror or e}", file=sys.stderr)
        return 2
