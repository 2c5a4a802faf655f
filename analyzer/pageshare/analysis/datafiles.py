"""Where pageshare's files other than its Python modules are.

Installed from the Debian package (packaging/pageshare), the Python code is
in /usr/lib/pageshare/python, the crash extension, built when the package
was built, is /usr/lib/pageshare/pagescan.so (with the crash version it was
built against beside it), and the notebooks are in
/usr/share/pageshare/notebooks.  Run from a source checkout, the extension
is built from crash-ext/ (make, against the installed crash's defs.h) and
the notebooks are the checkout's.  The checkout is used only when this
module is inside one, so an installed package never builds anything, nor
looks for a source tree.  PAGESHARE_PAGESCAN names another extension.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from ..errors import UserError

INSTALLED_LIB = Path("/usr/lib/pageshare")
INSTALLED_SHARE = Path("/usr/share/pageshare")


def checkout() -> Path | None:
    """The source checkout this module runs from, if it runs from one."""
    root = Path(__file__).resolve().parents[3]
    if (root / "crash-ext" / "pagescan.c").is_file() and (root / "analyzer").is_dir():
        return root
    return None


def crash_version() -> str:
    """The installed crash's version line ("crash 8.0.2")."""
    out = subprocess.run(["crash", "--version"], capture_output=True, text=True)
    for line in out.stdout.splitlines():
        if line.startswith("crash "):
            return line.strip()
    return "crash (unknown version)"


def pagescan_extension() -> Path:
    """The pagescan crash extension for the installed crash."""
    if not shutil.which("crash"):
        raise UserError(
            "the crash utility is not installed",
            "install it (apt install crash), or use --introspector drgn",
        )
    named = os.environ.get("PAGESHARE_PAGESCAN")
    if named:
        return Path(named)
    root = checkout()
    if root is None:
        ext = INSTALLED_LIB / "pagescan.so"
        if not ext.is_file():
            raise UserError(
                f"{ext} is missing",
                "reinstall the pageshare package (apt install --reinstall pageshare)",
            )
        built_for = (INSTALLED_LIB / "pagescan.crash-version").read_text().strip()
        if built_for != crash_version():
            # crash extensions use crash's internal structures: another
            # version may lay them out differently.
            raise UserError(
                f"{ext} was built for {built_for}, but {crash_version()} is installed",
                "use --introspector drgn, or install the pageshare package built for this crash",
            )
        return ext
    ext_dir = root / "crash-ext"
    p = subprocess.run(["make", "-s", "-C", str(ext_dir)], capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"building crash-ext failed:\n{p.stdout}{p.stderr}")
    return ext_dir / "pagescan.so"


def notebook(name: str) -> Path:
    """A notebook by file name ("analysis.ipynb")."""
    root = checkout()
    return (root / "notebooks" if root else INSTALLED_SHARE / "notebooks") / name
