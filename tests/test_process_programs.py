"""Process mode runs the fused programs a single-process cluster runs, without a GPU: each
rank's ``SmPrepared`` (``purlin.torch.sm_path``; host tensors stand for its staging area)
builds, from every rank's tables, the program a single-process cluster builds for
that rank -- regrouped flags, segmented and joined ops, cut odd-aligned copies -- launches
the grid every other rank launches, and keeps that program's flags and rotations where its
buffers move (``zero_copy``) and where the peers see each other's buffers at other
addresses. The GPU runs of the same path: tests/test_process_one_gpu.py,
tests/test_gpu_process.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from purlin.atom.fused import kernel_name, program, segmented_program
from purlin.atom.fused_rows import launch_ops
from purlin.atom.lowering import relocate
from purlin.atom.sm import Gpu, fused_launch
from purlin.runtime.shm import layout
from purlin.snac import plan
from purlin.spec import collectives
from test_bench_auto import _bench

N = 4


def _bench_cases():
    return {name: (coll, sizes) for name, _, coll, sizes, _, _ in _bench().cases(N, 96 << 10, 2)}


def _schedule(case: str, strategy: str):
    lanes = 2 if case.endswith(", 2 lanes") else 1
    case = case.removesuffix(", 2 lanes")
    if case in ("gqa all-gather", "gqa all-gather, odd pieces", "two-root broadcast",
                "partial all-reduce to the others"):
        coll, sizes = _bench_cases()[case]
        return plan(coll, strategy, chunk_sizes=sizes, dtype="bfloat16", lanes=lanes)
    coll, count = {"all-gather": (collectives.all_gather(N), 4096),
                   "reduce-scatter": (collectives.reduce_scatter(N), 4096),
                   "all-reduce + 1": (collectives.all_reduce(N), 8 * 4096 + 1)}[case]
    return plan(coll, strategy, count=count, dtype="bfloat16")


CASES = [("all-gather", "direct-pull", "fused"), ("all-gather", "direct-push", "fused-ll"),
         ("gqa all-gather", "direct-pull", "fused"), ("gqa all-gather", "direct-push", "fused"),
         ("gqa all-gather, odd pieces", "direct-pull", "fused"),
         ("gqa all-gather, odd pieces", "direct-push", "fused"),
         ("gqa all-gather", "direct-push", "fused-ll"),
         ("reduce-scatter", "direct-push", "fused"), ("all-reduce + 1", "two-phase", "fused"),
         # (ranks whose largest rows differ: every rank launches the largest one's grid)
         ("two-root broadcast", "direct-push", "fused-ll"),
         ("partial all-reduce to the others", "direct-pull", "fused"),
         # (a program a lane: each root's half in its own)
         ("two-root broadcast, 2 lanes", "direct-pull", "fused"),
         ("gqa all-gather, 2 lanes", "direct-push", "fused-ll")]


class _Launcher:  # (the kernels' launchers, made without a GPU: their configuration)
    def __init__(self, **config):
        self.config = config
        self.head_words = config.get("stride_words", 0)
        self.nranks_in_launch = config.get("nranks_in_launch", 1)


def _prepared(monkeypatch, s, protocol: str, views=None) -> list:
    """Every rank's ``SmPrepared`` of ``s`` at offset 0 of its staging (host memory);
    ``views[r][q]``: where rank r sees rank q's staging (by default where it is)."""
    from purlin.kernels import launch
    from purlin.torch.sm_path import SmPath

    monkeypatch.setattr(launch, "Launcher", _Launcher)
    lay = layout(s, ll=protocol == "fused-ll", block_flags=True)
    bufs = [torch.zeros(lay.size, dtype=torch.uint8) for _ in range(N)]
    out = []
    for r in range(N):
        path = object.__new__(SmPath)
        path.group, path.rank, path.nranks, path.timeout = None, r, N, 2.0
        path.device = torch.device("cpu", 0)
        path.blocks_per_lane, path.threads = None, 512
        path.gpu, path.sms = Gpu(0, 132), 132
        path.buf = bufs[r]
        path.ptrs = list(views[r]) if views else [b.data_ptr() for b in bufs]
        path.ptrs[r] = bufs[r].data_ptr()
        path._launchers, path.prepared = {}, []
        out.append(path.prepare(s, 0, lay, protocol=protocol))
    return out


def _error(p) -> int:
    return p.control.data_ptr() + 2 * 8


@pytest.mark.parametrize("case,strategy,protocol", CASES)
def test_each_rank_builds_the_single_process_cluster_s_program_for_it(case, strategy, protocol,
                                                                      monkeypatch):
    s = _schedule(case, strategy)
    ps = _prepared(monkeypatch, s, protocol)
    p0 = ps[0]
    want = launch_ops(s, p0.all_lowered, p0.unit).programs(lambda q: _error(ps[q]),
                                                           p0.abort_ptr, p0.flags.slot)
    lanes = len(want) // N  # (every rank of these cases has rows in every lane)
    assert len(want) == N * lanes and lanes == s.lanes, case
    grid = fused_launch(Gpu(0, 132), max(w.items for w in want), 1, p0.unit, lanes=lanes,
                        kind="process")
    if len({w.items for w in want}) > 1:  # (its own largest row would give another grid)
        assert any(fused_launch(Gpu(0, 132), w.items, 1, p0.unit, lanes=lanes,
                                kind="process") != grid
                   for w in want)
    for r, p in enumerate(ps):
        mine = want[r * lanes:(r + 1) * lanes]
        assert len(p.programs) == lanes
        assert all(np.array_equal(a.words, w.words) for a, w in zip(p.programs, mine)), (case, r)
        assert (p.blocks_per_lane, p.threads) == grid, (case, r)
        assert p.kernel.launcher.config["kernel"] == kernel_name([w.words for w in mine])
        assert p.kernel.launcher.config["nranks_in_launch"] == lanes
        assert p.kernel.launcher.config["stride_words"] >= max(w.words.size for w in mine)
    if case.startswith("gqa") and protocol == "fused":  # (before: the rank's own rows only)
        alone = [program(p.lowered, _error(p), p.abort_ptr, p.flags.slot, p.unit) for p in ps]
        assert any(segmented_program(w.words) for w in want)
        assert not any(np.array_equal(a.words, w.words) for a, w in zip(alone, want))


@pytest.mark.parametrize("case,strategy,protocol", CASES)
def test_ranks_that_see_each_other_elsewhere_build_programs_of_one_shape(
        case, strategy, protocol, monkeypatch):
    """A process sees its peers' staging at addresses of its own (symmetric memory or CUDA
    IPC maps it where it can): every rank's view of every rank's ops has the same shape --
    op kinds, bytes, flag values, rotations -- so the programs meet block for block."""
    s = _schedule(case, strategy)
    views = [[((q + 1) << 40) + (r << 36) for q in range(N)] for r in range(N)]
    ps = _prepared(monkeypatch, s, protocol, views)

    def shape(p):
        return [([(op.kind, getattr(op, "nbytes", None), getattr(op, "value", None),
                   len(getattr(op, "parts", ()))) for op in ops], sorted(rot.items()))
                for ops, rot in zip(p.ops.ops, p.ops.rotations)]

    assert all(shape(p) == shape(ps[0]) for p in ps), case
    assert len({p.ops.items() for p in ps}) == 1


def _like(region: torch.Tensor) -> torch.Tensor:
    """A tensor of ``region``'s size and dtype elsewhere, as aligned within 16 bytes."""
    nbytes = region.numel() * region.element_size()
    raw = torch.zeros(nbytes + 32, dtype=torch.uint8)
    at = (region.data_ptr() - raw.data_ptr()) % 16
    return raw[at: at + nbytes].view(region.dtype)


@pytest.mark.parametrize("case,strategy,protocol", [
    ("all-gather", "direct-push", "fused-ll"), ("gqa all-gather", "direct-push", "fused"),
    ("gqa all-gather, odd pieces", "direct-push", "fused"),
    ("gqa all-gather", "direct-push", "fused-ll"), ("reduce-scatter", "direct-push", "fused"),
    ("gqa all-gather, 2 lanes", "direct-push", "fused")])
def test_a_relocated_program_is_the_cluster_s_program_of_the_moved_table(
        case, strategy, protocol, monkeypatch):
    """``zero_copy``: a rank reading the caller's input and writing its output in place runs
    its program with those addresses moved -- the program the cluster builds when that rank's
    buffers sit there -- at the collective's stride."""
    s = _schedule(case, strategy)
    ps = _prepared(monkeypatch, s, protocol)
    moved = 0
    for r, p in enumerate(ps):
        src, dst = _like(p.input), _like(p.output)
        move_in, move_out = p.movable(src, dst)
        if not (move_in or move_out):
            continue
        moves = {(region.data_ptr(), region.numel() * region.element_size()): t.data_ptr()
                 for go, region, t in ((move_in, p.input, src), (move_out, p.output, dst))
                 if go}
        everyone = list(p.all_lowered)
        everyone[r] = relocate(p.lowered, moves)
        wants = launch_ops(s, everyone, p.unit).program(r, _error(p), p.abort_ptr,
                                                        p.flags.slot)
        table, _ = p._moved[p._key(src if move_in else None, dst if move_out else None)]
        got = table.numpy().reshape(len(wants), -1)  # (a program a lane, at one stride)
        assert got.shape[1] == p.program_words and len(wants) == s.lanes
        for g, w in zip(got, wants):
            assert np.array_equal(g[:w.words.size], w.words) and not g[w.words.size:].any(), \
                (case, r)
        moved += 1
    assert moved, case
