"""pageshare-host's /etc/default/grub.d/pageshare-kernel.cfg keeps the newest
pageshare kernel GRUB's default entry: run by Debian 12's and 13's own
grub-mkconfig (grub-common from the archive, relocated into a scratch tree
with a fake /boot and a stub grub-probe: tests/grub_tree.py), so the id it
sets is checked against the entries Debian's real 10_linux writes for the
same kernels and root device, and the default is resolved as GRUB resolves
it (pageshare.host.grubboot, a port of grub-core/normal/menu.c's rules, itself
checked here on hand-written menus).  No VM, no root file system touched.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from grub_tree import ROOT_UUID, SNIPPET, SUITES, GrubTree, RootDevice, grub_common
from pageshare.host import grubboot

pytestmark = pytest.mark.build

PAGESHARE = "6.12.38-pageshare-cloud-amd64"
DEBIAN_NEWER = "6.12.43+deb13-cloud-amd64"  # a later patch level: 10_linux lists it first
DEBIAN_OLD = "6.1.0-56-amd64"


@pytest.fixture(params=SUITES)
def tree(request: pytest.FixtureRequest) -> Iterator[GrubTree]:
    t = GrubTree(grub_common(request.param))
    yield t
    t.remove()


def pinned(release: str, ident: str = ROOT_UUID, submenu: bool = True) -> str:
    """The GRUB_DEFAULT the snippet should write: 10_linux's ids."""
    entry = f"gnulinux-{release}-advanced-{ident}"
    return f"gnulinux-advanced-{ident}>{entry}" if submenu else entry


def default_line(cfg: str) -> str:
    """00_header's `set default` (the one that is not grub-reboot's next_entry)."""
    [line] = [
        ln.strip()
        for ln in cfg.splitlines()
        if ln.strip().startswith("set default=") and "next_entry" not in ln
    ]
    return line


def test_without_it_a_later_debian_kernel_becomes_the_default(tree: GrubTree) -> None:
    """The problem, on Debian's own 10_linux: entries newest first, default 0."""
    tree.kernels(PAGESHARE, DEBIAN_NEWER, DEBIAN_OLD)
    cfg, _ = tree.mkconfig()
    assert default_line(cfg) == 'set default="0"'
    g = grubboot.grub_default(cfg)
    assert g.release == DEBIAN_NEWER and not g.fallback
    assert g.path[0].id == f"gnulinux-simple-{ROOT_UUID}"


def test_it_pins_the_pageshare_kernels_own_entry(tree: GrubTree) -> None:
    tree.kernels(PAGESHARE, DEBIAN_NEWER, DEBIAN_OLD)
    tree.install_snippet()
    cfg, messages = tree.mkconfig()
    want = pinned(PAGESHARE)
    assert default_line(cfg) == f'set default="{want}"'
    # The id names entries 10_linux wrote: the submenu, then the kernel's own
    # (not its recovery entry, not the simple entry of the newest kernel).
    g = grubboot.grub_default(cfg)
    assert [e.id for e in g.path] == want.split(">")
    assert g.release == PAGESHARE and not g.fallback
    assert g.path[-1].title.endswith(f"with Linux {PAGESHARE}")
    assert f'pageshare: GRUB_DEFAULT="{want}"' in messages
    # host check's fix names the same id for this kernel
    assert grubboot.entry_for(g.menu, PAGESHARE) == want


@pytest.mark.parametrize("value", ["y", "yes", "true"])
def test_without_the_submenu_the_entry_is_top_level(tree: GrubTree, value: str) -> None:
    tree.kernels(PAGESHARE, DEBIAN_NEWER)
    tree.install_snippet()
    tree.default.write_text(tree.default.read_text() + f"GRUB_DISABLE_SUBMENU={value}\n")
    cfg, _ = tree.mkconfig()
    want = pinned(PAGESHARE, submenu=False)
    assert default_line(cfg) == f'set default="{want}"'
    assert "submenu " not in cfg
    g = grubboot.grub_default(cfg)
    assert [e.id for e in g.path] == [want] and g.release == PAGESHARE
    assert grubboot.entry_for(g.menu, PAGESHARE) == want


def test_the_newest_pageshare_kernel_wins(tree: GrubTree) -> None:
    """By version (6.12.10 after 6.12.9), and a dpkg leftover is no kernel."""
    old, new = "6.12.9-pageshare-cloud-amd64", "6.12.10-pageshare-cloud-amd64"
    tree.kernels(old, new, DEBIAN_NEWER)
    (tree.boot / "vmlinuz-6.12.99-pageshare-cloud-amd64.dpkg-new").write_bytes(b"x")
    tree.install_snippet()
    cfg, _ = tree.mkconfig()
    assert default_line(cfg) == f'set default="{pinned(new)}"'
    assert grubboot.grub_default(cfg).release == new
    assert "6.12.99" not in cfg
    assert grubboot.pageshare_kernels(tree.boot) == [old, new]


@pytest.mark.parametrize(
    ("device", "setting", "ident"),
    [
        # LVM: the id is the logical volume's file system UUID, as 10_linux's
        (
            RootDevice(
                "/dev/mapper/vg0-root", "5d2a8c1e-0b7f-4e39-a6d4-93c0f1e2b845", "ext2", "lvm"
            ),
            "",
            "5d2a8c1e-0b7f-4e39-a6d4-93c0f1e2b845",
        ),
        # btrfs: the file system's UUID too
        (
            RootDevice("/dev/vda2", "c3b1e7a4-6f20-4d8e-b915-7a2e0d4c6f31", "btrfs"),
            "",
            "c3b1e7a4-6f20-4d8e-b915-7a2e0d4c6f31",
        ),
        # no UUID found, or UUIDs turned off: the device's name
        (RootDevice("/dev/vda1", ""), "", "/dev/vda1"),
        (RootDevice(), "GRUB_DISABLE_UUID=true\n", "/dev/vda1"),
    ],
    ids=["lvm", "btrfs", "no-uuid", "disable-uuid"],
)
def test_the_id_follows_the_root_device(
    tree: GrubTree, device: RootDevice, setting: str, ident: str
) -> None:
    tree.set_device(device)
    tree.kernels(PAGESHARE, DEBIAN_NEWER)
    tree.install_snippet()
    tree.default.write_text(tree.default.read_text() + setting)
    cfg, _ = tree.mkconfig()
    assert default_line(cfg) == f'set default="{pinned(PAGESHARE, ident)}"'
    g = grubboot.grub_default(cfg)
    assert g.release == PAGESHARE and not g.fallback


@pytest.mark.parametrize(
    ("default_grub", "grub_d", "want", "says"),
    [
        ("GRUB_DEFAULT=saved\n", {}, "${saved_entry}", "left"),
        ("GRUB_DEFAULT=2\n", {}, "2", "left"),
        (f'GRUB_DEFAULT="{pinned(DEBIAN_NEWER)}"\n', {}, pinned(DEBIAN_NEWER), "left"),
        # a grub.d file sourced before it (digits sort before letters)
        ("", {"10_local.cfg": "GRUB_DEFAULT=saved\n"}, "${saved_entry}", "left"),
        # one sourced after it has the last word
        ("", {"zz_local.cfg": "GRUB_DEFAULT=1\n"}, "1", "pinned"),
        ("PAGESHARE_GRUB_DEFAULT=false\n", {}, "0", ""),
    ],
    ids=["saved", "index", "own-id", "grub.d-before", "grub.d-after", "opt-out"],
)
def test_the_operators_own_default_wins(
    tree: GrubTree, default_grub: str, grub_d: dict[str, str], want: str, says: str
) -> None:
    tree.kernels(PAGESHARE, DEBIAN_NEWER)
    tree.install_snippet()
    tree.default.write_text(tree.default.read_text() + default_grub)
    for name, text in grub_d.items():
        (tree.grub_d / name).write_text(text)
    cfg, messages = tree.mkconfig()
    assert default_line(cfg) == f'set default="{want}"'
    # update-grub's output says what it did, and the pageshare kernel's id
    if says == "left":
        assert "is set: not making the pageshare kernel" in messages, messages
        assert f'(its entry: "{pinned(PAGESHARE)}")' in messages
    elif says == "pinned":
        assert f'pageshare: GRUB_DEFAULT="{pinned(PAGESHARE)}"' in messages
    else:
        assert "pageshare:" not in messages


def test_saved_users_point_grub_set_default_at_it(tree: GrubTree) -> None:
    """GRUB_DEFAULT=saved: grubenv's saved_entry decides (grub-set-default)."""
    tree.kernels(PAGESHARE, DEBIAN_NEWER)
    tree.install_snippet()
    tree.default.write_text(tree.default.read_text() + "GRUB_DEFAULT=saved\n")
    cfg, _ = tree.mkconfig()
    g = grubboot.grub_default(cfg, "# GRUB Environment Block\n" + "#" * 100)
    assert g.release == DEBIAN_NEWER and g.fallback  # no saved_entry: the first entry
    env = f"# GRUB Environment Block\nsaved_entry={pinned(PAGESHARE)}\n" + "#" * 100
    g = grubboot.grub_default(cfg, env)
    assert g.release == PAGESHARE and g.source.startswith("saved_entry=")


def test_no_pageshare_kernel_no_change(tree: GrubTree) -> None:
    tree.kernels(DEBIAN_NEWER, DEBIAN_OLD)
    tree.install_snippet()
    cfg, messages = tree.mkconfig()
    assert default_line(cfg) == 'set default="0"' and "pageshare" not in messages
    # and after the pageshare kernel is removed, the next update-grub unpins it
    tree.kernels(PAGESHARE)
    cfg, _ = tree.mkconfig()
    assert grubboot.grub_default(cfg).release == PAGESHARE
    for f in tree.boot.glob(f"*-{PAGESHARE}"):
        f.unlink()
    cfg, _ = tree.mkconfig()
    assert default_line(cfg) == 'set default="0"'


def test_sourced_outside_grub_mkconfig_it_does_nothing(tree: GrubTree) -> None:
    """grub's postinst (config_item) sources /etc/default/grub and grub.d/*.cfg
    under set -e to read a setting: no GRUB_DEVICE, no grub-mkconfig_lib."""
    tree.kernels(PAGESHARE, DEBIAN_NEWER)
    tree.install_snippet()
    p = subprocess.run(
        [
            "sh",
            "-ec",
            'for x in "$1" "$2"/*.cfg; do . "$x" >/dev/null; done; '
            'echo "GRUB_DEFAULT=$GRUB_DEFAULT"',
            "sh",
            str(tree.default),
            str(tree.grub_d),
        ],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "PAGESHARE_GRUB_BOOT": str(tree.boot)},
    )
    assert (p.returncode, p.stdout, p.stderr) == (0, "GRUB_DEFAULT=0\n", "")


def test_the_snippet_is_posix_sh() -> None:
    subprocess.run(["shellcheck", "--shell=sh", str(SNIPPET)], check=True)
    subprocess.run(["sh", "-n", str(SNIPPET)], check=True)


# --------------------------------------------------------------------------- GRUB's rules

MENU = """\
function gfxmode {
	set gfxpayload="${1}"
}
if [ "${next_entry}" ] ; then
   set default="${next_entry}"
   set next_entry=
else
   set default="DEFAULT"
fi
menuentry 'Debian GNU/Linux' --class debian $menuentry_id_option 'gnulinux-simple-U' {
	linux	/boot/vmlinuz-DEB root=UUID=U ro quiet
}
submenu 'Advanced options for Debian GNU/Linux' $menuentry_id_option 'gnulinux-advanced-U' {
	menuentry 'Debian GNU/Linux, with Linux DEB' $menuentry_id_option 'gnulinux-DEB-advanced-U' {
		linux	/boot/vmlinuz-DEB root=UUID=U ro quiet
	}
	menuentry 'Debian GNU/Linux, with Linux PS' $menuentry_id_option 'gnulinux-PS-advanced-U' {
		linux	/boot/vmlinuz-PS root=UUID=U ro quiet
	}
	menuentry 'a>b' --id 'odd>id' {
		linux	/vmlinuz-6.1.0-56-amd64 root=UUID=U ro
	}
}
menuentry 'UEFI Firmware Settings' $menuentry_id_option 'uefi-firmware' {
	fwsetup
}
""".replace("DEB", DEBIAN_NEWER).replace("PS", PAGESHARE)


@pytest.mark.parametrize(
    ("default", "release", "fallback"),
    [
        ("0", "6.12.43+deb13-cloud-amd64", False),
        ("1>1", PAGESHARE, False),
        ("1", "6.12.43+deb13-cloud-amd64", False),  # a submenu boots its first entry
        ("gnulinux-advanced-U>gnulinux-6.12.38-pageshare-cloud-amd64-advanced-U", PAGESHARE, False),
        (
            "Advanced options for Debian GNU/Linux>Debian GNU/Linux, with Linux " + PAGESHARE,
            PAGESHARE,
            False,
        ),
        ("gnulinux-advanced-U>odd>>id", "6.1.0-56-amd64", False),  # '>>' is a '>'
        ("gnulinux-advanced-U>a>>b", "6.1.0-56-amd64", False),  # by title
        # named entries that do not exist: the first entry, at that level
        (
            "gnulinux-advanced-U>gnulinux-6.12.30-pageshare-cloud-amd64-advanced-U",
            "6.12.43+deb13-cloud-amd64",
            True,
        ),
        (
            "gnulinux-advanced-OLDUUID>gnulinux-6.12.38-pageshare-cloud-amd64-advanced-OLDUUID",
            "6.12.43+deb13-cloud-amd64",
            True,
        ),
        ("7", "6.12.43+deb13-cloud-amd64", True),
        ("2", "", False),  # no kernel: firmware settings
        ("0x1>0x1", PAGESHARE, False),  # grub_strtoul's bases
    ],
)
def test_the_default_resolves_as_grub_does(default: str, release: str, fallback: bool) -> None:
    g = grubboot.grub_default(MENU.replace("DEFAULT", default))
    assert (g.release, g.fallback) == (release, fallback), g
    assert g.spec == default


def test_the_menu_and_a_pending_grub_reboot() -> None:
    menu, sets = grubboot.parse_menu(MENU)
    assert [e.id for e in menu] == ["gnulinux-simple-U", "gnulinux-advanced-U", "uefi-firmware"]
    assert menu[1].entries is not None and len(menu[1].entries) == 3
    assert sets["default"] == "DEFAULT"  # not grub-reboot's ${next_entry}
    env = "# GRUB Environment Block\nnext_entry=gnulinux-advanced-U>1\nsaved_entry=x\n####\n"
    g = grubboot.grub_default(MENU.replace("DEFAULT", "0"), env)
    assert g.next_entry == "gnulinux-advanced-U>1"
    assert grubboot.entry_for(menu, PAGESHARE) == (
        "gnulinux-advanced-U>gnulinux-6.12.38-pageshare-cloud-amd64-advanced-U"
    )
    assert grubboot.entry_for(menu, "6.1.0-56-amd64") == "gnulinux-advanced-U>odd>>id"
    assert grubboot.entry_for(menu, "6.12.30-pageshare-cloud-amd64") == ""


def test_pageshare_kernels_in_boot(tmp_path: Path) -> None:
    for name in (
        "vmlinuz-6.12.10-pageshare-cloud-amd64",
        "vmlinuz-6.12.9-pageshare-cloud-amd64",
        "vmlinuz-6.12.11-pageshare-cloud-amd64.dpkg-tmp",
        "vmlinuz-6.12.12-pageshare-cloud-amd64.old",
        "vmlinuz-6.12.43+deb13-cloud-amd64",
        "config-6.12.13-pageshare-cloud-amd64",
    ):
        (tmp_path / name).write_text("x")
    assert grubboot.pageshare_kernels(tmp_path) == [
        "6.12.9-pageshare-cloud-amd64",
        "6.12.10-pageshare-cloud-amd64",
    ]
    assert grubboot.pageshare_kernels(tmp_path / "nonexistent") == []
