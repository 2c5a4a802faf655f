"""The notebook tests' shared steps: a notebook read or executed headless,
the errors and text its cells show, the figures it saves as PNG.  (No
tests here.)

execute() runs a notebook of notebooks/ in ipykernel's own kernel for this
interpreter (a private kernel directory, IPC sockets: no TCP port), for the
notebooks that read a benchmark's recorded run (test_migration_notebook.py,
test_e2e_bench.py); the analysis and refinements notebooks are run by the
product (pageshare.analysis.notebook).  nbformat, nbclient and
jupyter_client are imported when called, so that a module importing this
one still collects where the notebook tests' importorskip would say what
is missing.
"""

from __future__ import annotations

import os
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def read_nb(path: Path) -> Any:
    import nbformat

    return nbformat.read(path, as_version=4)  # type: ignore[no-untyped-call]


def execute(notebook: Path, env: dict[str, str], prefix: str) -> Any:
    """NOTEBOOK executed (5 minutes at most per cell) in notebooks/ with
    ENV added to this process' environment and MPLBACKEND=Agg; the kernel's
    sockets in a temporary directory named PREFIX..., removed after."""
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import AsyncKernelManager
    from nbclient import NotebookClient

    nb = read_nb(notebook)
    sockets = Path(tempfile.mkdtemp(prefix=prefix))
    km = AsyncKernelManager(
        kernel_name="python3",
        kernel_spec_manager=KernelSpecManager(kernel_dirs=[]),
        transport="ipc",
        ip=str(sockets / "kernel"),
    )
    client = NotebookClient(
        nb,
        km=km,
        kernel_name="python3",
        timeout=300,
        resources={"metadata": {"path": str(REPO / "notebooks")}},
    )
    try:
        client.execute(cleanup_kc=True, env=dict(os.environ, **env, MPLBACKEND="Agg"))
    finally:
        shutil.rmtree(sockets, ignore_errors=True)
    return nb


def cell_errors(nb: Any) -> list[tuple[Any, Any, Any]]:
    """(cell id, exception name, its value) of every error a code cell shows."""
    return [
        (c.get("id"), o.get("ename"), o.get("evalue"))
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.get("outputs", [])
        if o.get("output_type") == "error"
    ]


def stream_text(nb: Any, cell_id: str) -> str:
    """What the one cell CELL_ID printed (its stream outputs)."""
    cells = [c for c in nb.cells if c.get("id") == cell_id]
    assert len(cells) == 1, f"notebook has no single cell {cell_id!r}"
    return "".join(o.get("text", "") for o in cells[0].outputs if o.output_type == "stream")


def shown_images(nb: Any) -> list[Any]:
    """The outputs of code cells that show a PNG."""
    return [
        o
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.outputs
        if "image/png" in o.get("data", {})
    ]


def png_size(data: bytes, name: str) -> tuple[int, int]:
    """Width and height of the PNG DATA (figure NAME), which must start
    with PNG's signature and its IHDR chunk."""
    assert data[:8] == PNG_MAGIC, name
    assert data[12:16] == b"IHDR", name
    width, height = struct.unpack(">II", data[16:24])
    return int(width), int(height)
