#!/bin/sh
# Apply the series patch by patch: checkpatch --strict each, build each.
# Usage: kernel-syscall/check-series.sh [--config plain|debug] [--no-build] [--no-checkpatch]
# The venv's Python (make deps): it has the tooling package ktest.py imports.
exec "$(dirname "$0")/../.venv/bin/python" "$(dirname "$0")/ktest.py" check-series "$@"
