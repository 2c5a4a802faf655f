"""pageshare's build and test tooling, shared by the scripts in
kernel-syscall/, qemu-patches/, packaging/, bench/ and page-server/bench/ and
by the tests.  Not part of the product: the Debian packages ship
analyzer/pageshare only.

- cargo: the cargo to build the page server with, and the tests' target directory
- ktestlib: the kernel series' build, boot and test driver (kernel-syscall/ktest.py)
- qemu_guest: the patched QEMU's build and a golden image booted on it through
  the filter (tests/qemu_helpers.py, tests/migration_helpers.py, bench/migration_bench.py)

The cache root and the private apt configuration are the product's
(pageshare.cache, pageshare.debian): the analyzer needs them too.
"""
