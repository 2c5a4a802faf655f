"""/etc/pageshare/libvirt.toml: how pageshare runs under libvirt on this host.

One file for `pageshare libvirt-watch` and the libvirt hook
(`pageshare libvirt-hook`, run by libvirtd as
/etc/libvirt/hooks/qemu.d/pageshare), so that the filter a domain gets
when it starts here and the one it gets when it migrates in are the same.
Every key is optional; a missing file means the defaults:

    control = "/run/pageshare/control.sock"   # the page server's control socket
    mode = "merge"            # the filter's mode: "merge" or "copy" (stock kernels)
    block_refs = false        # live migrations *from* this host send listed pages
                              # as block references (QEMU capability block-refs)
    timeout = 30              # seconds per QMP command
    qmp_dir = "/var/lib/libvirt/qemu"   # where an incoming domain's QEMU gets
                                        # the hook's private QMP socket
    log_dir = "/var/log/libvirt/qemu"   # the hook's lines go to <log_dir>/<domain>.log

block_refs is the source's choice: libvirt-watch sets the capability on
each domain it attaches and records it in the domain's metadata, which
travels with the domain; the destination's hook turns the capability on
for that incoming QEMU when the metadata says so.  Every host a domain with
block references may migrate to needs pageshare (this hook), or the
migration fails (cleanly: the guest keeps running on the source).
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import PageshareError
from .server_control import DEFAULT_CONTROL

DEFAULT_CONFIG = Path("/etc/pageshare/libvirt.toml")
MODES = ("merge", "copy")


class ConfigError(PageshareError, ValueError):
    """The configuration file cannot be read or has a wrong value."""


@dataclass(frozen=True)
class HostConfig:
    control: Path = DEFAULT_CONTROL
    mode: str | None = None  # None: the filter's default (merge)
    block_refs: bool = False
    timeout: float = 30.0
    qmp_dir: Path = Path("/var/lib/libvirt/qemu")
    log_dir: Path = Path("/var/log/libvirt/qemu")


def _typed(path: Path, data: dict[str, Any], key: str, kinds: tuple[type, ...]) -> Any:
    v = data[key]
    # bool is an int: a number where a bool is wanted (or back) is a mistake
    if not isinstance(v, kinds) or (isinstance(v, bool) and bool not in kinds):
        want = " or ".join(k.__name__ for k in kinds)
        raise ConfigError(f"{path}: {key} must be a {want}, not {v!r}")
    return v


def load(path: Path = DEFAULT_CONFIG, *, required: bool = False) -> HostConfig:
    """The configuration in PATH; the defaults if it does not exist (unless
    REQUIRED: a path an operator named must exist)."""
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        if required:
            raise ConfigError(f"{path}: no such file") from None
        return HostConfig()
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"{path}: {e}") from None
    known = {"control", "mode", "block_refs", "timeout", "qmp_dir", "log_dir"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(
            f"{path}: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})"
        )
    out: dict[str, Any] = {}
    for key in ("control", "qmp_dir", "log_dir"):
        if key in data:
            out[key] = Path(_typed(path, data, key, (str,)))
    if "qmp_dir" in out and "," in str(out["qmp_dir"]):
        raise ConfigError(f"{path}: qmp_dir may not contain a comma (QEMU's option syntax)")
    if "mode" in data:
        mode = _typed(path, data, "mode", (str,))
        if mode not in MODES:
            raise ConfigError(f"{path}: mode must be one of {', '.join(MODES)}, not {mode!r}")
        out["mode"] = mode
    if "block_refs" in data:
        out["block_refs"] = _typed(path, data, "block_refs", (bool,))
    if "timeout" in data:
        t = float(_typed(path, data, "timeout", (int, float)))
        if t <= 0:
            raise ConfigError(f"{path}: timeout must be positive")
        out["timeout"] = t
    return HostConfig(**out)
