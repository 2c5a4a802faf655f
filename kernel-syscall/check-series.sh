#!/bin/sh
# Apply the series patch by patch: checkpatch --strict each, build each.
# Usage: kernel-syscall/check-series.sh [--config plain|debug] [--no-build] [--no-checkpatch]
exec python3 "$(dirname "$0")/ktest.py" check-series "$@"
