"""The variable-length pack and unpack kernels (kernels/varlen.py) in Numba's CUDA simulator.

The simulator must be on before ``numba.cuda`` is first imported, so the cases run in one
child process (``NUMBA_ENABLE_CUDASIM=1 python tests/test_varlen_sim.py OUT``) and each test
checks one case's verdict. Each case packs every rank's packed input into its slots with the
kernel, moves the slots as the padded collective does (numpy, by the sizing's offsets: the
strategies only change how the schedule moves those bytes, tested on the cpu datapath),
unpacks with the kernel and compares with the unpadded reference. The "lowered" cases run
each strategy's plan of the padded collective through the instruction tables the GPU executor
interprets (on host memory, ``purlin.atom.host``) instead.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
from simulator import run_cases, simulator_verdicts

KINDS = ("all-gather-v", "reduce-scatter-v", "all-to-all-v")
DTYPES = ("float16", "float32", "float64", "int32", "float8_e4m3fn", "bfloat16")
STYLES = ("mixed", "zero", "full")
LOWERED_DTYPES = ("bfloat16", "float16", "float32", "float64", "int32")  # isa's dtypes
SENTINEL = 0x7F  # the unpacked outputs start so: nothing past the packed rows may change


def _builder(kind):
    from purlin.spec.varlen import VARIABLE

    return VARIABLE[kind]


def _np_dtype(dtype):
    # bfloat16 and FP8 have no numpy type: their bits move as integers of their size
    return {"bfloat16": np.int16, "float8_e4m3fn": np.uint8}.get(dtype, np.dtype(dtype))


def _shared(a):
    """``a`` as the simulator's device array without a copy: the kernels write one buffer
    through two views (elements and int64 headers), as they do on a GPU."""
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

    return FakeCUDAArray(a)


def _int_view(a, kw):
    return _shared(a.view(kw.int_name))


def _move(v, sizing, padded_in, dtype):
    """The padded collective, on the host: copies move slot bits; reductions add in float64."""
    c = v.collective
    _, slot = v.slot(dtype)
    outs = []
    for r, row in enumerate(c.output):
        out = np.zeros(slot * max(len(row), 1), dtype=padded_in[0].dtype)
        for q, name in enumerate(row):
            srcs = [padded_in[sr][sp * slot:(sp + 1) * slot] for sr, sp in c.sources(name)]
            if c.op.is_reduce:
                total = np.sum([_decode(s, dtype) for s in srcs], axis=0)
                out[q * slot:(q + 1) * slot] = _encode(total, dtype)
            else:
                out[q * slot:(q + 1) * slot] = srcs[0]
        outs.append(out)
    return outs


def _move_lowered(strategy):
    """The padded collective as ``strategy`` plans it, lowered to the instruction tables the
    GPU executor runs and run on host memory (``purlin.atom.host``)."""
    def move(v, sizing, padded_in, dtype):
        from purlin.atom.host import HostBuffers, run_calls
        from purlin.snac.planner import plan

        bufs = HostBuffers(plan(v.collective, strategy, sizing=sizing))
        # run_calls takes and gives values; the headers' small counts are subnormal floats
        # there, which survive the round trip bit for bit
        outs = run_calls(bufs.lower(), bufs, [[_decode(p, dtype) for p in padded_in]])[0]
        back = [_encode(o, dtype) for o in outs]
        assert all(np.array_equal(_decode(b, dtype), o) for b, o in zip(back, outs))
        return back

    return move


def _run(v, dtype, counts, inputs, threads=32, move=None):
    """pack -> padded collective -> unpack through the kernels; (outputs, counts, errors)."""
    from purlin.kernels import varlen as kv
    from purlin.runtime.varlen import kernel_view, slot_meta

    c = v.collective
    _, slot = v.slot(dtype)
    kw = kernel_view(v, dtype)  # rows move as integers of kw.unit bytes
    head, row = kw.head, kw.row
    counts = np.asarray(counts, dtype=np.int64)
    padded, errors = [], []
    for r in range(v.nranks):
        buf = np.zeros(slot * max(len(c.input[r]), 1), dtype=inputs[r].dtype)
        err = np.zeros(16, dtype=np.int64)
        meta_in, _ = slot_meta(v, r, dtype)
        if c.input[r]:
            src = inputs[r] if inputs[r].size else np.zeros(v.row, inputs[r].dtype)
            kv.pack[kv.grid(len(c.input[r]), v.capacity * row, threads), threads](
                _int_view(src, kw), inputs[r].size // v.row * row, _int_view(buf, kw),
                _shared(buf.view(np.int64)), counts, _shared(meta_in), head, row, v.capacity,
                _shared(err), r)
        padded.append(buf)
        errors.append(err)
    moved = (move or _move)(v, v.sized(dtype), padded, dtype)
    outs, got = [], []
    for r in range(v.nranks):
        _, meta_out = slot_meta(v, r, dtype)
        out = np.full(max(v.output_capacity(r), 1), SENTINEL, dtype=inputs[r].dtype)
        oc = np.zeros(max(len(c.output[r]), 1), dtype=np.int64)
        if c.output[r]:
            kv.unpack[kv.grid(len(c.output[r]), v.capacity * row, threads), threads](
                _int_view(moved[r], kw), _shared(moved[r].view(np.int64)), _int_view(out, kw),
                counts, _shared(meta_out), head, row, v.capacity, _shared(oc))
        outs.append(out)
        got.append(oc[:len(c.output[r])])
    return outs, got, errors


def _encode(vals, dtype):
    if dtype == "float8_e4m3fn":
        from purlin.spec.dtypes import fp8_encode

        return fp8_encode(vals, dtype)
    if dtype == "bfloat16":
        from purlin.atom.host import bf16_bits

        return bf16_bits(vals.astype(np.float32)).view(np.int16)
    return vals.astype(dtype)


def _values(dtype, n, rng):
    vals = rng.integers(-3, 4, n).astype(np.float64)
    return vals, _encode(vals, dtype)


def _decode(x, dtype):
    if dtype == "float8_e4m3fn":
        from purlin.spec.dtypes import fp8_decode

        return fp8_decode(x, dtype).astype(np.float64)
    if dtype == "bfloat16":
        from purlin.atom.host import bf16_floats

        return bf16_floats(x.view(np.uint16)).astype(np.float64)
    return x.astype(np.float64)


def case_reference(kind, dtype, style, row=2, strategy=None):
    rng = np.random.default_rng(abs(hash((kind, dtype, style, row))) % 2**32)
    v = _builder(kind)(3, 4, row=row)
    if style == "zero":
        counts = [0] * len(v.names)
    elif style == "full":
        counts = [v.capacity] * len(v.names)
    else:
        counts = rng.integers(0, v.capacity + 1, len(v.names)).tolist()
        counts[0], counts[-1] = 0, v.capacity
    checked = v.counts(counts)
    values, ins = [], []
    for r in range(v.nranks):
        f, x = _values(dtype, sum(v.input_counts(r, checked)) * v.row, rng)
        values.append(f)
        ins.append(x)
    outs, got, errors = _run(v, dtype, counts, ins,
                             move=_move_lowered(strategy) if strategy else None)
    want = v.reference(values, counts)
    for r in range(v.nranks):
        assert tuple(got[r].tolist()) == v.output_counts(r, checked), (r, got[r], counts)
        n = sum(v.output_counts(r, checked)) * v.row
        assert np.array_equal(_decode(outs[r][:n], dtype), want[r]), (r, outs[r], want[r])
        # nothing written past the packed rows
        assert (outs[r][n:] == np.full(1, SENTINEL, outs[r].dtype)).all(), r
        assert errors[r][0] == 0, errors[r]
    return "ok"


def case_bad_counts():
    from purlin.kernels import isa
    from purlin.spec.varlen import all_to_all_v

    v = all_to_all_v(2, capacity=3)
    rng = np.random.default_rng(1)
    ins = [rng.integers(0, 9, 6).astype(np.float32) for _ in range(2)]
    # rank 1 sends 7 rows to rank 0: over capacity; rank 0 sends -2 to rank 1
    outs, got, errors = _run(v, "float32", [1, -2, 7, 1], ins)
    e0, e1 = errors
    assert e0[isa.E_CODE] == isa.ERR_COUNT and e0[isa.E_RANK] == 0 and e0[isa.E_STEP] == 1 \
        and e0[isa.E_SEEN] == -2 and e0[isa.E_EXPECTED] == 3, e0
    assert e1[isa.E_CODE] == isa.ERR_COUNT and e1[isa.E_RANK] == 1 and e1[isa.E_FLAG] == 2 \
        and e1[isa.E_SEEN] == 7, e1
    # clamped, not truncated silently out of bounds: rank 0 gets 1 + 3 rows, rank 1 0 + 1
    assert got[0].tolist() == [1, 3] and got[1].tolist() == [0, 1]
    assert outs[0][:4].tolist() == [ins[0][0], *ins[1][:3]]
    assert outs[1][:1].tolist() == [ins[1][3]]
    # counts that run past the packed input: cut there, recorded
    outs, got, errors = _run(v, "float32", [2, 3, 0, 0], [ins[0][:4], ins[1][:0]])
    assert errors[0][isa.E_CODE] == isa.ERR_PACKED and errors[0][isa.E_STEP] == 1 and \
        errors[0][isa.E_SEEN] == 5 and errors[0][isa.E_EXPECTED] == 4, errors[0]
    assert got[1].tolist() == [2, 0] and outs[1][:2].tolist() == ins[0][2:4].tolist()
    return "ok"


def _run_group(v, dtype, counts, inputs, threads=32, blocks=2):
    """:func:`_run` with every rank's pack in one ``pack_group`` launch and every unpack in
    one ``unpack_group`` launch (``blocks`` per slot: their grid-stride loops share a slot);
    each buffer has one spare slot past its end that must stay untouched."""
    from purlin.kernels import varlen as kv
    from purlin.runtime.varlen import kernel_view, slot_meta

    c = v.collective
    _, slot = v.slot(dtype)
    kw = kernel_view(v, dtype)
    counts = np.asarray(counts, dtype=np.int64)
    n = v.nranks
    bufs = [np.full(slot * (len(c.input[r]) + 1), SENTINEL, dtype=inputs[r].dtype)
            for r in range(n)]
    for b in bufs:
        b[:-slot] = 0
    errors = [np.zeros(16, dtype=np.int64) for _ in range(n)]
    srcs = [inputs[r] if inputs[r].size else np.zeros(v.row, inputs[r].dtype) for r in range(n)]
    metas = [slot_meta(v, r, dtype) for r in range(n)]
    grid = (blocks, max(len(c.input[r]) for r in range(n)), n)
    kv.pack_group[grid, threads](
        tuple(_int_view(x, kw) for x in srcs),
        tuple(inputs[r].size // v.row * kw.row for r in range(n)),
        tuple(_int_view(b, kw) for b in bufs), tuple(_shared(b.view(np.int64)) for b in bufs),
        counts, tuple(_shared(m[0]) for m in metas), tuple(len(c.input[r]) for r in range(n)),
        kw.head, kw.row, v.capacity, tuple(_shared(e) for e in errors), tuple(range(n)))
    for b in bufs:
        assert (b[-slot:] == np.full(1, SENTINEL, b.dtype)).all(), "a pack wrote past its slots"
    moved = _move(v, v.sized(dtype), [b[:-slot] for b in bufs], dtype)
    outs = [np.full(max(v.output_capacity(r), 1) + slot, SENTINEL, dtype=inputs[r].dtype)
            for r in range(n)]
    got = [np.zeros(max(len(c.output[r]), 1), dtype=np.int64) for r in range(n)]
    kv.unpack_group[(blocks, max(len(c.output[r]) for r in range(n)), n), threads](
        tuple(_int_view(m, kw) for m in moved), tuple(_shared(m.view(np.int64)) for m in moved),
        tuple(_int_view(o, kw) for o in outs), counts, tuple(_shared(m[1]) for m in metas),
        tuple(len(c.output[r]) for r in range(n)), kw.head, kw.row, v.capacity,
        tuple(_shared(g) for g in got))
    return ([o[:-slot] for o in outs], [g[:len(c.output[r])] for r, g in enumerate(got)],
            errors, [o[-slot:] for o in outs])


def case_group(kind, dtype):
    """Several ranks in one pack launch and one unpack launch: the same bits, counts and
    error records as one launch per rank, also with a count error on the last rank only."""
    from purlin.kernels import isa

    rng = np.random.default_rng(3)
    v = _builder(kind)(3, 4, row=3)
    counts = rng.integers(0, v.capacity + 1, len(v.names)).tolist()
    counts[0] = v.capacity
    bad = list(counts)
    name = v.collective.input[2][-1]
    bad[v.index(name)] = 9  # over capacity, on rank 2's last input chunk only
    checked = v.counts(counts)
    ins = [_values(dtype, sum(v.input_counts(r, checked)) * v.row, rng)[1] for r in range(3)]
    for cs in (counts, bad):
        want_outs, want_got, want_err = _run(v, dtype, cs, ins)
        outs, got, errors, spare = _run_group(v, dtype, cs, ins)
        for r in range(3):
            assert np.array_equal(outs[r], want_outs[r]), (r, outs[r], want_outs[r])
            assert np.array_equal(got[r], want_got[r]), (r, got[r], want_got[r])
            assert np.array_equal(errors[r], want_err[r]), (r, errors[r], want_err[r])
            assert (spare[r] == np.full(1, SENTINEL, spare[r].dtype)).all(), r
    if not v.collective.op.is_reduce:  # a reduction's chunks are every rank's input
        assert errors[0][isa.E_CODE] == errors[1][isa.E_CODE] == isa.ERR_NONE, errors
    e = errors[2]
    assert e[isa.E_CODE] == isa.ERR_COUNT and e[isa.E_RANK] == 2 and \
        e[isa.E_STEP] == len(v.collective.input[2]) - 1 and \
        e[isa.E_FLAG] == v.index(name) and e[isa.E_SEEN] == 9 and \
        e[isa.E_EXPECTED] == v.capacity, e
    return "ok"


def case_runtime_group_error(kind, most=None):
    """VarLenBound's one launch per device (``most`` ranks a launch: kernels.varlen's
    MAX_GROUP, made smaller): a bad count on a rank past the first is reported with that rank
    and chunk."""
    from types import SimpleNamespace

    import torch

    from purlin.errors import CountError
    from purlin.kernels import varlen as kv
    from purlin.runtime.varlen import VarLenBound

    _fake_gpu()
    v = _builder(kind)(3, 4, row=2)
    kept = kv.MAX_GROUP
    kv.MAX_GROUP = most or kept
    try:
        bound = VarLenBound(SimpleNamespace(kind="virtual", nranks=3), v,
                            _FakeGpuBound(v, "float32"), "float32")
    finally:
        kv.MAX_GROUP = kept
    want = [(0, 1, 2)] if most is None else [(0, 1), (2,)]
    assert [g.ranks for g in bound._pack_groups] == want, bound._pack_groups
    assert [g.ranks for g in bound._unpack_groups] == want, bound._unpack_groups
    fixed = [torch.ones(v.input_capacity(r)) for r in range(3)]
    counts = [1] * len(v.names)
    name = v.collective.input[2][-1]
    counts[v.index(name)] = 7
    bound.launch(fixed, torch.tensor(counts))
    try:
        bound.check()
        raise AssertionError("an over-capacity count on rank 2 went unreported")
    except CountError as exc:
        assert str(exc).startswith(f"rank 2 chunk {_fmt(name)} "), exc
        assert "count 7 is over the capacity of 4 rows" in str(exc), exc
    return "ok"


def _fmt(name):
    from purlin.spec.collective import _fmt as fmt

    return fmt(name)


def _fake_gpu():
    """Run the GPU code paths of ``purlin.runtime.varlen`` and ``purlin.torch.varlen`` here:
    host tensors handed to the simulator's kernels as they are (no copies), no streams."""
    from types import SimpleNamespace

    import torch
    from numba import cuda

    from purlin.kernels import varlen as kv
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

    cuda.as_cuda_array = lambda t: FakeCUDAArray(t.numpy())
    cuda.external_stream = lambda handle: 0
    torch.cuda.current_stream = lambda device=None: SimpleNamespace(cuda_stream=0)
    kv.THREADS = 32  # the simulator runs a Python thread per CUDA thread


class _FakeGpuBound:
    """A padded collective bound "on a GPU": the sm datapath's buffers and front door, the
    collective itself run by the cpu datapath on those buffers."""

    def __init__(self, v, dtype, strategy="direct-push"):
        import torch

        from purlin import Cluster

        self.torch = torch
        self.cpu = Cluster.cpu(v.nranks).bind(v.collective, strategy, sizing=v.sized(dtype))
        self.schedule = self.cpu.schedule
        sizing, tdt = self.schedule.sizing, getattr(torch, dtype)
        self.inputs = [torch.zeros(sizing.input_count(r), dtype=tdt) for r in range(v.nranks)]
        self.outputs = [torch.zeros(sizing.output_count(r), dtype=tdt)
                        for r in range(v.nranks)]

    def launch(self):
        outs = self.cpu([x.numpy() for x in self.inputs])
        for o, got in zip(self.outputs, outs):
            o.copy_(self.torch.from_numpy(got))

    def synchronize(self):
        pass

    def check(self):
        pass


def case_runtime_gpu_path(kind, dtype):
    """VarLenBound's GPU path (device counts, kernels, error records) end to end."""
    from types import SimpleNamespace

    import torch

    from purlin.errors import CountError
    from purlin.runtime.varlen import VarLenBound

    _fake_gpu()
    v = _builder(kind)(3, 4, row=2)
    bound = VarLenBound(SimpleNamespace(kind="virtual", nranks=3), v, _FakeGpuBound(v, dtype),
                        dtype)
    rng = np.random.default_rng(7)
    counts = rng.integers(0, 5, len(v.names)).tolist()
    counts[0] = 4
    checked = v.counts(counts)
    values = [rng.integers(-3, 4, sum(v.input_counts(r, checked)) * 2).astype(np.float64)
              for r in range(3)]
    tdt = getattr(torch, dtype)
    outs = bound([torch.from_numpy(x).to(tdt) for x in values], counts)  # host counts
    want = v.reference(values, counts)
    assert all(np.array_equal(o.double().numpy(), w) for o, w in zip(outs, want)), outs
    # device counts, fixed-size inputs; then a count over capacity, recorded and raised
    fixed = [torch.zeros(v.input_capacity(r), dtype=tdt) for r in range(3)]
    for r in range(3):
        fixed[r][:values[r].size] = torch.from_numpy(values[r]).to(tdt)
    outs, got = bound.launch(fixed, torch.tensor(counts))
    bound.check()
    for r in range(3):
        assert tuple(got[r].tolist()) == v.output_counts(r, checked), (r, got[r])
        n = sum(v.output_counts(r, checked)) * 2
        assert np.array_equal(outs[r][:n].double().numpy(), want[r]), r
    bad = list(counts)
    bad[-1] = 9
    bound.launch(fixed, torch.tensor(bad))
    name = v.names[-1]
    try:
        bound.check()
        raise AssertionError("an over-capacity count went unreported")
    except CountError as exc:
        assert "count 9 is over the capacity of 4 rows (caught on the GPU" in str(exc), exc
        assert str(exc).startswith(f"rank {v.collective.sources(name)[0][0]} chunk ") or \
            v.collective.op.is_reduce, exc
    bound.check()  # cleared once reported
    return "ok"


def case_process_slots_gpu_path():
    """purlin.torch's slots on the kernel path: pack, headers, unpack, a recorded split."""
    import torch

    from purlin.errors import CountError
    from purlin.spec.varlen import all_to_all_v
    from purlin.torch.varlen import Slots

    _fake_gpu()
    v = all_to_all_v(2, capacity=3, row=2)
    slots = [Slots(v, r, torch.float32, torch.device("cpu")) for r in range(2)]
    for s in slots:
        s.kernels = True  # the kernel path, on host tensors
    ins = [torch.arange(8.0), torch.arange(100.0, 106.0)]
    counts = [torch.tensor([1, 3, 0, 0]), torch.tensor([0, 0, 2, 1])]
    for s, x, c in zip(slots, ins, counts):
        s.pack(x, c)
    # the all-to-all of the slots: slot j of rank r goes to slot r of rank j
    slot = slots[0].slot
    for r in range(2):
        for j in range(2):
            slots[j].padded_out[r * slot:(r + 1) * slot] = \
                slots[r].padded_in[j * slot:(j + 1) * slot]
    assert slots[0].received() == [1, 2] and slots[1].received() == [3, 1]
    out0, out1 = torch.zeros(6), torch.zeros(8)
    got0 = slots[0].unpack(out0, counts[0]).tolist()
    got1 = slots[1].unpack(out1, counts[1]).tolist()
    assert got0 == [1, 2] and out0.tolist() == [0.0, 1.0, 100.0, 101.0, 102.0, 103.0], out0
    assert got1 == [3, 1] and out1.tolist() == [2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 104.0, 105.0]
    slots[0].pack(ins[0], torch.tensor([-2, 1, 0, 0]))
    try:
        slots[0].check()
        raise AssertionError("a negative split went unreported")
    except CountError as exc:
        assert "rank 0 chunk (0,0) (its split for rank 0): split -2 is negative (caught on " \
               "the GPU by the pack kernel; 0 rows were sent)" in str(exc), exc
    return "ok"


def _cases():
    out = {f"ref-{k}-{d}-{s}": (case_reference, (k, d, s))
           for k in KINDS for d in DTYPES for s in STYLES}
    # rows of 3 and 8 elements: the kernels move them in units of 2, 4 or 8 bytes
    out.update({f"ref-{k}-{d}-row{row}": (case_reference, (k, d, "mixed", row))
                for k in KINDS for d in ("bfloat16", "float8_e4m3fn", "float32")
                for row in (3, 8)})
    # every strategy's plan, lowered and run on host memory between the kernels
    from purlin.errors import PlanError
    from purlin.snac.planner import plan
    from purlin.snac.strategies import STRATEGIES

    for k in KINDS:
        for strategy in STRATEGIES:
            v = _builder(k)(3, 4, row=2)
            try:
                plan(v.collective, strategy, sizing=v.sized("float32"))
            except PlanError:
                continue
            for d in LOWERED_DTYPES:
                out[f"lowered-{k}-{strategy}-{d}"] = (case_reference, (k, d, "mixed", 2,
                                                                       strategy))
    out["bad-counts"] = (case_bad_counts, ())
    out.update({f"runtime-gpu-path-{k}-{d}": (case_runtime_gpu_path, (k, d))
                for k in KINDS for d in ("float32", "float16", "int32")})
    out["process-slots-gpu-path"] = (case_process_slots_gpu_path, ())
    out.update({f"group-{k}-{d}": (case_group, (k, d))
                for k in KINDS for d in ("float32", "bfloat16", "float8_e4m3fn")})
    # a reduction's chunk is every rank's input: its bad count is on every rank
    out.update({f"runtime-group-error-{k}": (case_runtime_group_error, (k,))
                for k in ("all-gather-v", "all-to-all-v")})
    out["runtime-group-error-split"] = (case_runtime_group_error, ("all-to-all-v", 2))
    return out


def _simulated_cases() -> dict:
    def checked(fn, args):
        def run():
            verdict = fn(*args)
            if verdict != "ok":
                raise AssertionError(verdict)
        return run
    return {name: checked(fn, args) for name, (fn, args) in _cases().items()}


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory):
    return simulator_verdicts(__file__, tmp_path_factory, timeout=600)


@pytest.mark.parametrize("name", list(_cases()))
def test_simulated(verdicts, name):
    assert verdicts[name] == "ok", verdicts[name]


if __name__ == "__main__":
    run_cases(_simulated_cases(), sys.argv[1])
