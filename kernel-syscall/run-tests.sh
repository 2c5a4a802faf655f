#!/bin/sh
# Build the kernel series (cached), boot it under QEMU/TCG, run the tests.
# Usage: kernel-syscall/run-tests.sh [--config debug|plain] [--bench] [--only REGEX] [-v]
# The venv's Python (make deps): it has the tooling package ktest.py imports.
exec "$(dirname "$0")/../.venv/bin/python" "$(dirname "$0")/ktest.py" run "$@"
