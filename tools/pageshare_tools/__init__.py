"""pageshare's build and test tooling, shared by the scripts in
kernel-syscall/, qemu-patches/, packaging/, bench/ and page-server/bench/ and
by the tests.  Not part of the product: the Debian packages ship
analyzer/pageshare only.

- cargo: the cargo to build the page server with, and the tests' target directory
- ktestlib: the kernel series' build, boot and test driver (kernel-syscall/ktest.py)

The cache root and the private apt configuration are the product's
(pageshare.cache, pageshare.debian): the analyzer needs them too.
"""
