"""PTX bodies of the fused kernel's entries, and of the same source with a piece of its text
cut out, for tests that check a build carries none of another's code (no GPU needed)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

SOURCE = Path(__file__).resolve().parents[1] / "kernels" / "fused.py"


def fused_module():
    """``purlin.kernels.fused``, or a skip where PTX cannot be compiled here."""
    cuda = pytest.importorskip("numba.cuda", reason="numba-cuda compiles the kernels")
    if cuda.config.ENABLE_CUDASIM:
        pytest.skip("NUMBA_ENABLE_CUDASIM=1 is set: PTX needs the compiler")
    from purlin.kernels import fused

    return fused


def module_of(text: str, tmp_path, stem: str):
    """The fused kernel's source ``text`` (an edited copy of ``SOURCE``) imported as ``stem``."""
    path = tmp_path / f"{stem}.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def body(module, name: str) -> str:
    """Entry ``name`` of ``module`` compiled for sm_90, from its ``.entry`` on, with the names
    of symbols and shared arrays (numbered by what the process compiled before) replaced."""
    from purlin.kernels.compat import compile_ptx
    from purlin.kernels.executor import MAX_THREADS
    from purlin.kernels.fused import SIGNATURE

    ptx = compile_ptx(getattr(module, name).py_func, SIGNATURE, cc=(9, 0),
                      launch_bounds=MAX_THREADS)
    return re.sub(r"_ZN\w+|_cudapy_smem_\d+", "SYM", ptx[ptx.index(".visible .entry"):])
