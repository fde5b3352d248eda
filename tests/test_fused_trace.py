"""Tracing the fused kernel: the traced twins record one stamped record per op per block in
the interpreter's format (the simulator runs them), the untraced kernels carry none of that
code (PTX), and a bound fused collective traces on GPUs (``@pytest.mark.gpu``)."""

from __future__ import annotations

import ctypes
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from simulator import run_cases, simulator_verdicts

from purlin.atom.fused_trace import as_row_records, op_rows
from purlin.kernels import isa

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------ the simulator's cases


def _layouts():
    """(name, collective, protocol): an all-reduce on flags and on LL transfers, and a custom
    layout -- every rank gathers the pieces in reverse rank order."""
    from purlin.spec import Collective, collectives

    rev = Collective([[r] for r in range(4)], [list(range(3, -1, -1))] * 4, "copy",
                     name="reversed all-gather")
    qkv = Collective([[(r, t) for t in "qkv"] for r in range(4)],
                     [[(r, t) for t in "qkv" for r in range(4)]] * 4, "copy", name="gqa")
    return [("all-reduce", collectives.all_reduce(4), "fused"),
            ("all-reduce-ll", collectives.all_reduce(4), "fused-ll"),
            ("reversed-all-gather", rev, "fused"),
            ("reversed-all-gather-ll-joined", rev, "fused-ll"),  # the program that runs
            ("gqa-segmented", qkv, "fused")]


def _landed_rank0(low, bufs, item):
    """What the peers' rows of call 0 leave on rank 0: their LL units (tag 1) and pushes; every
    wait of rank 0 satisfied."""
    from purlin.kernels import sim

    for peer in range(1, len(low)):
        for row in low[peer].tables[0]:
            size = int(row[isa.COUNT]) * item
            if row[isa.OP] == isa.LL_PUT and row[isa.PEER] == 0:
                data = ctypes.string_at(int(low[peer].srcs[row[isa.SRC]]), size)
                units = sim.ll_pack(data + bytes(-size % 16), 1)
                ctypes.memmove(int(row[isa.DST]), units.tobytes(), units.nbytes)
            elif row[isa.OP] == isa.COPY and any(
                    0 <= int(row[isa.DST]) - m.ctypes.data < m.nbytes
                    for m in (bufs.scratch[0], bufs.outputs[0])):
                ctypes.memmove(int(row[isa.DST]), int(low[peer].srcs[row[isa.SRC]]), size)
    for f in bufs.block_flags:
        f[:] = 1 << 40


def _traced_rank0(coll, protocol, blocks=2, threads=3, count=24, segments=False):
    """Rank 0 of ``coll`` (bfloat16, direct-push) on the fused kernel, its peers' data landed:
    untraced, then traced; ``segments``: the program the sm datapath runs (segmented,
    joined) on ``fused_seg`` and its traced twin, else one op per row on ``fused``. Returns
    (schedule, lowered, the rows each op names, outputs untraced, traced, trace records
    int64[blocks, ops, 4])."""
    from purlin.atom.fused import fused_unit
    from purlin.atom.fused_rows import cluster_programs, several_pieces
    from purlin.atom.fused_trace import program_rows
    from purlin.atom.host import HostBuffers, fused_programs
    from purlin.kernels import fused
    from purlin.snac import plan

    sizing = coll.sized(chunk_sizes={k: count for k in coll.input.names()}, dtype="bfloat16")
    s = plan(coll, "direct-push", sizing=sizing)
    bufs = HostBuffers(s, ll=protocol == "fused-ll")
    rng = np.random.default_rng(1)
    for r in range(s.nranks):
        bufs.inputs[r][:] = rng.integers(0x3f00, 0x4000, bufs.inputs[r].size).astype(np.uint16)
    low = bufs.lower()
    unit, problem = fused_unit(low, protocol)
    assert problem is None, problem
    words = fused_programs(low, bufs, unit, segments=segments)[0].copy()
    ops = int(words[isa.F_NOPS])
    if segments:  # (the same ops, on addresses that do not matter here)
        prog = cluster_programs(low, lambda r: 0, 0, int, unit, segments=several_pieces(s))[0]
        rows = program_rows(low[0], prog.op_list, unit)
    else:
        rows = op_rows(low[0], ops)
    plain_kernel, traced_kernel = (fused.fused_seg, fused.fused_seg_trace) if segments else \
        (fused.fused, fused.fused_trace)
    outs = []
    trace = np.zeros((blocks, ops, isa.TRACE_WIDTH), np.int64)
    for traced in (False, True):
        bufs.outputs[0][:] = 0
        _landed_rank0(low, bufs, 2)
        counters = np.zeros(isa.F_MAX_BLOCKS, np.int64)
        args = (words.ctypes.data, 1, blocks, 10_000_000, words.size, counters.ctypes.data)
        if traced:
            traced_kernel[blocks, threads](*args, trace.ctypes.data, ops)
        else:
            plain_kernel[blocks, threads](*args)
        assert bufs.fused_error[isa.E_CODE] == 0, bufs.fused_error
        assert (counters[:blocks] == 1).all()
        outs.append(bufs.outputs[0].copy())
    return s, low, rows, outs[0], outs[1], trace


def _check_case(name, coll, protocol):
    from purlin.trace import from_sm_records
    from purlin.viz import timeline_figure

    segments = name.endswith(("-joined", "-segmented"))
    s, low, rows, plain, traced, rec = _traced_rank0(coll, protocol, segments=segments)
    ops = len(rows)
    assert np.array_equal(plain, traced), (name, "the traced kernel computes otherwise")
    if segments:
        assert any(len(r) > 1 for r in rows), (name, "no op stands for several rows", rows)
    for b, block in enumerate(rec):  # one record per op, stamps in program order
        assert block[:, 0].tolist() == list(range(ops)) and (block[:, 1] == b).all(), block
        starts, ends = block[:, 2], block[:, 3]
        assert (starts > 0).all() and (ends >= starts).all(), block
        assert (starts[1:] >= ends[:-1]).all(), (name, block)
    as_rows = as_row_records(rec, rows, len(low[0].tables[0]))
    t = from_sm_records(s, low, [as_rows, None, None, None], 2, devices=[0] * 4,
                        label=f"measured ({protocol} kernel)", block_matched=True)
    # on LL transfers a move polls its peers' units in place: its wait is inside the consume
    kinds = {"fused": {"stage", "notify", "wait", "consume"}, "fused-ll": {"stage", "consume"}}
    assert set(t.kinds()) == kinds[protocol], (name, t.kinds())
    assert {e.rank for e in t} == {0} and {e.block for e in t} == {0, 1}
    assert t.check() == [], t.check()
    spans = {(int(rec[b, k, 2]), int(rec[b, k, 3])) for b in range(2) for k in range(ops)}
    zero = min(start for start, _ in spans)
    for e in t:  # every event is the span of its ops
        assert any(abs(e.start_ns - (start - zero)) < 1 for start, _ in spans), e
    fig = timeline_figure(t, title=t.label)
    assert len(fig.data) > 0 and "fused" in fig.layout.title.text


def _simulated_cases() -> dict:
    return {name: (lambda n=name, c=coll, p=protocol: _check_case(n, c, p))
            for name, coll, protocol in _layouts()}


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory):
    return simulator_verdicts(__file__, tmp_path_factory, timeout=600)


@pytest.mark.parametrize("name", [name for name, _, _ in _layouts()])
def test_the_traced_fused_kernel_records_every_op_in_the_simulator(name, verdicts):
    """Rank 0 of a 4-rank all-reduce (flags; LL) and of a rank-reversed all-gather, two blocks,
    one op per row on ``fused``, and the programs the sm datapath runs on ``fused_seg`` (the
    all-gather's LL rows joined, GQA's pieces segmented): the traced kernel gives the
    untraced one's output, one record per op per block with start <= end <= the next op's
    start, and the records draw as a measured timeline."""
    assert verdicts.get(name) == "ok", verdicts.get(name, f"case {name} did not run")


# ------------------------------------------------------------------------- no simulator


def _table(*opcodes):
    table = np.zeros((len(opcodes), isa.ROW_WIDTH), np.int64)
    table[:, isa.OP] = opcodes
    return SimpleNamespace(rank=0, tables=[table])


def test_records_become_table_rows_and_a_norm_has_none():
    from purlin.errors import ExecutionError

    rows = op_rows(_table(isa.WAIT, isa.LL_GET, isa.REDUCE), 3)  # wait, move, norm
    assert rows.tolist() == [0, 2, -1]
    rec = np.array([[[0, 1, 10, 20], [1, 1, 20, 50], [2, 1, 50, 90]],
                    np.zeros((3, 4), np.int64)])  # block 1 never ran
    out = as_row_records(rec, rows, 3)
    assert out[0].tolist() == [[0, 1, 10, 20], [0, 0, 0, 0], [2, 1, 20, 50]]
    assert not out[1].any()
    with pytest.raises(ExecutionError, match="2 ops but its table 3 rows"):
        op_rows(_table(isa.WAIT, isa.NOTIFY, isa.COPY), 2)


def test_every_table_row_is_named_by_one_op_of_the_program_that_runs():
    """A traced bind runs the program the untraced one runs (regrouped, segmented, joined):
    each of its ops names the rows it stands for, and every row that becomes an op (all but
    the LL_GET rows the moves read) is named exactly once -- the standard collectives and the
    custom layouts, every strategy that fuses, both protocols, 2, 4 and 8 ranks."""
    from purlin.atom.fused import fused_unit
    from purlin.atom.fused_rows import cluster_programs, several_pieces
    from purlin.atom.fused_trace import program_rows
    from purlin.atom.host import HostBuffers
    from purlin.snac import plan
    from purlin.spec import Collective, collectives

    joined = segmented = 0
    for n in (2, 4, 8):
        layouts = [getattr(collectives, name)(n) for name in (
            "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")]
        layouts += [
            Collective([[r] for r in range(n)], [list(range(n - 1, -1, -1))] * n, "copy"),
            Collective([[(r, t) for t in "qkv"] for r in range(n)],
                       [[(r, t) for t in "qkv" for r in range(n)]] * n, "copy"),
            Collective([["a"], ["b"]] + [[] for _ in range(n - 2)], [["a", "b"]] * n, "copy")]
        for coll in layouts:
            for strategy in ("direct-push", "direct-pull", "two-phase"):
                for protocol in ("fused", "fused-ll"):
                    try:
                        s = plan(coll, strategy, dtype="bfloat16", sizing=coll.sized(
                            chunk_sizes={k: 64 for k in coll.input.names()},
                            dtype="bfloat16"))
                    except Exception:  # noqa: BLE001 - a strategy this layout has not
                        continue
                    low = HostBuffers(s, ll=protocol == "fused-ll").lower()
                    unit, problem = fused_unit(low, protocol)
                    if problem is not None:
                        continue
                    progs = cluster_programs(low, lambda r: 0, 0, int, unit,
                                             segments=several_pieces(s))
                    for lr, prog in zip(low, progs):
                        named = program_rows(lr, prog.op_list, unit)
                        assert len(named) == prog.ops
                        flat = sorted(row for rows in named for row in rows)
                        assert flat == op_rows(lr).tolist(), (coll.name, strategy, protocol,
                                                              lr.rank, named)
                        joined += any(len(rows) > 1 for rows in named)
                        segmented += prog.segments > 0
    assert joined and segmented  # (the joined and segmented programs were among them)


def test_block_matched_flows_pair_each_block_with_its_own_notify():
    """Block 0 of both ranks runs far ahead of block 1: on the interpreter every block's wait
    needs every block's notify (so block 0 ending its wait early is inconsistent); on the fused
    kernel block 0 waits only for block 0 of its peer."""
    from purlin.atom.lowering import lower
    from purlin.snac import plan
    from purlin.spec import collectives
    from purlin.trace import from_sm_records

    s = plan(collectives.all_reduce(2), "direct-push", count=64, dtype="float32")
    bases = {(r, b): (1 + 4 * r + i) << 20 for r in range(2)
             for i, b in enumerate(("input", "output", "scratch"))}
    low = lower(s, bases, {r: (9 + r) << 20 for r in range(2)})
    assert [int(x) for x in low[0].tables[0][:, isa.OP]] == [isa.COPY, isa.NOTIFY, isa.WAIT,
                                                            isa.REDUCE]
    spans = {0: (1000, 1010, 1020, 1030, 1040), 1: (1000, 1100, 1110, 1120, 1130)}
    traces = [np.array([[(row, b, t[row], t[row + 1]) for row in range(4)]
                        for b, t in spans.items()]) for _ in range(2)]
    kw = dict(devices=[0, 0])
    interpreter = from_sm_records(s, low, traces, 2, **kw)
    fused = from_sm_records(s, low, traces, 2, block_matched=True, **kw)
    assert any("which releases it" in p for p in interpreter.check())
    assert fused.check() == [] and fused.meta["block_matched"] is True
    assert {(n.block, w.block) for n, w in fused.flows()} == {(0, 0), (1, 1)}


def test_ll_rows_read_as_the_stage_and_the_wait_they_carry():
    """An LL_PUT is a Stage with its Notify inside the data, an LL_GET a Consume's wait (the
    interpreter's LL rows; on the fused kernel the LL_GET folds into the move)."""
    from purlin.atom.lowering import lower
    from purlin.snac import plan
    from purlin.spec import collectives
    from purlin.trace import from_sm_records

    s = plan(collectives.all_reduce(2), "direct-push", count=64, dtype="float32")
    bases = {(r, b): (1 + 4 * r + i) << 20 for r in range(2)
             for i, b in enumerate(("input", "output", "scratch", "ll"))}
    low = lower(s, bases, {r: (9 + r) << 20 for r in range(2)},
                ll_bases={r: bases[(r, "ll")] for r in range(2)})
    assert [int(x) for x in low[0].tables[0][:, isa.OP]] == [isa.LL_PUT, isa.LL_GET,
                                                            isa.REDUCE]
    traces = [np.array([[(row, 0, 100 + 10 * row, 110 + 10 * row) for row in range(3)]])
              for _ in range(2)]
    t = from_sm_records(s, low, traces, 1, devices=[0, 0])
    assert [(e.kind, e.step) for e in t.where(rank=0)] == [("stage", 0), ("wait", 2),
                                                           ("consume", 2)]


def test_a_traced_launcher_needs_its_buffer():
    from purlin.errors import SpecError
    from purlin.kernels.launch import Launcher

    with pytest.raises(SpecError, match="needs its trace buffer"):
        Launcher(kernel="fused-trace", trace=0, trace_rows=4)


def test_the_untraced_fused_kernels_carry_none_of_the_trace():
    """The traced twin adds exactly its two clock reads and four record stores per op; the
    untraced kernel keeps its six parameters and has neither (its body, symbol names aside,
    is the one compiled before tracing existed: checked when the hook went in)."""
    cuda = pytest.importorskip("numba.cuda", reason="numba-cuda compiles the kernels")
    if cuda.config.ENABLE_CUDASIM:
        pytest.skip("NUMBA_ENABLE_CUDASIM=1 is set: PTX needs the compiler")
    from purlin.kernels import fused
    from purlin.kernels.compat import compile_ptx
    from purlin.kernels.executor import MAX_THREADS

    def ptx(name, sig):
        return compile_ptx(getattr(fused, name).py_func, sig, cc=(9, 0),
                           launch_bounds=MAX_THREADS)

    for plain_name in ("fused", "fused_norm_pdl"):
        traced_name = plain_name.replace("fused", "fused_trace", 1) if "norm" not in plain_name \
            else "fused_norm_trace_pdl"
        plain, traced = ptx(plain_name, fused.SIGNATURE), ptx(traced_name, fused.TRACE_SIGNATURE)
        entry = plain[plain.index(".entry"):plain.index(")")]
        assert entry.count(".param") == 6
        assert traced.count("%globaltimer") == plain.count("%globaltimer") + 2
        assert traced.count("st.global.u64") == plain.count("st.global.u64") + 4
        assert ".local" not in traced and "call " not in traced


# the trace hook in kernels/fused.py, exactly as written there: without it, the source the
# untraced kernels were compiled from before tracing existed
HOOK = ("    t_op = np.int64(0)  # (``trace``: the fused_trace kernels; the others compile it out)\n",
        "        if trace != 0 and tid == 0:\n            t_op = globaltimer()\n",
        "        if trace != 0 and tid == 0:\n"
        "            _trace_op(trace, trace_rows, slot, blocks_per_rank, block, k, t_op)\n",
        ", trace=0, trace_rows=0):")


def test_the_untraced_fused_kernels_compile_as_if_the_hook_were_not_there(tmp_path):
    """kernels/fused.py with the trace hook cut out of its text compiles the untraced kernels
    to the same PTX bodies (symbol names aside): tracing costs them nothing. (Cut out, the
    text is the one before tracing existed, whose PTX these bodies also matched.)"""
    from ptx_bodies import SOURCE, body, fused_module, module_of

    fused = fused_module()
    text = SOURCE.read_text()
    for piece in HOOK:
        assert text.count(piece) == 1, f"the trace hook changed: update HOOK ({piece!r})"
        text = text.replace(piece, "):" if piece.startswith(",") else "")
    bare = module_of(text, tmp_path, "fused_without_hook")
    for name in ("fused", "fused_norm_pdl"):
        assert body(fused, name) == body(bare, name), name


def test_from_sm_names_the_kernel_that_ran():
    from purlin.snac import plan
    from purlin.spec import collectives
    from purlin.trace import from_sm

    s = plan(collectives.all_gather(2), "direct-push", count=8)
    low = [SimpleNamespace(tables=[np.zeros((1, isa.ROW_WIDTH), np.int64)],
                           lane_offsets=np.array([0, 1])) for _ in range(2)]
    for lw in low:
        lw.tables[0][0, isa.OP] = isa.COPY  # step 0: the stage
    rec = [np.array([[[0, 0, 100, 200]]]), np.array([[[0, 0, 150, 260]]])]
    bound = SimpleNamespace(schedule=s, lowered=low, blocks_per_lane=1, devices=(0, 0),
                            trace_rows=1, read_trace=lambda: rec, kernel="fused kernel")
    t = from_sm(bound)
    assert t.meta["kernel"] == "fused kernel" and len(t) == 2
    assert t.label == "measured (gpu, fused kernel)"


def test_the_bench_fused_mode_writes_its_table_json_and_figures(tmp_path, monkeypatch, capsys):
    """bench/timelines.py --fused with the GPU parts faked (binds, graph timing, the measured
    timeline): both layouts at every size, traced and untraced, one figure per traced call."""
    import importlib.util

    import purlin.bench.clusters as clusters
    import purlin.bench.providers as providers
    import purlin.trace as trace
    from purlin.runtime import Cluster
    from purlin.trace import predict

    spec = importlib.util.spec_from_file_location("bench_timelines", ROOT / "bench/timelines.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    binds = []

    def bind(self, coll, strategy, **kw):  # no protocol named: the fast path's
        from purlin.atom.sm import fast_protocol
        from purlin.snac import plan

        assert "protocol" not in kw
        s = plan(coll, strategy, nbytes=kw["nbytes"], dtype=kw["dtype"])
        protocol = fast_protocol(s)
        binds.append((coll.name, kw["nbytes"], protocol, kw["trace_rows"]))
        return SimpleNamespace(schedule=s, kernel=f"{protocol} kernel", protocol=protocol,
                               pdl=True, blocks_per_lane=4, trace_rows=kw["trace_rows"])

    monkeypatch.setattr(clusters, "gpu_count", lambda: 1)
    monkeypatch.setattr(Cluster, "virtual", classmethod(lambda cls, n: Cluster("virtual", n,
                                                                               (0,) * n)))
    monkeypatch.setattr(Cluster, "bind", bind)
    monkeypatch.setattr(providers, "time_graph",
                        lambda torch, b, ops, repeats: [10.0 + 0.5 * (b.trace_rows > 0)] * 3)
    monkeypatch.setattr(trace, "from_sm", lambda b: predict(b.schedule, "H200"))
    monkeypatch.setattr("sys.argv", ["timelines.py", "--fused", "--out", str(tmp_path)])
    assert script.main() == 0
    assert len(binds) == 12 and {b[2] for b in binds} == {"fused-ll", "fused"}
    data = json.loads((tmp_path / "fused-timelines.json").read_text())
    assert len(data["rows"]) == 6 and all(r["overhead_us"] == 0.5 for r in data["rows"])
    assert sorted(p.name for p in tmp_path.glob("*.html")) == sorted(
        f"fused-{stem}-{size}.html" for stem in ("allreduce", "reversed-allgather")
        for size in ("8KiB", "64KiB", "1MiB"))
    assert "fused-ll kernel" in capsys.readouterr().out


# ---------------------------------------------------------------------------------- GPUs


def _bind(n_bytes, layout, trace, protocol="fused"):
    from purlin.runtime import Cluster
    from purlin.spec import Collective, collectives

    coll = collectives.all_reduce(4) if layout == "all-reduce" else \
        Collective([[r] for r in range(4)], [list(range(3, -1, -1))] * 4, "copy",
                   name="reversed all-gather")
    return Cluster.virtual(4).bind(coll, "direct-push", nbytes=n_bytes, dtype="bfloat16",
                                   protocol=protocol, trace_rows=64 if trace else 0)


@pytest.mark.gpu
@pytest.mark.parametrize("protocol", ["fused", "fused-ll"])
@pytest.mark.parametrize("layout", ["all-reduce", "reversed-all-gather"])
def test_gpu_a_traced_fused_bind_runs_the_fused_kernel_and_draws(layout, protocol):
    import torch

    from purlin.spec import reference
    from purlin.trace import from_sm
    from purlin.viz import timeline_figure

    plain = _bind(64 << 10, layout, False, protocol)
    bound = _bind(64 << 10, layout, True, protocol)
    assert bound.kernel == plain.kernel == f"{protocol} kernel"
    # the traced twin of the kernel that runs untraced (the LL all-gather's joined program:
    # fused-seg), on the same program
    assert bound.launches[0].launcher.kernel == plain.launches[0].launcher.kernel + "-trace"
    del plain
    sizing = bound.schedule.sizing
    gen = np.random.default_rng(0)
    xs = [gen.standard_normal(sizing.input_count(r)).astype(np.float32) for r in range(4)]
    outs = bound([torch.tensor(x) for x in xs])
    want = reference(sizing, [torch.tensor(x).bfloat16().double().numpy() for x in xs])
    for r in range(4):
        got = outs[r].double().cpu().numpy()
        assert np.allclose(got, want[r], rtol=3e-2, atol=3e-2), r
    t = from_sm(bound)
    assert t.meta["kernel"] == f"{protocol} kernel" and t.check(tolerance_ns=1000) == []
    assert {e.rank for e in t} == set(range(4))
    assert {e.block for e in t} == set(range(bound.blocks_per_lane))
    raw = bound.read_trace()
    assert all(r.shape[0] == bound.blocks_per_lane for r in raw)
    pytest.importorskip("plotly", reason="plotly draws the timeline (pip install .[viz]); "
                        "the kernel's outputs and trace were checked")
    assert len(timeline_figure(t).data) > 0


@pytest.mark.gpu
def test_gpu_auto_keeps_the_fused_kernel_when_tracing():
    from purlin.runtime import Cluster
    from purlin.spec import collectives

    plain = Cluster.virtual(4).bind(collectives.all_reduce(4), "auto", nbytes=8 << 10,
                                    dtype="bfloat16")
    traced = Cluster.virtual(4).bind(collectives.all_reduce(4), "auto", nbytes=8 << 10,
                                     dtype="bfloat16", trace_rows=64)
    assert traced.kernel == plain.kernel
    assert traced.protocol == plain.protocol


@pytest.mark.gpu
def test_gpu_purlin_trace_measures_the_fused_kernel(tmp_path, capsys):
    from purlin.cli import main

    pytest.importorskip("plotly", reason="purlin trace draws with plotly (pip install .[viz])")
    page = tmp_path / "t.html"
    assert main(["trace", "all-reduce", "-n", "4", "-b", "64KiB", "--dtype", "bfloat16",
                 "--measure", "--out", str(page)]) == 0
    printed = capsys.readouterr().out
    assert "fused-ll kernel" in printed and "fused-ll kernel" in page.read_text()


if __name__ == "__main__":
    run_cases(_simulated_cases(), sys.argv[1])
