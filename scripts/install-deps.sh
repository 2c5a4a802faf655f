#!/bin/bash
# Installs everything pageshare needs on a Debian 12 host and creates the
# project's Python venv (.venv).  Idempotent: a second run only checks.
#
# The venv is made from Debian's /usr/bin/python3 with system site-packages,
# because libguestfs' Python binding comes only as the Debian package
# python3-guestfs.
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(
	# guests and images
	qemu-system-x86 qemu-utils ovmf libguestfs-tools python3-guestfs mmdebstrap
	e2fsprogs gdisk fdisk zstd dosfstools mtools squashfs-tools
	# mapping XFS file systems (xfs_db) and testing it (mkfs.xfs)
	xfsprogs
	# mapping btrfs (dump-tree) and testing it (mkfs.btrfs); LUKS headers for
	# the encrypted-image tests (cryptsetup luksFormat on a plain file)
	btrfs-progs cryptsetup-bin
	# introspection: crash ships its defs.h for extensions
	crash binutils gcc make
	# Python
	python3 python3-venv python3-dev
	# results and distribution
	sqlite3 redis-server
	# the kernel series (kernel-syscall/ktest.py): kernel build, static tests
	# (ksm_tests links libnuma), initramfs
	flex bison bc libelf-dev libssl-dev libnuma-dev cpio xz-utils rsync
	# the fuzz target of the filter's table parser (libFuzzer, ASan, UBSan)
	clang libclang-rt-dev
	# Debian packages (packaging/debs.py); the pageshare package's manual
	# pages (help2man) and vendored wheels (Debian's pip)
	dpkg-dev debhelper lintian help2man python3-pip
	# libvirt, for `pageshare attach --libvirt` and libvirt-watch and their
	# test (which runs a libvirtd of its own, in a mount namespace)
	libvirt-daemon-system libvirt-clients python3-libvirt
	# apparmor_parser, for the syntax of pageshare-host's AppArmor parts in
	# libvirt's profiles, and AppArmor's rule logic (python3-apparmor) for
	# their exec rules
	apparmor python3-apparmor
	# a FUSE file system for the test that an image on one is refused
	bindfs
	# `make lint`: the shell scripts
	shellcheck
)

if [ "$(id -u)" != 0 ]; then
	echo "install-deps: run as root (it installs Debian packages)" >&2
	exit 2
fi

missing=()
for p in "${APT_PACKAGES[@]}"; do
	dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
	echo "install-deps: installing ${missing[*]}" >&2
	apt-get update -qq
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
		"${missing[@]}" >/dev/null
	# libguestfs needs a host kernel for its appliance; Recommends are off above.
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq linux-image-amd64 >/dev/null
fi

if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c 'import guestfs' 2>/dev/null; then
	echo "install-deps: creating .venv" >&2
	rm -rf .venv
	/usr/bin/python3 -m venv --system-site-packages .venv
fi
# Both editable: the product (pyproject.toml, package pageshare in analyzer/)
# and the build and test tooling the scripts and tests import (tools/, package
# pageshare_tools; never shipped).
stamp=.venv/.pageshare-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ tools/pyproject.toml -nt "$stamp" ] ||
	! .venv/bin/python -c 'import pageshare_tools' 2>/dev/null; then
	echo "install-deps: installing Python packages into .venv" >&2
	.venv/bin/pip install -q --upgrade pip
	.venv/bin/pip install -q -e '.[notebooks,dev]' -e tools
	touch "$stamp"
fi
# Rust (page-server) comes with the machine image (rustup); Debian 12's cargo
# is too old for the page server's dependencies, so do not fall back to it.
export PATH="$HOME/.cargo/bin:$PATH"
if ! command -v cargo >/dev/null; then
	echo "install-deps: cargo not found; install Rust >= 1.80 with rustup, then rerun" >&2
	exit 2
fi
make -s -C crash-ext
echo "install-deps: ok" >&2
