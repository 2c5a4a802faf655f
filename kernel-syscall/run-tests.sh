#!/bin/sh
# Build the kernel series (cached), boot it under QEMU/TCG, run the tests.
# Usage: kernel-syscall/run-tests.sh [--config debug|plain] [--bench] [--only REGEX] [-v]
exec python3 "$(dirname "$0")/ktest.py" run "$@"
