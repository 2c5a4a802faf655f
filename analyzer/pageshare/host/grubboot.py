"""Which kernel GRUB boots on this host by default, as GRUB itself decides.

For `pageshare host check`'s kernel finding: the pageshare kernels in /boot,
and the kernel grub.cfg's default entry boots.  grub.cfg is read as
grub-mkconfig writes it (one statement per line, `menuentry ... {` and
`submenu ... {` opening a block, `}` alone closing it; ids after
`$menuentry_id_option`).  Its `set default=` is resolved as GRUB 2.06 and
2.12 do (grub-core/normal/menu.c):

- `${saved_entry}` (GRUB_DEFAULT=saved) is grubenv's saved_entry, which
  load_env reads at boot; a pending `${next_entry}` (grub-reboot) boots once;
- a value that starts with digits is an index (grub_strtoul: "1>2" is 1);
  otherwise the first entry whose title or id matches (menuentry_eq: up to
  the first single '>', '>>' standing for a '>');
- the rest after that '>' is the default inside the submenu chosen;
- a value that matches nothing, or an index past the end, is entry 0: GRUB
  falls back to the first entry (run_menu), and a submenu opened without a
  default boots its own first entry.

Standard library only (a host tool).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

BOOT = Path("/boot")
GRUB_CFG = Path("/boot/grub/grub.cfg")
GRUBENV = Path("/boot/grub/grubenv")
# pageshare-host's grub-mkconfig snippet (packaging/pageshare-host/grub.d/).
SNIPPET = Path("/etc/default/grub.d/pageshare-kernel.cfg")
PAGESHARE_MARK = "-pageshare-"


@dataclass
class Entry:
    """A menuentry (kernel: its linux line's path, "" if none) or a submenu
    (entries: what it holds)."""

    title: str
    id: str
    kernel: str = ""
    entries: list[Entry] | None = None

    @property
    def release(self) -> str:
        """The kernel release this entry boots ("" if none)."""
        name = self.kernel.rsplit("/", 1)[-1]
        return name.split("-", 1)[1] if name.startswith("vmlinuz-") else ""


@dataclass
class GrubDefault:
    """What grub.cfg's default resolves to."""

    spec: str  # the value GRUB resolves: set default's, or grubenv's saved_entry
    source: str  # where spec comes from, for the operator
    path: list[Entry] = field(default_factory=list)  # the entries chosen, outermost first
    fallback: bool = False  # spec matched no entry: GRUB took the first
    next_entry: str = ""  # a one-time grub-reboot choice, if one is pending
    menu: list[Entry] = field(default_factory=list)  # grub.cfg's top-level entries

    @property
    def entry(self) -> Entry | None:
        return self.path[-1] if self.path else None

    @property
    def release(self) -> str:
        return self.entry.release if self.entry else ""

    @property
    def titles(self) -> str:
        return ">".join(e.title for e in self.path)


def version_key(release: str) -> list[tuple[int, str]]:
    """Orders releases as sort -V does for these names: 6.12.9 < 6.12.10."""
    return [(int(p), "") if p.isdigit() else (-1, p) for p in re.split(r"[.\-+~_]", release)]


def pageshare_kernels(boot: Path = BOOT) -> list[str]:
    """The releases of the pageshare kernels in boot, oldest first: the files
    the snippet and 10_linux consider (no .dpkg-*, .old, .sig, .efi.signed)."""
    found = []
    for f in boot.glob(f"vmlinuz-*{PAGESHARE_MARK}*"):
        name = f.name
        if not f.is_file() or re.search(r"\.(dpkg-\w+|old|sig|efi\.signed|rpmsave|rpmnew)$", name):
            continue
        found.append(name.removeprefix("vmlinuz-"))
    return sorted(found, key=version_key)


def is_pageshare(release: str) -> bool:
    return PAGESHARE_MARK in release


def _words(line: str) -> list[str]:
    try:
        return shlex.split(line)
    except ValueError:
        return line.split()


def parse_menu(text: str) -> tuple[list[Entry], dict[str, str]]:
    """grub.cfg's top-level menu, and its top-level `set NAME=VALUE`s (the last
    of each; for default, the one that is not `${next_entry}`)."""
    top: list[Entry] = []
    sets: dict[str, str] = {}
    # Open blocks: an Entry for a menuentry or submenu, None for any other
    # (a function: what it defines is not the menu).
    stack: list[Entry | None] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line == "}":
            if stack:
                stack.pop()
            continue
        w = _words(line)
        if not w:
            continue
        if line.endswith("{"):
            if w[-1] == "{":
                w = w[:-1]
            if not w or w[0] not in ("menuentry", "submenu") or None in stack:
                stack.append(None)
                continue
            title = w[1] if len(w) > 1 else ""
            ident = next(
                (w[i + 1] for i in range(len(w) - 1) if w[i] in ("$menuentry_id_option", "--id")),
                title,  # GRUB's id of an entry without one is its title
            )
            e = Entry(title, ident, entries=[] if w[0] == "submenu" else None)
            parent = stack[-1] if stack else None
            if parent is None:
                top.append(e)
            elif parent.entries is not None:
                parent.entries.append(e)
            stack.append(e)
            continue
        current = stack[-1] if stack else None
        if current is not None and current.entries is None:
            if w[0] in ("linux", "linux16", "linuxefi") and len(w) > 1:
                current.kernel = w[1]
            continue
        if not stack and w[0] == "set" and len(w) > 1 and "=" in w[1]:
            name, value = w[1].split("=", 1)
            if name == "default" and value == "${next_entry}":
                continue
            sets[name] = value
    return top, sets


def read_env(text: str) -> dict[str, str]:
    """A grubenv block's variables (NAME=VALUE lines; '#' padding ignored)."""
    env = {}
    for line in text.splitlines():
        if line.startswith("#") or "=" not in line:
            continue
        name, value = line.split("=", 1)
        env[name] = value
    return env


def _strtoul(val: str) -> int | None:
    """grub_strtoul(val, 0, 0): leading digits (0x hex, 0 octal), None if none."""
    s = val.lstrip(" \t\n\r\f\v")
    base = 10
    if s.startswith("0x"):
        base, s = 16, s[2:]
    elif len(s) > 1 and s[0] == "0" and s[1] in "01234567":
        base = 8
    digits = ""
    for c in s.lower():
        if c in "0123456789abcdef"[:base]:
            digits += c
        else:
            break
    return int(digits, base) if digits else None


def menuentry_eq(ident: str, spec: str) -> bool:
    """menu.c's menuentry_eq: ident equals spec up to spec's first single '>'."""
    i = j = 0
    while True:
        if j < len(spec) and spec[j] == ">":
            if j + 1 < len(spec) and spec[j + 1] == ">":
                j += 1  # '>>' is a literal '>'
            else:
                return i == len(ident)
        if i == len(ident) or j == len(spec):
            return i == len(ident) and j == len(spec)
        if ident[i] != spec[j]:
            return False
        i += 1
        j += 1


def _rest(spec: str) -> str | None:
    """What menu.c passes into a submenu as its default: after the first
    single '>' (None: no such '>', the submenu's default is unset)."""
    j = 0
    while j < len(spec):
        if spec[j] == ">":
            if j + 1 < len(spec) and spec[j + 1] == ">":
                j += 2
                continue
            return spec[j + 1 :] if j + 1 < len(spec) else None
        j += 1
    return None


def resolve(menu: list[Entry], spec: str | None) -> tuple[list[Entry], bool]:
    """The entries GRUB goes through for default spec (None: unset), and
    whether some level fell back to its first entry."""
    path: list[Entry] = []
    fallback = False
    while menu:
        index: int | None = None
        if spec is not None:
            n = _strtoul(spec)
            if n is not None:
                index = n
            else:
                index = next(
                    (
                        i
                        for i, e in enumerate(menu)
                        if menuentry_eq(e.title, spec) or menuentry_eq(e.id, spec)
                    ),
                    None,
                )
        if index is None or index >= len(menu):
            if spec is not None:
                fallback = True
            index = 0
        chosen = menu[index]
        path.append(chosen)
        if chosen.entries is None:
            break
        menu = chosen.entries
        spec = _rest(spec) if spec is not None else None
    return path, fallback


def grub_default(cfg_text: str, env_text: str = "") -> GrubDefault:
    """grub.cfg's default entry (env_text: grubenv's contents, if readable)."""
    menu, sets = parse_menu(cfg_text)
    env = read_env(env_text)
    spec = sets.get("default", "0")
    source = f'set default="{spec}" in grub.cfg'
    if spec == "${saved_entry}":
        spec = env.get("saved_entry", "")
        source = f'saved_entry="{spec}" in grubenv (GRUB_DEFAULT=saved)'
    path, fallback = resolve(menu, spec)
    return GrubDefault(spec, source, path, fallback, env.get("next_entry", ""), menu)


def _leaves(menu: list[Entry], prefix: str = "") -> list[tuple[str, Entry]]:
    """Every menuentry with its id path (ids joined by '>', a '>' in an id doubled)."""
    out = []
    for e in menu:
        ident = prefix + e.id.replace(">", ">>")
        if e.entries is None:
            out.append((ident, e))
        else:
            out += _leaves(e.entries, ident + ">")
    return out


def entry_for(menu: list[Entry], release: str) -> str:
    """The id path (for GRUB_DEFAULT or grub-set-default) of release's own
    entry, the one 10_linux names gnulinux-RELEASE-advanced-ID (not the
    simple entry of whichever kernel is newest, not recovery); else the
    first other entry that boots it; "" if none does."""
    leaves = [(p, e) for p, e in _leaves(menu) if e.release == release]
    for p, e in leaves:
        if e.id.startswith(f"gnulinux-{release}-advanced-"):
            return p
    return next((p for p, e in leaves if "recovery" not in e.id), "")
