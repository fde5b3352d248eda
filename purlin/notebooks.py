"""The notebooks in ``notebooks/``: finding them, running them headless, and the demo.

Notebooks are the main way into Purlin (``./dev.sh lab`` opens them in JupyterLab). This module
runs them without a browser, through nbclient and an ipykernel: the tests execute every one,
and ``purlin demo`` executes the tour on the cpu datapath, prints what it prints and writes its
timelines as a standalone HTML page, for machines without a screen. nbclient and nbformat
(the ``notebook`` extra) are imported when a notebook runs.

>>> [p.name for p in notebook_paths()][:2]
['01-tour.ipynb', '02-custom-collective.ipynb']
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Callable

from purlin.errors import CapabilityError, ExecutionError

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
TOUR = "01-tour.ipynb"
CELL_TIMEOUT = 120  # seconds per cell: a notebook must never hang
# The tour's last timelines, exported by the demo (the tour names them; a test checks it).
DEMO_EXPORT = """\
from purlin.viz import compare_figure, to_html

_ = to_html(compare_figure(predicted, measured), {path!r})"""

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def notebook_paths(folder: Path | str | None = None) -> list[Path]:
    """The notebooks of ``folder`` (default: the repository's ``notebooks/``), in order."""
    folder = Path(folder) if folder is not None else NOTEBOOKS
    if not folder.is_dir():
        raise ExecutionError(f"no notebooks folder at {folder}: the notebooks ship with the "
                             "repository (a checkout with pip install -e .), not the wheel")
    return sorted(folder.glob("[0-9]*.ipynb"))


def _nb_modules():
    try:
        import nbclient
        import nbformat
    except ModuleNotFoundError as exc:
        raise CapabilityError(f"running notebooks needs {exc.name}: pip install -e '.[notebook]'"
                              " (or ./dev.sh demo, which installs it)") from None
    return nbformat, nbclient


def execute(path, *, cwd=None, timeout: int = CELL_TIMEOUT, cpu_only: bool = False,
            extra_cells: tuple[str, ...] = (), env: dict | None = None,
            on_cell: Callable | None = None, kernel_log=None):
    """Run the notebook at ``path`` top to bottom in a fresh kernel and return it with its
    outputs (an nbformat NotebookNode). The kernel starts in ``cwd`` (default: the notebook's
    folder); ``extra_cells`` are code cells appended first; ``cpu_only`` hides every GPU from
    the kernel (``CUDA_VISIBLE_DEVICES=""``); ``env`` adds environment variables;
    ``on_cell(cell, index)`` is called after each cell ran; ``kernel_log`` (a path) takes the
    kernel process's own output (start-up warnings) instead of this process's stderr. A cell
    that raises or runs longer than ``timeout`` seconds, or a kernel that dies, raises
    ExecutionError naming the notebook, the cell and the error."""
    nbformat, nbclient = _nb_modules()
    path = Path(path)
    nb = nbformat.read(path, as_version=4)
    for source in extra_cells:
        nb.cells.append(nbformat.v4.new_code_cell(source))
    kernel_env = dict(os.environ)
    kernel_env.update(env or {})
    if cpu_only:
        kernel_env["CUDA_VISIBLE_DEVICES"] = ""
    def hook(cell, cell_index, **_):
        if on_cell is not None:
            on_cell(cell, cell_index)
    client = nbclient.NotebookClient(
        nb, timeout=timeout, kernel_name="python3", allow_errors=False,
        resources={"metadata": {"path": str(Path(cwd) if cwd is not None else path.parent)}},
        on_cell_executed=hook)
    launch = {"env": kernel_env}
    log = open(kernel_log, "w") if kernel_log is not None else None  # noqa: SIM115
    if log is not None:
        launch.update(stdout=log, stderr=log)
    try:
        client.execute(**launch)
    except nbclient.exceptions.CellTimeoutError as exc:
        raise ExecutionError(f"{path.name}: a cell ran longer than {timeout} s: "
                             f"{_ANSI.sub('', str(exc))[:2000]}") from None
    except nbclient.exceptions.CellExecutionError as exc:
        index = _failed_cell(nb)
        raise ExecutionError(f"{path.name}: cell {index} raised {exc.ename}: "
                             f"{_ANSI.sub('', exc.evalue)}\n{_ANSI.sub('', str(exc))}") from None
    except nbclient.exceptions.DeadKernelError as exc:
        where = f" (its output is in {kernel_log})" if kernel_log is not None else ""
        raise ExecutionError(f"{path.name}: the kernel died{where}: {exc}") from None
    finally:
        if log is not None:
            log.close()
    return nb


def _failed_cell(nb) -> int | None:
    for i, cell in enumerate(nb.cells):
        if any(o.get("output_type") == "error" for o in cell.get("outputs", ())):
            return i
    return None


# -- the demo -----------------------------------------------------------------------------------


def demo(out="outputs", *, cpu_only: bool = True, timeout: int = CELL_TIMEOUT,
         print_fn: Callable[[str], None] = print) -> dict[str, Path]:
    """Execute the tour notebook headless, echoing its headings and text outputs, and write
    into ``out`` (created if missing; default ``outputs/``, which git ignores):
    ``demo-timeline.html`` (predicted and measured timelines of the tour, a
    standalone page), ``demo-tour.ipynb`` (the executed notebook) and ``demo-kernel.log``
    (what the kernel process printed). Returns the page's and the notebook's paths."""
    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    page = out / "demo-timeline.html"
    executed = out / "demo-tour.ipynb"
    tour = NOTEBOOKS / TOUR
    if not tour.exists():
        raise ExecutionError(f"the tour notebook is missing: {tour}")
    nbformat, _ = _nb_modules()
    cells = nbformat.read(tour, as_version=4).cells
    printer = _Echo(cells, print_fn)
    where = "the cpu datapath" if cpu_only else "the best cluster here"
    print_fn(f"purlin demo: running {tour.name} headless on {where}\n")
    nb = execute(tour, timeout=timeout, cpu_only=cpu_only,
                 extra_cells=(DEMO_EXPORT.format(path=str(page)),), on_cell=printer,
                 kernel_log=out / "demo-kernel.log")
    nbformat.write(nb, executed)
    print_fn(f"\ntimeline page:     {page}")
    print_fn(f"executed notebook: {executed}")
    return {"html": page, "notebook": executed}


class _Echo:
    """Prints, after each code cell of a notebook ran, the headings before it and its text
    outputs; figures and widgets as one line each."""

    def __init__(self, cells, print_fn):
        self.print = print_fn
        self.printed = False
        self.headings: dict[int, list[str]] = {}
        pending: list[str] = []
        for i, cell in enumerate(cells):
            if cell.cell_type == "markdown":
                pending += [line for line in cell.source.splitlines() if line.startswith("#")]
            elif cell.cell_type == "code":
                self.headings[i], pending = pending, []

    def __call__(self, cell, index) -> None:
        if cell.cell_type != "code":
            return
        headings = self.headings.get(index, ())
        for heading in headings:
            self.print(f"\n{heading.lstrip('#').strip()}\n{'-' * len(heading.lstrip('#').strip())}")
        texts = []
        for output in cell.get("outputs", ()):
            kind = output.get("output_type")
            if kind == "stream":
                texts.append(output.get("text", "").rstrip("\n"))
            elif kind in ("execute_result", "display_data"):
                texts.append(_describe(output.get("data", {})))
        if texts and not headings and self.printed:
            self.print("")  # a cell's output apart from the previous cell's
        for text in texts:
            self.print(text)
        self.printed = self.printed or bool(texts)

    # the tour's appended export cell has no heading and prints nothing


def _describe(data: dict) -> str:
    if "application/vnd.plotly.v1+json" in data:
        layout = data["application/vnd.plotly.v1+json"].get("layout", {})
        title = layout.get("title", {})
        text = title.get("text", "") if isinstance(title, dict) else str(title)
        return f"[plotly figure: {re.sub(r'<[^>]+>', ' ', text).strip()}]"
    if "application/vnd.jupyter.widget-view+json" in data:
        return "[interactive widget: open the notebook in JupyterLab (./dev.sh lab) to use it]"
    return str(data.get("text/plain", "")).rstrip("\n")
