"""Launch sizing and ``strategy="auto"`` without a GPU: a made-up device (SM count, registers
per thread) stands in for the one a bind would query.

Every default launch of a verified schedule fits the device (all of its blocks resident at
once, counting every rank of a virtual cluster: they share one launch); an explicit request
that cannot fit is refused with a sentence naming what would; ``auto`` picks the fused kernel
on clusters no tuning table covers, and something that binds where the fused kernel cannot
run the plan."""

from __future__ import annotations

import re

import pytest

from purlin.atom.fused import fused_problems
from purlin.atom.lowering import ll_transfers
from purlin.atom.sm import (Gpu, fused_launch, interpreter_launch, size_launch)
from purlin.errors import CapabilityError
from purlin.runtime.auto import TuningTable, select
from purlin.snac import plan
from purlin.spec import STANDARD, standard

SIZES = [8, 1 << 10, 8 << 10, 64 << 10, 1 << 20, 16 << 20, 256 << 20, 1 << 30]
GPUS = [Gpu(0, 132), Gpu(0, 132, registers=64), Gpu(0, 16)]


class Virtual:
    """What ``select`` reads of a cluster: n virtual ranks on GPU 0."""

    datapath, kind = "sm", "virtual"

    def __init__(self, n):
        self.nranks, self.devices = n, (0,) * n


def _fits(gpu, ranks, lanes, bpl, threads):
    return bpl >= 1 and bpl * lanes * ranks <= gpu.resident(threads)


def _sized(coll, nbytes, dtype="bfloat16"):
    """A sizing of about ``nbytes`` per message that the collective accepts."""
    item = 2 if dtype == "bfloat16" else 4
    widest = max(max(len(r) for r in coll.input), max(len(r) for r in coll.output))
    each = max(1, nbytes // item // widest)
    return coll.sized(count=each * widest, dtype=dtype)


@pytest.mark.parametrize("n", range(2, 9))
def test_default_and_auto_launches_always_fit(n):
    """Standard collectives x 2..8 virtual ranks x 8 B..1 GiB: the default bind
    (direct-push, the size's blocks) and auto's choice (its blocks only a wish) fit, on
    the interpreter and on the fused kernel."""
    checked = 0
    for name in STANDARD:
        coll = standard(name, n)
        for nbytes in SIZES:
            sizing = _sized(coll, nbytes)
            choice = select(coll, Virtual(n), chunk_sizes=dict(sizing.chunks),
                            dtype="bfloat16", gpu="NVIDIA H200")
            default = plan(coll, "direct-push", sizing=sizing)
            auto = plan(coll, choice.strategy, sizing=sizing, chunks=choice.chunks,
                        lanes=choice.lanes, lanes_by=choice.lanes_by)
            for gpu in GPUS:
                for schedule, wish in ((default, None), (auto, choice.blocks_per_lane),
                                       (auto, 256)):
                    for ll in (False, bool(ll_transfers(schedule))):
                        bpl, threads = interpreter_launch(schedule, gpu, n, ll=ll,
                                                          blocks_per_lane=wish, fit=True,
                                                          kind="virtual")
                        assert _fits(gpu, n, schedule.lanes, bpl, threads), \
                            (name, nbytes, gpu, schedule.lanes, bpl, threads)
                    for unit in (8, 16):
                        items = max(1, sizing.message_bytes // unit)
                        blocks, threads = fused_launch(gpu, items, n, unit, wish=wish)
                        assert _fits(gpu, n, 1, blocks, threads), (name, nbytes, gpu, blocks)
                        checked += 1
    assert checked == len(STANDARD) * len(SIZES) * len(GPUS) * 3 * 2


def test_the_one_gpu_notebook_launches_fit():
    """What stopped the notebooks on one H200: 1 MiB with 4 virtual ranks (256 blocks of
    512 threads) and four lanes of 33 blocks each (528)."""
    gpu = Gpu(0, 132)
    for name in ("all-gather", "reduce-scatter", "all-reduce"):
        coll = standard(name, 4)
        for lanes in (1, 4):
            schedule = plan(coll, "direct-push", sizing=_sized(coll, 1 << 20), chunks=lanes,
                            lanes=lanes)
            bpl, threads = interpreter_launch(schedule, gpu, 4, kind="virtual")
            assert _fits(gpu, 4, schedule.lanes, bpl, threads)
            assert threads == 512 and bpl == 132 // 4 // schedule.lanes


@pytest.mark.parametrize("ranks,lanes,bpl", [(4, 1, 64), (4, 4, 40), (8, 2, 20), (2, 16, 8)])
def test_an_explicit_overflow_names_what_fits(ranks, lanes, bpl):
    gpu = Gpu(3, 132)
    with pytest.raises(CapabilityError) as info:
        size_launch(gpu, lanes=lanes, ranks=ranks, want=1, blocks_per_lane=bpl,
                    kind="virtual")
    text = str(info.value)
    assert f"{bpl * lanes * ranks} blocks of 512 threads" in text and "GPU 3 (132 SMs" in text
    most = int(re.search(r"at most (\d+) blocks per lane fit: pass blocks_per_lane<=(\d+)",
                         text).group(1))
    assert _fits(gpu, ranks, lanes, most, 512) and not _fits(gpu, ranks, lanes, most + 1, 512)
    assert size_launch(gpu, lanes=lanes, ranks=ranks, want=1, blocks_per_lane=most) == \
        (most, 512)
    fewer = re.search(r"lanes<=(\d+)", text)
    if fewer:
        assert _fits(gpu, ranks, int(fewer.group(1)), bpl, 512)
        assert not _fits(gpu, ranks, int(fewer.group(1)) + 1, bpl, 512)
    smaller = re.search(r"threads<=(\d+)", text)
    if smaller:
        assert size_launch(gpu, lanes=lanes, ranks=ranks, want=1, blocks_per_lane=bpl,
                           threads=int(smaller.group(1)))[0] == bpl
    assert text.endswith("or fewer virtual ranks")


def test_an_explicit_fused_overflow_names_what_fits():
    gpu = Gpu(0, 132)
    with pytest.raises(CapabilityError, match=r"at most 33 blocks per lane fit: pass "
                                              r"blocks_per_lane<=33"):
        fused_launch(gpu, 1 << 20, 4, blocks=64, threads=512)
    assert fused_launch(gpu, 1 << 20, 4, blocks=33, threads=512) == (33, 512)
    with pytest.raises(CapabilityError, match="at most 256 blocks per rank"):
        fused_launch(gpu, 1 << 20, 1, blocks=300)


def test_explicit_threads_are_kept_and_blocks_cut_to_them():
    gpu = Gpu(0, 132)
    assert size_launch(gpu, lanes=1, ranks=4, want=64, threads=256) == (64, 256)
    assert size_launch(gpu, lanes=1, ranks=8, want=64, threads=128) == (64, 128)
    with pytest.raises(CapabilityError, match="not even one block per lane fits: plan with "
                                              "lanes<=16"):
        size_launch(gpu, lanes=32, ranks=8, want=1, threads=512)


@pytest.mark.parametrize("gpu, source", [
    ("NVIDIA A100-SXM4-80GB", "fast path"), ("NVIDIA H200", "table NVIDIA H200 virtual"),
    ("NVIDIA H100 80GB HBM3", "table NVIDIA H100 80GB HBM3 virtual")])
def test_auto_picks_the_fused_kernel_on_a_virtual_cluster(gpu, source):
    """With no table for the GPU the fast path, with the H200's table its virtual-rank
    entries: auto takes the fused kernel at 8 KiB and 64 KiB, LL included, and its plan
    fuses."""
    for name in STANDARD:
        coll = standard(name, 4)
        for nbytes in (8 << 10, 64 << 10):
            sizing = _sized(coll, nbytes)
            choice = select(coll, Virtual(4), chunk_sizes=dict(sizing.chunks),
                            dtype="bfloat16", gpu=gpu)
            assert choice.protocol.startswith("fused"), (name, nbytes, choice)
            tuned = name not in ("gather", "scatter")  # purlin tune measures the other six
            assert choice.lanes == 1, choice
            assert source in choice.source or not tuned and "fast path" in choice.source, choice
            schedule = plan(coll, choice.strategy, sizing=sizing, chunks=choice.chunks,
                            lanes=choice.lanes)
            assert fused_problems(schedule)[choice.protocol] is None
    coll = standard("all-reduce", 4)
    assert select(coll, Virtual(4), nbytes=8 << 10, dtype="bfloat16",
                  gpu=gpu).protocol == "fused-ll"


def test_auto_picks_a_fused_plan_that_runs_for_uneven_sizes_and_fp8_sums():
    """Sizes whose rows do not all start aligned (uneven chunks) and FP8 sums: auto's choice
    is the fused kernel with a plan it runs (odd-aligned pieces and FP8 sums on the narrow
    builds)."""
    for name in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all"):
        coll = standard(name, 4)
        names = coll.input.names()
        for each, dtype in ((1, "bfloat16"), (3, "bfloat16"), (4097, "bfloat16"),
                            (4097, "float8_e4m3fn")):
            sizes = {k: each + i % 2 for i, k in enumerate(names)}
            choice = select(coll, Virtual(4), chunk_sizes=sizes, dtype=dtype,
                            gpu="NVIDIA H200")
            schedule = plan(coll, choice.strategy, sizing=coll.sized(chunk_sizes=sizes,
                                                                     dtype=dtype),
                            chunks=choice.chunks, lanes=choice.lanes)
            assert choice.protocol.startswith("fused"), (name, each, dtype, choice)
            assert fused_problems(schedule)[choice.protocol] is None, (name, each, choice)


def test_tables_are_keyed_by_virtual_or_real_ranks(tmp_path):
    entry = {"collective": "all-reduce", "nbytes": 8192, "strategy": "ring", "chunks": 1,
             "lanes": 2, "blocks_per_lane": 4}
    table = TuningTable("Made-up GPU", {2: [entry]})
    coll = standard("all-reduce", 2)

    class Local(Virtual):
        kind = "local"

    assert select(coll, Local(2), nbytes=8192, table=table).strategy == "ring"
    assert "fast path" in select(coll, Virtual(2), nbytes=8192, table=table).source
    table.add(2, {**entry, "strategy": "direct-pull", "lanes": 1}, virtual=True)
    table = TuningTable.from_json(table.to_json())
    assert select(coll, Virtual(2), nbytes=8192, table=table).source == \
        "table Made-up GPU virtual @ 8192 B"
    assert select(coll, Virtual(2), nbytes=8192, table=table).strategy == "direct-pull"
    assert select(coll, Local(2), nbytes=8192, table=table).strategy == "ring"


def test_a_tables_fused_choice_at_an_odd_size_runs_on_the_interpreter():
    entry = {"collective": "all-reduce", "nbytes": 8192, "strategy": "direct-push",
             "chunks": 1, "lanes": 1, "blocks_per_lane": 8, "protocol": "fused-ll",
             "pdl": True}
    table = TuningTable("Made-up GPU", {2: [entry]})
    coll = standard("all-reduce", 2)

    class Local(Virtual):
        kind = "local"

    whole = select(coll, Local(2), count=4096, dtype="bfloat16", table=table)
    assert whole.protocol == "fused-ll" and whole.blocks_per_lane == 8
    sizes = {k: 2049 + i for i, k in enumerate(coll.input.names())}
    sizing = coll.sized(chunk_sizes=sizes, dtype="bfloat16")
    if fused_problems(plan(coll, "direct-push", sizing=sizing))["fused-ll"] is not None:
        odd = select(coll, Local(2), chunk_sizes=sizes, dtype="bfloat16", table=table)
        assert odd.protocol == "ll" and odd.blocks_per_lane is None


def test_auto_options_make_a_tables_blocks_a_wish():
    from purlin.runtime.auto import Choice
    from purlin.runtime.cluster import _auto_options

    choice = Choice("direct-push", 1, 1, 132, "table", "fused", False)
    assert _auto_options(choice, {}, sm=True)["fit"] is True
    assert "fit" not in _auto_options(choice, {"blocks_per_lane": 8}, sm=True)
