"""User epilogues at every size: where the one-shot kernel does not run, the all-reduce runs on
its own path and then the standalone epilogue kernel (``purlin.kernels.epilogue.apply_kernels``)
applies the same device functions to each rank's output, one launch per device.

The simulator cases (``NUMBA_ENABLE_CUDASIM=1 python tests/test_epilogue_any.py OUT``) run the
standalone kernel on host tensors against ``Epilogue.reference``; the ``gpu`` tests bind
16 MiB all-reduces on virtual ranks with epilogues (default strategy and ``"auto"``) against
the all-reduce followed by separate torch ops, eager and in graph replay.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
from simulator import run_cases, simulator_tests

torch = pytest.importorskip("torch")
cuda = pytest.importorskip("numba.cuda")

from purlin import Cluster, Epilogue, collectives  # noqa: E402
from purlin.atom.epilogue import rms_norm  # noqa: E402
from purlin.bench.epilogues import fp8_norm  # noqa: E402
from test_epilogue_api import (bias_gelu, check_fp8, clip_scale, swiglu, torch_gelu,  # noqa: E402
                               torch_norm)

CASES = {}
EPS = 1e-5


def case(fn):
    CASES[fn.__name__] = fn
    return fn


def fp8_epilogue(residual, weight, out, scales, functions=None):
    stat, finish, fn = functions or fp8_norm(weight.numel(), EPS)
    return Epilogue(fn, extras=(weight,), residual=residual, stat=stat, finish=finish, out=out,
                    row_out=scales, hidden=weight.numel(), name="add_rms_norm_fp8")


# ------------------------------------------------------------------------ the simulator


def _apply(epis, tensors, prologue=False, blocks=None, threads=None):
    """The standalone kernel over ``epis[k]`` on ``tensors[k]`` (host tensors: one launch,
    one rank slot each) through the Launcher the sm datapath uses; ``blocks`` / ``threads``
    replace the table's grid (a grid-stride or a row loop of several turns)."""
    from purlin.atom.sm_epilogue import apply_table
    from purlin.kernels.launch import Launcher

    words, stride, name, b, t = apply_table(epis, tensors, sms=1, prologue=prologue)
    unused = np.zeros(1, np.int64)
    Launcher(nranks_in_launch=len(epis), blocks_per_lane=blocks or b, threads=threads or t,
             kernel=name, stride_words=stride)(words.ctypes.data, counters=unused.ctypes.data)
    return b, t


def _sums(n, count, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(count, generator=gen) * 2).to(dtype) for _ in range(n)], gen


@case
def sim_per_element_bias_gelu_matches_the_reference():
    """bias + GELU (a per-column extra) on bfloat16 and float32, two rank slots in one launch,
    the table's grid and a grid-stride loop of one small block."""
    for dtype in (torch.bfloat16, torch.float32):
        for blocks, threads in ((None, None), (1, 32)):
            hidden = 16
            sums, gen = _sums(2, 8 * hidden, dtype, 1)
            biases = [torch.randn(hidden, generator=gen).to(dtype) for _ in range(2)]
            epis = [Epilogue(bias_gelu, extras=(b,), hidden=hidden) for b in biases]
            got = [s.clone() for s in sums]
            _apply(epis, got, blocks=blocks, threads=threads)
            for g, s, e in zip(got, sums, epis):
                want = e.reference(s.clone())  # (float64 where the simulator has float32)
                tol = 1e-6 if dtype == torch.float32 else 8e-3
                assert torch.allclose(g, want, rtol=tol, atol=1e-7), (dtype, blocks, g, want)
                assert torch.allclose(g.float(), torch_gelu(s.reshape(-1, hidden), e.extras[0])
                                      .reshape(-1), rtol=1e-2, atol=1e-2)


@case
def sim_two_extras_and_an_output_tensor():
    """silu(v + bias) * up (a per-column and a per-element extra) into an ``out`` tensor of
    the dtype: the sum stays where it was."""
    hidden = 8
    sums, gen = _sums(1, 12 * hidden, torch.bfloat16, 2)
    bias = torch.randn(hidden, generator=gen).bfloat16()
    up = torch.randn(12 * hidden, generator=gen).bfloat16()
    out = torch.zeros_like(sums[0])
    e = Epilogue(swiglu, extras=(bias, up), out=out, hidden=hidden)
    got = sums[0].clone()
    _apply([e], [got], blocks=2, threads=32)
    assert torch.equal(got, sums[0])
    want = torch.zeros_like(out)
    Epilogue(swiglu, extras=(bias, up), out=want, hidden=hidden).reference(sums[0].clone())
    assert torch.equal(out, want), (out, want)


@case
def sim_per_row_rms_norm_matches_the_reference():
    """``rms_norm`` (the residual add, a row sum, a per-row finish) on rows one block walks
    in turns and on rows of more items than threads; the residual bit for bit, the output
    within the row sum's order of additions."""
    for dtype, hidden, rows, blocks, threads in ((torch.bfloat16, 32, 5, 2, 32),
                                                 (torch.bfloat16, 256, 3, None, 32),
                                                 (torch.float32, 64, 4, None, None)):
        sums, gen = _sums(1, rows * hidden, dtype, 3)
        r0 = torch.randn(rows * hidden, generator=gen).to(dtype)
        weight = (torch.rand(hidden, generator=gen) + 0.5).to(dtype)
        mine, ref = r0.clone(), r0.clone()
        got = sums[0].clone()
        _apply([rms_norm(mine, weight, EPS)], [got], blocks=blocks, threads=threads)
        want = rms_norm(ref, weight, EPS).reference(sums[0].clone(), hidden)
        assert torch.equal(mine, ref), (dtype, hidden)
        assert torch.equal(mine, torch_norm(sums[0], r0, weight)[0])
        assert torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2), (got, want)
        assert torch.allclose(got.float(), torch_norm(sums[0], r0, weight)[1], rtol=1e-2,
                              atol=1e-2)


@case
def sim_fp8_out_and_a_row_output_match_the_reference():
    """add + RMSNorm + float8_e4m3fn with a per-token scale (``row_out``): the residual
    bits, the scales within float32 rounding, codes at most one FP8 step from unfused torch."""
    hidden, rows = 64, 6
    functions = fp8_norm(hidden, EPS)
    sums, gen = _sums(2, rows * hidden, torch.bfloat16, 4)
    weight = (torch.rand(hidden, generator=gen) + 0.5).bfloat16()
    starts = [torch.randn(rows * hidden, generator=gen).bfloat16() for _ in range(2)]
    epis, refs = [], []
    for r in range(2):
        epis.append(fp8_epilogue(starts[r].clone(), weight, torch.empty(
            rows * hidden, dtype=torch.float8_e4m3fn), torch.empty(rows), functions))
        refs.append(fp8_epilogue(starts[r].clone(), weight, torch.empty(
            rows * hidden, dtype=torch.float8_e4m3fn), torch.empty(rows), functions))
    _apply(epis, [s.clone() for s in sums], blocks=2)
    for r in range(2):
        e, ref = epis[r], refs[r]
        ref.reference(sums[r].clone())
        assert torch.equal(e.residual, ref.residual)
        assert torch.allclose(e.row_out, ref.row_out, rtol=1e-5, atol=0), (e.row_out,
                                                                           ref.row_out)
        steps = (e.out.view(torch.uint8).int() - ref.out.view(torch.uint8).int()).abs()
        assert int(steps.max()) <= 1, steps
        check_fp8(e.out, e.row_out, e.residual, sums[r], starts[r], weight)


@case
def sim_the_prologue_kernel_rewrites_the_input_as_the_reference():
    hidden = 16
    sums, gen = _sums(1, 4 * hidden, torch.float32, 5)
    w = torch.rand(hidden, generator=gen) * 2
    e = Epilogue(bias_gelu, extras=(w,), prologue=clip_scale, hidden=hidden)
    got = sums[0] * 4
    want = e.reference_prologue(got.clone())
    _apply([e], [got], prologue=True, blocks=1, threads=32)
    assert torch.equal(got, want)
    assert not torch.equal(got, sums[0] * 4)  # (it did something)


@case
def sim_a_bound_all_reduce_gets_the_prologue_and_epilogue_launches_around_its_own():
    """``add_device_epilogue`` on a stand-in for an ``SmBound`` of two virtual ranks (host
    tensors; "cuda" tables made on the host): the prologue launch first, the bound's own,
    the epilogue launch last, each one launch for both rank slots, and ``kernel`` saying so;
    run in that order they give the prologue, the sum, then the epilogue."""
    import types

    from purlin.atom.epilogue import per_rank
    from purlin.atom.sm import Gpu
    from purlin.atom.sm_epilogue import add_device_epilogue
    from purlin.snac import plan

    class HostTorch:  # torch, with every device the host
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def device(*_):
            return torch.device("cpu")

    hidden, rows = 16, 4
    s = plan(collectives.all_reduce(2), "direct-push", count=rows * hidden, dtype="float32")
    xs = [torch.randn(rows * hidden) * 3 for _ in range(2)]
    bound = types.SimpleNamespace(
        torch=HostTorch(), schedule=s, devices=(0, 0), gpu=Gpu(0, 2), pdl=False, _keep=[],
        kernel="interpreter", launches=[("own",)], inputs=[x.clone() for x in xs],
        outputs=[torch.zeros(rows * hidden) for _ in range(2)])
    w = torch.rand(hidden) * 2
    add_device_epilogue(bound, per_rank(Epilogue(bias_gelu, extras=(w,), prologue=clip_scale,
                                                 hidden=hidden), s))
    assert bound.kernel == "prologue kernel then interpreter then epilogue kernel"
    before, own, after = bound.launches
    assert own == ("own",) and before.ranks == after.ranks == [0, 1]
    assert before.launcher.nranks_in_launch == after.launcher.nranks_in_launch == 2
    assert before.records() == after.records() == []  # (nothing in them waits)
    before.launcher(before.desc, counters=before.counters)
    pre = [(x.reshape(-1, hidden) * w).clamp(-4, 4).reshape(-1) for x in xs]
    for got, want in zip(bound.inputs, pre):
        assert torch.allclose(got, want)
    total = bound.inputs[0] + bound.inputs[1]
    for o in bound.outputs:
        o.copy_(total)
    after.launcher(after.desc, counters=after.counters)
    want = torch_gelu(total.reshape(-1, hidden), w).reshape(-1)
    for o in bound.outputs:
        assert torch.allclose(o, want, rtol=1e-5, atol=1e-5)


@case
def sim_rows_of_a_partial_unit_are_refused_with_what_would_run():
    from purlin.atom.sm_epilogue import apply_words
    from purlin.errors import CapabilityError

    t = torch.zeros(2 * 6, dtype=torch.bfloat16)
    e = Epilogue(bias_gelu, extras=(torch.zeros(6, dtype=torch.bfloat16),), hidden=6)
    try:
        apply_words(e, t)
    except CapabilityError as exc:
        assert "rows of 6 torch.bfloat16 elements (12 bytes)" in str(exc), exc
        assert "a multiple of 4 elements" in str(exc), exc
    else:
        raise AssertionError("rows of 12 bytes were not refused")


# ----------------------------------------------------------------------------- the PTX


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", ["bias_gelu", "swiglu", "fp8", "prologue"])
def test_the_standalone_kernels_compile_for_sm90_without_spills(name, dtype):
    """Every form's epilogue kernel (and a prologue's kernel), plain and PDL, types and
    compiles for sm_90 (the simulator runs Python, not Numba's typing) with no local
    memory; the row's reductions only in the per-row form, its maximum only where asked."""
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
         "prologue": lambda: Epilogue(bias_gelu, extras=(col,), prologue=clip_scale,
                                      hidden=h)}[name]()
    for prologue in ((False, True) if name == "prologue" else (False,)):
        plain, pdl, sig = ep.apply_kernels(e.form(x), prologue)
        for k in (plain, pdl):
            ptx = compile_ptx(k.py_func, sig, cc=(9, 0), launch_bounds=executor.MAX_THREADS)
            assert ".local" not in ptx
            assert ("griddepcontrol.wait" in ptx) == (k is pdl)
            assert ("max.f32" in ptx) == (name == "fp8" or prologue)
            assert ("shfl.sync" in ptx) == (name == "fp8")  # a row's sum: the row form's


# ------------------------------------------------------------- which path a bind takes


def test_sm_bind_routes_an_epilogue_to_the_one_shot_kernel_or_the_epilogue_kernel(monkeypatch):
    """``purlin.atom.sm.bind(..., epilogue=)`` without a GPU: the one-shot kernel is tried at
    LL sizes whatever the protocol, else (or where it refuses) the plain bind on the asked
    protocol gets the epilogue kernel; an explicit ``fused-ll`` that cannot run is refused
    saying what would."""
    import types

    from purlin.atom import sm, sm_epilogue
    from purlin.errors import CapabilityError
    from purlin.snac import plan

    made = []

    def fake_bound(cluster, schedule, *, protocol, epilogue=None, **kw):
        made.append((protocol, epilogue is not None))
        if epilogue is not None and schedule.strategy != "direct-push":
            raise CapabilityError("rank 0: its program is not PUTs, one MOVE and the NORM "
                                  "epilogue")
        return types.SimpleNamespace(kernel=f"{protocol} kernel with epilogue" if epilogue
                                     else "interpreter")

    def fake_add(bound, epis):
        bound.kernel += " then epilogue kernel"

    monkeypatch.setattr(sm, "SmBound", fake_bound)
    monkeypatch.setattr(sm_epilogue, "add_device_epilogue", fake_add)
    e = Epilogue(bias_gelu, extras=(torch.zeros(4096, dtype=torch.bfloat16),), hidden=4096)

    def bind(strategy, count, **kw):
        made.clear()
        schedule = plan(collectives.all_reduce(2), strategy, count=count, dtype="bfloat16")
        return sm.bind(None, schedule, epilogue=e, **kw).kernel

    small, big = 8 * 4096, 2048 * 4096
    assert bind("direct-push", small) == "fused-ll kernel with epilogue"
    assert bind("direct-push", small, protocol="simple") == "fused-ll kernel with epilogue"
    assert bind("direct-push", big) == "interpreter then epilogue kernel"
    assert made == [("fused", False)]  # no protocol: the fast path (no one-shot past LL sizes)
    assert bind("direct-push", big, protocol="simple") == "interpreter then epilogue kernel"
    assert made == [("simple", False)]
    assert bind("ring", small, protocol="ll") == "interpreter then epilogue kernel"
    assert made == [("fused-ll", True), ("ll", False)]
    assert bind("direct-push", big, protocol="fused", fallback=True) == \
        "interpreter then epilogue kernel"
    assert made == [("fused", False)]
    with pytest.raises(CapabilityError, match=r"not PUTs, one MOVE and the NORM epilogue; "
                                              r"protocol='fused-ll' asks for the one-shot "
                                              r"kernel .* bind without protocol="):
        bind("ring", small, protocol="fused-ll")


# --------------------------------------------------------------------------- cpu datapath


def test_a_cpu_cluster_runs_an_epilogue_at_a_size_beyond_the_one_shot_kernel():
    """1 MiB of float32 per rank (past any LL size): the cpu datapath's host reference."""
    hidden, rows = 1024, 256
    gen = torch.Generator().manual_seed(7)
    xs = [torch.randn(rows * hidden, generator=gen) for _ in range(2)]
    bias = torch.randn(hidden, generator=gen)
    out = Cluster.cpu(2).bind(collectives.all_reduce(2), count=rows * hidden, dtype="float32",
                              epilogue=Epilogue(bias_gelu, extras=(bias,), hidden=hidden))(xs)
    want = torch_gelu((xs[0] + xs[1]).reshape(rows, hidden), bias).reshape(-1)
    for o in out:
        assert torch.allclose(torch.as_tensor(o).float(), want, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ GPU: virtual ranks

BIG = 16 << 20  # bytes per rank: far past the one-shot kernel's LL sizes


def _parts(n, count, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(count, generator=gen, device="cuda").bfloat16() for _ in range(n)], gen


def _replayed(bound, xs, reset=lambda: None):
    """The outputs of one graph replay of ``bound`` on inputs ``xs`` (outputs zeroed first,
    ``reset()`` restoring what the eager call changed)."""
    graph = bound.capture(1)
    for x, buf in zip(xs, bound.inputs):
        buf[:x.numel()].copy_(x)
    for o in bound.outputs:
        o.zero_()
    reset()
    torch.cuda.synchronize()
    graph.replay()
    bound.check()
    return [o[:xs[0].numel()].clone() for o in bound.outputs]


@pytest.mark.gpu
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("strategy", ["direct-push", "auto"])
def test_gpu_bias_gelu_at_16_mib_is_the_all_reduce_then_torch(n, strategy):
    hidden = 8192
    count = BIG // 2
    xs, gen = _parts(n, count, seed=n)
    bias = torch.randn(hidden, generator=gen, device="cuda").bfloat16()
    c = Cluster.virtual(n)
    ar = collectives.all_reduce(n)
    b = c.bind(ar, strategy, count=count, dtype="bfloat16",
               epilogue=Epilogue(bias_gelu, extras=(bias,), hidden=hidden))
    assert b.kernel.endswith(" then epilogue kernel"), b.kernel
    total = c.bind(ar, strategy, count=count, dtype="bfloat16")(xs)[0].clone()
    want = torch_gelu(total.reshape(-1, hidden), bias).reshape(-1)
    for got in ([o.clone() for o in b(xs)], _replayed(b, xs)):
        for r, o in enumerate(got):
            assert torch.allclose(o.float(), want, rtol=1e-2, atol=1e-2), (strategy, n, r)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("strategy", ["direct-push", "auto"])
def test_gpu_add_rms_norm_fp8_at_16_mib_is_the_all_reduce_then_torch(n, strategy):
    hidden = 8192
    count = BIG // 2
    rows = count // hidden
    xs, gen = _parts(n, count, seed=10 + n)
    weight = (torch.rand(hidden, generator=gen, device="cuda") + 0.5).bfloat16()
    starts = [torch.randn(count, generator=gen, device="cuda").bfloat16() for _ in range(n)]
    functions = fp8_norm(hidden, EPS)  # one launch for the ranks of a GPU: the same functions
    epis = [fp8_epilogue(s.clone(), weight, torch.empty(count, device="cuda",
                                                        dtype=torch.float8_e4m3fn),
                         torch.empty(rows, device="cuda"), functions) for s in starts]
    c = Cluster.virtual(n)
    ar = collectives.all_reduce(n)
    b = c.bind(ar, strategy, count=count, dtype="bfloat16", epilogue=epis)
    assert b.kernel.endswith(" then epilogue kernel"), b.kernel
    total = c.bind(ar, strategy, count=count, dtype="bfloat16")(xs)[0].clone()
    b(xs)
    torch.cuda.synchronize()

    def reset():
        for e, s in zip(epis, starts):
            e.residual.copy_(s)
            e.out.view(torch.uint8).zero_()

    for call in ("eager", "graph"):
        if call == "graph":
            _replayed(b, xs, reset)
        for r, e in enumerate(epis):
            check_fp8(e.out, e.row_out, e.residual, total, starts[r], weight)


@pytest.mark.gpu
def test_gpu_a_prologue_runs_before_the_all_reduce_beyond_the_one_shot_kernel():
    hidden, n = 8192, 2
    count = BIG // 2
    xs, gen = _parts(n, count, seed=20)
    w = (torch.rand(hidden, generator=gen, device="cuda") * 2).bfloat16()
    e = Epilogue(bias_gelu, extras=(w,), prologue=clip_scale, hidden=hidden)
    b = Cluster.virtual(n).bind(collectives.all_reduce(n), count=count, dtype="bfloat16",
                                epilogue=e)
    assert b.kernel.startswith("prologue kernel then "), b.kernel
    pre = [(x.float().reshape(-1, hidden) * w.float()).clamp(-4, 4).bfloat16() for x in xs]
    want = torch_gelu((pre[0].float() + pre[1].float()).bfloat16(), w).reshape(-1)
    for o in b([x.clone() for x in xs]):
        assert torch.allclose(o.float(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_gpu_an_ll_size_keeps_the_one_shot_kernel_and_fused_ll_elsewhere_is_refused():
    from purlin.atom.sm import fast_protocol
    from purlin.errors import CapabilityError

    hidden = 4096
    c = Cluster.virtual(2)
    ar = collectives.all_reduce(2)
    bias = torch.zeros(hidden, device="cuda").bfloat16()
    e = Epilogue(bias_gelu, extras=(bias,), hidden=hidden)
    for strategy in ("direct-push", "auto"):
        b = c.bind(ar, strategy, count=8 * hidden, dtype="bfloat16", epilogue=e)
        if b.schedule.strategy == "direct-push":  # (auto's table may choose another)
            assert b.kernel == "fused-ll kernel with epilogue", (strategy, b.kernel)
        else:
            assert b.kernel.endswith(" then epilogue kernel"), (strategy, b.kernel)
    assert c.bind(ar, count=8 * hidden, dtype="bfloat16", protocol="fused",
                  epilogue=e).kernel == "fused-ll kernel with epilogue"  # (any protocol)
    ring = c.bind(ar, "ring", count=8 * hidden, dtype="bfloat16", epilogue=e)
    # (no protocol named: the ring on its fast path, then the epilogue kernel)
    assert ring.kernel == f"{fast_protocol(ring.schedule)} kernel then epilogue kernel", \
        ring.kernel
    ring = c.bind(ar, "ring", count=8 * hidden, dtype="bfloat16", protocol="simple",
                  epilogue=e)
    assert ring.kernel == "interpreter then epilogue kernel", ring.kernel
    with pytest.raises(CapabilityError, match=r"bind without protocol= \(or with "
                                              r"strategy='auto'\) to run"):
        c.bind(ar, "ring", count=8 * hidden, dtype="bfloat16", protocol="fused-ll",
               epilogue=e)


verdicts, test_in_simulator = simulator_tests(__file__, CASES)


if __name__ == "__main__":
    run_cases(CASES, sys.argv[1])
