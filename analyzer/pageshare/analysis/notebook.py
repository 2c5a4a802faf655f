"""Run the results notebooks headless against a results database.

notebooks/analysis.ipynb shows one analysis (run_notebook), and
notebooks/refinements.ipynb an image's list generations as `pageshare list
refine` recorded them (run_refinements_notebook).  Each reads its settings
from the environment (PAGESHARE_DB, PAGESHARE_FIGURES, and PAGESHARE_ANALYSIS,
or PAGESHARE_IMAGE and PAGESHARE_REFINEMENT); the runners set them for the
kernel only, execute every cell with nbclient and write the executed
notebook.  The kernel is ipykernel's own "python3" kernel for the interpreter
running this code (sys.executable), never a "python3" kernel spec registered
elsewhere on the machine, so the notebook sees the same packages as the
caller.  Needs the "notebooks" extra: pip install 'pageshare[notebooks]'.
"""

import atexit
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from .datafiles import checkout, notebook

NOTEBOOK = notebook("analysis.ipynb")
REFINEMENTS_NOTEBOOK = notebook("refinements.ipynb")
KERNEL_NAME = "python3"
# Every setting a notebook reads besides PAGESHARE_DB: the caller's own are
# never passed on, only those given.
SETTINGS = ("PAGESHARE_ANALYSIS", "PAGESHARE_IMAGE", "PAGESHARE_REFINEMENT", "PAGESHARE_FIGURES")

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def _strip_ansi(text: str) -> str:
    return _ANSI.sub("", text)


def _kernel_env(db: Path, settings: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in SETTINGS}
    env["PAGESHARE_DB"] = str(db)
    env.update(settings)
    env["MPLBACKEND"] = "Agg"
    return env


def _install_hint() -> str:
    if checkout() is None:  # the Debian package: its Recommends
        return (
            "apt install python3-pandas python3-matplotlib python3-nbclient "
            "python3-nbformat python3-ipykernel"
        )
    return "pip install 'pageshare[notebooks]'"


def _first_error(nb: Any) -> tuple[int, str, str] | None:
    """(cell index, cell id, error text) of the first cell with an error output."""
    for index, cell in enumerate(nb.cells):
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error":
                tb = _strip_ansi("\n".join(out.get("traceback", [])))
                text = f"{out.get('ename', 'Error')}: {out.get('evalue', '')}"
                if tb:
                    text += "\n" + tb
                return index, str(cell.get("id", "?")), text
    return None


def run_notebook(
    db: Path, analysis_id: int | None, out_ipynb: Path, figures_dir: Path | None, timeout: int = 300
) -> Path:
    """Execute notebooks/analysis.ipynb on `db` and write the executed notebook.

    analysis_id None means the newest analysis with status 'ok'; figures_dir
    None means figures are only embedded in the notebook, not saved as PNG.
    `timeout` is per cell, in seconds.  Returns out_ipynb.  Raises
    RuntimeError naming the failing cell and its error if any cell fails (the
    partly executed notebook is still written to out_ipynb).
    """
    settings = {} if analysis_id is None else {"PAGESHARE_ANALYSIS": str(analysis_id)}
    return _run(
        NOTEBOOK,
        "analysis notebook",
        db,
        settings,
        {"analysis_id": analysis_id},
        out_ipynb,
        figures_dir,
        timeout,
    )


def run_refinements_notebook(
    db: Path,
    out_ipynb: Path,
    figures_dir: Path | None,
    *,
    image: str | None = None,
    refinement_id: int | None = None,
    timeout: int = 300,
) -> Path:
    """Execute notebooks/refinements.ipynb on `db`: the list generations of
    one image, each refinement's blocks and coverage (docs/results-db.md).

    The generations shown are those that lead to refinement_id (default: the
    newest refinement with status 'ok', of `image` if given: its id in the
    image table, its path, or a prefix of its content sha256).  Otherwise
    as run_notebook."""
    settings: dict[str, str] = {}
    if image is not None:
        named = Path(image).expanduser()
        # The kernel runs in the notebook's directory: a path must be absolute.
        settings["PAGESHARE_IMAGE"] = (
            str(named.resolve()) if not image.isdigit() and named.exists() else image
        )
    if refinement_id is not None:
        settings["PAGESHARE_REFINEMENT"] = str(refinement_id)
    return _run(
        REFINEMENTS_NOTEBOOK,
        "refinements notebook",
        db,
        settings,
        {"image": image, "refinement_id": refinement_id},
        out_ipynb,
        figures_dir,
        timeout,
    )


def _run(
    notebook_path: Path,
    what: str,
    db: Path,
    settings: dict[str, str],
    metadata: dict[str, Any],
    out_ipynb: Path,
    figures_dir: Path | None,
    timeout: int,
) -> Path:
    try:
        import nbformat
        from jupyter_client.kernelspec import KernelSpecManager
        from jupyter_client.manager import AsyncKernelManager
        from jupyter_core.utils import run_sync
        from nbclient import NotebookClient
        from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError
    except ImportError as e:
        raise RuntimeError(f"running the {what} needs {e.name}: {_install_hint()}") from e
    try:
        import ipykernel  # noqa: F401  (the kernel must run in this interpreter)
    except ImportError as e:
        raise RuntimeError(
            f"ipykernel is not installed for {sys.executable}: {_install_hint()}"
        ) from e

    db = Path(db).expanduser().resolve()
    if not db.is_file():
        raise RuntimeError(f"results database not found: {db}")
    if not notebook_path.is_file():
        raise RuntimeError(f"{what} not found: {notebook_path}")
    figures = Path(figures_dir).expanduser().resolve() if figures_dir is not None else None
    if figures is not None:
        settings = {**settings, "PAGESHARE_FIGURES": str(figures)}
    out_ipynb = Path(out_ipynb).expanduser().resolve()
    out_ipynb.parent.mkdir(parents=True, exist_ok=True)

    nb = nbformat.read(notebook_path, as_version=4)  # type: ignore[no-untyped-call]
    # An empty kernel search path leaves only ipykernel's native spec, whose
    # argv is [sys.executable, "-m", "ipykernel_launcher", ...].
    specs = KernelSpecManager(kernel_dirs=[])
    # IPC transport (Unix sockets in a private directory): no TCP ports, no
    # unencrypted-TCP warning.  The socket path must be absolute: the kernel
    # runs in notebooks/, not in the caller's working directory.
    sockets = Path(tempfile.mkdtemp(prefix="pageshare-kernel-"))
    km = AsyncKernelManager(
        kernel_name=KERNEL_NAME,
        kernel_spec_manager=specs,
        transport="ipc",
        ip=str(sockets / "kernel"),
    )
    client = NotebookClient(
        nb,
        km=km,
        kernel_name=KERNEL_NAME,
        timeout=timeout,
        resources={"metadata": {"path": str(notebook_path.parent)}},
    )

    failure: str | None = None
    cause: BaseException | None = None
    try:
        client.execute(cleanup_kc=True, env=_kernel_env(db, settings))
    except CellExecutionError as e:
        cause = e
        found = _first_error(nb)
        if found is not None:
            index, cell_id, text = found
            failure = f"cell {index} ({cell_id}) failed: {text}"
        else:
            failure = f"a cell failed: {e.ename}: {e.evalue}"
    except CellTimeoutError as e:
        cause = e
        failure = f"a cell ran longer than {timeout} s: {_strip_ansi(str(e))}"
    except DeadKernelError as e:
        cause = e
        failure = f"the kernel died: {e}"
    except Exception as e:  # kernel start-up and messaging failures (plain RuntimeError etc.)
        cause = e
        failure = f"could not run the {KERNEL_NAME} kernel ({sys.executable}): {e}"
        # nbclient leaves its exit-time kernel cleanup registered when start-up fails.
        atexit.unregister(client._cleanup_kernel)
        if km.has_kernel:
            run_sync(km.shutdown_kernel)(now=True)
    finally:
        shutil.rmtree(sockets, ignore_errors=True)

    nb.metadata["pageshare"] = {
        "db": str(db),
        **metadata,
        "figures_dir": str(figures) if figures is not None else None,
        "kernel_python": sys.executable,
    }
    nbformat.write(nb, out_ipynb)  # type: ignore[no-untyped-call]
    if failure is not None:
        raise RuntimeError(
            f"{what} {notebook_path.name} on {db}: {failure}\n"
            f"(partly executed notebook: {out_ipynb})"
        ) from cause
    return out_ipynb


REPORT_EPILOG = """\
what it does:
  executes the results notebook (analysis.ipynb: listed blocks, what the
  guests' merged memory was, coverage, the KSM curve) headless against the
  results database analyze-image wrote, and writes the executed notebook
  (open it in Jupyter, or convert it: jupyter nbconvert --to html FILE);
  --figures also saves each figure as a PNG.  With --refinements it runs
  refinements.ipynb instead: an image's list generations as `pageshare list
  refine` recorded them, the blocks each refinement added and dropped, and
  each generation's share of the fleet's reads (docs/results-db.md).  Needs
  pandas, matplotlib, nbclient, nbformat and ipykernel (Debian:
  python3-pandas python3-matplotlib python3-nbclient python3-nbformat
  python3-ipykernel).

exit status: 0 done, 1 a cell failed or a module is missing (the message
says which), 2 usage.

examples:
  pageshare report                                  # newest analysis -> ./pageshare-report.ipynb
  pageshare report --analysis 3 --figures figs/ --out run3.ipynb
  pageshare report --refinements                    # newest refinement's generations
  pageshare report --refinements --image golden.qcow2 --figures figs/
  pageshare report --refinements --refinement 7     # the generations that led to #7
"""


def main(argv: list[str]) -> int:
    import argparse

    from ..errors import print_error
    from .analyze import default_db

    p = argparse.ArgumentParser(
        prog="pageshare report",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run the results notebook headless on analyze-image's results.",
        epilog=REPORT_EPILOG,
    )
    p.add_argument(
        "--db",
        type=Path,
        default=default_db(),
        help="results database (default: %(default)s, or $PAGESHARE_DB)",
    )
    p.add_argument(
        "--analysis",
        type=int,
        metavar="ID",
        help="the analysis to show (default: the newest one that succeeded)",
    )
    p.add_argument(
        "--refinements",
        action="store_true",
        help="show an image's list generations and refinements instead",
    )
    p.add_argument(
        "--image",
        metavar="IMAGE",
        help="with --refinements: the image (its id in the results database, its "
        "path, or a prefix of its content sha256; default: the newest refinement's)",
    )
    p.add_argument(
        "--refinement",
        type=int,
        metavar="ID",
        help="with --refinements: the generations that led to this refinement "
        "(default: the newest that succeeded)",
    )
    p.add_argument(
        "--out",
        type=Path,
        help="the executed notebook (default: pageshare-report.ipynb, with "
        "--refinements pageshare-refinements.ipynb)",
    )
    p.add_argument("--figures", type=Path, metavar="DIR", help="also save figures as PNG here")
    args = p.parse_args(argv)
    if args.refinements and args.analysis is not None:
        p.error("--analysis and --refinements show different notebooks: give one")
    if not args.refinements and (args.image is not None or args.refinement is not None):
        p.error("--image and --refinement go with --refinements")
    try:
        if args.refinements:
            out = run_refinements_notebook(
                args.db,
                args.out or Path("pageshare-refinements.ipynb"),
                args.figures,
                image=args.image,
                refinement_id=args.refinement,
            )
        else:
            out = run_notebook(
                args.db, args.analysis, args.out or Path("pageshare-report.ipynb"), args.figures
            )
    except RuntimeError as e:
        first, _, rest = str(e).partition("\n")
        print_error(first, rest, prog="pageshare report")
        return 1
    print(out)
    return 0
