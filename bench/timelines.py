"""Measured vs predicted SNAC timelines on 2 GPUs (the figures of docs/timelines/), and the
fused kernel's measured timelines and tracing overhead on one GPU.

    python3 bench/timelines.py [--out outputs/timelines]
    python3 bench/timelines.py --fused [--out outputs/timelines]

1. measures the offset between the GPUs' clocks with a flag ping-pong (and its uncertainty);
2. times a few all-reduce schedules under CUDA graphs and calibrates the cost model on them;
3. traces one 1 MiB bf16 all-reduce for two strategies and writes predicted-vs-measured
   figures (HTML) and Perfetto traces into DIR; prints how close prediction and measurement are.

Writes DIR/timeline.json, the calibrated profile DIR/profile-h200-calibrated.json, the figures
and the traces.

``--fused`` (one GPU, 4 virtual ranks): an all-reduce and a custom layout (every rank gathers
the pieces in reverse rank order) at 8 KiB, 64 KiB and 1 MiB bf16 on the fused kernel (the
one the benchmarks time), timed under CUDA graphs untraced and traced; prints the table,
writes DIR/fused-timelines.json and each traced call's measured timeline
(DIR/fused-<layout>-<size>.html, Perfetto traces beside them).
"""

from __future__ import annotations

import argparse
import json
import sys

from purlin.bench.scripts import folder, gpu_env, missing_gpus

KiB, MiB = 1 << 10, 1 << 20
# (chunks, lanes); blocks per lane: the binding's default (~16 KiB of message per block, up to
# every SM), so that the links, not a handful of blocks, bound the large sizes the model fits
STRATEGIES = {"direct-push": (1, 2), "two-phase": (1, 2)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="outputs/timelines", help="folder (default "
                    "outputs/timelines)")
    ap.add_argument("--fused", action="store_true",
                    help="the fused kernel's timelines and tracing overhead on one GPU")
    args = ap.parse_args()
    if args.fused:
        return fused_timelines(args.out)
    why = missing_gpus(2, "bench/timelines.py")
    if why:
        print(why, file=sys.stderr)
        return 2
    out = folder(args.out)
    gpu_env()

    import numpy as np
    import torch

    from purlin.atom.sm import clock_pair
    from purlin.bench.providers import time_graph
    from purlin.runtime import Cluster
    from purlin.spec import collectives
    from purlin.trace import (calibrate, from_sm, get_profile, measure_clocks, predict,
                              to_perfetto)
    from purlin.viz import compare_figure, to_html

    cluster = Cluster.local(2)
    clocks = measure_clocks(lambda a, b: clock_pair(a, b, 64), [0, 1])
    offset, uncertainty = clocks.offset_ns(1), clocks.uncertainty_ns(1)
    print(f"clock offset GPU1-GPU0: {offset:.0f} ns +- {uncertainty:.0f} ns")
    coll = collectives.all_reduce(2)

    measurements, rows = [], []
    for strategy, (chunks, lanes) in STRATEGIES.items():
        for nbytes in (8 * KiB, 64 * KiB, 1 * MiB, 16 * MiB):
            bound = cluster.bind(coll, strategy, nbytes=nbytes, dtype="bfloat16",
                                 chunks=chunks, lanes=lanes)
            per_op = float(np.median(time_graph(torch, bound, 20, 10)))
            measurements.append((bound.schedule, per_op * 1e3))
            rows.append({"strategy": strategy, "nbytes": nbytes, "graph_us": per_op})
            del bound
    base = get_profile("H200-measured")
    profile = calibrate(measurements, base=base, fit=("alpha_ns", "link_bandwidth",
                                                      "launch_ns"),
                        name="H200-calibrated", path=out / "profile-h200-calibrated.json")
    for row, (schedule, ns) in zip(rows, measurements):
        row["predicted_base_us"] = predict(schedule, base).end_ns / 1e3
        row["predicted_calibrated_us"] = predict(schedule, profile).end_ns / 1e3
    print(f"calibrated: alpha {profile.alpha_ns:.0f} ns, link {profile.link_bandwidth / 1e9:.0f} "
          f"GB/s, launch {profile.launch_ns:.0f} ns")
    print(f"{'strategy':>12} {'bytes':>9} {'graph us':>9} {'pred(base)':>10} {'pred(cal)':>10} "
          f"{'cal err':>8}")
    for r in rows:
        r["calibrated_error"] = r["predicted_calibrated_us"] / r["graph_us"] - 1
        print(f"{r['strategy']:>12} {r['nbytes']:>9} {r['graph_us']:9.2f} "
              f"{r['predicted_base_us']:10.2f} {r['predicted_calibrated_us']:10.2f} "
              f"{r['calibrated_error']:+8.1%}")

    floor = launch_floor(torch)
    print(f"empty executor launch under a CUDA graph: {floor:.2f} us per op")

    # what tracing costs: the same bindings timed with the trace buffer off and on (if even
    # tracing on is within the noise, the branch that tracing off leaves costs nothing)
    overhead = []
    for nbytes in (8 * KiB, 1 * MiB):
        row = {"nbytes": nbytes}
        for label, rows_ in (("off", 0), ("on", 64)):
            bound = cluster.bind(coll, "direct-push", nbytes=nbytes, dtype="bfloat16",
                                 trace_rows=rows_)
            times = time_graph(torch, bound, 50, 15)
            row[f"trace_{label}_us"] = float(np.median(times))
            row[f"trace_{label}_p20_p80"] = [float(np.percentile(times, 20)),
                                             float(np.percentile(times, 80))]
            del bound
        overhead.append(row)
        print(f"tracing {nbytes:>8} B: off {row['trace_off_us']:.2f} us "
              f"(p20-p80 {row['trace_off_p20_p80'][0]:.2f}-{row['trace_off_p20_p80'][1]:.2f}), "
              f"on {row['trace_on_us']:.2f} us "
              f"(p20-p80 {row['trace_on_p20_p80'][0]:.2f}-{row['trace_on_p20_p80'][1]:.2f})")
    small = cluster.bind(coll, "direct-push", nbytes=8 * KiB, dtype="bfloat16",
                         blocks_per_lane=1, trace_rows=16)
    for _ in range(50):
        small.launch()
    small.check()
    t8 = from_sm(small, clocks)
    print("8 KiB direct-push, one eager call, per event (rank, lane, kind, step, start, us):")
    for e in sorted(t8.events, key=lambda e: (e.rank, e.start_ns)):
        print(f"  r{e.rank} l{e.lane} {e.kind:>8} step {e.step:>2} "
              f"{(e.start_ns - t8.start_ns) / 1e3:7.2f} {(e.end_ns - e.start_ns) / 1e3:6.2f}")

    traced = []
    for strategy, (chunks, lanes) in STRATEGIES.items():
        bound = cluster.bind(coll, strategy, nbytes=1 * MiB, dtype="bfloat16", chunks=chunks,
                             lanes=lanes, trace_rows=64)
        for _ in range(20):
            bound.launch()
        bound.check()
        # the GPUs' clocks drift apart by microseconds per second: measure the offset right
        # after the traced call, not once at the start
        now = measure_clocks(lambda a, b: clock_pair(a, b, 64), [0, 1])
        print(f"clock offset now: {now.offset_ns(1):.0f} ns +- {now.uncertainty_ns(1):.0f} ns "
              f"(drift since the start {now.offset_ns(1) - offset:+.0f} ns)")
        measured = from_sm(bound, now)
        predicted = predict(bound.schedule, profile)
        problems = measured.check(tolerance_ns=2 * now.uncertainty_ns(1) + 1000)
        fig = compare_figure(predicted, measured,
                             title=f"all-reduce 1 MiB bf16, {strategy}, 2 x H200")
        html = to_html(fig, out / f"timeline-allreduce-1MiB-{strategy}.html")
        to_perfetto(measured, out / f"perfetto-allreduce-1MiB-{strategy}.json")
        traced.append({"strategy": strategy, "blocks_per_lane": bound.blocks_per_lane,
                       "clock_offset_ns": now.offset_ns(1),
                       "clock_uncertainty_ns": now.uncertainty_ns(1),
                       "measured_us": measured.duration_ns / 1e3,
                       "predicted_us": predicted.end_ns / 1e3, "events": len(measured.events),
                       "consistency_problems": [str(p) for p in problems][:5],
                       "html": html.name})
        print(f"traced {strategy}: measured {measured.duration_ns / 1e3:.2f} us, predicted "
              f"{predicted.end_ns / 1e3:.2f} us (launch included), {len(measured.events)} events, "
              f"{len(problems)} consistency problems")
    (out / "timeline.json").write_text(json.dumps({
        "clock": {"offset_ns": offset, "uncertainty_ns": uncertainty},
        "profile": json.loads((out / "profile-h200-calibrated.json").read_text()),
        "graph_vs_predicted": rows, "traced": traced, "empty_launch_graph_us": floor,
        "tracing_overhead": overhead,
        "events_8KiB": [e.__dict__ if hasattr(e, "__dict__") else str(e) for e in t8.events]},
        indent=1, default=str))
    return 0


FUSED_SIZES = (8 * KiB, 64 * KiB, 1 * MiB)


def fused_layouts(n: int = 4):
    """(file stem, collective): an all-reduce and a rank-reversed all-gather."""
    from purlin.spec import Collective, collectives

    rev = Collective([[r] for r in range(n)], [list(range(n - 1, -1, -1))] * n, "copy",
                     name="reversed all-gather")
    return [("allreduce", collectives.all_reduce(n)), ("reversed-allgather", rev)]


def fused_timelines(out_dir, ops: int = 50, repeats: int = 15) -> int:
    """The ``--fused`` mode (the module's notes): returns the exit status."""
    from purlin.bench.clusters import gpu_count

    if gpu_count() < 1:
        print("bench/timelines.py --fused needs a GPU; none is visible", file=sys.stderr)
        return 2
    out = folder(out_dir)
    gpu_env()

    import numpy as np
    import torch

    from purlin.bench.providers import time_graph
    from purlin.runtime import Cluster
    from purlin.trace import from_sm, to_perfetto
    from purlin.viz import timeline_figure, to_html

    cluster = Cluster.virtual(4)
    rows = []
    for stem, coll in fused_layouts(cluster.nranks):
        for nbytes in FUSED_SIZES:
            row = {"layout": coll.name, "nbytes": nbytes}
            for label, trace_rows in (("off", 0), ("on", 64)):  # no protocol: the fast path
                bound = cluster.bind(coll, "direct-push", nbytes=nbytes, dtype="bfloat16",
                                     trace_rows=trace_rows)
                row["protocol"], row["pdl"] = bound.protocol, bound.pdl
                times = time_graph(torch, bound, ops, repeats)
                row[f"trace_{label}_us"] = float(np.median(times))
                row[f"trace_{label}_p20_p80"] = [float(np.percentile(times, 20)),
                                                 float(np.percentile(times, 80))]
                row["kernel"], row["blocks_per_rank"] = bound.kernel, bound.blocks_per_lane
                if trace_rows:  # the records of the last replayed call
                    measured = from_sm(bound)
                    size = f"{nbytes // MiB}MiB" if nbytes >= MiB else f"{nbytes // KiB}KiB"
                    title = (f"{coll.name} {size} bf16, 4 virtual ranks on one GPU: "
                             f"{bound.kernel}, measured")
                    html = to_html(timeline_figure(measured, title=title),
                                   out / f"fused-{stem}-{size}.html")
                    to_perfetto(measured, out / f"fused-{stem}-{size}.json")
                    row.update(html=html.name, events=len(measured.events),
                               measured_us=measured.duration_ns / 1e3,
                               consistency_problems=[str(p) for p in measured.check()][:5])
                del bound
            row["overhead_us"] = row["trace_on_us"] - row["trace_off_us"]
            row["overhead"] = row["trace_on_us"] / row["trace_off_us"] - 1
            rows.append(row)
    print(f"{'layout':>20} {'bytes':>8} {'kernel':>16} {'off us':>8} {'on us':>8} "
          f"{'overhead':>9} {'events':>6} {'traced us':>9}")
    for r in rows:
        print(f"{r['layout']:>20} {r['nbytes']:>8} {r['kernel']:>16} {r['trace_off_us']:8.2f} "
              f"{r['trace_on_us']:8.2f} {r['overhead_us']:+6.2f} us {r['events']:>6} "
              f"{r['measured_us']:9.2f}")
    print(f"(median of {repeats} CUDA-graph replays of {ops} calls each; 'traced us': the last "
          "traced call's first start to last end)")
    (out / "fused-timelines.json").write_text(json.dumps(
        {"cluster": "4 virtual ranks on GPU 0", "dtype": "bfloat16", "ops_per_graph": ops,
         "repeats": repeats, "rows": rows}, indent=1))
    print(f"wrote {(out / 'fused-timelines.json').resolve()} and {len(rows)} timelines")
    return 0


def launch_floor(torch, ops: int = 50) -> float:
    """Per-op time of executor launches with no rows (launch + epoch bookkeeping only)."""
    from purlin.kernels import isa
    from purlin.kernels.launch import Launcher

    ctl = torch.zeros(2 + isa.ERR_WIDTH, dtype=torch.int64, device="cuda:0")
    abort = torch.zeros(1, dtype=torch.int64, device="cuda:0")
    desc = [0] * isa.DESC_WIDTH
    desc[isa.D_EPOCH], desc[isa.D_DONE] = ctl.data_ptr(), ctl.data_ptr() + 8
    desc[isa.D_ERROR], desc[isa.D_ABORT] = ctl.data_ptr() + 16, abort.data_ptr()
    table = torch.tensor([desc], dtype=torch.int64, device="cuda:0")
    launcher = Launcher(device=0, nranks_in_launch=1, nlanes=1, blocks_per_lane=1, threads=512)
    stream = torch.cuda.Stream(device=0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(ops):
            launcher(table.data_ptr(), stream.cuda_stream, 10**9)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / ops)
    return sorted(times)[len(times) // 2]


if __name__ == "__main__":
    sys.exit(main())
