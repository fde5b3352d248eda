"""nccl-tests' conventions: bus-bandwidth factors, the table's columns, counts per size."""

import math

import pytest

from purlin.bench.metrics import (Record, Timing, algbw_gbs, bus_factor, nccl_table, op_counts,
                                  vs_baseline)


@pytest.mark.parametrize("collective, n, factor", [
    ("all-reduce", 2, 1.0), ("all-reduce", 8, 1.75), ("all-gather", 2, 0.5),
    ("all-gather", 8, 0.875), ("reduce-scatter", 4, 0.75), ("all-to-all", 8, 0.875),
    ("broadcast", 8, 1.0), ("reduce", 8, 1.0), ("my-custom", 4, 1.0)])
def test_bus_factors_follow_nccl_tests(collective, n, factor):
    assert bus_factor(collective, n) == pytest.approx(factor)


def _rec(provider="nccl", collective="all-reduce", n=8, nbytes=1 << 30, us=10_000.0, wrong=0,
         mode="graph", **extra):
    return Record.make(provider, collective, n, nbytes, nbytes // 2, "bfloat16", "sum", mode,
                       Timing(us, us, us, 3), wrong, **extra)


def test_record_bandwidths():
    r = _rec()
    assert r.algbw_gbs == pytest.approx(algbw_gbs(1 << 30, 10_000.0)) == pytest.approx(107.374,
                                                                                         rel=1e-4)
    assert r.busbw_gbs == pytest.approx(r.algbw_gbs * 1.75)
    assert Record.from_dict(r.to_dict()) == r


def test_table_has_nccl_tests_columns_and_values():
    recs = [_rec(nbytes=s, us=u) for s, u in ((1024, 5.0), (1 << 30, 10_000.0))]
    recs.append(_rec(provider="purlin:auto", nbytes=1024, us=4.0, strategy="direct-push",
                     chunks=1, lanes=1, blocks_per_lane=2))
    text = nccl_table(recs)
    lines = text.splitlines()
    assert lines[0].startswith("# all-reduce | nccl | 8 ranks | bfloat16 | graph")
    assert lines[1].split()[1:] == ["size", "count", "type", "redop", "root", "time", "algbw",
                                    "busbw", "#wrong"]
    row = lines[4].split()
    assert row == ["1073741824", "536870912", "bfloat16", "sum", "-1", "10000", "107.37",
                   "187.90", "0"]
    assert "# Avg bus bandwidth" in text
    assert "direct-push c1 l1 b2" in text  # Purlin's configuration at the end of its line


def test_table_marks_roots_unchecked_and_failed_points():
    nan = float("nan")
    recs = [_rec(collective="broadcast", n=2, nbytes=64),
            _rec(provider="purlin:ring", n=2, nbytes=64, wrong=-1, mode="model"),
            Record.make("nccl", "reduce", 2, 64, 0, "bfloat16", "sum", "graph",
                        Timing(nan, nan, nan, 0), -1, error="RuntimeError: boom")]
    text = nccl_table(recs)
    bcast = [ln for ln in text.splitlines() if ln.strip().startswith("64")]
    assert bcast[0].split()[4] == "0"  # root of broadcast
    assert bcast[1].split()[8] == "N/A"  # the model checks nothing
    assert "n/a" in bcast[2] and "error: RuntimeError: boom" in bcast[2]


def test_op_counts_shrink_with_size_but_never_vanish():
    assert op_counts(8, 50, 20) == (50, 20)
    assert op_counts(4 << 20, 50, 20) == (50, 20)
    ops, reps = op_counts(1 << 30, 50, 20)
    assert ops >= 2 and reps >= 3 and ops * reps < 50 * 20 / 50


def test_vs_baseline_pairs_same_points_only():
    recs = [_rec(us=10.0), _rec(provider="purlin:auto", us=5.0),
            _rec(provider="purlin:auto", us=5.0, nbytes=2048)]
    rows = vs_baseline(recs)
    assert len(rows) == 1 and rows[0]["ratio"] == 2.0 and not math.isnan(rows[0]["ratio"])
