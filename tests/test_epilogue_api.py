"""User-written epilogues (``purlin.Epilogue``): device functions refused at bind time with a
clear error; user epilogues against unfused PyTorch on the kernel simulator, the cpu datapath
and (``gpu``) virtual ranks on one GPU; the built-in add + RMSNorm through the same mechanism
bit for bit equal to the fused kernel's NORM op.

The simulator cases run in one child process (``NUMBA_ENABLE_CUDASIM=1 python
tests/test_epilogue_api.py OUT``), as in ``test_kernels_sim.py``, whose buffers they reuse.
"""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest
from simulator import run_cases, simulator_tests

torch = pytest.importorskip("torch")
cuda = pytest.importorskip("numba.cuda")

from purlin import Cluster, Epilogue, SpecError, collectives  # noqa: E402
from purlin.atom.epilogue import rms_norm  # noqa: E402
from purlin.bench.epilogues import fp8_norm as bench_fp8_norm  # noqa: E402

CASES = {}
EPS = 1e-5


def case(fn):
    CASES[fn.__name__] = fn
    return fn


# ------------------------------------------------------------------- the users' epilogues


@cuda.jit(device=True)
def bias_gelu(v, bias):
    x = v + bias
    return 0.5 * x * (1.0 + math.erf(x * 0.7071067811865476))


@cuda.jit(device=True)
def swiglu(v, bias, up):  # silu(v + bias) * up: a column bias and an element-wise operand
    x = v + bias
    return x / (1.0 + math.exp(-x)) * up


def fp8_norm(hidden: int, eps: float = EPS):
    """add + RMSNorm + float8_e4m3fn with a per-token scale: (stat, finish, fn)."""
    return bench_fp8_norm(hidden, eps)


def fp8_epilogue(residual, weight, out, scales, functions=None):
    """``functions``: ``fp8_norm(hidden)``'s, shared by ranks that share a launch."""
    stat, finish, fn = functions or fp8_norm(weight.numel())
    return Epilogue(fn, extras=(weight,), residual=residual, stat=stat, finish=finish, out=out,
                    row_out=scales, hidden=weight.numel(), name="add_rms_norm_fp8")


# --------------------------------------------------------------- unfused PyTorch references


def torch_gelu(total, bias):
    return torch.nn.functional.gelu(total.float() + bias.float())


def torch_swiglu(total, bias, up):
    return torch.nn.functional.silu(total.float() + bias.float()) * up.float()


def torch_norm(total, residual, weight):
    """(new residual, rms_norm(residual) * weight in float32)."""
    r = (total.float() + residual.float()).to(total.dtype)
    h = weight.numel()
    return r, torch.rms_norm(r.float().reshape(-1, h), (h,), weight.float(), EPS).reshape(-1)


def torch_fp8(total, residual, weight):
    """(new residual, float8 codes, per-row scales) unfused."""
    r, n = torch_norm(total, residual, weight)
    rows = n.reshape(-1, weight.numel())
    scale = (rows.abs().amax(dim=1) / 448).clamp(min=1e-12)
    q = (rows / scale[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return r, q.reshape(-1), scale


def check_fp8(q, scales, residual_got, total, residual0, weight):
    """The fused FP8 outputs against unfused PyTorch: the same residual bits, scales within
    float32 rounding, codes at most one FP8 step apart (the scale's last bit can differ)."""
    r, q_want, s_want = torch_fp8(total, residual0, weight)
    assert torch.equal(residual_got.view(torch.int16), r.view(torch.int16))
    assert torch.allclose(scales, s_want, rtol=1e-5, atol=0), (scales, s_want)
    steps = (q.view(torch.uint8).int() - q_want.view(torch.uint8).int()).abs()
    assert int(steps.max()) <= 1, steps
    back = q.float().reshape(-1, weight.numel()) * scales[:, None]
    n = torch_norm(total, residual0, weight)[1].reshape(back.shape)
    assert torch.allclose(back, n, rtol=0.07, atol=1e-3 * float(n.abs().max()))


# ----------------------------------------------------------------- refused at bind time


def _x(dtype=torch.float32, rows=2, hidden=8):
    return torch.randn(rows, hidden).to(dtype)


def test_a_device_function_with_the_wrong_arity_is_refused_naming_the_signature():
    with pytest.raises(SpecError, match=r"epilogue 'bias_gelu': fn must take \(v\) -- the "
                                        r"value, then one per extra tensor; it takes \(v, bias\)"):
        Epilogue(bias_gelu).check(_x())
    with pytest.raises(SpecError, match=r"stat must take \(v, e0\); it takes \(v\)"):
        Epilogue(lambda v, p, q, w: v, extras=(torch.ones(8),), stat=lambda v: v).check(_x())


def test_a_device_function_returning_the_wrong_kind_is_refused():
    @cuda.jit(device=True)
    def pair(v, bias):
        return v, bias

    with pytest.raises(SpecError, match=r"epilogue 'pair': fn must return one float "
                                        r"\(as fn\(v, e0\)\); it returns a tuple of 2 floats"):
        Epilogue(pair, extras=(torch.ones(8),)).check(_x())
    with pytest.raises(SpecError, match=r"finish must return a tuple of 2 floats"):
        Epilogue(lambda v, p, q: v, stat=lambda v: v * v, finish=lambda t, m: t).check(_x())


def test_code_that_does_not_compile_is_refused_with_the_first_line_of_the_reason():
    def broken(v, bias):
        return math.no_such_function(v) + bias

    with pytest.raises(SpecError, match=r"epilogue 'broken': fn does not compile for float32 "
                                        r"arguments as fn\(v, e0\): .*no_such_function"):
        Epilogue(broken, extras=(torch.ones(8),)).check(_x())


def test_a_kernel_or_a_non_function_is_refused():
    @cuda.jit
    def kernel(a):
        a[0] = 1

    with pytest.raises(SpecError, match="is a CUDA kernel, not a device function"):
        Epilogue(kernel).check(_x())
    with pytest.raises(SpecError, match="must be a Numba CUDA device function"):
        Epilogue(3.0).check(_x())


def test_dtype_and_shape_mismatches_are_refused_naming_both():
    x = _x(torch.bfloat16)
    with pytest.raises(SpecError, match=r"extra 0 is torch.float32, the tensor torch.bfloat16; "
                                        r"give extras of the tensor's dtype"):
        Epilogue(bias_gelu, extras=(torch.ones(8),)).check(x)
    with pytest.raises(SpecError, match=r"extra 0 has 5 elements; it needs the tensor's 16 or "
                                        r"a row's 8"):
        Epilogue(bias_gelu, extras=(torch.ones(5, dtype=torch.bfloat16),)).check(x)
    with pytest.raises(SpecError, match=r"out must hold 16 elements of torch.bfloat16 or "
                                        r"float8_e4m3fn; got 16 torch.float16"):
        Epilogue(bias_gelu, extras=(torch.ones(8, dtype=torch.bfloat16),),
                 out=torch.empty(16, dtype=torch.float16)).check(x)
    with pytest.raises(SpecError, match="row_out must hold one float32 per row"):
        fp8_epilogue(torch.zeros_like(x), torch.ones(8, dtype=torch.bfloat16),
                     torch.empty(16, dtype=torch.float8_e4m3fn), torch.empty(3)).check(x)
    with pytest.raises(SpecError, match="an epilogue follows a bfloat16, float16 or float32"):
        Epilogue(lambda v: v).check(torch.ones(4, dtype=torch.int32))


def test_good_epilogues_pass_and_say_what_the_kernel_needs():
    x = _x(torch.bfloat16)
    bias = torch.ones(8, dtype=torch.bfloat16)
    assert Epilogue(bias_gelu, extras=(bias,)).check(x) == \
        {"hidden": 8, "per_column": (True,), "stats": 1}
    assert Epilogue(swiglu, extras=(bias, torch.ones_like(x))).check(x)["per_column"] == \
        (True, False)
    e = fp8_epilogue(torch.zeros_like(x), bias, torch.empty(16, dtype=torch.float8_e4m3fn),
                     torch.empty(2))
    assert e.check(x)["stats"] == 2
    assert rms_norm(torch.zeros_like(x), bias, EPS).check(x)["stats"] == 1


def test_a_plain_python_function_is_compiled_as_a_device_function_once():
    def double(v):
        return v * 2.0

    a, b = Epilogue(double).form(_x()), Epilogue(double).form(_x())
    assert a.fn is b.fn and hasattr(a.fn, "py_func")


# --------------------------------------------------------------------------- cpu datapath


def test_user_epilogues_on_the_cpu_datapath_match_unfused_torch():
    hidden, rows = 16, 3
    gen = torch.Generator().manual_seed(3)
    xs = [torch.randn(rows * hidden, generator=gen).half() for _ in range(2)]
    total = (xs[0].float() + xs[1].float()).half()
    bias = torch.randn(hidden, generator=gen).half()
    ups = [torch.randn(rows * hidden, generator=gen).half() for _ in range(2)]
    c = Cluster.cpu(2)
    ar = collectives.all_reduce(2)
    out = c.bind(ar, count=rows * hidden, dtype="float16",
                 epilogue=Epilogue(bias_gelu, extras=(bias,), hidden=hidden))(xs)
    for o in out:
        assert torch.allclose(o.float(), torch_gelu(total.reshape(rows, hidden), bias)
                              .reshape(-1), rtol=2e-3, atol=2e-3)
    out = c.bind(ar, count=rows * hidden, dtype="float16",
                 epilogue=[Epilogue(swiglu, extras=(bias, ups[r]), hidden=hidden)
                           for r in range(2)])(xs)
    for r in range(2):
        want = torch_swiglu(total.reshape(rows, hidden), bias, ups[r].reshape(rows, hidden))
        assert torch.allclose(out[r].float(), want.reshape(-1), rtol=2e-3, atol=2e-3)
    residual = torch.randn(rows * hidden, generator=gen).half()
    weight = torch.rand(hidden, generator=gen).half()
    want_r, want = torch_norm(total, residual, weight)
    out = c.bind(ar, count=rows * hidden, dtype="float16",
                 epilogue=[rms_norm(residual if r == 0 else residual.clone(), weight, EPS)
                           for r in range(2)])(xs)
    assert torch.equal(residual, want_r)
    assert torch.allclose(out[0].float(), want, rtol=2e-3, atol=2e-3)


def test_a_prologue_runs_on_each_rank_input_before_the_cpu_all_reduce():
    hidden = 8
    gen = torch.Generator().manual_seed(4)
    xs = [torch.randn(2 * hidden, generator=gen) * 4 for _ in range(2)]
    w = torch.rand(hidden, generator=gen) * 2
    e = Epilogue(bias_gelu, extras=(w,), prologue=clip_scale, hidden=hidden)
    out = Cluster.cpu(2).bind(collectives.all_reduce(2), count=2 * hidden, dtype="float32",
                              epilogue=e)([x.clone() for x in xs])
    pre = [(x.reshape(-1, hidden) * w).clamp(-4, 4) for x in xs]
    want = torch_gelu(pre[0] + pre[1], w).reshape(-1)
    assert torch.allclose(out[0], want, rtol=1e-5, atol=1e-5)
    with pytest.raises(SpecError, match=r"prologue must take \(x, e0\); it takes \(x\)"):
        Epilogue(bias_gelu, extras=(w,), prologue=lambda x: x, hidden=hidden).check(xs[0])


def test_an_epilogue_after_another_collective_is_refused():
    from purlin.errors import CapabilityError

    with pytest.raises(CapabilityError, match="a user epilogue follows an all-reduce, not "
                                              "all-gather"):
        Cluster.cpu(2).bind(collectives.all_gather(2), count=8, dtype="float32",
                            epilogue=Epilogue(lambda v: v))


def _communicator_worker(rank, n, datapath):
    """Communicator.all_reduce_epilogue against the all-reduce and then unfused torch:
    bias + GELU, SwiGLU with two extras, add + RMSNorm + FP8; the built-in as a user epilogue
    against all_reduce_add_rms_norm (on the sm datapath the same kernel: the same bits)."""
    import warnings

    device = "cuda" if datapath == "sm" else "cpu"
    if device == "cuda":  # (every rank on GPU 0 where there is one)
        torch.cuda.set_device(rank % torch.cuda.device_count())
    from purlin.torch import Communicator

    comm = Communicator(timeout=10.0, datapath=datapath)
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    bad = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # on sm, 16 MiB too: past the one-shot kernel, the all-reduce then the epilogue kernel
        for rows, hidden in ((1, 4096), (4, 4096), (2, 8192)) + (
                ((1024, 8192),) if datapath == "sm" else ()):
            gen = torch.Generator(device=device).manual_seed(rows + hidden)
            parts = [torch.randn(rows, hidden, generator=gen, device=device).to(dt)
                     for _ in range(n)]
            total = sum(p.float() for p in parts).to(dt)  # (two ranks: one rounding)
            bias = torch.randn(hidden, generator=gen, device=device).to(dt)
            up = torch.randn(rows, hidden, generator=gen, device=device).to(dt)
            t = parts[rank].clone()
            comm.all_reduce_epilogue(t, Epilogue(bias_gelu, extras=(bias,)))
            if not torch.allclose(t.float(), torch_gelu(total, bias), rtol=2e-2, atol=2e-2):
                bad.append(f"bias_gelu {rows}x{hidden}")
            t = parts[rank].clone()
            comm.all_reduce_epilogue(t, Epilogue(swiglu, extras=(bias, up)))
            if not torch.allclose(t.float(), torch_swiglu(total, bias, up), rtol=2e-2,
                                  atol=2e-2):
                bad.append(f"swiglu {rows}x{hidden}")
            residual = torch.randn(rows, hidden, generator=gen, device=device).to(dt)
            weight = (torch.rand(hidden, generator=gen, device=device) + 0.5).to(dt)
            r, t = residual.clone(), parts[rank].clone()
            q = torch.empty(rows * hidden, device=device, dtype=torch.float8_e4m3fn)
            scales = torch.empty(rows, device=device)
            comm.all_reduce_epilogue(t, fp8_epilogue(r, weight, q, scales))
            try:
                check_fp8(q, scales, r.reshape(-1), total.reshape(-1), residual.reshape(-1),
                          weight)
            except AssertionError as exc:
                bad.append(f"fp8 {rows}x{hidden}: {exc}")
            r1, t1 = residual.clone(), parts[rank].clone()
            comm.all_reduce_epilogue(t1, rms_norm(r1, weight, EPS))
            r2, t2 = residual.clone(), parts[rank].clone()
            comm.all_reduce_add_rms_norm(t2, r2, weight, EPS)
            oneshot = rows * hidden * t1.element_size() <= 256 << 10
            if datapath == "sm" and oneshot and not (torch.equal(t1, t2)
                                                     and torch.equal(r1, r2)):
                bad.append(f"rms_norm {rows}x{hidden}: not the built-in's bits")
            if not (torch.allclose(t1.float(), t2.float(), rtol=1e-2, atol=1e-2)
                    and torch.equal(r1, r2)):
                bad.append(f"rms_norm {rows}x{hidden}: not the built-in's result")
    return bad


def test_communicator_all_reduce_with_an_epilogue_on_the_cpu_datapath():
    from purlin.torch.testing import raise_for, run_processes

    for bad in raise_for(run_processes(_communicator_worker, 2, "cpu", timeout=240)):
        assert bad == []


def _process_prepared(protocol, epilogue_kernel="auto", count=1024):
    """rank 0's ``SmPrepared`` of a 2-rank direct-push all-reduce on made-up addresses (no
    GPU: launchers are their kernels' names), with its lowered table, and (as a tensor would
    give it) its output address."""
    import types

    from purlin.atom.lowering import lower
    from purlin.atom.sm_kernel import Flags
    from purlin.kernels import isa
    from purlin.runtime.shm import layout
    from purlin.snac import plan
    from purlin.torch.sm_path import SmPrepared

    s = plan(collectives.all_reduce(2), "direct-push", count=count, dtype="bfloat16")
    lay = layout(s, ll=protocol == "fused-ll", block_flags=True)
    ptrs = [1 << 40, 2 << 40]
    bases = {(q, b): ptrs[q] + lay.offset(q, b) for q in range(2)
             for b in ("input", "output", "scratch")}
    p = object.__new__(SmPrepared)
    p.path = types.SimpleNamespace(device=torch.device("cpu"), ptrs=ptrs, rank=0)
    flags = Flags(2, 1, lay.flag_count, {q: ptrs[q] + lay.flags for q in range(2)},
                  slots={q: ptrs[q] + lay.block_flags for q in range(2)})
    ll = ({q: ptrs[q] + lay.offset(q, "ll") for q in range(2)} if lay.has_ll else None)
    p.core = types.SimpleNamespace(  # (the prepared kernel's parts the epilogue reads)
        threads=32, unit=8 if protocol == "fused-ll" else 16, flags=flags, abort=0,
        control={0: torch.zeros(2 + isa.ERR_WIDTH, dtype=torch.int64)},
        lowered=lower(s, bases, flags.flags, ll_bases=ll))
    p.program_words, p.sums = None, None
    p.output = torch.zeros(count, dtype=torch.bfloat16)
    p.epilogue_kernel, p.norm_kernel = epilogue_kernel, None
    p._grid_launcher = lambda kernel, words=0: kernel
    out = types.SimpleNamespace(data_ptr=lambda: bases[(0, "output")])
    return p, out


@pytest.mark.parametrize("protocol,epilogue_kernel,kernel", [
    ("fused-ll", "auto", "generic"), ("fused-ll", "fused", "fused-norm"),
    ("fused", "auto", "fused-norm")])
def test_process_mode_runs_the_builtin_on_the_one_shot_kernel_where_it_runs(
        protocol, epilogue_kernel, kernel):
    """``all_reduce_add_rms_norm``'s (residual, weight, eps) on an LL program runs on the
    one-shot kernel built for ``rms_norm``, its program holding the weight's address after the
    NORM parameters; elsewhere, and with ``epilogue_kernel="fused"``, on the fused kernel's
    NORM op. A user epilogue runs on its one-shot kernel or is refused."""
    from purlin.kernels import isa

    p, out = _process_prepared(protocol, epilogue_kernel)
    weight = torch.ones(512, dtype=torch.bfloat16)
    norm = (torch.zeros(1024, dtype=torch.bfloat16), weight, EPS)
    words, _ = p._program(None, p._epilogue(out, norm))
    why, words, launcher = p._epilogue_kernel(None, words, out, norm)
    assert why is None and p.norm_kernel == kernel
    assert launcher.startswith("epilogue-") if kernel == "generic" else launcher == kernel
    ops = int(words[isa.F_NOPS])
    params = int(words[isa.F_HEAD + (ops - 1) * isa.OP_WIDTH + isa.NORM_PARAMS])
    assert words[params: params + 2].tolist() == [norm[0].data_ptr(), weight.data_ptr()]
    if kernel == "generic":  # then its output (the tensor), row output (none) and extras
        extras = words[params + isa.SOURCE_WIDTH: params + isa.SOURCE_WIDTH + 3].tolist()
        assert extras == [0, 0, weight.data_ptr()]
    gelu = Epilogue(bias_gelu, extras=(weight,), hidden=512)
    words, _ = p._program(None, p._epilogue(out, gelu))
    why, _, launcher = p._epilogue_kernel(None, words, out, gelu)
    if protocol == "fused-ll":
        assert why is None and launcher.startswith("epilogue-")
    else:
        assert why.startswith("a user epilogue runs on the one-shot kernel, which cannot run")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_gpu_communicator_all_reduce_with_an_epilogue_on_the_fused_kernel(backend):
    """Process mode on the sm datapath: the epilogues on the one-shot kernel and past it.
    nccl: two GPUs; gloo: both processes on one GPU (staging mapped by CUDA IPC)."""
    from purlin.torch.testing import raise_for, run_processes

    if backend == "nccl" and torch.cuda.device_count() < 2:
        pytest.skip("process mode on nccl needs 2 GPUs")
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    for bad in raise_for(run_processes(_communicator_worker, 2, "sm", backend=backend,
                                       timeout=300)):
        assert bad == []


# ----------------------------------------------------------------------------- the PTX


def test_the_builtin_through_the_generic_kernel_compiles_to_less_code_than_the_fused_norm():
    """The built-in add + RMSNorm as a user epilogue: its kernel, specialised for bfloat16,
    has no more PTX instructions than ``fused_norm`` (the fused kernel with the NORM op, every
    op and dtype at run time), the same LL stores and polls, and no local-memory spills."""
    pytest.importorskip("numba.cuda.cudadrv.nvvm")
    from purlin.kernels import epilogue as ep, executor, fused, isa
    from purlin.kernels.compat import compile_ptx

    stat, finish, fn = ep.rms_norm_functions(4096, EPS)
    kernel, _, sig = ep.kernels(ep.Form(fn, isa.BF16, (True,), True, stat, 1, finish))
    ptx = {name: compile_ptx(k.py_func, sig, cc=(9, 0), launch_bounds=executor.MAX_THREADS)
           for name, k in (("fused-norm", fused.fused_norm), ("generic", kernel))}

    def instructions(text):
        return [line for line in (raw.strip() for raw in text.splitlines())
                if line.endswith(";") and not line.startswith((".", "//"))]

    counts = {name: len(instructions(text)) for name, text in ptx.items()}
    assert counts["generic"] <= counts["fused-norm"], counts
    for text in ptx.values():
        assert ".local" not in text
        assert "st.volatile.global.v4.u32" in text and "ld.volatile.global.v4.u32" in text
        assert "sqrt" in text


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", ["bias_gelu", "swiglu", "fp8", "plain", "prologue"])
def test_each_form_compiles_for_sm90_without_spills(name, dtype):
    """Every form's kernel types and compiles (the simulator runs Python, not Numba's typing):
    per element with none, one or two extras, per row with a pair of statistics, FP8 out and
    a row output, a prologue."""
    pytest.importorskip("numba.cuda.cudadrv.nvvm")
    from purlin.kernels import epilogue as ep, executor
    from purlin.kernels.compat import compile_ptx

    h = 64
    x = torch.empty(4 * h, dtype=dtype)
    col, el = torch.ones(h, dtype=dtype), torch.ones(4 * h, dtype=dtype)
    e = {"bias_gelu": lambda: Epilogue(bias_gelu, extras=(col,), hidden=h),
         "swiglu": lambda: Epilogue(swiglu, extras=(col, el), hidden=h),
         "fp8": lambda: fp8_epilogue(torch.zeros_like(el), col, torch.empty(
             4 * h, dtype=torch.float8_e4m3fn), torch.empty(4)),
         "plain": lambda: Epilogue(lambda v: v * 2.0, hidden=h),
         "prologue": lambda: Epilogue(bias_gelu, extras=(col,), prologue=clip_scale,
                                      hidden=h)}[name]()
    kernel, _, sig = ep.kernels(e.form(x))
    ptx = compile_ptx(kernel.py_func, sig, cc=(9, 0), launch_bounds=executor.MAX_THREADS)
    assert ".local" not in ptx and "st.volatile.global.v4.u32" in ptx
    # the row maximum only where asked for (and the prologue's clip)
    assert ("max.f32" in ptx) == (name in ("fp8", "prologue"))


# ------------------------------------------------------------------ GPU: virtual ranks


def _virtual(hidden, rows, epilogue_for, seed=5):
    """A 2-rank fused-ll all-reduce on one GPU ending with ``epilogue_for(rank, gen)``; one
    call. Returns (inputs, the reduced sum, outputs, epilogues)."""
    c = Cluster.virtual(2)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    xs = [torch.randn(rows * hidden, generator=gen, device="cuda").bfloat16() for _ in range(2)]
    epis = [epilogue_for(r, gen) for r in range(2)]
    b = c.bind(collectives.all_reduce(2), "direct-push", count=rows * hidden, dtype="bfloat16",
               protocol="fused-ll", epilogue=epis)
    plain = c.bind(collectives.all_reduce(2), "direct-push", count=rows * hidden,
                   dtype="bfloat16", protocol="fused-ll")
    total = plain(xs)[0].clone()
    out = [o.clone() for o in b(xs)]
    return xs, total, out, epis


@pytest.mark.gpu
@pytest.mark.parametrize("hidden,rows", [(4096, 1), (4096, 8), (8192, 64)])
def test_gpu_user_epilogues_match_the_collective_and_separate_torch_ops(hidden, rows):
    def gelu_for(r, gen):
        return Epilogue(bias_gelu, extras=(torch.randn(hidden, generator=gen, device="cuda")
                                           .bfloat16(),), hidden=hidden)

    _, total, out, epis = _virtual(hidden, rows, gelu_for)
    for r, (o, e) in enumerate(zip(out, epis)):  # each rank its own bias
        want = torch_gelu(total.reshape(rows, hidden), e.extras[0]).reshape(-1)
        assert torch.allclose(o.float(), want, rtol=1e-2, atol=1e-2), f"rank {r}"

    def swiglu_for(r, gen):
        return Epilogue(swiglu, extras=(
            torch.randn(hidden, generator=gen, device="cuda").bfloat16(),
            torch.randn(rows * hidden, generator=gen, device="cuda").bfloat16()), hidden=hidden)

    _, total, out, epis = _virtual(hidden, rows, swiglu_for)
    for o, e in zip(out, epis):
        want = torch_swiglu(total.reshape(rows, hidden), e.extras[0],
                            e.extras[1].reshape(rows, hidden)).reshape(-1)
        assert torch.allclose(o.float(), want, rtol=1e-2, atol=1e-2)

    starts = {}
    functions = fp8_norm(hidden)  # virtual ranks share one launch: the same device functions

    def fp8_for(r, gen):
        residual = torch.randn(rows * hidden, generator=gen, device="cuda").bfloat16()
        starts[r] = residual.clone()
        weight = (torch.rand(hidden, generator=gen, device="cuda") + 0.5).bfloat16()
        return fp8_epilogue(residual, weight, torch.empty(rows * hidden, device="cuda",
                                                          dtype=torch.float8_e4m3fn),
                            torch.empty(rows, device="cuda"), functions)

    _, total, out, epis = _virtual(hidden, rows, fp8_for)
    for r, e in enumerate(epis):
        check_fp8(e.out, e.row_out, e.residual, total, starts[r], e.extras[0])


@pytest.mark.gpu
@pytest.mark.parametrize("hidden,rows", [(4096, 1), (4096, 16), (8192, 1), (8192, 64)])
def test_gpu_builtin_rms_norm_through_the_generic_kernel_matches_unfused_torch(hidden, rows):
    """(Bit for bit the fused kernel's NORM op: the simulator case below.)"""
    starts = {}

    def norm_for(r, gen):
        starts[r] = torch.randn(rows * hidden, generator=gen, device="cuda").bfloat16()
        weight = torch.rand(hidden, generator=gen, device="cuda").bfloat16()
        return rms_norm(starts[r].clone(), weight, EPS)

    _, total, out, epis = _virtual(hidden, rows, norm_for)
    for r in range(2):
        want_r, want = torch_norm(total, starts[r], epis[r].extras[0])
        assert torch.equal(epis[r].residual, want_r)
        assert torch.allclose(out[r].float(), want, rtol=1e-2, atol=1e-2)


# ------------------------------------------------------------------------ the simulator


def _bf16_tensor(bits: np.ndarray):
    return torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)


def _sim_run(make, dtype="bfloat16", count=96, hidden=32, blocks=1, threads=4, calls=2,
             kernel="generic"):
    """Rank 0 of a 2-rank LL all-reduce ending with ``make(out, rng)``'s epilogue, on the
    simulated one-shot kernel (``kernel``: "generic", the epilogue's; "fused-norm":
    ``fused.fused_norm`` on the same program). Returns (total, outputs per call, epilogue)."""
    import test_kernels_sim as sim

    from purlin.atom.fused import oneshot_problem, program, row_sums_bytes
    from purlin.kernels import epilogue as ep, fused, isa

    s, xs, outs, ll, lowered, keep = sim._fused_setup(collectives.all_reduce(2), dtype, count)
    tensor = _bf16_tensor(outs[0]) if dtype == "bfloat16" else torch.from_numpy(outs[0])
    inputs = [_bf16_tensor(x) if dtype == "bfloat16" else torch.from_numpy(x) for x in xs]
    total = (inputs[0].float() + inputs[1].float()).to(tensor.dtype)
    gen = torch.Generator().manual_seed(11)
    e = make(tensor, gen)
    form = e.form(tensor)
    sums = np.zeros(row_sums_bytes(outs[0].nbytes, 8, threads) // 8, np.int64)
    err = np.zeros(isa.ERR_WIDTH, dtype=np.int64)
    abort = np.zeros(1, dtype=np.uint64)
    record = e.record(outs[0].ctypes.data, sums.ctypes.data, e.check(tensor)["hidden"])
    words = program(lowered[0], err.ctypes.data, abort.ctypes.data, lambda a: a, 8,
                    epilogue=record, threads=threads).words.copy()
    assert oneshot_problem(words) is None, oneshot_problem(words)
    launch = fused.fused_norm if kernel == "fused-norm" else ep.kernels(form)[0]
    counters = np.zeros(isa.F_MAX_BLOCKS, dtype=np.int64)
    got = []
    for call in range(calls):
        sim._peer_units(lowered, ll, 0, call)
        launch[blocks, threads](words.ctypes.data, 1, blocks, 10_000_000, words.size,
                                counters.ctypes.data)
        assert err[isa.E_CODE] == 0, err
        assert (counters[:blocks] == call + 1).all(), counters
        got.append((tensor.clone(), None if e.out is None else e.out.clone(),
                    None if e.residual is None else e.residual.clone(),
                    None if e.row_out is None else e.row_out.clone()))
    return total, got, e


@case
def sim_bias_gelu_per_element_matches_torch():
    """bias + GELU on bfloat16 and float32, rows traded or owned, two calls (LL parities)."""
    for dtype, blocks, hidden in (("bfloat16", 1, 32), ("bfloat16", 3, 16), ("float32", 3, 8)):
        def make(t, gen):
            return Epilogue(bias_gelu, extras=(torch.randn(hidden, generator=gen)
                                               .to(t.dtype),), hidden=hidden)

        total, got, e = _sim_run(make, dtype=dtype, hidden=hidden, blocks=blocks)
        want = torch_gelu(total.reshape(-1, hidden), e.extras[0]).reshape(-1)
        for y, *_ in got:
            tol = 1e-2 if dtype == "bfloat16" else 1e-5
            assert torch.allclose(y.float(), want, rtol=tol, atol=tol), (dtype, y, want)


@case
def sim_swiglu_with_two_extras_matches_torch():
    """silu(v + bias) * up: a per-column and a per-element extra."""
    def make(t, gen):
        return Epilogue(swiglu, extras=(torch.randn(16, generator=gen).to(t.dtype),
                                        torch.randn(t.numel(), generator=gen).to(t.dtype)),
                        hidden=16)

    total, got, e = _sim_run(make, hidden=16, blocks=3)
    want = torch_swiglu(total.reshape(-1, 16), e.extras[0], e.extras[1].reshape(-1, 16))
    for y, *_ in got:
        assert torch.allclose(y.float(), want.reshape(-1), rtol=1e-2, atol=1e-2)


@case
def sim_add_rms_norm_fp8_with_a_per_token_scale_matches_torch():
    """Residual add, RMSNorm, e4m3 codes and one float32 scale per row; rows of two chunks
    on one block (owned) and rows of one chunk on three blocks."""
    for hidden, blocks in ((32, 1), (16, 3)):
        state = {}

        def make(t, gen):
            residual = torch.randn(t.numel(), generator=gen).to(t.dtype)
            state["r0"] = residual.clone()
            weight = torch.rand(hidden, generator=gen).to(t.dtype) + 0.5
            return fp8_epilogue(residual, weight, torch.empty(t.numel(),
                                                              dtype=torch.float8_e4m3fn),
                                torch.empty(t.numel() // hidden))

        total, got, e = _sim_run(make, hidden=hidden, blocks=blocks, calls=1)
        _, q, residual, scales = got[0]
        check_fp8(q, scales, residual, total, state["r0"], e.extras[0])


@case
def sim_builtin_rms_norm_through_the_generic_kernel_is_bitwise_the_fused_norm():
    """``rms_norm`` as a user epilogue: the generic kernel and ``fused.fused_norm`` (the NORM
    op) on the same program leave the same residual and output bits and call counters, both
    equal to unfused torch within a rounding."""
    for dtype, hidden, blocks in (("bfloat16", 32, 1), ("bfloat16", 16, 3), ("float32", 8, 3)):
        runs = {}
        for kernel in ("generic", "fused-norm"):
            state = {}

            def make(t, gen):
                state["r0"] = torch.randn(t.numel(), generator=gen).to(t.dtype)
                return rms_norm(state["r0"].clone(), torch.rand(hidden, generator=gen)
                                .to(t.dtype), EPS)

            runs[kernel] = _sim_run(make, dtype=dtype, hidden=hidden, blocks=blocks,
                                    kernel=kernel) + (state["r0"],)
        (total, got, e, r0), (_, base, _, _) = runs["generic"], runs["fused-norm"]
        for (y, _, res, _), (y2, _, res2, _) in zip(got, base):
            assert torch.equal(y, y2) and torch.equal(res, res2), (dtype, y, y2)
        want_r, want = torch_norm(total, r0, e.extras[0])
        assert torch.equal(got[0][2], want_r)
        assert torch.allclose(got[0][0].float(), want, rtol=1e-2, atol=1e-2)


@cuda.jit(device=True)
def clip_scale(x, w):  # a prologue: each input scaled by its column's weight, clipped
    return min(max(x * w, np.float32(-4)), np.float32(4))


@case
def sim_a_prologue_rewrites_the_input_before_it_is_sent():
    """prologue(x, w) on each rank's input, then the all-reduce, then bias + GELU on the sum
    (the peer's units carry its input after the same prologue, as its kernel would send)."""
    import test_kernels_sim as sim

    hidden = 16
    state = {}

    def make(t, gen):
        w = (torch.rand(hidden, generator=gen) * 2).to(t.dtype)
        e = Epilogue(bias_gelu, extras=(w,), prologue=clip_scale, hidden=hidden)
        state["e"] = e
        return e

    original = sim._peer_units

    def peer_units(lowered, ll, to, call):  # the peer ran the prologue on its input first
        for low in lowered:
            if low.rank != to:
                for addr in {int(a) for a in low.srcs}:
                    x = state["inputs"].get(addr)
                    if x is not None and addr not in state["done"]:
                        state["e"].reference_prologue(x)
                        state["done"].add(addr)
        original(lowered, ll, to, call)

    setup = sim._fused_setup

    def fused_setup(*args, **kw):
        out = setup(*args, **kw)
        xs = out[1]
        state["raw"] = [_bf16_tensor(x).clone() for x in xs]
        state["inputs"] = {xs[1].ctypes.data: _bf16_tensor(xs[1])}
        state["xs0"] = xs[0]
        state["done"] = set()
        return out

    sim._peer_units, sim._fused_setup = peer_units, fused_setup
    try:
        total, got, e = _sim_run(make, hidden=hidden, blocks=3, calls=1)
    finally:
        sim._peer_units, sim._fused_setup = original, setup
    assert state["done"], "the peer's input was not found"
    w = e.extras[0].float()
    pre = [(x.float().reshape(-1, hidden) * w).clamp(-4, 4).to(torch.bfloat16)
           for x in state["raw"]]
    assert not torch.equal(pre[0].reshape(-1), state["raw"][0])  # the prologue did something
    mine = _bf16_tensor(state["xs0"]).reshape(pre[0].shape)  # rank 0's input, rewritten
    assert torch.equal(mine, pre[0]), (mine, pre[0])
    total = (pre[0].float() + pre[1].float()).to(torch.bfloat16)
    want = torch_gelu(total, e.extras[0]).reshape(-1)
    assert torch.allclose(got[0][0].float(), want, rtol=1e-2, atol=1e-2), (got[0][0], want)


@case
def sim_e4m3_conversion_matches_torch():
    """``kernels.epilogue.f32_to_e4m3`` against torch's float8_e4m3fn on every code's
    neighbourhood (ties included), saturating past 448."""
    from purlin.kernels.epilogue import f32_to_e4m3

    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    finite = codes[torch.isfinite(codes)].unique()
    mids = (finite[1:] + finite[:-1]) / 2
    xs = torch.cat([finite, mids, mids * (1 + 1e-6), mids * (1 - 1e-6), -finite, -mids,
                    torch.tensor([1e-9, 460.0, 1e6, -1e6])])
    want = xs.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    got = torch.tensor([f32_to_e4m3(np.float32(x)) for x in xs.tolist()], dtype=torch.int64)
    bad = (got != want.long()).nonzero().ravel()
    assert bad.numel() == 0, [(xs[i].item(), got[i].item(), want[i].item()) for i in bad[:5]]


verdicts, test_in_simulator = simulator_tests(__file__, CASES)


if __name__ == "__main__":
    run_cases(CASES, sys.argv[1])
