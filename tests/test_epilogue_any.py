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
from simulator import run_cases, simulator_verdicts

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


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory):
    return simulator_verdicts(__file__, tmp_path_factory)


@pytest.mark.parametrize("name", sorted(CASES))
def test_in_simulator(name, verdicts):
    assert name in verdicts, f"case {name} did not run"
    assert verdicts[name] == "ok", verdicts[name]


if __name__ == "__main__":
    run_cases(CASES, sys.argv[1])
