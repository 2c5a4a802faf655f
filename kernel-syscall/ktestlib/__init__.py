"""ktest.py's parts (kernel-syscall/ktest.py is the command).

In the order a run uses them:

- common: paths, run(), log(), KtestError, the cache root
- source: Debian's linux-source-6.12 (host apt or a private apt), its git repository
- series: patches/ applied with git am
- kernel: config fragments, the cached bzImage builds
- payload: the pageshare filter test's payload (patched QEMU, pageshare-server,
  a base image and its list, the booted guest's kernel and initramfs)
- guest: busybox, the test list, the static test binaries, the VM's initramfs
- boot: QEMU under TCG, the serial log, TAP results and the kernel log scan
- commands: the subcommands (ktest.py's main() parses the command line)
"""

import sys
from pathlib import Path

# The analyzer's standard-library-only helpers: the cache root and the Debian
# mirror and private apt configuration, shared with the analyzer and build.py.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "analyzer"))
