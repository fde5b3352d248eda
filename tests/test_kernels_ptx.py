"""Every kernel and atom compiles for sm_90 and emits the instructions it is meant to.

No GPU needed: libNVVM (the CUDA 13 wheels of numba-cuda) turns Numba IR into PTX, and
nvJitLink (same wheels) assembles the PTX to report registers and spills.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

cuda = pytest.importorskip("numba.cuda", reason="numba-cuda is needed to compile the kernels")
if cuda.config.ENABLE_CUDASIM:
    pytest.skip("NUMBA_ENABLE_CUDASIM=1 is set: PTX can only be checked without the simulator",
                allow_module_level=True)

from purlin.kernels import atoms, executor, intrinsics  # noqa: E402
from purlin.kernels.compat import compile_ptx, ensure_numpy_compat  # noqa: E402

CC = (9, 0)


@pytest.fixture(scope="module", params=["executor", "executor_pdl"])
def executor_ptx(request) -> str:
    kernel = getattr(executor, request.param)
    return compile_ptx(kernel.py_func, executor.SIGNATURE, cc=CC,
                       launch_bounds=executor.MAX_THREADS)


def test_the_pdl_executor_waits_for_the_kernel_before_it():
    """executor_pdl lets the next kernel launch early and waits before reading anything."""
    ptx = compile_ptx(executor.executor_pdl.py_func, executor.SIGNATURE, cc=CC,
                      launch_bounds=executor.MAX_THREADS)
    body = ptx[ptx.index(".entry"):]
    assert body.index("griddepcontrol.launch_dependents") < body.index("griddepcontrol.wait")
    assert body.index("griddepcontrol.wait") < body.index("ld.global")
    plain = compile_ptx(executor.executor.py_func, executor.SIGNATURE, cc=CC,
                        launch_bounds=executor.MAX_THREADS)
    assert "griddepcontrol" not in plain


@pytest.mark.parametrize("instruction", [
    "ld.acquire.sys.global.u64",       # WAIT and the epoch read
    "red.release.sys.global.add.u64",  # NOTIFY, ABORT
    "fence.acq_rel.sys",
    "%globaltimer",                    # deadlines and traces
    "atom.acq_rel.gpu.global.add.u64",  # DONE / EPOCH
    "atom.acq_rel.gpu.global.cas.b64",  # claiming the error record
    "ld.global.v4.u32",                # copy, bf16 / f16 reduce
    "st.global.v4.u32",
    "ld.global.v4.f32", "st.global.v4.f32",
    "ld.global.v2.f64", "st.global.v2.f64",
    "cvt.rn.bf16x2.f32", "cvt.rn.f16x2.f32", "cvt.f32.f16",
    "bar.sync",
    "st.volatile.global.v4.u32",       # LL_PUT: {data, tag, data, tag}
    "ld.volatile.global.v4.u32",       # LL_GET polls
])
def test_executor_emits(executor_ptx, instruction):
    assert instruction in executor_ptx


def test_executor_has_no_calls_or_local_memory(executor_ptx):
    """Device functions are inlined and nothing spills to a stack frame in the PTX."""
    assert "call.uni" not in executor_ptx and "call " not in executor_ptx
    assert ".local" not in executor_ptx
    assert ".maxntid 512" in executor_ptx.replace(", 1, 1", "")


def test_only_executor_fp8_carries_the_fp8_reduction():
    """The FP8 decode and encode of reduce rows is compiled into ``executor_fp8`` only (the
    plain executor's PTX is a third smaller without it); ``kernel_for`` picks it for tables
    with an FP8 reduce row."""
    from purlin.kernels import isa
    from purlin.kernels.executor import kernel_for

    plain, fp8 = (compile_ptx(getattr(executor, k).py_func, executor.SIGNATURE, cc=CC,
                              launch_bounds=executor.MAX_THREADS)
                  for k in ("executor", "executor_fp8"))
    assert len(plain) < 0.8 * len(fp8)
    table = np.zeros((2, isa.ROW_WIDTH), np.int64)
    table[0, isa.OP], table[0, isa.DTYPE] = isa.REDUCE, isa.BF16
    table[1, isa.OP], table[1, isa.DTYPE] = isa.COPY, isa.E4M3
    assert kernel_for([table]) == "executor"  # (an FP8 copy moves bytes)
    table[0, isa.DTYPE] = isa.E5M2
    assert kernel_for([table]) == "executor-fp8"


def test_executor_fits_its_launch_bound(executor_ptx):
    """ptxas (through nvJitLink) keeps the kernel within 128 registers and spill-free, so a
    512-thread block always launches."""
    nvjitlink = pytest.importorskip("cuda.bindings.nvjitlink",
                                    reason="nvJitLink (CUDA 13 wheels) assembles the PTX")
    data = executor_ptx.encode()
    handle = nvjitlink.create(2, [f"-arch=sm_{CC[0]}{CC[1]}", "-verbose"])
    try:
        nvjitlink.add_data(handle, nvjitlink.InputType.PTX, data, len(data), "executor.ptx")
        nvjitlink.complete(handle)
        log = bytearray(nvjitlink.get_info_log_size(handle))
        nvjitlink.get_info_log(handle, log)
    finally:
        nvjitlink.destroy(handle)
    text = log.decode(errors="replace")
    regs = int(re.search(r"[Uu]sed (\d+) registers", text).group(1))
    assert regs <= 65536 // executor.MAX_THREADS, text
    assert "0 bytes spill stores" in text, text


@pytest.mark.parametrize("name, sig", [
    ("copy_bytes", "void(int64, int64, int64, int64, int64)"),
    ("reduce_row", "void(int64, int64, int64, int64, int64, int64, int64, int64, int64, "
                   "boolean)"),
    ("itemsize", "int64(int64)"),
    ("ll_put", "void(int64, int64, int64, int64, int64, int64)"),
])
def test_atom_compiles(name, sig):
    ptx = compile_ptx(getattr(atoms, name).py_func, sig, cc=CC, device=True)
    assert ".func" in ptx
    if name == "copy_bytes":
        assert "ld.global.v4.u32" in ptx and "st.global.v4.u32" in ptx
    if name == "reduce_row":
        assert "ld.global.v4.f32" in ptx and "cvt.rn.bf16x2.f32" in ptx


def _every_intrinsic(a, b):
    w = intrinsics.load_v4_u32(a)
    intrinsics.store_v4_u32(b, w)
    intrinsics.store_v4_f32(b + 16, intrinsics.load_v4_f32(a + 16))
    intrinsics.store_v4_i32(b + 32, intrinsics.load_v4_i32(a + 32))
    intrinsics.store_v2_f64(b + 48, intrinsics.load_v2_f64(a + 48))
    intrinsics.red_release_add(b + 64, intrinsics.load_acquire(a + 64))
    intrinsics.fence_system()
    t = intrinsics.globaltimer() + intrinsics.atomic_add(a + 72, 1)
    intrinsics.store_i64(b + 72, t + intrinsics.atomic_cas(a + 80, 0, 1))
    intrinsics.store_u8(b + 88, intrinsics.load_u8(a + 88))
    intrinsics.store_u16(b + 90, intrinsics.load_u16(a + 90))
    lo, hi = intrinsics.f16x2_to_f32(intrinsics.load_u32(a + 92))
    intrinsics.store_u32(b + 92, intrinsics.f32x2_to_f16x2(lo, hi))
    intrinsics.store_u32(b + 96, intrinsics.f32x2_to_bf16x2(intrinsics.bits_to_f32(w[0]), lo))
    intrinsics.store_f32(b + 100, intrinsics.load_f32(a + 100) + intrinsics.load_i32(a + 104))
    intrinsics.store_f64(b + 112, intrinsics.load_f64(a + 112))
    intrinsics.store_i64(b + 120, intrinsics.f32_to_bits(hi) + intrinsics.load_i64(a + 120))


def test_intrinsics_emit_their_instructions():
    ptx = compile_ptx(_every_intrinsic, "void(int64, int64)", cc=CC)
    for text in ["ld.global.v4.u32", "st.global.v4.u32", "ld.global.v4.f32", "st.global.v4.f32",
                 "ld.global.v4.u32", "st.global.v4.u32", "ld.global.v2.f64", "st.global.v2.f64",
                 "ld.acquire.sys.global.u64", "red.release.sys.global.add.u64",
                 "fence.acq_rel.sys", "mov.u64 %rd", "%globaltimer", "atom.acq_rel.gpu.global.add",
                 "atom.acq_rel.gpu.global.cas.b64", "ld.global.u8", "st.global.u8",
                 "ld.global.u16", "st.global.u16", "cvt.f32.f16", "cvt.rn.f16x2.f32",
                 "cvt.rn.bf16x2.f32", "ld.global.f32", "st.global.f32", "ld.global.f64",
                 "st.global.f64", "ld.global.u64", "st.global.u64"]:
        assert text in ptx, text


def test_numpy_alias_is_restored(monkeypatch):
    monkeypatch.delattr(np, "row_stack", raising=False)
    ensure_numpy_compat()
    assert np.row_stack is np.vstack


def test_launcher_rejects_bad_grids_before_touching_a_gpu():
    from purlin.errors import SpecError
    from purlin.kernels.launch import Launcher

    with pytest.raises(SpecError, match="at most 512 threads"):
        Launcher(0, threads=1024)
    with pytest.raises(SpecError, match="blocks_per_lane >= 1"):
        Launcher(0, blocks_per_lane=0)


def test_clock_pingpong_compiles_with_timer_and_system_scope_flags():
    from numba import types

    from purlin.kernels import clock
    from purlin.kernels.compat import compile_ptx

    ptx = compile_ptx(clock.pingpong.py_func, (types.int64,) * 5)
    for needle in ("%globaltimer", "ld.acquire.sys", "red.release.sys"):
        assert needle in ptx, needle
