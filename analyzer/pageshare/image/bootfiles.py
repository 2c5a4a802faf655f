"""Which kernel and initrd a golden image boots, wherever its /boot lives.

Looked up in the image's own tree with every file system of its /etc/fstab
mounted (so a separate /boot partition is where it is in the guest), in the
order a booting machine would decide:
1. the boot loader's default entry: GRUB's grub.cfg (Debian, Ubuntu; also
   grub2/ on the RHEL family), or Boot Loader Specification entries
   (/boot/loader/entries/*.conf, the RHEL family's blscfg);
2. the /vmlinuz symlink Debian's kernel packages maintain;
3. the newest /boot/vmlinuz-<version>.
Paths in a boot loader's configuration are relative to the file system it
reads them from: "/vmlinuz-6.1.0" on a separate /boot is /boot/vmlinuz-6.1.0,
and on a btrfs they start at its top level, so a root in subvolume @rootfs
has its kernel at "/@rootfs/boot/vmlinuz-6.1.0".
The initrd goes by the entry's own initrd line, else by the naming
conventions: initrd.img-V (Debian), initramfs-V.img (RHEL, Arch), initrd-V
(SUSE).
"""

import re
import shlex
from dataclasses import dataclass
from typing import Any

from ..errors import UserError

GRUB_CONFIGS = ("/boot/grub/grub.cfg", "/boot/grub2/grub.cfg")
BLS_DIR = "/boot/loader/entries"


@dataclass(frozen=True)
class BootEntry:
    kernel: str  # as the configuration gives it
    initrd: str  # "" if the entry has none


def version_key(v: str) -> list[tuple[int, str]]:
    """Orders kernel versions: 6.1.0-10 < 6.1.0-9 is wrong as text, right here."""
    return [(int(p), "") if p.isdigit() else (-1, p) for p in re.split(r"[.\-+~_]", v)]


def _words(line: str) -> list[str]:
    try:
        return shlex.split(line, comments=False)
    except ValueError:
        return line.split()


def grub_default_entry(cfg: str) -> BootEntry | None:
    """The linux/initrd of grub.cfg's default entry (generated configs: one
    statement per line, `menuentry ... {` and `}` on lines of their own).

    `set default` may be an index of a top-level entry (a submenu counts as
    one, and "1>2" picks inside it), an entry's title or id, or a variable
    (saved_entry): anything unresolved means the first entry, as GRUB falls
    back to it.
    """
    default = "0"
    # Top-level items: (title, id, entries) where a menuentry's entries is itself.
    items: list[tuple[str, str, list[tuple[str, str, BootEntry]]]] = []
    stack: list[str] = []
    entry: dict[str, str] = {}
    title = ident = ""
    for raw in cfg.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        w = _words(line)
        if not stack and w[0] == "set" and len(w) > 1 and w[1].startswith("default="):
            default = w[1].split("=", 1)[1]
        if w[0] in ("menuentry", "submenu") and line.endswith("{"):
            title = w[1] if len(w) > 1 else ""
            ident = next(
                (w[i + 1] for i in range(len(w) - 1) if w[i] == "$menuentry_id_option"), ""
            )
            if w[0] == "submenu" and not stack:
                items.append((title, ident, []))
            stack.append(w[0])
            entry = {}
            continue
        if line == "}" and stack:
            kind = stack.pop()
            if kind == "menuentry" and "linux" in entry:
                e = BootEntry(entry["linux"], entry.get("initrd", ""))
                if stack:  # inside a submenu
                    if items:
                        items[-1][2].append((title, ident, e))
                else:
                    items.append((title, ident, [(title, ident, e)]))
            continue
        if (
            stack
            and stack[-1] == "menuentry"
            and w[0] in ("linux", "linux16", "linuxefi")
            and len(w) > 1
        ):
            entry["linux"] = w[1]
        if (
            stack
            and stack[-1] == "menuentry"
            and w[0] in ("initrd", "initrd16", "initrdefi")
            and len(w) > 1
        ):
            entry["initrd"] = w[-1]  # the last one if several: the microcode comes first
    items = [i for i in items if i[2]]
    if not items:
        return None
    path = default.split(">")
    chosen = items[0]
    if path[0].isdigit() and int(path[0]) < len(items):
        chosen = items[int(path[0])]
    else:
        chosen = next((i for i in items if path[0] in (i[0], i[1])), items[0])
    sub = chosen[2]
    if len(path) > 1:
        if path[1].isdigit() and int(path[1]) < len(sub):
            return sub[int(path[1])][2]
        return next((e for t, i, e in sub if path[1] in (t, i)), sub[0][2])
    return sub[0][2]


def bls_entry(text: str) -> BootEntry | None:
    """A Boot Loader Specification entry's linux and (last) initrd."""
    kernel = initrd = ""
    for line in text.splitlines():
        key, _, value = line.strip().partition(" ")
        if key == "linux":
            kernel = value.strip()
        elif key == "initrd":
            initrd = value.strip().split()[-1] if value.strip() else ""
    return BootEntry(kernel, initrd) if kernel else None


def resolve(g: Any, path: str, subvols: dict[str, str] | None = None) -> str:
    """A boot loader path as a path in the mounted image, "" if no such file.

    GRUB may prefix a device ("(hd0,gpt2)/vmlinuz", "($root)/..."); the file
    is on /boot when /boot is its own partition, on / otherwise, or in a
    btrfs subvolume mounted somewhere (subvols: subvolume path -> mountpoint).
    """
    path = re.sub(r"^\([^)]*\)", "", path)
    if not path.startswith("/"):
        path = "/" + path
    inside = [
        mp.rstrip("/") + path[len(sv) + 1 :]
        for sv, mp in sorted((subvols or {}).items(), key=lambda i: -len(i[0]))
        if path.startswith(f"/{sv}/")
    ]
    for candidate in (*inside, path, "/boot" + path):
        if g.is_file(candidate, followsymlinks=True):
            return candidate
    return ""


def kernel_version_of(path: str) -> str:
    name = path.rsplit("/", 1)[-1]
    for prefix in ("vmlinuz-", "vmlinux-", "bzImage-", "kernel-"):
        if name.startswith(prefix):
            return name[len(prefix) :]
    return ""


def initrd_for(g: Any, version: str) -> str:
    for name in (
        f"initrd.img-{version}",
        f"initramfs-{version}.img",
        f"initrd-{version}",
        f"initramfs-{version}",
    ):
        if g.is_file(f"/boot/{name}", followsymlinks=True):
            return f"/boot/{name}"
    return ""


def _from_entry(
    g: Any, e: BootEntry, subvols: dict[str, str] | None = None
) -> tuple[str, str, str] | None:
    """The entry's files, None when its kernel is not found or has no version in its
    name (then the image's other conventions decide)."""
    kernel = resolve(g, e.kernel, subvols)
    version = kernel_version_of(kernel)
    if not kernel or not version:
        return None
    initrd = resolve(g, e.initrd, subvols) if e.initrd else ""
    return kernel, initrd or (initrd_for(g, version) if version else ""), version


def _boot_loader_entry(g: Any) -> BootEntry | None:
    for cfg in GRUB_CONFIGS:
        if g.is_file(cfg, followsymlinks=True):
            e = grub_default_entry(g.cat(cfg))
            if e:
                return e
    if g.is_dir(BLS_DIR):
        entries = []
        for name in g.ls(BLS_DIR):
            if name.endswith(".conf"):
                e = bls_entry(g.cat(f"{BLS_DIR}/{name}"))
                if e:
                    entries.append((version_key(name), e))
        if entries:
            # blscfg shows the highest version first and boots it by default.
            return max(entries, key=lambda t: t[0])[1]
    return None


def find_kernel(g: Any, subvols: dict[str, str] | None = None) -> tuple[str, str, str]:
    """(kernel path, initrd path or "", version) in the mounted image; subvols:
    the btrfs subvolumes its /etc/fstab mounts (subvolume path -> mountpoint)."""
    entry = _boot_loader_entry(g)
    files = _from_entry(g, entry, subvols) if entry else None
    if files:
        return files
    for link in ("/vmlinuz", "/boot/vmlinuz"):
        if g.is_symlink(link):
            version = kernel_version_of(g.readlink(link))
            if version:
                kernel = f"/boot/vmlinuz-{version}"
                if not g.is_file(kernel, followsymlinks=True):
                    raise UserError(
                        f"kernel {kernel} (the target of {link}) missing in the "
                        "image, with every file system of its /etc/fstab mounted",
                        "check the image's /etc/fstab (a separate /boot must be "
                        "listed) and repair the golden image",
                    )
                return kernel, initrd_for(g, version), version
    if not g.is_dir("/boot"):
        raise UserError("the image has no /boot", "the analyzer boots the image's own kernel")
    versions = sorted(
        (
            v
            for v in map(kernel_version_of, g.ls("/boot"))
            if v and g.is_file(f"/boot/vmlinuz-{v}", followsymlinks=True)
        ),
        key=version_key,
    )
    if not versions:
        raise UserError(
            "no kernel (/boot/vmlinuz-*) in the image, with every file system of "
            "its /etc/fstab mounted",
            "install a kernel package in the golden image; if /boot is a "
            "partition of its own, /etc/fstab must mount it",
        )
    return f"/boot/vmlinuz-{versions[-1]}", initrd_for(g, versions[-1]), versions[-1]
