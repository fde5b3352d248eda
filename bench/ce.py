"""The copy-engine datapath table on 2 GPUs: correctness, bandwidth against sm and NCCL,
matmul overlap.

    python3 bench/ce.py [--out outputs/ce.json] [--quick]

1. Correct: all-gather, all-to-all and broadcast on the ce datapath and all-reduce on ce+sm equal
   the reference from 16 B to 1 GiB (all-gather up to 1 GiB), over back-to-back eager calls with
   fresh inputs and over CUDA-graph replays (one lane).
2. Overlap: a bf16 matmul on a side stream of each GPU, alone and next to a 256 MiB all-gather
   loop on the sm and on the ce datapath: how much the collective slows the matmul.
3. Bus bandwidth at 64 MiB and 256 MiB: ce against sm (strategy "auto") and NCCL, one table;
   ce with one lane first, then with four lanes (chained one after another inside graphs).

Prints tables and rewrites the JSON file after every section (a later hang keeps the rest).
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback

from purlin.bench.scripts import gpu_env, missing_gpus, output, write_json
from purlin.bench.sweep import environment

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
DTYPE = "bfloat16"
COLLECTIVES = ("all-gather", "all-to-all", "broadcast", "all-reduce")
CORRECT_SIZES = [16, 4 * KiB, 1 * MiB, 64 * MiB, 256 * MiB]
BIG_SIZES = [64 * MiB, 256 * MiB]
# ce configurations tried for bandwidth: (strategy, chunks, lanes)
# (pulls read the peer's input straight into the output: one copy engine transfer per piece;
# pushes land in the peer's scratch, which the peer then copies into its output)
COPY_CONFIGS = [("direct-pull", 1, 1), ("direct-pull", 4, 4), ("direct-push", 4, 4)]
CE_CONFIGS = {"all-gather": COPY_CONFIGS, "all-to-all": COPY_CONFIGS, "broadcast": COPY_CONFIGS,
              "all-reduce": [("two-phase", 1, 1), ("two-phase", 4, 4), ("direct-push", 4, 4)]}
SM_FALLBACK = ("direct-push", 16, 16, 8)


def collective(name):
    from purlin.spec import standard

    return standard(name, 2)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="JSON file or folder (default outputs/)")
    ap.add_argument("--quick", action="store_true", help="fewer sizes and configurations")
    ap.add_argument("--no-baselines", action="store_true")
    ap.add_argument("--sizes", default=None,
                    help="correctness sizes for every collective (default 16 B..256 MiB, and "
                         "1 GiB for all-gather), e.g. 1GiB")
    ap.add_argument("--correct-only", action="store_true",
                    help="only part 1 (correctness); no overlap or bandwidth")
    args = ap.parse_args()
    why = missing_gpus(2, "bench/ce.py")
    if why:
        print(why, file=sys.stderr)
        return 2
    args.out = output(args.out, "ce.json")
    gpu_env()
    t_start = time.time()
    result = {"info": {}, "correct": [], "bandwidth": [], "overlap": [], "failures": []}

    baselines = []
    if args.correct_only:
        args.no_baselines = True
    if not args.no_baselines:  # first, before this process holds GPU memory
        from purlin.bench.torch_dist import run_baselines

        points = [("nccl", c, s, DTYPE, "sum", "graph") for c in COLLECTIVES for s in BIG_SIZES]
        try:
            baselines = run_baselines(points, world=2, ops=20, repeats=10)
        except Exception:
            result["failures"].append({"what": "nccl baselines",
                                       "error": traceback.format_exc(limit=4)})
    import torch

    from purlin.atom import ce_driver
    from purlin.runtime import Cluster

    cluster = Cluster.local(2)
    result["info"] = {
        **environment("sm", 2), "driver_support": ce_driver.device_support(0),
        "CUDA_DEVICE_MAX_CONNECTIONS": ce_driver.max_connections()}
    print(f"# {result['info']['hardware']}, commit {result['info']['commit'][:12]}", flush=True)

    print("\n== 1. correctness (ce; all-reduce ce+sm)", flush=True)
    sizes = [16, 1 * MiB, 64 * MiB] if args.quick else CORRECT_SIZES
    if args.sizes:
        from purlin.cli import size_list

        sizes = size_list(args.sizes)
    for name in COLLECTIVES:
        for nbytes in sizes + ([1 * GiB] if name == "all-gather" and not args.sizes else []):
            strategy, chunks, lanes = CE_CONFIGS[name][0]
            result["correct"].append(_correct(torch, cluster, name, nbytes, strategy, chunks,
                                              lanes, result["failures"]))
            torch.cuda.empty_cache()

    _save(args.out, result, [])
    if args.correct_only:
        return 0 if all(c.get("wrong") == 0 for c in result["correct"]) else 1
    print("\n== 2. matmul slowdown next to a 256 MiB all-gather loop", flush=True)
    try:
        result["overlap"] = _overlap(torch, cluster, quick=args.quick)
    except Exception:
        result["failures"].append({"what": "overlap", "error": traceback.format_exc(limit=6)})
    for row in result["overlap"]:
        print(f"  {row['datapath']:>6}: matmul {row['matmul_ms']:8.3f} ms "
              f"({row['slowdown']:5.3f}x alone)  all-gather {row['allgather_us']:9.1f} us/op "
              f"({row['allgather_busbw_gbs']:6.1f} GB/s)", flush=True)

    _save(args.out, result, [])
    print("\n== 3. bus bandwidth at >= 64 MiB (graph replays)", flush=True)
    records = list(baselines)
    sizes = [256 * MiB] if args.quick else BIG_SIZES
    for name in COLLECTIVES:          # one lane first (the configuration checked above) and sm
        for nbytes in sizes:
            strategy, chunks, lanes = CE_CONFIGS[name][0]
            records += _attempt(result["failures"], f"ce {name} {nbytes}", _time_ce, cluster,
                                name, nbytes, strategy, chunks, lanes)
            records += _attempt(result["failures"], f"sm {name} {nbytes}", _time_sm, cluster,
                                name, nbytes)
            torch.cuda.empty_cache()
        _save(args.out, result, records)
    for name in ([] if args.quick else COLLECTIVES):   # then several lanes
        for nbytes in sizes:
            for strategy, chunks, lanes in CE_CONFIGS[name][1:]:
                records += _attempt(result["failures"], f"ce {name} {nbytes}", _time_ce,
                                    cluster, name, nbytes, strategy, chunks, lanes)
            torch.cuda.empty_cache()
        _save(args.out, result, records)
    print(_bandwidth_table(records), flush=True)

    print("\n== predicted timeline (cost model, engines labelled): all-reduce ce+sm, 1 MiB")
    result["predicted"] = _predicted()
    result["info"]["seconds"] = round(time.time() - t_start, 1)
    print(f"\n{len(result['failures'])} failure(s); {result['info']['seconds']} s", flush=True)
    for f in result["failures"]:
        print(f"--- {f['what']}\n{f['error']}")
    _save(args.out, result, records)
    ok = all(c.get("wrong") == 0 for c in result["correct"]) and not result["failures"]
    return 0 if ok else 1


def _save(path, result, records) -> None:
    """Write what there is so far (a later hang still leaves the earlier results)."""
    result["bandwidth"] = [r.to_dict() for r in records]
    write_json(path, result)


def _attempt(failures, what, fn, *args):
    try:
        return [fn(*args)]
    except Exception:
        failures.append({"what": what, "error": traceback.format_exc(limit=6)})
        print(f"  {what}: FAILED\n{failures[-1]['error']}", flush=True)
        return []


# -- 1. correctness -----------------------------------------------------------------------------
def _correct(torch, cluster, name, nbytes, strategy, chunks, lanes, failures) -> dict:
    from purlin.bench.providers import count_wrong, reference_on_gpu
    from purlin.spec.sizing import fit_nbytes

    coll = collective(name)
    row = {"collective": name, "nbytes": nbytes, "strategy": strategy, "chunks": chunks,
           "lanes": lanes}
    try:
        sizing = coll.sized(nbytes=fit_nbytes(coll, nbytes, DTYPE), dtype=DTYPE)
        bound = cluster.bind(coll, strategy, sizing=sizing, chunks=chunks, lanes=lanes,
                             datapath="ce")
        row["message_bytes"] = sizing.message_bytes
        row["engines"] = sorted({e for r in bound.engines for e in r})
        # three eager calls, fresh inputs each: counters rebase between calls
        row["wrong_eager"] = [count_wrong(torch, bound) for _ in range(3)]
        # graph replays: 4 calls per graph, replayed 3 times, then compared
        graphs = bound.capture(4)
        for _ in range(3):
            graphs.replay()
        bound.check()
        inputs = [bound.inputs[r][: sizing.input_count(r)] for r in range(2)]
        expect = reference_on_gpu(torch, sizing, inputs)
        wrong = 0
        for r, e in enumerate(expect):
            got = bound.outputs[r][: sizing.output_count(r)].float()
            wrong += int((torch.abs(got - e) > 2e-2 * (1 + torch.abs(e))).sum().item())
        row["wrong_graph"] = wrong
        row["wrong"] = sum(row["wrong_eager"]) + wrong
        row["calls"] = bound.calls
        del graphs, bound
    except Exception:
        failures.append({"what": f"correct {name} {nbytes}",
                         "error": traceback.format_exc(limit=6)})
        print(failures[-1]["error"], flush=True)
        row["wrong"] = -1
    print(f"  {name:>11} {nbytes:>11} B {strategy:>11} c{chunks} l{lanes}: "
          f"engines {row.get('engines')} wrong eager {row.get('wrong_eager')} "
          f"graph {row.get('wrong_graph')}", flush=True)
    return row


# -- 2. bandwidth -------------------------------------------------------------------------------
def _time_ce(cluster, name, nbytes, strategy, chunks, lanes):
    from purlin.bench.ce import time_ce

    rec = time_ce(cluster, collective(name), nbytes, DTYPE, strategy, chunks, lanes,
                  mode="graph", ops=20, repeats=10)
    rec.extra["config"] = f"{strategy} c{chunks} l{lanes}"
    print(f"  ce {name:>11} {nbytes:>11} {rec.extra['config']:>22}: {rec.time_us:9.1f} us "
          f"busbw {rec.busbw_gbs:6.1f} GB/s wrong {rec.wrong}", flush=True)
    return rec


def _time_sm(cluster, name, nbytes):
    from purlin.bench.providers import time_purlin

    try:
        rec = time_purlin(cluster, collective(name), nbytes, DTYPE, "auto", mode="graph",
                          ops=20, repeats=10, provider="purlin-sm:auto")
    except Exception:
        strategy, chunks, lanes, bpl = SM_FALLBACK
        rec = time_purlin(cluster, collective(name), nbytes, DTYPE, strategy, chunks, lanes,
                          bpl, mode="graph", ops=20, repeats=10,
                          provider=f"purlin-sm:{strategy}")
    rec.extra["datapath"] = "sm"
    print(f"  sm {name:>11} {nbytes:>11} {rec.provider:>22}: {rec.time_us:9.1f} us "
          f"busbw {rec.busbw_gbs:6.1f} GB/s wrong {rec.wrong}", flush=True)
    return rec


def _bandwidth_table(records) -> str:
    lines = [f"{'collective':>11} {'size':>10} {'ce busbw':>9} {'ce config':>22} "
             f"{'sm busbw':>9} {'nccl busbw':>10} {'ce/sm':>6} {'ce/nccl':>7}"]
    for name in COLLECTIVES:
        for nbytes in BIG_SIZES:
            pick = [r for r in records if r.collective == name and r.nbytes == nbytes
                    and r.mode == "graph"]
            ce = [r for r in pick if r.extra.get("datapath") == "ce" and r.wrong == 0]
            sm = [r for r in pick if r.extra.get("datapath") == "sm" and r.wrong == 0]
            nccl = [r for r in pick if r.provider == "nccl"]
            if not (ce or sm or nccl):
                continue
            best_ce = max(ce, key=lambda r: r.busbw_gbs) if ce else None
            bw = [best_ce.busbw_gbs if best_ce else float("nan"),
                  max((r.busbw_gbs for r in sm), default=float("nan")),
                  nccl[0].busbw_gbs if nccl else float("nan")]
            cfg = best_ce.extra.get("config", "") if best_ce else ""
            lines.append(f"{name:>11} {nbytes >> 20:>7}MiB {bw[0]:9.1f} {cfg:>22} {bw[1]:9.1f} "
                         f"{bw[2]:10.1f} {bw[0] / bw[1]:6.2f} {bw[0] / bw[2]:7.2f}")
    return "\n".join(lines)


# -- 3. overlap ---------------------------------------------------------------------------------
def _overlap(torch, cluster, quick=False) -> list:
    """Matmul time on a side stream of both GPUs, alone and next to an all-gather loop."""
    from purlin.spec.sizing import fit_nbytes

    n_mm = 8192
    reps = 10 if quick else 20
    mats = {d: (torch.randn(n_mm, n_mm, device=f"cuda:{d}", dtype=torch.bfloat16),
                torch.randn(n_mm, n_mm, device=f"cuda:{d}", dtype=torch.bfloat16))
            for d in range(2)}
    side = {d: torch.cuda.Stream(device=d, priority=0) for d in range(2)}

    def matmuls():
        events = {}
        for d in range(2):
            with torch.cuda.device(d), torch.cuda.stream(side[d]):
                start, end = (torch.cuda.Event(enable_timing=True),
                              torch.cuda.Event(enable_timing=True))
                start.record()
                a, b = mats[d]
                for _ in range(reps):
                    torch.mm(a, b)
                end.record()
                events[d] = (start, end)
        return events

    def elapsed(events):
        for d in range(2):
            events[d][1].synchronize()
        return max(events[d][0].elapsed_time(events[d][1]) for d in range(2)) / reps

    matmuls()
    torch.cuda.synchronize(0), torch.cuda.synchronize(1)
    alone = min(elapsed(matmuls()) for _ in range(3))
    rows = [{"datapath": "none", "matmul_ms": alone, "slowdown": 1.0, "allgather_us": 0.0,
             "allgather_busbw_gbs": 0.0}]
    coll = collective("all-gather")
    sizing = coll.sized(nbytes=fit_nbytes(coll, 256 * MiB, DTYPE), dtype=DTYPE)
    for datapath, kw in (("sm", dict(strategy="direct-push", chunks=16, lanes=16,
                                     blocks_per_lane=8)),
                         ("ce", dict(strategy="direct-pull", chunks=1, lanes=1))):
        strategy = kw.pop("strategy")
        bound = cluster.bind(coll, strategy, sizing=sizing, datapath=datapath, **kw)
        ops = 4
        graphs = bound.capture(ops)
        graphs.replay()
        bound.check()
        # how long one graph takes alone, to cover the matmuls with enough replays
        t0 = time.perf_counter()
        for _ in range(3):
            graphs.replay()
        bound.synchronize()
        per_graph = (time.perf_counter() - t0) / 3
        replays = int(alone * reps / 1e3 / per_graph) + 2
        coll_events = {}
        for d in range(2):
            with torch.cuda.device(d):
                coll_events[d] = (torch.cuda.Event(enable_timing=True),
                                  torch.cuda.Event(enable_timing=True))
                coll_events[d][0].record()
        mm = matmuls()
        for _ in range(replays):
            graphs.replay()
        for d in range(2):
            with torch.cuda.device(d):
                coll_events[d][1].record()
        with_coll = elapsed(mm)
        bound.synchronize()
        bound.check()
        coll_us = max(coll_events[d][0].elapsed_time(coll_events[d][1])
                      for d in range(2)) * 1e3 / (replays * ops)
        from purlin.bench.metrics import algbw_gbs, bus_factor

        rows.append({"datapath": datapath, "matmul_ms": with_coll,
                     "slowdown": with_coll / alone, "allgather_us": coll_us,
                     "allgather_busbw_gbs": algbw_gbs(sizing.message_bytes, coll_us)
                     * bus_factor("all-gather", 2), "replays": replays,
                     "blocks": getattr(bound, "blocks_per_lane", None)})
        del graphs, bound
        torch.cuda.empty_cache()
    return rows


def _predicted() -> dict:
    from purlin.atom.ce import CAPABILITIES, predict
    from purlin.snac import plan

    s = plan(collective("all-reduce"), "two-phase", nbytes=1 * MiB, dtype=DTYPE, chunks=2,
             lanes=2, capabilities=CAPABILITIES)
    t = predict(s, "H200")
    counts = {}
    for e in t.events:
        counts[f"{e.kind}/{e.engine}"] = counts.get(f"{e.kind}/{e.engine}", 0) + 1
    print(f"  {t!r}; events by kind/engine: {counts}")
    return {"label": t.label, "latency_us": t.duration_ns / 1e3, "events": counts}


if __name__ == "__main__":
    sys.exit(main())
